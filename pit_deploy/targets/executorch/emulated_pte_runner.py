"""The emulated side of ``pit-deploy verify --isa aarch64`` for ExecuTorch programs: replays the
recorded runtime calls on ``.pte`` programs in an aarch64 Python and writes what the ExecuTorch
runtime's aarch64 kernels (XNNPACK, the portable and LLM custom ops) returned.

The ``.pte`` counterpart of :mod:`pit_deploy.runtime.emulated_runner`, whose job and result files it shares: it
imports the standard library, numpy, and what :class:`~pit_deploy.runtime.standalone.PteDecoder` imports (the
``executorch`` runtime and PyTorch's tensors), and runs as a script in a job folder beside copies
of ``emulated_runner.py`` and ``standalone.py``. It makes the calls the x86 side recorded on the
package's ExecuTorch driver (:mod:`pit_deploy.targets.executorch.driver`), in their order:
``prefill`` and ``step`` through ``PteDecoder`` (the program's ``forward``), ``interface``
through the program's ``embed`` and ``head`` methods in the chunks the job names. Each program
is run once (KleidiAI is an onnxruntime setting) and its outputs saved to ``<artifact>.npz``.

Importing the runtime the usual way also imports ExecuTorch's exporter (``executorch.exir``, and
through it TorchDynamo and Inductor), which under emulation takes minutes; the runtime needs none
of it. :func:`import_runtime` loads only what running a program needs: PyTorch, the runtime's
bindings, and the libraries of the LLM custom ops and the quantized kernels, which register their
kernels with the runtime when loaded.
"""

from __future__ import annotations

import importlib.util
import json
import platform
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np


def _sibling(name: str, module: str) -> Any:
    """``name`` from beside this file, loaded by path (no package import, no ``sys.path`` change)."""
    loaded = sys.modules.get(module)
    if loaded is None:
        spec = importlib.util.spec_from_file_location(module, Path(__file__).with_name(name))
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[module] = loaded
        spec.loader.exec_module(loaded)
    return loaded


def onnx_runner() -> Any:
    """:mod:`pit_deploy.runtime.emulated_runner` (its job format and helpers)."""
    return _sibling("emulated_runner.py", "pit_emulated_runner")


#: the module whose import loads the LLM custom ops' library (what ``PteDecoder`` imports)
CUSTOM_OPS = "executorch.extension.llm.custom_ops.custom_ops"


def import_runtime() -> dict[str, str]:
    """Import the ExecuTorch runtime without its exporter; the versions it runs on.

    ``executorch.exir`` becomes a bare package, so that the one module of it the bindings import
    (``executorch.exir._warnings``) loads alone; the custom ops' library is loaded directly and
    :data:`CUSTOM_OPS` stands for the Python module that would load it (and import Inductor to
    register ahead-of-time lowerings, which running a program does not use)."""
    from importlib.metadata import version

    package = importlib.util.find_spec("executorch")
    if package is None or not package.submodule_search_locations:
        raise ImportError("no executorch package")
    root = Path(list(package.submodule_search_locations)[0])
    if "executorch.exir" not in sys.modules:
        exir = types.ModuleType("executorch.exir")
        exir.__path__ = [str(root / "exir")]
        sys.modules["executorch.exir"] = exir
    import torch
    from executorch.runtime import Runtime  # noqa: F401

    if CUSTOM_OPS not in sys.modules:
        libs = sorted((root / "extension" / "llm" / "custom_ops").glob("*custom_ops_aot_lib.*"))
        if libs:
            torch.ops.load_library(str(libs[0]))
            sys.modules[CUSTOM_OPS] = types.ModuleType(CUSTOM_OPS)
    import executorch.kernels.quantized  # noqa: F401 — loads its library (light)

    return {"executorch": version("executorch"), "torch": torch.__version__}


def _numpy(tensor: Any) -> np.ndarray:
    return tensor.detach().clone().float().numpy()


def interface_outputs(decoder: Any, ids: list[int], rows: list[int], dim: int, ids_chunk: int,
                      rows_chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """The program's embedding of the token ids ``ids`` ``(len(ids), d)`` and head of the basis
    vectors ``rows`` of ``I_d`` ``(len(rows), V)``, through its ``embed`` and ``head`` methods in
    chunks of at most ``ids_chunk`` ids / ``rows_chunk`` rows."""
    import torch  # the executorch runtime's tensor type

    embed, head = decoder.program.load_method("embed"), decoder.program.load_method("head")
    tokens, basis = torch.tensor(ids, dtype=torch.long), torch.eye(dim, dtype=torch.float32)[rows]
    emb = [_numpy(embed.execute([chunk])[0]) for chunk in tokens.split(ids_chunk)]
    out = [_numpy(head.execute([chunk])[0]) for chunk in basis.split(rows_chunk)]
    return np.concatenate(emb), np.concatenate(out)


def replay(artifact: dict[str, Any], threads: int) -> dict[str, np.ndarray]:
    """Make one program's recorded calls; ``{key: output}`` as :mod:`pit_deploy.runtime.emulated_runner` names them."""
    decoder = onnx_runner().standalone().PteDecoder(artifact["decoder"], threads)
    ids_chunk, rows_chunk = (int(n) for n in artifact["interface_chunks"])
    out: dict[str, np.ndarray] = {}
    try:
        for n, call in enumerate(artifact["calls"]):
            kind = call[0]
            if kind in ("interface", "interface_rows"):
                out[f"{n}.emb"], out[f"{n}.head"] = interface_outputs(
                    decoder, *onnx_runner().interface_call(call), ids_chunk, rows_chunk)
            elif kind == "prefill":
                out[str(n)] = _numpy(decoder.prefill([int(i) for i in call[1]]))
            elif kind == "step":
                out[str(n)] = _numpy(decoder.step(int(call[1]), int(call[2])))
            else:
                raise ValueError(f"unknown call {kind!r}")
    finally:
        decoder.close()
    return out


def main(argv: list[str] | None = None) -> int:
    """``python emulated_pte_runner.py JOB_DIR``: replay every program of ``JOB_DIR/job.json``;
    ``python emulated_pte_runner.py --probe``: print the machine, the executorch and torch
    versions and whether PyTorch sees a GPU (what the set-up checks)."""
    args = sys.argv[1:] if argv is None else argv
    versions = import_runtime()  # before anything else: a failure here is a broken set-up
    if args[0] == "--probe":
        import torch

        print(platform.machine(), versions["torch"].split("+")[0], versions["executorch"], torch.cuda.is_available())
        return 0
    runner = onnx_runner()
    job_dir = Path(args[0])
    job = json.loads((job_dir / runner.JOB_NAME).read_text())
    results: dict[str, Any] = {"machine": platform.machine(), **versions, "numpy": np.__version__, "runs": []}
    runner.write_json(job_dir / runner.RESULTS_NAME, results)
    for i, artifact in enumerate(job["artifacts"]):
        start, error = time.perf_counter(), None
        try:
            np.savez(job_dir / f"{i}.npz", **replay(artifact, int(job["threads"])))
        except Exception as exc:  # noqa: BLE001 — the runtime's own complaint goes to the report
            said = (str(exc).strip().splitlines() or [""])[0][:300]
            error = f"{type(exc).__name__}: {said}"
        results["runs"].append({"artifact": i, "kleidiai": None, "seconds": time.perf_counter() - start,
                                "error": error})
        runner.write_json(job_dir / runner.RESULTS_NAME, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
