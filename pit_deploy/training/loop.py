"""One training recipe for PIT and transpose tying (TT): continued pretraining, from-scratch
pretraining, distillation-assisted recovery and LoRA; one process or many (``torchrun``).

:class:`TrainingRecipe` reads top to bottom the way torchtune's single-device recipes do:
``setup`` (processes → run directory → model → data → optimizer → resume) → ``train`` (the
loop: learning rate, :meth:`~TrainingRecipe.train_step`, logging, evaluation, checkpoints) →
``finish`` (final model, summary, plot) → ``cleanup``. The benchmarks call the same
``train_step`` (token-normalized gradient accumulation with DDP ``no_sync``, gradient scaler,
clipping, AdamW step, polar retraction of ``Z``, the ``cond(T)`` floor of
:mod:`.interface_guard`) instead of re-implementing it. A PIT run stops (exit 1) before
checkpointing a step whose ``W_out E`` is no longer ``I`` within ``--max-delta-ti``.

Run directory ``--out``::

    run.json           the options of the run
    metrics.jsonl      one JSON object per logged step ("kind": "train") or evaluation ("eval")
    checkpoints/       step-NNNNNNN/{model.safetensors, optimizer.pt, rng.pt, state.json}, LATEST
    model/             the final model (PIT checkpoint or plain HF directory; merged for LoRA)
    adapter/           LoRA adapters when not merged
    summary.json       final numbers
    loss.png           the loss curve

Batches: ``--batch-size`` is per process and per micro-step; one optimizer step consumes
``batch_size × grad_accum × world_size`` blocks of ``seq_len`` targets. Every process reads the
same deterministic stream and takes its own slice, so N processes with batch ``B`` see the same
global batch as one process with batch ``N·B``. The loss of a step is the sum over its trained
tokens divided by the number of trained tokens of the whole global batch (``train.loss``).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import PitError
from ..io.checkpoint import save_model
from ..io.fs import check_output_dir, write_text_atomic
from ..model.core import PITSpec
from ..model.families import adapter_for, max_positions
from ..model.inspect import find_interface
from ..model.inspect import interface_delta_ti as delta_ti
from ..model.modules import INTERFACE_ATTR
from .checkpointer import (LoadedCheckpoint, latest_checkpoint, load_latest, rng_state,
                           save_checkpoint, set_rng_state)
from ..options import field_default
from .config import TrainConfig, changed_resume_keys, describe_change, validate, with_start_defaults
from ..data.corpus import Block, TextSource, TrainStream, validation_blocks
from .evaluation import block_nll, prose_blocks
from .interface_guard import InterfaceGuard
from .loss import distill_kl_sum, token_loss, token_nll_sum
from .throughput import device_info, flops_per_token, mfu, peak_flops, peak_memory_mb
from ..io.metrics import MetricsLog, read_metrics

__all__ = ["TrainConfig", "TrainResult", "TrainingRecipe", "StepStats", "train", "param_groups",
           "token_loss", "latest_checkpoint", "cosine_lr", "AMP_DTYPES"]

log = logging.getLogger(__name__)

AMP_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
#: seconds between two progress lines (the first and the last step are always reported)
PROGRESS_SECONDS = 5.0


@dataclass
class TrainResult:
    """What a finished run reports (also written to ``summary.json``)."""

    out: str
    steps: int
    tokens: int
    final_train_loss: float | None
    final_val_loss: float | None
    initial_val_loss: float | None
    median_step_time_s: float | None
    tokens_per_s: float | None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepStats:
    """One optimizer step: mean loss per trained token (global), KL when distilling, the
    gradient norm before clipping, and the step's compute time."""

    loss: float
    kl: float
    grad_norm: float
    seconds: float
    trained_tokens: int


# --------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------


def load_tokenizer(spec: str):
    """Tokenizer of a model source (``default``, GGUF file, directory or hub id)."""
    from transformers import AutoTokenizer

    from ..io.sources import default_gguf_path, gguf_tokenizer

    try:
        if spec == "default":
            return gguf_tokenizer(default_gguf_path())
        p = Path(spec).expanduser()
        if p.is_file():
            return gguf_tokenizer(p)
        return AutoTokenizer.from_pretrained(spec)
    except PitError:
        raise
    except Exception as exc:
        raise PitError(f"cannot load a tokenizer from {spec!r} ({type(exc).__name__}); pass a model "
                       "directory or hub id that has one") from None


def freeze_body(model: torch.nn.Module) -> None:
    """``--interface-only``: everything but the PIT interface and the final norm stops training.

    Why a user wants it: the converted body then stays bit for bit what the conversion made of the
    source. A source stored on a 4-bit grid (the default model's GGUF is Q4_1) keeps its body on
    that grid up to the conversion's exact rotation, so an exporter that maps it back can round it
    without loss (``studies/source-grid.md``); the block
    norms are frozen too, because a trained gain in the rotated basis is no diagonal gain in the
    source's."""
    interface = find_interface(model)
    if interface is None:
        raise PitError("--interface-only needs a PIT model (this one has no PIT interface)")
    keep = {id(p) for p in interface.parameters() if p.requires_grad}
    keep |= {id(p) for p in adapter_for(model.config).final_norm(model).parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)


def param_groups(model: torch.nn.Module, cfg: TrainConfig) -> list[dict[str, Any]]:
    """AdamW groups: decayed matrices; undecayed norms/biases; ``Z`` and ``L`` never decayed
    (decay would pull ``Z`` off the Stiefel manifold and shrink ``T``); ``L`` at ``lr_t``."""
    groups: dict[str, list] = {"decay": [], "no_decay": [], "interface_z": [], "interface_t": []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if f"{INTERFACE_ATTR}." in name or name.startswith(INTERFACE_ATTR):
            groups["interface_z" if name.endswith(".Z") else "interface_t"].append(p)
        elif p.ndim < 2 or "norm" in name.lower() or name.endswith(".bias"):
            groups["no_decay"].append(p)
        else:
            groups["decay"].append(p)
    spec = {
        "decay": (cfg.weight_decay, 1.0),
        "no_decay": (0.0, 1.0),
        "interface_z": (0.0, 1.0),
        "interface_t": (0.0, cfg.t_lr_scale),
    }
    return [
        {"params": ps, "weight_decay": spec[k][0], "lr_scale": spec[k][1], "name": k}
        for k, ps in groups.items()
        if ps
    ]


def cosine_lr(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Linear warmup to ``lr`` then cosine decay to ``min_lr_ratio·lr`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))) * (cfg.lr - min_lr)


def _jsonable(cfg: TrainConfig) -> dict[str, Any]:
    return json.loads(json.dumps(asdict(cfg)))


# --------------------------------------------------------------------------------------
# The recipe
# --------------------------------------------------------------------------------------


class TrainingRecipe:
    """One training job described by a :class:`TrainConfig` (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, say: Callable[[str], None] | None = None) -> None:
        cfg = with_start_defaults(cfg)
        validate(cfg)
        self.cfg = cfg
        #: where progress lines go when the progress bar is off (``pit-deploy run``, ``--no-progress``)
        self.say = say
        self._said_at = -math.inf
        self.out = Path(cfg.out)
        self.step = 0
        self.tokens_seen = 0
        self.teacher: torch.nn.Module | None = None
        self.val: Block | None = None
        self.metrics = MetricsLog(self.out, enabled=False)
        self._resume_from: LoadedCheckpoint | None = None
        self._progress = None
        self._writer = None
        self.val_prose: Block | None = None
        self._mfus: list[float] = []
        self.compiled = False
        self.stopped_early: str | None = None

    # ---- setup ---------------------------------------------------------------------------

    def setup(self, write: bool = True) -> "TrainingRecipe":
        """Everything before the first step. ``write=False`` builds model, data and optimizer
        without touching ``--out`` (the benchmarks time :meth:`train_step` this way)."""
        self._setup_processes()
        if write:
            self._setup_run_dir()
        self.corpus = TextSource(self.cfg.data_config_obj())  # bad data fails before the slow model load
        torch.manual_seed(self.cfg.seed)
        random.seed(self.cfg.seed)
        self._setup_model()
        self._setup_data()
        self._setup_optimizer()
        if self._resume_from is not None:
            self._load_checkpoint(self._resume_from)
            self._record_resume()
        elif write:
            self._start_run_dir()
        if self.ddp:
            dist.barrier()
        self._wrap_ddp()
        if self.cfg.compile:
            self._compile_model()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if write:
            self._setup_logging()
        return self

    def _setup_processes(self) -> None:
        """One process, or many under torchrun (DDP or FSDP)."""
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if self.cfg.device == "auto":
            self.device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
        else:
            self.device = torch.device(self.cfg.device)
            if self.device.type == "cuda" and not torch.cuda.is_available():
                raise PitError(f"--device {self.cfg.device}: no CUDA device is available here; use --device cpu")
        self.ddp = self.world > 1
        if self.ddp and not dist.is_initialized():
            dist.init_process_group(backend="nccl" if self.device.type == "cuda" else "gloo")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.master = self.rank == 0

    def _setup_run_dir(self) -> None:
        """A new run checks ``--out``; a resumed one reads its newest complete checkpoint and
        refuses changed options."""
        cfg = self.cfg
        if cfg.resume:
            self._resume_from = load_latest(self.out, self.device)
            saved = self._resume_from.state["config"]
            mine = _jsonable(cfg)
            changed = changed_resume_keys(saved, mine)
            if changed:
                what = "; ".join(describe_change(k, saved.get(k, field_default(TrainConfig, k)), mine.get(k))
                                 for k in changed)
                raise PitError(f"--resume with different options: {what}; resume with the options of the "
                               "original run (see its run.json)")
        else:
            check_output_dir(self.out, cfg.force, protect=(cfg.model, cfg.data))
        if self.ddp:  # every process has checked before rank 0 writes anything
            dist.barrier()

    def _setup_model(self) -> None:
        """The model (converted to PIT unless TT), the distillation teacher, LoRA, sharding."""
        cfg = self.cfg
        spec = PITSpec(diagonal=cfg.diagonal, train_z=cfg.train_z)
        if cfg.from_scratch:
            model, tokenizer, source_info = self._scratch_model(spec)
        else:
            model, tokenizer, source_info = self._pretrained_model(spec)
        limit = max_positions(model.config)
        if limit is not None and cfg.seq_len > limit:
            raise PitError(f"--seq-len {cfg.seq_len} exceeds the model's {limit} positions; use --seq-len "
                           f"{limit} or less")
        if cfg.lora:
            from .lora import apply_lora

            model = apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets,
                               train_t=cfg.lora_train_t, train_z=cfg.train_z)
        if not cfg.train_body:
            freeze_body(model)
        model.to(self.device).train()
        self.interface = find_interface(model)
        self.z_trains = self.interface is not None and self.interface.Z.requires_grad
        # measured on the model as built (before any checkpoint is loaded): the start of the run
        self.guard = (InterfaceGuard(self.interface, cfg.t_max_cond, cfg.max_delta_ti)
                      if self.interface is not None else None)
        if cfg.fsdp:
            if not self.ddp:
                raise PitError("--fsdp shards the model over several processes: run under "
                               "torchrun --nproc-per-node N (N ≥ 2)")
            if self._resume_from is not None:  # full weights go in before the model is sharded
                from safetensors.torch import load_model

                load_model(model, str(self._resume_from.weights), strict=True, device=str(self.device))
            from .sharding import shard_model

            shard_model(model, self.interface.parameters() if self.interface is not None else ())
        self.raw_model = self.model = model
        self.tokenizer = tokenizer
        self.source_info = source_info
        self.flops_per_token = flops_per_token(model, cfg.seq_len)
        self.peak_flops = peak_flops(self.device, cfg.precision, cfg.peak_tflops)

    def _scratch_model(self, spec: PITSpec) -> tuple[Any, Any, dict[str, Any]]:
        from ..converters.conversion import from_scratch
        from .architectures import ARCHITECTURES, build_model

        cfg = self.cfg
        tokenizer = load_tokenizer(cfg.tokenizer or ("default" if cfg.model == "default" else cfg.model))
        arch = ARCHITECTURES.get(cfg.arch)
        if arch is None:
            raise PitError(f"unknown --arch {cfg.arch!r}; choose one of {', '.join(ARCHITECTURES)}")
        vocab = max(arch.vocab_size, len(tokenizer))
        if vocab != arch.vocab_size and self.master:
            log.warning("tokenizer has %d tokens; vocabulary widened from %d", len(tokenizer), arch.vocab_size)
        ids = {k: getattr(tokenizer, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")
               if getattr(tokenizer, k, None) is not None}
        model = build_model(cfg.arch, vocab, cfg.seed, **ids)
        if cfg.tying == "pit":
            from_scratch(model, torch.Generator().manual_seed(cfg.seed), spec, "qr")
        return model, tokenizer, {"kind": "scratch", "arch": cfg.arch}

    def _pretrained_model(self, spec: PITSpec) -> tuple[Any, Any, dict[str, Any]]:
        from ..converters.conversion import convert_model
        from ..io.sources import load_source

        cfg = self.cfg
        loaded = load_source(cfg.model)
        model, tokenizer = loaded.model, loaded.tokenizer
        if cfg.tokenizer:
            tokenizer = load_tokenizer(cfg.tokenizer)
        if tokenizer is None:
            raise PitError(f"{cfg.model} has no tokenizer; pass --tokenizer SRC")
        if loaded.is_pit:
            if cfg.tying == "tt":
                raise PitError(f"{cfg.model} is a PIT model; --tying tt needs a plain (tied) model")
            if cfg.distill:
                raise PitError("--distill needs the plain source model as teacher; pass the source, "
                               "not an already converted PIT checkpoint")
            find_interface(model).Z.requires_grad_(cfg.train_z)
            return model, tokenizer, loaded.source
        if cfg.distill:
            self.teacher = copy.deepcopy(model).eval().requires_grad_(False).to(self.device)
        if cfg.tying == "pit":
            from ..converters.conversion import default_conversion

            t_init = cfg.t_init or default_conversion(model.config)
            model = convert_model(model, t_init, spec, loaded.source, tokenizer=tokenizer)
        return model, tokenizer, loaded.source

    def _setup_data(self) -> None:
        """The training stream, the held-out blocks and the step budget."""
        cfg = self.cfg
        dcfg = self.corpus.cfg
        self.stream = TrainStream(self.corpus, self.tokenizer, dcfg)
        if cfg.eval_every > 0:
            self.val = validation_blocks(self.corpus, self.tokenizer, dcfg, cfg.eval_blocks)
            if self.val is None:
                raise PitError(f"--data {cfg.data}: the validation split yields no text; raise --val-fraction, "
                               "add data, or pass --eval-every 0")
            if cfg.eval_prose:
                self.val_prose = prose_blocks(self.tokenizer, cfg.seq_len, cfg.eval_blocks)
        self.blocks_per_step = cfg.batch_size * cfg.grad_accum * self.world
        self.tokens_per_step = self.blocks_per_step * cfg.seq_len
        self.total_steps = cfg.steps if cfg.steps is not None else math.ceil(cfg.tokens / self.tokens_per_step)

    def _setup_optimizer(self) -> None:
        """AdamW over :func:`param_groups`, autocast and (fp16 only) a gradient scaler."""
        cfg = self.cfg
        groups = param_groups(self.model, cfg)
        if not groups:
            raise PitError("nothing to train: every parameter is frozen")
        fused = {"fused": True} if self.device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), **fused)
        amp_dtype = AMP_DTYPES[cfg.precision]
        device_type = self.device.type
        self.autocast = ((lambda: torch.autocast(device_type, dtype=amp_dtype)) if amp_dtype
                         else contextlib.nullcontext)
        self.scaler = torch.amp.GradScaler(device_type, enabled=cfg.precision == "fp16")
        self.trainable = [p for g in groups for p in g["params"]]

    def _compile_model(self) -> None:
        """``--compile``: ``torch.compile`` the training model, tried at once on one micro-batch
        (forward and backward, gradients then dropped, nothing stepped); when compiling fails the
        run goes on in eager mode after one warning line. Evaluations run the model uncompiled."""
        cfg = self.cfg
        compiled = torch.compile(self.model)
        # the shape and strides of train_step's inputs (a view of seq_len + 1 ids), so the first step reuses it
        ids = torch.zeros(cfg.batch_size, cfg.seq_len + 1, dtype=torch.long, device=self.device)
        try:
            with self.autocast():
                logits = compiled(input_ids=ids[:, :-1], use_cache=False).logits
            logits.float().sum().backward()
        except Exception as exc:  # any compiler failure: the eager model trains the same
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            if self.master:
                print(f"warning: --compile failed ({type(exc).__name__}: {message[:200]}); training in eager mode",
                      file=sys.stderr)
            torch._dynamo.reset()
        else:
            self.model = compiled
            self.compiled = True
        finally:
            self.optimizer.zero_grad(set_to_none=True)

    def _load_checkpoint(self, ck: LoadedCheckpoint) -> None:
        if self.cfg.fsdp:
            from .sharding import load_full_optimizer_state

            load_full_optimizer_state(self.model, self.optimizer, ck.optimizer)
        else:
            from safetensors.torch import load_model

            load_model(self.model, str(ck.weights), strict=True, device=str(self.device))
            self.optimizer.load_state_dict(ck.optimizer)
        set_rng_state(ck.extra["rng"])
        if ck.extra.get("scaler"):
            self.scaler.load_state_dict(ck.extra["scaler"])
        self.step, self.tokens_seen = ck.state["step"], ck.state["tokens"]
        self.stream.load_state_dict(ck.state["data"])
        self.metrics = MetricsLog(self.out, enabled=self.master)
        self.metrics.truncate_after(self.step)  # what was logged after the checkpoint is logged again
        if self.master:
            print(f"resuming from {ck.path.name} (step {self.step})", file=sys.stderr)

    def _run_record(self) -> dict[str, Any]:
        """What ``run.json`` records: the options this invocation runs with."""
        return json.loads(json.dumps({**asdict(self.cfg), "world_size": self.world, "source": self.source_info},
                                     default=str))

    def _start_run_dir(self) -> None:
        if not self.master:
            return
        if self.out.exists() and self.cfg.force:
            shutil.rmtree(self.out)
        self.out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.out / "run.json", json.dumps(self._run_record(), indent=2))
        self.metrics = MetricsLog(self.out, enabled=True)
        self.metrics.start()

    def _record_resume(self) -> None:
        """``run.json`` of a resumed run records the options it runs with (not the first
        invocation's), and under ``resumes`` the step it resumed at and each option that differs
        from the previous record (``"steps": [old, new]``); the changes are printed too."""
        if not self.master:
            return
        path = self.out / "run.json"
        try:
            before = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            before = {}
        before = before if isinstance(before, dict) else {}
        now = self._run_record()
        keys = [f for f in now if f not in ("resume", "force", "source") and f in before]
        changed = {k: [before[k], now[k]] for k in keys if before[k] != now[k]}
        history = before.get("resumes") if isinstance(before.get("resumes"), list) else []
        now["resumes"] = [*history, {"step": self.step, "changed": changed}]
        write_text_atomic(path, json.dumps(now, indent=2))
        if changed:
            print("resumed with changed options: " + "; ".join(
                describe_change(k, old, new) if k != "world_size" else f"processes {old} → {new}"
                for k, (old, new) in changed.items()), file=sys.stderr)

    def _wrap_ddp(self) -> None:
        if self.ddp and not self.cfg.fsdp:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.model = DDP(self.raw_model, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def _setup_logging(self) -> None:
        if self.cfg.tensorboard and self.master:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise PitError("--tensorboard needs the package tensorboard: pip install tensorboard") from None
            self._writer = SummaryWriter(str(self.out / "tensorboard"))
            self.metrics.scalar_sink = self._writer.add_scalar
        if self.cfg.progress and self.master:
            from tqdm.auto import tqdm

            self._progress = tqdm(total=self.total_steps, initial=self.step, unit="step", dynamic_ncols=True,
                                  file=sys.stderr)

    # ---- one step -------------------------------------------------------------------------

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group["lr_scale"]

    def train_step(self, batch: Block) -> StepStats:
        """One optimizer step on the global ``batch`` (``blocks_per_step`` blocks): this
        process's micro-batches, gradients summed and normalized by the global number of
        trained tokens, clipped, AdamW, then ``Z`` retracted onto the Stiefel manifold and
        ``T``'s spectrum floored and measured (:class:`~.interface_guard.InterfaceGuard`).

        Raises:
            PitError: a non-finite loss or gradient (nothing is stepped; the last good
                checkpoint is named).
        """
        cfg, world, rank, device = self.cfg, self.world, self.rank, self.device
        model = self.model
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        trained = int(batch.mask[:, 1:].sum())
        # DDP and FSDP average gradients over processes: × world makes that a global sum.
        scale = world / max(trained, 1)
        sums = torch.zeros(2, device=device)  # LM and KL, summed over this process's tokens
        for micro in range(cfg.grad_accum):
            lo = micro * cfg.batch_size * world + rank * cfg.batch_size
            ids = batch.ids[lo : lo + cfg.batch_size].to(device, non_blocking=True)
            mask = batch.mask[lo : lo + cfg.batch_size, 1:].to(device, non_blocking=True)
            sync = micro == cfg.grad_accum - 1
            if cfg.fsdp:
                model.set_requires_gradient_sync(sync)
            with (model.no_sync() if self.ddp and not cfg.fsdp and not sync else contextlib.nullcontext()):
                with self.autocast():
                    logits = model(input_ids=ids[:, :-1], use_cache=False).logits
                lm = token_nll_sum(logits, ids[:, 1:], mask)
                loss = lm
                if self.teacher is not None:
                    with torch.no_grad(), self.autocast():
                        t_logits = self.teacher(input_ids=ids[:, :-1], use_cache=False).logits
                    kl = distill_kl_sum(logits, t_logits, mask, cfg.distill_temperature)
                    loss = (1.0 - cfg.distill_weight) * lm + cfg.distill_weight * kl
                    sums[1] += kl.detach()
                self.scaler.scale(loss * scale).backward()
            sums[0] += lm.detach()
        if self.ddp:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        train_loss, train_kl = (float(x) / max(trained, 1) for x in sums)
        self.scaler.unscale_(self.optimizer)
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        if cfg.fsdp:
            from .sharding import average_replicated_grads, clip_grad_norm

            average_replicated_grads(self.trainable, world)  # the unsharded PIT interface
            grad_norm = clip_grad_norm(self.trainable, max_norm)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, max_norm)
        if not math.isfinite(train_loss) or (not self.scaler.is_enabled() and not torch.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            raise PitError(f"the loss became non-finite at step {self.step + 1} (loss {train_loss}, grad norm "
                           f"{float(grad_norm)}); training stopped without saving: {self._last_good()}. "
                           "Lower --lr, raise --warmup-steps or use --precision fp32/bf16")
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.z_trains:
            self.interface.retract_()  # back onto the Stiefel manifold (paper Eq. 13)
        if self.guard is not None:
            self.guard.after_step()  # cond(T) floor, conditioning figures (d×d work)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return StepStats(loss=train_loss, kl=train_kl, grad_norm=float(grad_norm),
                         seconds=time.perf_counter() - t0, trained_tokens=trained)

    def evaluate(self) -> float:
        """Mean NLL per token on the held-out blocks."""
        self.raw_model.eval()
        loss = block_nll(self.raw_model, self.val, self.cfg.batch_size, self.device, self.autocast)
        self.raw_model.train()
        return loss

    def save_checkpoint(self) -> None:
        """Atomic ``checkpoints/step-NNNNNNN`` (every process takes part under FSDP)."""
        cfg = self.cfg
        full = None
        if cfg.fsdp:
            from .sharding import full_state_dicts

            full = full_state_dicts(self.model, self.optimizer)
        if self.master:
            if full is None:
                weights, optimizer_state = self.raw_model, self.optimizer.state_dict()
            else:
                names = ({n for n, _ in self.raw_model.named_parameters()}
                         | {n for n, _ in self.raw_model.named_buffers()})
                weights, optimizer_state = {k: v for k, v in full[0].items() if k in names}, full[1]
            extra = {"rng": rng_state(), "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None}
            save_checkpoint(self.out, self.step, weights, optimizer_state, extra,
                            {"tokens": self.tokens_seen, "data": self.stream.state_dict(), "config": _jsonable(cfg)},
                            keep=cfg.keep_checkpoints)
        if self.ddp:
            dist.barrier()

    def _last_good(self) -> str:
        ck = latest_checkpoint(self.out) if self.out.is_dir() else None
        return f"the last good checkpoint is {ck} (resume with --resume)" if ck else "no checkpoint was saved"

    def on_step_end(self, step: int) -> None:
        """Called after every step, its logging, evaluation and checkpoint: a hook for
        subclasses (extra reporting; the tests' simulated crashes)."""

    # ---- the loop ---------------------------------------------------------------------------

    def train(self) -> TrainResult:
        """The loop from the current step to the budget, then :meth:`finish`."""
        cfg = self.cfg
        if self.val is not None and self.step == 0:
            self._log_eval(self.evaluate())
        step_times: list[float] = []
        last_loss = None
        started = time.perf_counter()
        while self.step < self.total_steps:
            wall0 = time.perf_counter()
            lr = cosine_lr(self.step, cfg, self.total_steps)
            self.set_lr(lr)
            batch = self.stream.next_batch(self.blocks_per_step)  # the global batch; this rank takes its slice
            stats = self.train_step(batch)
            wall = time.perf_counter() - wall0
            self.step += 1
            self.tokens_seen += self.tokens_per_step
            step_times.append(stats.seconds)
            last_loss = stats.loss
            broken = self.guard is not None and self.guard.broken()
            out_of_time = (cfg.max_seconds > 0 and self.step < self.total_steps
                           and time.perf_counter() - started >= cfg.max_seconds)
            last = self.step == self.total_steps or out_of_time
            if broken or self.step % cfg.log_every == 0 or last:
                self._log_train(stats, lr, wall)
            if broken:  # before this step's evaluation or checkpoint: every checkpoint keeps the identity
                raise self.guard.error(self.step, self._last_good(), cfg.lr * cfg.t_lr_scale)
            if self._progress is not None:
                self._progress.update(1)
                self._progress.set_postfix(loss=f"{stats.loss:.4f}", tok_s=f"{self.tokens_per_step / wall:.0f}")
            elif self.say is not None and self.master:
                self._say_progress(stats, wall, time.perf_counter() - started, step_times, last)
            if self.val is not None and (self.step % cfg.eval_every == 0 or last):
                self._log_eval(self.evaluate())
            if cfg.save_every and (self.step % cfg.save_every == 0 or last):
                self.save_checkpoint()
            self.on_step_end(self.step)
            if out_of_time:
                self.stopped_early = f"max_seconds: {cfg.max_seconds:g} s of training after step {self.step}"
                if self.master:
                    print(f"stopping after step {self.step} of {self.total_steps}: --max-seconds {cfg.max_seconds:g} "
                          "reached", file=sys.stderr)
                break
        return self.finish(step_times, last_loss)

    def _say_progress(self, stats: StepStats, wall: float, elapsed: float, step_times: list[float],
                      last: bool) -> None:
        """One progress line (step, loss, tokens/s, MFU, ETA) after the first step, the last one,
        and otherwise at most every :data:`PROGRESS_SECONDS`: a slow step is reported as it ends,
        a thousand fast ones do not flood the terminal."""
        now = time.perf_counter()
        if not (len(step_times) == 1 or last or now - self._said_at >= PROGRESS_SECONDS):
            return
        self._said_at = now
        tokens_per_s = self.tokens_per_step / wall
        util = mfu(tokens_per_s, self.flops_per_token, self.peak_flops)
        left = (self.total_steps - self.step) * elapsed / max(len(step_times), 1)
        self.say(f"step {self.step}/{self.total_steps}: loss {stats.loss:.4f}, {tokens_per_s:,.0f} tokens/s"
                 + (f", MFU {util:.1%}" if util is not None else "")
                 + (f", ETA {_clock(left)}" if not last else f", {_clock(elapsed)} in all"))

    def _log_train(self, stats: StepStats, lr: float, wall: float) -> None:
        record = {"kind": "train", "step": self.step, "tokens": self.tokens_seen, "loss": stats.loss,
                  "ppl": math.exp(min(stats.loss, 50.0)), "lr": lr, "grad_norm": stats.grad_norm,
                  "step_time": stats.seconds, "tokens_per_s": self.tokens_per_step / wall}
        # throughput: MFU against the device's peak and the peak memory so far (None when unknown / off CUDA)
        record["mfu"] = mfu(record["tokens_per_s"], self.flops_per_token, self.peak_flops)
        record["peak_memory_mb"] = peak_memory_mb(self.device)
        if record["mfu"] is not None:
            self._mfus.append(record["mfu"])
        if self.teacher is not None:
            record["kl"] = stats.kl
        if self.guard is not None:  # PIT: delta_ti and cond(T) from d×d work (interface_guard)
            record.update(self.guard.record())
        elif self.master or self.cfg.fsdp:  # TT; a sharded table is gathered by all
            record["delta_ti"] = delta_ti(self.raw_model)
        if self.master and self.z_trains:
            record["z_orthogonality_error"] = self.interface.orthogonality_error()
        self.metrics.write(record)

    def _log_eval(self, val_loss: float) -> None:
        record = {"kind": "eval", "step": self.step, "tokens": self.tokens_seen, "val_loss": val_loss,
                  "val_ppl": math.exp(min(val_loss, 50.0))}
        if self.val_prose is not None:  # --eval-prose: the package's held-out English prose
            self.raw_model.eval()
            record["val_prose_loss"] = block_nll(self.raw_model, self.val_prose, self.cfg.batch_size, self.device,
                                                 self.autocast)
            self.raw_model.train()
        self.metrics.write(record)

    # ---- artefacts ----------------------------------------------------------------------------

    def finish(self, step_times: list[float], last_loss: float | None) -> TrainResult:
        """The final model (gathered, merged or as adapters), ``summary.json`` and the plot,
        written by rank 0; every rank returns rank 0's result."""
        cfg = self.cfg
        self.close_progress()
        final = self.raw_model
        if cfg.fsdp:  # gather the shards (every process), then rank 0 rebuilds an ordinary model
            from .sharding import full_state_dicts, unsharded_model

            full_state = full_state_dicts(self.model, self.optimizer)[0]
            if self.master:
                final = unsharded_model(self.raw_model.config, full_state)
        result = None
        if self.master:
            if cfg.lora and cfg.merge:
                from .lora import merge

                final = merge(self.raw_model)
            if cfg.lora and not cfg.merge:
                self._save_adapter()
            else:
                save_model(final, self.out / "model", self.tokenizer, force=True)
            evals = read_metrics(self.out, "eval")
            steady = sorted(step_times[1:] or step_times)
            median = steady[len(steady) // 2] if steady else None
            result = TrainResult(
                out=str(self.out), steps=self.step, tokens=self.tokens_seen, final_train_loss=last_loss,
                final_val_loss=evals[-1]["val_loss"] if evals else None,
                initial_val_loss=evals[0]["val_loss"] if evals and evals[0]["step"] == 0 else None,
                median_step_time_s=median, tokens_per_s=(self.tokens_per_step / median) if median else None,
                extra={"tying": cfg.tying, "world_size": self.world, "delta_ti": delta_ti(final),
                       **({"t_cond": self.guard.current.cond} if self.guard is not None else {}),
                       "device": device_info(self.device), "precision": cfg.precision, "compiled": self.compiled,
                       "flops_per_token": self.flops_per_token,
                       "peak_tflops": self.peak_flops / 1e12 if self.peak_flops else None,
                       "mfu": sorted(self._mfus)[len(self._mfus) // 2] if self._mfus else None,
                       "peak_memory_mb": peak_memory_mb(self.device),
                       "stopped_early": self.stopped_early},
            )
            write_text_atomic(self.out / "summary.json", json.dumps(asdict(result), indent=2))
            if cfg.plot:
                from ..analysis.plotting import RunLog, plot_runs

                plot_runs([RunLog.load(self.out)], self.out / "loss.png")
        if self.ddp:
            dist.barrier()
            shared = [result]
            dist.broadcast_object_list(shared, src=0)  # every rank returns rank 0's result
            result = shared[0]
        return result

    def _save_adapter(self) -> None:
        from safetensors.torch import save_file

        from ..io.fs import atomic_directory

        with atomic_directory(self.out / "adapter", force=True) as tmp:
            self.raw_model.save_pretrained(tmp)
            if self.interface is not None and (self.cfg.lora_train_t or self.cfg.train_z):
                # PEFT saves adapters only; the trained interface goes next to them.
                save_file({k: v.detach().contiguous().cpu() for k, v in self.interface.state_dict().items()},
                          str(tmp / "pit_interface.safetensors"))
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(tmp)

    def close_progress(self) -> None:
        if self._progress is not None:
            self._progress.close()
            self._progress = None

    def cleanup(self) -> None:
        """Close the progress bar and TensorBoard writer (also after an error)."""
        self.close_progress()
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _clock(seconds: float) -> str:
    """``seconds`` as ``1h02m``, ``3m05s`` or ``12s``."""
    whole = int(round(seconds))
    if whole >= 3600:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 60}m{whole % 60:02d}s" if whole >= 60 else f"{whole}s"


def train(cfg: TrainConfig, say: Callable[[str], None] | None = None) -> TrainResult:
    """Run one training job described by ``cfg``; returns its result (on every rank: rank 0's). ``say`` takes
    a progress line every few seconds when ``cfg.progress`` (the bar) is off.

    Raises:
        PitError: bad options or data, no loadable checkpoint to resume from, a non-finite
            loss (the last good checkpoint is kept and named); its subclass
            :class:`~.interface_guard.IdentityLost` (exit 1) when ``delta_ti`` exceeds
            ``--max-delta-ti``.
    """
    recipe = TrainingRecipe(cfg, say)
    try:
        recipe.setup()
        return recipe.train()
    finally:
        recipe.cleanup()
