"""Memory options and measurements: weight precision, gradient checkpointing, per-device peak memory."""

from __future__ import annotations

import resource
import sys
from typing import Sequence

import torch
from transformers import PreTrainedModel

from comlrl.parallel.device import default_dtype

# The weights' dtype of each precision; "bf16-mixed" keeps float32 weights (comlrl.training.mixed_precision).
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "bf16-mixed": torch.float32}


def resolve_precision(precision: str, device: torch.device) -> torch.dtype:
    """``"auto"``: bf16 on CUDA GPUs that support it, float32 elsewhere; otherwise the named dtype."""
    if precision == "auto":
        return default_dtype(device)
    if precision in ("bf16", "bf16-mixed") and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"precision={precision!r} was requested but {device} does not support bfloat16; use 'fp16' or 'fp32'")
    return PRECISIONS[precision]


def enable_gradient_checkpointing(models: Sequence[PreTrainedModel]) -> None:
    """Recompute activations in the backward pass (non-reentrant: works with frozen bases and LoRA).

    Generation runs in eval mode, where transformers turns checkpointing off and keeps the KV cache.
    """
    for model in models:
        if hasattr(model, "activation_checkpointing_enable"):  # the name in recent transformers releases
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def is_checkpointing(model: PreTrainedModel) -> bool:
    if hasattr(model, "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def device_memory_metrics(devices: Sequence[torch.device]) -> dict[str, float]:
    """Peak memory per device since the last call, in GiB: CUDA allocator peaks, process peak RSS for CPU."""
    metrics: dict[str, float] = {}
    for device in dict.fromkeys(devices):
        if device.type == "cuda":
            metrics[f"memory/{device}/max_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
            torch.cuda.reset_peak_memory_stats(device)
        elif device.type == "cpu":
            metrics["memory/cpu/max_rss_gb"] = _peak_rss_bytes() / 2**30
    return metrics
