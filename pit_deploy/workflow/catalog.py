"""``pit-deploy list``: what the registries hold, as the registries say it.

Targets (``pit_deploy/targets/``), quantization schemes (``pit_deploy/schemes.py``), the export
and run recipes shipped with the package (and those in ``./export/`` and ``./runs/``), and the
model families (``pit_deploy/model/families.py``). Nothing here names one of them: a target, a
scheme, a recipe or a family registered elsewhere is listed the same way.
"""

from __future__ import annotations

import sys
from typing import Any

KINDS: tuple[str, ...] = ("targets", "schemes", "recipes", "families")


def scheme_targets(scheme: Any) -> list[str]:
    """The targets that export ``scheme`` (its own ``runtimes``, or every target of its dtype
    that takes it)."""
    from ..targets import get_target, target_names

    return [name for name in target_names() if get_target(name).supports_scheme(scheme)]


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    return "\n".join(lines)


def list_targets() -> str:
    from ..targets import get_target, target_names

    rows = []
    for name in target_names():
        t = get_target(name)
        rows.append((name, "default" if t.default_export else "opt-in", ",".join(t.dtypes), ",".join(t.modes),
                     ",".join(t.model_types) if t.model_types else "all",
                     "yes" if t.installed() else f"no (pip install {t.package or t.module})"))
    return _table(("target", "export", "dtypes", "modes", "families", "installed"), rows)


def list_schemes() -> str:
    from ..schemes import get_scheme, scheme_names

    rows = []
    for name in scheme_names():
        s = get_scheme(name)
        rows.append((name, s.dtype, ",".join(scheme_targets(s)), s.description))
    return _table(("scheme", "dtype", "targets", "description"), rows)


def list_recipes() -> str:
    from ..exporters.recipes import MODEL_RECIPES, available_recipes, find_recipe, load_recipe
    from ..errors import PitError
    from .recipe import available_run_recipes, find_run_recipe

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]

    rows = []
    for name in available_run_recipes():
        try:
            data = tomllib.loads(find_run_recipe(name).read_text(encoding="utf-8"))
            run = data.get("run") if isinstance(data.get("run"), dict) else {}
            text = str(run.get("description") or data.get("description") or "")
        except (OSError, ValueError, PitError) as exc:
            text = f"(unreadable: {exc})"
        rows.append(("run", name, text))
    for name in available_recipes():
        try:
            text = load_recipe(str(find_recipe(name))).description
        except PitError as exc:
            text = f"(unreadable: {exc})"
        if name in MODEL_RECIPES:
            text += " (applied by `pit-deploy run` on this model)"
        rows.append(("export", name, text))
    return _table(("kind", "recipe", "description"), rows)


def list_families() -> str:
    from ..model.families import families
    from ..targets import get_target, target_names

    rows = []
    for adapter in families():
        targets = [n for n in target_names() if any(get_target(n).supports_family(t) for t in adapter.model_types)]
        rows.append((adapter.name, ",".join(adapter.model_types), ",".join(targets), adapter.covers))
    return _table(("family", "model types", "targets", "models"), rows)


def listing(kinds: list[str] | tuple[str, ...] = KINDS) -> str:
    """The tables of ``kinds`` (each one of :data:`KINDS`), each under its name."""
    from ..errors import PitError

    makers = {"targets": list_targets, "schemes": list_schemes, "recipes": list_recipes, "families": list_families}
    parts = []
    for kind in kinds:
        if kind not in makers:
            raise PitError(f"pit-deploy list {kind!r}: choose one of {', '.join(KINDS)} (or none for all)")
        parts.append(f"{kind}:\n{makers[kind]()}")
    return "\n\n".join(parts)
