"""Runtimes that run exported artifacts: one :class:`~pit_deploy.runtime.base.Driver` per
runtime (onnxruntime, the ExecuTorch runtime, PyTorch eager); a target names its driver
(:mod:`pit_deploy.targets`).

The runtime side never imports the export side: evaluation (verify, bench) and a device
harness need only this package and the runtime's own library.
"""

from .base import Driver
from .drivers import EAGER, driver_class

__all__ = ["EAGER", "Driver", "driver_class"]
