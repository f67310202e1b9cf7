"""The original comlrl's process context names, as thin adapters over :mod:`comlrl.parallel.distributed`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from comlrl.parallel.distributed import DataParallel


@dataclass(frozen=True)
class DistributedContext:
    """Whether this process is the main one, and the device it computes on."""

    is_main: bool
    device: torch.device


def local_context(device: torch.device | None = None) -> DistributedContext:
    """The context of a plain single-process run: main process, on ``device``.

    ``device`` defaults to CUDA when available, else the CPU. No process group is joined
    (use :func:`comlrl.parallel.distributed.current` for launched runs).
    """
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return DistributedContext(is_main=DataParallel().is_main, device=device)


def unwrap_model(model: Any) -> Any:
    """The module inside a wrapper that keeps it as ``.module`` (DDP, DataParallel); else ``model``."""
    return getattr(model, "module", model)


__all__ = ["DistributedContext", "local_context", "unwrap_model"]
