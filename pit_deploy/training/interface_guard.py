"""Keeping PIT's identity ``W_out E = I`` through training.

The stored ``Z`` is float32, so ``ZᵀZ = I + Δ`` with ``Δ`` of rounding size, and the interface
defect is ``W_out E − I = T Δ T⁻¹``: it grows with ``cond(T)``. AdamW moves every entry of ``L``
by about the learning rate whatever its size, and nothing in the Cholesky parameterization stops
those steps from lining up into a near-singular ``L`` while its diagonal stays where it was.
Then ``T``'s smallest eigenvalue collapses and ``delta_ti`` grows by orders of magnitude
(``docs/training.md``, "Keeping T well conditioned"; ``studies/t-conditioning.md`` has the
reproduction and the measured choice among the remedies).

:class:`InterfaceGuard` does three things after every optimizer step, with ``d×d`` work only:

* floors ``T``'s spectrum at ``λ_max / max_cond`` (``--t-max-cond``;
  :meth:`~pit_deploy.model.core.PITInterface.floor_spectrum_`), a projection that leaves a ``T``
  within the bound untouched;
* measures ``cond(T)``, its extreme eigenvalues and ``delta_ti`` for ``metrics.jsonl``
  (:meth:`~pit_deploy.model.core.PITInterface.conditioning`);
* stops the run with :class:`IdentityLost` (exit 1) when ``delta_ti`` exceeds
  ``--max-delta-ti``, before the step is checkpointed, so every checkpoint on disk keeps the
  identity.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import PitError
from ..model.core import Conditioning, PITInterface


class IdentityLost(PitError):
    """Training broke ``delta_ti ≤ --max-delta-ti``: a verification bound failed (exit 1).

    The options were valid and the input usable, so this is not exit 2; the CLI still prints
    one ``error:`` line naming the bound, the step and what to change.
    """

    exit_code = 1


class InterfaceGuard:
    """The conditioning floor, the logged figures and the identity bound of one PIT run.

    Args:
        interface: the model's PIT interface.
        max_cond: cap on ``cond(T)`` (``None`` or 0: no floor). A start above it keeps its own
            condition number as the cap: the model it was given is never changed by the guard.
        max_delta_ti: bound on ``delta_ti`` (``None`` or 0: no check).

    Raises:
        PitError: the starting model already breaks the bound (exit 2: unusable input).
    """

    def __init__(self, interface: PITInterface, max_cond: float | None, max_delta_ti: float | None) -> None:
        self.interface = interface
        self.start = interface.conditioning()
        self.max_cond = max(max_cond, self.start.cond) if max_cond else None
        self.max_delta_ti = max_delta_ti or None
        self.trains = interface.L_diag.requires_grad or interface.L_offdiag.requires_grad
        self.floored = 0  # steps whose T was floored since the last record
        self.current = self.start
        if self.max_delta_ti is not None and not self.start.delta_ti <= self.max_delta_ti:
            raise PitError(
                f"the starting model already breaks W_out E = I: delta_ti {self.start.delta_ti:.3g} exceeds "
                f"--max-delta-ti {self.max_delta_ti:g} (cond(T) {self.start.cond:.3g}); start from a model that "
                "keeps the identity (an earlier checkpoint), or pass --max-delta-ti 0 to train it as it is")

    def after_step(self) -> Conditioning:
        """Floor ``T`` if it went past the cap, then measure; call after every optimizer step."""
        current = self.interface.conditioning()
        if self.max_cond is not None and self.trains and current.cond > self.max_cond:
            if self.interface.floor_spectrum_(self.max_cond):
                self.floored += 1
                current = self.interface.conditioning()
        self.current = current
        return current

    def record(self) -> dict[str, Any]:
        """The figures of the last step for ``metrics.jsonl``; resets the floored-step count."""
        c = self.current
        out = {"delta_ti": c.delta_ti, "t_cond": c.cond, "t_eig_min": c.eig_min, "t_eig_max": c.eig_max,
               "l_diag_min": c.l_diag_min, "l_diag_max": c.l_diag_max, "t_floored": self.floored}
        self.floored = 0
        return out

    def broken(self) -> bool:
        """Whether the last measured step breaks the identity bound (non-finite counts)."""
        return self.max_delta_ti is not None and not self.current.delta_ti <= self.max_delta_ti

    def error(self, step: int, last_good: str, lr_t: float) -> IdentityLost:
        """The one-line stop for :meth:`broken` at ``step``."""
        c = self.current
        remedy = (f"cond(T) was capped at {self.max_cond:g}: lower --t-max-cond, or T's rate --lr-t" if self.max_cond
                  else "The cond(T) floor was off: turn it on (--t-max-cond 1e3), or lower T's rate --lr-t")
        return IdentityLost(
            f"W_out E = I no longer holds at step {step}: delta_ti {c.delta_ti:.3g} exceeds --max-delta-ti "
            f"{self.max_delta_ti:g} (cond(T) {_fmt(c.cond)}, smallest eigenvalue {c.eig_min:.3g}); training "
            f"stopped before this step was saved: {last_good}. {remedy} (now {lr_t:g}) or --lr")


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3g}"
