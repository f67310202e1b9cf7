"""Datasets, prompt formatting and the seeded data order of each epoch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Sequence

import torch

Formatter = Callable[[Mapping[str, Any]], str]


def check_dataset(dataset: Any, argument: str) -> None:
    """A dataset is anything indexable with a length whose rows are mappings (a ``datasets.Dataset``)."""
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise ValueError(f"{argument} must be a datasets.Dataset or a sequence of dicts, got {type(dataset).__name__}")
    if len(dataset) == 0:
        raise ValueError(f"{argument} is empty; it needs at least one row")
    first = dataset[0]
    if not isinstance(first, Mapping):
        raise ValueError(f"{argument}[0] must be a dict-like row, got {type(first).__name__}: {first!r}")


def default_formatter(row: Mapping[str, Any]) -> str:
    """Use the row's ``prompt`` field as it is."""
    return row["prompt"]


def resolve_formatters(formatters: Formatter | Sequence[Formatter] | None, num_agents: int) -> list[Formatter]:
    """One formatter per agent: none (use ``prompt``), one callable for all, or a list of ``num_agents``."""
    if formatters is None:
        return [default_formatter] * num_agents
    if callable(formatters):
        return [formatters] * num_agents
    if isinstance(formatters, (str, bytes)) or not isinstance(formatters, Sequence):
        raise ValueError("formatters must be None, a callable, or a sequence of callables. "
                         f"Got {type(formatters).__name__}: {formatters!r:.100}")
    formatters = list(formatters)
    if len(formatters) != num_agents:
        raise ValueError("Number of formatters must match num_agents when providing a sequence: "
                         f"formatters has {len(formatters)} entries but there are {num_agents} agents")
    for index, formatter in enumerate(formatters):
        if not callable(formatter):
            raise ValueError("formatters must be None, a callable, or a sequence of callables: "
                             f"formatters[{index}] is a {type(formatter).__name__}")
    return formatters


def format_prompt(formatter: Formatter, row: Mapping[str, Any], agent: int, row_index: int | str) -> str:
    """Apply a formatter, turning a missing field into an error that names the row and field, and an
    empty prompt (nothing for generation to start from) into an error that names the row."""
    try:
        prompt = formatter(row)
    except KeyError as error:
        raise ValueError(
            f"row {row_index} has no field {error.args[0]!r} needed by the formatter of agent {agent} "
            f"(fields present: {sorted(row)})"
        ) from None
    if not isinstance(prompt, str):
        raise ValueError(f"the formatter of agent {agent} returned {type(prompt).__name__} for row {row_index}; it must return str")
    if not prompt:
        raise ValueError(f"row {row_index} gives agent {agent} an empty prompt; every prompt needs some text "
                         f"(the row's fields: {dict(row)!r:.200})")
    return prompt


def epoch_order(num_rows: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """Row order of one epoch: a permutation drawn from ``seed`` and ``epoch`` alone.

    Depending only on these two numbers makes an epoch's order reproducible on resume.
    """
    if not shuffle:
        return list(range(num_rows))
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_rows, generator=generator).tolist()


def batches(order: list[int], batch_size: int) -> list[list[int]]:
    """Consecutive index batches; the last one may be shorter."""
    return [order[start:start + batch_size] for start in range(0, len(order), batch_size)]
