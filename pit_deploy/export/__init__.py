"""The export stage: recipes (:mod:`.recipes`), module passes (:mod:`.passes`), one exporter per
target (:mod:`.to_onnx`, :mod:`.to_genai`, :mod:`.to_executorch`, :mod:`.to_gguf`; each target in
:mod:`pit_deploy.targets` names its own), the quantizers and what they share (:mod:`.quantize_onnx`,
:mod:`.fold_onnx`, :mod:`.pte_head`, :mod:`.pte_token_table`, :mod:`.calibrated_rounding`,
:mod:`.residual_rotation`, :mod:`.expected_error`), the ExecuTorch helpers (:mod:`.llm_ops`,
:mod:`.xnnpack_rewrites`, :mod:`.runner_tokenizer`), and the pipeline that writes an export
directory with its manifest (:mod:`.pipeline`). See ``docs/export.md``.
"""
