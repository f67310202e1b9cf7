"""Early termination of multi-turn episodes (``early_termination_threshold``) in MAGRPO, IAC and MAAC.

A node (one prompt's joint samples at a turn) whose mean reward exceeds the threshold spawns no
node at the next turn: the transition is not called for it, nothing is generated for it, each
sample is scored once, and its samples' returns are their rewards. Checked on hand-computed returns,
on real rollouts of tiny models, and by resuming (equal to the uninterrupted run).
"""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset

from comlrl.algorithms.advantages import tree_returns
from comlrl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from comlrl.trainers.actor_critic.base import episode_matrix, reached
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

PROMPTS = ["stop at once", "keep going", "stop here too", "keep writing"]


class Calls:
    """A reward that is high (1.0 + a letter share) on rows whose prompt says 'stop', and counts its calls."""

    def __init__(self) -> None:
        self.scored = 0

    def __call__(self, completions_0, completions_1, batch_items=None):
        self.scored += len(completions_0)
        return [(1.0 if "stop" in item["prompt"] else 0.0) + 0.1 * a.count("e") / max(len(a), 1)
                for a, item in zip(completions_0, batch_items)]


class Transition:
    def __init__(self) -> None:
        self.prompts: list[str] = []

    def __call__(self, prompt, agent_completions, num_agents, **_):
        self.prompts.append(prompt)
        return [f"{prompt} then more"] * num_agents


def test_tree_returns_of_a_pruned_tree_by_hand():
    # turn 0: one node, joint samples rewarded 1 and 2; only sample 1 spawned a node, whose samples got 4 and 6
    rewards = [torch.tensor([[1.0, 2.0]]), torch.tensor([[4.0, 6.0]])]
    returns = tree_returns(rewards, discount=0.5, parents=[None, [1]])
    assert returns[0].tolist() == [[1.0, 2.0 + 0.5 * 5.0]]  # sample 0 ended: its return is its reward
    assert returns[1].tolist() == [[4.0, 6.0]]
    full = [torch.tensor([[1.0, 2.0]]), torch.tensor([[4.0, 6.0], [0.0, 2.0]])]  # no pruning: parents in order
    assert tree_returns(full, 0.5)[0].tolist() == tree_returns(full, 0.5, [None, [0, 1]])[0].tolist() == [[3.5, 2.5]]


def test_episode_matrix_of_ended_chains():
    rows = [torch.tensor([0, 1, 2]), torch.tensor([1])]  # episodes 0 and 2 ended after turn 0
    matrix = episode_matrix([torch.tensor([1.0, 2.0, 3.0]), torch.tensor([5.0])], rows)
    assert torch.equal(torch.isnan(matrix), torch.tensor([[False, True], [False, False], [False, True]]))
    assert matrix[1].tolist() == [2.0, 5.0]
    assert reached(rows, 3, 2).tolist() == [[True, False], [True, True], [True, False]]


def magrpo(model, transition, reward, **config):
    settings = dict(num_agents=2, num_turns=2, num_generations=2, max_new_tokens=4, temperature=1.0,
                    agent_learning_rate=1e-3, per_device_train_batch_size=4, discount=0.5,
                    early_termination_threshold=0.5, num_train_epochs=1, disable_tqdm=True, seed=1)
    settings.update(config)
    return MAGRPOTrainer(agent_model=model, reward_func=reward, external_transition=transition,
                         train_dataset=Dataset.from_dict({"prompt": PROMPTS}), args=MAGRPOConfig(**settings))


def test_magrpo_stops_expanding_nodes_above_the_threshold(tiny_llama):
    transition, reward = Transition(), Calls()
    trainer = magrpo(tiny_llama, transition, reward)
    rows = [trainer.train_dataset[i] for i in range(4)]
    rollout = trainer.rollout(rows)
    second = rollout.turns[1]
    # only the two 'keep' rows go on: 2 joint samples each -> 4 nodes, spawned by samples 2, 3 (row 1) and 6, 7 (row 3)
    assert second.parents == [2, 3, 6, 7] and second.node_rows == [1, 1, 3, 3]
    assert second.generations[0].completion_ids.shape[0] == 4 * 2  # 4 nodes x 2 generations
    assert all(prompt.startswith("keep") for prompt in transition.prompts) and len(transition.prompts) == 4
    rewards = trainer.score(rollout)
    assert reward.scored == 8 + 8  # turn 0 scored while rolling out (reused), turn 1 once
    returns = tree_returns(rewards, 0.5, rollout.parents())
    for node in (0, 2):  # 'stop' rows: returns are the rewards
        assert torch.equal(returns[0][node], rewards[0][node])
    for node, first_child in ((1, 0), (3, 2)):
        for j in range(2):
            child = first_child + j
            expected = rewards[0][node, j] + 0.5 * rewards[1][child].mean()
            assert returns[0][node, j].item() == pytest.approx(expected.item())
    advantages = trainer.advantages(rewards, None, rollout)
    assert [a.shape[0] for a in advantages[0]] == [8, 8]


def test_magrpo_every_node_stopping_ends_the_rollout(tiny_llama):
    transition = Transition()
    trainer = magrpo(tiny_llama, transition, Calls(), early_termination_threshold=-1.0)
    rollout = trainer.rollout([trainer.train_dataset[i] for i in range(4)])
    assert len(rollout.turns) == 1 and transition.prompts == []
    metrics = trainer.train_step([trainer.train_dataset[i] for i in range(4)])
    assert "turn_2/reward_mean" not in metrics and math.isfinite(metrics["reward_mean"])


@pytest.mark.parametrize("kind", ["magrpo", "iac", "maac"])
def test_resume_with_early_termination_equals_the_uninterrupted_run(kind, tiny_llama, tmp_path):
    def build():
        common = dict(num_agents=2, num_turns=2, max_new_tokens=4, temperature=1.0, agent_learning_rate=1e-3,
                      per_device_train_batch_size=2, early_termination_threshold=0.5, num_train_epochs=2,
                      disable_tqdm=True, seed=2)
        data = dict(reward_func=Calls(), external_transition=Transition(),
                    train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
        if kind == "magrpo":
            return MAGRPOTrainer(agent_model=tiny_llama, args=MAGRPOConfig(num_generations=2, **common), **data)
        if kind == "iac":
            return IACTrainer(agent_model=tiny_llama, critic_model=tiny_llama, args=IACConfig(**common), **data)
        return MAACTrainer(agent_model=tiny_llama, critic_model=tiny_llama, args=MAACConfig(**common), **data)

    straight = build()
    straight.train(checkpoint_dir=tmp_path / "run", checkpoint_interval=1)
    history = straight.state.history
    assert any("turn_2/reward_mean" in step for step in history)  # 'keep' rows went on
    resumed = build()
    resumed.train(resume_from_checkpoint=tmp_path / "run" / "checkpoint-1")
    for name, module in straight.checkpoint_modules().items():
        other = resumed.checkpoint_modules()[name].state_dict()
        assert all(torch.equal(value, other[key]) for key, value in module.state_dict().items()), name
    assert [s["reward_mean"] for s in history] == [s["reward_mean"] for s in resumed.state.history]


def test_actor_critic_ended_episodes_have_no_later_targets(tiny_llama):
    trainer = IACTrainer(agent_model=tiny_llama, critic_model=tiny_llama, reward_func=Calls(),
                         external_transition=Transition(), train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                         args=IACConfig(num_train_epochs=1, num_agents=2, num_turns=2, max_new_tokens=4, discount=0.5, gae_lambda=1.0,
                                        early_termination_threshold=0.5, normalize_advantages=False,
                                        disable_tqdm=True, seed=3))
    rows = [trainer.train_dataset[i] for i in range(4)]
    rollout = trainer.rollout(rows)
    rewards = trainer.score(rollout)
    values = trainer.values(trainer.critic_inputs(rollout), rollout)
    estimates = trainer.advantages(rewards, values, None, rollout)
    targets = estimates.returns[0]
    assert torch.isnan(targets[[0, 2], 1]).all() and not torch.isnan(targets[[1, 3]]).any()
    # an ended episode's return is its reward (no value after the end); a continuing one bootstraps (lambda=1: the return)
    assert targets[0, 0].item() == pytest.approx(rewards[0][0, 0].item())
    assert targets[1, 0].item() == pytest.approx(rewards[0][1, 0].item() + 0.5 * rewards[1][0, 0].item())
    assert (estimates.advantages[0][[0, 2], 1] == 0).all()  # unreached turns: no advantage
    metrics = trainer.update(rollout, trainer.critic_inputs(rollout), estimates, values)
    assert all(math.isfinite(v) for v in metrics.values())


def test_actor_critic_refuses_early_termination_under_data_parallelism():
    from types import SimpleNamespace

    from comlrl.trainers.actor_critic.base import check_early_termination_alone

    args = SimpleNamespace(num_turns=2, early_termination_threshold=0.5)
    with pytest.raises(ValueError, match="IACTrainer: early_termination_threshold=0.5 cannot be combined with data"):
        check_early_termination_alone("IACTrainer", args, data_parallel=True)
    check_early_termination_alone("IACTrainer", args, data_parallel=False)  # one process: allowed
    check_early_termination_alone("IACTrainer", SimpleNamespace(num_turns=2, early_termination_threshold=None), True)
