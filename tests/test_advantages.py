"""The maths on hand-computed numbers."""

import torch

from comlrl.algorithms.advantages import agent_advantages, group_relative_advantages, joint_index, tree_returns
from comlrl.algorithms.losses import clipped_policy_loss, masked_sequence_mean


def test_group_relative_mean_only():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 6.0]])
    # mean 3 -> [-2, -1, 0, 3]
    assert torch.equal(group_relative_advantages(rewards, normalize=False), torch.tensor([[-2.0, -1.0, 0.0, 3.0]]))


def test_group_relative_normalized_by_sample_std():
    rewards = torch.tensor([[1.0, 3.0]])
    # mean 2, sample std sqrt(((-1)^2 + 1^2) / (2 - 1)) = sqrt(2) -> [-1, 1] / sqrt(2)
    advantages = group_relative_advantages(rewards, normalize=True, eps=1e-8)
    assert torch.allclose(advantages, torch.tensor([[-1.0, 1.0]]) / 2**0.5, atol=1e-6)
    # the population std (/ n) is 1 -> [-1, 1]
    population = group_relative_advantages(rewards, normalize=True, eps=1e-8, unbiased=False)
    assert torch.allclose(population, torch.tensor([[-1.0, 1.0]]), atol=1e-6)


def test_constant_group_gives_zero_not_nan():
    advantages = group_relative_advantages(torch.tensor([[0.5, 0.5, 0.5]]), normalize=True)
    assert torch.equal(advantages, torch.zeros(1, 3))


def test_joint_index_aligned_and_cross():
    assert joint_index(2, 3, "aligned").tolist() == [[0, 0], [1, 1], [2, 2]]
    assert joint_index(2, 2, "cross").tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]


def test_cross_credit_is_the_mean_over_joints_containing_the_completion():
    index = joint_index(2, 2, "cross")
    joint = torch.tensor([[1.0, 2.0, 3.0, 4.0]])  # (a0,b0)=1 (a0,b1)=2 (a1,b0)=3 (a1,b1)=4
    credit = agent_advantages(joint, index, 2)
    assert credit[0].tolist() == [[1.5, 3.5]]  # agent 0: a0 in joints 1,2; a1 in 3,4
    assert credit[1].tolist() == [[2.0, 3.0]]  # agent 1: b0 in joints 1,3; b1 in 2,4


def test_tree_returns_discount_child_means():
    # Turn 0: one node, two joints with rewards 1 and 0. Turn 1: child nodes 0 and 1.
    rewards = [torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 4.0], [0.0, 0.0]])]
    returns = tree_returns(rewards, discount=0.5)
    assert returns[0].tolist() == [[1.0 + 0.5 * 3.0, 0.0 + 0.5 * 0.0]]
    assert torch.equal(returns[1], rewards[1])


def test_masked_sequence_mean_ignores_padding_and_empty_rows():
    values = torch.tensor([[1.0, 3.0, 100.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert masked_sequence_mean(values, mask).tolist() == [2.0, 0.0]


def test_policy_loss_gradient_raises_logprob_of_better_sample():
    """Two samples, advantage +1 and -1: a gradient step must raise the first one's log-prob."""
    logprobs = torch.tensor([[-1.0], [-1.0]], requires_grad=True)
    loss = clipped_policy_loss(logprobs, logprobs.detach(), torch.tensor([1.0, -1.0]), torch.ones(2, 1), 0.2)
    loss.backward()
    # d loss / d logprob = -A / 2 at ratio 1
    assert torch.allclose(logprobs.grad, torch.tensor([[-0.5], [0.5]]))


def test_policy_loss_clips_large_ratios():
    old = torch.zeros(1, 1)
    logprobs = torch.tensor([[1.0]], requires_grad=True)  # ratio e > 1.2
    loss = clipped_policy_loss(logprobs, old, torch.tensor([1.0]), torch.ones(1, 1), 0.2)
    assert torch.allclose(loss, torch.tensor(-1.2))
    loss.backward()
    assert logprobs.grad.abs().sum() == 0  # clipped: no push beyond the trust region


def test_dropped_samples_are_left_out_of_the_group():
    rewards = torch.tensor([[1.0, float("nan"), 3.0]])
    advantages = group_relative_advantages(rewards, normalize=False)
    assert advantages.tolist() == [[-1.0, 0.0, 1.0]]
    normalized = group_relative_advantages(rewards, normalize=True, eps=1e-8)  # kept 1 and 3: sample std sqrt(2)
    assert torch.allclose(normalized, torch.tensor([[-1.0, 0.0, 1.0]]) / 2**0.5, atol=1e-6)
    assert not torch.isnan(group_relative_advantages(torch.full((1, 3), float("nan")))).any()
