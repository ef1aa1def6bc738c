"""Runtimes that run exported artifacts: one :class:`~pit_deploy.runtime.base.Driver` per
runtime (onnxruntime, the ExecuTorch runtime, PyTorch eager), found by name in a registry.

The runtime side never imports the export side: evaluation (verify, bench) and a device
harness need only this package and the runtime's own library.
"""

from .base import DRIVERS, Driver, driver_class, register_driver

__all__ = ["DRIVERS", "Driver", "driver_class", "register_driver"]
