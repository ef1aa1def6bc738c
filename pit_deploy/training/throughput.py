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
device (H100 SXM and H200: 989 TFLOP/s; H100 NVL: 835; H100 PCIe: 756), else, for an fp32 run on an
x86 CPU, the CPU's fp32 vector peak (:func:`cpu_peak_flops`), else unknown (``None``: an fp32 run on
a GPU, an unlisted GPU, a CPU whose vector width or clock cannot be read), and MFU is then ``None``.
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


#: fp32 FLOPs a core retires per cycle at its widest vector ISA, by ``/proc/cpuinfo`` flag (first
#: match): two FMA units of 16 (AVX-512) or 8 (AVX2) lanes, two FLOPs an FMA
CPU_FP32_FLOPS_PER_CYCLE: tuple[tuple[str, int], ...] = (("avx512f", 64), ("avx2", 32))


def cpu_peak_flops(threads: int | None = None, cpuinfo: str | None = None) -> float | None:
    """The fp32 peak of the cores an fp32 CPU run uses: ``threads`` (torch's intra-op threads)
    × FLOPs per cycle (:data:`CPU_FP32_FLOPS_PER_CYCLE`; both FMA units assumed, so an upper
    bound on parts with one) × the clock (the kernel's maximum frequency where it reports one,
    else ``cpu MHz`` of ``/proc/cpuinfo``, the base clock a virtual machine reports). ``None``
    where the flags or the clock cannot be read (not x86 Linux)."""
    import re
    from pathlib import Path

    try:
        text = cpuinfo if cpuinfo is not None else Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    found = re.search(r"^flags\s*:(.*)$", text, re.M)
    flags = set(found.group(1).split()) if found else set()
    per_cycle = next((n for flag, n in CPU_FP32_FLOPS_PER_CYCLE if flag in flags), None)
    hz = None
    if cpuinfo is None:
        try:
            hz = int(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text().strip()) * 1e3
        except (OSError, ValueError):
            hz = None
    if hz is None:
        found = re.search(r"^cpu MHz\s*:\s*([0-9.]+)", text, re.M)
        hz = float(found.group(1)) * 1e6 if found else None
    if per_cycle is None or not hz:
        return None
    return float(threads if threads is not None else torch.get_num_threads()) * per_cycle * hz


def peak_flops(device: torch.device, precision: str, override_tflops: float | None = None) -> float | None:
    """The device's peak FLOP/s for MFU: the override, a known bf16/fp16 GPU peak, the CPU's
    fp32 peak for an fp32 CPU run, or ``None``."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type == "cpu" and precision == "fp32":
        return cpu_peak_flops()
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
