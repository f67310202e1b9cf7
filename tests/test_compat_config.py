"""Configs written for the original comlrl 1.4.3: aliases, accepted-but-not-supported fields, MARLHFIterConfig."""

from __future__ import annotations

import dataclasses

import pytest

from comlrl.trainers import IACConfig, MAACConfig, MAGRPOConfig, MARLHFConfig, MARLHFIterConfig

ALIASES = [
    (MAGRPOConfig, "advantage_normalization", "normalize_advantages", False),
    (IACConfig, "advantage_normalization", "normalize_advantages", False),
    (MAACConfig, "advantage_normalization", "normalize_advantages", False),
    (MARLHFConfig, "reward_num_train_epochs", "reward_train_epochs", 2),
    (MARLHFConfig, "reward_train_batch_size", "reward_batch_size", 4),
    (MARLHFConfig, "preference_num_candidates", "preference_num_generations", 20),
    (MARLHFConfig, "preference_pairs_per_sample", "max_pairs_per_prompt", 4),
    (MARLHFConfig, "critic_devices", "critic_device", "cpu"),
    (IACConfig, "critic_devices", "critic_device", "cpu"),
    (MAGRPOConfig, "agent_devices", "device", "cpu"),
]


@pytest.mark.parametrize("cls, alias, canonical, value", ALIASES)
def test_alias_sets_canonical_field(cls, alias, canonical, value):
    config = cls(**{alias: value})
    assert getattr(config, canonical) == value
    names = {f.name for f in dataclasses.fields(cls)}
    assert alias not in names and alias not in config.to_dict()
    assert alias not in cls.help() and alias in cls.help()[canonical]
    assert getattr(cls(**{alias: value, canonical: value}), canonical) == value  # same value: fine


@pytest.mark.parametrize("cls, alias, canonical, value", ALIASES)
def test_alias_conflict_raises(cls, alias, canonical, value):
    other = {False: True, 2: 5, 4: 6, 20: 8, "cpu": "auto" if canonical == "device" else ["cpu"]}[value]
    with pytest.raises(ValueError) as info:
        cls(**{alias: value, canonical: other})
    assert alias in str(info.value) and canonical in str(info.value)


def test_alias_value_is_validated_and_bool_is_not_int():
    with pytest.raises(ValueError, match="reward_train_epochs"):
        MARLHFConfig(reward_num_train_epochs=0)
    with pytest.raises(ValueError, match="disagree"):
        MARLHFConfig(reward_num_train_epochs=1, reward_train_epochs=True)


def test_alias_none_keeps_default_where_field_takes_no_none():
    assert MAGRPOConfig(agent_devices=None).device == "auto"
    assert IACConfig(critic_devices=None).critic_device is None


def test_dataclasses_replace_and_unknown_keyword():
    config = dataclasses.replace(MAGRPOConfig(), normalize_advantages=False)
    assert config.normalize_advantages is False
    with pytest.raises(TypeError):
        MAGRPOConfig(no_such_field=1)


# (class, field, the original's default, a value we refuse)
NOT_SUPPORTED = [
    (MAGRPOConfig, "eval_batch_size", 1, 4),
    (IACConfig, "eval_batch_size", 1, 2),
    (MARLHFConfig, "collaboration_mode", "decentralized", "centralized"),
    (MARLHFConfig, "dpo_beta", 0.1, 0.2),
    (MARLHFConfig, "use_environment_step", True, False),
    (MARLHFConfig, "environment_steps_per_pair", 2, 3),
    (MARLHFIterConfig, "preference_scoring_reward", "task", "reward_model"),
]


@pytest.mark.parametrize("cls, name, default, refused", NOT_SUPPORTED)
def test_not_supported_yet_accepts_default_and_refuses_others(cls, name, default, refused):
    assert getattr(cls(**{name: default}), name) == default
    with pytest.raises(ValueError, match=rf"{name}={refused!r} is not supported yet"):
        cls(**{name: refused})


def test_early_termination_threshold_is_accepted_with_any_number_of_turns():
    assert MAGRPOConfig(early_termination_threshold=-0.2).early_termination_threshold == -0.2  # one turn: no effect
    assert MAGRPOConfig(num_turns=2).early_termination_threshold is None  # off unless set (docs/migrating.md)
    assert MAGRPOConfig(num_turns=2, early_termination_threshold=-0.2).early_termination_threshold == -0.2
    assert IACConfig(num_turns=2, early_termination_threshold=0.5).early_termination_threshold == 0.5


def test_rollout_buffer_and_train_batch_size_only_when_equivalent():
    config = MAGRPOConfig(per_device_train_batch_size=2, rollout_buffer_size=2, train_batch_size=2)
    assert config.rollout_buffer_size == 2
    assert IACConfig(per_device_train_batch_size=2, num_generations=4, rollout_buffer_size=8).rollout_buffer_size == 8
    for kwargs in (dict(per_device_train_batch_size=1, rollout_buffer_size=2), dict(train_batch_size=3),
                   dict(num_turns=2, rollout_buffer_size=1, external_prompt_passthrough=False)):
        field = "rollout_buffer_size" if "rollout_buffer_size" in kwargs else "train_batch_size"
        with pytest.raises(ValueError, match=rf"MAGRPOConfig\.{field}=\d is not supported yet"):
            MAGRPOConfig(**kwargs)
    with pytest.raises(ValueError, match="rollout_buffer_size=8 is not supported yet"):
        MAACConfig(per_device_train_batch_size=1, rollout_buffer_size=8)  # 4 samples per update here
    # Given alone, the buffer sets the batch (tests/test_default_batching.py): 8 completions = 2 prompts x 4.
    assert MAACConfig(rollout_buffer_size=8).per_device_train_batch_size == 2


def test_parallel_training_accepts_original_values():
    assert MAGRPOConfig(parallel_training="mp", agent_devices=["cpu", "cpu"]).device == ["cpu", "cpu"]
    with pytest.raises(ValueError, match="parallel_training only supports: none, mp"):
        MAGRPOConfig(parallel_training="ddp")


@pytest.mark.parametrize("written", ["null", "Null", " NULL ", None, "None", "NONE", " none"])
@pytest.mark.parametrize("cls, devices", [(MAGRPOConfig, {"agent_devices": "cpu"}),
                                          (MAACConfig, {"agent_devices": "cpu", "critic_devices": "cpu"}),
                                          (IACConfig, {"agent_devices": "cpu", "critic_devices": "cpu"})])
def test_parallel_training_off_as_the_original_configs_write_it(cls, devices, written):
    """comlrl 1.4.3's YAML configs write ``parallel_training: null`` for "off" (YAML reads it as None, a string
    template as "null"); its trainers read any case. A config copied from there constructs and means "none"."""
    assert cls(parallel_training=written).parallel_training == "none"
    assert cls(parallel_training=" MP ", **devices).parallel_training == "mp"


def test_critic_learning_rate_none_follows_agent_learning_rate():
    assert IACConfig(agent_learning_rate=1e-5, critic_learning_rate=None).critic_learning_rate == 1e-5
    assert MARLHFConfig(agent_learning_rate=1e-5, critic_learning_rate=None).critic_learning_rate == 1e-5
    assert MAACConfig().critic_learning_rate == 5e-6


def test_marlhf_critic_fields_reach_the_policy_config_and_conflicts_raise():
    from comlrl.trainers.preference.policy import policy_config

    args = MARLHFConfig(rl_algorithm="iac", critic_type="v", value_loss_coef=0.6, value_clip_range=0.2,
                        critic_learning_rate=1e-5)
    config = policy_config(args, IACConfig)
    assert (config.value_loss_coef, config.value_clip_range, config.critic_learning_rate) == (0.6, 0.2, 1e-5)
    assert policy_config(MARLHFConfig(rl_algorithm="iac"), IACConfig).value_loss_coef == IACConfig().value_loss_coef
    with pytest.raises(ValueError, match="value_loss_coef"):
        MARLHFConfig(value_loss_coef=0.5, policy_overrides={"value_loss_coef": 0.7})


def test_pair_selection_all_needs_no_pair_limit():
    assert MARLHFConfig(pair_selection="all").max_pairs_per_prompt is None
    with pytest.raises(ValueError, match="pair_selection='all'"):
        MARLHFConfig(pair_selection="all", preference_pairs_per_sample=4)


def test_marlhf_iter_config_is_a_marlhf_config_the_iter_trainer_accepts():
    import comlrl.trainers as trainers
    from comlrl.trainers.preference import MARLHFIterConfig as exported
    from comlrl.trainers.preference import MARLHFIterTrainer

    assert trainers.MARLHFIterConfig is exported is MARLHFIterConfig
    config = MARLHFIterConfig(num_iterations=3, pool_preference_pairs=True, reward_num_train_epochs=2)
    assert isinstance(config, MARLHFConfig) and isinstance(config, MARLHFIterTrainer.config_class)
    assert config.num_iterations == 3 and config.reward_train_epochs == 2
