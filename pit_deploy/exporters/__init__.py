"""The export stage: recipes (:mod:`.recipes`), module passes (:mod:`.passes`), what the
targets' exporters share — the ONNX quantizer both ONNX targets use (:mod:`.quantize_onnx`, over
the graph surgery of :mod:`.onnx_graph` and the table codecs of :mod:`.onnx_tables`),
calibrated rounding (:mod:`.calibrated_rounding`), the residual rotation
(:mod:`.residual_rotation`), the expected error (:mod:`.expected_error`) — and the pipeline that
writes an export directory with its manifest (:mod:`.pipeline`). Each target's own exporter lives
in its folder, ``pit_deploy/targets/<name>/export.py``, and the target names it
(:mod:`pit_deploy.targets`). See ``docs/export.md``.
"""
