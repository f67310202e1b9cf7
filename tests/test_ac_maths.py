"""Actor-critic maths on hand-computed numbers: TD targets, GAE, value loss, normalisation, entropy."""

import math

import pytest
import torch

from comlrl.algorithms.advantages import gae, normalize, td_targets
from comlrl.algorithms.losses import token_entropy, value_loss

# One episode of two turns: r = [1, 2], V = [0.5, 1.0], discount 0.5.
REWARDS = torch.tensor([[1.0, 2.0]])
VALUES = torch.tensor([[0.5, 1.0]])


def test_td_targets_bootstrap_from_the_next_turn_and_end_at_zero():
    # t0: 1 + 0.5 * 1.0 = 1.5; t1 (last): 2 + 0.5 * 0 = 2
    assert torch.equal(td_targets(REWARDS, VALUES, 0.5), torch.tensor([[1.5, 2.0]]))


def test_gae_lambda_zero_is_the_td_error():
    # deltas: 1.5 - 0.5 = 1.0 and 2.0 - 1.0 = 1.0
    assert torch.equal(gae(REWARDS, VALUES, 0.5, 0.0), torch.tensor([[1.0, 1.0]]))


def test_gae_lambda_one_is_the_discounted_return_minus_value():
    # return from t0 = 1 + 0.5 * 2 = 2, minus V0 = 0.5 -> 1.5; at t1: 2 - 1 = 1
    assert torch.equal(gae(REWARDS, VALUES, 0.5, 1.0), torch.tensor([[1.5, 1.0]]))


def test_gae_intermediate_lambda():
    # A0 = delta0 + 0.5 * 0.5 * A1 = 1 + 0.25 * 1 = 1.25
    assert torch.equal(gae(REWARDS, VALUES, 0.5, 0.5), torch.tensor([[1.25, 1.0]]))


def test_one_turn_advantage_is_reward_minus_value():
    rewards, values = torch.tensor([[3.0], [1.0]]), torch.tensor([[1.0], [2.0]])
    assert torch.equal(gae(rewards, values, 0.9, 0.95), torch.tensor([[2.0], [-1.0]]))


def test_td_targets_reject_mismatched_shapes():
    with pytest.raises(ValueError, match=r"rewards and values must both be \[num_episodes, num_turns\], got \(1, 2\) and \(2,\)"):
        td_targets(REWARDS, torch.tensor([0.5, 1.0]), 0.9)


def test_value_loss_is_mse():
    # (1 - 0)^2 and (3 - 0)^2 -> mean 5
    assert value_loss(torch.tensor([1.0, 3.0]), torch.tensor([0.0, 0.0])) == 5.0


def test_value_clipping_takes_the_larger_loss():
    # V moved from 0 to 2 (target 2), clip 0.5: V_clip = 0.5, loss max(0, 1.5^2) = 2.25
    values, old, targets = torch.tensor([2.0]), torch.tensor([0.0]), torch.tensor([2.0])
    assert value_loss(values, targets, old, clip_range=0.5) == 2.25
    # moving away from the target is not rewarded by clipping either: V 1, old 2, target 3 -> max(4, 2.25) = 4
    assert value_loss(torch.tensor([1.0]), torch.tensor([3.0]), torch.tensor([2.0]), clip_range=0.5) == 4.0
    # unclipped within range: equal to the plain MSE
    assert value_loss(torch.tensor([0.2]), torch.tensor([1.2]), torch.tensor([0.0]), clip_range=0.5) == value_loss(
        torch.tensor([0.2]), torch.tensor([1.2])
    )


def test_value_clipping_needs_old_values():
    with pytest.raises(ValueError, match="needs old_values"):
        value_loss(torch.tensor([1.0]), torch.tensor([0.0]), clip_range=0.2)


def test_value_clipping_stops_the_gradient_beyond_the_range():
    values = torch.tensor([2.0], requires_grad=True)
    value_loss(values, torch.tensor([2.0]), torch.tensor([0.0]), clip_range=0.5).backward()
    assert values.grad.item() == 0.0  # the clipped branch wins and is flat in V


def test_normalize():
    # sample std of [1, 3]: sqrt(2)
    assert torch.allclose(normalize(torch.tensor([1.0, 3.0]), eps=1e-9), torch.tensor([-1.0, 1.0]) / 2**0.5)
    assert torch.equal(normalize(torch.tensor([5.0])), torch.tensor([0.0]))
    assert torch.equal(normalize(torch.tensor([2.0, 2.0, 2.0])), torch.zeros(3))


def test_token_entropy():
    uniform = torch.zeros(1, 2, 4)
    assert torch.allclose(token_entropy(uniform), torch.full((1, 2), math.log(4.0)))
    peaked = torch.tensor([[[100.0, 0.0, 0.0]]])
    assert token_entropy(peaked).item() < 1e-6
