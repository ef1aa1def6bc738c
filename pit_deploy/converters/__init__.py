"""Conversion of a causal LM to PIT (:mod:`.conversion`; the source-preserving conversion,
:mod:`.preserve`) and back to a vanilla untied model (:mod:`.materialize`). See
``docs/conversion.md``.
"""

from .conversion import convert_model, from_scratch
from .materialize import materialize_model

__all__ = ["convert_model", "from_scratch", "materialize_model"]
