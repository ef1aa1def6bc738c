"""The README's generated tables: the support matrix (from the registries) and the headline
figures (from the result files in ``benchmarks/results/``).

Each table sits in README.md between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``. Run
``python scripts/readme_tables.py`` to rewrite them after a registry or a result file changed;
``--check`` exits 1 when README.md and what the registries and result files say disagree (a
test runs it), so a figure in the README cannot drift from the file it comes from.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# ------------------------------------------------------------------------------------------
# support matrix
# ------------------------------------------------------------------------------------------


def support_matrix() -> str:
    """Target × family, mode and scheme, read from the target, family and scheme registries.

    A family counts for a target when the target builds it and the test suite's tiny models
    cover it (:data:`pit_deploy.tiny.ALL_FAMILIES`); a registered family without tiny export
    tests is shown, with what it is for, but not claimed."""
    from pit_deploy.model.families import families as registered_families
    from pit_deploy.schemes import get_scheme, scheme_names
    from pit_deploy.targets import get_target, target_names
    from pit_deploy.tiny import ALL_FAMILIES

    adapters = {adapter.name: adapter.model_types for adapter in registered_families()}
    families = [name for name in adapters if name in ALL_FAMILIES]
    header = ["target", "runtime", *families, "modes", "schemes", "ARM64 verified (emulated)"]
    arm = _arm_verified()
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in target_names():
        target = get_target(name)
        cells = ["✓" if any(target.supports_family(t) for t in adapters[f]) else "—" for f in families]
        schemes = [s for s in scheme_names() if target.supports_scheme(get_scheme(s))]
        default = "" if target.default_export else " (opt-in)"
        lines.append(f"| `{name}`{default} | {target.title} | " + " | ".join(cells)
                     + f" | {', '.join(target.modes)} | {', '.join(f'`{s}`' for s in schemes)} | {arm(name, target)} |")
    untested = [f"{name} ({', '.join(adapters[name])})" for name in adapters if name not in ALL_FAMILIES]
    covers = {adapter.name: adapter.covers for adapter in registered_families()}
    family_types = " · ".join(f"`{name}` ({', '.join(adapters[name])}): {covers[name]}" for name in families)
    note = (f"\nModel types per family: {family_types}. Every family also exports as the transpose-tied "
            "baseline (`--keep-tying`, mode `tied`).")
    if untested:
        note += (f" Also registered for conversion and training, without export tests: {', '.join(untested)}.")
    return "\n".join(lines) + "\n" + note


def _arm_verified() -> Any:
    """The "ARM64 verified" cell of a target: the default model's rows that pass in
    ``benchmarks/results/verify_aarch64.json`` (dtype and CPU profiles), else what the test suite
    checks on aarch64 for it, else why it cannot run emulated."""
    path = RESULTS / "verify_aarch64.json"
    rows = _load(path.name)["rows"] if path.is_file() else []

    def cell(name: str, target: Any) -> str:
        if target.aarch64_layout is None:
            return "—"
        passed: dict[str, list[str]] = {}
        for r in rows:
            key = re.fullmatch(rf"{re.escape(name)}-(?:factorized|materialized|tied)-?(.*)", r["artifact"])
            if key and r["checked"] and r["passed"]:
                cpus = passed.setdefault(key.group(1) or "fp32", [])
                if r["arm_cpu"] not in cpus:
                    cpus.append(r["arm_cpu"])
        parts = [f"default model {d} on {', '.join(f'`{c}`' for c in cpus)}"
                 for d, cpus in passed.items()]
        if parts:
            return "; ".join(parts) + f" ([table]({_rel(path)}))"
        return "tiny models in the test suite"
    return cell


# ------------------------------------------------------------------------------------------
# headline figures
# ------------------------------------------------------------------------------------------


def _load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))


def _kl(row: dict[str, Any]) -> str:
    return " / ".join(f"{row[kind]['kl_mean']:.3f}" for kind in ("code", "prose", "chat"))


def _decode(rows: list[dict[str, Any]], artifact: str) -> str:
    found = {r["threads"]: r["decode_ms_per_token"] for r in rows if r["artifact"] == artifact}
    return " / ".join(f"{found[t]:.2f}" if t in found else "—" for t in (1, 2))


def headline_figures() -> str:
    """One row per int4 artifact a user would choose between (ours and the peers), with the
    held-out KL from ``int4_quality_peers.json`` and the decode time from ``pte_anchors.json``;
    then the training cost from ``train_pit_vs_tt_cpu.json``."""
    quality_file, speed_file, train_file = ("int4_quality_peers.json", "pte_anchors.json",
                                            "train_pit_vs_tt_cpu.json")
    quality, speed, train = _load(quality_file), _load(speed_file), _load(train_file)
    q = {r["artifact"]: r for r in quality["rows"]}
    link_q = f"[quality]({_rel(RESULTS / quality_file)})"
    link_s = f"[speed]({_rel(RESULTS / speed_file)})"
    #: (label, row in the quality file, row in the speed file or None)
    rows: list[tuple[str, str, str | None]] = [
        ("PIT int4 `.pte`, ExecuTorch (`pit-deploy run default`)", "ours:export-int4/executorch-factorized-int4",
         "ours-pte-int4"),
        ("PIT int4 onnxruntime-genai folder (`pit-deploy run default`)", "ours:export-int4/onnx-genai-factorized-int4",
         "ours-genai-int4"),
        ("llama.cpp Q4_K_M (its own quantizer, same source)", "llama.cpp-Q4_K_M", None),
        ("llama.cpp Q4_0 (its own quantizer, same source)", "llama.cpp-Q4_0", "llama.cpp-Q4_0"),
        ("onnxruntime-genai builder int4 (same source)", "genai-builder-int4", "genai-builder-int4"),
    ]
    lines = ["| artifact | size MB | held-out mean KL, code / prose / chat | decode ms/token, 1 / 2 threads | from |",
             "|---|---|---|---|---|"]
    for label, qkey, skey in rows:
        row = q[qkey]
        decode = _decode(speed["rows"], skey) if skey else "—"
        sources = link_q + (f", {link_s}" if skey else "")
        lines.append(f"| {label} | {row['size_mb']:.1f} | {_kl(row)} | {decode} | {sources} |")
    tokens = quality["tokens"]
    ratio = train["interleaved_timing"]["ratio_pit_over_tt"]
    delta = train["runs"]["pit"]["delta_ti_logged_max"]
    note = (f"\nKL is measured against each model's own float32 reference on {tokens['code']} / {tokens['prose']} / "
            f"{tokens['chat']} held-out tokens of code / prose / chat; decode is the median of "
            f"{speed['rounds']} interleaved rounds of {speed['gen_len']} tokens after a {speed['prompt_len']}-token "
            "prompt, the `.pte` in ExecuTorch's stock runner, the onnxruntime-genai folders in "
            "`onnxruntime_genai`'s generator; sizes count the files a runtime loads (ours with "
            "the tokenizer). All on a 2-core x86-64 CPU; compare figures within one file only. "
            f"Training: a PIT step takes {ratio:.2f}× the time of a transpose-tied step on the CPU, and "
            f"`delta_ti` stays at most {delta:.1e} throughout ([training]({_rel(RESULTS / train_file)})).")
    return "\n".join(lines) + "\n" + note


TABLES: dict[str, Callable[[], str]] = {"support-matrix": support_matrix, "headline": headline_figures}


def _block(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- {re.escape(name)}:start -->\n)(.*?)(<!-- {re.escape(name)}:end -->)", re.S)


def render(text: str) -> str:
    """``text`` (README.md) with every generated table replaced by what it should be now."""
    for name, make in TABLES.items():
        pattern = _block(name)
        if not pattern.search(text):
            raise SystemExit(f"error: README.md has no <!-- {name}:start --> … <!-- {name}:end --> block")
        body = make()
        text = pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(3), text, count=1)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md is not up to date")
    args = parser.parse_args(argv)
    text = README.read_text(encoding="utf-8")
    new = render(text)
    if args.check:
        if new != text:
            print("error: README.md's generated tables differ from the registries and result files; "
                  "run `python scripts/readme_tables.py`", file=sys.stderr)
            return 1
        return 0
    if new != text:
        README.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
