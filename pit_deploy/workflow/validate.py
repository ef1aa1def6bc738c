"""What ``pit-deploy run`` checks before any stage runs: that the recipe fits the model.

The source model's config is read first — ``config.json`` of a directory, the header of a GGUF
file (the bundled ``default`` included), never the weights, never the network: a hub id is
checked by the stages themselves — and then, each a :class:`~pit_deploy.errors.PitError` (exit
2) naming the key and the fix:

* a sequence length past the model's positions: ``train.seq_len`` (training and the held-out
  loss of the convert stage), ``export.max_seq_len``;
* a target that cannot export the model: its family (the onnxruntime-genai builder has no GPT-2,
  llama.cpp takes Llama and Qwen3), its mode (``gguf`` is materialized only), a runtime that is
  not installed; ``runtimes = ["all"]`` becomes the targets that can;
* a quantization setting the model cannot take: a group size that does not divide the hidden
  size, a name of ``int4_8bit_layers`` that matches none of the model's linears (the module names
  of the model built from its config on the meta device: no memory, no weights).

The config is kept on the recipe (``RunRecipe.source_config``), so the export settings measured
on a model (``MODEL_RECIPES``) apply to a checkpoint of that model's shape too.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from ..errors import PitError
from .recipe import RunRecipe


def gguf_config(path: Path) -> Any:
    """A transformers config of the GGUF model ``path`` from the file's header metadata
    (architecture, shape, vocabulary, positions), or ``None`` when the header does not say."""
    from transformers import AutoConfig

    from ..io.gguf_files import gguf_metadata

    try:
        meta = gguf_metadata(path)
        arch = meta["general.architecture"]
    except (OSError, ValueError, KeyError):
        return None
    names = {"hidden_size": "embedding_length", "num_hidden_layers": "block_count",
             "intermediate_size": "feed_forward_length", "num_attention_heads": "attention.head_count",
             "num_key_value_heads": "attention.head_count_kv", "max_position_embeddings": "context_length",
             "vocab_size": "vocab_size"}
    values = {key: meta.get(f"{arch}.{name}") for key, name in names.items()}
    if values["vocab_size"] is None:
        values["vocab_size"] = meta.get("tokenizer.ggml.tokens")
    values = {k: v for k, v in values.items() if isinstance(v, int) and not isinstance(v, bool)}
    try:
        return AutoConfig.for_model(arch, **values)
    except (ValueError, KeyError, TypeError):
        return None


def source_config(spec: str) -> Any:
    """The config of the model source ``spec`` read without its weights (``None``: a hub id, or
    a path the convert stage will refuse with its own message).

    Raises:
        PitError: a directory whose ``config.json`` names a family pit-deploy does not support.
    """
    from ..io.checkpoint import load_config, read_config_dict
    from ..io.sources import GGUF_MAGIC, default_gguf_path

    if spec == "default":
        return gguf_config(default_gguf_path())
    path = Path(spec).expanduser()
    if path.is_file():
        with open(path, "rb") as fh:
            return gguf_config(path) if fh.read(4) == GGUF_MAGIC else None
    if path.is_dir() and read_config_dict(path) is not None:
        return load_config(path)
    return None


def _source_tokenizer(spec: str) -> Any:
    """The tokenizer of a model directory (``None``: it has none) for the targets' tokenizer
    checks; :data:`~pit_deploy.exporters.recipes.TOKENIZER_UNKNOWN` for the other sources (the
    bundled default's fits every target; a GGUF file's or a hub model's is read by the convert
    stage, and the export stage checks it)."""
    from ..exporters.recipes import TOKENIZER_UNKNOWN
    from ..io.sources import directory_tokenizer

    path = Path(spec).expanduser()
    if spec == "default" or not path.is_dir():
        return TOKENIZER_UNKNOWN
    return directory_tokenizer(path)


def check_verify_isa(recipe: RunRecipe) -> None:
    """``[verify]`` ``isa``, ``arm_cpu`` and ``kleidiai``: known values, and for ``aarch64`` the
    emulation set-up present and an export with an artifact it runs — found before the run trains
    and exports for an hour, not at its verify stage.

    Raises:
        PitError: one line naming the key, or the set-up command.
    """
    if not recipe["verify"]["enabled"]:
        return
    from ..evaluate.verify import ISAS
    from ..exporters.recipes import parse_list
    from ..runtime.emulated import KLEIDIAI_SETTINGS, OTHER_CPUS, PROFILES, check_emulates, find_setup
    from ..targets import get_target

    v = recipe.effective("verify")
    try:
        isas = parse_list(v["isa"], ISAS, "ISA")
        parse_list(v["arm_cpu"], PROFILES + OTHER_CPUS, "aarch64 CPU profile")
        parse_list(v["kleidiai"], KLEIDIAI_SETTINGS, "KleidiAI setting")
    except PitError as exc:
        raise PitError(f"[verify]: {exc}") from None
    if "aarch64" not in isas:
        return
    runtimes = recipe.export_recipe().runtimes
    if not any(get_target(r).aarch64_layout is not None for r in runtimes):
        raise PitError(f"verify.isa includes aarch64, but none of the export's runtimes ({', '.join(runtimes)}) "
                       "runs emulated here; add onnx, onnx-genai or executorch to export.runtimes")
    try:
        check_emulates(find_setup())
    except PitError as exc:
        raise PitError(f"verify.isa includes aarch64: {exc}") from None


def check_run_fits(recipe: RunRecipe) -> None:
    """Refuse, before any stage runs, a recipe that cannot fit its model (module docstring); keep
    the model's config on ``recipe``.

    Raises:
        PitError: one line naming the key and the fix.
    """
    from ..exporters.recipes import TOKENIZER_UNKNOWN
    from ..model.families import body_linears, max_positions, skeleton
    from ..targets import get_target

    check_verify_isa(recipe)
    config = source_config(str(recipe["run"]["model"]))
    if config is None:
        return
    recipe.source_config = config
    where = f"the {{}} positions of the model {recipe['run']['model']} (its config's max_position_embeddings or n_positions)"
    limit = max_positions(config)
    train = recipe.effective("train")
    if limit is not None:
        if int(train["seq_len"]) > limit:
            raise PitError(f"train.seq_len {train['seq_len']} is longer than {where.format(limit)}; "
                           f"--set train.seq_len={limit} (or less)")
    exp = recipe.export_recipe()
    if limit is not None and exp.max_seq_len > limit:
        raise PitError(f"export.max_seq_len {exp.max_seq_len} is longer than {where.format(limit)}; "
                       f"--set export.max_seq_len={limit} (or less)")
    pit = config
    if not getattr(config, "pit", None):  # the run converts it: the export sees a PIT model
        pit = copy.deepcopy(config)
        pit.pit = {"converted_by": "run"}
    tokenizer = _source_tokenizer(str(recipe["run"]["model"]))
    try:
        exp = exp.for_model(pit, tokenizer=tokenizer)
        for runtime in exp.runtimes:
            get_target(runtime).precheck(pit, exp)
            if tokenizer is not TOKENIZER_UNKNOWN:  # e.g. a pre-tokenizer llama.cpp lacks, before training
                get_target(runtime).precheck_tokenizer(tokenizer)
        exp.check_model(config, body_linears(skeleton(config)))
    except PitError as exc:
        raise PitError(f"[export]: {exc}") from None
