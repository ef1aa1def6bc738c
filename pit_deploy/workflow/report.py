"""The run report: ``report.md`` and a single-file ``report.html`` (images embedded), written
from the stage records alone, so it can be rebuilt at any time and always says what ran.

What it shows, in the order a person reads it: warnings first (a number that says the model is
not ready), then what was trained, the loss curves, the interface before and after, the parity
of every artifact, latency/memory/size, and greedy answers of the artifact beside the source's.
"""

from __future__ import annotations

import base64
import html
import json
import math
import platform
from pathlib import Path
from typing import Any

from ..io.fs import write_text_atomic
from .recipe import STAGES, RunRecipe
from .stage_records import StageRecord, resolved_outputs, stage_dir

REPORT_NAME = "report.md"  #: the report a run writes (and ``report.html`` beside it)
Block = tuple  # ("h2", text) | ("p", text) | ("table", headers, rows) | ("img", path, alt) | ("pre", text)


def _vs_x86(cross: dict[str, Any] | None) -> str:
    """A compact aarch64 row's comparison with the same artifact on x86 (docs/verify.md)."""
    if not cross:
        return "—"
    if cross.get("kl_bound") is None:
        return f"rel L2 {cross['rel_l2']:.1e}, greedy {'same' if cross['greedy_identical'] else 'DIFFERS'}"
    return f"KL {cross['kl_mean']:.2g} (≤ {cross['kl_bound']:.2g})"


def _fmt(value: Any, spec: str = ".4g") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):  # NaN: not measured (compact aarch64 rows)
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def bench_label(row: dict[str, Any]) -> str:
    """A bench row's artifact, with the variant it was timed through (``(stock runner)``) so
    that two rows of one artifact are told apart."""
    return f"{row['artifact']} ({row['variant']})" if row.get("variant") else str(row["artifact"])


def collect(out: Path) -> dict[str, StageRecord | None]:
    """Every stage's record, its paths resolved against ``out`` (records hold them relative)."""
    records = {stage: StageRecord.read(stage_dir(out, stage), stage) for stage in STAGES}
    for rec in records.values():
        if rec is not None:
            rec.outputs = resolved_outputs(rec.outputs, out)
    return records


def warnings_of(records: dict[str, StageRecord | None], recipe: RunRecipe) -> list[str]:
    """Plain sentences for every number that says the model is not ready."""
    warn: list[str] = []
    for stage, rec in records.items():
        if rec is not None and rec.status == "failed":
            warn.append(f"Stage **{stage}** failed (exit {rec.exit_code}): {rec.error}")
        elif rec is not None and rec.status == "running" and stage != "report":
            warn.append(f"Stage **{stage}** was interrupted before it finished.")
        elif rec is None and stage != "report":
            warn.append(f"Stage **{stage}** has not run.")
    conv = records.get("convert")
    limit = float(recipe["report"]["val_loss_warn_nats"])
    if conv is not None and conv.status == "done":
        src, cvt = conv.outputs.get("source_val_nll"), conv.outputs.get("converted_val_nll")
        final = cvt
        train = records.get("train")
        if train is not None and train.status == "done":
            pit = train.outputs.get("runs", {}).get("pit")
            if pit:
                final = pit["summary"].get("final_val_loss") or final
        if src is not None and final is not None and final > src + limit:
            warn.append(f"The model is not ready: its validation loss is {final:.3f} nats/token against the "
                        f"source model's {src:.3f} (+{final - src:.2f}). A short CPU run does not recover a "
                        "conversion that lost this much; use the source-preserving conversion or train longer.")
    verify = records.get("verify")
    if verify is not None and verify.status == "skipped":
        warn.append("The artifacts were not verified (verify.enabled = false).")
    return warn


def isa_tag(artifact: dict[str, Any]) -> str:
    """`` [aarch64 max, KleidiAI on]`` for a verify row computed on emulated aarch64 kernels
    (``verify.isa``), else ``""``."""
    if artifact.get("isa", "x86_64") == "x86_64":
        return ""
    kleidiai = artifact.get("kleidiai")
    where = ", ".join(x for x in (artifact.get("arm_cpu"), kleidiai and f"KleidiAI {kleidiai}") if x)
    return f" [{artifact['isa']}{' ' + where if where else ''}]"


def _verdict(artifact: dict[str, Any]) -> str:
    if artifact.get("checked", True) is False:
        return "not checked: " + "; ".join(artifact.get("notes") or [])
    return "pass" if artifact["passed"] else "FAIL: " + "; ".join(artifact["failures"])


def build(out: Path, recipe: RunRecipe) -> list[Block]:
    records = collect(out)
    blocks: list[Block] = [("h1", f"pit-deploy run — {recipe.name}")]
    warn = warnings_of(records, recipe)
    blocks.append(("h2", "Warnings"))
    blocks += [("p", "⚠ " + w) for w in warn] or [("p", "None: every stage finished and every figure is within its bound.")]

    conv = records.get("convert")
    train = records.get("train")
    total = sum(r.seconds for r in records.values() if r is not None)
    src = conv.outputs.get("source", {}) if conv else {}
    blocks.append(("h2", "What ran"))
    rows = [["recipe", recipe.name], ["source model", f"{recipe['run']['model']} ({src.get('kind', '?')})"],
            ["data", recipe["run"]["data"]], ["T init", recipe["convert"]["t_init"]],
            ["machine", f"{platform.machine()}, {platform.system()} {platform.release()}, Python {platform.python_version()}"],
            ["wall time", f"{total:.0f} s"]]
    if train is not None and train.status == "done":
        for tying, info in train.outputs.get("runs", {}).items():
            s = info["summary"]
            rows.append([f"training ({tying})", f"{s.get('steps')} steps, {s.get('tokens')} tokens, "
                         f"{_fmt(s.get('tokens_per_s'), '.0f')} tokens/s, device {_device_of(info['dir'])}"])
    blocks.append(("table", ["", ""], rows))
    blocks.append(("table", ["stage", "status", "seconds", "note"],
                   [[s, r.status if r else "not run", _fmt(r.seconds, '.1f') if r else "—",
                     (r.error or "") if r else ""] for s, r in records.items() if s != "report"]))

    if conv is not None and conv.status == "done":
        blocks.append(("h2", "Token interface and held-out loss"))
        b, a = conv.outputs["interface_before"], conv.outputs["interface_after"]
        keys = ["delta_ti", "cosine_distance", "procrustes_error", "principal_angle"]
        blocks.append(("table", ["", *keys, "val NLL"], [
            ["source", *[_fmt(b.get(k)) for k in keys], _fmt(conv.outputs.get("source_val_nll"))],
            ["converted", *[_fmt(a.get(k)) for k in keys], _fmt(conv.outputs.get("converted_val_nll"))],
        ]))
    if train is not None and train.status == "done" and train.outputs.get("runs"):
        blocks.append(("h2", "Training"))
        runs = train.outputs["runs"]
        blocks.append(("table", ["run", "steps", "val loss at start", "val loss at end", "train loss at end"], [
            [k, _fmt(v["summary"].get("steps")), _fmt(v["summary"].get("initial_val_loss")),
             _fmt(v["summary"].get("final_val_loss")), _fmt(v["summary"].get("final_train_loss"))] for k, v in runs.items()]))
        png = _loss_plot(out, runs)
        if png is not None:
            blocks.append(("img", png, "loss curves"))

    verify = records.get("verify")
    reports = (verify.outputs.get("reports") if verify and verify.status == "done" else None) or _verify_json(out)
    if reports:
        blocks.append(("h2", "Parity on the runtimes"))
        rows = []
        for rep in reports:
            for a in rep["artifacts"]:
                rows.append([Path(rep["directory"]).name, a["runtime"] + isa_tag(a), a["mode"], a.get("dtype", "float32"),
                             _fmt(a.get("logits_rel_l2"), ".2e"), _fmt(a.get("top1_agreement"), ".2%"),
                             _fmt(a.get("greedy_match")), _fmt(a.get("kl_mean"), ".4f"),
                             _fmt(a.get("kl_p99"), ".3f"), _fmt(a.get("same_top1"), ".1%"),
                             _fmt(a.get("ppl_ratio"), ".3f"), _fmt(a.get("delta_ti"), ".2e"),
                             _vs_x86(a.get("cross_isa")), _verdict(a)])
        blocks.append(("p", "fp32 artifacts are held to logit bounds (rel L2, top-1, greedy); quantized ones to KL "
                            "divergence from the fp32 reference on the held-out tokens (mean, p99, same top-1, "
                            "perplexity ratio)."))
        blocks.append(("table", ["export", "runtime", "mode", "dtype", "rel L2", "top-1", "greedy", "KL mean",
                                 "KL p99", "same top-1", "ppl ratio", "delta_ti", "vs x86", "result"], rows))
        runner_rows = _stock_runner_rows(reports)
        if runner_rows:
            blocks.append(("p", "ExecuTorch's stock LLM runner (`TextLLMRunner`, the runner behind `llama_main`) on each "
                                "`.pte`, greedy, with the artifact's own tokenizer file, against the PyTorch reference:"))
            blocks.append(("table", ["export", "mode", "dtype", "texts identical", "its last prompt", "its answer"],
                           runner_rows))

    bench = records.get("bench")
    if bench is not None and bench.status == "done" and bench.outputs.get("rows"):
        blocks.append(("h2", "Latency, memory and size"))
        cols = ["artifact", "runtime", "mode", "dtype", "threads", "prefill_tok_s", "decode_tok_s", "ttft_ms",
                "decode_ms_p50", "peak_rss_mb", "size_mb"]
        blocks.append(("table", cols, [[bench_label(r), *(_fmt(r.get(c), ".4g") for c in cols[1:])]
                                       for r in bench.outputs["rows"]]))
        if any(r.get(c) is None for r in bench.outputs["rows"] for c in ("prefill_tok_s", "decode_tok_s")):
            blocks.append(("p", "— in a rate column: not measured. A runner that times itself (ExecuTorch's stock "
                                "runner) reports whole milliseconds, and on a small model a phase can take less "
                                "than one, so there is no rate to give."))
        foreign = [r["foreign_load_cores"] for r in bench.outputs["rows"] if r.get("foreign_load_cores") is not None]
        if foreign:
            blocks.append(("p", f"Other processes kept {min(foreign):.2f}–{max(foreign):.2f} cores busy during the "
                                "measurements (machine busy time minus the benchmark's own CPU time); figures taken "
                                "beside a busy core are slow and noisy."))
        png = Path(bench.outputs.get("png", ""))
        if png.is_file():
            blocks.append(("img", png, "benchmark"))

    answers = stage_dir(out, "report") / "answers.json"
    if answers.is_file():
        data = json.loads(answers.read_text())
        blocks.append(("h2", "Greedy answers: source model vs shipped artifact"))
        if "error" in data:
            blocks.append(("p", f"Not available: {data['error']}"))
        else:
            blocks.append(("p", f"Artifact: `{data['artifact']}` ({data['runtime']}, {data['mode']})."))
            for row in data["prompts"]:
                same = "identical" if row["identical"] else "different"
                blocks.append(("pre", f"Q: {row['prompt']}\nsource:   {row['source']}\nartifact: {row['artifact']}\n({same})"))
    return blocks


def _stock_runner_rows(reports: list[dict[str, Any]]) -> list[list[str]]:
    """One row per ``.pte`` the stock runner ran: how many of its texts equal the reference's,
    and its answer to the last prompt (the chat question, when the tokenizer has a template)."""
    rows = []
    for rep in reports:
        for a in rep["artifacts"]:
            check = a.get("stock_runner") or {}
            answers = check.get("answers") or []
            if not answers:
                continue
            same = len(answers) - len(check.get("mismatches") or [])
            last = answers[-1]
            rows.append([Path(rep["directory"]).name, a["mode"], a.get("dtype", "float32"), f"{same}/{len(answers)}",
                         _one_line(last["prompt"]), _one_line(last["runner"])])
    return rows


def _one_line(text: str, limit: int = 120) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit - 1] + "…"


def _device_of(run_dir: str) -> str:
    """The device a training run used, from its ``run.json`` (``?`` when it cannot be read)."""
    try:
        data = json.loads(Path(run_dir, "run.json").read_bytes())
    except (OSError, ValueError):
        return "?"
    return str(data.get("device_used") or data.get("device", "?")) if isinstance(data, dict) else "?"


def _verify_json(out: Path) -> list | None:
    path = stage_dir(out, "verify") / "verify.json"
    return json.loads(path.read_text())["reports"] if path.is_file() else None


def _loss_plot(out: Path, runs: dict[str, Any]) -> Path | None:
    try:
        from ..analysis.plotting import RunLog, plot_runs

        logs = [RunLog.load(info["dir"], label=name) for name, info in runs.items()]
        return Path(plot_runs(logs, stage_dir(out, "report") / "loss.png"))
    except Exception:  # a missing curve must not hide the rest of the report
        return None


def render_markdown(blocks: list[Block], root: Path) -> str:
    lines: list[str] = []
    for b in blocks:
        kind = b[0]
        if kind == "h1":
            lines += [f"# {b[1]}", ""]
        elif kind == "h2":
            lines += [f"## {b[1]}", ""]
        elif kind == "p":
            lines += [b[1], ""]
        elif kind == "pre":
            lines += ["```", b[1], "```", ""]
        elif kind == "img":
            rel = Path(b[1]).resolve().relative_to(root.resolve()) if Path(b[1]).resolve().is_relative_to(root.resolve()) else b[1]
            lines += [f"![{b[2]}]({Path(rel).as_posix()})", ""]
        elif kind == "table":
            headers, rows = b[1], b[2]
            lines.append("| " + " | ".join(headers) + " |")
            lines.append("|" + "---|" * len(headers))
            lines += ["| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in row) + " |" for row in rows]
            lines.append("")
    return "\n".join(lines)


def render_html(blocks: list[Block]) -> str:
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>pit-deploy run</title><style>",
             "body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}",
             "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}",
             "pre{background:#f6f6f6;padding:8px;white-space:pre-wrap}img{max-width:100%}</style></head><body>"]
    for b in blocks:
        kind = b[0]
        if kind in ("h1", "h2"):
            parts.append(f"<{kind}>{html.escape(b[1])}</{kind}>")
        elif kind == "p":
            parts.append(f"<p>{html.escape(b[1]).replace('**', '')}</p>")
        elif kind == "pre":
            parts.append(f"<pre>{html.escape(b[1])}</pre>")
        elif kind == "img":
            data = base64.b64encode(Path(b[1]).read_bytes()).decode()
            parts.append(f"<img alt='{html.escape(b[2])}' src='data:image/png;base64,{data}'>")
        elif kind == "table":
            head = "".join(f"<th>{html.escape(str(h))}</th>" for h in b[1])
            body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in b[2])
            parts.append(f"<table><tr>{head}</tr>{body}</table>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(out: Path, recipe: RunRecipe) -> Path:
    """Write ``report.md`` and ``report.html`` into the run directory; returns the markdown path."""
    out = Path(out)
    (stage_dir(out, "report")).mkdir(parents=True, exist_ok=True)
    blocks = build(out, recipe)
    md = write_text_atomic(out / REPORT_NAME, render_markdown(blocks, out))
    write_text_atomic(md.with_suffix(".html"), render_html(blocks))
    return md
