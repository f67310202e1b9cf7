"""A step's statistics over every process's samples, and averaging per-step metrics over a logging window."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, Collection, Iterable, Sequence

import torch

Total = Callable[[torch.Tensor], torch.Tensor]  # a tensor summed over the processes (itself in one process)


def this_process(sums: torch.Tensor) -> torch.Tensor:
    """The :data:`Total` of one process (or of statistics every process computes over the same samples)."""
    return sums


def pooled_means(series: Sequence[torch.Tensor], total: Total = this_process) -> list[float]:
    """The mean of each tensor's values that are not NaN (a dropped sample), over every process's values:
    ``total`` sums each series' count and sum over the processes in one collective. NaN for a series
    without a value on any process."""
    sums = torch.tensor([[float((~torch.isnan(values)).sum()), float(values.double().nansum())] for values in series],
                        dtype=torch.float64).reshape(-1, 2)
    return [first / count if count else math.nan for count, first in total(sums).tolist()]


def pooled_std(values: torch.Tensor, mean: float, total: Total = this_process) -> float:
    """The population standard deviation of ``values`` that are not NaN, over every process's values, around
    their pooled ``mean`` (:func:`pooled_means`). NaN without a value."""
    kept = values[~torch.isnan(values)].double()
    count, squares = total(torch.tensor([float(kept.numel()), float((kept - mean).square().sum())],
                                        dtype=torch.float64)).tolist()
    return math.sqrt(squares / count) if count else math.nan


# Per-step counts (0 or 1 a step) that a window reports as totals: how many of its steps, not their share.
COUNTERS = frozenset({"dpo/steps_without_pairs"})


def update_measurement(name: str, models: Collection[str]) -> bool:
    """Whether metric ``name`` is what the update of one of the trained ``models`` measured: its loss
    (``agent_0/loss``, ``agent_0/policy_loss``, ``critic/value_loss``) or its gradient norm (``agent_1/grad_norm``)."""
    model, _, measured = name.partition("/")
    return model in models and (measured == "grad_norm" or measured == "loss" or measured.endswith("_loss"))


class MetricWindow:
    """Accumulates step metrics and returns, when flushed, each metric's mean over the steps that reported it.

    A step reports a metric by including it; NaN means "no value this step" (a statistic of nothing) and is
    left out like an absent metric, so it never turns a window's mean into NaN; a metric without any value
    in the window is absent from the flush. The exception is an update's own measurement
    (:func:`update_measurement`): a NaN loss or gradient norm is what a non-finite update measured (the
    update was skipped and counted in ``nonfinite_updates``), so it is a value, and the window's mean is
    NaN. ``counters`` (default :data:`COUNTERS`) are totalled instead.
    """

    def __init__(self, counters: Iterable[str] = COUNTERS) -> None:
        self.counters = frozenset(counters)
        self._sums: dict[str, float] = defaultdict(float)
        self._counts: dict[str, int] = defaultdict(int)

    def add(self, metrics: dict[str, float], models: Collection[str] = ()) -> None:
        """Add one step's ``metrics``; ``models`` names the trained models, whose update measurements keep a NaN."""
        for name, value in metrics.items():
            value = float(value)
            if math.isnan(value) and not update_measurement(name, models):
                continue
            self._sums[name] += value
            self._counts[name] += 1

    def flush(self) -> dict[str, float]:
        means = {name: total if name in self.counters else total / self._counts[name]
                 for name, total in self._sums.items()}
        self._sums.clear()
        self._counts.clear()
        return means
