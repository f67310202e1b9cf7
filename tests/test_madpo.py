"""MADPO: the DPO maths and pair selection on hand-computed numbers, the trainer's reference, resume and learning."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from comlrl.algorithms import dpo
from comlrl.rollout import preferences
from comlrl.tasks.letters import letters_reward, rows
from comlrl.trainers.preference import MADPOConfig, MADPOTrainer

PROMPTS = ["write about the cat", "write about the sun", "write about the tree", "write about the road"]
TINY = dict(num_agents=2, num_generations=4, max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=None,
            agent_learning_rate=1e-2, per_device_train_batch_size=2, disable_tqdm=True, seed=3)


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ----- the maths ---------------------------------------------------------------------------------
def test_sequence_logprobs_and_log_ratio_differences_by_hand():
    tokens = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert dpo.sequence_logprobs(tokens, mask).tolist() == [-3.0, -10.0]
    chosen, rejected = torch.tensor([-3.0]), torch.tensor([-1.0])
    # (pi_w - ref_w) - (pi_l - ref_l) = (-3 + 4) - (-1 + 1.5) = 0.5; without a reference pi_w - pi_l = -2
    assert dpo.log_ratio_differences(chosen, rejected, torch.tensor([-4.0]), torch.tensor([-1.5])).item() == 0.5
    assert dpo.log_ratio_differences(chosen, rejected).item() == -2.0
    with pytest.raises(ValueError, match="^give both reference_chosen and reference_rejected, or neither$"):
        dpo.log_ratio_differences(chosen, rejected, torch.tensor([-4.0]))


def test_joint_dpo_loss_and_its_gradient_by_hand():
    own = torch.tensor([0.5, -1.0], requires_grad=True)
    others = torch.tensor([1.5, 1.0], requires_grad=True)
    beta = 0.5
    loss = dpo.joint_dpo_loss(own, others, beta)  # joint differences 2 and 0
    expected = (-math.log(sigmoid(1.0)) - math.log(sigmoid(0.0))) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-6) and expected == pytest.approx(0.5032044, abs=1e-6)
    loss.backward()
    # d/d own_p = -beta * sigmoid(-beta * J_p) / P; the other agents get no gradient
    assert own.grad.tolist() == pytest.approx([-beta * sigmoid(-1.0) / 2, -beta * sigmoid(0.0) / 2], abs=1e-7)
    assert others.grad is None
    # ... which is the gradient of the undetached joint loss with respect to this agent's differences
    own2 = own.detach().clone().requires_grad_(True)
    (-torch.nn.functional.logsigmoid(beta * (own2 + others.detach())).mean()).backward()
    assert torch.allclose(own.grad, own2.grad)
    assert dpo.joint_dpo_loss(torch.zeros(0, requires_grad=True), torch.zeros(0), 0.1).item() == 0.0


def test_dpo_statistics_by_hand():
    stats = dpo.dpo_statistics(torch.tensor([2.0, 0.0, -1.0]), beta=1.0)
    loss = (-math.log(sigmoid(2.0)) + math.log(2.0) - math.log(sigmoid(-1.0))) / 3
    assert stats["loss"] == pytest.approx(loss, abs=1e-6)
    assert stats["accuracy"] == pytest.approx(0.5)  # a win, a tie (half), a loss
    assert stats["margin"] == pytest.approx(1.0 / 3.0)
    small = dpo.dpo_statistics(torch.tensor([0.5, -0.25]), beta=1.0)  # a win by less than 1 still wins
    assert small == pytest.approx({"loss": (-math.log(sigmoid(0.5)) - math.log(sigmoid(-0.25))) / 2, "accuracy": 0.5,
                                   "margin": 0.125})
    assert dpo.dpo_statistics(torch.tensor([2.0]), beta=1.0) == pytest.approx(  # one pair
        {"loss": -math.log(sigmoid(2.0)), "accuracy": 1.0, "margin": 2.0})
    assert all(math.isnan(v) for v in dpo.dpo_statistics(torch.zeros(0), 0.1).values())


def test_pair_construction_and_selection_by_hand():
    rewards = torch.tensor([0.0, 1.0, 1.0, 3.0])
    pairs = preferences.ordered_pairs(rewards)
    # index order, the tie (1, 2) dropped, margins r_i - r_j
    assert [(p.chosen, p.rejected, p.margin) for p in pairs] == [(1, 0, 1.0), (2, 0, 1.0), (3, 0, 3.0), (3, 1, 2.0),
                                                                 (3, 2, 2.0)]
    assert [(p.chosen, p.rejected) for p in preferences.ordered_pairs(rewards, tie_margin=1.0)] == [(3, 0), (3, 1),
                                                                                                    (3, 2)]
    widest = preferences.select_pairs(pairs, "reward_gap", 3)
    assert [(p.chosen, p.rejected) for p in widest] == [(3, 0), (3, 1), (3, 2)]  # margin 3, then 2, 2 by index
    assert preferences.select_pairs(pairs, "all") == pairs
    with pytest.raises(ValueError, match="'all' keeps every pair"):
        preferences.select_pairs(pairs, "all", 2)
    draws = [tuple((p.chosen, p.rejected) for p in preferences.select_pairs(
        pairs, "random", 2, torch.Generator().manual_seed(seed))) for seed in range(20)]
    assert all(len(d) == 2 and len(set(d)) == 2 and set(d) <= {(p.chosen, p.rejected) for p in pairs} for d in draws)
    assert draws[0] == tuple((p.chosen, p.rejected) for p in preferences.select_pairs(
        pairs, "random", 2, torch.Generator().manual_seed(0)))  # seeded: reproducible
    assert len(set(draws)) > 3  # and not a fixed choice
    assert preferences.ranked_pairs(rewards, max_pairs=2) == [(3, 0), (3, 1)]


def test_pairs_across_sides_and_comparator_reward_selection_by_hand():
    # candidates 0, 1 from the policy; 2, 3 from a comparator: only pairs across the sides
    rewards = [0.1, 0.6, 0.4, 0.6]
    sides = [0, 0, 1, 1]
    pairs = preferences.ordered_pairs(rewards, sides=sides)
    assert [(p.chosen, p.rejected) for p in pairs] == [(1, 2), (2, 0), (3, 0)]  # (1, 3) tie, (0, 1) same side
    ranked = preferences.select_pairs(pairs, "comparator_reward", rewards=rewards, sides=sides)
    # the comparator-side candidate's reward first (3: 0.6, then 2: 0.4 twice, wider margin (2, 0) first)
    assert [(p.chosen, p.rejected) for p in ranked] == [(3, 0), (2, 0), (1, 2)]


# ----- the config --------------------------------------------------------------------------------
def test_config_takes_the_originals_names_and_validates_before_loading():
    config = MADPOConfig(preference_num_candidates=6, preference_pairs_per_sample=2, advantage_normalization=True,
                         use_environment_step=True, environment_steps_per_pair=2, collaboration_mode="decentralized")
    assert (config.num_generations, config.max_pairs_per_prompt, config.dpo_reference) == (6, 2, "initial")
    for bad, message in [
        (dict(pair_selection="all"), "pair_selection='all' keeps every pair"),
        (dict(num_turns=2), "num_turns must be 1"),
        (dict(dpo_beta=0.0), "dpo_beta must be > 0"),
        (dict(dpo_reference="sft"), "dpo_reference must be one of: 'initial', 'none'"),
        (dict(collaboration_mode="centralized"), "collaboration_mode='centralized' is not supported yet"),
        (dict(preference_num_candidates=1), r"preference_num_candidates must be >= 2, got 1 \(MADPOConfig.num_generations"),
        (dict(reference_kl_enabled=True), "a second KL penalty is not supported"),
        (dict(dpo_reference="none", reference_model="x"), "need dpo_reference='initial'"),
    ]:
        with pytest.raises(ValueError, match=message):
            MADPOConfig(**bad)


# ----- the trainer -------------------------------------------------------------------------------
def build(model: str, **options) -> MADPOTrainer:
    return MADPOTrainer(agent_model=model, reward_func=letters_reward, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                        args=MADPOConfig(**{**TINY, **options}))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_reference_is_the_initial_policy(tiny_llama, tiny_llama_b, lora):
    """With the frozen reference every first-step ratio is 1: the loss is exactly log 2, whatever the pairs."""
    trainer = build(tiny_llama, lora_rank=2 if lora else None, num_train_epochs=1)
    assert [r.kind for r in trainer.references] == (["adapters_off"] * 2 if lora else ["copy"] * 2)
    assert set(trainer.checkpoint_modules()) == {"agent_0", "agent_1"}  # the references are never checkpointed
    first = trainer.train_step([{"prompt": p} for p in PROMPTS[:2]])
    assert first["dpo/pairs"] > 0
    assert first["dpo/loss"] == pytest.approx(math.log(2.0), abs=1e-6) and first["dpo/accuracy"] == 0.5
    given = build(tiny_llama, reference_model=tiny_llama_b, num_train_epochs=1)  # an SFT model as the reference
    assert [r.kind for r in given.references] == ["source"] * 2
    raw = build(tiny_llama, dpo_reference="none", num_train_epochs=1)
    assert raw.references is None
    assert raw.train_step([{"prompt": p} for p in PROMPTS[:2]])["dpo/loss"] != pytest.approx(math.log(2.0), abs=1e-3)


def test_the_first_step_is_neutral_under_mixed_precision(tiny_llama):
    """Under bf16-mixed the policy's log-probabilities run under the same autocast as the reference's, so the
    first step's ratios are exactly 1 again (a policy pass in fp32 against a bf16 reference would not be)."""
    trainer = build(tiny_llama, precision="bf16-mixed", num_train_epochs=1)
    first = trainer.train_step([{"prompt": p} for p in PROMPTS[:2]])
    assert first["dpo/pairs"] > 0
    assert first["dpo/loss"] == pytest.approx(math.log(2.0), abs=1e-6) and first["dpo/accuracy"] == 0.5


def test_a_batch_without_pairs_reports_no_loss_and_still_counts_a_micro_batch(tiny_llama):
    """Equal rewards give no pair: the step reports no DPO loss (not log 2 on a phantom pair), makes no gradient,
    and each agent's accumulation window still counts the micro-batch (data-parallel processes must agree on
    when to step)."""
    trainer = build(tiny_llama, num_train_epochs=1, gradient_accumulation_steps=2)
    rollout = trainer.rollout([{"prompt": p} for p in PROMPTS[:2]])
    pairs = trainer.select_pairs([torch.full((2, TINY["num_generations"]), 0.5)])
    assert pairs == [[], []]
    metrics = trainer.update(rollout, pairs)
    assert metrics["dpo/pairs"] == 0.0
    for key in ("dpo/loss", "dpo/accuracy", "dpo/margin", "agent_0/loss", "agent_1/loss"):
        assert key not in metrics or math.isnan(metrics[key]), (key, metrics[key])  # no value for no pairs
    assert all(c.pending == 1 for c in trainer.model_optimizers.values())
    assert all(p.grad is None for agent in trainer.agents for p in agent.parameters())


def test_every_agent_backpropagates_the_joint_loss(tiny_llama):
    """Each agent's loss is the joint one, -log sigmoid(beta * sum_b delta_b), with the other agents' terms
    detached: not its own -log sigmoid(beta * delta_a). Without a reference every delta_b differs from 0 at the
    first step (with the initial-weights reference they are all 0 and any coupling gives log 2), so the two
    agents' own DPO losses would differ from each other and from the joint loss. The gradient itself is checked
    against the maths in tests/test_trainer_maths.py."""
    trainer = build(tiny_llama, dpo_reference="none", dpo_beta=0.5, num_train_epochs=1)
    metrics = trainer.train_step([{"prompt": p} for p in PROMPTS[:2]])
    assert metrics["dpo/pairs"] > 0
    joint = metrics["dpo/loss"]  # -log sigmoid(beta * joint difference), averaged over the pairs
    assert abs(joint - math.log(2.0)) > 1e-3  # the differences are not 0, so the coupling shows
    for agent in range(2):
        assert metrics[f"agent_{agent}/loss"] == pytest.approx(joint, rel=1e-5), agent


def test_resume_equals_uninterrupted_and_save_model_layout(tiny_llama, tmp_path):
    options = dict(num_train_epochs=2, pair_selection="random", gradient_accumulation_steps=3)
    straight = build(tiny_llama, **options)
    straight.train(checkpoint_dir=tmp_path / "run", checkpoint_interval=1)
    resumed = build(tiny_llama, **options)
    resumed.train(resume_from_checkpoint=tmp_path / "run" / "checkpoint-1", checkpoint_dir=tmp_path / "resumed")
    for a, b in zip(straight.agents, resumed.agents):
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert [s["dpo/loss"] for s in straight.state.history] == [s["dpo/loss"] for s in resumed.state.history]
    assert all(c.pending == 0 for c in straight.model_optimizers.values())  # every epoch flushed its window
    out = straight.save_model(tmp_path / "export")
    for i in range(2):
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (out / f"agent_{i}").iterdir()}
        loaded = AutoModelForCausalLM.from_pretrained(out / f"agent_{i}")
        assert all(torch.equal(x, y) for x, y in zip(loaded.state_dict().values(), straight.agents[i].state_dict().values()))


def test_madpo_learns_letters(tiny_llama):
    """Letters, seed 0: 2 epochs of 8 steps (4 prompts x 4 joint candidates each); the held-out reward
    (8 unseen prompts x 8 samples) rises by at least 0.1 (measured: 0.097 -> 0.49)."""
    data = rows(48)
    trainer = MADPOTrainer(
        agent_model=tiny_llama, reward_func=letters_reward, train_dataset=Dataset.from_list(data[:32]),
        eval_dataset=Dataset.from_list(data[40:48]),
        args=MADPOConfig(num_agents=2, num_generations=4, max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=None,
                         agent_learning_rate=1e-2, num_train_epochs=2, per_device_train_batch_size=4, eval_num_samples=8, disable_tqdm=True,
                         seed=0))
    before = trainer.evaluate()["eval/reward_mean"]
    trainer.train()
    after = trainer.evaluate()["eval/reward_mean"]
    assert after >= before + 0.1, f"held-out reward {before:.3f} -> {after:.3f}"
