"""Errors keep comlrl 1.4.3's words: code that catches the original's errors by message still matches.

Each row: the original's phrase (its message without the trailing period), the call that breaks the
same rule here, and the exception type both raise. Ours may add the field, the values and the fix
after the phrase. Config rows fail at construction; trainer rows fail before any model loads except
where the rule is about training itself.
"""

from __future__ import annotations

import re
import warnings
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from comlrl import utils
from comlrl.trainers import (
    CentralizedMAGRPOConfig,
    CentralizedMAGRPOTrainer,
    IACConfig,
    IACTrainer,
    MAACConfig,
    MAACTrainer,
    MADPOConfig,
    MADPOIterConfig,
    MAGRPOConfig,
    MAGRPOTrainer,
    MARLHFConfig,
    MARLHFIterConfig,
)

# (original phrase, config class, settings)
CONFIG_ROWS = [
    ("num_train_epochs must be >= 1", MAGRPOConfig, dict(num_train_epochs=0)),
    ("num_agents must be >= 1", MAGRPOConfig, dict(num_agents=0)),
    ("num_generations must be >= 2", MAGRPOConfig, dict(num_generations=1)),
    ("rollout_buffer_size must be >= 1", MAGRPOConfig, dict(rollout_buffer_size=0)),
    ("eval_interval must be >= 0", MAGRPOConfig, dict(eval_interval=-1)),
    ("eval_num_samples must be >= 0", MAGRPOConfig, dict(eval_num_samples=-1)),
    ("eval_batch_size must be >= 1", MAGRPOConfig, dict(eval_batch_size=0)),
    ("num_turns must be >= 1", MAGRPOConfig, dict(num_turns=0)),
    ("logging_steps must be >= 1", MAGRPOConfig, dict(logging_steps=0)),
    ("train_batch_size must be >= 1", MAGRPOConfig, dict(train_batch_size=0)),
    ("advantage_mode must be one of: mean, raw, max, rloo", MAGRPOConfig, dict(advantage_mode="median")),
    ("parallel_training only supports: none, mp", MAGRPOConfig, dict(parallel_training="dp")),
    ("parallel_training='mp' requires explicit agent_devices", MAGRPOConfig, dict(parallel_training="mp")),
    ("agent_devices length (3) must be 1 or 2", MAGRPOConfig, dict(agent_devices=["cpu", "cpu", "cpu"])),
    ("reference_kl_coef must be >= 0", MAGRPOConfig, dict(reference_kl_coef=-0.1)),
    ("reference_devices length (3) must be 1 or 2", MAGRPOConfig,
     dict(reference_kl_enabled=True, reference_devices=["cpu", "cpu", "cpu"])),
    ("num_generations must be >= 1", MAACConfig, dict(num_generations=0)),
    ("Multi-turn MAAC currently supports num_generations == 1", MAACConfig, dict(num_turns=2, num_generations=2)),
    ("Multi-turn IAC currently supports num_generations == 1", IACConfig, dict(num_turns=2, num_generations=2)),
    ("critic_type must be one of: 'v', 'q'", MAACConfig, dict(critic_type="x")),
    ("critic_type must be one of: 'v', 'q'", IACConfig, dict(critic_type="x")),
    ("parallel_training='mp' requires explicit agent_devices", MAACConfig, dict(parallel_training="mp")),
    ("parallel_training='mp' requires explicit critic_devices", MAACConfig,
     dict(parallel_training="mp", agent_devices=["cpu", "cpu"])),
    ("parallel_training='mp' requires explicit critic_devices when use_separate_critic=True", IACConfig,
     dict(parallel_training="mp", agent_devices=["cpu", "cpu"])),
    ("critic_devices length (3) must be 1 or 2", IACConfig, dict(critic_devices=["cpu", "cpu", "cpu"])),
    ("rl_algorithm must be one of: magrpo, mareinforce, maremax, marloo, maac, iac", MARLHFConfig,
     dict(rl_algorithm="ppo")),
    ("num_generations must be >= 2 for MAGRPO-family MARLHF backends", MARLHFConfig, dict(num_generations=1)),
    ("reward_learning_rate must be > 0", MARLHFConfig, dict(reward_learning_rate=0.0)),
    ("reward_num_train_epochs must be >= 1", MARLHFConfig, dict(reward_num_train_epochs=0)),
    ("reward_train_batch_size must be >= 1", MARLHFConfig, dict(reward_train_batch_size=0)),
    ("reward_max_length must be >= 1 or null", MARLHFConfig, dict(reward_max_length=0)),
    ("critic_learning_rate must be > 0 or null", MARLHFConfig, dict(critic_learning_rate=0.0)),
    ("critic_type must be one of: v, q", MARLHFConfig, dict(critic_type="x")),
    ("value_loss_coef must be > 0", MARLHFConfig, dict(value_loss_coef=0.0)),
    ("value_clip_range must be > 0 or null", MARLHFConfig, dict(value_clip_range=0.0)),
    ("preference_num_candidates must be >= 2", MADPOConfig, dict(preference_num_candidates=1)),
    ("preference_num_candidates must be >= 2", MARLHFConfig, dict(preference_num_candidates=1)),
    ("preference_pairs_per_sample must be >= 1 or null", MADPOConfig, dict(preference_pairs_per_sample=0)),
    ("dpo_beta must be > 0", MADPOConfig, dict(dpo_beta=0.0)),
    ("environment_steps_per_pair must be >= 1", MADPOConfig, dict(environment_steps_per_pair=0)),
    ("pair_selection must be one of:", MADPOConfig, dict(pair_selection="best")),
    ("preference_pairs_per_sample must be null when pair_selection='all'", MADPOConfig,
     dict(pair_selection="all", preference_pairs_per_sample=2)),
    ("preference_pairs_per_sample must be null when pair_selection='all'", MARLHFConfig,
     dict(pair_selection="all", preference_pairs_per_sample=2)),
    ("MADPO currently supports num_turns=1 only", MADPOConfig, dict(num_turns=2)),
    ("collaboration_mode must be decentralized or centralized", MADPOConfig, dict(collaboration_mode="x")),
    ("num_iterations must be >= 1", MADPOIterConfig, dict(num_iterations=0)),
    ("comparator_policy must be one of: current, current_copy, model, history, api", MADPOIterConfig,
     dict(comparator_policy="x")),
    ("comparator_generation_mode must be one of: decentralized, centralized", MADPOIterConfig,
     dict(comparator_generation_mode="x")),
    ("comparator_centralized_agent_index must be >= 0", MADPOIterConfig, dict(comparator_centralized_agent_index=-1)),
    ("preference_replay_mode must be one of: current, nearest_k, all_history, lambda_decay", MADPOIterConfig,
     dict(preference_replay_mode="x")),
    ("comparator_num_candidates must be >= 1 or null", MADPOIterConfig, dict(comparator_num_candidates=0)),
    ("comparator_api_max_n_per_request must be >= 1 or null", MADPOIterConfig,
     dict(comparator_api_max_n_per_request=0)),
    ("comparator_model_name or comparator_agents is required when comparator_policy='model'", MADPOIterConfig,
     dict(comparator_policy="model")),
    ("comparator_history_k is only valid when comparator_policy='history'", MADPOIterConfig,
     dict(comparator_history_k=2)),
    ("comparator_history_k must be >= 1", MADPOIterConfig, dict(comparator_policy="history", comparator_history_k=0)),
    ("comparator_model_name and comparator_agents are only valid when comparator_policy='model'", MADPOIterConfig,
     dict(comparator_model_name="some/model")),
    ("comparator_api_url is required when comparator_policy='api'", MADPOIterConfig, dict(comparator_policy="api")),
    ("preference_replay_k must be null or 1 when preference_replay_mode='current'", MADPOIterConfig,
     dict(preference_replay_k=2)),
    ("preference_replay_k is required when preference_replay_mode='nearest_k'", MADPOIterConfig,
     dict(preference_replay_mode="nearest_k")),
    ("preference_replay_k must be >= 1", MADPOIterConfig, dict(preference_replay_mode="nearest_k", preference_replay_k=0)),
    ("preference_replay_k is only valid when preference_replay_mode='nearest_k'", MADPOIterConfig,
     dict(preference_replay_mode="all_history", preference_replay_k=2)),
    ("preference_replay_lambda is only valid when preference_replay_mode='lambda_decay'", MADPOIterConfig,
     dict(preference_replay_lambda=0.5)),
    ("preference_replay_lambda is required when preference_replay_mode='lambda_decay'", MADPOIterConfig,
     dict(preference_replay_mode="lambda_decay")),
    ("preference_replay_lambda must be in [0, 1]", MADPOIterConfig,
     dict(preference_replay_mode="lambda_decay", preference_replay_lambda=1.5)),
    ("preference_replay_sample_size is only valid when preference_replay_mode is 'nearest_k', 'all_history', "
     "or 'lambda_decay'", MADPOIterConfig, dict(preference_replay_sample_size=3)),
    ("preference_replay_sample_size must be >= 1 or null", MADPOIterConfig,
     dict(preference_replay_mode="all_history", preference_replay_sample_size=0)),
    ("preference_scoring_reward must be one of: task, reward_model", MARLHFIterConfig,
     dict(preference_scoring_reward="x")),
    ("CentralizedMAGRPOConfig requires centralized collaboration", CentralizedMAGRPOConfig,
     dict(collaboration_mode="decentralized")),
    ("Centralized MAGRPO currently supports num_turns=1 only", CentralizedMAGRPOConfig, dict(num_turns=2)),
]


@pytest.mark.parametrize("phrase, config_class, settings", CONFIG_ROWS,
                         ids=[f"{row[1].__name__}-{row[0][:50]}" for row in CONFIG_ROWS])
def test_config_errors_contain_the_originals_phrase(phrase, config_class, settings):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=re.escape(phrase)):
            config_class(**settings)


def test_original_values_that_pass_there_pass_here():
    """The rules above refuse what the original refuses, not more: its accepted edge values construct."""
    assert MAGRPOConfig(parallel_training="mp", agent_devices=["cpu"]).parallel_training == "mp"
    assert MAGRPOConfig(agent_devices=["cpu"]).device == ["cpu"]  # one entry places every agent
    assert MADPOIterConfig(preference_replay_k=1).preference_replay_k is None  # 'current' replay with k=1
    assert IACConfig(use_separate_critic=False, parallel_training="mp", agent_devices="cpu").critic_device is None


def _reward(completions_0, completions_1):
    return [0.0] * len(completions_0)


def _small(config_class, **fields):
    return config_class(**{"num_agents": 2, "max_new_tokens": 2, "device": "cpu", "disable_tqdm": True, **fields})


def trainer_rows(tiny_llama, train_dataset):
    """(original phrase, exception type, a call that breaks the rule) for the trainers' constructors."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    base = dict(reward_func=_reward, train_dataset=train_dataset)
    magrpo = _small(MAGRPOConfig, num_generations=2)
    maac, iac = _small(MAACConfig), _small(IACConfig)
    shared_iac = _small(IACConfig, use_separate_critic=False)
    return [
        ("Either agent_model or agents must be provided", ValueError, lambda: MAGRPOTrainer(args=magrpo, **base)),
        ("Either agent_model or agents must be provided", ValueError,
         lambda: MAACTrainer(critic_model=tiny_llama, args=maac, **base)),
        ("agents length (3) must match num_agents (2)", ValueError,
         lambda: MAGRPOTrainer(agents=[tiny_llama] * 3, args=magrpo, **base)),
        ("agent_model and agents conflict", ValueError,
         lambda: MAGRPOTrainer(agent_model="other/model", agents=[tiny_llama] * 2, args=magrpo, **base)),
        ("num_agents must match args.num_agents", ValueError,
         lambda: MAGRPOTrainer(agent_model=tiny_llama, num_agents=3, args=magrpo, **base)),
        ("reward_func must be a callable", ValueError,
         lambda: MAGRPOTrainer(agent_model=tiny_llama, args=magrpo, train_dataset=train_dataset)),
        ("reward_func must be a callable", ValueError,
         lambda: MAGRPOTrainer(agent_model=tiny_llama, args=magrpo, reward_func=5, train_dataset=train_dataset)),
        ("reward_func must be a callable", ValueError,
         lambda: IACTrainer(agent_model=tiny_llama, critic_model=tiny_llama, args=iac, train_dataset=train_dataset)),
        ("Multi-turn MAGRPO requires an external_transition", ValueError,
         lambda: MAGRPOTrainer(agent_model=tiny_llama, args=_small(MAGRPOConfig, num_generations=2, num_turns=2),
                               **base)),
        ("Multi-turn MAAC requires an external_transition", ValueError,
         lambda: MAACTrainer(agent_model=tiny_llama, critic_model=tiny_llama,
                             args=_small(MAACConfig, num_turns=2), **base)),
        ("Multi-turn IAC requires an external_transition", ValueError,
         lambda: IACTrainer(agent_model=tiny_llama, critic_model=tiny_llama,
                            args=_small(IACConfig, num_turns=2), **base)),
        ("Either critic_model or critics must be provided for MAAC", ValueError,
         lambda: MAACTrainer(agent_model=tiny_llama, args=maac, **base)),
        ("Either critic_model or critics must be provided when use_separate_critic=True", ValueError,
         lambda: IACTrainer(agent_model=tiny_llama, args=iac, **base)),
        ("critics can only be provided when use_separate_critic=True", ValueError,
         lambda: IACTrainer(agent_model=tiny_llama, critic_model=tiny_llama, args=shared_iac, **base)),
        ("critics length (1) must match num_agents (2)", ValueError,
         lambda: IACTrainer(agent_model=tiny_llama, critics=[tiny_llama], args=iac, **base)),
        ("critics length (2) must match 1 critic", ValueError,
         lambda: MAACTrainer(agent_model=tiny_llama, critics=[tiny_llama] * 2, args=maac, **base)),
        ("Tokenizer must be provided when using agents", ValueError,
         lambda: MAACTrainer(agents=[tiny_llama] * 2, critic_model=tiny_llama, args=maac, **base)),
        ("tokenizers length must match agents", ValueError,
         lambda: MAGRPOTrainer(agents=[tiny_llama] * 2, tokenizer=[tokenizer] * 3, args=magrpo, **base)),
        ("Number of formatters must match num_agents when providing a sequence", ValueError,
         lambda: MAGRPOTrainer(agent_model=tiny_llama, formatters=[str], args=magrpo, **base)),
        ("formatters must be None, a callable, or a sequence of callables", ValueError,
         lambda: MAGRPOTrainer(agent_model=tiny_llama, formatters=5, args=magrpo, **base)),
        ("Centralized collaboration requires exactly one actor model", ValueError,
         lambda: CentralizedMAGRPOTrainer(agents=[tiny_llama] * 2, args=CentralizedMAGRPOConfig(), **base)),
        ("Centralized collaboration requires one actor tokenizer", ValueError,
         lambda: CentralizedMAGRPOTrainer(agent_model=tiny_llama, tokenizer=[tokenizer] * 2,
                                          args=CentralizedMAGRPOConfig(), **base)),
        ("num_agents must match args.num_agents", ValueError,
         lambda: CentralizedMAGRPOTrainer(agent_model=tiny_llama, num_agents=3, args=CentralizedMAGRPOConfig(),
                                          **base)),
        ("reward_func must be callable", ValueError,
         lambda: CentralizedMAGRPOTrainer(agent_model=tiny_llama, args=CentralizedMAGRPOConfig(),
                                          train_dataset=train_dataset)),
    ]


def test_trainer_errors_contain_the_originals_phrase(tiny_llama, train_dataset):
    for phrase, error_type, call in trainer_rows(tiny_llama, train_dataset):
        with pytest.raises(error_type, match=re.escape(phrase)):
            call()


def test_helper_errors_contain_the_originals_phrase():
    args = SimpleNamespace(reference_kl_enabled=True, reference_kl_coef=0.1, reference_devices=["cpu"] * 3)
    with pytest.raises(ValueError, match=re.escape("reference_devices length (3) must be 1 or 2")):
        utils.validate_reference_kl_config(args, 2)
    with pytest.raises(ValueError, match=re.escape("reference_kl_coef must be >= 0")):
        utils.validate_reference_kl_config(SimpleNamespace(reference_kl_coef=-1.0), 2)
    for declared, phrase in [
        ((1.0,), "reward_func.reward_range must be a two-item sequence"),
        ((0.0, float("inf")), "reward_func.reward_range values must be finite"),
        ((1.0, 0.0), "reward_func.reward_range minimum must be less than maximum"),
    ]:
        def reward(completions_0, completions_1):
            return [0.0]
        reward.reward_range = declared
        with pytest.raises(ValueError, match=re.escape(phrase)):
            utils.resolve_reward_range(reward)


def test_training_errors_contain_the_originals_phrase(tiny_llama, train_dataset):
    """Rules the original checks once a trainer exists: at train(), and on what a transition returns."""
    trainer = MAGRPOTrainer(agent_model=tiny_llama, reward_func=_reward,
                            args=_small(MAGRPOConfig, num_generations=2, num_train_epochs=1))
    with pytest.raises(ValueError, match=re.escape("Trainer: training requires a train_dataset")):
        trainer.train()
    trainer.train_dataset = train_dataset.select(range(1))
    with pytest.raises(ValueError, match=re.escape("checkpoint_interval must be a positive integer")):
        trainer.train(checkpoint_interval=0)

    for returned, phrase in [
        ("one string", "External transition must return a list or tuple of external prompts for each agent"),
        (["only one"], "External transition returned 1 values but expected 2"),
    ]:
        def transition(prompt, agent_completions, num_agents, prompt_history_per_agent,
                       response_history_per_agent, returned=returned):
            return returned
        multi_turn = MAGRPOTrainer(
            agent_model=tiny_llama, reward_func=_reward, train_dataset=train_dataset.select(range(1)),
            external_transition=transition,
            args=_small(MAGRPOConfig, num_generations=2, num_turns=2, num_train_epochs=1))
        with pytest.raises(ValueError, match=re.escape(phrase)):
            multi_turn.train()
