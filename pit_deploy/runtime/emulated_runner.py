"""The emulated side of ``pit-deploy verify --isa aarch64``: replays recorded runtime calls in an
aarch64 Python and writes what onnxruntime's aarch64 kernels returned.

Like :mod:`.standalone` (whose :class:`~.standalone.OrtDecoder` it drives), this module imports
nothing but the standard library, ``numpy`` and ``onnxruntime``: it runs under user-mode emulation
in an arm64 Python that has no PyTorch, transformers or ``pit_deploy`` (``scripts/setup_aarch64.sh``
installs just those wheels). :mod:`pit_deploy.runtime.emulated` copies this file and
``standalone.py`` into a job folder and runs it there as a script. ``.pte`` programs have their
own runner, :mod:`pit_deploy.targets.executorch.emulated_pte_runner`, which shares this file's job format and helpers.

The x86 side does everything else. It records the calls its own verification makes on a driver —
``prefill`` of ids, ``step`` of a token at a position, ``interface`` of ``(vocab, dim)`` — into
``job.json``; this runner makes the same calls, in the same order, on the same graphs, once per
KleidiAI setting, and saves every output to ``<artifact>-<kleidiai>.npz`` (key ``n`` for call
``n``; ``n.emb`` / ``n.head`` for the interface: ``interface`` of every id and basis row,
``interface_rows`` of a sample of each, the compact check's). ``results.json`` says, per artifact and setting,
how long it took and the runtime's error if it failed; it is rewritten after each one so that a
crashed emulator leaves the finished ones readable.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

JOB_NAME = "job.json"
RESULTS_NAME = "results.json"
#: the session config entry that keeps onnxruntime's MLAS off Arm's KleidiAI kernels
KLEIDIAI_OFF = {"mlas.disable_kleidiai": "1"}
_INTERFACE_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def standalone() -> Any:
    """``standalone.py`` from beside this file (the package's, or its copy in a job folder), loaded by
    path: no package import and no ``sys.path`` change, in either place."""
    module = sys.modules.get("pit_emulated_standalone")
    if module is None:
        path = Path(__file__).with_name("standalone.py")
        spec = importlib.util.spec_from_file_location("pit_emulated_standalone", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module


def session_config(kleidiai: str) -> dict[str, str]:
    """The session config entries of a KleidiAI setting (``"on"``: onnxruntime's default)."""
    return {} if kleidiai == "on" else dict(KLEIDIAI_OFF)


def interface_outputs(path: str, layout: str, ids: list[int], rows: list[int], dim: int, threads: int,
                      config: dict[str, str]) -> tuple[np.ndarray, np.ndarray]:
    """The interface graph's embedding of the token ids ``ids`` ``(len(ids), d)`` and head of the
    basis vectors ``rows`` of ``I_d`` ``(len(rows), V)``; ``layout`` ``"batched"`` is the
    onnx-genai folder's (a batch axis, named outputs, the decoder's float type), ``"plain"`` the
    onnx target's."""
    import onnxruntime as ort

    sess = ort.InferenceSession(path, sess_options=standalone().ort_session_options(threads, config),
                                providers=["CPUExecutionProvider"])
    tokens = np.asarray(ids, dtype=np.int64)
    if layout == "batched":
        hidden = np.eye(dim, dtype=_INTERFACE_DTYPES[sess.get_inputs()[1].type])[rows]
        emb, head = sess.run(["embeddings", "head_logits"], {"input_ids": tokens[None], "hidden": hidden[None]})
        return emb[0].astype(np.float32), head[0].astype(np.float32)
    emb, head = sess.run(None, {"input_ids": tokens, "hidden": np.eye(dim, dtype=np.float32)[rows]})
    return np.asarray(emb, np.float32), np.asarray(head, np.float32)


def interface_call(call: list[Any]) -> tuple[list[int], list[int], int]:
    """``(ids, rows, dim)`` of an ``interface`` call (every id, every row) or an
    ``interface_rows`` one (a sample of each), as the x86 side recorded them."""
    if call[0] == "interface":
        vocab, dim = int(call[1]), int(call[2])
        return list(range(vocab)), list(range(dim)), dim
    return [int(i) for i in call[1]], [int(r) for r in call[2]], int(call[3])


def replay(artifact: dict[str, Any], kleidiai: str, threads: int) -> dict[str, np.ndarray]:
    """Make one artifact's recorded calls; ``{key: output}`` as the module docstring names them."""
    config = session_config(kleidiai)
    decoder = None
    out: dict[str, np.ndarray] = {}
    for n, call in enumerate(artifact["calls"]):
        kind = call[0]
        if kind in ("interface", "interface_rows"):
            out[f"{n}.emb"], out[f"{n}.head"] = interface_outputs(
                artifact["interface"], artifact["layout"], *interface_call(call), threads, config)
            continue
        if decoder is None:
            decoder = standalone().OrtDecoder(artifact["decoder"], threads, config)
        if kind == "prefill":
            out[str(n)] = decoder.prefill(np.asarray(call[1], dtype=np.int64))
        elif kind == "step":
            out[str(n)] = decoder.step(int(call[1]), int(call[2]))
        else:
            raise ValueError(f"unknown call {kind!r}")
    if decoder is not None:
        decoder.close()
    return out


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """``python emulated_runner.py JOB_DIR``: replay every artifact of ``JOB_DIR/job.json``."""
    job_dir = Path((sys.argv[1:] if argv is None else argv)[0])
    job = json.loads((job_dir / JOB_NAME).read_text())
    import onnxruntime as ort

    results: dict[str, Any] = {"machine": platform.machine(), "onnxruntime": ort.__version__,
                               "numpy": np.__version__, "runs": []}
    write_json(job_dir / RESULTS_NAME, results)
    for i, artifact in enumerate(job["artifacts"]):
        for kleidiai in artifact.get("kleidiai", job.get("kleidiai", ["on"])):
            start, error = time.perf_counter(), None
            try:
                np.savez(job_dir / f"{i}-{kleidiai}.npz", **replay(artifact, kleidiai, int(job["threads"])))
            except Exception as exc:  # noqa: BLE001 — the runtime's own complaint goes to the report
                said = (str(exc).strip().splitlines() or [""])[0][:300]
                error = f"{type(exc).__name__}: {said}"
            results["runs"].append({"artifact": i, "kleidiai": kleidiai, "seconds": time.perf_counter() - start,
                                    "error": error})
            write_json(job_dir / RESULTS_NAME, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
