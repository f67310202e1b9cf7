"""The joint reward as a trainer calls it (comlrl/rollout/rewards.py), against values written out in each test:
how a signature is read, what a one-sample function receives call by call, what a processor may return, how
drops are counted across calls, the monitors, the rows and metrics a reward function reports, and each refusal's
words."""

from __future__ import annotations

import functools
import math

import pytest

from comlrl.rollout.rewards import JointReward, function_name, plan_reward_call, resolve_reward_range


def named_prompts(prompts, a): pass
def n_plus_one(texts, a, b): pass
def three_and_more(a, b, c, *more): pass
def first_and_others(first, *others): pass
def one_list(agent_completions): pass
def two(a, b): pass


@pytest.mark.parametrize("func, agents, prompts_first, nested", [
    (named_prompts, 2, True, False),     # named prompts: prompts first, whatever the count
    (n_plus_one, 2, True, False),        # N+1 positional parameters: the first is the prompts
    (three_and_more, 2, False, False),   # *args takes the completions: never prompts first
    (first_and_others, 2, False, False),  # nor nested: the agents' lists go positionally
    (one_list, 2, False, True),          # one parameter for several agents: one nested list
    (two, 2, False, False),
])
def test_how_a_signature_is_read(func, agents, prompts_first, nested):
    plan = plan_reward_call(func, agents)
    assert (plan.prompts_first, plan.nested) == (prompts_first, nested)


def test_a_functions_name_in_messages():
    def judge(a, b):
        return [0.0]

    class Named:
        __name__ = "named_judge"

        def __call__(self, a, b):
            return [0.0]

    class Anonymous:
        def __call__(self, a, b):
            return [0.0]

    instance = Anonymous()
    assert function_name(judge).endswith("judge") and "<locals>" in function_name(judge)
    assert function_name(Named()) == "named_judge"
    assert function_name(instance) == repr(instance)
    assert function_name(functools.partial(judge, [""])).startswith("functools.partial(")


@pytest.mark.parametrize("declared, message", [
    ((0.0, math.inf), "reward_func.reward_range values must be finite."),
    ((1.0, 1.0), "reward_func.reward_range minimum must be less than maximum."),
    ((0.0,), "reward_func.reward_range must be a two-item sequence: (minimum, maximum)."),
])
def test_reward_range_refusals(declared, message):
    def reward(a, b):
        return [0.0]

    reward.reward_range = declared
    with pytest.raises(ValueError) as error:
        resolve_reward_range(reward)
    assert str(error.value) == message


@pytest.mark.parametrize("arguments, message", [
    ({"reward_func": []}, "reward_func must be a callable or a non-empty list of callables"),
    ({"reward_func": [len, 7]}, "reward_func must be a callable: reward_func[1] is a int"),
    ({"reward_func": "score"}, "reward_func must be a callable: reward_func is a str"),
    ({"reward_func": len, "reward_processor": 3}, "reward_processor must be callable, got int"),
    ({"reward_func": len, "on_invalid": "skip"}, "on_invalid must be 'raise' or 'drop', got 'skip'"),
])
def test_construction_refusals(arguments, message):
    with pytest.raises(ValueError) as error:
        JointReward(**arguments)
    assert str(error.value) == message


def test_a_one_sample_function_gets_each_rows_prompt_and_item_call_by_call():
    calls = []

    def one_at_a_time(a, b, prompts=None, batch_items=None):
        calls.append((list(a), list(b), list(prompts), list(batch_items)))
        return 1.0 if a[0] == b[0] else 0.0

    reward = JointReward(one_at_a_time, num_agents=2)
    rows = [{"prompt": "p0", "id": 0}, {"id": 1}, {"prompt": "p2", "id": 2}]  # row 1 has no prompt: ""
    values = reward([["x", "y", "z"], ["x", "q", "z"]], rows)
    assert values.tolist() == [1.0, 0.0, 1.0]
    # The first call has the whole batch (one number back: a one-sample function); then one call per sample.
    assert calls[1:] == [(["x"], ["x"], ["p0"], [rows[0]]), (["y"], ["q"], [""], [rows[1]]),
                         (["z"], ["z"], ["p2"], [rows[2]])]
    assert reward.state_dict()["per_sample"] == [0]
    rows_without_dicts = ["not a dict", None]  # rows that are not mappings give empty prompts
    assert reward([["x", "y"], ["x", "y"]], rows_without_dicts).tolist() == [1.0, 1.0]
    assert [call[2] for call in calls[-2:]] == [[""], [""]]


def test_one_number_for_one_sample_is_not_a_one_sample_function_and_for_two_it_is():
    single = JointReward(lambda a, b: 0.5, num_agents=2)
    assert single([["x"], ["y"]], [{}]).tolist() == [0.5]
    assert single.state_dict()["per_sample"] == []  # one sample, one number: nothing to learn from that
    assert single([["x", "x"], ["y", "y"]], [{}, {}]).tolist() == [0.5, 0.5]
    assert single.state_dict()["per_sample"] == [0]


def test_an_invalid_reward_is_named_with_the_function_and_what_to_set():
    def bad(a, b):
        return [1.0, "high"]

    with pytest.raises(ValueError) as error:
        JointReward(bad, num_agents=2)([["x", "y"], ["x", "y"]], [{}, {}])
    assert str(error.value).startswith("reward function ")
    assert "bad returned a non-number at index 1: 'high'" in str(error.value)
    assert str(error.value).endswith(" (set invalid_reward='drop' to drop such samples and count them)")


def test_a_processor_never_sees_a_dropped_sample_and_may_not_make_a_finite_reward_infinite():
    seen = []

    def processor(value):
        seen.append(value)
        return 0.0 if math.isnan(value) else 2 * value

    reward = JointReward(lambda a, b: [1.0, math.nan, 3.0], reward_processor=processor, on_invalid="drop",
                         num_agents=2)
    values = reward([["a"] * 3, ["b"] * 3], [{}] * 3).tolist()
    assert values[0] == 2.0 and math.isnan(values[1]) and values[2] == 6.0
    assert seen == [1.0, 3.0] and reward.dropped == 1
    assert math.isnan(reward([["a"] * 3, ["b"] * 3], [{}] * 3).tolist()[1])
    assert reward.dropped == 2  # counted over calls
    reward.load_state_dict({"dropped": 7})  # a checkpoint from before per_sample was recorded
    assert reward.state_dict() == {"dropped": 7, "per_sample": []}

    def judge(a, b):
        return [1.0, 2.0]

    with pytest.raises(ValueError) as error:
        JointReward(judge, reward_processor=lambda v: math.inf if v == 1.0 else v, num_agents=2)(
            [["a", "b"], ["c", "d"]], [{}, {}])
    assert str(error.value) == "reward_processor returned a non-finite value at index 0"
    with pytest.raises(ValueError) as error:  # finite in float64, beyond float32: the rewards' dtype
        JointReward(judge, reward_processor=lambda v: 1e39 * v, num_agents=2)([["a", "b"], ["c", "d"]], [{}, {}])
    assert "gave 1e+39 at index 0, beyond float32 range" in str(error.value)
    assert "judge" in str(error.value)


def test_each_monitor_reports_its_own_mean_and_a_drain_clears_them():
    reward = JointReward(lambda a, b: [0.0, 0.0], monitors={"first": lambda a, b: [1.0, 3.0],
                                                            "second": lambda a, b: [10.0, 20.0]}, num_agents=2)
    reward([["a", "b"], ["c", "d"]], [{}, {}])
    reward([["a", "b"], ["c", "d"]], [{}, {}])
    assert reward.drain_monitor_metrics() == {"monitor/first": 2.0, "monitor/second": 15.0}
    assert reward.drain_monitor_metrics() == {}


class Judge:
    """A reward function that keeps rows about what it judged and reports metrics of its own."""

    def __init__(self):
        self.kept = [{"program": "print(1)", "passed": True}]

    def __call__(self, a, b):
        return [1.0] * len(a)

    def sample_rows(self):
        return self.kept

    def drain_metrics(self):
        return {"coding/passed": 1, 7: 0.5}


def test_the_rows_and_metrics_a_reward_function_reports():
    judge = Judge()
    reward = JointReward([judge, lambda a, b: [0.0] * len(a), Judge()], num_agents=2)
    rows = reward.sample_rows()
    assert rows == [{"program": "print(1)", "passed": True}] * 2  # every function that keeps rows, in order
    rows[0]["passed"] = False
    assert judge.kept[0]["passed"] is True  # copies: a table cannot change what the judge keeps
    assert JointReward(lambda a, b: [0.0], num_agents=2).sample_rows() == []
    metrics = reward.drain_monitor_metrics()
    assert metrics == {"coding/passed": 1.0, "7": 0.5}
    assert all(type(value) is float for value in metrics.values())


def test_a_one_sample_functions_bad_answer_is_named_with_the_function():
    answers = iter([0.5, 1.0, "high"])  # the batch call, then one sample at a time

    def judge_one(a, b):
        return next(answers)

    with pytest.raises(ValueError) as error:
        JointReward(judge_one, num_agents=2)([["x", "y"], ["x", "y"]], [{}, {}])
    assert "judge_one returned a str ('high')" in str(error.value)
