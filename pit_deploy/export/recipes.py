"""Declarative export recipes: ``export/<name>.toml`` files (or ``.json``).

A recipe names the runtimes, modes, dtypes and the static cache length of an export, and for
quantized dtypes the group size, the PIT correction and the parity bounds::

    runtimes = ["onnx", "executorch"]
    modes = ["materialized", "factorized"]
    dtype = ["float32", "int8", "int4"]     # one string or a list
    max_seq_len = 256
    group_size = 32                         # int4 blocks / int8 table blocks along the input dim
    pit_correction = true                   # factorized quantized: T⁻¹ → (ẐᵀẐ)⁻¹ T⁻¹
    table_bits = 8                          # bits of the token tables: ONNX head + embedding, .pte gather
    int4_8bit_layers = ["v_proj", "down_proj"]  # int4: linears kept at 8 bits (both runtimes)
    pte_head_bits = 0                       # quantized factorized .pte: 0 = fp32 head (exact W_out E = I);
                                            # 4 or 8 = a rotated quantized head (smaller, faster)
    [bounds.int4]                           # overrides the built-in bounds of a dtype
    kl_mean = 0.5

``pit-deploy export --recipe NAME`` reads ``NAME`` as a path to such a file, or looks for
``NAME.toml`` / ``NAME.json`` in ``./export/`` (the user's own recipes) and then among the
recipes shipped inside the package (``pit_deploy/recipes/``, package data, so a normal
non-editable install finds them). Command-line flags override recipe fields.

Runtimes and dtypes are those the exporter registry (:mod:`.registry`) knows.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import PitError
from .registry import EXPORTERS

RUNTIMES: tuple[str, ...] = tuple(EXPORTERS)
MODES: tuple[str, ...] = ("materialized", "factorized")
DTYPES: tuple[str, ...] = tuple(dict.fromkeys(d for spec in EXPORTERS.values() for d in spec.dtypes))
#: the recipes shipped with the package (package data)
PACKAGE_RECIPES = Path(__file__).resolve().parents[1] / "recipes"
DEFAULT_MAX_SEQ_LEN = 256
_FIELDS = ("runtimes", "modes", "dtype", "max_seq_len", "description", "group_size", "pit_correction", "bounds",
           "table_bits", "int4_8bit_layers", "pte_head_bits")
GROUP_SIZES = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Recipe:
    """What to export. Validated on construction (raises :class:`PitError`)."""

    runtimes: tuple[str, ...] = RUNTIMES
    modes: tuple[str, ...] = MODES
    dtype: tuple[str, ...] = ("float32",)
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN
    description: str = ""
    name: str = "builtin-default"
    group_size: int = 32
    pit_correction: bool = True
    table_bits: int = 8
    #: int4: linear layers (name suffixes) kept at 8 bits on both runtimes (docs/quantization.md)
    int4_8bit_layers: tuple[str, ...] = ("v_proj", "down_proj")
    #: quantized factorized .pte: 0 keeps the fp32 head, 4/8 a rotated quantized head (export/pte_head.py)
    pte_head_bits: int = 0
    bounds: dict[str, dict[str, Any]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "runtimes", tuple(parse_list(self.runtimes, RUNTIMES, "runtime")))
        object.__setattr__(self, "modes", tuple(parse_list(self.modes, MODES, "mode")))
        object.__setattr__(self, "dtype", tuple(parse_list(self.dtype, DTYPES, "dtype")))
        for runtime in self.runtimes:
            refused = [d for d in self.dtype if d not in EXPORTERS[runtime].dtypes]
            if refused:
                raise PitError(f"the {runtime} runtime does not export {', '.join(refused)}; it supports "
                               f"{', '.join(EXPORTERS[runtime].dtypes)}")
        if not isinstance(self.max_seq_len, int) or isinstance(self.max_seq_len, bool) or self.max_seq_len < 2:
            raise PitError(f"max_seq_len must be an integer ≥ 2, got {self.max_seq_len!r}")
        if self.group_size not in GROUP_SIZES or isinstance(self.group_size, bool):
            raise PitError(f"group_size must be one of {', '.join(map(str, GROUP_SIZES))}, got {self.group_size!r}")
        if self.table_bits not in (4, 8) or isinstance(self.table_bits, bool):
            raise PitError(f"table_bits must be 4 or 8, got {self.table_bits!r}")
        if self.pte_head_bits not in (0, 4, 8) or isinstance(self.pte_head_bits, bool):
            raise PitError(f"pte_head_bits must be 0 (a float32 head), 4 or 8, got {self.pte_head_bits!r}")
        layers = self.int4_8bit_layers
        if not isinstance(layers, (list, tuple)) or not all(isinstance(n, str) and n for n in layers):
            raise PitError(f"int4_8bit_layers must be a list of layer names (e.g. [\"v_proj\", \"down_proj\"]), "
                           f"got {layers!r}")
        object.__setattr__(self, "int4_8bit_layers", tuple(layers))
        if not isinstance(self.pit_correction, bool):
            raise PitError(f"pit_correction must be true or false, got {self.pit_correction!r}")
        if not isinstance(self.bounds, dict) or any(k not in DTYPES or not isinstance(v, dict)
                                                   for k, v in self.bounds.items()):
            raise PitError(f"bounds must be a table per dtype ({', '.join(DTYPES)}), got {self.bounds!r}")

    @property
    def dtypes(self) -> tuple[str, ...]:
        return self.dtype

    def check_model(self, config: Any) -> None:
        """Raise :class:`PitError` if a quantized dtype's group size does not divide the hidden size."""
        d = int(config.hidden_size)
        if any(dt != "float32" for dt in self.dtype) and d % self.group_size:
            raise PitError(f"group size {self.group_size} does not divide the hidden size {d}; "
                           f"choose one of {', '.join(str(g) for g in GROUP_SIZES if d % g == 0) or 'none'}")

    def override(self, **kwargs: Any) -> "Recipe":
        """A copy with every non-``None`` keyword replaced."""
        return replace(self, **{k: v for k, v in kwargs.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["runtimes"], data["modes"], data["dtype"] = list(self.runtimes), list(self.modes), list(self.dtype)
        data["int4_8bit_layers"] = list(self.int4_8bit_layers)
        return data


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
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise PitError(f"recipe {path} has unknown field(s) {unknown}; allowed: {', '.join(_FIELDS)}")
    return Recipe(name=path.stem, **data)
