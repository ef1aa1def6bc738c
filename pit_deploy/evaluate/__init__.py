"""Evaluation of exported artifacts on their runtimes: parity verification (:mod:`.verify`, with
each scheme's bounds from :mod:`pit_deploy.schemes`; the stock ExecuTorch runner's check,
:mod:`pit_deploy.targets.executorch.stock_runner`; transformers.js, :mod:`pit_deploy.targets.onnx.web_check`) and benchmarks (:mod:`.bench`, one
process per cell, :mod:`.bench_cell`; phones over adb, :mod:`pit_deploy.targets.executorch.bench_adb`; the shared row schema,
:mod:`.bench_rows`). Built on :mod:`pit_deploy.runtime` only. See ``docs/verify.md`` and
``docs/bench.md``.
"""
