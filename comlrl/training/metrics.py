"""Averaging per-step metrics over a logging window."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable

# Per-step counts (0 or 1 a step) that a window reports as totals: how many of its steps, not their share.
COUNTERS = frozenset({"dpo/steps_without_pairs"})


class MetricWindow:
    """Accumulates step metrics and returns, when flushed, each metric's mean over the steps that reported it.

    A step reports a metric by including it; NaN means "no value this step" (a statistic of nothing) and is
    left out like an absent metric, so it never turns a window's mean into NaN; a metric without any value
    in the window is absent from the flush. ``counters`` (default :data:`COUNTERS`) are totalled instead.
    """

    def __init__(self, counters: Iterable[str] = COUNTERS) -> None:
        self.counters = frozenset(counters)
        self._sums: dict[str, float] = defaultdict(float)
        self._counts: dict[str, int] = defaultdict(int)

    def add(self, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            value = float(value)
            if math.isnan(value):
                continue
            self._sums[name] += value
            self._counts[name] += 1

    def flush(self) -> dict[str, float]:
        means = {name: total if name in self.counters else total / self._counts[name]
                 for name, total in self._sums.items()}
        self._sums.clear()
        self._counts.clear()
        return means
