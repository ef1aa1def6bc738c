"""Run and time an exported artifact with nothing but its runtime: the standard library,
``numpy`` and ``onnxruntime`` (ONNX) or the ``executorch`` runtime (``.pte``).

This module imports nothing of ``pit_deploy`` (a test checks it), for two reasons:

* the package's own drivers (the ONNX targets' and the ``executorch`` target's) decode through
  :class:`OrtDecoder` and :class:`PteDecoder`, and ``bench`` times them with
  :func:`time_generation` — one implementation for verification, benchmarks and devices;
* ``pit-deploy bench --bundle`` copies this file, unchanged, into a tarball as
  ``pit_bench_runtime.py`` beside a three-line ``run_bench.py``, so an edge device without this
  package, PyTorch's model code or transformers runs the same cells and writes the same JSON rows
  (``docs/bench.md``, "Edge devices without the toolchain").

Timings exclude tokenization and sampling (ids in, argmax out); one warm-up pass, then
``reps`` measured passes (``docs/conventions.md``, "Benchmark conventions"). Peak memory is
this process's own ``VmHWM``; foreign load is the machine's busy CPU time beside ours.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

BUNDLE_SPEC = "bundle.json"
#: modules whose presence in ``sys.modules`` a cell reports (a bundle must need none of them)
WATCHED_MODULES = ("pit_deploy", "transformers", "optimum", "torch")


# --------------------------------------------------------------------------------------
# Decoders: prefill a prompt from an empty cache, then one token per step
# --------------------------------------------------------------------------------------


def ort_session_options(threads: int | None, config: dict[str, str] | None = None, arena: bool = True):
    """``SessionOptions`` with ``threads`` intra-op threads (``None``: onnxruntime's default),
    the session ``config`` entries (e.g. ``{"mlas.disable_kleidiai": "1"}`` on aarch64) and, with
    ``arena=False``, no CPU memory arena (each run's buffers go back when it ends)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.enable_cpu_mem_arena = arena
    if threads is not None:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    for key, value in (config or {}).items():
        opts.add_session_config_entry(key, value)
    return opts


_ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(bfloat16)": np.float32}


#: onnxruntime-genai's config, beside a builder's decoder (the ``onnx-genai`` target's folders)
GENAI_CONFIG_NAME = "genai_config.json"


def _cache_dims(path: Path, heads: Any, head_dim: Any) -> tuple[int, int]:
    """The KV cache's ``(heads, head_dim)``: from the graph where it declares them, else from the
    ``genai_config.json`` beside it — the onnxruntime-genai builder declares them symbolically."""
    if isinstance(heads, int) and isinstance(head_dim, int):
        return heads, head_dim
    config = path.parent / GENAI_CONFIG_NAME
    if not config.is_file():
        raise ValueError(f"{path}: the KV cache's head count/size are symbolic and there is no {GENAI_CONFIG_NAME} "
                         "beside it to read them from")
    decoder = json.loads(config.read_text())["model"]["decoder"]
    return int(decoder["num_key_value_heads"]), int(decoder["head_size"])


class OrtDecoder:
    """A decoder with a KV cache (the ``.onnx`` file at ``path``) driven by a plain
    ``InferenceSession``: ``input_ids``, ``attention_mask``, optional ``position_ids``, and
    ``past_key_values.N.key/value`` in; ``logits`` and ``present.N.key/value`` out. The cache
    is held as numpy arrays between calls. Two layouts take this form: optimum's
    text-generation-with-past graph and the onnxruntime-genai builder's (no ``position_ids``:
    its ``GroupQueryAttention`` derives positions from ``attention_mask``, the way genai feeds it;
    the cache's dimensions symbolic, read from its ``genai_config.json``)."""

    def __init__(self, path: str | Path, threads: int | None = None, config: dict[str, str] | None = None,
                 arena: bool = True) -> None:
        import onnxruntime as ort

        self.session = ort.InferenceSession(str(path),
                                            sess_options=ort_session_options(threads, config, arena),
                                            providers=["CPUExecutionProvider"])
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.has_positions = "position_ids" in inputs
        self.past_names = [n for n in inputs if n.startswith("past_key_values.")]
        self.empty_past = {}
        for name in self.past_names:
            meta = inputs[name]
            _, heads, _, head_dim = meta.shape
            heads, head_dim = _cache_dims(Path(path), heads, head_dim)
            self.empty_past[name] = np.zeros((1, heads, 0, head_dim), dtype=_ORT_DTYPES.get(meta.type, np.float32))
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.present_to_past = {n: n.replace("present.", "past_key_values.", 1)
                                for n in self.output_names if n.startswith("present.")}
        self.past = dict(self.empty_past)
        self.length = 0

    def _run(self, ids: np.ndarray, start: int) -> np.ndarray:
        feed = {"input_ids": ids[None].astype(np.int64),
                "attention_mask": np.ones((1, start + len(ids)), dtype=np.int64), **self.past}
        if self.has_positions:
            feed["position_ids"] = np.arange(start, start + len(ids), dtype=np.int64)[None]
        outputs = dict(zip(self.output_names, self.session.run(self.output_names, feed)))
        self.past = {self.present_to_past[k]: v for k, v in outputs.items() if k in self.present_to_past}
        self.length = start + len(ids)
        return outputs["logits"][0]

    def prefill(self, ids: Any) -> np.ndarray:
        """Logits ``(S, V)`` of ``ids`` from an empty cache."""
        self.past = dict(self.empty_past)
        return self._run(np.asarray(ids, dtype=np.int64), 0)

    def step(self, token: int, pos: int) -> np.ndarray:
        """Logits ``(V,)`` of ``token`` at position ``pos`` (= tokens already cached)."""
        if pos != self.length:
            raise ValueError(f"step at position {pos}, but {self.length} tokens are cached")
        return self._run(np.array([token], dtype=np.int64), pos)[-1]

    def close(self) -> None:
        self.session = None
        self.past = {}


def set_executorch_threads(threads: int | None) -> None:
    """Resize ExecuTorch's shared CPU threadpool (used by XNNPACK) to ``threads``."""
    if threads is None:
        return
    from executorch.extension.pybindings import portable_lib

    portable_lib._unsafe_reset_threadpool(int(threads))


def load_llm_custom_ops() -> bool:
    """Register the kernels of ExecuTorch's non-core ops that the exported programs call with
    the runtime of this process: the LLM custom ops (``llama::update_cache``,
    ``llama::custom_sdpa``) of the Llama-style decoders, and the quantized embedding
    (``quantized_decomposed::embedding_byte``) of quantized programs. They live in the
    ``executorch`` wheel's ``extension/llm/custom_ops`` and ``kernels/quantized`` libraries,
    which the runtime does not load by itself; importing the modules loads them. Returns
    whether both could be loaded."""
    loaded = True
    try:
        from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401
    except Exception:  # noqa: BLE001 — an install without them: programs that need them fail to load
        loaded = False
    try:
        import executorch.kernels.quantized  # noqa: F401
    except Exception:  # noqa: BLE001 — as above
        loaded = False
    return loaded


def pte_data_file(pte: str | Path) -> Path | None:
    """The named data file beside a ``.pte`` (``model.pte`` → ``model.ptd``): a program that keeps
    its constants outside the ``.pte`` (a shared token table) loads only with it."""
    data = Path(pte).with_suffix(".ptd")
    return data if data.is_file() else None


def load_pte_program(path: str | Path, threads: int | None = None) -> tuple[Any, bool]:
    """``(program, whether the LLM custom ops loaded)`` of a ``.pte`` (with its named data file,
    if there is one beside it), on ``threads`` threads. No method is loaded yet."""
    from executorch.runtime import Runtime

    set_executorch_threads(threads)
    have_ops = load_llm_custom_ops()
    data = pte_data_file(path)
    return Runtime.get().load_program(str(path), data_path=None if data is None else str(data)), have_ops


class PteDecoder:
    """A ``.pte`` program's ``forward(tokens [1, S], input_pos [1])`` over the static KV cache in
    the program's mutable buffers (the ExecuTorch LLM runner's convention). The program returns
    the last position's logits (``[1, 1, V]``; programs exported before that returned
    ``[1, S, V]``); :meth:`prefill` still gives every position's."""

    def __init__(self, path: str | Path, threads: int | None = None) -> None:
        self.program, have_ops = load_pte_program(path, threads)
        try:
            self.forward = self.program.load_method("forward")
        except RuntimeError as exc:
            hint = "" if have_ops else (" — this program may use ExecuTorch's LLM custom ops "
                                        "(llama::update_cache, llama::custom_sdpa) or its quantized embedding "
                                        "kernel, which could not be loaded")
            raise RuntimeError(f"{exc}{hint}") from None

    def _run(self, ids: list[int], pos: int):
        import torch  # the executorch runtime's tensor type

        out = self.forward.execute([torch.tensor([ids], dtype=torch.long), torch.tensor([pos], dtype=torch.long)])
        return out[0][0].clone()  # outputs may live in planned memory that the next call reuses

    def prefill(self, ids: Any):
        """Logits ``[S, V]`` of every position of a prompt prefilled from position 0.

        The whole prompt goes through ``forward`` in one call, as the stock runner prefills
        (the last row, and the KV cache of every position, come from that call); a program that
        returns only the last row is then stepped through positions ``0 … S−2`` one token at a
        time over that cache (the attention of a step at position ``j`` reads positions ``≤ j``
        only), which gives each earlier position's logits on the runtime's decode path."""
        import torch  # the executorch runtime's tensor type

        ids = [int(i) for i in ids]
        last = self._run(ids, 0)
        if last.shape[0] == len(ids):
            return last
        rows = [self._run([token], pos)[-1] for pos, token in enumerate(ids[:-1])]
        return torch.stack([*rows, last[-1]])

    def prefill_last(self, ids: Any):
        """Logits ``[V]`` of the prompt's last position: one ``forward`` call, as the stock runner."""
        return self._run([int(i) for i in ids], 0)[-1]

    def step(self, token: int, pos: int):
        return self._run([int(token)], pos)[-1]

    def close(self) -> None:
        self.forward = None
        self.program = None


#: the decoders of this file by class name: a bundle's spec names the one each artifact needs
DECODERS: dict[str, Callable[..., Any]] = {"OrtDecoder": OrtDecoder, "PteDecoder": PteDecoder}


# --------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------


#: the shortest interval, in clock ticks, whose foreign load is reported (``LoadWindow.foreign_cores``)
MIN_LOAD_TICKS = 50


def _machine_busy_s() -> float | None:
    """CPU seconds all cores spent not idle since boot (``/proc/stat``), or ``None``."""
    stat = Path("/proc/stat")
    if not stat.is_file():
        return None
    values = [int(v) for v in stat.read_text().splitlines()[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return (sum(values[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


@dataclass
class LoadWindow:
    """A measured interval: wall time, the machine's busy CPU time, this process's CPU time."""

    wall_s: float = 0.0
    machine_busy_s: float | None = None
    process_cpu_s: float = 0.0

    @property
    def foreign_cores(self) -> float | None:
        """Average number of cores other processes kept busy during the interval, at most the
        machine's cores. ``None`` for an interval shorter than :data:`MIN_LOAD_TICKS` clock
        ticks: the kernel counts busy time in ticks (10 ms at 100 Hz) per core, so over a few
        milliseconds the figure is mostly rounding (it could exceed the cores there are)."""
        if self.machine_busy_s is None or self.wall_s <= 0:
            return None
        if self.wall_s * os.sysconf("SC_CLK_TCK") < MIN_LOAD_TICKS:
            return None
        cores = float(os.cpu_count() or 1)
        return min(cores, max(0.0, self.machine_busy_s - self.process_cpu_s) / self.wall_s)


class measure_load:
    """``with measure_load() as w: ...`` fills ``w`` (a :class:`LoadWindow`) on exit."""

    def __enter__(self) -> LoadWindow:
        self.window = LoadWindow()
        self._t, self._busy, self._cpu = time.perf_counter(), _machine_busy_s(), _own_cpu_s()
        return self.window

    def __exit__(self, *exc: object) -> None:
        w = self.window
        w.wall_s = time.perf_counter() - self._t
        busy = _machine_busy_s()
        w.machine_busy_s = None if busy is None or self._busy is None else busy - self._busy
        w.process_cpu_s = _own_cpu_s() - self._cpu


def peak_rss_mb() -> float:
    """Peak resident set size of this process's own memory so far, in MiB.

    Linux: ``VmHWM`` of ``/proc/self/status``. ``ru_maxrss`` would be wrong for a benchmark
    cell: Linux carries the parent's resident size at ``fork`` into the child's ``ru_maxrss``
    across ``exec``. Elsewhere ``ru_maxrss`` is the fallback.
    """
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024.0 * 1024.0) if sys.platform == "darwin" else rss / 1024.0


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, linearly interpolated between order statistics;
    NaN for none."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation; NaN for none or for any NaN (an interval below the
    clock's resolution): ``statistics.stdev`` raises on NaN instead of returning it."""
    if not values or any(v != v for v in values):
        return float("nan"), float("nan")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def last_logits(decoder: Any, ids: Any) -> Any:
    """The prompt's last-position logits from a decoder of this file: its ``prefill_last``
    where it has one (a ``.pte`` returns only that row), else the last row of ``prefill``."""
    prefill_last = getattr(decoder, "prefill_last", None)
    return prefill_last(ids) if prefill_last is not None else decoder.prefill(ids)[-1]


def time_generation(decoder: Any, ids: Any, gen_len: int, reps: int) -> dict[str, Any]:
    """Greedy generation of ``gen_len`` tokens after ``ids``: one warm-up, ``reps`` timed
    passes. Returns the timing fields of a benchmark row and the last pass's ``tokens``."""
    prompt_len = len(ids)

    def one_pass() -> tuple[float, list[float], list[int]]:
        start = time.perf_counter()
        token = int(last_logits(decoder, ids).argmax())
        ttft = time.perf_counter() - start
        tokens, step_s, pos = [token], [], prompt_len
        for _ in range(gen_len - 1):
            start = time.perf_counter()
            token = int(decoder.step(token, pos).argmax())
            step_s.append(time.perf_counter() - start)
            tokens.append(token)
            pos += 1
        return ttft, step_s, tokens

    one_pass()  # warm-up
    ttfts: list[float] = []
    steps: list[float] = []
    decode_rates: list[float] = []
    tokens: list[int] = []
    with measure_load() as window:
        for _ in range(reps):
            ttft, step_s, tokens = one_pass()
            ttfts.append(ttft)
            steps += step_s
            if step_s:
                decode_rates.append(len(step_s) / sum(step_s))
    pp, pp_std = mean_std([prompt_len / t for t in ttfts])
    tg, tg_std = mean_std(decode_rates)
    return {
        "prefill_tok_s": pp, "prefill_tok_s_std": pp_std,
        "decode_tok_s": tg, "decode_tok_s_std": tg_std,
        "ttft_ms": statistics.fmean(ttfts) * 1e3,
        "decode_ms_p50": percentile(steps, 0.5) * 1e3, "decode_ms_p90": percentile(steps, 0.9) * 1e3,
        "tokens": tokens,
        "wall_s": window.wall_s, "process_cpu_s": window.process_cpu_s,
        "machine_busy_s": window.machine_busy_s, "foreign_load_cores": window.foreign_cores,
    }


def first_divergence(tokens: list[int], reference: list[int] | None) -> int | None:
    """Index of the first generated token that differs from the reference (``None``: none)."""
    if reference is None:
        return None
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def watched_modules() -> list[str]:
    """Which of :data:`WATCHED_MODULES` this process has imported."""
    return [m for m in WATCHED_MODULES if m in sys.modules]


# --------------------------------------------------------------------------------------
# A bundle on a device: python run_bench.py [--threads 1,2] [--out ROWS.json]
# --------------------------------------------------------------------------------------


def measure_cell(open_decoder: Callable[..., Any], spec: dict[str, Any]) -> dict[str, Any]:
    """One cell: open the artifact with ``open_decoder(folder, threads=...)`` (load time), time
    greedy generation, and report the peak memory of this process before and after."""
    baseline = peak_rss_mb()
    t0 = time.perf_counter()
    decoder = open_decoder(spec["folder"], threads=spec["threads"])
    load_s = time.perf_counter() - t0
    row = time_generation(decoder, spec["prompt_ids"], int(spec["gen_len"]), int(spec["reps"]))
    decoder.close()
    row.update(load_s=load_s, peak_rss_mb=peak_rss_mb(), baseline_rss_mb=baseline)
    return row


def bundle_decoder(decoder: dict[str, str]) -> Callable[..., Any]:
    """The decoder class a bundle's artifact names: ``{"module": ..., "class": ...}``, where the
    module is this file (``pit_bench_runtime``) or another decoder file packed beside it."""
    import importlib

    module = sys.modules[__name__] if decoder["module"] in (__name__, "pit_bench_runtime") \
        else importlib.import_module(decoder["module"])
    return getattr(module, decoder["class"])


def run_bundle_cell(spec: dict[str, Any]) -> dict[str, Any]:
    """One cell of a bundle (in its own process), through the decoder its artifact names,
    opened on the artifact's file."""
    cls = bundle_decoder(spec["decoder"])
    opened = lambda folder, threads: cls(Path(folder) / spec["file"], threads=threads)  # noqa: E731
    return {**measure_cell(opened, spec), "imported": watched_modules()}


def _int_list(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers ≥ 1 separated by commas, got {text!r}")
    return values


def bundle_main(argv: list[str] | None = None, root: str | Path | None = None) -> int:
    """``run_bench.py``: every artifact of the bundle × thread count, each cell in its own
    process; writes ``{"rows": [...], "prompts": ..., "machine": ...}`` (the rows of
    ``pit-deploy bench --json``), which ``pit-deploy bench --ingest`` reads."""
    root = Path(root or Path(sys.argv[0]).resolve().parent)
    if not (root / BUNDLE_SPEC).is_file():
        print(f"error: {root / BUNDLE_SPEC} is missing: run run_bench.py from an unpacked bundle "
              "(pit-deploy bench DIR --bundle OUT.tar.gz)", file=sys.stderr)
        return 2
    spec = json.loads((root / BUNDLE_SPEC).read_text(encoding="utf-8"))
    p = argparse.ArgumentParser(prog="run_bench.py", description=bundle_main.__doc__)
    p.add_argument("--threads", type=_int_list, default=spec["threads"], help="e.g. 1,2,4")
    p.add_argument("--reps", type=int, default=spec["reps"])
    p.add_argument("--out", default="bench_rows.json", help="where the JSON rows go")
    p.add_argument("--cell", default=None, help=argparse.SUPPRESS)  # internal: run one cell
    args = p.parse_args(argv)
    if args.cell:
        print(json.dumps(run_bundle_cell(json.loads(Path(args.cell).read_text(encoding="utf-8")))))
        return 0
    for art in spec["artifacts"]:  # a bundle only ever opens its own files
        for key in ("folder", "file"):
            rel = art.get(key)
            if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel or ":" in rel \
                    or any(part in ("", ".", "..") for part in rel.split("/")):
                print(f"error: {root / BUNDLE_SPEC}: {art.get('artifact')!r} {key} {rel!r} is not a plain relative path "
                      "inside the bundle; re-make the bundle with `pit-deploy bench DIR --bundle OUT.tar.gz`",
                      file=sys.stderr)
                return 2
    missing = {a["runtime"]: a["requires"] for a in spec["artifacts"] if not _installed(a["requires"]["module"])}
    if missing:
        print(f"error: the bundle needs the {' and '.join(sorted(missing))} runtime(s): pip install "
              + " ".join(dict.fromkeys(r["pip"] for r in missing.values())), file=sys.stderr)
        return 2
    rows = []
    cells = [(a, t) for a in spec["artifacts"] for t in args.threads]
    for i, (art, threads) in enumerate(cells, 1):
        print(f"[{i}/{len(cells)}] {art['artifact']} threads={threads}", file=sys.stderr, flush=True)
        cell = {"runtime": art["runtime"], "decoder": art["decoder"], "file": art["file"],
                "folder": str(root / art["folder"]), "threads": threads,
                "prompt_ids": spec["prompts"][art["prompt"]], "gen_len": spec["gen_len"], "reps": args.reps}
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
            json.dump(cell, fh)
        try:
            proc = subprocess.run([sys.executable, str(Path(sys.argv[0]).resolve()), "--cell", fh.name],
                                  capture_output=True, text=True)
        finally:
            os.unlink(fh.name)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            print(f"error: {art['artifact']} failed (exit {proc.returncode}): {proc.stderr[-1500:]}", file=sys.stderr)
            return 3
        measured = json.loads(lines[-1])
        tokens = measured.pop("tokens")
        rows.append({**art["meta"], "threads": threads, **measured,
                     "first_divergence": first_divergence(tokens, spec["reference_tokens"].get(art["prompt"]))})
    machine = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
               "cpu_count": os.cpu_count(), "python": platform.python_version(), "bundle": spec.get("name")}
    Path(args.out).write_text(json.dumps({"rows": rows, "prompts": spec["prompts"], "machine": machine,
                                          "warnings": spec.get("warnings", [])}, indent=2) + "\n")
    print(f"wrote {len(rows)} row(s) to {args.out}", file=sys.stderr)
    return 0


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
