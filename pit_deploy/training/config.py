"""The options of a training run: one dataclass whose fields carry their own flag, help text
and group, so ``pit-deploy train``'s flags are generated from it (``cli.add_train``) and a
default lives in exactly one place. :func:`validate` rejects every bad value up front, before
anything slow happens (``docs/training.md`` lists the options; ``docs/conventions.md`` the exit
codes)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..errors import PitError
from ..options import Flag, dataclass_flags, field_default, flag_name, opt

PRECISIONS = ("fp32", "bf16", "fp16")
# Options that must not change between a run and its resumption.
RESUME_KEYS = ("model", "tying", "from_scratch", "arch", "seq_len", "batch_size", "grad_accum",
               "seed", "data", "lora", "t_init", "train_z", "train_body", "fsdp")
GROUPS = ("model", "data", "optimization", "distillation", "LoRA", "run")  # flag groups, in --help order
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?|mps)$")
#: learning rates and warm-up left to the start (:func:`with_start_defaults`)
SCRATCH_LR = 3e-4
CPT_LR = 1e-5
CPT_WARMUP = 4
#: defaults of ``--t-max-cond`` and ``--max-delta-ti`` (``docs/training.md``, "Keeping T well
#: conditioned"; measured in ``studies/t-conditioning.md``)
T_MAX_COND = 1e3
MAX_DELTA_TI = 1e-4


@dataclass
class TrainConfig:
    """Every option of ``pit-deploy train`` (see ``docs/training.md``)."""

    out: str = opt(None, "run directory", group="run")
    # model
    model: str = opt("default", "default | GGUF file | HF/PIT directory | hub id", group="model")
    tying: str = opt("pit", "PIT or transpose tying (baseline)", group="model", choices=("pit", "tt"))
    t_init: str | None = opt(None, "T init when converting: preserve | identity | input | output (default: preserve "
                                   "where the family allows it, else output)", group="model")
    diagonal: str = opt("softplus", "map to L's diagonal: softplus | exp", group="model")
    train_z: bool = opt(False, "train Z too (polar retraction after each step)", group="model")
    train_body: bool = opt(True, "train the interface (T; Z with --train-z) and the final norm only: the body's "
                           "linears and block norms stay as converted (a source stored on a 4-bit grid stays on it)",
                           group="model", flag="--interface-only")
    from_scratch: bool = opt(False, "random init of --arch instead of --model", group="model")
    arch: str = opt("tiny", "llama-0.3b | llama-0.6b | llama-1.2b | llama-135m | tiny", group="model")
    tokenizer: str | None = opt(None, "tokenizer source (default: that of --model)", group="model")
    # data
    data: str = opt("default", "default | file | directory | hub dataset id", group="data")
    data_config: str | None = opt(None, "hub dataset config (e.g. sample-10BT)", group="data")
    data_split: str = opt("train", "hub dataset split", group="data")
    streaming: bool = opt(True, "download the hub split instead of streaming", group="data", flag="--no-streaming")
    val_fraction: float = opt(0.05, "share of documents held out, in [0, 1)", group="data")
    text_field: str = opt("text", "JSONL/hub field of plain text", group="data")
    prompt_field: str = opt("prompt", "JSONL/hub field of prompts (loss masked)", group="data")
    completion_field: str = opt("completion", "JSONL/hub field of completions (trained)", group="data")
    seq_len: int = opt(256, "tokens per block", group="data")
    # optimization
    steps: int | None = opt(None, "optimizer steps (or --tokens)", group="optimization")
    tokens: int | None = opt(None, "token budget (instead of --steps)", group="optimization")
    batch_size: int = opt(4, "blocks per process per micro-step", group="optimization")
    grad_accum: int = opt(1, "micro-steps per optimizer step (loss normalized by trained tokens)",
                          group="optimization")
    lr: float | None = opt(None, "peak learning rate (> 0; default: 3e-4 from scratch, with --lora or a paper "
                                 "--t-init, 1e-5 when continuing a pretrained model)", group="optimization")
    lr_t: float | None = opt(None, "learning rate of T's factors (default: --lr; 0 freezes T's rate)",
                             group="optimization")
    min_lr_ratio: float = opt(0.1, "cosine floor as a fraction of --lr, in [0, 1]", group="optimization")
    warmup_steps: int | None = opt(None, "linear warmup steps (default: 0 from scratch, with --lora or a paper "
                                         "--t-init, 4 when continuing a pretrained model)", group="optimization")
    weight_decay: float = opt(0.1, "on matrices; never on Z, L, norms, biases", group="optimization")
    betas: tuple[float, float] = opt((0.9, 0.95), "AdamW betas, e.g. 0.9,0.95", group="optimization")
    grad_clip: float = opt(1.0, "max gradient norm (0: off)", group="optimization")
    t_max_cond: float = opt(T_MAX_COND, "cap on cond(T) kept after every step by raising T's smallest eigenvalues "
                                        "(0: off; a start above it keeps its own)", group="optimization")
    max_delta_ti: float = opt(MAX_DELTA_TI, "stop (exit 1) when ‖W_out E − I‖_F exceeds this (0: never)",
                              group="optimization")
    precision: str = opt("fp32", "autocast precision", group="optimization", choices=PRECISIONS)
    seed: int = opt(0, "seed of the model init, the data order and dropout", group="optimization")
    device: str = opt("auto", "auto | cpu | cuda | cuda:N", group="optimization")
    compile: bool = opt(False, "torch.compile the model (one warning line and eager when compiling fails)",
                        group="optimization")
    # distillation
    distill: bool = opt(False, "add KL to the frozen source model's logits", group="distillation")
    distill_weight: float = opt(0.5, "loss = (1-w)·LM + w·KL, w in [0, 1]", group="distillation")
    distill_temperature: float = opt(1.0, "softmax temperature of the KL (> 0)", group="distillation")
    # LoRA
    lora: bool = opt(False, "train LoRA adapters (PEFT) on attention/MLP linears", group="LoRA")
    lora_rank: int = opt(8, "adapter rank", group="LoRA")
    lora_alpha: float = opt(16.0, "adapter scale numerator", group="LoRA")
    lora_targets: list[str] | None = opt(None, "comma-separated module names (default: all attention/MLP linears)",
                                         group="LoRA")
    lora_train_t: bool = opt(False, "train T next to the adapters", group="LoRA")
    merge: bool = opt(False, "write the merged PIT model to OUT/model", group="LoRA")
    # run
    eval_every: int = opt(0, "validation every N steps (0: off)", group="run")
    eval_blocks: int = opt(8, "held-out blocks per evaluation", group="run")
    log_every: int = opt(1, "log every N steps", group="run")
    save_every: int = opt(0, "checkpoint every N steps (0: none)", group="run")
    keep_checkpoints: int = opt(2, "checkpoints kept on disk", group="run")
    resume: bool = opt(False, "continue from the newest complete checkpoint in --out", group="run")
    fsdp: bool = opt(False, "under torchrun: shard the model over the processes (FSDP) instead of DDP", group="run")
    force: bool = opt(False, "replace a non-empty --out", group="run")
    progress: bool = opt(True, "no progress bar", group="run", flag="--no-progress")
    tensorboard: bool = opt(False, "also log to OUT/tensorboard (needs tensorboard)", group="run")
    plot: bool = opt(True, "no loss.png", group="run", flag="--no-plot")
    eval_prose: bool = opt(False, "also evaluate held-out English prose shipped with the package (val_prose_loss; at most "
                           "--eval-blocks blocks)",
                           group="run")
    peak_tflops: float | None = opt(None, "the device's peak TFLOP/s for the logged MFU (default: known for "
                                          "H100/H200 at bf16/fp16; none on CPU)", group="run")
    max_seconds: float = opt(0.0, "end the run after the first step that passes this many seconds of training "
                                  "(0: no limit; the schedule stays that of the full budget)", group="run")

    def data_config_obj(self):
        from ..data.corpus import DataConfig

        return DataConfig(
            spec=self.data, seq_len=self.seq_len, seed=self.seed, val_fraction=self.val_fraction,
            hub_config=self.data_config, hub_split=self.data_split, streaming=self.streaming,
            text_field=self.text_field, prompt_field=self.prompt_field,
            completion_field=self.completion_field,
        )

    @property
    def t_lr_scale(self) -> float:
        """``lr_t / lr``: 1 when ``lr_t`` is unset (``None``), 0 when it is 0 (T's rate frozen)."""
        return 1.0 if self.lr_t is None else self.lr_t / self.lr


def default_of(name: str) -> Any:
    """The default of field ``name`` (``None`` when it has none)."""
    return field_default(TrainConfig, name)


_flag = flag_name


def with_start_defaults(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with the learning rate and warm-up its start calls for, where they were left out.

    From scratch, for LoRA adapters and from one of the paper's conversions (which lose what the
    source knew, ``docs/conversion.md``: little to keep): ``3e-4`` with no warm-up. Continued pretraining of a
    pretrained model — PIT from the source-preserving conversion or the TT baseline, which both
    start at the source's loss — takes :data:`CPT_LR` after :data:`CPT_WARMUP` steps: the
    rate at which PIT ended best and rose least above its start in the measured
    sweep (``studies/continued-pretraining.md``); a from-scratch rate there undoes what the conversion kept."""
    from dataclasses import replace

    paper_init = cfg.tying == "pit" and cfg.t_init in ("identity", "input", "output")
    scratch_like = cfg.from_scratch or cfg.lora or paper_init
    lr = cfg.lr if cfg.lr is not None else (SCRATCH_LR if scratch_like else CPT_LR)
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else (0 if scratch_like else CPT_WARMUP)
    return replace(cfg, lr=lr, warmup_steps=warmup)


def changed_resume_keys(saved: dict[str, Any], mine: dict[str, Any]) -> list[str]:
    """The :data:`RESUME_KEYS` on which a checkpoint's config ``saved`` differs from ``mine``
    (both as written to JSON). A key newer than the checkpoint counts as its default, which is
    what the run that saved it did: a run saved before an option existed still resumes."""
    return [k for k in RESUME_KEYS if saved.get(k, field_default(TrainConfig, k)) != mine.get(k)]


def option_flag(key: str) -> str:
    """The command-line flag of the :class:`TrainConfig` field ``key`` (``train_body``:
    ``--interface-only``)."""
    meta = next((f.metadata for f in fields(TrainConfig) if f.name == key), {})
    return meta.get("flag") or flag_name(key)


def describe_change(key: str, before: Any, now: Any) -> str:
    """One option's change between two invocations, named by its flag: ``--steps 2 → 3``; a
    switch says whether it was given (``--interface-only given now, not before``)."""
    flag, default = option_flag(key), field_default(TrainConfig, key)
    if isinstance(default, bool):
        given = lambda value: "given" if value != default else "not given"  # noqa: E731
        return f"{flag} {given(now)} now, {given(before)} before"
    return f"{flag} {before} → {now}"


def validate(cfg: TrainConfig) -> None:
    """Reject inconsistent or out-of-range options before anything slow happens (exit 2)."""
    from ..model.choices import CONVERSIONS, DIAGONAL_MAPS

    if not cfg.out:
        raise PitError("--out is required: the run directory")
    if cfg.tying not in ("pit", "tt"):
        raise PitError(f"unknown --tying {cfg.tying!r}; choose pit or tt")
    if cfg.precision not in PRECISIONS:
        raise PitError(f"unknown --precision {cfg.precision!r}; choose {', '.join(PRECISIONS)}")
    if cfg.t_init is not None and cfg.t_init not in CONVERSIONS:
        raise PitError(f"unknown --t-init {cfg.t_init!r}; choose one of {', '.join(CONVERSIONS)}")
    if cfg.diagonal not in DIAGONAL_MAPS:
        raise PitError(f"unknown --diagonal {cfg.diagonal!r}; choose one of {', '.join(DIAGONAL_MAPS)}")
    if not _DEVICE.match(cfg.device):
        raise PitError(f"unknown --device {cfg.device!r}; choose auto, cpu, cuda, cuda:N or mps")
    if (cfg.steps is None) == (cfg.tokens is None):
        raise PitError("give exactly one of --steps and --tokens")
    for name in ("seq_len", "batch_size", "grad_accum", "log_every", "eval_blocks", "keep_checkpoints",
                 "lora_rank"):
        if getattr(cfg, name) < 1:
            raise PitError(f"{_flag(name)} must be at least 1, got {getattr(cfg, name)}")
    for name in ("warmup_steps", "save_every", "eval_every"):
        if getattr(cfg, name) < 0:
            raise PitError(f"{_flag(name)} must be 0 or more, got {getattr(cfg, name)}")
    if (cfg.steps is not None and cfg.steps < 1) or (cfg.tokens is not None and cfg.tokens < 1):
        raise PitError("--steps/--tokens must be positive")
    floats = {"lr": cfg.lr, "weight_decay": cfg.weight_decay, "grad_clip": cfg.grad_clip,
              "t_max_cond": cfg.t_max_cond, "max_delta_ti": cfg.max_delta_ti,
              "min_lr_ratio": cfg.min_lr_ratio, "distill_weight": cfg.distill_weight,
              "distill_temperature": cfg.distill_temperature, "lora_alpha": cfg.lora_alpha,
              "val_fraction": cfg.val_fraction}
    if cfg.lr_t is not None:
        floats["lr_t"] = cfg.lr_t
    if cfg.peak_tflops is not None:
        floats["peak_tflops"] = cfg.peak_tflops
    floats["max_seconds"] = cfg.max_seconds
    for name, value in floats.items():
        if not math.isfinite(value):
            raise PitError(f"{_flag(name)} must be a finite number, got {value}")
    if cfg.lr <= 0:
        raise PitError(f"--lr must be positive, got {cfg.lr}")
    if cfg.lr_t is not None and cfg.lr_t < 0:
        raise PitError(f"--lr-t must be 0 or more, got {cfg.lr_t} (0 keeps T's factors at their start)")
    for name in ("weight_decay", "grad_clip"):
        if getattr(cfg, name) < 0:
            raise PitError(f"{_flag(name)} must be 0 or more, got {getattr(cfg, name)}"
                           + (" (0 turns clipping off)" if name == "grad_clip" else ""))
    if cfg.t_max_cond != 0 and not cfg.t_max_cond > 1:
        raise PitError(f"--t-max-cond must exceed 1 (a bound on λ_max/λ_min), or be 0 for no floor; got {cfg.t_max_cond}")
    if cfg.peak_tflops is not None and cfg.peak_tflops <= 0:
        raise PitError(f"--peak-tflops must be positive, got {cfg.peak_tflops}")
    if cfg.max_seconds < 0:
        raise PitError(f"--max-seconds must be 0 (no limit) or positive, got {cfg.max_seconds}")
    if cfg.max_delta_ti < 0:
        raise PitError(f"--max-delta-ti must be 0 (no check) or positive, got {cfg.max_delta_ti}")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise PitError(f"--min-lr-ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    if len(cfg.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.betas):
        raise PitError(f"--betas must be two numbers in [0, 1), got {cfg.betas}")
    if not 0.0 <= cfg.distill_weight <= 1.0:
        raise PitError("--distill-weight must be in [0, 1] (loss = (1-w)·LM + w·KL)")
    if cfg.distill_temperature <= 0:
        raise PitError(f"--distill-temperature must be positive, got {cfg.distill_temperature}")
    if cfg.lora_alpha <= 0:
        raise PitError(f"--lora-alpha must be positive, got {cfg.lora_alpha}")
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise PitError("--val-fraction must be in [0, 1)")
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
    if not cfg.train_body and cfg.tying != "pit":
        raise PitError("--interface-only trains the PIT interface, which --tying tt has none of; drop one of them")
    if not cfg.train_body and (cfg.lora or cfg.from_scratch):
        raise PitError(f"--interface-only keeps the converted body; it cannot be used with "
                       f"{'--lora' if cfg.lora else '--from-scratch'}")


def write_config(cfg: TrainConfig, path: Path) -> Path:
    """``cfg`` as a JSON file of its fields, which ``pit-deploy train --config FILE`` reads back
    (how ``pit-deploy run`` hands a ``torchrun`` child its configuration)."""
    from dataclasses import asdict

    from ..io.fs import write_json_atomic

    return write_json_atomic(path, asdict(cfg))


def read_config(path: str | Path) -> TrainConfig:
    """The config a :func:`write_config` file holds.

    Raises:
        PitError: not a readable JSON object of config fields, or a value of the wrong type
            (naming the key).
    """
    import json
    from dataclasses import fields

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PitError(f"--config {path}: cannot read a training config ({exc})") from None
    known = {f.name for f in fields(TrainConfig)}
    if not isinstance(data, dict) or set(data) - known:
        extra = sorted(set(data) - known) if isinstance(data, dict) else []
        raise PitError(f"--config {path}: expected a JSON object of training options"
                       + (f"; unknown: {', '.join(extra)}" if extra else ""))
    if isinstance(data.get("betas"), list):
        data["betas"] = tuple(data["betas"])
    from ..options import check_types

    check_types(TrainConfig, data, lambda name: f"--config {path}: {name}")
    return TrainConfig(**data)


def config_flags() -> list[Flag]:
    """The flags of every command-line field of :class:`TrainConfig`, in field order (``--out``
    is required by :func:`validate`, so that ``--config FILE`` can stand alone)."""
    return dataclass_flags(TrainConfig)
