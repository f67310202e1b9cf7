"""The maths (comlrl.algorithms) on hand-computed numbers."""

import math

import pytest
import torch

from comlrl.algorithms import dpo
from comlrl.algorithms.advantages import (agent_advantages, baseline_advantages, group_relative_advantages, joint_index,
                                          moments, normalize, q_critic_advantages, tree_returns)
from comlrl.algorithms.kl import kl_shaped_rewards
from comlrl.algorithms.losses import (bradley_terry_loss, clipped_policy_loss, clipped_token_losses, loss_normaliser,
                                      masked_sequence_mean, token_entropy, value_loss)


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


# ----- the rest of comlrl.algorithms, on hand-computed numbers ------------------------------------------------
def test_normalize_over_every_process_by_hand():
    # Values 1, 2 on one process and 3, 6 on another: count 4, sum 12, squares 50; mean 3, sum of squared
    # deviations 50 - 4 * 9 = 14: sample variance 14 / 3, population variance 14 / 4.
    totals = moments(torch.tensor([1.0, 2.0])) + moments(torch.tensor([3.0, 6.0]))
    assert totals.tolist() == [4.0, 12.0, 50.0] and totals.dtype == torch.float64
    part = torch.tensor([1.0, 2.0])
    for unbiased, variance in ((True, 14 / 3), (False, 14 / 4)):
        for eps in (1e-6, 0.5):
            expected = [(x - 3) / (variance ** 0.5 + eps) for x in (1.0, 2.0)]
            assert normalize(part, eps=eps, unbiased=unbiased, totals=totals).tolist() == pytest.approx(expected)
            whole = torch.tensor([1.0, 2.0, 3.0, 6.0])  # the same statistics from the values themselves
            assert normalize(whole, eps=eps, unbiased=unbiased)[:2].tolist() == pytest.approx(expected)
    # Two values 0 and 0.5 (squared deviations 0.125): mean 0.25, sample std sqrt(0.125) -> -1/sqrt(2), 1/sqrt(2).
    pair = torch.tensor([0.0, 0.5])
    assert normalize(pair, totals=moments(pair)).tolist() == pytest.approx([-(0.5 ** 0.5), 0.5 ** 0.5], rel=1e-5)
    # Fewer than two values, or a std at most eps (here the population std of -1, 1 is exactly 1): zeros.
    assert normalize(torch.tensor([4.0]), totals=moments(torch.tensor([4.0]))).tolist() == [0.0]
    opposite = torch.tensor([-1.0, 1.0])
    assert normalize(opposite, eps=1.0, unbiased=False).tolist() == [0.0, 0.0]
    assert normalize(opposite, eps=1.0, unbiased=False, totals=moments(opposite)).tolist() == [0.0, 0.0]


def test_clipped_policy_loss_averages_each_completion_then_the_completions():
    logprobs = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    # ratio 1: token losses -A; completion 1 (A = 1) has two tokens, completion 2 (A = -2) one:
    # mean(mean(-1, -1), mean(2)) = 0.5 (a token-level mean would be (-1 - 1 + 2) / 3 = 0)
    loss = clipped_policy_loss(logprobs, logprobs.detach(), torch.tensor([1.0, -2.0]), mask, 0.2)
    assert loss.item() == pytest.approx(0.5)
    loss.backward()
    assert logprobs.grad.tolist() == [[-0.25, -0.25], [1.0, 0.0]]


def test_bradley_terry_loss_by_hand():
    chosen, rejected = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])
    expected = (math.log(1 + math.exp(-1.0)) + math.log(1 + math.exp(2.0))) / 2  # -log sigmoid(1), -log sigmoid(-2)
    assert bradley_terry_loss(chosen, rejected).item() == pytest.approx(expected)


def test_value_clipping_keeps_the_larger_loss_below_the_old_value_too():
    # V_old = 1, V = 0 (moved down by 1), clip 0.2: V_clip = 0.8. Target -0.5: (0 + 0.5)^2 = 0.25 and
    # (0.8 + 0.5)^2 = 1.69, the larger kept.
    loss = value_loss(torch.tensor([0.0]), torch.tensor([-0.5]), old_values=torch.tensor([1.0]), clip_range=0.2)
    assert loss.item() == pytest.approx(1.69)
    with pytest.raises(ValueError, match=r"^value_loss with clip_range needs old_values \(the values at rollout time\)$"):
        value_loss(torch.tensor([0.0]), torch.tensor([0.0]), clip_range=0.2)


def test_token_entropy_is_over_the_last_dimension():
    # [1, 2, 3]: position 1 uniform over 3 tokens (entropy log 3), position 2 certain (0)
    logits = torch.tensor([[[0.0, 0.0, 0.0], [0.0, -1e4, -1e4]]])
    assert token_entropy(logits)[0].tolist() == pytest.approx([math.log(3.0), 0.0], abs=1e-6)


def test_kl_and_dpo_terms_keep_the_callers_dtype():
    rewards = torch.tensor([1.0], dtype=torch.float32)
    assert kl_shaped_rewards(rewards, torch.tensor([0.5], dtype=torch.float64), 0.2).dtype == torch.float32
    chosen, rejected = torch.tensor([-1.0], dtype=torch.bfloat16), torch.tensor([-2.0], dtype=torch.bfloat16)
    reference = torch.tensor([-1.5], dtype=torch.float64)
    assert dpo.log_ratio_differences(chosen, rejected, reference, reference).dtype == torch.bfloat16
    own = torch.tensor([0.5], dtype=torch.bfloat16, requires_grad=True)
    assert dpo.joint_dpo_loss(own, torch.tensor([1.0], dtype=torch.float64), 1.0).dtype == torch.bfloat16
    advantages = torch.tensor([1.0], dtype=torch.float64)
    assert clipped_token_losses(torch.zeros(1, 1), torch.zeros(1, 1), advantages, 0.2).dtype == torch.float32


def test_cross_credit_in_double_precision():
    joint = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
    credit = agent_advantages(joint, joint_index(2, 2, "cross"), 2)
    assert credit.dtype == torch.float64 and credit[0].tolist() == [[1.5, 3.5]] and credit[1].tolist() == [[2.0, 3.0]]


def test_q_critic_advantages_over_turns_and_groups_by_hand():
    # 4 episodes of 2 turns in groups of 2: A = G - mean of the other episode's Q in the group, per turn.
    targets = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
    q_values = torch.tensor([[0.5, 1.0], [1.5, 2.0], [2.5, 3.0], [3.5, 4.0]])
    assert q_critic_advantages(targets, q_values, 2).tolist() == [[1.0 - 1.5, 2.0 - 2.0], [3.0 - 0.5, 4.0 - 1.0],
                                                                  [5.0 - 3.5, 6.0 - 4.0], [7.0 - 2.5, 8.0 - 3.0]]
    # A group of one has no other sample: no baseline, so no advantage (NaN)
    assert torch.isnan(q_critic_advantages(targets, q_values, 1)).all()
    with pytest.raises(ValueError, match=r"^targets and q_values must both be \[num_episodes, num_turns\], "
                                         r"got \(4, 2\) and \(4, 1\)$"):
        q_critic_advantages(targets, q_values[:, :1], 2)
    with pytest.raises(ValueError, match=r"got \(4,\) and \(4,\)$"):
        q_critic_advantages(targets[:, 0], q_values[:, 0], 2)
    with pytest.raises(ValueError, match="^4 episodes do not split into groups of group_size=3$"):
        q_critic_advantages(targets, q_values, 3)


# Two groups: 1, 3, (dropped), 2 (mean 2, squared deviations 2) and 0, 4 (two dropped; mean 2, squared deviations 8).
GROUPS = torch.tensor([[1.0, 3.0, float("nan"), 2.0], [0.0, 4.0, float("nan"), float("nan")]])
BASELINED = {"mean": [[-1.0, 1.0, 0.0, 0.0], [-2.0, 2.0, 0.0, 0.0]],
             "raw": [[1.0, 3.0, 0.0, 2.0], [0.0, 4.0, 0.0, 0.0]],
             "max": [[-2.0, 0.0, 0.0, -1.0], [-4.0, 0.0, 0.0, 0.0]],
             "rloo": [[1 - 2.5, 3 - 1.5, 0.0, 2 - 2.0], [0 - 4.0, 4 - 0.0, 0.0, 0.0]]}
# Per group: sample std sqrt(2 / 2) and sqrt(8 / 1); population std sqrt(2 / 3) and sqrt(8 / 2).
STDS = {True: (1.0, 8 ** 0.5), False: ((2 / 3) ** 0.5, 2.0)}


@pytest.mark.parametrize("mode", ["mean", "raw", "max", "rloo"])
def test_baseline_advantages_per_group_with_dropped_samples_by_hand(mode):
    assert baseline_advantages(GROUPS, mode, normalize=False).tolist() == BASELINED[mode]
    for unbiased in (True, False):
        for eps in (1e-6, 0.5):
            scaled = baseline_advantages(GROUPS, mode, normalize=True, eps=eps, unbiased=unbiased)
            for row, std in enumerate(STDS[unbiased]):
                expected = [a / (std + eps) for a in BASELINED[mode][row]]
                assert scaled[row].tolist() == pytest.approx(expected, rel=1e-6), (mode, unbiased, eps, row)


def test_advantage_defaults_and_the_eps_boundary():
    # defaults: the group mean, normalised by the sample std (eps 1e-6)
    expected = [[-1.0 / (1 + 1e-6), 1.0 / (1 + 1e-6), 0.0, 0.0], [-2 / (8 ** 0.5 + 1e-6), 2 / (8 ** 0.5 + 1e-6), 0.0, 0.0]]
    for advantages in (baseline_advantages(GROUPS), group_relative_advantages(GROUPS)):
        assert advantages[0].tolist() == pytest.approx(expected[0]) and advantages[1].tolist() == pytest.approx(expected[1])
    # A std of exactly eps is "at most eps": the population std of 0, 2 is 1; eps 1 -> not scaled (zeros for 'mean')
    pair = torch.tensor([[0.0, 2.0]])
    assert baseline_advantages(pair, "raw", normalize=True, eps=1.0, unbiased=False).tolist() == [[0.0, 2.0]]
    assert group_relative_advantages(pair, normalize=True, eps=1.0, unbiased=False).tolist() == [[0.0, 0.0]]
    assert group_relative_advantages(torch.tensor([[0.0, 1e-7]])).tolist() == [[0.0, 0.0]]  # std below eps: zeros
    for function in (group_relative_advantages, lambda r: baseline_advantages(r, "raw")):
        with pytest.raises(ValueError, match=r"^rewards must be \[num_groups, group_size\], got shape \(3,\)$"):
            function(torch.zeros(3))
    with pytest.raises(ValueError, match="^joint mode must be 'aligned' or 'cross', got 'diagonal'$"):
        joint_index(2, 2, "diagonal")


def test_tree_returns_over_three_turns_and_a_pruned_tree_by_hand():
    # Three turns, every joint sample spawning a node: turn 1's node n is spawned by turn 0's sample n, and so on.
    rewards = [torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 3.0], [0.0, 2.0]]),
               torch.tensor([[2.0, 2.0], [0.0, 4.0], [1.0, 1.0], [6.0, 0.0]])]
    returns = tree_returns(rewards, discount=0.5)
    # turn 1: 1 + 0.5 * 2, 3 + 0.5 * 2, 0 + 0.5 * 1, 2 + 0.5 * 3; turn 0: 1 + 0.5 * mean(2, 4), 2 + 0.5 * mean(0.5, 3.5)
    assert returns[1].tolist() == [[2.0, 4.0], [0.5, 3.5]] and returns[0].tolist() == [[2.5, 3.0]]
    assert returns[2].tolist() == rewards[2].tolist()
    # Two nodes at turn 0 (flat samples 0..3); only samples 1 and 2 spawned nodes (early termination).
    pruned = [torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[4.0, 6.0], [0.0, 2.0]])]
    assert tree_returns(pruned, 0.5, parents=[None, [1, 2]])[0].tolist() == [[1.0, 2.0 + 2.5], [3.0 + 0.5, 4.0]]
    # Three turns, pruned at each: turn 1's only node comes from turn 0's sample 1, turn 2's from turn 1's sample 0.
    # Turn 1: 1 + 0.5 * mean(4, 8) = 4 and 0 (ended); turn 0: 1 (ended) and 2 + 0.5 * mean(4, 0) = 3.
    three = [torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 0.0]]), torch.tensor([[4.0, 8.0]])]
    returns = tree_returns(three, 0.5, parents=[None, [1], [0]])
    assert returns[1].tolist() == [[4.0, 0.0]] and returns[0].tolist() == [[1.0, 3.0]]
    # float64 rewards keep float64 precision through a pruned tree (0.1 + 0.5 * 0.3 in float32 is off by ~1e-8)
    precise = tree_returns([torch.tensor([[0.1, 0.2]], dtype=torch.float64),
                            torch.tensor([[0.25, 0.35]], dtype=torch.float64)], 0.5, parents=[None, [0]])
    assert precise[0].dtype == torch.float64
    assert precise[0][0].tolist() == pytest.approx([0.1 + 0.5 * 0.3, 0.2], rel=1e-12, abs=0)


def test_loss_normaliser_counts_and_the_lower_clip_by_hand():
    assert [loss_normaliser(t, 1, 1, 4) for t in ("grpo", "bnpo", "dapo", "dr_grpo")] == [1.0, 1.0, 1.0, 4.0]
    assert [loss_normaliser(t, 0, 0, 4) for t in ("grpo", "bnpo", "dr_grpo")] == [1.0, 1.0, 4.0]  # never 0
    with pytest.raises(ValueError, match=r"^loss_type='dr_grpo' needs max_completion_length \(the config's "
                                         r"max_new_tokens\)$"):
        loss_normaliser("dr_grpo", 2, 5, None)
    with pytest.raises(ValueError, match=r"^loss_type must be one of \['grpo', 'bnpo', 'dapo', 'dr_grpo'\], "
                                         r"got 'token'$"):
        loss_normaliser("token", 2, 5, None)
    # ratio 0.5 with A = -1 (eps 0.2): -min(0.5 * -1, 0.8 * -1) = 0.8: the ratio is clipped from below
    losses = clipped_token_losses(torch.log(torch.tensor([[0.5]])), torch.zeros(1, 1), torch.tensor([-1.0]), 0.2)
    assert losses.tolist() == [[pytest.approx(0.8)]]
