"""Greedy answers of the shipped artifact beside the source model's, for the run report: the
plainest evidence that the exported model still does what the source did."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..data.calibration import encode_prompt
from ..errors import PitError


def pick_artifact(export_dirs: list[str]) -> tuple[Path, Any] | None:
    """The artifact a user would ship: the target that ships first (``Target.ship_priority``:
    ExecuTorch before ONNX), factorized before materialized, the first export directory (the
    first dtype of the recipe)."""
    from ..io.manifest import Manifest
    from ..targets import get_target

    for directory in export_dirs:
        manifest = Manifest.read(directory)
        order = sorted(manifest.artifacts, key=lambda a: (get_target(a.target).ship_priority, a.mode != "factorized"))
        if order:
            return Path(directory), order[0]
    return None


def greedy_answers(recipe: Any, ctx: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``{artifact, prompts: [{prompt, source, artifact, identical}]}`` for the report."""
    from transformers import AutoTokenizer

    from ..targets.executorch.stock_runner import eos_ids
    from ..io.sources import load_source
    from ..runtime.base import greedy
    from ..runtime.drivers import driver_class
    from ..runtime.torch_driver import TorchDriver

    chosen = pick_artifact(ctx.get("export", {}).get("exports", []))
    if chosen is None:
        raise PitError("no exported artifact to ask")
    directory, art = chosen
    reference = directory / "reference"
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(reference))
    except Exception as exc:  # no tokenizer in the export: nothing readable to show
        raise PitError(f"the export has no tokenizer ({exc}); answers need one") from None
    context = art.shapes.get("max_seq_len")
    max_new = int(recipe["report"]["max_new_tokens"])
    source = load_source(recipe["run"]["model"])
    # stop where the artifact's runner stops (the config's end of sequence: SmolLM2's end of turn)
    # and at the tokenizer's own end-of-sequence token
    tok_eos = set() if tokenizer.eos_token_id is None else {int(tokenizer.eos_token_id)}
    eos = frozenset(eos_ids(source.model) | tok_eos)
    src_driver = TorchDriver(model=source.model)
    runtime_driver = driver_class(art.target)(directory / art.path)
    rows = []
    for text in recipe["report"]["prompts"]:
        ids = encode_prompt(tokenizer, text)
        a = greedy(src_driver, ids, max_new, eos)
        b = greedy(runtime_driver, ids, max_new, eos, context)
        rows.append({"prompt": text, "source": tokenizer.decode(a, skip_special_tokens=True),
                     "artifact": tokenizer.decode(b, skip_special_tokens=True), "identical": a == b})
    runtime_driver.close()
    return {"artifact": f"{directory.name}/{art.path}", "runtime": art.target, "mode": art.mode, "prompts": rows}
