"""Checks of suspected algorithm defects, on hand-computed numbers (and one tiny GPT-2 with dropout).

1. Q critic: the actor's baseline must not depend on the taken action (else r - Q(h, a) -> 0).
2. Group std: the sample (Bessel-corrected) std, explicit in the signature.
3. Dropout: behaviour log-probs and the update forward run with dropout off.
4. Tree returns: a branch whose children were all dropped is dropped, not worth r_t + 0.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from comlrl.algorithms.advantages import group_relative_advantages, normalize, tree_returns
from comlrl.trainers.actor_critic.base import ActorCriticTrainer
from comlrl.trainers.actor_critic.config import IACConfig, MAACConfig

NAN = float("nan")


def stage_advantages(config, rewards, values):
    """``ActorCriticTrainer.advantages`` needs only ``self.args``: run it without loading any model."""
    return ActorCriticTrainer.advantages(SimpleNamespace(args=config), rewards, values)


# ----- 1. Q critic ---------------------------------------------------------------------------------
def test_q_critic_advantage_does_not_collapse_when_q_equals_the_reward():
    # two prompts x two completions; the critic has fitted Q(h, a) = r exactly
    rewards = [torch.tensor([[1.0, 3.0], [2.0, 6.0]])]
    q_values = [torch.tensor([[1.0], [3.0], [2.0], [6.0]])]
    estimates = stage_advantages(IACConfig(normalize_advantages=False, critic_type="q", num_generations=2), rewards, q_values)
    # A_i = r_i - Q of the other sample of the same prompt: 1-3, 3-1, 2-6, 6-2 (r - Q(h, a_i) would be all 0)
    assert estimates.advantages[0].tolist() == [[-2.0], [2.0], [-4.0], [4.0]]
    assert estimates.returns[0].tolist() == [[1.0], [3.0], [2.0], [6.0]]  # the critic still regresses Q(h, a) on r


def test_q_critic_baseline_does_not_depend_on_the_own_action_value():
    config = MAACConfig(normalize_advantages=False, critic_type="q", num_generations=3)
    rewards = [torch.tensor([[1.0, 2.0, 4.0]])]
    first = stage_advantages(config, rewards, [torch.tensor([[2.0], [5.0], [3.0]])])
    # baselines: (5+3)/2 = 4, (2+3)/2 = 2.5, (2+5)/2 = 3.5
    assert first.advantages[0].tolist() == [[-3.0], [-0.5], [0.5]]
    # moving sample 0's own Q leaves its advantage alone (and shifts only the others' baselines)
    moved = stage_advantages(config, rewards, [torch.tensor([[100.0], [5.0], [3.0]])])
    assert moved.advantages[0][0].item() == -3.0


def test_q_critic_leaves_dropped_samples_out_of_the_baselines():
    config = IACConfig(normalize_advantages=False, critic_type="q", num_generations=3)
    # sample 1 dropped; kept Q: 2 and 3 -> A_0 = 1 - 3, A_2 = 4 - 2; the dropped sample gets 0
    estimates = stage_advantages(config, [torch.tensor([[1.0, NAN, 4.0]])], [torch.tensor([[2.0], [5.0], [3.0]])])
    assert estimates.advantages[0].tolist() == [[-2.0], [0.0], [2.0]]
    assert math.isnan(estimates.returns[0][1, 0].item())
    # a group with one kept sample has no action-independent baseline: advantage 0, not r - Q(h, a)
    lone = stage_advantages(config, [torch.tensor([[5.0, NAN, NAN]])], [torch.tensor([[1.0], [2.0], [3.0]])])
    assert lone.advantages[0].tolist() == [[0.0], [0.0], [0.0]]


def test_q_critic_advantages_pure_function():
    from comlrl.algorithms.advantages import leave_one_out_mean, q_critic_advantages

    assert leave_one_out_mean(torch.tensor([[1.0, 2.0, 6.0]])).tolist() == [[4.0, 3.5, 1.5]]
    # NaN entries are left out: the kept 1 has no other kept entry (NaN); the NaN entry's others mean 1
    assert torch.allclose(leave_one_out_mean(torch.tensor([[1.0, NAN]])), torch.tensor([[NAN, 1.0]]), equal_nan=True)
    # two groups of two, one turn: A = G - Q(other)
    targets = torch.tensor([[1.0], [3.0], [0.0], [2.0]])
    q = torch.tensor([[0.5], [2.5], [1.0], [1.0]])
    assert q_critic_advantages(targets, q, 2).tolist() == [[1.0 - 2.5], [3.0 - 0.5], [0.0 - 1.0], [2.0 - 1.0]]
    with pytest.raises(ValueError, match="do not split into groups of group_size=3"):
        q_critic_advantages(targets, q, 3)


def test_v_critic_advantage_is_still_reward_minus_value():
    estimates = stage_advantages(IACConfig(normalize_advantages=False, critic_type="v", num_generations=2), [torch.tensor([[3.0, 1.0]])],
                                 [torch.tensor([[1.0], [2.0]])])
    assert estimates.advantages[0].tolist() == [[2.0], [-1.0]]


@pytest.mark.parametrize("config_class, settings", [
    (IACConfig, dict(critic_type="q", num_generations=1)),
    (MAACConfig, dict(critic_type="q", num_turns=2)),
])
def test_q_critic_needs_a_group_of_completions(config_class, settings):
    with pytest.raises(ValueError, match=rf"{config_class.__name__}.critic_type='q' needs num_generations >= 2 "
                                         r"\(got num_generations=1"):
        config_class(**settings)
    config_class(critic_type="q", num_generations=2)  # one turn, a group of two: fine


# ----- 2. group std --------------------------------------------------------------------------------
def test_group_std_is_the_sample_std_by_default():
    rewards = torch.tensor([[0.0, 0.0, 3.0, 3.0]])
    # mean 1.5, centred +-1.5, sum of squares 9: sample std sqrt(9/3) = sqrt(3), population std sqrt(9/4) = 1.5
    sample = group_relative_advantages(rewards, normalize=True, eps=0.0)
    assert torch.allclose(sample, torch.tensor([[-1.5, -1.5, 1.5, 1.5]]) / math.sqrt(3.0))
    population = group_relative_advantages(rewards, normalize=True, eps=0.0, unbiased=False)
    assert torch.allclose(population, torch.tensor([[-1.0, -1.0, 1.0, 1.0]]))


def test_group_std_counts_only_kept_samples_and_never_gives_nan():
    # kept 1 and 3: mean 2, sample std sqrt(2)
    advantages = group_relative_advantages(torch.tensor([[1.0, NAN, 3.0]]), normalize=True, eps=0.0)
    assert torch.allclose(advantages, torch.tensor([[-1.0, 0.0, 1.0]]) / math.sqrt(2.0))
    # constant group, one kept sample, nothing kept: zeros
    for rewards in ([[0.5, 0.5, 0.5]], [[2.0, NAN, NAN]], [[NAN, NAN]]):
        assert torch.equal(group_relative_advantages(torch.tensor(rewards)), torch.zeros(1, len(rewards[0])))


def test_batch_normalize_uses_the_same_std():
    # [1, 3]: sample std sqrt(2)
    assert torch.allclose(normalize(torch.tensor([1.0, 3.0]), eps=0.0), torch.tensor([-1.0, 1.0]) / math.sqrt(2.0))
    assert torch.allclose(normalize(torch.tensor([1.0, 3.0]), eps=0.0, unbiased=False), torch.tensor([-1.0, 1.0]))


# ----- 3. dropout ----------------------------------------------------------------------------------
def dropout_gpt2(p: float = 0.5):
    from transformers import GPT2LMHeadModel

    from comlrl.tiny import build_tiny_tokenizer, tiny_gpt2_config

    config = tiny_gpt2_config(build_tiny_tokenizer(vocab_size=96), hidden_size=32)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = p
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def hand_generation(vocab: int = 96):
    from comlrl.rollout.generation import Generation

    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(4, vocab, (2, 5), generator=generator)
    completion = torch.randint(4, vocab, (2, 4), generator=generator)
    return Generation(prompt, torch.ones_like(prompt), completion, torch.ones_like(completion), ["", ""], 1)


def test_behaviour_logprobs_are_deterministic_under_dropout_and_restore_the_mode():
    from comlrl.training.policy_update import behaviour_logprobs

    model, generation = dropout_gpt2(), hand_generation()
    model.train()
    first = behaviour_logprobs(model, [generation], 1.0)[0]
    second = behaviour_logprobs(model, [generation], 1.0)[0]
    assert torch.equal(first, second)
    model.eval()
    assert torch.equal(first, behaviour_logprobs(model, [generation], 1.0)[0])  # the eval-mode (sampling) policy
    model.train()
    behaviour_logprobs(model, [generation], 1.0)
    assert all(module.training for module in model.modules())  # train mode restored everywhere


def test_update_forward_runs_without_dropout():
    """With old log-probs from before the update the first pass has ratio exactly 1, so the loss is -mean(A)."""
    from comlrl.training.policy_update import backpropagate, behaviour_logprobs, policy_losses

    model, generation = dropout_gpt2(), hand_generation()
    model.train()
    old = behaviour_logprobs(model, [generation], 1.0)
    advantages = [torch.tensor([1.0, 2.0])]
    grads = []
    for _ in range(2):
        model.zero_grad()
        loss = backpropagate(policy_losses(model, [generation], advantages, 0.2, 1.0, old))
        assert loss == pytest.approx(-1.5, abs=1e-6)
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]))
    assert torch.equal(grads[0], grads[1])
    assert model.training and model.transformer.drop.training


def test_dropout_disabled_keeps_gradient_checkpointing():
    """Transformers checkpoints only layers in training mode: those stay in it, everything else goes to eval."""
    from comlrl.parallel.memory import enable_gradient_checkpointing
    from comlrl.training.policy_update import dropout_disabled

    model, generation = dropout_gpt2(), hand_generation()
    enable_gradient_checkpointing([model])
    model.train()
    block = model.transformer.h[0]
    seen = []
    hook = block.attn.register_forward_hook(lambda m, i, o: seen.append((block.training, m.training)))
    with dropout_disabled(model):
        ids = torch.cat([generation.prompt_ids, generation.completion_ids], dim=1)
        model(input_ids=ids, use_cache=False).logits.sum().backward()
    hook.remove()
    # the attention ran twice (forward, then recomputed in the backward pass), in eval mode inside a
    # training-mode (checkpointing) block
    assert seen == [(True, False), (True, False)]
    assert all(module.training for module in model.modules())



def test_critic_loss_runs_without_dropout():
    """The value loss compares the critic with the eval-mode values of rollout time, and is deterministic."""
    from comlrl.parallel.distributed import DataParallel
    from comlrl.training.policy_update import backpropagate
    from comlrl.trainers.actor_critic.critics import CriticInput
    from comlrl.models.value_heads import attach_value_head, sequence_values

    model, generation = dropout_gpt2(), hand_generation()
    torch.manual_seed(1)
    for parameter in attach_value_head(model).parameters():  # a new head predicts 0 whatever the backbone does
        torch.nn.init.normal_(parameter)
    ids = torch.cat([generation.prompt_ids, generation.completion_ids], dim=1)
    mask = torch.ones_like(ids)
    model.eval()
    with torch.no_grad():
        rollout_values = sequence_values(model, ids, mask)
    model.train()
    returns = torch.tensor([[1.0], [2.0]])
    stub = SimpleNamespace(args=IACConfig(), data_parallel=DataParallel())  # one process
    losses = [backpropagate(ActorCriticTrainer.critic_losses(stub, model, [CriticInput(ids, mask)], returns,
                                                             rollout_values.unsqueeze(1))) for _ in range(2)]
    expected = float(((rollout_values - returns[:, 0]) ** 2).mean())
    assert losses[0] == losses[1] and losses[0] == pytest.approx(expected, rel=1e-5)
    assert model.training

# ----- 4. tree returns with dropped children -------------------------------------------------------
def test_tree_return_of_a_branch_whose_children_were_all_dropped_is_dropped():
    # turn 0: one node, joints with rewards 1 and 2; turn 1: node 0 (children of joint 0) all dropped,
    # node 1 (children of joint 1) keeps 4 and drops the other
    rewards = [torch.tensor([[1.0, 2.0]]), torch.tensor([[NAN, NAN], [4.0, NAN]])]
    returns = tree_returns(rewards, discount=0.5)
    assert math.isnan(returns[0][0, 0].item())  # not 1 + 0.5 * 0
    assert returns[0][0, 1].item() == 2.0 + 0.5 * 4.0  # mean over the kept child only
    # in the group-relative step the dropped branch is left out (advantage 0), not ranked below its sibling
    assert group_relative_advantages(returns[0], normalize=False).tolist() == [[0.0, 0.0]]


def test_tree_returns_with_every_child_kept_are_unchanged():
    rewards = [torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 4.0], [0.0, 1.0]])]
    assert tree_returns(rewards, discount=0.5)[0].tolist() == [[1.0 + 0.5 * 3.0, 0.0 + 0.5 * 0.5]]
