"""One schema for benchmark rows: every cell — a local cell through this package's driver, a
bundle's cell on a device, a stock-runner cell, a phone cell over adb — produces a row with every
key of :data:`ROW_FIELDS` (and may add its own), so ``bench --ingest``, the report and the ratios
read them alike (``docs/bench.md``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

from ..errors import PitError
from ..io.fs import confined, sha256_file
from ..io.manifest import Manifest, artifact_key
from ..runtime.standalone import mean_std, percentile

ROW_FIELDS = ("artifact", "runtime", "mode", "dtype", "tying", "threads", "prompt_len", "gen_len",
              "prefill_tok_s", "decode_tok_s", "ttft_ms", "decode_ms_p50", "decode_ms_p90", "load_s",
              "peak_rss_mb", "size_mb")
#: the row fields that name what was measured, and those that count (positive integers); the
#: others of :data:`ROW_FIELDS` are measured figures: non-negative numbers, or ``null`` (not measured)
ROW_NAMES = ("artifact", "runtime", "mode", "dtype", "tying")
ROW_COUNTS = ("threads", "prompt_len", "gen_len")
#: optional fields the table reads, and the values each may take
_ROW_OPTIONAL = {"scheme": (str, type(None)), "variant": (str, type(None)), "verified": (bool, type(None)),
                 "first_divergence": (int, type(None)), "prefill_tok_s_std": (int, float, type(None)),
                 "decode_tok_s_std": (int, float, type(None)), "foreign_load_cores": (int, float, type(None))}


def row_problem(row: Any) -> str | None:
    """What makes ``row`` (read from a file, e.g. by ``bench --ingest``) unusable, naming the key;
    ``None`` when it is a row: every :data:`ROW_FIELDS` key of its type, every number finite."""
    if not isinstance(row, dict):
        return f"is a {type(row).__name__}, not an object"
    missing = [k for k in ROW_FIELDS if k not in row]
    if missing:
        return f"lacks {', '.join(missing)}"
    for key in ROW_NAMES:
        if not isinstance(row[key], str):
            return f"key {key!r} must be a string, got {type(row[key]).__name__}"
    for key in ROW_COUNTS:
        if not isinstance(row[key], int) or isinstance(row[key], bool) or row[key] < 1:
            return f"key {key!r} must be a positive integer, got {row[key]!r}"
    for key in (k for k in ROW_FIELDS if k not in ROW_NAMES + ROW_COUNTS):
        value = row[key]
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            return f"key {key!r} must be a number or null, got {type(value).__name__}"
        if value is not None and not 0 <= value < math.inf:
            return f"key {key!r} is {value!r}: a figure must be finite and non-negative (null: not measured)"
    for key, kinds in _ROW_OPTIONAL.items():
        value = row.get(key)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            return f"key {key!r} has the wrong type ({type(value).__name__})"
    for key, value in row.items():
        if isinstance(value, float) and not math.isfinite(value):
            return f"key {key!r} is {value!r}: numbers must be finite (null: not measured)"
    return None


def printable(text: str) -> str:
    """``text`` safe to print to a terminal: control and other non-printing characters (an
    escape sequence in a label read from a file) shown as Python escapes (``\\x1b``)."""
    return "".join(ch if ch.isprintable() or ch == " " else ch.encode("unicode_escape").decode("ascii")
                   for ch in text)


def runner_row(meta: dict[str, Any], passes: list[dict[str, float]], rss_kib: list[int | None]) -> dict[str, Any]:
    """A bench row (every key of :data:`ROW_FIELDS`) from the measured invocations of one cell
    of a runner that reports its own statistics (ExecuTorch's stock runner, ``llama_main``).
    ``decode_ms_p50``/``p90`` are over the invocations' mean ms per token: the stock runner
    reports no per-token times."""
    pp, pp_std = mean_std([p["prefill_tok_s"] for p in passes])
    tg, tg_std = mean_std([p["decode_tok_s"] for p in passes])
    per_token = [p["decode_ms_per_token"] for p in passes]
    known = [r for r in rss_kib if r is not None]
    return {
        **meta,
        "prefill_tok_s": pp, "prefill_tok_s_std": pp_std, "decode_tok_s": tg, "decode_tok_s_std": tg_std,
        "ttft_ms": sum(p["ttft_ms"] for p in passes) / len(passes),
        "decode_ms_p50": percentile(per_token, 0.5), "decode_ms_p90": percentile(per_token, 0.9),
        "load_s": sum(p["load_s"] for p in passes) / len(passes),
        "peak_rss_mb": max(known) / 1024.0 if known else math.nan,
        "prompt_tokens": passes[-1]["prompt_tokens"], "generated_tokens": passes[-1]["generated_tokens"],
    }


def verification_state(manifest: Manifest, art: Any, label: str, directory: Path,
                       warnings: list[str]) -> bool | None:
    """The artifact's recorded verification: ``True`` only when it passed and its files still
    have the digests ``verify`` checked; ``None`` when never verified or changed since; a
    warning is added for an unverified, changed or failed one — it is still measured, but
    flagged."""
    record = _verification(manifest, art)
    if record is None:
        warnings.append(f"{label} was never verified: run `pit-deploy verify {directory}` — its figures may be of a wrong model")
        return None
    changed = changed_since_verification(record, art, directory)
    if changed:
        warnings.append(f"{label} changed since verification ({changed}): its recorded result no longer applies; "
                        f"run `pit-deploy verify {directory}` again")
        return None
    if not record.get("passed"):
        warnings.append(f"{label} FAILED verification: it does not compute what PyTorch computes")
        return False
    return True


def changed_since_verification(record: dict[str, Any], art: Any, directory: Path) -> str | None:
    """What differs between the files ``verify`` checked (the ``digests`` it recorded) and the
    artifact's files now (``None``: nothing)."""
    digests = record.get("digests")
    if not isinstance(digests, dict) or not digests:
        return "the result records no digests of the files it verified (an older pit-deploy)"
    if set(digests) != set(art.files):
        return "its manifest lists other files than were verified"
    for rel, digest in sorted(digests.items()):
        path = confined(directory, rel, "manifest file")
        if not path.is_file():
            return f"{rel} is missing"
        if sha256_file(path) != digest:
            return f"{rel} differs from the verified file"
    return None


def export_names(directories: Sequence[str | Path]) -> list[str]:
    """One name per export directory, unique among them, for the labels of its rows, its prompt
    keys and its folder in a bundle: the folder's own name (of the resolved path, so ``.`` and
    ``..`` name a real folder), and ``name-2``, ``name-3`` … for further directories of the same
    name — two exports called ``exp`` in different places never mix."""
    taken: set[str] = set()
    names = []
    for directory in directories:
        base = Path(directory).resolve().name or "export"
        name, n = base, 1
        while name in taken:
            n += 1
            name = f"{base}-{n}"
        taken.add(name)
        names.append(name)
    return names


def reference_positions(directory: Path) -> int | None:
    """The most positions the export's model supports (its reference ``config.json``:
    ``max_position_embeddings`` or the family's equivalent); ``None`` when it names none."""
    from types import SimpleNamespace

    from ..io.manifest import REFERENCE_DIR
    from ..model.families import max_positions

    path = Path(directory) / REFERENCE_DIR / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # no config or an unreadable one: verify names that problem
        return None
    return max_positions(SimpleNamespace(**config)) if isinstance(config, dict) else None


def check_context(label: str, art: Any, opts: Any, positions: int | None = None) -> None:
    """Every prompt length plus the generation must fit the artifact's static cache and the
    model's ``positions`` (exit 2, before anything is measured)."""
    context = art.shapes.get("max_seq_len") if art is not None else None
    for p in opts.prompt_lens:
        if context is not None and p + opts.gen_len > context:
            raise PitError(f"{label}: prompt {p} + {opts.gen_len} generated tokens exceed the artifact's "
                           f"context of {context}; use a shorter --prompt-len/--gen-len or export with a "
                           "longer --max-seq-len")
        if positions is not None and p + opts.gen_len > positions:
            raise PitError(f"{label}: prompt {p} + {opts.gen_len} generated tokens exceed the {positions} positions "
                           "the model supports (max_position_embeddings of its config); use a shorter "
                           "--prompt-len/--gen-len")


def _verification(manifest: Manifest, art: Any) -> dict[str, Any] | None:
    """The recorded verification result of ``art`` (``None``: none)."""
    ver = manifest.verification if isinstance(manifest.verification, dict) else {}
    for a in ver.get("artifacts") or []:
        if isinstance(a, dict) and artifact_key(a.get("runtime"), a.get("mode"),
                                                a.get("scheme") or a.get("dtype", "float32")) == art.key:
            return a
    return None
