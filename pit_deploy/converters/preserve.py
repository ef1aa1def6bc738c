"""Source-preserving conversion (``--t-init preserve``): an exact PIT interface that keeps what
the source model knew, with no gradient training.

A tied model has ``W_out E = H²`` (``E0 = U H``, thin polar); PIT needs ``I``. The conversion
(``docs/conversion.md`` has the derivation):

1. ``T = H⁻¹`` in a rotated basis, so the input side is exact: ``E = E0 R``.
2. Every block norm's gain is folded into the linears that read it; then a global orthogonal
   rotation ``R`` of the residual stream is an exact symmetry of a pre-norm RMSNorm model
   (``‖x R‖ = ‖x‖``, the idea behind SliceGPT, Ashkboos et al. 2024): readers ``W → W R``,
   writers ``W → Rᵀ W``.
3. The final norm's diagonal gain ``D`` then acts as ``G = R D Rᵀ``, any symmetric matrix. The
   source head acts as ``n A H⁻¹ Uᵀ`` with ``A = diag(g) W_outᵀ… `` (see the docs), so ``G`` is
   fitted to ``A`` where it matters: ``min tr(C (G−A) P (G−A)ᵀ)`` over symmetric ``G``, with
   ``C`` the second moment of the normalized final states and ``P = H⁻¹ F H⁻¹`` (``F`` the
   softmax Fisher matrix mapped into d-space), both from calibration text — one such term per
   group of calibration positions (chat prompt, first answer token, rest of the answer, plain
   text), summed. With one term the stationarity condition ``C G P + P G C = C A P + P A C``
   has a closed form through two symmetric eigendecompositions; the sum is solved by conjugate
   gradients preconditioned with that closed form. ``G = R D Rᵀ`` gives the rotation and the
   new gain.
4. ``Z = U R``, ``T = Rᵀ H⁻¹ R``: ``W_out E = I`` exactly, the body computes what it computed.

Families whose blocks normalize their outputs before the residual add (Gemma 2 and 3:
``FamilyAdapter.post_norms``) have no rotation symmetry: a post-norm's gain acts on the residual
stream's own coordinates after a normalization, with no linear to fold it into. There the body
is kept exactly (``R = I``: ``Z = U``, ``T = H⁻¹``, ``E = E0``) and only the final gain is fitted,
as a diagonal ``G`` (:func:`fit_diagonal_grouped`). That is all a closed form can keep without
training, and on a real Gemma 3 it keeps little of the head (``docs/conversion.md``,
"Post-normalized blocks").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn
from transformers import PreTrainedModel

from ..errors import PitError
from ..model.core import PITInterface, PITSpec, gram64, polar_factor, rotate_rows, row_chunks, spd_and_inverse
from ..model.families import adapter_for, max_positions

log = logging.getLogger(__name__)

#: Pre-norm RMSNorm blocks read the residual stream only through their norms: each norm's
#: reading linears (by Llama-layout role), and the linears that write into the stream. Qwen3's
#: per-head q/k norms act after the projections: a residual rotation leaves them untouched.
_READERS = {"input_layernorm": ("self_attn", ("q_proj", "k_proj", "v_proj")),
            "post_attention_layernorm": ("mlp", ("gate_proj", "up_proj"))}
_WRITERS = (("self_attn", "o_proj"), ("mlp", "down_proj"))
#: the covered families and their norms' gain offset: the effective gain is ``w + offset``
#: (Gemma's RMSNorm multiplies by ``1 + w``, so a gain ``g`` is stored as ``w = g − 1``).
PRESERVE_FAMILIES = {"llama": 0.0, "mistral": 0.0, "qwen2": 0.0, "qwen3": 0.0, "granite": 0.0, "gemma": 1.0,
                     "smollm3": 0.0, "phi3": 0.0, "gemma2": 1.0, "gemma3_text": 1.0}
#: why families outside :data:`PRESERVE_FAMILIES` are refused
_REFUSED = {"gpt2": "uses LayerNorm (mean-centering, biases)"}
CALIB_PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that adds two numbers.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for writing clear emails.",
    "What is 17 times 23?",
    "Summarize the water cycle for a child.",
    "How do I reverse a list in Python?",
    "Translate 'good morning' into Spanish and French.",
    "Explain recursion with a short example.",
    "What causes the seasons on Earth?",
    "Suggest a name for a small bakery.",
    "How do I make a cup of green tea?",
    "What is the difference between a list and a tuple in Python?",
    "Describe a cat in one sentence.",
    "What is the largest ocean on Earth?",
    "Give two reasons to exercise regularly.",
    "Convert 5 kilometers to miles.",
    "What is an API?",
    "Write a short thank-you note to a teacher.",
    "Who painted the Mona Lisa?",
    "What is the chemical symbol for gold?",
    "How does a bicycle stay upright?",
    "Write a SQL query that counts rows in a table.",
    "What is the freezing point of water in Fahrenheit?",
    "Name a famous composer from Austria.",
    "What is a prime number?",
    "How do vaccines work, briefly?",
    "What is the capital of Canada?",
    "Recommend a book for a beginner programmer.",
    "What does HTML stand for?",
    "Describe the color blue to someone who cannot see.",
    "How many continents are there?",
)
#: the share of the calibration budget the chat rows may take (the rest is corpus text). On the
#: default model more chat prompts took the held-out chat KL down for a small cost on code
#: (docs/conversion.md, "Calibration"; studies/results/preserve_calibration_mix.json).
CHAT_SHARE = 0.6


def supports_preserve(config: Any) -> bool:
    return getattr(config, "model_type", None) in PRESERVE_FAMILIES


def _sub(module: nn.Module, dotted: str) -> nn.Module:
    for part in dotted.split("."):
        module = getattr(module, part)
    return module


# --------------------------------------------------------------------------------------
# Calibration
# --------------------------------------------------------------------------------------


@dataclass
class CalibrationSet:
    """Token-id rows to calibrate on and, where a row's source run was already done (the chat
    rows, during their generation), the final norm's inputs at each of its positions whose state
    that run computed (``None``: the row still needs a forward pass). ``prompt_lens`` gives a
    chat row's prompt length (prompt in the chat template, before the answer) and ``None`` for
    a row of plain text; the statistics group positions by it (:func:`position_groups`)."""

    rows: list[torch.Tensor]
    states: list[torch.Tensor | None]
    prompt_lens: list[int | None] | None = None

    def __post_init__(self) -> None:
        if self.prompt_lens is None:
            self.prompt_lens = [None] * len(self.rows)

    def __add__(self, other: "CalibrationSet") -> "CalibrationSet":
        return CalibrationSet(self.rows + other.rows, self.states + other.states,
                              list(self.prompt_lens) + list(other.prompt_lens))

    @property
    def tokens(self) -> int:
        return sum(len(r) for r in self.rows)


def calibration_set(model: PreTrainedModel, tokenizer: Any, data: str = "default", tokens: int = 4096,
                    seq_len: int = 256, chat: bool = True, seed: int = 0) -> CalibrationSet:
    """What to calibrate on: when the tokenizer has a chat template, the model's own greedy
    answers to fixed prompts in that template (up to :data:`CHAT_SHARE` of ``tokens``) — so
    chat-formatted text is covered without any dataset — then the training split of ``data``
    (packed rows of ``seq_len``) for the rest of the budget.
    Without a tokenizer: seeded random ids (the fit then only sees the model's own statistics)."""
    if tokenizer is None:
        gen = torch.Generator().manual_seed(seed)
        n = max(1, tokens // seq_len)
        rows = [torch.randint(0, model.config.vocab_size, (seq_len,), generator=gen) for _ in range(n)]
        return CalibrationSet(rows, [None] * n)
    from ..data.corpus import DataConfig, TextSource, encode

    found = CalibrationSet([], [])
    if chat and getattr(tokenizer, "chat_template", None):
        found = chat_calibration(model, tokenizer, budget=int(CHAT_SHARE * tokens))
    budget = tokens - found.tokens
    cfg = DataConfig(spec=data, seq_len=seq_len, seed=seed)
    buf: list[int] = []
    corpus: list[torch.Tensor] = []
    for doc in TextSource(cfg).train_documents(0, 0, None):
        ids, _ = encode(doc, tokenizer)
        buf += ids
        while len(buf) >= seq_len and budget > 0:
            corpus.append(torch.tensor(buf[:seq_len], dtype=torch.long))
            buf, budget = buf[seq_len:], budget - seq_len
        if budget <= 0:
            break
    found = found + CalibrationSet(corpus, [None] * len(corpus))
    if not found.rows:
        raise PitError(f"--calib {data}: no text to calibrate on")
    return found


def chat_rows(model: PreTrainedModel, tokenizer: Any, prompts: Iterable[str] = CALIB_PROMPTS,
              max_new_tokens: int = 48, budget: int | None = None, batch: int = 32) -> list[torch.Tensor]:
    """The token rows of :func:`chat_calibration` (prompt in the chat template + greedy answer)."""
    return chat_calibration(model, tokenizer, prompts, max_new_tokens, budget, batch).rows


@torch.no_grad()
def chat_calibration(model: PreTrainedModel, tokenizer: Any, prompts: Iterable[str] = CALIB_PROMPTS,
                     max_new_tokens: int = 48, budget: int | None = None, batch: int = 32) -> CalibrationSet:
    """Each fixed prompt in the chat template, followed by the model's own greedy answer (up to
    and including its end-of-sequence token), in order, until the rows hold ``budget`` tokens
    (always at least one row) — with the final norm's inputs the generation computed for them.

    Prompts are generated ``batch`` at a time, left-padded with an attention mask: for the 32
    default prompts on the default model one batch of 32 was the fastest of the batch sizes
    timed, with identical rows (``studies/conversion-preserve.md``). A forward pre-hook on the final norm
    keeps each step's hidden states, so the calibration statistics need no second pass over
    these rows: every position's state is computed during generation except the last token of a
    row that was still generating at the final step (that position is left out).
    """
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
    encoded = []
    for text in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        encoded.append(list(ids) if isinstance(ids, list) else list(ids["input_ids"]))
    found = CalibrationSet([], [])
    step = max(1, batch)
    captured: list[torch.Tensor] = []
    norm = adapter_for(model.config).final_norm(model)
    handle = norm.register_forward_pre_hook(lambda _m, args: captured.append(args[0].detach()))

    def full() -> bool:
        return bool(found.rows) and budget is not None and found.tokens >= budget

    try:
        for first in range(0, len(encoded), step):
            if full():
                break
            chunk = encoded[first:first + step]
            width = max(len(ids) for ids in chunk)
            input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in chunk], dtype=torch.long)
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in chunk], dtype=torch.long)
            captured.clear()
            out = model.generate(input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=pad)
            states = torch.cat(captured, dim=1)  # (batch, positions the model ran on, d)
            for b, (ids, generated) in enumerate(zip(chunk, out[:, width:].tolist())):
                if full():
                    break
                if eos is not None and eos in generated:
                    generated = generated[:generated.index(eos) + 1]
                start, stop = width - len(ids), width + len(generated)
                found.rows.append(torch.tensor(ids + generated, dtype=torch.long))
                found.states.append(states[b, start:min(stop, states.shape[1])])
                found.prompt_lens.append(len(ids))
    finally:
        handle.remove()
    return found


#: Position groups of the calibration statistics (:func:`position_groups`).
TEXT, PROMPT, FIRST_ANSWER, ANSWER = "text", "chat prompt", "first answer token", "chat answer"
#: How much more a first answer token counts than any other calibration position. The first
#: token of an answer decides which answer greedy decoding gives; weighting the 32 calibration
#: prompts' first answer tokens ×10 wins back the held-out code KL that separate group terms
#: cost on the default model, for a slight rise of the chat KL (docs/conversion.md, "One term per
#: group of positions"; studies/preserve_groups.py).
FIRST_ANSWER_WEIGHT = 10.0


def position_groups(positions: int, prompt_len: int | None, skip: int = 0) -> list[str | None]:
    """The group of each position of a calibration row (position ``j`` predicts token ``j+1``):
    all :data:`TEXT` for a plain-text row; for a chat row with a ``prompt_len``-token prompt,
    :data:`PROMPT` before ``prompt_len − 1``, :data:`FIRST_ANSWER` there, :data:`ANSWER` after.
    The first ``skip`` positions are left out (``None``): the chat template's shared prefix
    (system prompt), whose states are the same in every chat row, counts once, not once per row.
    """
    if prompt_len is None:
        return [TEXT] * positions
    return [None if j < skip else PROMPT if j < prompt_len - 1 else FIRST_ANSWER if j == prompt_len - 1 else ANSWER
            for j in range(positions)]


def _shared_prefix(calib: CalibrationSet) -> int:
    """Length of the prompt prefix every chat row shares (0 with fewer than two chat rows)."""
    prompts = [row[:n].tolist() for row, n in zip(calib.rows, calib.prompt_lens) if n is not None]
    if len(prompts) < 2:
        return 0
    common = min(len(p) for p in prompts)
    for j in range(common):
        if any(p[j] != prompts[0][j] for p in prompts[1:]):
            return j
    return common


@dataclass
class StatGroup:
    """One group's ``C = E[nᵀn]`` and d-space Fisher ``F`` (float64), its token count and its
    weight in the fit (tokens × the group's multiplier)."""

    name: str
    second_moment: torch.Tensor
    fisher: torch.Tensor
    tokens: int
    weight: float


@dataclass
class CalibrationStats:
    """Per-group statistics of the calibration positions (:func:`position_groups`)."""

    groups: list[StatGroup]

    @property
    def tokens(self) -> int:
        return sum(g.tokens for g in self.groups)

    def _pooled(self, field: str) -> torch.Tensor:
        total = sum(g.weight for g in self.groups)
        return sum(getattr(g, field) * (g.weight / total) for g in self.groups)

    @property
    def second_moment(self) -> torch.Tensor:
        """The weighted mean of the groups' ``C``."""
        return self._pooled("second_moment")

    @property
    def fisher(self) -> torch.Tensor:
        """The weighted mean of the groups' ``F``."""
        return self._pooled("fisher")


def _head_logits(model: PreTrainedModel, x: torch.Tensor) -> torch.Tensor:
    """The source's logits from final-norm inputs ``x``: the final norm, the head, Granite's
    ``logits_scaling`` and Gemma 2's final soft-capping (the families in
    :data:`PRESERVE_FAMILIES` apply nothing else)."""
    head = model.get_output_embeddings()
    logits = head(adapter_for(model.config).final_norm(model)(x))
    logits = logits / float(getattr(model.config, "logits_scaling", 1.0) or 1.0)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return logits if not cap else torch.tanh(logits / cap) * cap


class _GroupSums:
    """Running sums of one group: ``Σ nᵀn``, ``Σ (Uᵀp)(Uᵀp)ᵀ``, ``Σ p`` and the count."""

    def __init__(self, d: int, vocab: int):
        self.c = torch.zeros(d, d, dtype=torch.float64)
        self.s = torch.zeros(d, d, dtype=torch.float64)
        self.pbar = torch.zeros(vocab, dtype=torch.float64)
        self.count = 0

    def add(self, n: torch.Tensor, p: torch.Tensor, pu: torch.Tensor, rows: torch.Tensor) -> None:
        """Add the positions ``rows`` (indices) of one sequence: ``n``, ``p``, ``pu`` are the whole
        sequence's (``p``'s rows are summed by a product, not copied out: a row of a 262k-token
        vocabulary is 1 MiB)."""
        n, pu = n[rows], pu[rows]
        self.c += n.T @ n
        self.s += pu.T @ pu
        pick = torch.zeros(p.shape[0], dtype=p.dtype)
        pick[rows] = 1.0
        self.pbar += (pick @ p).to(torch.float64)
        self.count += n.shape[0]

    def finish(self, name: str, u: torch.Tensor, multiplier: float) -> StatGroup:
        pbar = self.pbar / self.count
        fisher = gram64(u, weight=pbar) - self.s / self.count
        return StatGroup(name, self.c / self.count, 0.5 * (fisher + fisher.T), self.count, self.count * multiplier)


#: rows of a sequence's logits turned into probabilities at a time (see :func:`softmax_in_place`)
SOFTMAX_ROWS = 16


def softmax_in_place(logits: torch.Tensor) -> torch.Tensor:
    """``torch.softmax(logits, -1)`` of a ``(positions, V)`` tensor, written over ``logits``
    :data:`SOFTMAX_ROWS` rows at a time, and returned: a sequence's logits and probabilities are
    256 MiB each at 262k tokens, the peak of a conversion at that vocabulary. Each row's softmax
    is computed on its own, so the values are those of one call on the whole tensor."""
    for start in range(0, logits.shape[0], SOFTMAX_ROWS):
        part = logits[start:start + SOFTMAX_ROWS]
        part.copy_(torch.softmax(part, dim=-1))
    return logits


@torch.no_grad()
def calibration_stats(model: PreTrainedModel, calib: CalibrationSet | list[torch.Tensor],
                      u: torch.Tensor) -> CalibrationStats:
    """The source's normalized final states ``n`` (the final norm's output before its gain) and
    next-token distributions ``p`` over ``calib``, summed per position group: rows with
    recorded states reuse them (only the head runs), the others go through the model."""
    if not isinstance(calib, CalibrationSet):
        calib = CalibrationSet(list(calib), [None] * len(calib))
    norm = adapter_for(model.config).final_norm(model)
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
    captured: list[torch.Tensor] = []
    handle = norm.register_forward_pre_hook(lambda _m, args: captured.append(args[0].detach()))
    u32 = u.to(torch.float32)
    sums: dict[str, _GroupSums] = {}
    shared, seen_chat = _shared_prefix(calib), False
    try:
        model.eval()
        for row, state, prompt_len in zip(calib.rows, calib.states, calib.prompt_lens):
            if state is None:
                captured.clear()
                logits = model(input_ids=row[None]).logits[0].float()
                state = captured[-1][0]
            else:
                logits = _head_logits(model, state).float()
            x = state.to(torch.float64)
            n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            p = softmax_in_place(logits)  # the logits' own memory now holds the probabilities
            pu = (p @ u32).to(torch.float64)
            labels = position_groups(len(x), prompt_len, shared if seen_chat else 0)
            seen_chat = seen_chat or prompt_len is not None
            for name in dict.fromkeys(lab for lab in labels if lab is not None):
                idx = torch.tensor([j for j, lab in enumerate(labels) if lab == name])
                if name not in sums:  # not setdefault: that would allocate a V-sized sum per row
                    sums[name] = _GroupSums(u.shape[1], u.shape[0])
                sums[name].add(n, p, pu, idx)
    finally:
        handle.remove()
    if not sums:
        raise PitError("calibration produced no tokens")
    return CalibrationStats([
        total.finish(name, u32, FIRST_ANSWER_WEIGHT if name == FIRST_ANSWER else 1.0) for name, total in sums.items()
    ])


# --------------------------------------------------------------------------------------
# The fit
# --------------------------------------------------------------------------------------


def source_head_times(model: PreTrainedModel, u: torch.Tensor) -> torch.Tensor:
    """``W_out U`` (``d×d``, float64) of the source's effective head (its logits multiplier
    folded in), a chunk of rows at a time."""
    head = model.get_output_embeddings().weight.detach()
    total = torch.zeros(u.shape[1], u.shape[1], dtype=torch.float64)
    for part, chunk in row_chunks(u):
        total += head[part].to(torch.float64).T @ chunk
    return total * adapter_for(model.config).logits_multiplier(model.config)


def _sym(m: torch.Tensor) -> torch.Tensor:
    return 0.5 * (m + m.T)


def _sym_sqrt_inv(m: torch.Tensor, ridge: float) -> torch.Tensor:
    evals, evecs = torch.linalg.eigh(m)
    evals = evals.clamp_min(ridge * evals.max().clamp_min(1e-300))
    return (evecs * evals.rsqrt()) @ evecs.T


class _KroneckerSolver:
    """Solves ``C X P + P X C = B`` for symmetric ``X`` (``C``, ``P`` SPD, ``B`` symmetric).

    With ``W`` such that ``Wᵀ C W = I`` and ``Wᵀ P W = Λ`` (from ``C^{-1/2}`` and the
    eigendecomposition of ``C^{-1/2} P C^{-1/2}``), ``X = W Y Wᵀ`` turns it into
    ``Y Λ + Λ Y = Wᵀ B W``: ``Y_ij = (Wᵀ B W)_ij / (λ_i + λ_j)``."""

    def __init__(self, c: torch.Tensor, p: torch.Tensor, ridge: float = 1e-8):
        c_mh = _sym_sqrt_inv(_sym(c), ridge)
        lam, q = torch.linalg.eigh(c_mh @ _sym(p) @ c_mh)
        self.lam = lam.clamp_min(ridge * lam.max().clamp_min(1e-300))
        self.w = c_mh @ q

    def __call__(self, b: torch.Tensor) -> torch.Tensor:
        y = (self.w.T @ b @ self.w) / (self.lam[:, None] + self.lam[None, :])
        return _sym(self.w @ _sym(y) @ self.w.T)


def fit_symmetric(a: torch.Tensor, c: torch.Tensor, p: torch.Tensor, ridge: float = 1e-8) -> torch.Tensor:
    """The symmetric ``G`` minimizing ``tr(C (G−A) P (G−A)ᵀ)`` (all float64, ``C``, ``P`` SPD).

    Stationarity: ``C G P + P G C = C A P + P Aᵀ C``, solved in closed form by
    :class:`_KroneckerSolver` (two symmetric eigendecompositions, no iteration)."""
    c, p = _sym(c), _sym(p)
    return _KroneckerSolver(c, p, ridge)(c @ a @ p + p @ a.T @ c)


Term = tuple[float, torch.Tensor, torch.Tensor]


def fit_symmetric_grouped(a: torch.Tensor, terms: list[Term], ridge: float = 1e-8, rtol: float = 1e-6,
                          max_iter: int = 40) -> torch.Tensor:
    """The symmetric ``G`` minimizing ``Σ_k w_k tr(C_k (G−A) P_k (G−A)ᵀ)`` over ``terms``
    ``(w_k, C_k, P_k)`` (float64).

    One Kronecker term per group of positions (chat prompt, answer, plain text…) is a closer
    second-order model of the KL than one pooled ``C ⊗ P`` when the groups' statistics differ.
    Stationarity, ``Σ_k w_k (C_k G P_k + P_k G C_k) = Σ_k w_k (C_k A P_k + P_k Aᵀ C_k)``, is a
    symmetric positive definite linear system in ``G``. It is solved by conjugate gradients in
    the basis ``W`` of the pooled term's closed form (:class:`_KroneckerSolver`): there
    ``G = W Y Wᵀ``, the pooled operator is diagonal (``Y_ij (λ_i + λ_j)``) and serves as the
    preconditioner, and the system is well scaled, so the iterations run in float32 (the
    statistics' own precision). One term converges at once. On the default model's four
    groups 40 iterations come close to the converged objective and leave the held-out KL
    unchanged (``docs/conversion.md``, "One term per group of positions"), hence ``max_iter=40``.
    """
    total = sum(w for w, _, _ in terms)
    terms = [(w / total, _sym(c), _sym(p)) for w, c, p in terms]
    basis = _KroneckerSolver(sum(w * c for w, c, _ in terms), sum(w * p for w, _, p in terms), ridge)
    wt = basis.w
    rhs = sum(w * (c @ a @ p + p @ a.T @ c) for w, c, p in terms)
    # In the basis: C̃_k = Wᵀ C_k W, P̃_k = Wᵀ P_k W, the right-hand side Wᵀ B W.
    white = [(w, (wt.T @ c @ wt).float(), (wt.T @ p @ wt).float()) for w, c, p in terms]
    b = (wt.T @ rhs @ wt).float()
    scale = (basis.lam[:, None] + basis.lam[None, :]).float()

    def op(y: torch.Tensor) -> torch.Tensor:
        out = sum(w * (c @ y @ p) for w, c, p in white)
        return out + out.T

    y = b / scale
    r = b - op(y)
    z = r / scale
    direction, rz, stop = z, float((r * z).sum()), rtol * float(b.norm())
    for _ in range(max_iter):
        if float(r.norm()) <= stop:
            break
        ad = op(direction)
        alpha = rz / float((direction * ad).sum())
        y, r = y + alpha * direction, r - alpha * ad
        z = r / scale
        rz_next = float((r * z).sum())
        direction, rz = z + (rz_next / rz) * direction, rz_next
    return _sym(wt @ _sym(y.to(torch.float64)) @ wt.T)


def fit_diagonal_grouped(a: torch.Tensor, terms: list[Term]) -> torch.Tensor:
    """The diagonal ``G = diag(x)`` minimizing ``Σ_k w_k tr(C_k (G−A) P_k (G−A)ᵀ)`` (float64).

    The gradient in ``x_i`` is ``2 Σ_k w_k [C_k (G−A) P_k]_ii``, so the minimum solves the
    d×d system ``(Σ_k w_k C_k ∘ P_k) x = Σ_k w_k diag(C_k A P_k)`` (``∘`` elementwise; the
    Hadamard product of two positive definite matrices is positive definite)."""
    total = sum(w for w, _, _ in terms)
    hadamard = sum((w / total) * (_sym(c) * _sym(p)) for w, c, p in terms)
    rhs = sum((w / total) * torch.diagonal(_sym(c) @ a @ _sym(p)) for w, c, p in terms)
    return torch.diag(torch.linalg.solve(hadamard, rhs))


def weighted_misfit(g: torch.Tensor, a: torch.Tensor, c: torch.Tensor, p: torch.Tensor) -> float:
    delta = g - a
    return float(torch.trace(c @ delta @ p @ delta.T))


def grouped_misfit(g: torch.Tensor, a: torch.Tensor, terms: list[Term]) -> float:
    """``Σ_k w_k tr(C_k (G−A) P_k (G−A)ᵀ) / Σ_k w_k``: the objective of :func:`fit_symmetric_grouped`."""
    return sum(w * weighted_misfit(g, a, c, p) for w, c, p in terms) / sum(w for w, _, _ in terms)


# --------------------------------------------------------------------------------------
# Applying it to a model
# --------------------------------------------------------------------------------------


@torch.no_grad()
def fold_and_rotate(model: PreTrainedModel, r: torch.Tensor, gain_offset: float) -> None:
    """Fold block norm gains into their readers, rotate the residual stream by ``R`` (in place).

    The folded gain is the effective one, ``w + gain_offset``; the norm is then left at
    effective gain 1 (``w = 1 − gain_offset``: 0 for Gemma's ``1 + w``)."""
    adapter = adapter_for(model.config)
    readers = {norm: tuple(f"{parent}.{name}" for name in adapter.linear_names(roles))
               for norm, (parent, roles) in _READERS.items()}  # Phi-3: self_attn.qkv_proj, mlp.gate_up_proj
    writers = tuple(f"{parent}.{name}" for parent, role in _WRITERS for name in adapter.linear_names((role,)))
    for layer in adapter.layers(model):
        for norm_name, names in readers.items():
            norm = _sub(layer, norm_name)
            gain = norm.weight.detach().to(torch.float64) + gain_offset
            for name in names:
                lin = _sub(layer, name)
                w = lin.weight.detach().to(torch.float64) * gain[None, :]
                lin.weight.copy_((w @ r).to(lin.weight.dtype))
            norm.weight.fill_(1.0 - gain_offset)
        for name in writers:
            lin = _sub(layer, name)
            lin.weight.copy_((r.T @ lin.weight.detach().to(torch.float64)).to(lin.weight.dtype))
            if getattr(lin, "bias", None) is not None:
                lin.bias.copy_((r.T @ lin.bias.detach().to(torch.float64)).to(lin.bias.dtype))


@dataclass
class PreserveFit:
    """What the fit found: the misfit before/after (weighted objective), and ``D``'s range."""

    misfit_identity_rotation: float
    misfit_fitted: float
    gain_min: float
    gain_max: float
    calib_tokens: int
    groups: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@torch.no_grad()
def preserve_convert(model: PreTrainedModel, tokenizer: Any = None, spec: PITSpec = PITSpec(),
                     calib: str = "default", calib_tokens: int = 4096, seq_len: int = 256,
                     rows: CalibrationSet | list[torch.Tensor] | None = None) -> tuple[PITInterface, PreserveFit]:
    """Fold, fit, rotate ``model`` in place; return its PIT interface (not yet installed).

    Raises:
        PitError: a family the method does not cover (use a paper init), or no calibration text.
    """
    model_type = getattr(model.config, "model_type", None)
    if model_type not in PRESERVE_FAMILIES:
        why = _REFUSED.get(model_type, "is not a pre-norm RMSNorm model read only through its norms")
        raise PitError(
            f"--t-init preserve covers pre-norm RMSNorm families ({', '.join(sorted(PRESERVE_FAMILIES))}); "
            f"{model_type!r} {why} — use --t-init identity, input or output"
        )
    offset = PRESERVE_FAMILIES[model_type]
    adapter = adapter_for(model.config)
    # U in float32 (a 262k-token table in float64 would be 1.3 GB at d = 640); every product
    # with it is summed in float64, a chunk of rows at a time
    u, h = polar_factor(model.get_input_embeddings().weight.detach(),
                        scale=adapter.embedding_multiplier(model.config), dtype=torch.float32)
    h_sym, h_inv = spd_and_inverse(h.to(torch.float64))
    norm = adapter.final_norm(model)
    g = norm.weight.detach().to(torch.float64) + offset
    a = g[:, None] * (source_head_times(model, u) @ h_sym)  # the source head acts as n A H⁻¹ Uᵀ
    if rows is None:
        limit = max_positions(model.config) or seq_len
        rows = calibration_set(model, tokenizer, calib, calib_tokens, min(seq_len, limit))
    stats = calibration_stats(model, rows, u)
    terms = [(g.weight, g.second_moment, h_inv @ g.fisher @ h_inv) for g in stats.groups]
    if adapter.post_norms:  # no rotation symmetry: the body stays as it is, the final gain is fitted
        log.warning("%s normalizes each block's outputs before the residual add, so no rotation keeps it: the "
                    "conversion keeps the body and fits only the final gain, and the loss rises (by 2-3 nats/token on "
                    "Gemma 3 270M; docs/conversion.md, 'Post-normalized blocks') until it is distilled from the source "
                    "(pit-deploy train --model SRC --distill --distill-weight 1)",
                    model_type)
        gfit = fit_diagonal_grouped(a, terms)
        d_vals, r = torch.diagonal(gfit).clone(), torch.eye(len(gfit), dtype=torch.float64)
    else:
        gfit = fit_symmetric_grouped(a, terms)
        d_vals, r = torch.linalg.eigh(gfit)
    fit = PreserveFit(
        misfit_identity_rotation=grouped_misfit(torch.diag(torch.diagonal(a)), a, terms),
        misfit_fitted=grouped_misfit(gfit, a, terms),
        gain_min=float(d_vals.min()), gain_max=float(d_vals.max()), calib_tokens=stats.tokens,
        groups={g.name: g.tokens for g in stats.groups},
    )
    if not adapter.post_norms:
        fold_and_rotate(model, r, offset)
    norm.weight.copy_((d_vals - offset).to(norm.weight.dtype))
    z = u if adapter.post_norms else rotate_rows(u, r, out=u)  # U is not needed unrotated: Z = U R in its place
    t = r.T @ h_inv @ r
    lf = torch.linalg.cholesky(0.5 * (t + t.T))
    interface = PITInterface(z.to(torch.float32), lf, spec, copy=False)
    return interface, fit
