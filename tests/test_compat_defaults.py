"""Defaults: comlrl 1.4.3's, config by config, and only the exceptions docs/migrating.md lists ("Defaults").

The expected values are the original's dataclass defaults (written out here, read from its source),
so code that relies on a default trains as it did there.
"""

from __future__ import annotations

import pytest
from datasets import Dataset

import comlrl.trainers as T

SAMPLING = dict(max_new_tokens=256, temperature=0.6, top_p=0.6, discount=1.0, agent_learning_rate=5e-6)
ORIGINAL = {
    "MAGRPOConfig": dict(SAMPLING, top_k=50, num_train_epochs=20, num_generations=4, joint_mode="aligned",
                         normalize_advantages=True, advantage_mode="mean", reference_kl_enabled=False,
                         reference_kl_coef=0.1, eval_num_samples=4, num_agents=2),
    "MAREINFORCEConfig": dict(SAMPLING, top_k=50, num_train_epochs=20, advantage_mode="raw"),
    "MAReMaxConfig": dict(SAMPLING, top_k=50, num_train_epochs=20, advantage_mode="max"),
    "MARLOOConfig": dict(SAMPLING, top_k=50, num_train_epochs=20, advantage_mode="rloo"),
    "CentralizedMAGRPOConfig": dict(SAMPLING, top_k=50, num_train_epochs=20, collaboration_mode="centralized"),
    "IACConfig": dict(SAMPLING, top_k=None, num_train_epochs=40, critic_learning_rate=5e-6, value_clip_range=0.2,
                      value_loss_coef=0.6, use_separate_critic=True, critic_type="v", normalize_advantages=True),
    "MAACConfig": dict(SAMPLING, top_k=None, num_train_epochs=40, critic_learning_rate=5e-6, value_loss_coef=0.6,
                       critic_type="v"),
    "MARLHFConfig": dict(SAMPLING, top_k=50, num_train_epochs=20, num_turns=1, reward_learning_rate=1e-5,
                         critic_learning_rate=5e-6, value_loss_coef=0.6, value_clip_range=0.2, rl_algorithm="magrpo",
                         num_generations=4, reward_model_device="cuda:0", pair_selection="reward_gap", dpo_beta=0.1),
    "MARLHFIterConfig": dict(SAMPLING, top_k=50, num_train_epochs=2, num_iterations=6, reward_learning_rate=1e-5,
                             pair_selection="comparator_reward", comparator_policy="current"),
    "MADPOConfig": dict(SAMPLING, top_k=50, num_train_epochs=20, num_turns=1, pair_selection="reward_gap"),
    "MADPOIterConfig": dict(SAMPLING, top_k=50, num_iterations=6, pair_selection="comparator_reward"),
}
# docs/migrating.md, "Defaults": the listed exceptions and their values here.
EXCEPTIONS = {
    "MAGRPOConfig": dict(num_turns=1, early_termination_threshold=None, logging_steps=1, eval_interval=None,
                         max_grad_norm=1.0),
    "IACConfig": dict(num_turns=1, num_generations=4, eval_interval=None),
    "MAACConfig": dict(num_turns=1, num_generations=4, eval_interval=None),
    "MAREINFORCEConfig": dict(normalize_advantages=False),
    "MARLHFConfig": dict(preference_num_generations=None, max_pairs_per_prompt=None, reward_train_epochs=3,
                         reward_batch_size=8),
    "MADPOConfig": dict(num_generations=8, max_pairs_per_prompt=4),
}


@pytest.mark.parametrize("name", sorted(ORIGINAL))
def test_defaults_are_the_originals(name):
    config = getattr(T, name)()
    seen = {field: getattr(config, field) for field in ORIGINAL[name]}
    assert seen == ORIGINAL[name]


@pytest.mark.parametrize("name", sorted(EXCEPTIONS))
def test_only_the_listed_exceptions_differ(name):
    config = getattr(T, name)()
    assert {field: getattr(config, field) for field in EXCEPTIONS[name]} == EXCEPTIONS[name]


def test_multi_turn_ac_defaults_to_chains():
    assert T.IACConfig(num_turns=2).num_generations == 1  # the original's default case: 2 turns, 1 generation


def test_a_transition_with_num_turns_left_at_its_default_is_refused(tiny_llama):
    def transition(prompt, agent_completions, num_agents, **_):
        return [prompt] * num_agents

    data = dict(reward_func=lambda c0, c1: [0.0] * len(c0), train_dataset=Dataset.from_dict({"prompt": ["a b"]}))
    with pytest.raises(ValueError, match="num_turns was left at its default, 1, so the transition would never run"):
        T.MAGRPOTrainer(agent_model=tiny_llama, external_transition=transition, args=T.MAGRPOConfig(), **data)
    explicit = T.MAGRPOTrainer(agent_model=tiny_llama, external_transition=transition,
                               args=T.MAGRPOConfig(num_turns=1, max_new_tokens=4), **data)
    assert explicit.args.num_turns == 1  # chosen, not defaulted: accepted
