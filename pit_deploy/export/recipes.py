"""Declarative export recipes: ``export/<name>.toml`` files (or ``.json``).

A recipe names the runtimes, modes, dtype and the static cache length of an export::

    runtimes = ["onnx", "executorch"]
    modes = ["materialized", "factorized"]
    dtype = "float32"
    max_seq_len = 256

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
_FIELDS = ("runtimes", "modes", "dtype", "max_seq_len", "description")


@dataclass(frozen=True)
class Recipe:
    """What to export. Validated on construction (raises :class:`PitError`)."""

    runtimes: tuple[str, ...] = RUNTIMES
    modes: tuple[str, ...] = MODES
    dtype: str = "float32"
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN
    description: str = ""
    name: str = "builtin-default"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "runtimes", tuple(parse_list(self.runtimes, RUNTIMES, "runtime")))
        object.__setattr__(self, "modes", tuple(parse_list(self.modes, MODES, "mode")))
        if self.dtype not in DTYPES:
            raise PitError(
                f"unsupported dtype {self.dtype!r}; this version exports {', '.join(DTYPES)} "
                "(the parity bounds are FP32 bounds)"
            )
        if not isinstance(self.max_seq_len, int) or isinstance(self.max_seq_len, bool) or self.max_seq_len < 2:
            raise PitError(f"max_seq_len must be an integer ≥ 2, got {self.max_seq_len!r}")

    def override(self, **kwargs: Any) -> "Recipe":
        """A copy with every non-``None`` keyword replaced."""
        return replace(self, **{k: v for k, v in kwargs.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["runtimes"], data["modes"] = list(self.runtimes), list(self.modes)
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
