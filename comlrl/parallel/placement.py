"""Placement: which device every agent and critic lives on, and running per-agent work side by side.

A placement is ``"auto"`` (spread over this process's GPUs by parameter count; CPU when there
are none), one device for every model (``"cpu"``, ``"cuda:1"``), or a list with one entry per
model. Every entry is resolved and checked before any model loads. Work of agents on
different GPUs runs in threads (CUDA kernels release the GIL); anything else runs one model
after another, so CPU runs stay deterministic.
"""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence, TypeVar

import torch
from transformers import PreTrainedModel

from comlrl.parallel.device import resolve_device

T = TypeVar("T")
Placement = str | Sequence[str] | None


# The original comlrl's names of the placement fields, which its length errors use.
ORIGINAL_FIELD_NAMES = {"device": "agent_devices", "critic_device": "critic_devices"}


def check_placement_format(placement: Any, count: int, where: str) -> str | None:
    """A problem with the shape of a placement (None when fine); CUDA availability is checked at resolve time.

    A one-entry list places every model there (as one device string does)."""
    if placement is None or isinstance(placement, str):
        return None
    if not isinstance(placement, (list, tuple)) or not all(isinstance(entry, str) for entry in placement):
        return f"{where} must be 'auto', a device string or a list of device strings, got {placement!r}"
    if len(placement) not in (1, count):
        field = where.rsplit(".", 1)[-1]
        kind = ORIGINAL_FIELD_NAMES.get(field, field)
        return (f"{kind} length ({len(placement)}) must be 1 or {count}: {where} lists {list(placement)} for "
                f"{count} models (give one device or {count})")
    return None


def local_gpus(local_rank: int = 0, local_world_size: int = 1) -> list[torch.device]:
    """The GPUs this process may use: all visible ones, or its even share when several processes share a node."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return []
    share = max(1, count // max(local_world_size, 1))
    first = (local_rank * share) % count
    return [torch.device("cuda", index) for index in range(first, min(first + share, count))]


def spread_by_size(sizes: Sequence[int], devices: Sequence[torch.device]) -> list[torch.device]:
    """Largest model first onto the least-loaded device (greedy bin balancing)."""
    load = [0] * len(devices)
    chosen: list[torch.device | None] = [None] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        target = min(range(len(devices)), key=lambda d: (load[d], d))
        chosen[index] = devices[target]
        load[target] += sizes[index]
    return chosen  # type: ignore[return-value]


def parameter_count(source: Any, trust_remote_code: bool = False) -> int:
    """Parameters of a model object, or of an identifier/directory built on the meta device (no weights read)."""
    if isinstance(source, torch.nn.Module):
        return sum(p.numel() for p in source.parameters())
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return sum(p.numel() for p in model.parameters())


def resolve_placement(
    placement: Placement,
    sources: Sequence[Any],
    where: str,
    gpus: Sequence[torch.device] | None = None,
    trust_remote_code: bool = False,
) -> list[torch.device]:
    """One checked ``torch.device`` per source; raises naming ``where`` and the entry for impossible devices."""
    problem = check_placement_format(placement, len(sources), where)
    if problem:
        raise ValueError(problem)
    gpus = list(gpus) if gpus is not None else local_gpus()
    if placement in (None, "auto"):
        if not gpus:
            return [torch.device("cpu")] * len(sources)
        if len(gpus) == 1 or len(sources) == 1:
            return [gpus[0]] * len(sources)
        return spread_by_size([parameter_count(s, trust_remote_code) for s in sources], gpus)
    one = isinstance(placement, str) or len(placement) == 1
    entries = [placement if isinstance(placement, str) else placement[0]] * len(sources) if one else list(placement)
    devices = []
    for index, entry in enumerate(entries):
        label = where if one else f"{where}[{index}]"
        if entry == "auto":
            raise ValueError(f"{label}='auto' is only allowed for the whole placement, not one entry of {list(entries)}")
        try:
            devices.append(resolve_device(entry))
        except ValueError as error:
            raise ValueError(f"{label}={entry!r} cannot be used: {error}") from None
    return devices


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def runs_concurrently(devices: Sequence[torch.device]) -> bool:
    """Per-agent work is threaded only across two or more distinct CUDA devices."""
    return len({d for d in devices if d.type == "cuda"}) >= 2


# How per-agent work is spread: ``agent_map(function, devices) -> [function(i) for each agent]``.
# Trainers hold one (``trainer.agent_map``, default :func:`map_by_device`); the pipeline can
# install one that runs each agent's work as a task of a distributed task runner.
AgentMap = Callable[[Callable[[int], Any], Sequence[torch.device]], list[Any]]


def map_by_device(function: Callable[[int], T], devices: Sequence[torch.device]) -> list[T]:
    """``[function(i) for i in range(len(devices))]``; models on different GPUs run in parallel threads.

    Items sharing a device run one after another in that device's thread, in index order.
    """
    if not runs_concurrently(devices):
        return [function(index) for index in range(len(devices))]
    groups: dict[torch.device, list[int]] = {}
    for index, device in enumerate(devices):
        groups.setdefault(device, []).append(index)

    def run_group(device: torch.device, indices: list[int]) -> list[tuple[int, T]]:
        if device.type != "cuda":
            return [(index, function(index)) for index in indices]
        with torch.cuda.device(device):
            return [(index, function(index)) for index in indices]

    results: list[Any] = [None] * len(devices)
    with ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="comlrl-device") as pool:
        futures = [pool.submit(run_group, device, indices) for device, indices in groups.items()]
        for future in futures:
            for index, value in future.result():
                results[index] = value
    return results


def private_tokenizers(tokenizers: Sequence[Any]) -> list[Any]:
    """A tokenizer object shared by several agents, copied per agent: fast tokenizers are not thread-safe."""
    seen: set[int] = set()
    result = []
    for tokenizer in tokenizers:
        result.append(copy.deepcopy(tokenizer) if id(tokenizer) in seen else tokenizer)
        seen.add(id(tokenizer))
    return result


def devices_of(models: Sequence[PreTrainedModel]) -> list[torch.device]:
    return [model_device(model) for model in models]
