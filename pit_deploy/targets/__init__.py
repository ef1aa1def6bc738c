"""The target registry: runtime name → :class:`~pit_deploy.targets.base.Target`.

Each built-in target lives in one module of this package (``onnx_optimum``,
``executorch_xnnpack``, ``onnx_genai``, ``llama_cpp``) that registers itself when imported; the registry imports them on first
use, by name, so nothing here imports a runtime. A new target is one module that defines a
``Target`` subclass and calls :func:`register_target` (``docs/design.md``, "Adding a target");
code outside the package can register one the same way (a test does, for the proof).

Standard library only (``io.manifest`` validates runtime names on devices).
"""

from __future__ import annotations

import importlib

from ..errors import PitError
from .base import Target, VerifyContext, resolve

#: built-in targets: runtime name → the module that registers it
BUILTIN: dict[str, str] = {
    "onnx": "pit_deploy.targets.onnx_optimum",
    "executorch": "pit_deploy.targets.executorch_xnnpack",
    "onnx-genai": "pit_deploy.targets.onnx_genai",
    "gguf": "pit_deploy.targets.llama_cpp",
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
