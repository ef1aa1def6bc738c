"""What runs exported artifacts, shared by the targets: the :class:`~pit_deploy.runtime.base.Driver`
interface, finding a runtime's driver by name (:mod:`.drivers`; PyTorch eager: :mod:`.torch_driver`),
the onnxruntime driver both ONNX targets build on (:mod:`.ort_driver`), the standalone decoders an edge bundle carries
(:mod:`.standalone`, importing nothing of the package), the emulated aarch64 runs
(:mod:`.emulated`) and the transformers.js clients (:mod:`.web_clients`). Each target's own
driver lives in its folder, ``pit_deploy/targets/<name>/driver.py``, and the target names it
(:mod:`pit_deploy.targets`).

The runtime side never imports the export side: evaluation (verify, bench) and a device
harness need only this package and the runtime's own library.
"""

from .base import Driver
from .drivers import EAGER, driver_class

__all__ = ["EAGER", "Driver", "driver_class"]
