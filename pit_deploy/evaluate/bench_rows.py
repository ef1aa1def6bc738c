"""One schema for benchmark rows: every cell — a local cell through this package's driver, a
bundle's cell on a device, a stock-runner cell, a phone cell over adb — produces a row with every
key of :data:`ROW_FIELDS` (and may add its own), so ``bench --ingest``, the report and the ratios
read them alike (``docs/bench.md``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..errors import PitError
from ..io.manifest import Manifest, artifact_key
from ..runtime.standalone import _mean_std, _percentile

ROW_FIELDS = ("artifact", "runtime", "mode", "dtype", "tying", "threads", "prompt_len", "gen_len",
              "prefill_tok_s", "decode_tok_s", "ttft_ms", "decode_ms_p50", "decode_ms_p90", "load_s",
              "peak_rss_mb", "size_mb")


def runner_row(meta: dict[str, Any], passes: list[dict[str, float]], rss_kib: list[int | None]) -> dict[str, Any]:
    """A bench row (every key of :data:`ROW_FIELDS`) from the measured invocations of one cell
    of a runner that reports its own statistics (ExecuTorch's stock runner, ``llama_main``).
    ``decode_ms_p50``/``p90`` are over the invocations' mean ms per token: the stock runner
    reports no per-token times."""
    pp, pp_std = _mean_std([p["prefill_tok_s"] for p in passes])
    tg, tg_std = _mean_std([p["decode_tok_s"] for p in passes])
    per_token = [p["decode_ms_per_token"] for p in passes]
    known = [r for r in rss_kib if r is not None]
    return {
        **meta,
        "prefill_tok_s": pp, "prefill_tok_s_std": pp_std, "decode_tok_s": tg, "decode_tok_s_std": tg_std,
        "ttft_ms": sum(p["ttft_ms"] for p in passes) / len(passes),
        "decode_ms_p50": _percentile(per_token, 0.5), "decode_ms_p90": _percentile(per_token, 0.9),
        "load_s": sum(p["load_s"] for p in passes) / len(passes),
        "peak_rss_mb": max(known) / 1024.0 if known else math.nan,
        "prompt_tokens": passes[-1]["prompt_tokens"], "generated_tokens": passes[-1]["generated_tokens"],
    }


def verification_state(manifest: Manifest, art: Any, label: str, directory: Path,
                       warnings: list[str]) -> bool | None:
    """The artifact's recorded verification (``None``: never verified); a warning is added for
    an unverified or failed one — it is still measured, but flagged."""
    verified = _verification(manifest, art)
    if verified is None:
        warnings.append(f"{label} was never verified: run `pit-deploy verify {directory}` — its figures may be of a wrong model")
    elif not verified:
        warnings.append(f"{label} FAILED verification: it does not compute what PyTorch computes")
    return verified


def check_context(label: str, art: Any, opts: Any) -> None:
    """Every prompt length plus the generation must fit the artifact's static cache (exit 2)."""
    context = art.shapes.get("max_seq_len")
    for p in opts.prompt_lens:
        if context is not None and p + opts.gen_len > context:
            raise PitError(f"{label}: prompt {p} + {opts.gen_len} generated tokens exceed the artifact's "
                           f"context of {context}; use a shorter --prompt-len/--gen-len or export with a "
                           "longer --max-seq-len")


def _verification(manifest: Manifest, art: Any) -> bool | None:
    ver = manifest.verification or {}
    for a in ver.get("artifacts", []):
        if artifact_key(a.get("runtime"), a.get("mode"), a.get("scheme") or a.get("dtype", "float32")) == art.key:
            return bool(a.get("passed"))
    return None
