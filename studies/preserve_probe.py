"""Shared by the `preserve` calibration studies: the default source model's head written as
``logits = n · G · H⁻¹ Uᵀ`` (``n`` the final state normalized before the final norm's gain), so a
candidate symmetric gain ``G`` can be scored on cached states without building a model."""

from __future__ import annotations

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pit_deploy.io.sources import load_source  # noqa: E402
from pit_deploy.model.core import polar_factor, spd_and_inverse  # noqa: E402
from pit_deploy.model.families import adapter_for  # noqa: E402
from pit_deploy.model.inspect import effective_interface  # noqa: E402


class SourceHead:
    """The source model, ``U``, ``H⁻¹``, the head's ``A`` (``n A H⁻¹ Uᵀ`` are its logits) and ``K = H⁻¹ Uᵀ``."""

    def __init__(self, model: str = "default"):
        src = load_source(model)
        self.model, self.tokenizer = src.model.eval(), src.tokenizer
        e_eff, w_eff, _ = effective_interface(self.model)
        u, h = polar_factor(e_eff)
        self.u, h = u.double(), h.double()
        h_sym, self.h_inv = spd_and_inverse(h)
        self.norm = adapter_for(self.model.config).final_norm(self.model)
        self.eps = float(getattr(self.norm, "variance_epsilon", 1e-6))
        gain = self.norm.weight.detach().double()
        self.a = gain[:, None] * (w_eff @ self.u @ h_sym)
        self.k = (self.h_inv @ self.u.T).float()  # d x V

    @torch.no_grad()
    def states(self, rows_with_start) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalized final states ``n`` and the source's log-probs at the scored positions
        (from ``start - 1`` on) of each ``(ids, start)`` row."""
        ns, lps, cap = [], [], []
        hook = self.norm.register_forward_pre_hook(lambda _m, args: cap.append(args[0].detach()))
        try:
            for seq, start in rows_with_start:
                cap.clear()
                logits = self.model(input_ids=seq[None]).logits[0, :-1].float()
                x = cap[-1][0, :-1].double()
                n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
                ns.append(n[start - 1:].float())
                lps.append(torch.log_softmax(logits[start - 1:], -1))
        finally:
            hook.remove()
        return torch.cat(ns), torch.cat(lps)

    @torch.no_grad()
    def kl(self, g: torch.Tensor, n: torch.Tensor, lp: torch.Tensor, chunk: int = 512) -> float:
        """Mean KL(source ‖ head with gain ``G``) over the cached positions."""
        total = 0.0
        for i in range(0, len(n), chunk):
            q = torch.log_softmax(n[i:i + chunk] @ g.float() @ self.k, -1)
            p = lp[i:i + chunk]
            total += float((p.exp() * (p - q)).sum())
        return total / len(n)
