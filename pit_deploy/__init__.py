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
``io`` (files, checkpoints, sources, manifests), ``converters``, ``training``, ``exporters``,
``runtime`` (one driver per runtime), ``evaluate`` (verify), ``analysis`` (diagnostics, probe,
plots) and ``workflow`` (``run``'s stages and report); ``cli`` sits on top. No sub-package shares a
name with a call: ``pit_deploy.export`` is the function, ``pit_deploy.exporters`` the package.
"""

from __future__ import annotations

import importlib
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time they load on first use
    from .api import bench, bench_adb, bench_bundle, bench_ingest, convert, export, run, train, verify
    from .errors import PitError

__version__ = "0.1.0"

#: the calls of the Python API (:mod:`pit_deploy.api`)
_CALLS = ("convert", "train", "export", "verify", "bench", "bench_bundle", "bench_ingest", "bench_adb", "run")
__all__ = [*_CALLS, "PitError", "__version__"]


def _api_function(name: str) -> Any:
    return getattr(importlib.import_module("pit_deploy.api"), name)


def __getattr__(name: str) -> Any:
    """The API on first use (``import pit_deploy`` stays light)."""
    if name in _CALLS:
        globals()[name] = function = _api_function(name)  # found directly from now on
        return function
    if name == "PitError":
        from .errors import PitError

        return PitError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The API and the sub-packages imported so far."""
    loaded = [n for n, v in globals().items() if isinstance(v, types.ModuleType) and v.__name__ == f"{__name__}.{n}"]
    return sorted({*__all__, *loaded})
