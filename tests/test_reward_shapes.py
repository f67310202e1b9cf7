"""Reward functions written for the original comlrl's call shapes give the same rewards here."""

from __future__ import annotations

import pytest
import torch

from comlrl.rollout.rewards import JointReward, RewardCallPlan, plan_reward_call

COMPLETIONS = [["ab", "abcd", "a"], ["xyz", "x", "xy"]]  # two agents, three joint samples
ROWS = [{"prompt": "p0"}, {"prompt": "p1"}, {"prompt": "p2"}]
EXPECTED = [2 + 3 * 10, 4 + 1 * 10, 1 + 2 * 10]  # len(agent 0) + 10 * len(agent 1)


def score(func, completions=COMPLETIONS, rows=ROWS) -> list[float]:
    return JointReward(func, num_agents=len(completions))(completions, rows).tolist()


def positional(completions_0, completions_1):
    return [len(a) + 10 * len(b) for a, b in zip(completions_0, completions_1)]


def varargs(*completions):
    return [len(a) + 10 * len(b) for a, b in zip(*completions)]


def with_prompts(prompts, completions_0, completions_1):
    assert prompts == [row["prompt"] for row in ROWS][: len(prompts)]
    return [len(a) + 10 * len(b) for a, b in zip(completions_0, completions_1)]


def nested(agent_completions):
    return [len(a) + 10 * len(b) for a, b in zip(*agent_completions)]


def keywords(completions_0, completions_1, prompts=None, batch_items=None):
    assert prompts == [row["prompt"] for row in batch_items]
    return [len(a) + 10 * len(b) for a, b in zip(completions_0, completions_1)]


def any_keywords(completions_0, completions_1, **kwargs):
    assert set(kwargs) == {"prompts", "batch_items"}
    return torch.tensor([len(a) + 10 * len(b) for a, b in zip(completions_0, completions_1)], dtype=torch.float64)


def one_sample_bare_number(completions_0, completions_1):
    """As the original's README writes them: one joint sample per call, one number back."""
    return len(completions_0[0]) + 10 * len(completions_1[0])


def one_sample_list(completions_0, completions_1):
    return [len(completions_0[0]) + 10 * len(completions_1[0])]


@pytest.mark.parametrize("func", [positional, varargs, with_prompts, nested, keywords, any_keywords,
                                  one_sample_bare_number, one_sample_list])
def test_every_call_shape_gives_the_same_rewards(func):
    assert score(func) == EXPECTED


def test_single_agent_shapes():
    completions, rows = [["ab", "abc"]], ROWS[:2]
    assert score(lambda completions: [len(c) for c in completions], completions, rows) == [2, 3]
    assert score(lambda prompts, completions: [len(p) + len(c) for p, c in zip(prompts, completions)],
                 completions, rows) == [4, 5]


def test_the_plan_is_read_from_the_signature_once():
    assert plan_reward_call(positional, 2) == RewardCallPlan()
    assert plan_reward_call(with_prompts, 2) == RewardCallPlan(prompts_first=True)
    assert plan_reward_call(nested, 2) == RewardCallPlan(nested=True)
    assert plan_reward_call(keywords, 2) == RewardCallPlan(batch_items=True, prompts_keyword=True)
    assert plan_reward_call(varargs, 3) == RewardCallPlan()


def test_a_one_sample_function_is_called_per_sample_from_then_on_and_resumes_so():
    calls = []

    def counted(completions_0, completions_1):
        calls.append(len(completions_0))
        return 1.0

    reward = JointReward(counted, num_agents=2)
    assert reward(COMPLETIONS, ROWS).tolist() == [1.0, 1.0, 1.0]
    assert calls == [3, 1, 1, 1]  # the batch once, then one sample at a time
    reward(COMPLETIONS, ROWS)
    assert calls[4:] == [1, 1, 1]  # decided once
    resumed = JointReward(counted, num_agents=2)
    resumed.load_state_dict(reward.state_dict())
    resumed(COMPLETIONS, ROWS)
    assert calls[7:] == [1, 1, 1]  # a resumed run calls it as the uninterrupted one does


def two_of_three(completions_0, completions_1):
    return [1.0, 2.0]


def test_wrong_lengths_and_types_still_name_the_function():
    with pytest.raises(ValueError, match="reward function .*two_of_three returned 2 rewards for 3 joint samples"):
        score(two_of_three)
    with pytest.raises(ValueError, match="must return a number or a list of numbers, got str"):
        score(lambda completions_0, completions_1: "good")
