"""One training loop for PIT and transpose tying (TT): continued pretraining, from-scratch
pretraining, distillation-assisted recovery and LoRA; one process or many (``torchrun``).

:func:`train` reads top to bottom: build the model, the data, the optimizer; resume if asked;
then the loop (warmup + cosine learning rate, explicit gradient accumulation with DDP
``no_sync``, clipping, AdamW step, polar retraction of ``Z``), logging to ``metrics.jsonl``,
held-out evaluation and atomic checkpoints.

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
global batch as one process with batch ``N·B``.
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
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

from ..convert.conversion import CONVERSIONS, convert_model, from_scratch
from ..io.checkpoint import save_model, unique_tensors
from ..io.fs import atomic_directory, check_output_dir, write_text_atomic
from ..model.core import DIAGONAL_MAPS, PITSpec
from ..model.families import max_positions
from ..model.inspect import find_interface
from ..model.inspect import interface_delta_ti as delta_ti
from ..model.modules import INTERFACE_ATTR
from .data import DataConfig, TextSource, TrainStream, validation_blocks
from .evaluation import block_nll
from ..errors import PitError

log = logging.getLogger(__name__)

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
CHECKPOINT_DIR = "checkpoints"
LATEST = "LATEST"
# Options that must not change between a run and its resumption.
RESUME_KEYS = ("model", "tying", "from_scratch", "arch", "seq_len", "batch_size", "grad_accum",
               "seed", "data", "lora", "t_init", "train_z", "fsdp")


@dataclass
class TrainConfig:
    """Every option of ``pit-deploy train`` (see ``docs/training.md``)."""

    out: str
    model: str = "default"
    tying: str = "pit"  # pit | tt
    data: str = "default"
    data_config: str | None = None
    data_split: str = "train"
    streaming: bool = True
    val_fraction: float = 0.05
    text_field: str = "text"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    seq_len: int = 256
    batch_size: int = 4
    grad_accum: int = 1
    steps: int | None = None
    tokens: int | None = None
    lr: float = 3e-4
    lr_t: float | None = None  # learning rate of T's factors (default: lr)
    min_lr_ratio: float = 0.1
    warmup_steps: int = 0
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    precision: str = "fp32"
    t_init: str = "identity"
    diagonal: str = "softplus"
    train_z: bool = False
    from_scratch: bool = False
    arch: str = "tiny"
    tokenizer: str | None = None
    distill: bool = False
    distill_weight: float = 0.5
    distill_temperature: float = 1.0
    lora: bool = False
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_targets: list[str] | None = None
    lora_train_t: bool = False
    merge: bool = False
    eval_every: int = 0
    eval_blocks: int = 8
    log_every: int = 1
    save_every: int = 0
    keep_checkpoints: int = 2
    resume: bool = False
    fsdp: bool = False  # shard the model over the torchrun processes (pit_deploy.sharding)
    force: bool = False
    seed: int = 0
    device: str = "auto"
    progress: bool = True
    tensorboard: bool = False
    plot: bool = True
    stop_after: int | None = None  # end the process after this step, as a crash would (tests)

    def data_config_obj(self) -> DataConfig:
        return DataConfig(
            spec=self.data, seq_len=self.seq_len, seed=self.seed, val_fraction=self.val_fraction,
            hub_config=self.data_config, hub_split=self.data_split, streaming=self.streaming,
            text_field=self.text_field, prompt_field=self.prompt_field,
            completion_field=self.completion_field,
        )


# --------------------------------------------------------------------------------------
# Small helpers (the loop itself is in `train`)
# --------------------------------------------------------------------------------------


def validate(cfg: TrainConfig) -> None:
    """Reject inconsistent options before anything slow happens."""
    if cfg.tying not in ("pit", "tt"):
        raise PitError(f"unknown --tying {cfg.tying!r}; choose pit or tt")
    if cfg.precision not in PRECISIONS:
        raise PitError(f"unknown --precision {cfg.precision!r}; choose {', '.join(PRECISIONS)}")
    if cfg.t_init not in CONVERSIONS:
        raise PitError(f"unknown --t-init {cfg.t_init!r}; choose one of {', '.join(CONVERSIONS)}")
    if cfg.diagonal not in DIAGONAL_MAPS:
        raise PitError(f"unknown --diagonal {cfg.diagonal!r}; choose one of {', '.join(DIAGONAL_MAPS)}")
    if (cfg.steps is None) == (cfg.tokens is None):
        raise PitError("give exactly one of --steps and --tokens")
    for name in ("seq_len", "batch_size", "grad_accum", "log_every", "eval_blocks"):
        if getattr(cfg, name) < 1:
            raise PitError(f"--{name.replace('_', '-')} must be at least 1")
    if (cfg.steps is not None and cfg.steps < 1) or (cfg.tokens is not None and cfg.tokens < 1):
        raise PitError("--steps/--tokens must be positive")
    if not 0.0 <= cfg.distill_weight <= 1.0:
        raise PitError("--distill-weight must be in [0, 1] (loss = (1-w)·LM + w·KL)")
    if cfg.from_scratch and cfg.distill:
        raise PitError("--distill needs a pretrained source model; it cannot be used with --from-scratch")
    if cfg.fsdp and cfg.lora:
        raise PitError("--fsdp with --lora is not supported: LoRA adapters are small, use plain DDP "
                       "(torchrun without --fsdp)")
    if cfg.fsdp and cfg.precision == "fp16":
        raise PitError("--fsdp supports --precision fp32 or bf16 (fp16 needs a gradient scaler "
                       "that does not handle sharded gradients); use bf16")
    if cfg.from_scratch and cfg.lora:
        raise PitError("--lora adapts a trained model; train from scratch first, then run --lora on it")
    if cfg.merge and not cfg.lora:
        raise PitError("--merge only applies to --lora runs")
    if cfg.lora_train_t and cfg.tying != "pit":
        raise PitError("--lora-train-t needs --tying pit")
    if cfg.train_z and cfg.tying != "pit":
        raise PitError("--train-z needs --tying pit")
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise PitError("--val-fraction must be in [0, 1)")


def load_tokenizer(spec: str):
    """Tokenizer of a model source (``default``, GGUF file, directory or hub id)."""
    from transformers import AutoTokenizer

    from ..io.sources import default_gguf_path

    try:
        if spec == "default":
            path = default_gguf_path()
            return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        p = Path(spec).expanduser()
        if p.is_file():
            return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
        return AutoTokenizer.from_pretrained(spec)
    except PitError:
        raise
    except Exception as exc:
        raise PitError(f"cannot load a tokenizer from {spec!r} ({type(exc).__name__}); pass a model "
                       "directory or hub id that has one") from None


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
    t_scale = (cfg.lr_t / cfg.lr) if cfg.lr_t else 1.0
    spec = {
        "decay": (cfg.weight_decay, 1.0),
        "no_decay": (0.0, 1.0),
        "interface_z": (0.0, 1.0),
        "interface_t": (0.0, t_scale),
    }
    return [
        {"params": ps, "weight_decay": spec[k][0], "lr_scale": spec[k][1], "name": k}
        for k, ps in groups.items()
        if ps
    ]


def token_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean cross-entropy; logits ``(B, L, V)``, targets/mask ``(B, L)``."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
    return (ce * mask.flatten()).sum() / mask.sum().clamp_min(1.0)


def distill_kl(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """Masked mean ``KL(p_teacher ‖ p_student)`` per token at ``temperature`` (× T²)."""
    s = F.log_softmax(student.float() / temperature, dim=-1)
    t = F.log_softmax(teacher.float() / temperature, dim=-1)
    kl = (t.exp() * (t - s)).sum(-1)
    return (kl * mask).sum() / mask.sum().clamp_min(1.0) * temperature**2


@torch.no_grad()
def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def latest_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint of a run directory, or ``None``."""
    root = out / CHECKPOINT_DIR
    pointer = root / LATEST
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / "state.json").is_file():
            return candidate
    steps = sorted(p for p in root.glob("step-*") if (p / "state.json").is_file()) if root.is_dir() else []
    return steps[-1] if steps else None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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


# --------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------


def train(cfg: TrainConfig) -> TrainResult | None:
    """Run one training job described by ``cfg``; returns its result on rank 0.

    Raises:
        PitError: bad options or data, a missing checkpoint to resume from, a non-finite
            loss (the last good checkpoint is kept and named).
    """
    validate(cfg)
    out = Path(cfg.out)

    # ---- processes: one, or many under torchrun ----------------------------------------
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cfg.device == "auto":
        device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(cfg.device)
    ddp = world > 1
    if ddp and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    master = rank == 0

    # ---- run directory -------------------------------------------------------------------
    resume_from = None
    if cfg.resume:
        resume_from = latest_checkpoint(out)
        if resume_from is None:
            raise PitError(f"--resume: {out} holds no checkpoint (expected {out}/{CHECKPOINT_DIR}/step-*/); "
                           "start a new run without --resume")
        saved = json.loads((resume_from / "state.json").read_text())["config"]
        changed = [k for k in RESUME_KEYS if saved.get(k) != json.loads(json.dumps(asdict(cfg)))[k]]
        if changed:
            raise PitError(f"--resume with different options: {', '.join(changed)}; resume with the "
                           "options of the original run (see its run.json)")
    else:
        check_output_dir(out, cfg.force, protect=(cfg.model, cfg.data))
    if ddp:  # every process has checked before rank 0 writes anything
        dist.barrier()
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)

    # ---- model (and teacher for distillation) --------------------------------------------
    spec = PITSpec(diagonal=cfg.diagonal, train_z=cfg.train_z)
    teacher = None
    if cfg.from_scratch:
        from .architectures import ARCHITECTURES, build_model

        tokenizer = load_tokenizer(cfg.tokenizer or ("default" if cfg.model == "default" else cfg.model))
        arch = ARCHITECTURES.get(cfg.arch)
        if arch is None:
            raise PitError(f"unknown --arch {cfg.arch!r}; choose one of {', '.join(ARCHITECTURES)}")
        vocab = max(arch.vocab_size, len(tokenizer))
        if vocab != arch.vocab_size and master:
            log.warning("tokenizer has %d tokens; vocabulary widened from %d", len(tokenizer), arch.vocab_size)
        ids = {k: getattr(tokenizer, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")
               if getattr(tokenizer, k, None) is not None}
        model = build_model(cfg.arch, vocab, cfg.seed, **ids)
        if cfg.tying == "pit":
            from_scratch(model, torch.Generator().manual_seed(cfg.seed), spec, "qr")
        source_info: dict[str, Any] = {"kind": "scratch", "arch": cfg.arch}
    else:
        from ..io.sources import load_source

        loaded = load_source(cfg.model)
        model, tokenizer, source_info = loaded.model, loaded.tokenizer, loaded.source
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
        else:
            if cfg.distill:
                teacher = copy.deepcopy(model).eval().requires_grad_(False).to(device)
            if cfg.tying == "pit":
                model = convert_model(model, cfg.t_init, spec, source_info, tokenizer=tokenizer)
    limit = max_positions(model.config)
    if limit is not None and cfg.seq_len > limit:
        raise PitError(f"--seq-len {cfg.seq_len} exceeds the model's {limit} positions; use --seq-len {limit} or less")
    if cfg.lora:
        from .lora import apply_lora

        model = apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets,
                           train_t=cfg.lora_train_t, train_z=cfg.train_z)
    model.to(device).train()
    interface = find_interface(model)
    z_trains = interface is not None and interface.Z.requires_grad
    if cfg.fsdp:
        if not ddp:
            raise PitError("--fsdp shards the model over several processes: run under "
                           "torchrun --nproc-per-node N (N ≥ 2)")
        if resume_from is not None:  # full weights go in before the model is sharded
            from safetensors.torch import load_model

            load_model(model, str(resume_from / "model.safetensors"), strict=True, device=str(device))
        from .sharding import shard_model

        shard_model(model, interface.parameters() if interface is not None else ())

    # ---- data -----------------------------------------------------------------------------
    dcfg = cfg.data_config_obj()
    source = TextSource(dcfg)
    stream = TrainStream(source, tokenizer, dcfg)
    val = None
    if cfg.eval_every > 0:
        val = validation_blocks(source, tokenizer, dcfg, cfg.eval_blocks)
        if val is None:
            raise PitError(f"--data {cfg.data}: the validation split yields no text; raise --val-fraction, "
                           "add data, or pass --eval-every 0")
    blocks_per_step = cfg.batch_size * cfg.grad_accum * world
    tokens_per_step = blocks_per_step * cfg.seq_len
    total_steps = cfg.steps if cfg.steps is not None else math.ceil(cfg.tokens / tokens_per_step)

    # ---- optimizer, precision --------------------------------------------------------------
    groups = param_groups(model, cfg)
    if not groups:
        raise PitError("nothing to train: every parameter is frozen")
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, **fused)
    amp_dtype = PRECISIONS[cfg.precision]
    autocast = (lambda: torch.autocast(device.type, dtype=amp_dtype)) if amp_dtype else contextlib.nullcontext
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
    trainable = [p for g in groups for p in g["params"]]

    # ---- resume ------------------------------------------------------------------------------
    step, tokens_seen = 0, 0
    metrics_path = out / "metrics.jsonl"
    if resume_from is not None:
        from safetensors.torch import load_model

        optimizer_state = torch.load(resume_from / "optimizer.pt", map_location=device, weights_only=True)
        if cfg.fsdp:
            from .sharding import load_full_optimizer_state

            load_full_optimizer_state(model, optimizer, optimizer_state)
        else:
            load_model(model, str(resume_from / "model.safetensors"), strict=True, device=str(device))
            optimizer.load_state_dict(optimizer_state)
        extra = torch.load(resume_from / "rng.pt", weights_only=True)  # no unpickling of code
        _set_rng_state(extra["rng"])
        if extra.get("scaler"):
            scaler.load_state_dict(extra["scaler"])
        state = json.loads((resume_from / "state.json").read_text())
        step, tokens_seen = state["step"], state["tokens"]
        stream.load_state_dict(state["data"])
        if master:  # drop what was logged after the checkpoint; it will be logged again
            kept = [r for r in read_metrics(metrics_path) if r["step"] <= step]
            write_text_atomic(metrics_path, "".join(json.dumps(r) + "\n" for r in kept))
            print(f"resuming from {resume_from.name} (step {step})", file=sys.stderr)
    elif master:
        if out.exists() and cfg.force:
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out / "run.json", json.dumps({**asdict(cfg), "world_size": world,
                                                         "source": source_info}, indent=2, default=str))
        metrics_path.write_text("")
    if ddp:
        dist.barrier()

    raw_model = model
    if ddp and not cfg.fsdp:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    writer = None
    if cfg.tensorboard and master:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise PitError("--tensorboard needs the package tensorboard: pip install tensorboard") from None
        writer = SummaryWriter(str(out / "tensorboard"))

    def log_record(record: dict[str, Any]) -> None:
        if not master:
            return
        with open(metrics_path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        if writer is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("step",):
                    writer.add_scalar(f"{record['kind']}/{k}", v, record["step"])

    def lr_at(it: int) -> float:
        """Linear warmup to ``lr`` then cosine decay to ``min_lr_ratio·lr`` at the last step."""
        if it < cfg.warmup_steps:
            return cfg.lr * (it + 1) / cfg.warmup_steps
        progress = (it - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        min_lr = cfg.lr * cfg.min_lr_ratio
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))) * (cfg.lr - min_lr)

    def evaluate() -> float:
        raw_model.eval()
        loss = block_nll(raw_model, val, cfg.batch_size, device, autocast)
        raw_model.train()
        return loss

    def save_checkpoint() -> None:
        full = None
        if cfg.fsdp:  # every process takes part in gathering the shards
            from .sharding import full_state_dicts

            full = full_state_dicts(model, optimizer)
        if master:
            from safetensors.torch import save_file, save_model as save_weights

            root = out / CHECKPOINT_DIR
            root.mkdir(parents=True, exist_ok=True)
            name = f"step-{step:07d}"
            with atomic_directory(root / name, force=True) as tmp:
                if full is None:
                    save_weights(raw_model, str(tmp / "model.safetensors"))
                    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
                else:
                    # gathered copies of tied weights no longer share storage: keep the first name
                    names = {n for n, _ in raw_model.named_parameters()} | {n for n, _ in raw_model.named_buffers()}
                    weights = {k: v for k, v in full[0].items() if k in names}
                    save_file(unique_tensors(weights), str(tmp / "model.safetensors"), metadata={"format": "pt"})
                    torch.save(full[1], tmp / "optimizer.pt")
                torch.save({"rng": _rng_state(), "scaler": scaler.state_dict() if scaler.is_enabled() else None},
                           tmp / "rng.pt")
                (tmp / "state.json").write_text(json.dumps(
                    {"step": step, "tokens": tokens_seen, "data": stream.state_dict(),
                     "config": json.loads(json.dumps(asdict(cfg)))}))
            write_text_atomic(root / LATEST, name)
            for old in sorted(root.glob("step-*"))[: -cfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        if ddp:
            dist.barrier()

    def last_good() -> str:
        ck = latest_checkpoint(out)
        return f"the last good checkpoint is {ck} (resume with --resume)" if ck else "no checkpoint was saved"

    if val is not None and step == 0:
        val_loss = evaluate()
        log_record({"kind": "eval", "step": 0, "tokens": 0, "val_loss": val_loss,
                    "val_ppl": math.exp(min(val_loss, 50.0))})

    progress = None
    if cfg.progress and master:
        from tqdm.auto import tqdm

        progress = tqdm(total=total_steps, initial=step, unit="step", dynamic_ncols=True, file=sys.stderr)

    # ---- the loop ------------------------------------------------------------------------------
    step_times: list[float] = []
    last_train_loss = None
    while step < total_steps:
        wall0 = time.perf_counter()
        lr = lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr * group["lr_scale"]
        batch = stream.next_batch(blocks_per_step)  # the global batch; this rank takes its slice
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        lm_sum = torch.zeros((), device=device)
        kl_sum = torch.zeros((), device=device)
        for micro in range(cfg.grad_accum):
            lo = micro * cfg.batch_size * world + rank * cfg.batch_size
            ids = batch.ids[lo : lo + cfg.batch_size].to(device, non_blocking=True)
            mask = batch.mask[lo : lo + cfg.batch_size, 1:].to(device, non_blocking=True)
            sync = micro == cfg.grad_accum - 1
            if cfg.fsdp:
                model.set_requires_gradient_sync(sync)
            with (model.no_sync() if ddp and not cfg.fsdp and not sync else contextlib.nullcontext()):
                with autocast():
                    logits = model(input_ids=ids[:, :-1], use_cache=False).logits
                lm = token_loss(logits, ids[:, 1:], mask)
                loss = lm
                if teacher is not None:
                    with torch.no_grad(), autocast():
                        t_logits = teacher(input_ids=ids[:, :-1], use_cache=False).logits
                    kl = distill_kl(logits, t_logits, mask, cfg.distill_temperature)
                    loss = (1.0 - cfg.distill_weight) * lm + cfg.distill_weight * kl
                    kl_sum += kl.detach()
                scaler.scale(loss / cfg.grad_accum).backward()
            lm_sum += lm.detach()
        stats = torch.stack([lm_sum, kl_sum]) / cfg.grad_accum
        if ddp:
            dist.all_reduce(stats, op=dist.ReduceOp.AVG if device.type == "cuda" else dist.ReduceOp.SUM)
            if device.type != "cuda":
                stats /= world
        train_loss, train_kl = float(stats[0]), float(stats[1])
        scaler.unscale_(optimizer)
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        if cfg.fsdp:
            from .sharding import average_replicated_grads, clip_grad_norm

            average_replicated_grads(trainable, world)  # the unsharded PIT interface
            grad_norm = clip_grad_norm(trainable, max_norm)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, max_norm)
        if not math.isfinite(train_loss) or (not scaler.is_enabled() and not torch.isfinite(grad_norm)):
            if progress is not None:
                progress.close()
            raise PitError(f"the loss became non-finite at step {step + 1} (loss {train_loss}, grad norm "
                           f"{float(grad_norm)}); training stopped without saving: {last_good()}. "
                           "Lower --lr, raise --warmup-steps or use --precision fp32/bf16")
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if z_trains:
            interface.retract_()  # back onto the Stiefel manifold (paper Eq. 13)
        if device.type == "cuda":
            torch.cuda.synchronize()
        step_time = time.perf_counter() - t0
        wall = time.perf_counter() - wall0
        step += 1
        tokens_seen += tokens_per_step
        step_times.append(step_time)
        last_train_loss = train_loss

        if step % cfg.log_every == 0 or step == total_steps:
            record = {"kind": "train", "step": step, "tokens": tokens_seen, "loss": train_loss,
                      "ppl": math.exp(min(train_loss, 50.0)), "lr": lr, "grad_norm": float(grad_norm),
                      "step_time": step_time, "tokens_per_s": tokens_per_step / wall}
            if teacher is not None:
                record["kl"] = train_kl
            if master or (cfg.fsdp and interface is None):  # a sharded TT table is gathered by all
                record["delta_ti"] = delta_ti(raw_model)
            if master:
                if z_trains:
                    record["z_orthogonality_error"] = interface.orthogonality_error()
            log_record(record)
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{train_loss:.4f}", tok_s=f"{tokens_per_step / wall:.0f}")
        if val is not None and (step % cfg.eval_every == 0 or step == total_steps):
            val_loss = evaluate()
            log_record({"kind": "eval", "step": step, "tokens": tokens_seen, "val_loss": val_loss,
                        "val_ppl": math.exp(min(val_loss, 50.0))})
        if cfg.save_every and (step % cfg.save_every == 0 or step == total_steps):
            save_checkpoint()
        if cfg.stop_after is not None and step >= cfg.stop_after:
            if progress is not None:
                progress.close()
            return None  # as if the process had been killed here

    if progress is not None:
        progress.close()
    if writer is not None:
        writer.close()

    # ---- artefacts -----------------------------------------------------------------------------
    result = None
    final = raw_model
    if cfg.fsdp:  # gather the shards (every process), then rank 0 rebuilds an ordinary model
        from .sharding import full_state_dicts

        full_state = full_state_dicts(model, optimizer)[0]
        if master:
            from .sharding import unsharded_model

            final = unsharded_model(raw_model.config, full_state)
    if master:
        if cfg.lora and cfg.merge:
            from .lora import merge

            final = merge(raw_model)
        if cfg.lora and not cfg.merge:
            from safetensors.torch import save_file

            with atomic_directory(out / "adapter", force=True) as tmp:
                raw_model.save_pretrained(tmp)
                if interface is not None and (cfg.lora_train_t or cfg.train_z):
                    # PEFT saves adapters only; the trained interface goes next to them.
                    save_file({k: v.detach().contiguous().cpu() for k, v in interface.state_dict().items()},
                              str(tmp / "pit_interface.safetensors"))
                if tokenizer is not None:
                    tokenizer.save_pretrained(tmp)
        else:
            save_model(final, out / "model", tokenizer, force=True)
        records = read_metrics(metrics_path)
        evals = [r for r in records if r["kind"] == "eval"]
        steady = sorted(step_times[1:] or step_times)
        result = TrainResult(
            out=str(out), steps=step, tokens=tokens_seen, final_train_loss=last_train_loss,
            final_val_loss=evals[-1]["val_loss"] if evals else None,
            initial_val_loss=evals[0]["val_loss"] if evals and evals[0]["step"] == 0 else None,
            median_step_time_s=steady[len(steady) // 2] if steady else None,
            tokens_per_s=(tokens_per_step / steady[len(steady) // 2]) if steady else None,
            extra={"tying": cfg.tying, "world_size": world, "delta_ti": delta_ti(final)},
        )
        write_text_atomic(out / "summary.json", json.dumps(asdict(result), indent=2))
        if cfg.plot:
            from ..analysis.plotting import RunLog, plot_runs

            plot_runs([RunLog.load(out)], out / "loss.png")
    if ddp:
        dist.barrier()
    return result
