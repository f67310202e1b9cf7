"""Averaging per-step metrics over a logging window."""

from __future__ import annotations

from collections import defaultdict


class MetricWindow:
    """Accumulates step metrics and returns their means when flushed."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = defaultdict(float)
        self._counts: dict[str, int] = defaultdict(int)

    def add(self, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self._sums[name] += float(value)
            self._counts[name] += 1

    def flush(self) -> dict[str, float]:
        means = {name: self._sums[name] / self._counts[name] for name in self._sums}
        self._sums.clear()
        self._counts.clear()
        return means
