"""Runtime parity verification of an export directory.

Every artifact is loaded in its real runtime — ONNX through ``optimum.onnxruntime``'s
``ORTModelForCausalLM`` (an ``onnxruntime.InferenceSession`` underneath) and the interface
graph through a plain ``InferenceSession``; ``.pte`` files through ``executorch.runtime`` —
and compared with the PyTorch reference rebuilt from ``reference/`` (the PIT checkpoint
recorded in the manifest). All recorded sha256 digests are checked first.

Per prompt (tokenized text when the reference has a tokenizer, seeded random ids otherwise):

1. the reference's greedy continuation ``R`` of ``GREEDY_TOKENS`` tokens (no early stop at
   EOS) and its logits for the whole sequence ``prompt + R`` in one forward pass;
2. the runtime prefills the prompt in one call (**full-sequence logits**), then is fed ``R``
   one token at a time through its KV cache (**step-by-step decode logits**);
3. ``logits_max_abs`` and ``logits_rel_l2 = ‖a − b‖ / ‖b‖`` over both, ``top1_agreement``
   over every position, ``greedy_match``: the runtime's own argmax after each step equals
   ``R`` — fed its own choices, it would therefore produce the identical continuation.

``delta_ti = ‖W_out E − I‖_F`` in float64 from what the runtime outputs: its embedding of all
``V`` ids and its head applied to the ``d`` basis vectors. For ONNX the interface graph's
large weights must also be byte-identical to the decoder's.

FP32 bounds (``docs/definitions.md``, :mod:`.bounds`): ``logits_rel_l2 ≤ 1e-4``, ``top1_agreement = 1``, greedy identical,
``delta_ti ≤ 1e-5`` — a miss fails the artifact (optimum's own validation would only warn).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from ..errors import PitError
from ..export.recipes import MODES, RUNTIMES, parse_list
from ..io.checkpoint import load_pit_model
from ..io.fs import confined, sha256_file, write_json_atomic
from ..io.manifest import MANIFEST_NAME, REFERENCE_DIR, Manifest, check_digests
from ..model.core import identity_defect
from ..runtime.base import driver_class
from .bounds import bounds_for

FP32 = bounds_for("float32")
REL_L2_BOUND = FP32.logits_rel_l2
TOP1_BOUND = FP32.top1_agreement
DELTA_TI_BOUND = FP32.delta_ti
GREEDY_TOKENS = FP32.greedy_tokens
TEXT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
)
RANDOM_PROMPT_LENGTHS = (5, 11, 17)


@dataclass
class ArtifactResult:
    """Parity figures of one artifact; ``passed`` and ``failures`` follow the bounds."""

    runtime: str
    mode: str
    logits_rel_l2: float
    logits_max_abs: float
    prefill_rel_l2: float
    decode_rel_l2: float
    top1_agreement: float
    greedy_match: bool
    delta_ti: float
    reference_delta_ti: float
    prompts: int
    greedy_tokens: int
    weights_shared: bool | None = None
    tying: str = "pit"
    dtype: str = "float32"
    nonfinite_outputs: int = 0
    passed: bool = False
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def judge(self) -> "ArtifactResult":
        """Apply the bounds. Every comparison is written so that NaN fails it: ``not x <= b``
        is true for NaN, and a non-finite figure is named as such (``docs/definitions.md``)."""
        fails = []
        if self.nonfinite_outputs:
            fails.append(f"the runtime produced {self.nonfinite_outputs} non-finite logit(s)")
        if not self.logits_rel_l2 <= REL_L2_BOUND:
            fails.append(f"logits_rel_l2 {self.logits_rel_l2:.3e} > {REL_L2_BOUND:g}")
        if not self.top1_agreement >= TOP1_BOUND:
            fails.append(f"top1_agreement {self.top1_agreement:.4%} < 100%")
        if not self.greedy_match:
            fails.append(f"greedy continuation of {GREEDY_TOKENS} tokens differs from PyTorch")
        if self.greedy_tokens < GREEDY_TOKENS:
            fails.append(f"only {self.greedy_tokens} greedy tokens fit the static cache (need {GREEDY_TOKENS})")
        if self.tying == "tied":
            # A transpose-tied baseline has a large defect by nature; the runtime must show the
            # same one as the reference (relative agreement within the delta_ti bound).
            gap = abs(self.delta_ti - self.reference_delta_ti) / max(1.0, abs(self.reference_delta_ti))
            if not gap <= DELTA_TI_BOUND:
                fails.append(f"delta_ti {self.delta_ti:.6e} differs from the reference's "
                             f"{self.reference_delta_ti:.6e} (relative {gap:.2e} > {DELTA_TI_BOUND:g})")
        elif not self.delta_ti <= DELTA_TI_BOUND:
            fails.append(f"delta_ti {self.delta_ti:.3e} > {DELTA_TI_BOUND:g}")
        if self.weights_shared is False:
            fails.append("interface graph weights are not byte-identical to the decoder's")
        self.failures, self.passed = fails, not fails
        return self


@dataclass
class VerifyReport:
    directory: str
    artifacts: list[ArtifactResult]

    @property
    def passed(self) -> bool:
        return bool(self.artifacts) and all(a.passed for a in self.artifacts)

    def result(self, runtime: str, mode: str) -> ArtifactResult:
        """The result of the ``runtime``-``mode`` artifact (``KeyError`` if not verified)."""
        for r in self.artifacts:
            if r.runtime == runtime and r.mode == mode:
                return r
        raise KeyError(f"no verification result for {runtime}-{mode}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "directory": self.directory,
            "passed": self.passed,
            "bounds": {"logits_rel_l2": REL_L2_BOUND, "top1_agreement": TOP1_BOUND,
                       "greedy_tokens": GREEDY_TOKENS, "delta_ti": DELTA_TI_BOUND},
            "artifacts": [asdict(a) for a in self.artifacts],
        }

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    def __str__(self) -> str:
        head = f"{'runtime':<11}{'mode':<14}{'rel_l2':>10}{'max_abs':>10}{'top1':>8}{'greedy':>8}{'delta_ti':>10}  result"
        rows = [head]
        for a in self.artifacts:
            rows.append(
                f"{a.runtime:<11}{a.mode:<14}{a.logits_rel_l2:>10.2e}{a.logits_max_abs:>10.2e}"
                f"{a.top1_agreement:>8.2%}{'yes' if a.greedy_match else 'NO':>8}{a.delta_ti:>10.2e}  "
                + ("pass" if a.passed else "FAIL: " + "; ".join(a.failures))
            )
        rows.append("all artifacts passed" if self.passed else "verification FAILED")
        return "\n".join(rows)


# --------------------------------------------------------------------------------------
# Reference and prompts
# --------------------------------------------------------------------------------------


def load_reference(directory: Path):
    """The reference model (a PIT checkpoint, or the plain tied model of a ``--keep-tying``
    export) and its tokenizer (or ``None``)."""
    from ..io.checkpoint import is_pit_directory
    from ..io.sources import _maybe_tokenizer, load_source

    ref_dir = directory / REFERENCE_DIR
    if is_pit_directory(ref_dir):
        model = load_pit_model(ref_dir)
        from ..model.inspect import check_model_finite

        check_model_finite(model)  # a non-finite reference is unusable input (exit 2)
    else:
        model = load_source(str(ref_dir), with_tokenizer=False).model.eval()
    return model, _maybe_tokenizer(ref_dir, True, False)


def make_prompts(tokenizer, vocab_size: int, max_prompt: int, seed: int = 0) -> list[torch.Tensor]:
    """Tokenized :data:`TEXT_PROMPTS`, or seeded random ids when there is no tokenizer."""
    if tokenizer is not None:
        prompts = [torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long) for text in TEXT_PROMPTS]
    else:
        gen = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, vocab_size, (n,), generator=gen) for n in RANDOM_PROMPT_LENGTHS]
    return [p[: max(1, max_prompt)] for p in prompts]


@torch.no_grad()
def reference_run(model, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy continuation ``R`` (no EOS stop) and logits of ``prompt + R[:-1]`` in one pass."""
    seq = prompt.clone()
    greedy = []
    for _ in range(new_tokens):
        nxt = int(model(input_ids=seq[None]).logits[0, -1].argmax())
        greedy.append(nxt)
        seq = torch.cat([seq, torch.tensor([nxt])])
    full = torch.cat([prompt, torch.tensor(greedy[:-1], dtype=torch.long)])
    logits = model(input_ids=full[None]).logits[0]
    return torch.tensor(greedy, dtype=torch.long), logits


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-300))


def worst(values: Sequence[float]) -> float:
    """The largest error, NaN if any is NaN: ``max(0.0, nan)`` is ``0.0`` in Python, which
    would let a NaN pass every bound; an empty list is ``0.0`` (nothing was compared)."""
    if any(math.isnan(v) for v in values):
        return math.nan
    return max(values, default=0.0)


def delta_ti_of(emb: torch.Tensor, head_logits: torch.Tensor) -> float:
    """``‖W_out E − I‖_F`` (float64) from embeddings ``(V, d)`` and head logits of ``I_d`` ``(d, V)``."""
    return identity_defect(emb, head_logits)


@torch.no_grad()
def verify_artifact(directory: Path, art, reference, tokenizer, ref_runs=None) -> ArtifactResult:
    """Compare one artifact with the reference (see the module docstring)."""
    from ..model.inspect import effective_interface

    driver = driver_class(art.runtime)(directory / art.path)
    vocab, dim = art.shapes["vocab_size"], art.shapes["hidden_size"]
    max_seq = art.shapes.get("max_seq_len")
    max_prompt = (max_seq - GREEDY_TOKENS) if max_seq else 10**9
    n_new = GREEDY_TOKENS
    if max_prompt < 1:  # cache too short for prompt + 32 tokens: measure what fits, then fail
        max_prompt, n_new = 1, max(1, max_seq - 1)
    prompts = make_prompts(tokenizer, vocab, max_prompt)
    abs_errs: list[float] = []
    pre_errs: list[float] = []
    dec_errs: list[float] = []
    agree, total, greedy_ok, nonfinite = 0, 0, True, 0
    notes = []
    for i, prompt in enumerate(prompts):
        key = (i, len(prompt), n_new)
        if ref_runs is not None and key in ref_runs:
            greedy, ref_logits = ref_runs[key]
        else:
            greedy, ref_logits = reference_run(reference, prompt, n_new)
            if not torch.isfinite(ref_logits).all():
                raise PitError(
                    f"the PyTorch reference in {directory / REFERENCE_DIR} produces non-finite logits; "
                    "the exported weights are unusable — re-export from a finite checkpoint"
                )
            if ref_runs is not None:
                ref_runs[key] = (greedy, ref_logits)
        p = len(prompt)
        pre = driver.prefill(prompt).float()
        steps = [driver.step(int(greedy[j]), p + j).float() for j in range(n_new - 1)]
        dec = torch.stack(steps) if steps else pre[:0]
        got = torch.cat([pre, dec])
        finite_rows = torch.isfinite(got).all(-1)
        nonfinite += int((~torch.isfinite(got)).sum())
        abs_errs.append(float((got.double() - ref_logits.double()).abs().max()))
        pre_errs.append(_rel_l2(pre, ref_logits[:p]))
        if steps:
            dec_errs.append(_rel_l2(dec, ref_logits[p:]))
        # a row with a NaN never agrees (argmax of an all-NaN row would agree with itself)
        agree += int(((got.argmax(-1) == ref_logits.argmax(-1)) & finite_rows).sum())
        total += got.shape[0]
        runtime_choice = got[p - 1 :].argmax(-1)
        greedy_ok &= bool(torch.equal(runtime_choice, greedy)) and bool(finite_rows[p - 1 :].all())
    emb, head = driver.interface(vocab, dim)
    driver.close()
    e_ref, w_ref, _ = effective_interface(reference)
    weights_shared = None
    if art.runtime == "onnx":
        from ..runtime.onnx_weights import shared_weights

        weights_shared, msg = shared_weights(directory / art.path, min_elements=dim * dim)
        notes.append(msg)
    if tokenizer is None:
        notes.append("no tokenizer in the reference: prompts are seeded random token ids")
    rel_pre, rel_dec = worst(pre_errs), worst(dec_errs)
    return ArtifactResult(
        runtime=art.runtime, mode=art.mode,
        logits_rel_l2=worst([rel_pre, rel_dec]), logits_max_abs=worst(abs_errs),
        prefill_rel_l2=rel_pre, decode_rel_l2=rel_dec,
        top1_agreement=agree / max(total, 1), greedy_match=greedy_ok,
        delta_ti=delta_ti_of(emb, head), reference_delta_ti=delta_ti_of(e_ref, w_ref),
        prompts=len(prompts), greedy_tokens=n_new, weights_shared=weights_shared, notes=notes,
        tying=getattr(art, "tying", "pit"), dtype=art.dtype, nonfinite_outputs=nonfinite,
    ).judge()


def verify_directory(
    directory: str | Path,
    runtimes: Sequence[str] | str | None = None,
    modes: Sequence[str] | str | None = None,
    record: bool = True,
    expect_sha256: str | None = None,
) -> VerifyReport:
    """Check digests, then verify every (selected) artifact; optionally record the results.

    Raises:
        PitError: not an export directory, a digest mismatch or a missing file, an unknown
            runtime/mode, or a filter that selects no artifact.
    """
    directory = Path(directory)
    if expect_sha256 is not None:
        actual = sha256_file(directory / MANIFEST_NAME) if (directory / MANIFEST_NAME).is_file() else "missing"
        if actual != expect_sha256.lower():
            raise PitError(f"{directory / MANIFEST_NAME} has sha256 {actual}, not the pinned {expect_sha256}; "
                           "this is not the export you pinned")
    manifest = Manifest.read(directory)
    if record and not os.access(directory, os.W_OK):
        raise PitError(f"{directory} is read-only, so the results could not be recorded in its manifest; "
                       "pass --no-record to verify without recording")
    confined(directory, REFERENCE_DIR, "the reference directory")
    problems = check_digests(directory, manifest)
    if problems:
        raise PitError(
            f"{directory} failed the digest check ({len(problems)} problem(s)): " + "; ".join(problems)
            + " — re-export, or restore the original files"
        )
    selected = manifest.artifacts
    if runtimes is not None:
        wanted = parse_list(runtimes, RUNTIMES, "runtime")
        selected = [a for a in selected if a.runtime in wanted]
    if modes is not None:
        wanted_modes = parse_list(modes, MODES, "mode")
        selected = [a for a in selected if a.mode in wanted_modes]
    if not selected:
        have = ", ".join(a.key for a in manifest.artifacts) or "none"
        raise PitError(f"no artifact in {directory} matches the selection (it holds: {have})")
    reference, tokenizer = load_reference(directory)
    ref_runs: dict = {}
    results = [verify_artifact(directory, art, reference, tokenizer, ref_runs) for art in selected]
    report = VerifyReport(str(directory), results)
    if record:
        data = json.loads((directory / MANIFEST_NAME).read_text())
        previous = data.get("verification") or {}
        by_key = {f"{r['runtime']}-{r['mode']}": r for r in previous.get("artifacts", [])}
        by_key.update({f"{r.runtime}-{r.mode}": asdict(r) for r in results})
        data["verification"] = {
            "passed": all(r["passed"] for r in by_key.values()),
            "artifacts": list(by_key.values()),
        }
        write_json_atomic(directory / MANIFEST_NAME, data)
    return report

