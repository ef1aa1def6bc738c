"""pit_deploy: Pseudo-Inverse Tying for compact causal LMs, from conversion to on-device parity.

The public entry points are re-exported lazily so that ``import pit_deploy`` stays cheap and
the core math (``pit_deploy.core``) can be used without transformers.
"""

from __future__ import annotations

__version__ = "0.1.0"
