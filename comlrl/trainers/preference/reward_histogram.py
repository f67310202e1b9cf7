"""The reward histogram of an iteration, as comlrl 1.4.3's iterative trainers computed it.

Pure functions over reward lists: the finite rewards, ``NUM_BINS`` equal bins over the reward's declared
``reward_range`` (rewards outside it counted in the end bins), a series' counts and mean, the metrics of a
target/comparator pair of series. :class:`RewardHistogramNames` puts them behind the names the original's
``MADPOIterTrainer``/``MARLHFIterTrainer`` had, for code written against those. The statistics this
library logs itself (quantiles) are :func:`comlrl.trainers.preference.replay.reward_distribution`.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from comlrl.rollout.rewards import resolve_reward_range

NUM_BINS = 16


def finite_floats(values: Sequence[Any]) -> list[float]:
    """Each value as a float, NaN and infinities dropped (``None`` is a ``TypeError``, as ``float(None)``)."""
    return [number for number in (float(value) for value in values) if math.isfinite(number)]


def reward_range_of(reward_func: Any) -> tuple[float, float]:
    """The ``reward_range`` the histogram spans; a ``ValueError`` when the reward declares none."""
    declared = resolve_reward_range(reward_func)
    if declared is None:
        raise ValueError("log_reward_distribution=True requires reward_func.reward_range to declare the raw reward "
                         "scale as (minimum, maximum); set it with comlrl.utils.set_reward_range(reward_func, lo, hi)")
    return declared


def bin_edges(reward_range: tuple[float, float], num_bins: int = NUM_BINS) -> np.ndarray:
    """``num_bins + 1`` equally spaced edges from the range's minimum to its maximum."""
    return np.linspace(reward_range[0], reward_range[1], num_bins + 1)


def histogram_counts(rewards: Sequence[float], edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Counts per bin (and the edges): rewards clipped into the range first, so one below the minimum
    counts in the first bin and one above (or ``inf``) in the last; NaN is not counted."""
    if len(rewards) == 0:
        return np.zeros(len(edges) - 1, dtype=int), edges
    clipped = np.clip(np.asarray(rewards, dtype=float), float(edges[0]), float(edges[-1]))
    return np.histogram(clipped, bins=edges)


def histogram_series(rewards: Sequence[float], edges: np.ndarray) -> dict[str, Any]:
    """One side's finite rewards: ``sample_count``, ``mean`` (``None`` when there are none), ``counts`` per bin
    and the ``raw_rewards``."""
    finite = finite_floats(rewards)
    counts, _ = histogram_counts(finite, edges)
    return {"sample_count": len(finite), "mean": float(np.mean(finite)) if finite else None,
            "counts": [int(count) for count in counts], "raw_rewards": finite}


def histogram_metrics(namespace: str, iteration_idx: int, target: Sequence[float], comparator: Sequence[float],
                      pair_count: int | None = None) -> dict[str, float]:
    """``{namespace}/current_iteration`` (1-based), ``pair_count`` when given, each side's sample count and, for a
    side with rewards, its mean; ``{}`` when both sides are empty. The rewards are used as given (callers pass
    :func:`finite_floats`)."""
    if not target and not comparator:
        return {}
    metrics = {f"{namespace}/current_iteration": float(int(iteration_idx) + 1)}
    if pair_count is not None:
        metrics[f"{namespace}/pair_count"] = float(pair_count)
    metrics[f"{namespace}/target_sample_count"] = float(len(target))
    metrics[f"{namespace}/comparator_sample_count"] = float(len(comparator))
    for side, values in (("target", target), ("comparator", comparator)):
        if values:
            metrics[f"{namespace}/{side}_mean"] = float(np.mean(values))
    return metrics


def selected_pair_rewards(pairs: Sequence[Any]) -> tuple[list[float], list[float]]:
    """The finite ``target_raw_reward``/``comparator_raw_reward`` of pairs that have both; each side is
    filtered on its own, so the two lists may differ in length."""
    target: list[float] = []
    comparator: list[float] = []
    for pair in pairs:
        if pair.target_raw_reward is None or pair.comparator_raw_reward is None:
            continue
        target += finite_floats([pair.target_raw_reward])
        comparator += finite_floats([pair.comparator_raw_reward])
    return target, comparator


def format_axis_tick(value: float) -> str:
    """An axis label: integers bare, then 1, 2 or 3 decimals as the magnitude falls below 1 and 0.1."""
    if abs(value - round(value)) < 1e-9:
        return str(int(round(value)))
    if abs(value) >= 1.0:
        return f"{value:.1f}"
    return f"{value:.2f}" if abs(value) >= 0.1 else f"{value:.3f}"


class RewardHistogramNames:
    """The original iterative trainers' helper names over the functions above (``args`` is the trainer's, the
    reward its policy trainer's first reward function)."""

    _finite_floats = staticmethod(finite_floats)
    _format_axis_tick = staticmethod(format_axis_tick)

    def _log_reward_distribution_enabled(self) -> bool:
        return bool(getattr(self.args, "log_reward_distribution", False))

    def _resolve_reward_distribution_range(self) -> tuple[float, float]:
        return reward_range_of(self.policy_trainer.reward.funcs[0])

    def _reward_distribution_bin_edges(self) -> np.ndarray:
        return bin_edges(self._resolve_reward_distribution_range())

    def _reward_distribution_counts(self, rewards: Sequence[float], edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return histogram_counts(rewards, edges)

    def _reward_distribution_json_series(self, rewards: Sequence[float], edges: np.ndarray) -> dict[str, Any]:
        return histogram_series(rewards, edges)

    def _reward_distribution_json_section(self, target: Sequence[float], comparator: Sequence[float],
                                          edges: np.ndarray) -> dict[str, Any]:
        return {"target": histogram_series(target, edges), "comparator": histogram_series(comparator, edges)}

    def _selected_pair_reward_values(self, pairs: Sequence[Any]) -> tuple[list[float], list[float]]:
        return selected_pair_rewards(pairs)


__all__ = ["NUM_BINS", "RewardHistogramNames", "bin_edges", "finite_floats", "format_axis_tick", "histogram_counts",
           "histogram_metrics", "histogram_series", "reward_range_of", "selected_pair_rewards"]
