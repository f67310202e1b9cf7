"""Replay of earlier iterations' preference shards, and the reward distribution an iteration logs.

The shard of iteration ``i`` is the pairs collected in it. Iteration ``i`` trains on

- ``none``: its own shard;
- ``all``: shards ``0..i``;
- ``last_k``: shards ``i-k+1..i``;
- ``lambda_decay``: every shard, a shard of age ``a`` (``i - its iteration``) drawn with weight
  proportional to ``lambda^a`` (``lambda = 1``: uniform, ``0``: only the newest).

With a sample size ``S`` (always for ``lambda_decay``, default the newest shard's size) a seeded draw
picks how many pairs come from each shard (a multinomial over the shard weights ``w_j`` of
:func:`shard_weights`) and then which ones (a shard's pairs without replacement, cycling if asked
for more). A pair of shard ``j`` (``n_j`` pairs) is drawn ``S * w_j / n_j`` times in expectation:

- ``none``, ``all``, ``last_k``: ``w_j = n_j / sum_m n_m``, so every pair alike (``S / sum_m n_m``): the
  sample is a subsample of the pool used without a sample size;
- ``lambda_decay``: ``w_j = lambda^a_j / sum_m lambda^a_m`` over the non-empty shards (``a_j`` the age), a
  weight per *shard*: a pair of a small shard is drawn more often than one of a large shard of the same
  age (``lambda = 1`` is uniform over shards, not over pairs).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from datasets import Dataset

from comlrl.rollout import preferences


def replayed_shards(mode: str, iteration: int, k: int | None = None) -> list[int]:
    """The iterations whose shards iteration ``iteration`` trains on (oldest first)."""
    if mode == "none":
        return [iteration]
    if mode in ("all", "lambda_decay"):
        return list(range(iteration + 1))
    if mode == "last_k":
        if not k or k < 1:
            raise ValueError(f"replay mode 'last_k' needs k >= 1, got {k!r}")
        return list(range(max(0, iteration - k + 1), iteration + 1))
    raise ValueError(f"unknown replay mode {mode!r}")


def lambda_weights(num_shards: int, decay: float) -> list[float]:
    """Normalised weights of ``num_shards`` shards, oldest first: ``lambda^age``, age 0 the newest."""
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"lambda must lie in [0, 1], got {decay!r}")
    raw = [decay ** age for age in range(num_shards)][::-1]  # 0 ** 0 == 1: the newest always counts
    total = sum(raw)
    return [value / total for value in raw]


def shard_weights(mode: str, sizes: Sequence[int], decay: float | None = None) -> list[float]:
    """The probability of each replayed shard (oldest first, ``sizes`` their pair counts) for one drawn pair:
    proportional to its size for ``none``/``all``/``last_k`` (every pair alike), :func:`lambda_weights` for
    ``lambda_decay``; empty shards get 0 and the rest is renormalised (all zeros when every shard is empty)."""
    raw = lambda_weights(len(sizes), decay if decay is not None else 1.0) if mode == "lambda_decay" \
        else [float(n) for n in sizes]
    kept = [w if n > 0 else 0.0 for w, n in zip(raw, sizes)]
    total = sum(kept)
    return [w / total for w in kept] if total > 0 else [0.0] * len(sizes)


def shard_counts(sizes: Sequence[int], weights: Sequence[float], sample_size: int,
                 generator: torch.Generator) -> list[int]:
    """How many of ``sample_size`` pairs come from each shard: a multinomial draw over ``weights``
    restricted to non-empty shards (all zeros when every shard is empty)."""
    usable = torch.tensor([w if n > 0 else 0.0 for w, n in zip(weights, sizes)], dtype=torch.float64)
    if sample_size <= 0 or float(usable.sum()) == 0.0:
        return [0] * len(sizes)
    draws = torch.multinomial(usable / usable.sum(), sample_size, replacement=True, generator=generator)
    return torch.bincount(draws, minlength=len(sizes)).tolist()


def draw_indices(size: int, count: int, generator: torch.Generator) -> list[int]:
    """``count`` indices into a shard of ``size`` pairs: a permutation, repeated while more are asked."""
    chosen: list[int] = []
    while len(chosen) < count and size > 0:
        chosen += torch.randperm(size, generator=generator).tolist()[: count - len(chosen)]
    return chosen


def training_pairs(shards: Sequence[Dataset], iteration: int, mode: str, k: int | None = None,
                   decay: float | None = None, sample_size: int | None = None, seed: int = 0) -> Dataset:
    """The pairs iteration ``iteration`` trains on, from ``shards[j]`` (the pairs of iteration ``j``): every pair
    of the replayed shards, or ``sample_size`` of them drawn with :func:`shard_weights` (see the module docstring).

    Deterministic in ``seed`` and ``iteration``: a resumed run selects the same pairs.
    """
    chosen = replayed_shards(mode, iteration, k)
    missing = [j for j in chosen if j >= len(shards)]
    if missing:
        raise ValueError(f"iteration {iteration} replays shards {chosen}, but only {len(shards)} exist")
    selected = [shards[j] for j in chosen]
    if mode == "lambda_decay" and sample_size is None:
        sample_size = len(shards[iteration])
    if sample_size is None:
        return preferences.pool(selected)
    weights = shard_weights(mode, [len(shard) for shard in selected], decay)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + iteration)
    counts = shard_counts([len(s) for s in selected], weights, sample_size, generator)
    parts = [shard.select(draw_indices(len(shard), count, generator)) for shard, count in zip(selected, counts) if count]
    return preferences.pool(parts)


QUANTILES = {"min": 0.0, "q25": 0.25, "median": 0.5, "q75": 0.75, "max": 1.0}


def reward_distribution(values: Sequence[float]) -> dict[str, float]:
    """Count, mean, population std and quantiles (min, q25, median, q75, max; linear interpolation)
    of the finite ``values``; NaN statistics when there are none."""
    finite = torch.tensor([float(v) for v in values if math.isfinite(float(v))], dtype=torch.float64)
    if finite.numel() == 0:
        return {"count": 0.0, "mean": float("nan"), "std": float("nan"), **{k: float("nan") for k in QUANTILES}}
    stats = {"count": float(finite.numel()), "mean": float(finite.mean()), "std": float(finite.std(unbiased=False))}
    stats.update({name: float(torch.quantile(finite, q)) for name, q in QUANTILES.items()})
    return stats


def pair_batches(num_pairs: int, batch_size: int, epochs: int, seed: int, iteration: int) -> list[list[int]]:
    """The DPO micro-batches of one iteration: ``epochs`` seeded shuffles of the pairs, each cut into
    batches of ``batch_size`` (the last one of an epoch may be smaller)."""
    batches = []
    for epoch in range(epochs):
        generator = torch.Generator().manual_seed((seed * 1_000_003 + iteration) * 1_009 + epoch)
        order = torch.randperm(num_pairs, generator=generator).tolist()
        batches += [order[start:start + batch_size] for start in range(0, num_pairs, batch_size)]
    return batches
