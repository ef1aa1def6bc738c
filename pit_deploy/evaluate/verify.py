"""Runtime parity verification of an export directory.

Every artifact is loaded in its real runtime — ONNX through a plain
``onnxruntime.InferenceSession`` over optimum's decoder and its KV cache
(``runtime/standalone.py``, the code an edge bundle runs) and over the interface graph;
``.pte`` files through ``executorch.runtime`` —
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
``V`` ids and its head applied to the ``d`` basis vectors. A target adds its own checks
(:meth:`~pit_deploy.targets.base.Target.interface_checks`, ``verify_extras``): for ONNX the
interface graph's large weights must be byte-identical to the decoder's; every ``.pte`` also
runs through ExecuTorch's stock LLM runner.

FP32 bounds (``docs/definitions.md``, :mod:`pit_deploy.schemes`): ``logits_rel_l2 ≤ 1e-4``, ``top1_agreement = 1``, greedy identical,
``delta_ti ≤ 1e-5`` — a miss fails the artifact (optimum's own validation would only warn).

Quantized artifacts are judged by KL figures on the manifest's held-out blocks instead: against
the scheme's absolute bounds and, where the export recorded it, against a multiple of the
artifact's own expected quantization error (its weights rounded to the scheme's grid in PyTorch,
measured at export without the artifact: ``docs/quantization.md``, "Verification bounds"). Absolute bounds
set on one model say little about another; the scaled check is what catches an artifact that is
further from fp32 than its quantization explains. Both judge the output, so a model whose logits
depend little on its body could hide random codes there: every quantized weight is also read back
from the artifact and compared with the reference on the target's grid (:mod:`.weight_check`).
"""

from __future__ import annotations

import inspect
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from ..errors import PitError, WriteError
from ..exporters.recipes import MODES, parse_list
from ..io.checkpoint import load_pit_model
from ..io.fs import confined, json_text, lock_target, write_json_atomic
from ..io.heap import give_back_freed_memory
from ..io.manifest import (MANIFEST_NAME, REFERENCE_DIR, Manifest, artifact_key, check_digests, pin_sha256,
                           read_manifest_json)
from ..runtime.drivers import driver_class
from ..schemes import DTYPES, ParityBounds, QuantizedBounds, bounds_for, registered, scheme_names
from ..targets import VerifyContext, get_target, target_names
from .bound_checks import agreement_failures, finite_by_rows, kl_failures, logit_failures, max_abs_diff, rel_l2

log = logging.getLogger(__name__)
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
#: instruction sets ``verify --isa`` runs the runtimes' kernels of (aarch64: emulated, :mod:`.verify_aarch64`)
ISAS = ("x86_64", "aarch64")


@dataclass
class ArtifactResult:
    """Parity figures of one artifact; ``passed`` and ``failures`` follow the bounds of its
    dtype. fp32 artifacts fill the logit figures, quantized ones the KL figures; the other
    kind stays ``None``."""

    runtime: str
    mode: str
    dtype: str = "float32"
    #: the quantization scheme (``None`` in results recorded before schemes: the dtype's)
    scheme: str | None = None
    logits_rel_l2: float | None = None
    logits_max_abs: float | None = None
    prefill_rel_l2: float | None = None
    decode_rel_l2: float | None = None
    top1_agreement: float | None = None
    greedy_match: bool | None = None
    kl_mean: float | None = None
    kl_p99: float | None = None
    same_top1: float | None = None
    ppl_ratio: float | None = None
    heldout_tokens: int | None = None
    #: the KL figures the export measured for the artifact's weight rounding alone, in PyTorch
    #: (``details["expected"]``; ``None`` in manifests written before it)
    expected_kl_mean: float | None = None
    expected_kl_p99: float | None = None
    #: ``{"kl_mean", "kl_p99"}`` the expected figures allow (:meth:`QuantizedBounds.scaled_kl_bound`)
    scaled_bounds: dict[str, float] | None = None
    pit_correction: bool | None = None
    interface_exact: bool | None = None
    delta_ti: float = math.nan
    reference_delta_ti: float = math.nan
    prompts: int = 0
    greedy_tokens: int = 0
    weights_shared: bool | None = None
    tying: str = "pit"
    nonfinite_outputs: int = 0
    #: ExecuTorch artifacts: the stock LLM runner's greedy texts vs the reference's (:mod:`pit_deploy.targets.executorch.stock_runner`)
    stock_runner: dict[str, Any] | None = None
    #: ``verify --web``: per transformers.js client, its figures and failures (:mod:`pit_deploy.targets.onnx.web_check`)
    web: dict[str, Any] | None = None
    #: quantized artifacts: each weight read back from the artifact against the reference on the
    #: target's grid (:mod:`.weight_check`): ``checked``, ``tensors``, ``calibrated``, ``failure``, ``note``
    weight_check: dict[str, Any] | None = None
    #: checks only the artifact's target runs (``verify_extras``), by name: their figures and
    #: ``failures`` (e.g. the onnx-genai generator against the decoder session)
    target_checks: dict[str, Any] | None = None
    bounds: dict[str, Any] = field(default_factory=dict)
    passed: bool = False
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: the instruction set whose runtime kernels computed the figures (``verify --isa``)
    isa: str = "x86_64"
    #: aarch64 only: the emulated CPU profile and whether KleidiAI was on (:mod:`.verify_aarch64`)
    arm_cpu: str | None = None
    kleidiai: str | None = None
    #: ``False``: the artifact's runtime cannot run on this ISA here; never passed (``failures`` empty,
    #: the reason in ``notes``)
    checked: bool = True
    #: aarch64 only: wall seconds of the emulated runtime (not a latency: emulation is 50-100x slower)
    emulated_s: float | None = None
    #: aarch64 compact rows: the cross-ISA figures and failures (:mod:`.cross_isa`); ``None`` otherwise
    cross_isa: dict[str, Any] | None = None

    @property
    def key(self) -> str:
        return artifact_key(self.runtime, self.mode, self.scheme or self.dtype)

    @property
    def label(self) -> str:
        """The row's name in the table: the key, and on aarch64 the CPU profile and KleidiAI."""
        if self.isa == "x86_64":
            return self.key
        where = ", ".join(x for x in (self.arm_cpu, self.kleidiai and f"KleidiAI {self.kleidiai}") if x)
        return f"{self.key} [{self.isa}{' ' + where if where else ''}]"

    def judge(self, bounds: ParityBounds | QuantizedBounds | None = None) -> "ArtifactResult":
        """Apply the bounds. Every comparison is written so that NaN fails it: ``not x <= b``
        is true for NaN, and a non-finite figure is named as such (``docs/definitions.md``)."""
        bounds = bounds or bounds_for(self.scheme or self.dtype)
        self.bounds = bounds.to_dict()
        if self.cross_isa is not None:  # a compact aarch64 row: judged by its own bounds (.cross_isa)
            self.failures = list(self.cross_isa.get("failures", []))
            self.passed = not self.failures
            return self
        fails = []
        if self.nonfinite_outputs:
            fails.append(f"the runtime produced {self.nonfinite_outputs} non-finite logit(s)")
        if isinstance(bounds, QuantizedBounds):
            fails += self._judge_quantized(bounds)
        else:
            fails += self._judge_fp32(bounds)
        if self.weights_shared is False:
            fails.append("interface graph weights are not byte-identical to the decoder's")
        runner = self.stock_runner or {}
        if runner.get("error"):
            fails.append("the stock ExecuTorch LLM runner failed: " + runner["error"].splitlines()[0])
        elif runner.get("identical") is False and not isinstance(bounds, QuantizedBounds):
            fails.append(f"the stock ExecuTorch LLM runner's greedy text differs from PyTorch's on "
                         f"{len(runner.get('mismatches', []))} of {runner.get('prompts')} prompt(s)")
        for check in (self.web or {}).values():
            fails += check.get("failures", [])
        for check in (self.target_checks or {}).values():
            fails += check.get("failures", [])
        if (self.weight_check or {}).get("failure"):
            fails.append("weight-level check: " + self.weight_check["failure"])
        self.failures, self.passed = fails, not fails
        return self

    def _judge_fp32(self, b: ParityBounds) -> list[str]:
        fails = logit_failures(b, self.logits_rel_l2, self.top1_agreement)
        if not self.greedy_match:
            fails.append(f"greedy continuation of {b.greedy_tokens} tokens differs from PyTorch")
        if self.greedy_tokens < b.greedy_tokens:
            fails.append(f"only {self.greedy_tokens} greedy tokens fit the static cache (need {b.greedy_tokens})")
        if self.tying == "tied":
            # A transpose-tied baseline has a large defect by nature; the runtime must show the
            # same one as the reference (relative agreement within the delta_ti bound).
            gap = abs(self.delta_ti - self.reference_delta_ti) / max(1.0, abs(self.reference_delta_ti))
            if not gap <= b.delta_ti:
                fails.append(f"delta_ti {self.delta_ti:.6e} differs from the reference's "
                             f"{self.reference_delta_ti:.6e} (relative {gap:.2e} > {b.delta_ti:g})")
        elif not self.delta_ti <= b.delta_ti:
            fails.append(f"delta_ti {self.delta_ti:.3e} > {b.delta_ti:g}")
        return fails

    def _judge_quantized(self, b: QuantizedBounds) -> list[str]:
        fails = kl_failures(b, self.kl_mean, self.kl_p99)
        if self.expected_kl_mean is not None and self.expected_kl_p99 is not None:
            mean, p99 = b.scaled_kl_bound(self.expected_kl_mean, self.expected_kl_p99)
            self.scaled_bounds = {"kl_mean": mean, "kl_p99": p99}
            for name, value, allowed, expected, factor, floor in (
                    ("kl_mean", self.kl_mean, mean, self.expected_kl_mean, b.expected_factor, b.expected_floor),
                    ("kl_p99", self.kl_p99, p99, self.expected_kl_p99, b.expected_factor_p99, b.expected_floor_p99)):
                if not value <= allowed:
                    fails.append(f"{name} {value:.4g} > {allowed:.4g} = max({factor:g} × {expected:.4g}, {floor:g}), "
                                 f"the error its weight rounding explains (expected at export)")
        fails += agreement_failures(b, self.same_top1, self.ppl_ratio)
        if self.interface_exact and not self.delta_ti <= b.delta_ti:
            fails.append(f"delta_ti {self.delta_ti:.3e} > {b.delta_ti:g} (an exact factorized interface)")
        elif not math.isfinite(self.delta_ti):
            fails.append(f"delta_ti is {self.delta_ti}")
        return fails


def _cross_isa_line(c: dict[str, Any]) -> str:
    """The compact aarch64 row's own figures (:mod:`.cross_isa`): the same artifact on x86."""
    if c.get("kl_bound") is None:
        first = f"logits rel L2 {c['rel_l2']:.2e}, greedy {'identical' if c['greedy_identical'] else 'DIFFERENT'}"
    else:
        first = f"KL {c['kl_mean']:.3g} (bound {c['kl_bound']:.3g}, max {c['kl_max']:.3g}), top-1 same {c['same_top1']:.1%}"
        if c.get("x86_ppl_ratio") is not None:
            first += f", x86's own ppl_x {c['x86_ppl_ratio']:.3f}"
    return f"vs x86 on {c['positions']} positions: {first}, interface rel L2 {c['interface_rel_l2']:.2e}"


def _web_row(client: str, w: dict[str, Any], width: int = 30) -> str:
    """One transformers.js client's line under its artifact's row of the table."""
    label = f"  + transformers.js {client}"
    if w.get("error"):
        return f"{label:<{width}}did not run: {w['error']}"
    greedy = "-" if w.get("greedy_match") is None else ("yes" if w["greedy_match"] else "NO")
    rate = w.get("decode_ms_per_token")
    return (f"{label:<{width}}{_fmt(w.get('logits_rel_l2'), '.2e'):>9}{_fmt(w.get('top1_agreement'), '.2%'):>8}{greedy:>7}"
            f"{'-':>7}{_fmt(w.get('kl_mean'), '.4f'):>9}{'-':>7}{_fmt(w.get('kl_p99'), '.3f'):>8}"
            f"{_fmt(w.get('same_top1'), '.1%'):>7}{_fmt(w.get('ppl_ratio'), '.3f'):>7}{'-':>10}  "
            + ("pass" if w.get("passed") else "FAIL") + ("" if rate is None else f" (decode {rate:.1f} ms/token)"))


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ratio(value: float | None, expected: float | None) -> float | None:
    """``value / expected`` for the ``x_exp`` column (``None``: nothing to divide)."""
    if value is None or not expected:
        return None
    return value / expected


@dataclass
class VerifyReport:
    """What ``pit-deploy verify`` (and :func:`pit_deploy.verify`) found in one export directory.

    ``passed`` is the verdict a program reads (the command exits 0 when true, 1 when false);
    ``artifacts`` holds one :class:`ArtifactResult` per verified artifact, with its figures,
    ``passed`` and ``failures`` (each failed bound in words); :meth:`result` picks one artifact;
    ``str(report)`` is the command's table and :meth:`to_json` its ``--json``."""

    directory: str  #: the export directory verified
    artifacts: list[ArtifactResult]
    #: the manifest's pin for ``--expect-sha256`` (:func:`~pit_deploy.io.manifest.pin_sha256`)
    manifest_sha256: str | None = None

    @property
    def passed(self) -> bool:
        """Every checked artifact within its bounds, at least one checked. An artifact whose runtime
        cannot run on the ISA asked for (``checked`` false) is listed, never passed, and fails
        nothing by itself; a selection of nothing but those is refused before any work."""
        checked = [a for a in self.artifacts if a.checked]
        return bool(checked) and all(a.passed for a in checked)

    def result(self, runtime: str, mode: str, scheme: str = "float32") -> ArtifactResult:
        """The result of the ``runtime``-``mode``(-``scheme``) artifact (``KeyError`` if not verified)."""
        for r in self.artifacts:
            if r.key == artifact_key(runtime, mode, scheme):
                return r
        raise KeyError(f"no verification result for {runtime}-{mode} ({scheme})")

    def to_dict(self) -> dict[str, Any]:
        return {
            "directory": self.directory,
            "passed": self.passed,
            "manifest_sha256": self.manifest_sha256,
            "bounds": {name: s.bounds.to_dict() for name, s in registered().items()},
            "artifacts": [asdict(a) for a in self.artifacts],
        }

    def to_json(self, **kw) -> str:
        return json_text(self.to_dict(), **kw)

    def __str__(self) -> str:
        width = max([30, *(len(a.label) + 1 for a in self.artifacts)])  # the longest artifact name fits
        head = (f"{'artifact':<{width}}{'rel_l2':>9}{'top1':>8}{'greedy':>7}{'runner':>7}{'kl_mean':>9}{'x_exp':>7}{'kl_p99':>8}"
                f"{'same1':>7}{'ppl_x':>7}{'delta_ti':>10}  result")
        rows = [head]
        for a in self.artifacts:
            if not a.checked:
                rows.append(f"{a.label:<{width}}not checked on {a.isa}: " + "; ".join(a.notes))
                continue
            greedy = "-" if a.greedy_match is None else ("yes" if a.greedy_match else "NO")
            delta = "-" if a.cross_isa is not None and math.isnan(a.delta_ti) else f"{a.delta_ti:.2e}"
            same = (a.stock_runner or {}).get("identical")
            runner = "-" if same is None else ("yes" if same else "NO")
            rows.append(
                f"{a.label:<{width}}{_fmt(a.logits_rel_l2, '.2e'):>9}{_fmt(a.top1_agreement, '.2%'):>8}{greedy:>7}{runner:>7}"
                f"{_fmt(a.kl_mean, '.4f'):>9}{_fmt(_ratio(a.kl_mean, a.expected_kl_mean), '.1f'):>7}"
                f"{_fmt(a.kl_p99, '.3f'):>8}{_fmt(a.same_top1, '.1%'):>7}"
                f"{_fmt(a.ppl_ratio, '.3f'):>7}{delta:>10}  "
                + ("pass" if a.passed else "FAIL: " + "; ".join(a.failures))
            )
            if a.weight_check is not None and not a.weight_check.get("checked"):
                rows.append(f"  {a.weight_check.get('note') or 'not checked at the weight level'}")
            if a.cross_isa is not None:
                rows.append("  " + _cross_isa_line(a.cross_isa))
            for client, w in (a.web or {}).items():
                rows.append(_web_row(client, w, width))
        skipped = sum(not a.checked for a in self.artifacts)
        if self.passed and skipped:
            rows.append(f"all checked artifacts passed; {skipped} not checked (listed above)")
        else:
            rows.append("all artifacts passed" if self.passed else "verification FAILED")
        if self.manifest_sha256:
            rows.append(f"manifest pin (--expect-sha256): {self.manifest_sha256}")
        return "\n".join(rows)


# --------------------------------------------------------------------------------------
# Reference and prompts
# --------------------------------------------------------------------------------------


def load_reference(directory: Path):
    """The reference model (:func:`load_reference_model`) and its tokenizer (or ``None``)."""
    from ..io.sources import maybe_tokenizer

    return load_reference_model(directory), maybe_tokenizer(directory / REFERENCE_DIR, True, False)


def load_reference_model(directory: Path):
    """The reference model: a PIT checkpoint, or the plain tied model of a ``--keep-tying`` export."""
    from ..io.checkpoint import is_pit_directory
    from ..io.sources import load_source

    ref_dir = directory / REFERENCE_DIR
    if is_pit_directory(ref_dir):
        model = load_pit_model(ref_dir)
        from ..model.inspect import check_model_finite

        check_model_finite(model)  # a non-finite reference is unusable input (exit 2)
        return model
    return load_source(str(ref_dir), with_tokenizer=False).model.eval()


#: a reference model of at least this many bytes of weights is let go while an fp32 runtime
#: runs; a smaller one is kept, since loading it again would cost more time than its memory is worth
RELEASE_MIN_BYTES = 256 * 2**20


class ReferenceModel:
    """The export's PyTorch reference, held while a check needs it and let go (:meth:`release`)
    while an fp32 runtime runs: that check computes the reference's side first, so at a
    262,144-token vocabulary the runtime does not run beside a second 1 GB model. A later check
    that needs the model loads it again (:meth:`get`, the model alone); its ``delta_ti`` is
    computed once."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        # loaded now: a reference that cannot be used fails before any runtime work (exit 2)
        self._model, self.tokenizer = load_reference(directory)
        self._bytes = sum(t.numel() * t.element_size() for t in self._model.state_dict().values())
        self._delta_ti: float | None = None
        self._heldout: Any = None

    def get(self) -> Any:
        """The reference model, loaded again if it was let go."""
        if self._model is None:
            self._model = load_reference_model(self.directory)
        return self._model

    def delta_ti(self) -> float:
        """The reference's own ``‖W_out E − I‖_F`` (float64)."""
        from ..model.inspect import interface_delta_ti

        if self._delta_ti is None:
            self._delta_ti = interface_delta_ti(self.get())
        return self._delta_ti

    def release(self) -> None:
        """Let the model go until a check asks for it again (one of :data:`RELEASE_MIN_BYTES` or more)."""
        if self._model is None or self._bytes < RELEASE_MIN_BYTES:
            return
        self._model = None
        give_back_freed_memory()  # the model's tensors, and what the checks before freed

    def heldout_side(self, blocks: list[list[int]]) -> Any:
        """The reference's side of the held-out KL (:func:`pit_deploy.data.heldout.kl_parity`): for a
        model of :data:`RELEASE_MIN_BYTES` or more, its logits of ``blocks`` computed once into a
        temporary file (:class:`~pit_deploy.data.heldout.ReferenceLogits`, shared by every quantized
        artifact of the export) and the model let go, so no runtime session opens beside it; a
        smaller model, or one whose logits the temporary directory cannot take, itself."""
        from ..data.heldout import ReferenceLogits

        if self._bytes < RELEASE_MIN_BYTES:
            return self.get()
        if self._heldout is None or any(row not in self._heldout for row in blocks):
            self.close()
            try:
                self._heldout = ReferenceLogits(self.get(), blocks)
            except OSError as exc:  # a full or unwritable TMPDIR: the check runs with the model beside it
                log.warning("the reference's held-out logits were not written to a temporary file (%s); "
                            "comparing with the model in memory", exc)
                return self.get()
        self.release()
        return self._heldout

    def close(self) -> None:
        """Delete the temporary file of the held-out logits, if one was written."""
        if self._heldout is not None:
            self._heldout.close()
            self._heldout = None


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
    """Greedy continuation ``R`` (no EOS stop) and logits of ``prompt + R[:-1]`` in one pass. Each
    greedy step asks only for the last position's logits where the model takes ``logits_to_keep``
    (every position's were 84 MiB a step at a 262,144-token vocabulary)."""
    last = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    seq = prompt.clone()
    greedy = []
    for _ in range(new_tokens):
        nxt = int(model(input_ids=seq[None], **last).logits[0, -1].argmax())
        greedy.append(nxt)
        seq = torch.cat([seq, torch.tensor([nxt])])
    full = torch.cat([prompt, torch.tensor(greedy[:-1], dtype=torch.long)])
    logits = model(input_ids=full[None]).logits[0]
    return torch.tensor(greedy, dtype=torch.long), logits




def runtime_logits(driver, prompt: torch.Tensor, fed: torch.Tensor) -> torch.Tensor:
    """The runtime's float32 logits of ``prompt`` (one prefill) then of each token of ``fed``
    (one decode step each), written into one tensor as they come: at a 262,144-token vocabulary a
    list of steps, their stack and the joined block were 50 MiB each per prompt."""
    pre = driver.prefill(prompt)
    p = len(prompt)
    out = torch.empty(p + len(fed), pre.shape[-1], dtype=torch.float32)
    out[:p] = pre
    del pre
    for j, token in enumerate(fed.tolist()):
        out[p + j] = driver.step(int(token), p + j)
    return out


def worst(values: Sequence[float]) -> float:
    """The largest error, NaN if any is NaN: ``max(0.0, nan)`` is ``0.0`` in Python, which
    would let a NaN pass every bound; an empty list is ``0.0`` (nothing was compared)."""
    if any(math.isnan(v) for v in values):
        return math.nan
    return max(values, default=0.0)


def _interface_figures(directory: Path, art, driver) -> tuple[float, bool | None, list[str]]:
    """``delta_ti`` measured on the runtime and the target's own interface checks (ONNX:
    whether the interface graph reads the decoder's very weight bytes)."""
    vocab, dim = art.shapes["vocab_size"], art.shapes["hidden_size"]
    runtime_figure = driver.interface_defect(vocab, dim)
    weights_shared, notes = get_target(art.target).interface_checks(directory / art.path, dim)
    return runtime_figure, weights_shared, list(notes)


def expected_figures(directory: Path, art) -> dict[str, float] | None:
    """``{"kl_mean", "kl_p99"}`` of the artifact's expected quantization error as the export
    recorded it (``details["expected"]``, :mod:`pit_deploy.exporters.expected_error`), or ``None``
    for a manifest written before it was recorded.

    Raises:
        PitError: an ``expected`` entry that is not two finite non-negative numbers (a tampered
            or corrupted manifest): unusable input.
    """
    entry = art.details.get("expected") if isinstance(art.details, dict) else None
    if entry is None:
        return None
    values = {key: entry.get(key) if isinstance(entry, dict) else None for key in ("kl_mean", "kl_p99")}
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
               for v in values.values()):
        raise PitError(f"{directory / MANIFEST_NAME}: artifacts {art.key}: details.expected must hold finite, "
                       f"non-negative kl_mean and kl_p99, got {entry!r} (tampered manifest?); re-export")
    return {key: float(v) for key, v in values.items()}


def require_expected(directory: Path, art) -> None:
    """Refuse a quantized artifact whose target records an expected quantization error for its
    scheme (it declares a weight grid) but whose manifest entry has none: the scaled KL check
    would silently be dropped (a deleted ``details.expected``).

    Raises:
        PitError: the entry lacks ``details.expected`` (unusable input: re-export).
    """
    from ..schemes import get_scheme

    scheme = get_scheme(art.scheme_name)
    if not scheme.quantized or get_target(art.target).weight_grid(scheme, art.mode) is None:
        return
    if expected_figures(directory, art) is None:
        raise PitError(f"{directory / MANIFEST_NAME}: artifact {art.key} records no expected quantization error "
                       f"(details.expected), which every {art.target} {scheme.name} export records and the scaled "
                       "KL check needs; the manifest was edited or written by an older pit-deploy: re-export")


def _onnx_tensors(graph: Any) -> Any:
    """Every tensor an ONNX graph holds: its initializers (sparse ones' values and indices) and
    the tensors of its nodes' attributes, those of subgraphs included."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    for node in graph.node:
        yield from _attribute_tensors(node)


def _attribute_tensors(node: Any) -> Any:
    for attr in node.attribute:
        if attr.HasField("t"):
            yield attr.t
        yield from attr.tensors
        if attr.HasField("sparse_tensor"):
            yield from (attr.sparse_tensor.values, attr.sparse_tensor.indices)
        for sparse in attr.sparse_tensors:
            yield from (sparse.values, sparse.indices)
        if attr.HasField("g"):
            yield from _onnx_tensors(attr.g)
        for sub in attr.graphs:
            yield from _onnx_tensors(sub)


def check_onnx_data_files(directory: Path, art) -> None:
    """Refuse an artifact whose ONNX graphs read external data from a file that is not a regular
    file of the artifact that its manifest lists: every tensor stored outside an ``.onnx`` file
    that the manifest lists (the decoder, the interface graph, any other session's graph) names
    its data file by a ``location`` relative to the graph, which onnxruntime opens as it is. A
    location that is not a plain relative path (absolute, ``..``), a file the manifest does not
    list (so no digest covers what the runtime reads), a symbolic link or anything but a regular
    file is a tampered artifact.

    Exit 2, as a digest that does not match (:func:`~pit_deploy.io.manifest.check_digests`) and
    a config that names an unlisted file (:meth:`~pit_deploy.targets.base.Target.check_files`)
    are: what ``verify`` would measure is not the artifact the manifest describes, so it is
    refused before any work and nothing is recorded; exit 1 is for an artifact that was measured
    and missed a bound.

    Raises:
        PitError: a listed ``.onnx`` file that cannot be read, or an external-data location as above.
    """
    import posixpath

    import onnx
    from onnx import TensorProto

    from ..targets.base import plain_relative

    listed = set(art.files)
    for rel in sorted(r for r in art.files if r.endswith(".onnx")):
        path = confined(directory, rel, "manifest file")
        try:
            model = onnx.load(str(path), load_external_data=False)
        except Exception as exc:  # noqa: BLE001 — onnx raises several types for a damaged file
            raise PitError(f"{path} cannot be read as ONNX ({type(exc).__name__}); re-export") from None
        tensors = list(_onnx_tensors(model.graph))
        for function in model.functions:
            for node in function.node:
                tensors += list(_attribute_tensors(node))
        folder = posixpath.dirname(rel)
        checked: set[str] = set()
        for tensor in tensors:
            if tensor.data_location != TensorProto.EXTERNAL:
                continue
            location = next((e.value for e in tensor.external_data if e.key == "location"), None)
            if location in checked:
                continue
            where = f"{path}: tensor {tensor.name!r} reads its data from {location!r}"
            if not plain_relative(location):
                raise PitError(f"{where}, not a plain relative path inside the artifact (no absolute path, no '..'); "
                               "the file was edited or tampered — re-export")
            target = posixpath.join(folder, location)
            if target not in listed:
                raise PitError(f"{where}, which is not a file of the artifact that its manifest lists (no digest "
                               "covers it); the file was edited or tampered — re-export")
            file = Path(directory) / target
            linked = any(p.is_symlink() for p in [file, *file.parents][: target.count("/") + 1])
            if linked or not file.is_file():
                raise PitError(f"{where}, which is {'a symbolic link' if linked else 'not a regular file'}; the "
                               "runtime must read the file the manifest's digest covers — re-export")
            checked.add(location)


def interface_exact_of(art, recipe: dict | None) -> bool:
    """Whether a quantized artifact's interface is exact (``W_out E = I``, ``delta_ti`` bounded),
    from its scheme's ``pit_correction`` (the recipe's override, else the scheme's own) and its
    target and mode (:meth:`~pit_deploy.targets.base.Target.interface_exact`), never from a field
    of the artifact's details."""
    from ..schemes import get_scheme

    override = (recipe or {}).get("pit_correction")
    correction = override if isinstance(override, bool) else get_scheme(art.scheme_name).pit_correction
    return get_target(art.target).interface_exact(correction, art.mode)


def weight_level_check(directory: Path, art, reference) -> dict[str, Any]:
    """The weight-level check of a quantized artifact (:mod:`.weight_check`) as recorded on its result."""
    from .weight_check import WeightCheck, check_artifact_weights

    try:
        outcome = check_artifact_weights(directory, art, reference)
    except (ValueError, KeyError) as exc:  # a layout the reader does not know: reported, never passed
        outcome = WeightCheck(checked=False, note=f"not checked at the weight level: {exc}")
    return outcome.to_dict()


@torch.no_grad()
def verify_quantized_artifact(directory: Path, art, reference: ReferenceModel, heldout: dict | None, bounds,
                              driver=None, recipe: dict | None = None) -> ArtifactResult:
    """KL parity of a quantized artifact on the manifest's held-out blocks (:mod:`pit_deploy.data.heldout`),
    and its weights read back on the target's grid (:mod:`.weight_check`); ``driver`` (default: the
    runtime's own) is what :mod:`.verify_aarch64` replaces; ``recipe``: the manifest's (its scheme settings)."""
    from ..data.heldout import kl_parity

    blocks = heldout.get("blocks") if isinstance(heldout, dict) else None
    if not blocks:
        raise PitError(f"{directory / MANIFEST_NAME} records no held-out token set for the quantized "
                       f"artifact {art.key}; re-export with this pit-deploy")
    vocab = art.shapes["vocab_size"]
    if (not isinstance(blocks, list) or any(not isinstance(row, list) or not row for row in blocks)
            or any(not isinstance(t, int) or not 0 <= t < vocab for row in blocks for t in row)):
        raise PitError(f"{directory / MANIFEST_NAME}: the held-out ids are not token ids of this model "
                       "(tampered manifest?); re-export")
    if driver is None:
        driver = driver_class(art.target)(directory / art.path)
        driver.free_buffers_between_runs()
    try:
        # what needs the model comes first; a large one is then let go (its held-out logits kept
        # on disk), so the runtime's sessions and the KL run without 1 GB of it beside them
        weights = weight_level_check(directory, art, reference.get())
        ref_delta = reference.delta_ti()
        ref_side = reference.heldout_side(blocks)
        # the interface first: its two V×d tables are gone before the prefills grow the decoder's buffers
        delta, weights_shared, notes = _interface_figures(directory, art, driver)
        figures = kl_parity(driver, ref_side, blocks)
    finally:
        driver.close()
    quant = art.details.get("quantization", {}) if isinstance(art.details, dict) else {}
    correction, exact = quant.get("pit_correction"), interface_exact_of(art, recipe)
    notes.append(f"held-out set: {len(blocks)} × {len(blocks[0])} tokens, {heldout.get('source', '?')}")
    expected = expected_figures(directory, art)
    if expected is None:
        notes.append("the scaled KL check was not available: the manifest records no expected quantization "
                     "error for this artifact (written before exports measured it, or by a target that "
                     "declares no weight grid); re-export with this pit-deploy to get it")
    return ArtifactResult(
        runtime=art.target, mode=art.mode, dtype=art.dtype, scheme=art.scheme_name,
        kl_mean=figures.kl_mean, kl_p99=figures.kl_p99, same_top1=figures.same_top1,
        ppl_ratio=figures.ppl_ratio, heldout_tokens=figures.tokens, pit_correction=correction,
        interface_exact=exact, expected_kl_mean=None if expected is None else expected["kl_mean"],
        expected_kl_p99=None if expected is None else expected["kl_p99"],
        delta_ti=delta, reference_delta_ti=ref_delta, weights_shared=weights_shared, notes=notes,
        tying=getattr(art, "tying", "pit"), nonfinite_outputs=figures.nonfinite_outputs, weight_check=weights,
    ).judge(bounds)


@torch.no_grad()
def verify_artifact(directory: Path, art, reference: ReferenceModel, tokenizer, ref_runs=None,
                    bounds: ParityBounds | None = None, driver=None) -> ArtifactResult:
    """Compare one fp32 artifact with the reference (see the module docstring) on ``driver``
    (default: the runtime's own, holding the weights once; :mod:`.verify_aarch64` passes its
    replay of the emulated run). The reference's runs come first; the model is then let go
    (:meth:`ReferenceModel.release`) and the runtime runs without it beside."""
    vocab = art.shapes["vocab_size"]
    max_seq = art.shapes.get("max_seq_len")
    max_prompt = (max_seq - GREEDY_TOKENS) if max_seq else 10**9
    n_new = GREEDY_TOKENS
    if max_prompt < 1:  # cache too short for prompt + 32 tokens: measure what fits, then fail
        max_prompt, n_new = 1, max(1, max_seq - 1)
    prompts = make_prompts(tokenizer, vocab, max_prompt)
    runs: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for i, prompt in enumerate(prompts):
        key = (i, len(prompt), n_new)
        if ref_runs is not None and key in ref_runs:
            runs.append(ref_runs[key])
            continue
        greedy, ref_logits = reference_run(reference.get(), prompt, n_new)
        if not torch.isfinite(ref_logits).all():
            raise PitError(
                f"the PyTorch reference in {directory / REFERENCE_DIR} produces non-finite logits; "
                "the exported weights are unusable — re-export from a finite checkpoint"
            )
        if ref_runs is not None:
            ref_runs[key] = (greedy, ref_logits)
        runs.append((greedy, ref_logits))
    ref_delta = reference.delta_ti()
    reference.release()
    if driver is None:
        driver = driver_class(art.target)(directory / art.path)
        driver.hold_weights_once()
        driver.free_buffers_between_runs()
    # the interface first: its two V×d tables are gone before the prefills grow the runtime's buffers
    delta, weights_shared, notes_if = _interface_figures(directory, art, driver)
    abs_errs: list[float] = []
    pre_errs: list[float] = []
    dec_errs: list[float] = []
    agree, total, greedy_ok, nonfinite = 0, 0, True, 0
    notes = []
    for i, prompt in enumerate(prompts):
        greedy, ref_logits = runs[i]
        runs[i] = None  # not beside the next prompt's runs (unless ref_runs keeps them for another check)
        p = len(prompt)
        got = runtime_logits(driver, prompt, greedy[:-1])
        pre, dec = got[:p], got[p:]
        finite_rows, count = finite_by_rows(got)
        nonfinite += count
        abs_errs.append(max_abs_diff(got, ref_logits))
        pre_errs.append(rel_l2(pre, ref_logits[:p]))
        if len(dec):
            dec_errs.append(rel_l2(dec, ref_logits[p:]))
        # a row with a NaN never agrees (argmax of an all-NaN row would agree with itself)
        agree += int(((got.argmax(-1) == ref_logits.argmax(-1)) & finite_rows).sum())
        total += got.shape[0]
        runtime_choice = got[p - 1 :].argmax(-1)
        greedy_ok &= bool(torch.equal(runtime_choice, greedy)) and bool(finite_rows[p - 1 :].all())
        del got, pre, dec, ref_logits
    driver.close()
    notes += notes_if
    if tokenizer is None:
        notes.append("no tokenizer in the reference: prompts are seeded random token ids")
    rel_pre, rel_dec = worst(pre_errs), worst(dec_errs)
    return ArtifactResult(
        runtime=art.target, mode=art.mode,
        logits_rel_l2=worst([rel_pre, rel_dec]), logits_max_abs=worst(abs_errs),
        prefill_rel_l2=rel_pre, decode_rel_l2=rel_dec,
        top1_agreement=agree / max(total, 1), greedy_match=greedy_ok,
        delta_ti=delta, reference_delta_ti=ref_delta,
        prompts=len(prompts), greedy_tokens=n_new, weights_shared=weights_shared, notes=notes,
        tying=getattr(art, "tying", "pit"), dtype=art.dtype, scheme=art.scheme_name, nonfinite_outputs=nonfinite,
    ).judge(bounds)


def verify_directory(directory: str | Path, *args: Any, **kwargs: Any) -> VerifyReport:
    """Verify the export ``directory`` (:func:`verify_export`); a failure that comes from the
    directory being replaced while it was read (another ``export --force`` into it) is said as
    such, not as a damaged or failing artifact: what was read was half the old export and half
    the new one, and nothing is wrong with either.

    Raises:
        PitError: as :func:`verify_export`; and the directory was replaced while it was verified.
    """
    directory = Path(directory)
    before = _identity(directory)
    try:
        report = verify_export(directory, *args, **kwargs)
    except Exception as exc:
        _refuse_if_replaced(directory, before, exc)
        raise
    if not report.passed:
        _refuse_if_replaced(directory, before, None)
    return report


def _identity(directory: Path) -> tuple[Any, ...]:
    """What tells one export in ``directory`` from another written there later: the directory's
    inode (an export replaces the whole directory) and its manifest's pin."""
    try:
        info = os.stat(directory)
        return info.st_dev, info.st_ino, pin_sha256(directory)
    except (OSError, PitError):
        return ()


def _refuse_if_replaced(directory: Path, before: tuple[Any, ...], cause: BaseException | None) -> None:
    if before and _identity(directory) != before:
        raise PitError(f"{directory} was replaced while it was being verified (another export into it?); the "
                       "results were not recorded — verify it again once that export has finished") from cause


def verify_export(
    directory: str | Path,
    runtimes: Sequence[str] | str | None = None,
    modes: Sequence[str] | str | None = None,
    record: bool = True,
    expect_sha256: str | None = None,
    dtypes: Sequence[str] | str | None = None,
    web: Sequence[str] | str | None = None,
    isa: Sequence[str] | str | None = None,
    arm_cpu: Sequence[str] | str | None = None,
    kleidiai: Sequence[str] | str | None = None,
    full: bool = False,
) -> VerifyReport:
    """Check digests, then verify every (selected) artifact; optionally record the results.

    ``isa`` (default ``x86_64``; ``aarch64``, or both) picks whose runtime kernels run the
    artifacts: ``aarch64`` runs them emulated on each ``arm_cpu`` profile and ``kleidiai`` setting
    (:mod:`.verify_aarch64`): the compact cross-ISA check (:mod:`.cross_isa`), or with ``full``
    the whole verification; only x86-64 results are recorded in the manifest.

    Raises:
        PitError: not an export directory, a digest mismatch or a missing file, an unknown
            runtime/mode, a filter that selects no artifact, or (aarch64) no emulation set-up or
            no selected artifact whose runtime runs emulated.
    """
    directory = Path(directory)
    isas = parse_list(isa or "x86_64", ISAS, "ISA")
    if "aarch64" not in isas and (arm_cpu is not None or kleidiai is not None or full):
        raise PitError("--arm-cpu, --kleidiai and --full apply to --isa aarch64 only")
    record = record and "x86_64" in isas
    manifest = Manifest.read(directory)
    pin = pin_sha256(directory)
    if expect_sha256 is not None and pin != expect_sha256.strip().lower():
        raise PitError(f"{directory / MANIFEST_NAME} has sha256 {pin} (without its verification results), not the "
                       f"pinned {expect_sha256}; this is not the export you pinned")
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
        wanted = parse_list(runtimes, target_names(), "runtime")
        selected = [a for a in selected if a.target in wanted]
    if modes is not None:
        wanted_modes = parse_list(modes, MODES, "mode")
        selected = [a for a in selected if a.mode in wanted_modes]
    if dtypes is not None:
        wanted_dtypes = parse_list(dtypes, tuple(dict.fromkeys(DTYPES + scheme_names())), "dtype")
        selected = [a for a in selected if a.dtype in wanted_dtypes or a.scheme_name in wanted_dtypes]
    if not selected:
        have = ", ".join(a.key for a in manifest.artifacts) or "none"
        raise PitError(f"no artifact in {directory} matches the selection (it holds: {have})")
    for art in selected:  # what each runtime opens is what the digests cover
        get_target(art.target).check_files(directory, art)
        check_onnx_data_files(directory, art)
    for art in selected:
        require_expected(directory, art)  # before any work
    web_clients: tuple[str, ...] = ()
    if web:
        from ..runtime.web_clients import CLIENTS, check_setup

        web_clients = tuple(parse_list(web, CLIENTS, "web client"))
        if not any(get_target(a.target).web_ready for a in selected):
            raise PitError(f"--web runs transformers.js on the onnx target's folders, and none is selected in "
                           f"{directory}; export with --runtime onnx")
        for client in web_clients:
            check_setup(client)  # a client that is not set up: the user's to fix, before any work
    emulation = None
    if "aarch64" in isas:
        from .verify_aarch64 import EmulatedVerify

        emulation = EmulatedVerify(directory, selected, arm_cpu, kleidiai, ArtifactResult,  # set-up and selection
                                   full=full)                                             # checked here
    reference = ReferenceModel(directory)
    tokenizer = reference.tokenizer
    # the reference's logits of each prompt are kept for the next check only where there is one
    # (at a 262,144-token vocabulary they are about 50 MiB a prompt)
    reused = len(selected) * len(isas) > 1 or bool(web_clients)
    ref_runs: dict | None = {} if reused else None
    overrides = (manifest.recipe or {}).get("bounds") or {}
    cache: dict[str, Any] = {"heldout": manifest.heldout, **({"ref_runs": ref_runs} if reused else {})}
    ctx = VerifyContext(directory=directory, load_reference=reference.get, tokenizer=tokenizer, text_prompts=TEXT_PROMPTS,
                        greedy_tokens=GREEDY_TOKENS, cache=cache, web_clients=web_clients, bound_overrides=overrides)

    def check(art, driver=None) -> tuple[ArtifactResult, Any, bool]:
        bounds = bounds_for(art.scheme_name, overrides.get(art.scheme_name), art.rounding)
        quantized = isinstance(bounds, QuantizedBounds)
        if quantized:
            result = verify_quantized_artifact(directory, art, reference, manifest.heldout, bounds, driver,
                                               manifest.recipe)
        else:
            result = verify_artifact(directory, art, reference, tokenizer, ref_runs, bounds, driver)
        return result, bounds, quantized

    def compact(art) -> Any:  # the aarch64 compact check's x86 side (verify_aarch64 runs cross_isa.prepare)
        bounds = bounds_for(art.scheme_name, overrides.get(art.scheme_name), art.rounding)
        quantized = isinstance(bounds, QuantizedBounds)
        max_seq = art.shapes.get("max_seq_len")
        return {"art": art, "reference": reference.get(), "tokenizer": tokenizer, "heldout": manifest.heldout,
                "bounds": bounds, "quantized": quantized,
                "prompts": make_prompts(tokenizer, int(art.shapes["vocab_size"]), (max_seq or 10**9)),
                "expected": expected_figures(directory, art) if quantized else None}

    results = []
    try:
        if "x86_64" in isas:
            for art in selected:
                result, bounds, quantized = check(art)
                get_target(art.target).verify_extras(ctx, art, result, quantized)
                result.judge(bounds)
                results.append(result)
        if emulation is not None:
            results += emulation.run(check, compact)
    finally:
        reference.close()  # the held-out logits' temporary file, if one was written
    report = VerifyReport(str(directory), results, pin)
    results = [r for r in results if r.isa == "x86_64"]  # the manifest records the x86-64 results
    if record:
        record_results(directory, pin, selected, results)
    return report


#: seconds a ``verify`` waits to record its results while another command holds the export's lock
RECORD_WAIT_S = 30.0


def record_results(directory: Path, pin: str, selected: Sequence[Any], results: Sequence[ArtifactResult]) -> None:
    """Merge ``results`` into the ``verification`` entry of ``directory``'s manifest, under the
    export's lock (:func:`~pit_deploy.io.fs.lock_target`, which ``export`` holds while it writes
    the directory): two verifications recording at once both keep their results. Only into the
    export that was measured: the manifest's pin (``pin``, read before the measurement) must be
    the one on disk.

    Raises:
        PitError: the export was replaced or its manifest changed while it was verified (the
            results are not recorded), or another command kept the lock for
            :data:`RECORD_WAIT_S` seconds.
    """
    with lock_target(directory, "verify", wait=RECORD_WAIT_S):
        if pin_sha256(directory) != pin:
            raise PitError(f"{directory} was replaced or its {MANIFEST_NAME} changed while it was being verified "
                           "(another export into it?); the results were not recorded — verify it again")
        data = read_manifest_json(directory / MANIFEST_NAME)
        previous = data.get("verification") or {}
        by_key = {artifact_key(r["runtime"], r["mode"], r.get("scheme") or r.get("dtype", "float32")): r
                  for r in previous.get("artifacts", [])}
        # what was verified: the digests checked above, so that bench can tell a changed artifact
        files = {art.key: {rel: info["sha256"] for rel, info in art.files.items()} for art in selected}
        by_key.update({r.key: {**asdict(r), "digests": files[r.key]} for r in results})
        data["verification"] = {
            "passed": all(r["passed"] for r in by_key.values()),
            "artifacts": list(by_key.values()),
        }
        try:
            write_json_atomic(directory / MANIFEST_NAME, data)
        except WriteError as exc:  # verify has no --out: the way out is the cause's, or not recording
            cause, _, todo = exc.detail.partition("; ")
            todo = todo.split(" or ")[0] if " or " in todo else "fix that"
            detail = f"{cause}; {todo}, or pass --no-record to verify without recording"
            raise WriteError(f"cannot write {directory / MANIFEST_NAME}: {detail}", exc.errno,
                             directory / MANIFEST_NAME, detail) from exc

