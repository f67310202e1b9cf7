"""Issue 27, defect 2: with ``joint_mode="cross"`` and ``invalid_reward="drop"`` a completion is credited with the
mean advantage of its *kept* joint samples only; a completion whose joints were all dropped gets 0."""

from __future__ import annotations

import pytest
import torch

from comlrl.algorithms.advantages import agent_advantages, joint_index
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

NAN = float("nan")


def test_cross_credit_leaves_dropped_joints_out_of_the_mean_by_hand():
    index = joint_index(2, 2, "cross")  # joints (a0,b0) (a0,b1) (a1,b0) (a1,b1)
    joint = torch.tensor([[0.5, 0.0, -0.5, 0.0]])  # joints 1 and 3 were dropped (advantage 0)
    kept = torch.tensor([[True, False, True, False]])
    credit = agent_advantages(joint, index, 2, kept=kept)
    # agent 0: a0 is in joints 0 (0.5) and 1 (dropped) -> 0.5; a1 in joints 2 (-0.5) and 3 (dropped) -> -0.5
    # agent 1: b0 is in joints 0 and 2 -> (0.5 - 0.5) / 2 = 0; b1 only in dropped joints 1 and 3 -> 0
    assert credit.tolist() == [[[0.5, -0.5]], [[0.0, 0.0]]]
    # nothing dropped: the mean over every joint, as before
    assert agent_advantages(joint, index, 2, kept=torch.ones_like(kept)).tolist() == \
        agent_advantages(joint, index, 2).tolist() == [[[0.25, -0.25]], [[0.0, 0.0]]]


def test_magrpo_advantages_stage_credits_kept_joints_only(tiny_llama, train_dataset, reward_func):
    """The trainer's advantages stage, on rewards with two dropped cross joints (NaN): group mean over the kept
    rewards 1 and 0 is 0.5, so the joint advantages are [0.5, 0, -0.5, 0] (no std normalisation)."""
    trainer = MAGRPOTrainer(
        agent_model=tiny_llama, num_agents=2, reward_func=reward_func, train_dataset=train_dataset,
        args=MAGRPOConfig(num_agents=2, num_generations=2, joint_mode="cross", invalid_reward="drop",
                          normalize_advantages=False, max_new_tokens=4, device="cpu", disable_tqdm=True))
    rewards = [torch.tensor([[1.0, NAN, 0.0, NAN], [NAN, NAN, NAN, 2.0]])]
    per_agent = trainer.advantages(rewards)
    # node 0 as above; node 1 keeps one joint (a1, b1) alone: its own mean, advantage 0 for everyone
    assert per_agent[0][0].tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0])
    assert per_agent[1][0].tolist() == pytest.approx([0.0, 0.0, 0.0, 0.0])
    rewards = [torch.tensor([[1.0, NAN, 0.0, 3.0]])]  # mean 4/3: joints 1/3 - 4/3 = -1/3, -4/3, 5/3
    per_agent = trainer.advantages(rewards)
    assert per_agent[0][0].tolist() == pytest.approx([-1 / 3, (-4 / 3 + 5 / 3) / 2])  # a0 keeps joint 0 only
    assert per_agent[1][0].tolist() == pytest.approx([(-1 / 3 - 4 / 3) / 2, 5 / 3])  # b1 keeps joint 3 only
