"""The original comlrl's process context names, as thin adapters over :mod:`comlrl.parallel.distributed`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from comlrl.parallel.distributed import DataParallel


@dataclass(frozen=True)
class DistributedContext:
    """Whether this process is the main one and the device it computes on (comlrl 1.4.3's two fields), and
    where it stands in a launch (the fields later versions of the original added; one process by default)."""

    is_main: bool
    device: torch.device
    enabled: bool = False
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0


def local_context(device: torch.device | None = None) -> DistributedContext:
    """The context of a plain single-process run: main process, on ``device``.

    ``device`` defaults to CUDA when available, else the CPU. No process group is joined
    (use :func:`comlrl.parallel.distributed.current` for launched runs).
    """
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return DistributedContext(is_main=DataParallel().is_main, device=device)


def all_gather_objects(obj: Any, context: DistributedContext) -> list[Any]:
    """``obj`` from every process, in rank order (``[obj]`` when not distributed)."""
    if not context.enabled:
        return [obj]
    gathered: list[Any] = [None] * context.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def reduce_metrics_dict(metrics: dict[str, float], context: DistributedContext) -> dict[str, float]:
    """Each metric's mean over the processes, on the main process (the others get ``{}``); ``metrics`` as it is
    when not distributed. Every process must report the same names: a difference is refused on every process
    (so none waits in a collective the others skip), naming the names."""
    if not context.enabled:
        return metrics
    names = sorted(metrics)
    reported = all_gather_objects(names, context)
    if any(other != names for other in reported):
        raise ValueError(f"reduce_metrics_dict needs the same metric names on every process; by rank: {reported}")
    values = torch.tensor([float(metrics[name]) for name in names], dtype=torch.float64, device=context.device)
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    if not context.is_main:
        return {}
    return dict(zip(names, (values / context.world_size).tolist()))


def unwrap_model(model: Any) -> Any:
    """The module inside a wrapper that keeps it as ``.module`` (DDP, DataParallel); else ``model``."""
    return getattr(model, "module", model)


__all__ = ["DistributedContext", "all_gather_objects", "local_context", "reduce_metrics_dict", "unwrap_model"]
