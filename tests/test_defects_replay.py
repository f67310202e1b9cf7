"""Issue 27, suspicion c: the replay's sampling weights. With a sample size, ``all`` and ``last_k`` draw every
pair alike (a subsample of the pool they use without one); ``lambda_decay`` weights shards by age, so a pair's
chance is its shard's weight over the shard's size. Stated in replay.py's docstring and docs/algorithms.md."""

from __future__ import annotations

import pytest
from datasets import Dataset

from comlrl.rollout import preferences
from comlrl.trainers.preference import replay


def shard(iteration: int, count: int) -> Dataset:
    return preferences.pairs_dataset([{"iteration": iteration, "row_index": i, "chosen_reward": 1.0,
                                       "rejected_reward": 0.0} for i in range(count)])


def mean_draws(shards: list[Dataset], mode: str, sample_size: int, seeds: int, **options) -> dict[tuple[int, int], float]:
    """How often each pair (iteration, row_index) is drawn per call, over ``seeds`` seeded calls."""
    counts: dict[tuple[int, int], int] = {}
    for seed in range(seeds):
        drawn = replay.training_pairs(shards, len(shards) - 1, mode, sample_size=sample_size, seed=seed, **options)
        for key in zip(drawn["iteration"], drawn["row_index"]):
            counts[key] = counts.get(key, 0) + 1
    return {key: counts.get(key, 0) / seeds for key in ((j, i) for j, s in enumerate(shards) for i in range(len(s)))}


def test_shard_weights_by_hand():
    # all / last_k / none: proportional to the shard sizes, so each pair's chance is 1 / 9
    assert replay.shard_weights("all", [4, 2, 3]) == pytest.approx([4 / 9, 2 / 9, 3 / 9])
    assert replay.shard_weights("last_k", [0, 5]) == [0.0, 1.0]
    # lambda 0.5 over ages 2, 1, 0 gives 0.25, 0.5, 1; the empty middle shard drops out: 0.25 / 1.25, 1 / 1.25
    assert replay.shard_weights("lambda_decay", [4, 0, 3], 0.5) == pytest.approx([0.2, 0.0, 0.8])
    assert replay.shard_weights("lambda_decay", [4, 2], 1.0) == pytest.approx([0.5, 0.5])  # uniform over shards
    assert replay.shard_weights("all", [0, 0]) == [0.0, 0.0]


def test_all_draws_every_pair_alike_whatever_its_shard_size():
    """Shards of 1 and 9 pairs, 5 drawn per call: every pair's expected draws are 5 / 10 = 0.5 (the lone pair of
    the small shard was drawn 2.5 times per call when shards were picked uniformly)."""
    draws = mean_draws([shard(0, 1), shard(1, 9)], "all", sample_size=5, seeds=200)
    assert all(value == pytest.approx(0.5, abs=0.2) for value in draws.values()), draws
    assert sum(draws.values()) == pytest.approx(5.0)


def test_lambda_decay_weights_shards_by_age_not_size():
    """lambda 1 over shards of 1 and 9 pairs: each shard half the draws, so the lone pair 5 * 0.5 / 1 = 2.5 per
    call and each of the nine 5 * 0.5 / 9."""
    draws = mean_draws([shard(0, 1), shard(1, 9)], "lambda_decay", sample_size=5, seeds=200, decay=1.0)
    assert draws[(0, 0)] == pytest.approx(2.5, abs=0.4)
    assert all(draws[(1, i)] == pytest.approx(2.5 / 9, abs=0.15) for i in range(9))
