"""Finding the driver of a runtime by name: a target's (:mod:`pit_deploy.targets`), or PyTorch
eager's (``torch``: the reference and ``bench --torch``), the one driver that belongs to no
export target."""

from __future__ import annotations

from typing import Callable

from .base import Driver

#: the runtime name of PyTorch eager, which runs checkpoints rather than exported artifacts
EAGER = "torch"


def driver_class(name: str) -> Callable[..., Driver]:
    """The driver class of runtime ``name``.

    Raises:
        PitError: an unknown runtime, or one whose library is not installed.
    """
    if name == EAGER:
        from .torch_driver import TorchDriver

        return TorchDriver
    from ..targets import get_target

    return get_target(name).driver_class()
