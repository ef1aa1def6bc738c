"""The export stage: recipes (:mod:`.recipes`), module passes (:mod:`.passes`), one exporter per
runtime (:mod:`.to_onnx`, :mod:`.to_executorch`) registered in :mod:`.registry`, and the
pipeline that writes an export directory with its manifest (:mod:`.pipeline`).
See ``docs/export.md``.
"""
