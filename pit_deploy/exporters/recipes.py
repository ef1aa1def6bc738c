"""Declarative export recipes: ``export/<name>.toml`` files (or ``.json``).

A recipe names the targets, modes, quantization schemes and the static cache length of an
export, and may override a quantized scheme's settings and bounds::

    runtimes = ["onnx", "executorch"]       # targets (pit_deploy/targets/)
    modes = ["materialized", "factorized"]
    dtype = ["float32", "int8", "int4"]     # schemes (pit_deploy/schemes.py), one artifact each
    max_seq_len = 256
    group_size = 32                         # overrides of every quantized scheme's settings;
    pit_correction = true                   # left out, each scheme keeps its own
    table_bits = 8
    int4_8bit_layers = ["v_proj", "down_proj"]
    pte_head_bits = 0
    pte_shared_table = true
    rounding = "gptq"
    rotate_residual = true
    [bounds.int4]                           # overrides the scheme's bounds
    kl_mean = 0.5

The fields are :class:`Recipe`'s: ``pit-deploy export``'s flags are generated from them, and a
run recipe's ``[export]`` table is this recipe (``docs/design.md``, "Configuration").

``pit-deploy export --recipe NAME`` reads ``NAME`` as a path to such a file, or looks for
``NAME.toml`` / ``NAME.json`` in ``./export/`` (the user's own recipes) and then among the
recipes shipped inside the package (``pit_deploy/recipes/``, package data, so a normal
non-editable install finds them). Command-line flags override recipe fields.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable

from ..errors import PitError
from ..options import flag_name, opt
from ..schemes import GROUP_SIZES, SETTINGS, Scheme, get_scheme, scheme_names, setting_entry
from ..targets import default_target_names, get_target, target_names

MODES: tuple[str, ...] = ("materialized", "factorized")
#: ``runtimes = ["all"]``: every installed target that exports the model (:meth:`Recipe.for_model`)
ALL = "all"
#: the recipes shipped with the package (package data)
PACKAGE_RECIPES = Path(__file__).resolve().parents[1] / "recipes"
DEFAULT_MAX_SEQ_LEN = 256
#: the longest ``max_seq_len`` taken for a model whose config declares no positions
MAX_SEQ_LEN_CEILING = 1 << 20
#: :meth:`Recipe.for_model`'s ``tokenizer`` when the caller has not loaded it (``None`` means the
#: model has none)
TOKENIZER_UNKNOWN: Any = object()
#: scheme settings a recipe may override (``None``: each scheme's own; :data:`~pit_deploy.schemes.SETTINGS`)
SCHEME_SETTINGS = tuple(s.name for s in SETTINGS)


def setting_override(name: str) -> Any:
    """A :class:`Recipe` field overriding the scheme setting ``name``: ``None`` (each scheme's own
    value), with the export flag and help its :data:`~pit_deploy.schemes.SETTINGS` entry gives."""
    entry = setting_entry(name)
    return opt(None, entry.help, group="quantization", flag=entry.flag,
               choices=entry.values if entry.cli_choices else None)


@dataclass(frozen=True)
class Recipe:
    """What to export. Validated on construction (raises :class:`PitError`)."""

    runtimes: tuple[str, ...] | None = opt(None, f"comma list of targets (--target is the same option): "
                                    f"{', '.join(target_names())}, or {ALL} (every "
                                    "installed target that exports the model's family, the modes and the dtypes asked "
                                    f"for) (default: {', '.join(default_target_names())}; `pit-deploy list targets`)",
                                    flag="--runtime", group="what", parse="tuple[str, ...]", metavar="TARGETS",
                                    aliases=("--target",))
    modes: tuple[str, ...] = opt(MODES, "comma list of materialized, factorized (default: both)", flag="--mode",
                                 group="what", parse="tuple[str, ...]")
    dtype: tuple[str, ...] = opt(("float32",), f"comma list of quantization schemes: {', '.join(scheme_names())} (default "
                                 "float32; one artifact each; `pit-deploy list schemes` says which target takes which; "
                                 "--scheme is the same option)",
                                 group="what", parse="tuple[str, ...]", metavar="SCHEMES", aliases=("--scheme",))
    max_seq_len: int = opt(DEFAULT_MAX_SEQ_LEN, "static KV cache length of the .pte (default 256)", group="what")
    description: str = opt("", cli=False)
    name: str = opt("builtin-default", cli=False)
    # the schemes' SETTINGS as overrides (None: each scheme's own value), typed; their help and
    # flags come from the entries (tests/test_schemes.py checks the fields match SETTINGS)
    group_size: int | None = setting_override("group_size")
    pit_correction: bool | None = setting_override("pit_correction")
    table_bits: int | None = setting_override("table_bits")
    int4_8bit_layers: tuple[str, ...] | None = setting_override("int4_8bit_layers")
    pte_head_bits: int | None = setting_override("pte_head_bits")
    pte_shared_table: bool | None = setting_override("pte_shared_table")
    rounding: str | None = setting_override("rounding")
    head_activations: str | None = setting_override("head_activations")
    rotate_residual: bool | None = setting_override("rotate_residual")
    genai_group_size: int | None = setting_override("genai_group_size")
    bounds: dict[str, dict[str, Any]] = opt({}, cli=False)

    def __post_init__(self) -> None:
        runtimes = default_target_names() if self.runtimes is None else self.runtimes
        object.__setattr__(self, "runtimes", tuple(parse_list(runtimes, target_names() + (ALL,), "runtime")))
        object.__setattr__(self, "modes", tuple(parse_list(self.modes, MODES, "mode")))
        object.__setattr__(self, "dtype", tuple(parse_list(self.dtype, scheme_names(), "dtype")))
        if ALL in self.runtimes and len(self.runtimes) > 1:
            raise PitError(f"runtime {ALL!r} means every installed target that exports the model; pass it alone, "
                           f"or list targets ({', '.join(target_names())})")
        if not isinstance(self.max_seq_len, int) or isinstance(self.max_seq_len, bool) or self.max_seq_len < 2:
            raise PitError(f"max_seq_len must be an integer ≥ 2, got {self.max_seq_len!r}")
        if self.int4_8bit_layers is not None:
            layers = self.int4_8bit_layers
            if isinstance(layers, str) or not isinstance(layers, (list, tuple)):
                raise PitError(f"int4_8bit_layers must be a list of layer names (e.g. [\"v_proj\", \"down_proj\"]), "
                               f"got {layers!r}")
            object.__setattr__(self, "int4_8bit_layers", tuple(layers))
        if not isinstance(self.bounds, dict) or any(k not in self.dtype or not isinstance(v, dict)
                                                   for k, v in self.bounds.items()):
            raise PitError(f"bounds must be a table per exported scheme ({', '.join(self.dtype)}), got {self.bounds!r}")
        # the overrides' values, whatever the schemes (on a scheme whose settings cannot conflict with them)
        get_scheme("int4").with_settings(pte_shared_table=False).with_settings(**self.overrides())
        moot = [k for k in self.overrides() if not any(get_scheme(name).reads(k) for name in self.dtype)]
        if moot:
            what = ("the schemes that store int8/int4 codes (it changes how their body is rounded)"
                    if any(get_scheme(name).quantized for name in self.dtype)
                    else "quantized schemes only (float32 has no grid, blocks or tables)")
            raise PitError(f"{moot[0]} ({_flag(moot[0])}) applies to {what}, and this export's dtype is "
                           f"{', '.join(self.dtype)} only; drop {moot[0]} or add a quantized dtype (e.g. --dtype "
                           f"{','.join(self.dtype)},int4)")
        if self.runtimes == (ALL,):
            self.schemes()  # the targets are chosen for the model (for_model), which checks the rest
            return
        read = {k for r in self.runtimes for k in get_target(r).scheme_settings}
        ignored = [k for k in self.overrides() if k not in read]
        if ignored:
            readers = [t for t in target_names() if ignored[0] in get_target(t).scheme_settings]
            raise PitError(f"{ignored[0]} applies to the {', '.join(readers) or 'no'} runtime(s) only, and this export "
                           f"has {', '.join(self.runtimes)}; drop it or add the runtime")
        schemes = self.schemes()  # validates the settings together and the bounds
        static = [r for r in self.runtimes if get_target(r).static_cache]
        for scheme in (s for s in schemes if not s.quantized and static):
            # fp32 verification greedily decodes greedy_tokens after a prompt of at least one token
            need = scheme.bounds.greedy_tokens + 1
            if self.max_seq_len < need:
                raise PitError(f"max_seq_len {self.max_seq_len} is too short for the static cache of {', '.join(static)}: "
                               f"verifying a {scheme.name} artifact decodes {need - 1} tokens after a prompt, so it "
                               f"needs at least {need}; pass --max-seq-len {need} or more")
        for runtime in self.runtimes:
            target = get_target(runtime)
            refused = [s.name for s in schemes if s.dtype not in target.dtypes]
            if refused:
                raise PitError(f"the {runtime} runtime does not export {', '.join(refused)}; it supports "
                               f"{', '.join(target.dtypes)}")
            elsewhere = [s.name for s in schemes if s.runtimes is not None and runtime not in s.runtimes]
            if elsewhere:
                raise PitError(f"the {', '.join(elsewhere)} scheme is meant for {', '.join(get_scheme(elsewhere[0]).runtimes)} "
                               f"only, not {runtime}; choose another dtype or --runtime")

    @property
    def dtypes(self) -> tuple[str, ...]:
        return self.dtype

    def overrides(self) -> dict[str, Any]:
        """The scheme settings this recipe sets (the others stay each scheme's)."""
        return {k: getattr(self, k) for k in SCHEME_SETTINGS if getattr(self, k) is not None}

    def schemes(self, config: Any = None) -> list[Scheme]:
        """The recipe's schemes with its overrides of their settings and bounds applied. With the
        model's ``config``, a scheme's own ``int4_8bit_layers`` (Llama-layout names such as
        ``v_proj``) become the names of the model's family for the same linears
        (:meth:`~pit_deploy.model.families.FamilyAdapter.linear_names`; GPT-2: ``attn.c_attn``);
        names the recipe gives are taken as they are."""
        out = []
        for name in self.dtype:
            scheme = get_scheme(name)
            if scheme.quantized:
                scheme = scheme.with_settings(**self.overrides())
                if config is not None and self.int4_8bit_layers is None and scheme.int4_8bit_layers:
                    scheme = scheme.with_settings(int4_8bit_layers=_family(config).linear_names(scheme.int4_8bit_layers))
            out.append(scheme.with_bounds(self.bounds.get(name)))
        return out

    def check_model(self, config: Any, linears: list[str] | tuple[str, ...] | None = None) -> None:
        """Raise :class:`PitError`, before any slow work, if the recipe cannot fit the model: a
        quantized scheme's group size that does not divide the hidden size, a ``max_seq_len`` longer
        than the model's positions (past :data:`MAX_SEQ_LEN_CEILING` when the config declares none;
        without a static cache the default may exceed them), or (given the model's body ``linears``, module paths) a name of
        ``int4_8bit_layers`` that matches none of them."""
        from ..model.families import max_positions

        d = int(config.hidden_size)
        for scheme in self.schemes():
            for what, size in (("group size", scheme.group_size), ("genai_group_size", scheme.genai_group_size)):
                if scheme.quantized and size and d % size:
                    raise PitError(f"{what} {size} does not divide the hidden size {d}; "
                                   f"choose one of {', '.join(str(g) for g in GROUP_SIZES if d % g == 0) or 'none'}")
        static = [r for r in (target_names() if self.runtimes == (ALL,) else self.runtimes) if get_target(r).static_cache]
        limit = max_positions(config)
        what = f" (the static KV cache of {', '.join(static)})" if static else ""
        if limit is None and self.max_seq_len > MAX_SEQ_LEN_CEILING:
            raise PitError(f"max_seq_len {self.max_seq_len}{what} is past {MAX_SEQ_LEN_CEILING} positions, and the "
                           "model's config declares no limit (max_position_embeddings); set max_seq_len "
                           "(--max-seq-len) to the context the model was trained for")
        # without a static cache the length only caps the held-out blocks, which the model's
        # positions cap too: the default may exceed a short model's positions, a value given may not
        if limit is not None and self.max_seq_len > limit and (static or self.max_seq_len != DEFAULT_MAX_SEQ_LEN):
            raise PitError(f"max_seq_len {self.max_seq_len}{what} exceeds the model's {limit} positions; set "
                           f"max_seq_len (--max-seq-len) to {limit} or less")
        if linears is not None and self.int4_8bit_layers and any(s.dtype == "int4" for s in self.schemes()):
            check_layer_names(self.int4_8bit_layers, linears, getattr(config, "model_type", "?"))

    def for_model(self, config: Any, say: Callable[[str], None] | None = None,
                  tokenizer: Any = TOKENIZER_UNKNOWN) -> "Recipe":
        """This recipe with ``runtimes = ["all"]`` made concrete for a model of ``config``: every
        installed target that exports its family, the recipe's modes and its schemes (and, given the
        model's ``tokenizer`` — ``None`` when it has none —, can hold it; the others are left out, each with its reason through
        ``say``); any other recipe as it is.

        Raises:
            PitError: no installed target can export this model as asked.
        """
        if self.runtimes != (ALL,):
            return self
        chosen, left_out = [], []
        for name in target_names():
            target = get_target(name)
            if not target.installed():
                left_out.append(f"{name} (not installed: pip install {target.package or target.module})")
                continue
            try:
                candidate = replace(self, runtimes=(name,))
                target.precheck(config, candidate)
                if tokenizer is not TOKENIZER_UNKNOWN:  # None: the model has none, which a target may refuse
                    target.precheck_tokenizer(tokenizer)
            except PitError as exc:
                left_out.append(f"{name} ({exc})")
                continue
            chosen.append(name)
        if say is not None and left_out:
            say(f"--runtime {ALL}: {', '.join(chosen) or 'none'}; left out: {'; '.join(left_out)}")
        if not chosen:
            raise PitError(f"no installed target exports this {getattr(config, 'model_type', '?')} model as asked "
                           f"(modes {', '.join(self.modes)}, dtype {', '.join(self.dtype)}): {'; '.join(left_out)}")
        return replace(self, runtimes=tuple(chosen))

    def only(self, scheme: str) -> "Recipe":
        """This recipe for one of its schemes (``pit-deploy run`` writes one export directory a
        scheme): the settings that scheme reads (none for float32, no rounding for f16) and its
        own bounds only, so that the one-scheme recipe is as valid as the whole one."""
        one = get_scheme(scheme)
        cleared = {k: None for k in SCHEME_SETTINGS if not one.reads(k)}
        return replace(self, dtype=(scheme,), bounds={k: v for k, v in self.bounds.items() if k == scheme}, **cleared)

    def override(self, **kwargs: Any) -> "Recipe":
        """A copy with every non-``None`` keyword replaced."""
        return replace(self, **{k: v for k, v in kwargs.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        for key in ("runtimes", "modes", "dtype"):
            data[key] = list(data[key])
        if data["int4_8bit_layers"] is not None:
            data["int4_8bit_layers"] = list(data["int4_8bit_layers"])
        data["bounds"] = {k: dict(v) for k, v in self.bounds.items()}
        return data


def _family(config: Any):
    from ..model.families import adapter_for

    return adapter_for(config)


def check_layer_names(names: tuple[str, ...] | list[str], linears: list[str] | tuple[str, ...], model_type: str) -> None:
    """Raise :class:`PitError` naming the key and the fix if one of ``names`` (``int4_8bit_layers``)
    matches none of the model's body ``linears`` (module paths, :func:`~pit_deploy.schemes.names_linear`)."""
    from ..schemes import names_linear

    missing = [name for name in names if not any(names_linear(path, (name,)) for path in linears)]
    if missing:
        last = list(dict.fromkeys(path.rsplit(".", 1)[-1] for path in linears))
        example = linears[-1] if linears else "layers.0.mlp.down_proj"
        raise PitError(f"int4_8bit_layers: {', '.join(repr(m) for m in missing)} matches no linear of this "
                       f"{model_type} model (its linears: {', '.join(last) or 'none'}); name a linear's last name "
                       f"(every layer's) or a dotted suffix of its path (one layer's, e.g. {example!r}) in "
                       "--int4-8bit-layers or the recipe key int4_8bit_layers, or leave it out for the scheme's "
                       "choice for this family")


#: export recipes measured on one model, whose quantization settings ``pit-deploy run`` applies
#: when its model is that one: recipe name → the model sources it is (``default``: the bundled
#: model) and the ``config.json`` values that identify a checkpoint of it (architecture, shape, vocabulary)
MODEL_RECIPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "sources": ("default",),
        "config": {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30,
                   "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3},
    },
}


def _flag(name: str) -> str:
    """The command-line flag of the recipe field ``name`` (``--no-rotate-residual``, ``--group-size``)."""
    meta = next(f.metadata for f in fields(Recipe) if f.name == name)
    return meta.get("flag") or flag_name(name)


def model_recipe(source: str | None, config: Any = None) -> str | None:
    """The name of the :data:`MODEL_RECIPES` recipe measured on the model ``source`` (a model spec
    such as ``default``) with ``config`` (a transformers config or a dict; ``None``: not read
    yet), or ``None`` when no recipe was measured on it."""
    for name, match in MODEL_RECIPES.items():
        if source in match["sources"]:
            return name
        if config is not None:
            get = config.get if isinstance(config, dict) else (lambda k, c=config: getattr(c, k, None))
            if all(get(key) == value for key, value in match["config"].items()):
                return name
    return None


def model_settings(name: str) -> dict[str, Any]:
    """The quantization settings (:data:`SCHEME_SETTINGS`) the export recipe ``name`` sets."""
    return load_recipe(str(PACKAGE_RECIPES / f"{name}.toml")).overrides()


def recipe_fields() -> tuple[str, ...]:
    """The keys a recipe file (or a run recipe's ``[export]`` table) may set."""
    return tuple(f.name for f in fields(Recipe) if f.name != "name")


def parse_list(value: Any, allowed: tuple[str, ...], what: str) -> list[str]:
    """``"a,b"`` or ``["a", "b"]`` → validated, de-duplicated list in the given order."""
    items = value.split(",") if isinstance(value, str) else list(value)
    out: list[str] = []
    for item in (str(i).strip().lower() for i in items):
        if not item:
            continue
        if item not in allowed:
            raise PitError(f"unknown {what} {item!r}; choose from {', '.join(allowed)}")
        if item not in out:
            out.append(item)
    if not out:
        raise PitError(f"no {what} given; choose from {', '.join(allowed)}")
    return out


def recipe_dirs() -> list[Path]:
    """Folders searched for recipe names, in order."""
    return [Path.cwd() / "export", PACKAGE_RECIPES]


def available_recipes() -> list[str]:
    names = {p.stem for d in recipe_dirs() if d.is_dir() for p in d.glob("*.toml")}
    names |= {p.stem for d in recipe_dirs() if d.is_dir() for p in d.glob("*.json")}
    return sorted(names)


def find_recipe(name: str) -> Path:
    path = Path(name).expanduser()
    if path.suffix in (".toml", ".json") and path.is_file():
        return path
    for folder in recipe_dirs():
        for suffix in (".toml", ".json"):
            candidate = folder / f"{name}{suffix}"
            if candidate.is_file():
                return candidate
    known = ", ".join(available_recipes()) or "none found"
    raise PitError(f"unknown recipe {name!r}; pass a .toml/.json file or one of: {known}")


def load_recipe(name: str) -> Recipe:
    """Read the recipe ``name`` (a path or a name in :func:`recipe_dirs`)."""
    path = find_recipe(name)
    try:
        if path.suffix == ".toml":
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # pragma: no cover - Python 3.10
                import tomli as tomllib  # type: ignore[no-redef]
            data = tomllib.loads(path.read_text())
        else:
            data = json.loads(path.read_text())
    except Exception as exc:
        raise PitError(f"cannot parse recipe {path}: {exc}") from None
    if not isinstance(data, dict):
        raise PitError(f"recipe {path} must be a table of fields, got {type(data).__name__}")
    unknown = sorted(set(data) - set(recipe_fields()))
    if unknown:
        raise PitError(f"recipe {path} has unknown field(s) {unknown}; allowed: {', '.join(recipe_fields())}")
    return Recipe(name=path.stem, **data)
