"""Runtimes that run exported artifacts: one :class:`~pit_deploy.runtime.base.Driver` per
runtime (onnxruntime, onnxruntime-genai, the ExecuTorch runtime, llama.cpp, PyTorch eager:
:mod:`.drivers`); a target names its driver (:mod:`pit_deploy.targets`). Beside them: the
standalone decoders an edge bundle carries (:mod:`.standalone`, importing nothing of the
package), ExecuTorch's stock LLM runner (:mod:`.llm_runner`) and the transformers.js clients
(:mod:`.web_clients`).

The runtime side never imports the export side: evaluation (verify, bench) and a device
harness need only this package and the runtime's own library.
"""

from .base import Driver
from .drivers import EAGER, driver_class

__all__ = ["EAGER", "Driver", "driver_class"]
