import math

import pytest
import torch

from comlrl.rollout.rewards import JointReward


def test_positional_completions_and_batch_items():
    seen = {}

    def reward(c0, c1, batch_items):
        seen["rows"] = batch_items
        return [len(a) + len(b) for a, b in zip(c0, c1)]

    values = JointReward(reward)([["ab", "c"], ["d", ""]], batch_items=[{"x": 1}, {"x": 2}])
    assert values.tolist() == [3.0, 1.0] and seen["rows"] == [{"x": 1}, {"x": 2}]


def test_functions_without_batch_items_are_called_without_it():
    values = JointReward(lambda c0: [1.0] * len(c0))([["a", "b"]], batch_items=[{}, {}])
    assert values.tolist() == [1.0, 1.0]


def test_weighted_sum_and_processor():
    combined = JointReward([lambda c: [1.0, 2.0], lambda c: [10.0, 0.0]], weights=[2.0, 0.5],
                           reward_processor=lambda r: r / 10)
    assert torch.allclose(combined([["a", "b"]], [{}, {}]), torch.tensor([0.7, 0.4]))


@pytest.mark.parametrize(
    "returned, message",
    [
        ([1.0, 2.0, 3.0], "returned 3 rewards for 2 joint samples"),
        ([1.0, "x"], "non-number at index 1"),
        ([1.0, math.nan], "returned nan at index 1"),
        ([math.inf, 1.0], "returned inf at index 0"),
        ("0.5", "must return a number or a list of numbers, got str"),
    ],
)
def test_bad_rewards_name_the_function(returned, message):
    def my_reward(c):
        return returned

    with pytest.raises(ValueError) as error:
        JointReward(my_reward)([["a", "b"]], [{}, {}])
    assert message in str(error.value) and "my_reward" in str(error.value)


def test_raising_reward_is_reraised_with_context():
    def broken(c):
        raise KeyError("score")

    with pytest.raises(RuntimeError, match="reward function .*broken raised KeyError"):
        JointReward(broken)([["a"]], [{}])


def test_weight_count_must_match():
    with pytest.raises(ValueError, match="reward_weights has 1 entries but there are 2 reward functions"):
        JointReward([len, len], weights=[1.0])


def test_monitors_are_reported_but_do_not_enter_the_reward():
    reward = JointReward(lambda c: [1.0, 1.0], monitors={"task": lambda c: [0.0, 4.0]})
    assert reward([["a", "b"]], [{}, {}]).tolist() == [1.0, 1.0]
    assert reward.drain_monitor_metrics() == {"monitor/task": 2.0}
    assert reward.drain_monitor_metrics() == {}


def test_drop_mode_marks_invalid_samples_and_counts_them():
    reward = JointReward(lambda c: [1.0, math.nan, "x", 2.0], on_invalid="drop", reward_processor=lambda r: 2 * r)
    values = reward([["a", "b", "c", "d"]], [{}] * 4)
    assert values[0] == 2.0 and values[3] == 4.0 and torch.isnan(values[1]) and torch.isnan(values[2])
    assert reward.dropped == 2


def test_raise_mode_points_to_drop():
    with pytest.raises(ValueError, match="invalid_reward='drop'"):
        JointReward(lambda c: [math.inf])([["a"]], [{}])
