"""pit_deploy: Pseudo-Inverse Tying for compact causal LMs, from conversion to on-device parity.

The stages are sub-packages, in pipeline order: ``model`` (the PIT interface and its modules),
``io`` (files, checkpoints, sources, manifests), ``convert``, ``train``, ``export``, ``runtime``
(one driver per runtime), ``evaluate`` (verify) and ``analysis`` (diagnostics, probe, plots);
``cli`` sits on top. ``import pit_deploy`` imports none of them.
"""

from __future__ import annotations

__version__ = "0.1.0"
