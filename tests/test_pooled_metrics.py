"""A step's statistics over every process's samples (comlrl.training.metrics.pooled_means, pooled_std): the
numbers one process would report over all of the samples, with dropped (NaN) samples left out, whatever
share of them each process holds. The second process is written out by hand: its count and sum (or sum of
squared deviations) are what ``total`` adds, as ``DataParallel.all_sum`` does in a launch."""

import math
import threading
from typing import Callable

import pytest
import torch

from comlrl.training.metrics import pooled_means, pooled_std, this_process

NAN = float("nan")


def plus(other: list) -> Callable[[torch.Tensor], torch.Tensor]:
    """The total over this process and another whose statistics are ``other``."""
    return lambda sums: sums + torch.tensor(other, dtype=torch.float64).reshape(sums.shape)


def test_one_process_means_leave_out_dropped_samples():
    means = pooled_means([torch.tensor([1.0, NAN, 3.0]), torch.tensor([NAN, NAN]), torch.tensor([2.5])])
    assert means[0] == 2.0 and math.isnan(means[1]) and means[2] == 2.5
    assert pooled_means([]) == []
    # The sums travel in float64: a float32 sum would round 100000001 to 100000000.
    assert pooled_means([torch.tensor([100000001.0, NAN], dtype=torch.float64)]) == [100000001.0]
    assert pooled_std(torch.tensor([1.0, NAN, 3.0]), 2.0) == 1.0  # population: sqrt((1 + 1) / 2)
    assert math.isnan(pooled_std(torch.tensor([NAN]), NAN))
    assert this_process(torch.ones(2)).tolist() == [1.0, 1.0]


def test_means_over_two_processes_weigh_each_by_its_samples_not_each_process_alike():
    # This process: rewards [1, nan]; the other: [nan, nan, 5, 6] (count 2, sum 11). All of them: [1, 5, 6].
    mine = torch.tensor([1.0, NAN])
    [mean] = pooled_means([mine], plus([[2.0, 11.0]]))
    assert mean == pytest.approx(4.0, abs=1e-12)  # not (1 + 5.5) / 2, the mean of the two processes' means
    # Around the pooled mean the other process's squared deviations are (5-4)^2 + (6-4)^2 = 5.
    std = pooled_std(mine, mean, plus([2.0, 5.0]))
    assert std == pytest.approx(math.sqrt((9.0 + 5.0) / 3.0), abs=1e-12)
    assert std == pytest.approx(float(torch.tensor([1.0, 5.0, 6.0]).std(unbiased=False)), rel=1e-6)


def test_a_process_whose_every_sample_was_dropped_adds_nothing():
    # This process holds only dropped samples; the other process's [2, 4] are the step's.
    [mean] = pooled_means([torch.tensor([NAN, NAN])], plus([[2.0, 6.0]]))
    assert mean == 3.0
    assert pooled_std(torch.tensor([NAN, NAN]), mean, plus([2.0, 2.0])) == 1.0
    [mean] = pooled_means([torch.tensor([NAN])], plus([[0.0, 0.0]]))  # none on any process
    assert math.isnan(mean)


# ----- a trainer's step metrics: this process's rollout plus another's equal one process's over both ----------
def as_two_processes(metrics_of, mine, other):
    """``metrics_of(process, its_input, total)`` run by two threads, one per simulated process (0: ``mine``, 1:
    ``other``), whose ``total`` meets the other's at each collective and returns the sum of both, as
    ``DataParallel.all_sum`` does in a launch. Both report the same metrics; process 0's are returned."""
    meet, given, results = threading.Barrier(2, timeout=60), [None, None], [None, None]

    def total_of(process):
        def total(sums):
            given[process] = sums.clone()
            meet.wait()
            summed = given[0] + given[1]
            meet.wait()  # both have read before either gives its next sums
            return summed
        return total

    def run(process, its_input):
        results[process] = metrics_of(process, its_input, total_of(process))

    threads = [threading.Thread(target=run, args=pair) for pair in enumerate((mine, other))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results[0] is not None and results[0] == results[1], results
    return results[0]


def test_centralized_step_metrics_over_two_processes_are_one_process_metrics(tiny_llama):
    from test_centralized_magrpo_values import build, hand_rollout

    trainers = [build(tiny_llama), build(tiny_llama)]  # one per process: tokenizers are not shared by threads
    trainer = trainers[0]
    # This process: one node, its second sample unparsed ("sun") and its reward dropped; the other: one node.
    mine_texts, other_texts = ["the x cat", "sun"], ["tree x road and hill", "red x dog"]
    mine, other = torch.tensor([[1.0, NAN]]), torch.tensor([[4.0, 6.0]])
    both = trainer.rollout_metrics(hand_rollout(mine_texts + other_texts, node_rows=[0, 1], lengths=[3, 1, 5, 2]),
                                   [torch.cat([mine, other])])
    pooled = as_two_processes(
        lambda process, rollout, total: trainers[process].rollout_metrics(rollout[0], [rollout[1]], total),
        (hand_rollout(mine_texts, node_rows=[0], lengths=[3, 1]), mine),
        (hand_rollout(other_texts, node_rows=[1], lengths=[5, 2]), other))
    assert both["reward_mean"] == pytest.approx(11.0 / 3.0) and both["collaboration/parse_error_rate"] == 0.25
    assert both["joint/completion_length"] == 2.75
    assert pooled.keys() == both.keys()
    for name in both:
        assert pooled[name] == pytest.approx(both[name], rel=1e-9), name


def test_each_critics_metrics_are_its_own_and_pool_over_processes(tiny_llama):
    from test_ac_value_targets import build

    from comlrl.trainers.actor_critic.base import Estimates

    trainer = build("iac", tiny_llama)
    assert trainer.value_model_names() == ["critic_0", "critic_1"]

    def estimates(returns):
        return Estimates(advantages=[torch.zeros_like(r) for r in returns], returns=returns)

    values = [torch.tensor([[1.0], [2.0]]), torch.tensor([[0.0], [1.0]])]
    returns = [torch.tensor([[2.0], [NAN]]), torch.tensor([[3.0], [5.0]])]
    metrics = trainer.critic_metrics(values, estimates(returns))
    assert metrics == {"critic_0/value_mean": 1.5, "critic_0/value_error": 1.0,  # |2 - 1|; the NaN left out
                       "critic_1/value_mean": 0.5, "critic_1/value_error": 3.5}  # (|3 - 0| + |5 - 1|) / 2
    # Another process whose critic_0 targets were all dropped: its values count, its errors do not.
    other_values = [torch.tensor([[3.0]]), torch.tensor([[2.0]])]
    other_returns = [torch.tensor([[NAN]]), torch.tensor([[4.0]])]
    pooled = as_two_processes(lambda _, pair, total: trainer.critic_metrics(pair[0], estimates(pair[1]), total),
                              (values, returns), (other_values, other_returns))
    assert pooled == pytest.approx({"critic_0/value_mean": 2.0, "critic_0/value_error": 1.0,
                                    "critic_1/value_mean": 1.0, "critic_1/value_error": 3.0}, rel=1e-12)
