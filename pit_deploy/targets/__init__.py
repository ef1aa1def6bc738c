"""The target registry: runtime name → :class:`~pit_deploy.targets.base.Target`.

Each built-in target lives in one folder of this package (``onnx``, ``executorch``,
``onnx_genai``, ``gguf``), named after the target: its ``__init__.py`` declares the target and
registers it when imported, and beside it lie the modules only that target uses (``export.py``,
``driver.py``, …). The registry imports the declarations on first use, by name, so nothing here
imports a runtime. A new target is one folder whose ``__init__.py`` defines a ``Target`` subclass
and calls :func:`register_target`, plus its line in :data:`BUILTIN` (``docs/design.md``, "Adding
a target"); code outside the package can register one the same way (a test does, for the proof).

Standard library only (``io.manifest`` validates runtime names on devices).
"""

from __future__ import annotations

import importlib

from ..errors import PitError
from .base import Target, VerifyContext, resolve

#: built-in targets: runtime name → the module that registers it
BUILTIN: dict[str, str] = {
    "onnx": "pit_deploy.targets.onnx",
    "executorch": "pit_deploy.targets.executorch",
    "onnx-genai": "pit_deploy.targets.onnx_genai",
    "gguf": "pit_deploy.targets.gguf",
}

_TARGETS: dict[str, Target] = {}


def register_target(target: Target) -> Target:
    """Add (or replace) ``target`` under ``target.name``."""
    if not target.name or not target.exporter or not target.driver:
        raise ValueError("a target needs a name, an exporter and a driver")
    _TARGETS[target.name] = target
    return target


def unregister_target(name: str) -> None:
    """Remove a target registered at run time (a built-in one comes back on next use)."""
    _TARGETS.pop(name, None)


def _load_builtins() -> None:
    for name, module in BUILTIN.items():
        if name not in _TARGETS:
            importlib.import_module(module)


def target_names() -> tuple[str, ...]:
    """Every known target's name: the built-in ones first, then those registered at run time."""
    _load_builtins()
    return tuple(dict.fromkeys([*BUILTIN, *_TARGETS]))


def default_target_names() -> tuple[str, ...]:
    """The targets an export that names no runtime writes (those with ``default_export``)."""
    return tuple(name for name in target_names() if _TARGETS[name].default_export)


def get_target(name: str) -> Target:
    """The target called ``name``.

    Raises:
        PitError: no such target.
    """
    _load_builtins()
    try:
        return _TARGETS[name]
    except KeyError:
        raise PitError(f"unknown runtime {name!r}; choose from {', '.join(target_names())}") from None


__all__ = ["BUILTIN", "Target", "VerifyContext", "default_target_names", "get_target", "register_target", "resolve", "target_names",
           "unregister_target"]
