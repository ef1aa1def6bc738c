"""Throughput figures of a training step: FLOPs per token, the device's peak, MFU, peak memory.

Model FLOPs utilization (MFU) is the fraction of the device's peak that the model's own
arithmetic uses: ``tokens/s × FLOPs per token / peak FLOP/s``. FLOPs per trained token follow
the usual estimate for a decoder (Kaplan et al.; PaLM, appendix B): ``6 N`` for the forward
and backward matmuls of ``N`` parameters, plus ``12 · layers · heads · head_dim · seq_len`` for
the attention scores and their weighted sums. ``N`` counts every distinct parameter once: the
token table once (the head's ``V×d`` matmul; an embedding lookup costs no FLOPs), and for a
PIT model ``Z`` and ``T``'s factor, which the head multiplies by. Recomputation and the
optimizer are not counted, as MFU conventionally does not.

The peak is ``--peak-tflops`` when given, else the dense bf16/fp16 tensor-core figure of a known
device (H100 SXM and H200: 989 TFLOP/s; H100 NVL: 835; H100 PCIe: 756), else unknown (``None``: on a CPU, or
an fp32 run, or an unlisted GPU), and MFU is then ``None`` too.
"""

from __future__ import annotations

from typing import Any

import torch

#: dense bf16/fp16 tensor-core peaks in TFLOP/s, by a substring of the device name (first match)
KNOWN_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
)


def parameter_count(model: torch.nn.Module) -> int:
    """Distinct parameters of ``model`` (shared tensors counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Training FLOPs per trained token: ``6 N + 12 · layers · heads · head_dim · seq_len``."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    layers = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    hidden = int(getattr(cfg, "hidden_size", 0) or 0)
    head_dim = int(getattr(cfg, "head_dim", 0) or (hidden // heads if heads else 0))
    return 6.0 * parameter_count(model) + 12.0 * layers * heads * head_dim * seq_len


def peak_flops(device: torch.device, precision: str, override_tflops: float | None = None) -> float | None:
    """The device's peak FLOP/s for MFU: the override, a known bf16/fp16 peak, or ``None``."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type != "cuda" or precision not in ("bf16", "fp16"):
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in KNOWN_PEAK_TFLOPS:
        if key in name:
            return tflops * 1e12
    return None


def mfu(tokens_per_s: float, flops_per_tok: float, peak: float | None) -> float | None:
    """Model FLOPs utilization, or ``None`` when the peak is unknown."""
    if peak is None or not peak > 0:
        return None
    return tokens_per_s * flops_per_tok / peak


def peak_memory_mb(device: torch.device) -> float | None:
    """``torch.cuda.max_memory_allocated`` in MB (10⁶ bytes) since the run began; ``None`` off CUDA."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 1e6


def device_info(device: torch.device) -> dict[str, Any]:
    """Name and versions of the device a run trains on (for its ``summary.json``)."""
    info: dict[str, Any] = {"type": device.type, "torch": torch.__version__}
    if device.type == "cuda":
        info["name"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
        props = torch.cuda.get_device_properties(device)
        info["memory_gb"] = round(props.total_memory / 1e9, 1)
    else:
        import platform

        info["name"] = platform.processor() or platform.machine()
    return info
