"""The one device choice: CUDA with bf16 when a GPU is present, CPU with float32 otherwise."""

from __future__ import annotations

import torch


def resolve_device(name: str | None = "auto") -> torch.device:
    """Turn ``"auto"``/``None``/``"cpu"``/``"cuda"``/``"cuda:N"`` into a checked ``torch.device``.

    Fails before anything is loaded when a CUDA device is asked for that this machine lacks.
    """
    if name in (None, "auto"):
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ValueError(f"device {name!r} is not a valid torch device string ({error})") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = device.index or 0
        if index >= count:
            raise ValueError(
                f"device {name!r} was requested but this machine has {count} CUDA device(s); "
                "use 'cpu', 'auto' or an existing 'cuda:N'"
            )
    return device


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPUs that support it, float32 elsewhere (CPU training stays exact and reproducible)."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32
