"""The names a user picks the PIT interface's set-up by: ``T`` inits, diagonal maps and
conversions. Plain tuples in a module that imports nothing, so the command line lists them (and
answers ``--help``) without loading torch; the code that acts on each name imports it from here.
"""

from __future__ import annotations

#: the paper's inits of ``T`` from a source model's embedding (``docs/conversion.md``)
T_INITS: tuple[str, ...] = ("identity", "input", "output")
#: maps from ``L``'s free diagonal parameters to its positive diagonal
DIAGONAL_MAPS: tuple[str, ...] = ("softplus", "exp")
#: every conversion ``convert_model`` knows: the paper's T inits and the source-preserving fit
CONVERSIONS: tuple[str, ...] = (*T_INITS, "preserve")
#: the held-out loss rise (nats/token) past which ``convert`` refuses a conversion: 5× what
#: ``preserve`` costs the default model (+0.05), a tenth of what a Gemma 3 body-keeping conversion
#: costs (+2.9) and a thirtieth of the paper inits' 7–9 nats (docs/conversion.md, "Loss bound")
MAX_LOSS_RISE: float = 0.25
