"""The REINFORCE family (advantage modes), loss normalisations and the reference-model KL.

Pure functions against hand-computed numbers; the trainers' wiring on fixed rewards; the reference KL
on real tiny models: 0 at the first step, growing as the policy moves, smaller with a larger
coefficient, and held without a second copy of the weights under LoRA. Learning tests of the family
are in test_learning.py, resume and LR-plan cells in test_matrix.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset

from comlrl.algorithms.advantages import baseline_advantages, group_relative_advantages
from comlrl.algorithms.kl import k3_token_kl, kl_shaped_rewards, sequence_kl
from comlrl.algorithms.losses import aggregate_token_losses, loss_normaliser
from comlrl.tasks.letters import letters_reward, rows

NAN = float("nan")


# ----- advantage modes ------------------------------------------------------------------------------
def test_each_mode_by_hand():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 6.0]])
    assert baseline_advantages(rewards, "raw", normalize=False).tolist() == [[1.0, 2.0, 3.0, 6.0]]
    assert baseline_advantages(rewards, "max", normalize=False).tolist() == [[-5.0, -4.0, -3.0, 0.0]]
    assert baseline_advantages(rewards, "mean", normalize=False).tolist() == [[-2.0, -1.0, 0.0, 3.0]]
    # leave-one-out: 1 - (2+3+6)/3, 2 - (1+3+6)/3, 3 - (1+2+6)/3, 6 - (1+2+3)/3
    assert baseline_advantages(rewards, "rloo", normalize=False)[0].tolist() == pytest.approx(
        [1 - 11 / 3, 2 - 10 / 3, 0.0, 4.0])


def test_normalising_scales_by_the_group_std_and_never_recentres():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 6.0]])
    std = math.sqrt(14 / 3)  # sample std of 1, 2, 3, 6
    for mode, raw in (("raw", [1, 2, 3, 6]), ("max", [-5, -4, -3, 0]), ("rloo", [1 - 11 / 3, 2 - 10 / 3, 0, 4])):
        scaled = baseline_advantages(rewards, mode, normalize=True)[0]
        assert scaled.tolist() == pytest.approx([x / (std + 1e-6) for x in raw], rel=1e-6), mode
    # The original comlrl re-centred after the baseline, which made every mode equal to 'mean'; here they differ.
    mean = baseline_advantages(rewards, "mean", normalize=True)
    for mode in ("raw", "max", "rloo"):
        assert not torch.allclose(baseline_advantages(rewards, mode, normalize=True), mean), mode
    assert torch.equal(mean, group_relative_advantages(rewards, normalize=True))


def test_constant_group_and_dropped_samples():
    constant = torch.tensor([[2.0, 2.0, 2.0]])
    assert baseline_advantages(constant, "raw", normalize=True).tolist() == [[2.0, 2.0, 2.0]]  # std 0: unscaled
    assert baseline_advantages(constant, "max", normalize=True).tolist() == [[0.0, 0.0, 0.0]]
    dropped = torch.tensor([[1.0, NAN, 3.0], [5.0, NAN, NAN]])
    assert baseline_advantages(dropped, "rloo", normalize=False).tolist() == [[-2.0, 0.0, 2.0], [0.0, 0.0, 0.0]]
    assert baseline_advantages(dropped, "max", normalize=False).tolist() == [[-2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert baseline_advantages(dropped, "raw", normalize=False).tolist() == [[1.0, 0.0, 3.0], [5.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="advantage_mode must be one of"):
        baseline_advantages(constant, "median")


# ----- KL and losses --------------------------------------------------------------------------------
def test_k3_estimator_by_hand():
    policy = torch.tensor([[-1.0, -2.0, -0.5]])
    reference = torch.tensor([[-2.0, -1.0, -0.5]])
    # d = ref - policy = -1, 1, 0 -> e^d - d - 1
    expected = [math.exp(-1) + 1 - 1, math.exp(1) - 1 - 1, 0.0]
    assert k3_token_kl(policy, reference)[0].tolist() == pytest.approx(expected)
    mask = torch.tensor([[1, 1, 0]])
    assert sequence_kl(k3_token_kl(policy, reference), mask).tolist() == pytest.approx([expected[0] + expected[1]])
    assert kl_shaped_rewards(torch.tensor([1.0, NAN]), torch.tensor([0.5, 0.5]), 0.2)[0].item() == pytest.approx(0.9)
    assert math.isnan(kl_shaped_rewards(torch.tensor([1.0, NAN]), torch.tensor([0.5, 0.5]), 0.2)[1].item())


def test_loss_types_by_hand():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert aggregate_token_losses(per_token, mask, "grpo", loss_normaliser("grpo", 2, 5, None)).item() == 3.25
    for token_level in ("bnpo", "dapo"):  # (1 + 2 + 4 + 5 + 6) / 5 tokens
        assert aggregate_token_losses(per_token, mask, token_level,
                                      loss_normaliser(token_level, 2, 5, None)).item() == pytest.approx(3.6)
    assert aggregate_token_losses(per_token, mask, "dr_grpo", loss_normaliser("dr_grpo", 2, 5, 4)).item() == 18 / 8
    with pytest.raises(ValueError, match="max_completion_length"):
        loss_normaliser("dr_grpo", 2, 5, None)


# ----- the trainers ------------------------------------------------------------------------------------
def test_family_is_exported_under_the_original_names():
    import comlrl.trainers as trainers
    import comlrl.trainers.reinforce as reinforce
    from comlrl.trainers.algorithms import ALGORITHMS

    for name, mode in (("MAREINFORCE", "raw"), ("MAReMax", "max"), ("MARLOO", "rloo")):
        config = getattr(trainers, f"{name}Config")()
        assert config.advantage_mode == mode and config.normalize_advantages is False
        assert getattr(reinforce, f"{name}Trainer").config_class is getattr(reinforce, f"{name}Config")
        trainer_class, config_class = ALGORITHMS[name.lower()].load()
        assert trainer_class is getattr(trainers, f"{name}Trainer") and config_class is type(config)
    assert trainers.MAREINFORCEConfig(num_generations=1).num_generations == 1  # no baseline, no group needed
    with pytest.raises(ValueError, match="MAReMaxConfig.num_generations must be >= 2 for the 'max'"):
        trainers.MAReMaxConfig(num_generations=1)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        trainers.MAGRPOConfig(loss_type="token")


def build(model, kind="magrpo", **config):
    from comlrl.trainers import reinforce

    name = {"magrpo": "MAGRPO", "mareinforce": "MAREINFORCE", "maremax": "MAReMax", "marloo": "MARLOO"}[kind]
    settings = dict(num_agents=2, num_generations=4, max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=None,
                    num_train_epochs=1, agent_learning_rate=3e-3,
                    per_device_train_batch_size=2, disable_tqdm=True, seed=5)
    settings.update(config)
    return getattr(reinforce, f"{name}Trainer")(
        agent_model=model, reward_func=letters_reward, train_dataset=Dataset.from_list(rows(8)),
        args=getattr(reinforce, f"{name}Config")(**settings))


# Per prompt (one row each) the rewards 0.1 0.4 0.2 0.9 and 0.5 0.5 0.3 0.0; each mode's advantages by hand.
FAMILY_REWARDS = [[0.1, 0.4, 0.2, 0.9], [0.5, 0.5, 0.3, 0.0]]
BY_HAND = {
    "raw": [0.1, 0.4, 0.2, 0.9, 0.5, 0.5, 0.3, 0.0],
    # the group's best, 0.9 and 0.5
    "max": [-0.8, -0.5, -0.7, 0.0, 0.0, 0.0, -0.2, -0.5],
    # the mean of the 3 others: (0.4 + 0.2 + 0.9) / 3 = 0.5, ...; (0.5 + 0.3 + 0.0) / 3 = 0.8 / 3, ...
    "rloo": [0.1 - 0.5, 0.4 - 0.4, 0.2 - 1.4 / 3, 0.9 - 0.7 / 3, 0.5 - 0.8 / 3, 0.5 - 0.8 / 3, 0.3 - 1.0 / 3,
             0.0 - 1.3 / 3],
}
# The groups' sample stds: deviations from 0.4 are -0.3 0 -0.2 0.5 (squares 0.38); from 0.325 they are 0.175 0.175
# -0.025 -0.325 (squares 0.1675); each over n - 1 = 3.
GROUP_STDS = [(0.38 / 3) ** 0.5] * 4 + [(0.1675 / 3) ** 0.5] * 4


@pytest.mark.parametrize("normalize", [False, True], ids=["raw_scale", "normalized"])
@pytest.mark.parametrize("kind, mode", [("mareinforce", "raw"), ("maremax", "max"), ("marloo", "rloo")])
def test_trainer_advantages_use_its_mode(kind, mode, normalize, tiny_llama):
    trainer = build(tiny_llama, kind, normalize_advantages=normalize)
    advantages = trainer.advantages([torch.tensor(FAMILY_REWARDS)])
    expected = [a / (std + 1e-6) if normalize else a for a, std in zip(BY_HAND[mode], GROUP_STDS)]
    for agent in range(2):  # aligned joints: every agent's completion g gets joint sample g's advantage
        assert advantages[agent][0].tolist() == pytest.approx(expected, abs=1e-6), (agent, mode)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("mode", ["reward", "loss"])
def test_reference_kl_starts_at_zero_and_grows(mode, lora, tiny_llama):
    trainer = build(tiny_llama, reference_kl_enabled=True, reference_kl_mode=mode, lora_rank=2 if lora else None,
                    num_train_epochs=2)
    initial = {name: p.detach().clone() for name, p in trainer.agents[0].named_parameters()}
    trainer.train()
    kls = [step["reference_kl_mean"] for step in trainer.state.history]
    assert kls[0] == 0.0 and all(step["agent_0/reference_kl"] >= 0 for step in trainer.state.history)
    assert kls[-1] > 1e-3 and max(kls[1:]) > kls[0], kls
    assert trainer.state.history[-1]["reference_kl_penalty_mean"] == pytest.approx(0.1 * kls[-1])
    reference = trainer.references[0]
    if lora:  # the base with adapters off: no second copy of the weights
        assert reference.model is trainer.agents[0] and reference.kind == "adapters_off"
    else:  # a frozen copy of the initial weights, untouched by training
        assert reference.kind == "copy" and reference.model is not trainer.agents[0]
        ref_params = dict(reference.model.named_parameters())
        assert all(torch.equal(ref_params[name], value) for name, value in initial.items())
        assert not any(p.requires_grad for p in reference.model.parameters())


@pytest.mark.parametrize("mode, coef, seeds, ratio", [("loss", 1.0, (5, 6), 0.5), ("reward", 2.0, (5, 6, 7), 0.8)])
def test_reference_kl_coefficient_keeps_the_policy_closer(mode, coef, seeds, ratio, tiny_llama):
    """Same seeds, same data: the penalised runs stay measurably nearer their reference than unpenalised ones.

    Measured (mean KL over the run, penalised / unpenalised): loss mode 0.19, 0.16 (seed 7: 0.18);
    reward mode 0.47, 0.72, 0.61 (0.62 over the three)."""
    mean_kl = {}
    for value in (0.0, coef):
        total = 0.0
        for seed in seeds:
            trainer = build(tiny_llama, reference_kl_enabled=True, reference_kl_mode=mode, reference_kl_coef=value,
                            normalize_advantages=False, num_train_epochs=3, agent_learning_rate=1e-2, seed=seed)
            trainer.train()
            total += sum(step["reference_kl_mean"] for step in trainer.state.history) / len(trainer.state.history)
        mean_kl[value] = total / len(seeds)
    assert mean_kl[coef] < ratio * mean_kl[0.0], mean_kl


def test_reference_model_given_by_source(tiny_llama, tiny_llama_b):
    trainer = build(tiny_llama, reference_kl_enabled=True, reference_model=tiny_llama_b)
    assert trainer.references[0].kind == "source"
    terms = trainer.reference(trainer.rollout(rows(2)))
    assert terms.mean_kl() > 0  # another model's weights: not the policy
    with pytest.raises(ValueError, match="reference_model lists 3 models for num_agents=2"):
        build(tiny_llama, reference_kl_enabled=True, reference_model=[tiny_llama] * 3)


def test_collaboration_mode_points_to_the_centralized_trainer():
    from comlrl.trainers import CentralizedMAGRPOConfig, MAGRPOConfig

    assert MAGRPOConfig().collaboration_mode == "decentralized"
    assert CentralizedMAGRPOConfig().collaboration_mode == "centralized"
    with pytest.raises(ValueError, match="collaboration_mode='centralized'.*CentralizedMAGRPOConfig"):
        MAGRPOConfig(collaboration_mode="centralized")


def test_marlhf_policy_stage_carries_the_reference_kl(tiny_llama):
    from comlrl.trainers.preference import MARLHFConfig, MARLHFTrainer

    trainer = MARLHFTrainer(agent_model=tiny_llama, reward_func=letters_reward, train_dataset=Dataset.from_list(rows(4)),
                            args=MARLHFConfig(num_agents=2, num_generations=2, max_new_tokens=4, reward_model_device=None,
                                              preference_num_generations=4, reward_train_epochs=1, disable_tqdm=True,
                                              per_device_train_batch_size=2, reference_kl_enabled=True,
                                              reference_kl_mode="loss", agent_learning_rate=1e-2))
    trainer.train()
    assert trainer.policy_trainer.references is not None
    kls = [step["reference_kl_mean"] for step in trainer.state.history if "reference_kl_mean" in step]
    assert kls and kls[0] == 0.0 and max(kls) > 0.0, kls


def test_checkpoints_never_hold_the_reference(tiny_llama, tmp_path):
    """The reference is rebuilt from the trainer's sources at construction; a checkpoint saves only trained models."""
    trainer = build(tiny_llama, reference_kl_enabled=True)
    trainer.train(checkpoint_dir=tmp_path, checkpoint_interval=1)
    checkpoint = tmp_path / "checkpoint-1"
    saved = sorted(p.stem for p in (checkpoint / "models").glob("*.safetensors"))
    assert saved == ["agent_0", "agent_1"]
    state = torch.load(checkpoint / "state.pt", weights_only=True)

    def keys(value, prefix=""):
        if isinstance(value, dict):
            for key, item in value.items():
                yield f"{prefix}{key}"
                yield from keys(item, f"{prefix}{key}.")

    assert not [key for key in keys(state) if "reference" in key.lower()]
    resumed = build(tiny_llama, reference_kl_enabled=True)
    initial = {name: p.detach().clone() for name, p in resumed.agents[0].named_parameters()}
    resumed.train(resume_from_checkpoint=checkpoint)
    reference = dict(resumed.references[0].model.named_parameters())
    assert all(torch.equal(reference[name], value) for name, value in initial.items())  # initial weights, not checkpoint's
