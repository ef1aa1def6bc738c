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
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..errors import PitError
from ..options import opt
from ..schemes import GROUP_SIZES, ROUNDINGS, Scheme, get_scheme, scheme_names
from ..targets import default_target_names, get_target, target_names

MODES: tuple[str, ...] = ("materialized", "factorized")
#: the recipes shipped with the package (package data)
PACKAGE_RECIPES = Path(__file__).resolve().parents[1] / "recipes"
DEFAULT_MAX_SEQ_LEN = 256
#: scheme settings a recipe may override (``None``: each scheme's own)
SCHEME_SETTINGS = ("group_size", "table_bits", "int4_8bit_layers", "pit_correction", "pte_head_bits",
                   "pte_shared_table", "rounding", "rotate_residual")


@dataclass(frozen=True)
class Recipe:
    """What to export. Validated on construction (raises :class:`PitError`)."""

    runtimes: tuple[str, ...] | None = opt(None, "comma list of targets (default: every target but the opt-in ones)", flag="--runtime",
                                    group="what", parse="tuple[str, ...]")
    modes: tuple[str, ...] = opt(MODES, "comma list of materialized, factorized (default: both)", flag="--mode",
                                 group="what", parse="tuple[str, ...]")
    dtype: tuple[str, ...] = opt(("float32",), "comma list of schemes: float32 (default), int8, int4, int4-compact, int4-shared, int8-web, int4-web; gguf: f16, q8_0, q4_0, q4_k_m "
                                 "(one artifact each)", group="what", parse="tuple[str, ...]")
    max_seq_len: int = opt(DEFAULT_MAX_SEQ_LEN, "static KV cache length of the .pte (default 256)", group="what")
    description: str = opt("", cli=False)
    name: str = opt("builtin-default", cli=False)
    group_size: int | None = opt(None, "int4/int8 block size along the input dimension (default: the scheme's, 32)",
                                 group="quantization")
    pit_correction: bool | None = opt(None, "factorized quantized: keep T⁻¹ instead of (ẐᵀẐ)⁻¹T⁻¹ (W_out E then "
                                      "drifts from I)", flag="--no-pit-correction", group="quantization")
    table_bits: int | None = opt(None, "bits of the quantized token tables (default: the scheme's): ONNX head and "
                                 "embedding, the .pte embedding's gather table", group="quantization",
                                 choices=(4, 8))
    int4_8bit_layers: tuple[str, ...] | None = opt(
        None, "int4: comma list of linears kept at 8 bits: down_proj (every layer's) or "
        "layers.3.mlp.down_proj (one layer's) (default: the scheme's)", group="quantization")
    pte_head_bits: int | None = opt(None, "quantized factorized .pte with a head of its own: 0 keeps the fp32 head "
                                    "(default); 4 or 8 quantizes it behind a rotation (smaller, faster; W_out E = I "
                                    "still holds on the runtime)", group="quantization", choices=(0, 4, 8))
    pte_shared_table: bool | None = opt(None, "quantized factorized .pte: a head of its own (fp32 or --pte-head-bits) "
                                        "instead of one quantized table that the head and the gather share (int4's "
                                        "default)", flag="--no-pte-shared-table", group="quantization")
    rounding: str | None = opt(None, "how the body linears are rounded: rtn (nearest grid point) or gptq "
                               "(error feedback from calibration text, in PyTorch; the exporter writes those "
                               "codes) (default: the scheme's)", group="quantization", choices=ROUNDINGS)
    rotate_residual: bool | None = opt(None, "quantized .pte: round the body without first rotating the residual "
                                       "stream by a randomized Hadamard matrix (int4's default rotates)",
                                       flag="--no-rotate-residual", group="quantization")
    bounds: dict[str, dict[str, Any]] = opt({}, cli=False)

    def __post_init__(self) -> None:
        runtimes = default_target_names() if self.runtimes is None else self.runtimes
        object.__setattr__(self, "runtimes", tuple(parse_list(runtimes, target_names(), "runtime")))
        object.__setattr__(self, "modes", tuple(parse_list(self.modes, MODES, "mode")))
        object.__setattr__(self, "dtype", tuple(parse_list(self.dtype, scheme_names(), "dtype")))
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

    def schemes(self) -> list[Scheme]:
        """The recipe's schemes with its overrides of their settings and bounds applied."""
        out = []
        for name in self.dtype:
            scheme = get_scheme(name)
            if scheme.quantized:
                scheme = scheme.with_settings(**self.overrides())
            out.append(scheme.with_bounds(self.bounds.get(name)))
        return out

    def check_model(self, config: Any) -> None:
        """Raise :class:`PitError` if a quantized scheme's group size does not divide the hidden size."""
        d = int(config.hidden_size)
        for scheme in self.schemes():
            if scheme.quantized and d % scheme.group_size:
                raise PitError(f"group size {scheme.group_size} does not divide the hidden size {d}; "
                               f"choose one of {', '.join(str(g) for g in GROUP_SIZES if d % g == 0) or 'none'}")

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
