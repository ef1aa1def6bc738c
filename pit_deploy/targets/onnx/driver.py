"""Driver of the ``onnx`` target (:mod:`pit_deploy.targets.onnx`): the shared onnxruntime
driver (:class:`~pit_deploy.runtime.ort_driver.OrtDriver`) over optimum's decoder and the
interface graph, found in either of the target's layouts."""

from __future__ import annotations

from pathlib import Path

from ...runtime.ort_driver import OrtDriver
from . import decoder_file, interface_file

__all__ = ["OnnxDriver"]


class OnnxDriver(OrtDriver):
    """optimum's decoder through :class:`~pit_deploy.runtime.standalone.OrtDecoder`; the interface
    graph through its own session."""

    runtime = "onnx"

    def decoder_path(self) -> Path:
        return decoder_file(self.folder)

    def interface_path(self) -> Path:
        return interface_file(self.folder)
