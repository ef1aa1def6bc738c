"""pit_deploy: Pseudo-Inverse Tying for compact causal LMs, from conversion to on-device parity.

The Python API is one call per command (``docs/python-api.md``)::

    import pit_deploy

    pit_deploy.convert("default", "pit/")
    manifest = pit_deploy.export("pit/", "exp/", runtime="onnx", dtype=["float32", "int4"])
    assert pit_deploy.verify("exp/").passed

``convert``, ``train``, ``export``, ``verify``, ``bench`` (with ``bench_bundle``,
``bench_ingest`` and ``bench_adb`` for the command's other modes) and ``run`` are the functions of
:mod:`pit_deploy.api`, loaded on first use: ``import pit_deploy`` itself imports no torch and
no other heavy library. A user's mistake raises :class:`PitError`.

The stages are sub-packages, in pipeline order: ``model`` (the PIT interface and its modules),
``io`` (files, checkpoints, sources, manifests), ``convert``, ``train``, ``export``, ``runtime``
(one driver per runtime), ``evaluate`` (verify) and ``analysis`` (diagnostics, probe, plots);
``cli`` sits on top. Four of them share a name with a call (``convert``, ``train``, ``export``,
``run``): that sub-package is callable, as the call (``pit_deploy.export(...)``), and still holds
its modules (``pit_deploy.export.recipes``).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__version__ = "0.1.0"

#: the calls of the Python API (:mod:`pit_deploy.api`)
_CALLS = ("convert", "train", "export", "verify", "bench", "bench_bundle", "bench_ingest", "bench_adb", "run")
#: the calls whose name is also a sub-package's
_SUBPACKAGE_CALLS = frozenset(("convert", "train", "export", "run"))
__all__ = [*_CALLS, "PitError", "__version__"]


def _api_function(name: str) -> Any:
    return getattr(importlib.import_module("pit_deploy.api"), name)


class _CallableSubpackage(types.ModuleType):
    """A sub-package that is also the API call of its name: ``pit_deploy.train(...)`` calls
    :func:`pit_deploy.api.train`, ``pit_deploy.train.config`` is still the module."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _api_function(self.__name__.rpartition(".")[2])(*args, **kwargs)

    @property
    def __signature__(self) -> Any:  # what inspect.signature and help tools show: the call's
        import inspect

        return inspect.signature(_api_function(self.__name__.rpartition(".")[2]))


class _Package(types.ModuleType):
    """``pit_deploy`` itself: every sub-package named like a call becomes callable as it is
    imported (Python sets it as an attribute of this package, whichever import comes first)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SUBPACKAGE_CALLS and type(value) is types.ModuleType:
            value.__class__ = _CallableSubpackage
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    """The API on first use (``import pit_deploy`` stays light)."""
    if name in _SUBPACKAGE_CALLS:
        return importlib.import_module(f"{__name__}.{name}")  # callable once imported (_Package)
    if name in _CALLS:
        return _api_function(name)
    if name == "PitError":
        from .errors import PitError

        return PitError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The API and the sub-packages imported so far."""
    loaded = [n for n, v in globals().items() if isinstance(v, types.ModuleType) and v.__name__ == f"{__name__}.{n}"]
    return sorted({*__all__, *loaded})
