"""The declared reward interface (comlrl.rollout.reward_function): what JointReward and the pipeline ask of a
reward by name, for task objects and for plain comlrl 1.4.3 functions alike; and that nothing in the library
or the flows reads a reward's optional parts with getattr any more."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from comlrl.rollout.episodes import _next_prompts, transition_takes_row
from comlrl.rollout.reward_function import Closable, KeepsSampleRows, ReportsMetrics, RewardFunction
from comlrl.rollout.rewards import JointReward, resolve_reward_range
from comlrl.tasks import coding
from comlrl.utils import set_reward_range

REPO = Path(__file__).resolve().parents[1]


def plain(completions_0, completions_1, batch_items=None):  # comlrl 1.4.3's documented shape
    return [float(len(a) + len(b)) for a, b in zip(completions_0, completions_1)]


class Counting:
    """A reward object with every optional part."""

    reward_range = (0.0, 10.0)

    def __init__(self):
        self.seen, self.closed = [], 0

    def __call__(self, completions_0, completions_1, batch_items=None):
        self.seen += [row["id"] for row in batch_items]
        return [1.0] * len(completions_0)

    def drain_metrics(self):
        seen, self.seen = self.seen, []
        return {"counting/seen": len(seen)}

    def sample_rows(self):
        return [{"id": 7}]

    def close(self):
        self.closed += 1


def test_the_protocols_recognise_objects_and_plain_functions():
    task = coding.CodingTask()
    for reward in (task, coding.reward):
        assert isinstance(reward, RewardFunction) and isinstance(reward, ReportsMetrics)
        assert isinstance(reward, KeepsSampleRows) and resolve_reward_range(reward) == (0.0, 4.0)
    assert isinstance(task, Closable)

    def fresh(completions_0, completions_1, batch_items=None):
        return plain(completions_0, completions_1, batch_items)

    assert not isinstance(fresh, (RewardFunction, ReportsMetrics, KeepsSampleRows, Closable))
    assert resolve_reward_range(fresh) is None
    set_reward_range(fresh, -1, 3)  # the 1.4.3 way: an attribute on the function
    assert isinstance(fresh, RewardFunction) and resolve_reward_range(fresh) == (-1.0, 3.0)
    fresh.reward_range = (3, 1)
    with pytest.raises(ValueError, match="minimum must be less than maximum"):
        resolve_reward_range(fresh)


def test_joint_reward_drains_samples_and_closes_through_the_protocol():
    counting = Counting()
    joint = JointReward([counting, plain], weights=[1.0, 0.5], num_agents=2)
    values = joint([["ab", "c"], ["d", ""]], [{"id": 1}, {"id": 2}])
    assert values.tolist() == [1.0 + 1.5, 1.0 + 0.5]
    assert joint.drain_monitor_metrics() == {"counting/seen": 2}
    assert joint.drain_monitor_metrics() == {"counting/seen": 0}  # drained: nothing seen since
    assert joint.sample_rows() == [{"id": 7}]
    joint.close()
    assert counting.closed == 1
    twice = Counting()
    JointReward([twice, twice], num_agents=2, monitors={"again": twice}).close()
    assert twice.closed == 1  # once, however often it is listed
    alone = JointReward(plain, num_agents=2)
    assert alone([["a"], ["b"]], [{}]).tolist() == [2.0]
    assert alone.drain_monitor_metrics() == {} and alone.sample_rows() == []
    alone.close()  # a plain function holds nothing


def test_a_transition_gets_its_row_only_when_its_signature_takes_it():
    def original(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
        return [prompt] * num_agents

    def keyword(prompt, agent_completions, *, batch_item=None, **_):
        return [batch_item["id"]] * len(agent_completions)

    def anything(**kwargs):
        return [",".join(sorted(kwargs))] * 2

    assert [transition_takes_row(f) for f in (original, keyword, anything)] == [False, True, True]
    row = {"id": "row-3", "prompt": "p"}

    def call(transition):
        return _next_prompts(transition, row, ["a", "b"], [["p"], ["p"]], [["a"], ["b"]], (), True, 0,
                             transition_takes_row(transition))

    assert call(original) == ["p", "p"]
    assert call(keyword) == ["row-3", "row-3"]
    assert call(anything)[0] == ("agent_completions,batch_item,num_agents,prompt,prompt_history_per_agent,"
                                 "response_history_per_agent")


def test_no_reward_attribute_is_read_with_getattr():
    pattern = re.compile(r"""getattr\([^)]*["'](reward_range|drain_metrics|sample_rows)["']""")
    found = [f"{path.relative_to(REPO)}:{number}" for folder in ("comlrl", "flows")
             for path in sorted((REPO / folder).rglob("*.py"))
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert found == []
