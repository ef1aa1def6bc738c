"""Logit-lens traces: what each layer's hidden state "means" through the input and output
token interfaces (the paper's *transition trace*, Preliminaries).

For the medium token (by default the last prompt token) and every depth ``ℓ`` (0 = embedding
output, ``L`` = final layer), the hidden state ``f_ℓ`` goes through the model's final norm and
is read three ways:

* **logit lens**: ``softmax(norm(f_ℓ) W_out)`` — the model's own head, top-k tokens and
  probabilities (nostalgebraist's logit lens; Belrose et al., "Eliciting Latent Predictions
  from Transformers with the Tuned Lens", 2023).
* **output anchors**: the token whose ``B_out = W_out⁺`` row is most cosine-similar to
  ``norm(f_ℓ)``.
* **input anchors**: the token whose ``B_in = E`` row is most cosine-similar.

Under PIT ``B_out = B_in`` so the two anchor readings coincide at every layer; under transpose
tying they can disagree, which is the drift the paper's Figure 2 illustrates.
``LensTrace.anchor_agreement`` is the fraction of layers where they agree.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..io.fs import json_text
from ..model.inspect import unwrap_model, effective_interface
from .diagnostics import pseudo_inverse_rows
from .plotting import image_file
from ..model.families import adapter_for


@dataclass
class LayerReading:
    """Readings of one depth."""

    layer: int
    top_tokens: list[str]
    top_probs: list[float]
    output_anchor: str
    input_anchor: str


@dataclass
class LensTrace:
    """A logit-lens trace of one position; prints, serializes and plots itself."""

    prompt_tokens: list[str]
    position: int
    tying: str
    layers: list[LayerReading]

    @property
    def anchor_agreement(self) -> float:
        same = sum(r.output_anchor == r.input_anchor for r in self.layers)
        return same / len(self.layers)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["anchor_agreement"] = self.anchor_agreement
        return data

    def to_json(self, **kwargs: Any) -> str:
        return json_text(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        head = (f"logit lens at position {self.position} ({self.prompt_tokens[self.position]!r}), "
                f"tying={self.tying}, input/output anchor agreement {self.anchor_agreement:.0%}")
        lines = [head, f"{'layer':>5}  {'top-1 (p)':<28} {'out-anchor':<16} {'in-anchor':<16}"]
        for r in self.layers:
            top = f"{r.top_tokens[0]!r} ({r.top_probs[0]:.2f})"
            lines.append(f"{r.layer:>5}  {top:<28} {r.output_anchor!r:<16} {r.input_anchor!r:<16}")
        return "\n".join(lines)

    def plot(self, path: str | Path) -> Path:
        """Top-1 probability per layer, with layers where the anchors disagree marked."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        xs = [r.layer for r in self.layers]
        ps = [r.top_probs[0] for r in self.layers]
        fig, ax = plt.subplots(figsize=(7, 3.2))
        ax.plot(xs, ps, marker="o", label="logit-lens top-1 probability")
        bad = [r.layer for r in self.layers if r.output_anchor != r.input_anchor]
        if bad:
            ax.scatter(bad, [ps[xs.index(b)] for b in bad], color="red", zorder=3,
                       label="input/output anchors disagree")
        for x, r in zip(xs, self.layers):
            ax.annotate(r.top_tokens[0].strip()[:8] or "·", (x, ps[xs.index(x)]), fontsize=7,
                        textcoords="offset points", xytext=(0, 5), ha="center")
        ax.set_xlabel("layer")
        ax.set_ylabel("probability")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"logit lens ({self.tying}); anchor agreement {self.anchor_agreement:.0%}")
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        path = image_file(path)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


def _decode(tokenizer, ids: list[int]) -> list[str]:
    if tokenizer is None:
        return [f"<{i}>" for i in ids]
    return [tokenizer.decode([i]) for i in ids]


def _nearest_rows(anchors: torch.Tensor, vec: torch.Tensor) -> int:
    """Index of the anchor row with the largest cosine similarity to ``vec`` (zero rows never win)."""
    norms = anchors.norm(dim=1).clamp_min(torch.finfo(anchors.dtype).tiny)
    return int(((anchors @ vec) / norms).argmax())


@torch.no_grad()
def logit_lens(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    tokenizer=None,
    position: int = -1,
    top_k: int = 5,
) -> LensTrace:
    """Trace one position of ``input_ids`` (shape ``(1, S)``) through every layer.

    Args:
        model: a causal LM of a supported family (PIT, tied or untied; PEFT-wrapped is fine).
        input_ids: prompt token ids, ``(1, S)``.
        tokenizer: decodes token ids for display; ``None`` shows ids.
        position: which position's hidden states to read (default: the last token).
        top_k: how many logit-lens tokens to keep per layer.
    """
    base = unwrap_model(model)
    adapter = adapter_for(base.config)
    norm = adapter.final_norm(base)
    head = base.get_output_embeddings()
    out = model(input_ids, output_hidden_states=True)
    hidden = out.hidden_states  # L+1 states; the last one has the final norm applied already
    e, w, tying = effective_interface(base)
    b_out = pseudo_inverse_rows(w)
    multiplier = adapter.logits_multiplier(base.config)
    readings = []
    for layer, state in enumerate(hidden):
        h = state[0, position]
        normed = h if layer == len(hidden) - 1 else norm(h[None])[0]
        if layer == len(hidden) - 1:
            logits = out.logits[0, position].float()
        else:
            logits = head(normed[None])[0].float() * multiplier
        probs = torch.softmax(logits, dim=-1)
        top = probs.topk(top_k)
        vec = normed.to(torch.float64)
        readings.append(LayerReading(
            layer=layer,
            top_tokens=_decode(tokenizer, top.indices.tolist()),
            top_probs=[float(p) for p in top.values],
            output_anchor=_decode(tokenizer, [_nearest_rows(b_out, vec)])[0],
            input_anchor=_decode(tokenizer, [_nearest_rows(e, vec)])[0],
        ))
    tokens = _decode(tokenizer, input_ids[0].tolist())
    pos = position if position >= 0 else len(tokens) + position
    return LensTrace(prompt_tokens=tokens, position=pos, tying=tying, layers=readings)
