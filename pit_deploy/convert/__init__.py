"""Conversion of a causal LM to PIT (:mod:`.conversion`) and back to a vanilla untied model
(:mod:`.materialize`)."""

from .conversion import convert_model, from_scratch
from .materialize import materialize_model

__all__ = ["convert_model", "from_scratch", "materialize_model"]
