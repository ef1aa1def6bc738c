"""Evaluation of exported artifacts on their runtimes: parity verification (:mod:`.verify`)
with per-dtype bounds (:mod:`.bounds`). Built on :mod:`pit_deploy.runtime` only."""
