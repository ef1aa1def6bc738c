"""``pit-deploy bench``: latency, memory and size of exported artifacts on this machine.

For every artifact of every export directory (and an optional PyTorch eager row), for every
thread count and prompt length, one *cell* runs in its own process
(:mod:`.bench_cell`) on the same fixed prompt token ids: load time, one warm-up pass, then
``reps`` passes of prefill (``pp<P>`` tokens/s, time to first token) and greedy decode
(``tg<N>`` tokens/s, ms/token median and p90), peak resident memory of that process, size on
disk, the machine's foreign load during the measurement, and the first generated token where
the artifact's greedy output diverges from the PyTorch reference. Conventions:
``docs/conventions.md`` ("Benchmark conventions"); usage and measured figures: ``docs/bench.md``.
"""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import PitError
from ..io.fs import check_output_file, confined, json_text
from ..io.manifest import REFERENCE_DIR, Manifest
from ..options import opt
from ..runtime.standalone import first_divergence
from ..targets import get_target
from .bench_rows import (ROW_FIELDS, check_context, export_names, printable, reference_positions, row_problem,
                         verification_state)

Progress = Callable[[str], None]
PROMPT_SEED = 1234
#: upper limits of what a benchmark may ask for (a typo of 100000 would otherwise run for hours)
MAX_THREADS, MAX_TOKENS, MAX_REPS = 256, 32768, 1000


@dataclass(frozen=True)
class BenchOptions:
    """What to measure (validated on construction): the one declaration of these options.

    ``pit-deploy bench``'s flags are generated from these fields (``--torch``, ``--threads``,
    ``--prompt-len``, ``--gen-len``, ``--reps``), :func:`pit_deploy.bench` takes its keyword
    defaults from them, and a run recipe's ``[bench]`` table defaults to them
    (:func:`run_table_defaults`). ``--threads`` and ``--prompt-len`` take their comma list as
    text, parsed by :func:`int_list`, so a bad value is one ``error:`` line naming the flag."""

    torch_model: str | None = opt(None, "also measure this model in PyTorch eager", flag="--torch")
    threads: tuple[int, ...] = opt((1,), "comma list of thread counts (default 1)", parse="str")
    prompt_lens: tuple[int, ...] = opt((64,), "comma list of prompt lengths (default 64)", flag="--prompt-len",
                                       parse="str", metavar="PROMPT_LEN")
    gen_len: int = opt(128, "tokens generated per pass (default 128)")
    reps: int = opt(5, "measured passes after one warm-up (default 5)")
    cell_timeout_s: float = opt(3600.0, cli=False)

    def __post_init__(self) -> None:
        for name, values, top in (("threads", self.threads, MAX_THREADS), ("prompt length", self.prompt_lens, MAX_TOKENS)):
            if not values or any(not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= top for v in values):
                raise PitError(f"{name} must be integers from 1 to {top}, got {list(values)}")
        if not isinstance(self.gen_len, int) or not 2 <= self.gen_len <= MAX_TOKENS:
            raise PitError(f"--gen-len must be from 2 (one prefill token and one decode step) to {MAX_TOKENS}, "
                           f"got {self.gen_len}")
        if not isinstance(self.reps, int) or not 1 <= self.reps <= MAX_REPS:
            raise PitError(f"--reps must be from 1 to {MAX_REPS}, got {self.reps}")


def int_list(value: Any, flag: str) -> tuple[int, ...]:
    """``"1,2"``, ``2`` or ``[1, 2]`` as a tuple of integers (checked by :class:`BenchOptions`).

    Raises:
        PitError: text that is not comma-separated integers (naming ``flag``).
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, str):
        try:
            return tuple(int(x) for x in value.split(",") if x.strip())
        except ValueError:
            raise PitError(f"{flag} takes comma-separated integers, got {value!r}") from None
    return tuple(value)


def run_table_defaults() -> dict[str, Any]:
    """The defaults of a run recipe's ``[bench]`` keys: ``pit-deploy bench``'s own (a run
    measures one prompt length, so ``prompt_len`` is one number)."""
    d = BenchOptions()
    return {"threads": list(d.threads), "prompt_len": d.prompt_lens[0], "gen_len": d.gen_len, "reps": d.reps}


def bench_options(table: dict[str, Any]) -> BenchOptions:
    """The options of a run recipe's ``[bench]`` table (``threads``, ``prompt_len``, ``gen_len``, ``reps``;
    a key it lacks takes :func:`run_table_defaults`)."""
    table = {**run_table_defaults(), **table}
    threads = table["threads"] if isinstance(table["threads"], (list, tuple)) else [table["threads"]]
    return BenchOptions(threads=tuple(threads), prompt_lens=(table["prompt_len"],), gen_len=table["gen_len"],
                        reps=table["reps"])


@dataclass
class BenchResult:
    """Rows (one per cell), the prompt ids used, and PIT/TT ratios; prints, serializes, plots."""

    rows: list[dict[str, Any]]
    prompts: dict[str, list[int]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)

    def ratios(self) -> list[dict[str, Any]]:
        """PIT/TT ratios for rows that differ only in tying (same runtime, dtype, threads, P)."""
        out = []
        def pair(r: dict[str, Any]) -> tuple:
            return r["runtime"], r.get("scheme") or r["dtype"], r["threads"], r["prompt_len"]

        tied = {pair(r): r for r in self.rows if r["tying"] == "tied"}
        for r in self.rows:
            if r["tying"] != "pit":
                continue
            t = tied.get(pair(r))
            if t is None:
                continue
            out.append({
                "artifact": r["artifact"], "baseline": t["artifact"], "runtime": r["runtime"], "threads": r["threads"],
                "prompt_len": r["prompt_len"], "variant": r.get("variant"),
                "decode_time_ratio": _ratio(t["decode_tok_s"], r["decode_tok_s"]),
                "prefill_time_ratio": _ratio(t["prefill_tok_s"], r["prefill_tok_s"]),
                "rss_ratio": _ratio(r["peak_rss_mb"], t["peak_rss_mb"]),
                "size_ratio": _ratio(r["size_mb"], t["size_mb"]),
            })
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "ratios": self.ratios(), "prompts": self.prompts,
                "warnings": self.warnings, "machine": self.machine}

    def to_json(self, **kw: Any) -> str:
        return json_text(self.to_dict(), **kw)

    def __str__(self) -> str:
        head = (f"| {'artifact':<44} | {'threads':>7} | {'test':>6} | {'t/s':>16} | {'ttft ms':>8} | "
                f"{'p50 ms':>7} | {'p90 ms':>7} | {'load s':>6} | {'RSS MB':>7} | {'size MB':>7} | verified |")
        lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
        for r in self.rows:
            variant = f" {r['variant']}" if r.get("variant") else ""
            name = printable(f"{r['artifact']} ({r.get('scheme') or r['dtype']}{variant})")[:44]
            ok = {True: "yes", False: "FAILED", None: "no"}.get(r.get("verified"), "?")
            for test, mean, std in ((f"pp{r['prompt_len']}", r["prefill_tok_s"], r.get("prefill_tok_s_std")),
                                    (f"tg{r['gen_len']}", r["decode_tok_s"], r.get("decode_tok_s_std"))):
                lines.append(
                    f"| {name:<44} | {r['threads']:>7} | {test:>6} | {_fig(mean, '8.2f')} ± {_fig(std, '5.2f')} | "
                    f"{_fig(r['ttft_ms'], '8.1f')} | {_fig(r['decode_ms_p50'], '7.2f')} | {_fig(r['decode_ms_p90'], '7.2f')} | "
                    f"{_fig(r['load_s'], '6.2f')} | {_fig(r['peak_rss_mb'], '7.0f')} | {_fig(r['size_mb'], '7.1f')} | "
                    f"{ok:>8} |")
        for q in self.ratios():
            runner = f", {q['variant']}" if q.get("variant") else ""
            lines.append(f"PIT/TT {q['artifact']} vs {q['baseline']} ({q['threads']} threads, pp{q['prompt_len']}{runner}): "
                         f"decode time ×{_fig(q['decode_time_ratio'], '.3f')}, prefill time "
                         f"×{_fig(q['prefill_time_ratio'], '.3f')}, RSS ×{_fig(q['rss_ratio'], '.3f')}, "
                         f"size ×{_fig(q['size_ratio'], '.4f')}")
        foreign = [r["foreign_load_cores"] for r in self.rows if r.get("foreign_load_cores") is not None]
        if foreign:
            lines.append(f"foreign load during the measurements: {min(foreign):.2f}–{max(foreign):.2f} cores busy "
                         f"with other processes (of {os.cpu_count()})")
        lines += [f"WARNING: {w}" for w in self.warnings]
        return "\n".join(printable(line) for line in lines)  # rows read from files may hold escape sequences

    def plot(self, path: str | Path) -> Path:
        """Decode and prefill tokens/s per artifact and thread count, size beside."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from ..analysis.plotting import image_file

        labels = [f"{r['artifact']}\n{r['dtype']} t{r['threads']} p{r['prompt_len']}" for r in self.rows]
        fig, axes = plt.subplots(1, 3, figsize=(15, 0.5 * len(labels) + 2), sharey=True)

        def value(v: Any) -> float:  # a figure that was not measured (null) is not drawn
            return math.nan if v is None else v

        for ax, key, title in ((axes[0], "decode_tok_s", "decode tokens/s"), (axes[1], "prefill_tok_s", "prefill tokens/s"),
                               (axes[2], "size_mb", "size on disk (MB)")):
            ax.barh(range(len(labels)), [value(r[key]) for r in self.rows],
                    xerr=[value(r.get(key + "_std", 0.0)) for r in self.rows] if key != "size_mb" else None)
            ax.set_title(title)
            ax.grid(axis="x", alpha=0.3)
        axes[0].set_yticks(range(len(labels)), labels, fontsize=7)
        fig.tight_layout()
        path = image_file(path)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def _fig(value: Any, spec: str) -> str:
    """A figure of the table: ``-`` where none was measured (``null`` in rows read from JSON)."""
    return format(value, spec) if isinstance(value, (int, float)) else format("-", f">{spec.split('.')[0] or 1}")


def _ratio(a: Any, b: Any) -> float:
    """``a / b``, NaN (``null`` in JSON) when either was not measured or ``b`` is 0."""
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else math.nan


# --------------------------------------------------------------------------------------
# Prompts and references
# --------------------------------------------------------------------------------------


def prompt_ids(tokenizer: Any, vocab: int, length: int) -> list[int]:
    """``length`` fixed token ids: the default corpus's first held-out document tokenized with
    ``tokenizer`` (repeated if short), or seeded random ids below ``vocab`` without one."""
    if tokenizer is not None:
        from ..data.corpus import DataConfig, TextSource

        cfg = DataConfig(spec="default")
        for doc in TextSource(cfg).val_documents():
            text = doc.text or ((doc.prompt or "") + (doc.completion or ""))
            ids = list(tokenizer(text)["input_ids"])
            if ids:
                while len(ids) < length:
                    ids += ids
                return ids[:length]
    import random

    rng = random.Random(PROMPT_SEED)
    return [rng.randrange(vocab) for _ in range(length)]


def prompt_text(tokenizer: Any, vocab: int, length: int) -> tuple[str, list[int]]:
    """The text the stock LLM runner (``llama_main``, ``TextLLMRunner``) is given: the fixed prompt ids of :func:`prompt_ids` (the
    default corpus's first held-out document, ``length`` tokens), decoded back to text with
    the export's tokenizer, since the stock runner takes text, not ids."""
    ids = prompt_ids(tokenizer, vocab, length)
    return tokenizer.decode(ids, skip_special_tokens=True), ids


def reference_tokens(reference_dir: Path, ids: list[int], gen_len: int) -> list[int]:
    """The PyTorch reference's greedy tokens for ``ids`` (what every artifact should produce)."""
    import torch

    from ..runtime.base import greedy
    from ..runtime.torch_driver import TorchDriver

    with TorchDriver(reference_dir) as driver:
        return greedy(driver, torch.tensor(ids, dtype=torch.long), gen_len)


# --------------------------------------------------------------------------------------
# Cells
# --------------------------------------------------------------------------------------


def run_cell_process(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one cell in a fresh interpreter; raise :class:`PitError` on its unusable input."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(spec, fh)
        path = fh.name
    try:
        proc = subprocess.run([sys.executable, "-m", "pit_deploy.evaluate.bench_cell", path],
                              capture_output=True, text=True, timeout=timeout, env=_cell_env())
    finally:
        os.unlink(path)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if not lines:
        raise RuntimeError(f"benchmark cell for {spec['label']} died (exit {proc.returncode}): {proc.stderr[-1500:]}")
    row = json.loads(lines[-1])
    if "error" in row:
        raise PitError(f"{spec['label']}: {row['error']}")
    return row


def _cell_env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return env


def plan_cells(directories: Sequence[str | Path], opts: BenchOptions) -> tuple[list[dict[str, Any]], dict[str, list[int]], list[str]]:
    """Every cell to run (validated before anything is measured), the prompts, the warnings."""
    from ..io.sources import maybe_tokenizer

    cells, prompts, warnings = [], {}, []
    manifests = [(Path(d), Manifest.read(d)) for d in directories]  # every manifest is read before any work
    for (directory, manifest), name in zip(manifests, export_names(directories)):
        tokenizer = maybe_tokenizer(directory / REFERENCE_DIR, True, False)
        positions = reference_positions(directory)
        for art in manifest.artifacts:
            target = get_target(art.target)
            target.driver_class()  # an uninstalled runtime is unusable input, before any work
            target.check_files(directory, art)  # what the runtime opens is a file the digests cover
            label = f"{name}/{art.path}"
            check_context(label, art, opts, positions)
            verified = verification_state(manifest, art, label, directory, warnings)
            for p in opts.prompt_lens:
                ids = prompt_ids(tokenizer, art.shapes["vocab_size"], p)
                prompts[f"{name}:{p}"] = ids
                for t in opts.threads:
                    cells.append({
                        "label": label, "export": name, "prompt_key": f"{name}:{p}",
                        "folder": str(directory / art.path), "files": list(art.files), "runtime": art.target,
                        "target": art.target, "driver": target.driver, "threads": t, "prompt_ids": ids,
                        "gen_len": opts.gen_len,
                        "reps": opts.reps,
                        "meta": {"artifact": label, "runtime": art.target, "mode": art.mode, "dtype": art.dtype,
                                 "scheme": art.scheme_name,
                                 "tying": getattr(art, "tying", "pit"), "threads": t, "prompt_len": p,
                                 "gen_len": opts.gen_len, "size_mb": art.bytes / 1e6, "verified": verified},
                        "reference": str(directory / REFERENCE_DIR),
                    })
                cells += target.bench_cells(cells[-1], tokenizer, art.shapes["vocab_size"], p, opts.threads,
                                            directory / art.path)
    if opts.torch_model:
        from ..io.sources import load_source

        loaded = load_source(opts.torch_model)
        vocab = loaded.model.config.vocab_size
        from ..model.families import max_positions

        check_context(f"torch:{opts.torch_model}", None, opts, max_positions(loaded.model.config))
        size = _torch_size_mb(opts.torch_model)
        for p in opts.prompt_lens:
            ids = prompt_ids(loaded.tokenizer, vocab, p)
            prompts[f"torch:{p}"] = ids
            for t in opts.threads:
                cells.append({
                    "label": f"torch:{opts.torch_model}", "folder": opts.torch_model, "runtime": "torch", "threads": t,
                    "prompt_ids": ids, "gen_len": opts.gen_len, "reps": opts.reps,
                    "meta": {"artifact": f"torch:{Path(opts.torch_model).name}", "runtime": "torch", "mode": "eager",
                             "dtype": "float32", "tying": "pit" if loaded.is_pit else "tied", "threads": t,
                             "prompt_len": p, "gen_len": opts.gen_len, "size_mb": size, "verified": None},
                    "reference": None,
                })
        del loaded
    return cells, prompts, warnings


def _torch_size_mb(spec: str) -> float:
    path = Path(spec)
    if spec == "default":
        from ..io.sources import default_gguf_path

        path = default_gguf_path()
    if path.is_file():
        return path.stat().st_size / 1e6
    if path.is_dir():
        return sum(p.stat().st_size for p in path.glob("*.safetensors")) / 1e6
    return math.nan


def bench_directories(directories: Sequence[str | Path], opts: BenchOptions,
                      progress: Progress | None = None) -> BenchResult:
    """Measure every cell (see the module docstring)."""
    import platform

    say = progress or (lambda _m: None)
    if not directories and not opts.torch_model:
        raise PitError("nothing to benchmark: pass export directories and/or --torch MODEL")
    cells, prompts, warnings = plan_cells(directories, opts)
    refs: dict[tuple[str, int], list[int]] = {}
    rows = []
    for i, cell in enumerate(cells, 1):
        meta = cell["meta"]
        say(f"[{i}/{len(cells)}] {meta['artifact']} {meta['dtype']} threads={meta['threads']} "
            f"pp{meta['prompt_len']} tg{meta['gen_len']}")
        if cell.get("variant"):
            row, more = get_target(cell["target"]).measure_variant(cell, opts.cell_timeout_s)
            warnings += more
            if row is None:  # the variant could not be timed: its warning says why
                say(f"    not timed ({cell['variant']}): {more[-1] if more else 'no figures'}")
                continue
            say(f"    pp{meta['prompt_len']} {row['prefill_tok_s']:.1f} tok/s, tg{meta['gen_len']} "
                f"{row['decode_tok_s']:.1f} tok/s, RSS {row['peak_rss_mb']:.0f} MB ({cell['variant']})")
            rows.append(row)
            continue
        measured = run_cell_process(cell, opts.cell_timeout_s)
        ref = None
        if cell["reference"]:
            key = (cell["reference"], meta["prompt_len"])
            if key not in refs:
                refs[key] = reference_tokens(Path(cell["reference"]), cell["prompt_ids"], opts.gen_len)
            ref = refs[key]
        tokens = measured.pop("tokens")
        row = {**meta, **measured, "first_divergence": first_divergence(tokens, ref)}
        if row["first_divergence"] is not None:
            warnings.append(f"{meta['artifact']} ({meta['dtype']}, {meta['threads']} threads): greedy output "
                            f"diverges from the PyTorch reference at generated token {row['first_divergence']}")
        say(f"    pp{meta['prompt_len']} {row['prefill_tok_s']:.1f} tok/s, tg{meta['gen_len']} "
            f"{row['decode_tok_s']:.1f} tok/s, RSS {row['peak_rss_mb']:.0f} MB")
        rows.append(row)
    machine = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
               "cpu_count": os.cpu_count(), "python": platform.python_version()}
    return BenchResult(rows=rows, prompts=prompts, warnings=warnings, machine=machine)


# --------------------------------------------------------------------------------------
# Edge devices without the toolchain: a bundle, and its rows read back
# --------------------------------------------------------------------------------------

BUNDLE_RUNNER = "run_bench.py"
BUNDLE_MODULE = "pit_bench_runtime.py"
_RUNNER_TEXT = '''#!/usr/bin/env python3
"""Benchmark this bundle's artifacts: python run_bench.py [--threads 1,2] [--reps 5] [--out ROWS.json].

Needs numpy + onnxruntime (ONNX artifacts) or the executorch runtime (.pte), nothing else.
Read the rows back with `pit-deploy bench --ingest ROWS.json`."""
import sys

from pit_bench_runtime import bundle_main

sys.exit(bundle_main())
'''


def write_bundle(out: str | Path, directories: Sequence[str | Path], opts: BenchOptions,
                 progress: Progress | None = None, force: bool = False) -> Path:
    """Pack every ONNX/``.pte`` artifact of ``directories`` (the files their manifests list),
    the fixed prompt ids, the PyTorch reference's greedy tokens and a standalone
    ``run_bench.py`` into the tarball ``out`` (written atomically). Each export directory is a
    folder of its own in the bundle (:func:`~.bench_rows.export_names`).

    Raises:
        PitError: nothing to pack, ``--torch`` given (an eager row needs this package), an
            unusable directory, or an ``out`` that exists (without ``force``), is a directory or
            lies in one of ``directories``.
    """
    import tarfile

    from ..io.manifest import plain_relative
    from ..runtime import standalone

    say = progress or (lambda _m: None)
    if opts.torch_model:
        raise PitError("--bundle packs exported artifacts only; a --torch row needs this package (run it here)")
    if not directories:
        raise PitError("--bundle needs export directories to pack")
    out = check_output_file(out, "--bundle", overwrite=force, inputs=directories)
    cells, prompts, warnings = plan_cells(directories, opts)
    artifacts, references, seen, decoder_files = [], {}, set(), {}
    cells = [c for c in cells if not c.get("variant")]  # a target's variants (the stock runner) need more
    for cell in cells:
        meta = cell["meta"]
        target = get_target(cell["target"])
        if target.standalone is None:
            raise PitError(f"{cell['label']}: the {target.name} runtime has no standalone decoder, so it cannot "
                           "run in a bundle")
        module, cls = target.standalone
        stem = BUNDLE_MODULE[:-3]
        if module != standalone.__name__:  # a decoder file of its own, packed beside this one
            stem = decoder_stem(target.module, module)
            path = resolve_module_file(module)
            if decoder_files.setdefault(stem, path) != path:
                raise RuntimeError(f"two standalone decoders would be packed as {stem}.py")
        decoder = {"module": stem, "class": cls}
        prompt = cell["prompt_key"]
        if (cell["label"], prompt) in seen:
            continue
        seen.add((cell["label"], prompt))
        if prompt not in references:
            say(f"reference tokens of {prompt}")
            references[prompt] = reference_tokens(Path(cell["reference"]), cell["prompt_ids"], opts.gen_len)
        artifacts.append({"artifact": meta["artifact"], "runtime": cell["runtime"], "prompt": prompt,
                          "folder": f"artifacts/{cell['label']}", "decoder": decoder, "file": target.primary_path(Path(cell["folder"])),
                          "requires": {"module": target.module, "pip": target.bundle_install or target.package},
                          "meta": {k: v for k, v in meta.items() if k != "threads"}})
    spec = {"name": Path(out).name, "threads": list(opts.threads), "reps": opts.reps, "gen_len": opts.gen_len,
            "prompts": prompts, "reference_tokens": references, "artifacts": artifacts, "warnings": warnings}
    members: dict[str, dict[str, Path]] = {}  # label → member name → the file packed under it
    for cell in cells:
        directory = Path(cell["reference"]).parent
        members[cell["label"]] = {f"pit-bench/artifacts/{cell['export']}/{rel}": confined(directory, rel, "manifest file")
                                  for rel in cell["files"]}
    unsafe = [name for packed in members.values() for name in packed if not plain_relative(name)]
    if unsafe:  # the manifest reader refuses such paths: reaching here is a bug
        raise RuntimeError(f"bundle member names {unsafe[:3]} are not plain relative paths")
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        files = {BUNDLE_RUNNER: _RUNNER_TEXT, BUNDLE_MODULE: Path(standalone.__file__).read_text(encoding="utf-8"),
                 standalone.BUNDLE_SPEC: json_text(spec, indent=2) + "\n",
                 **{f"{stem}.py": path.read_text(encoding="utf-8") for stem, path in decoder_files.items()}}
        with tarfile.open(tmp, "w:gz") as tar:
            for name, text in files.items():
                data = text.encode("utf-8")
                info = tarfile.TarInfo(f"pit-bench/{name}")
                info.size, info.mode, info.mtime = len(data), 0o755 if name == BUNDLE_RUNNER else 0o644, int(time.time())
                tar.addfile(info, io.BytesIO(data))
            for label, packed in members.items():
                say(f"packing {label}")
                for name, path in packed.items():  # the file's content, never a link
                    tar.add(path, arcname=name, recursive=False)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def decoder_stem(runtime_module: str, module: str) -> str:
    """The name a target's own standalone decoder file has in a bundle: the runtime's module
    before the file's own name (``llama_cpp_decoder`` for ``pit_deploy.targets.gguf.decoder``),
    so that the decoders of several targets, each ``decoder.py`` in its folder, lie side by side."""
    return f"{runtime_module}_{module.rsplit('.', 1)[-1]}"


def resolve_module_file(module: str) -> Path:
    """The source file of ``module`` (a target's standalone decoder, packed into bundles)."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        raise PitError(f"the standalone decoder module {module} cannot be found")
    return Path(spec.origin)


def ingest_rows(paths: Sequence[str | Path]) -> BenchResult:
    """The rows written by ``run_bench.py`` (or ``bench --json``) as one :class:`BenchResult`.

    Raises:
        PitError: a missing file, one that is not such a JSON object, or a row with a missing
            key, a value of the wrong type or a non-finite number (exit 2, naming row and key).
    """
    rows, prompts, warnings, machine = [], {}, [], {}
    for path in map(Path, paths):
        if not path.is_file():
            raise PitError(f"--ingest {path}: no such file")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise PitError(f"--ingest {path}: not JSON ({exc})") from None
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            raise PitError(f"--ingest {path}: expected an object with a 'rows' list (what run_bench.py writes)")
        for i, row in enumerate(data["rows"]):
            problem = row_problem(row)
            if problem:
                label = f" ({row['artifact']!r})" if isinstance(row, dict) and isinstance(row.get("artifact"), str) else ""
                raise PitError(f"--ingest {path}: row {i}{label} {problem}; the file is not what run_bench.py or "
                               "`bench --json` writes — measure again")
            rows.append(row)
        for key, kind in (("prompts", dict), ("warnings", list), ("machine", dict)):
            if data.get(key) is not None and not isinstance(data[key], kind):
                raise PitError(f"--ingest {path}: {key!r} must be a {kind.__name__}, got {type(data[key]).__name__}")
        prompts.update(data.get("prompts") or {})
        warnings += [str(w) for w in data.get("warnings") or []]
        machine = data.get("machine") or machine
    return BenchResult(rows=rows, prompts=prompts, warnings=warnings, machine=machine)
