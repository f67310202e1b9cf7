"""What MARLHF tells its user (issue 42, item 13): the policy guard's warning, the actor-critic policy stage's
``rollout_buffer_size`` advice, which rows the guard scores, and the policy stage's default batch."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from datasets import Dataset

from comlrl.trainers.actor_critic.config import IACConfig, MAACConfig
from comlrl.trainers.preference import MARLHFConfig, MARLHFTrainer
from comlrl.trainers.preference.guard import PolicySnapshot, pairwise_agreement, revert_warning
from comlrl.trainers.preference.policy import policy_config

FAST = dict(num_generations=2, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=None, reward_model_device=None,
            disable_tqdm=True, num_train_epochs=1, num_agents=2, reward_train_epochs=1, reward_learning_rate=1e-4)


class Recorder:
    """A joint task reward that records every row it scores; ``constant`` makes every sample score 0."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.constant = False

    def __call__(self, completions_0, completions_1, batch_items=None):
        self.rows.extend(batch_items)
        if self.constant:
            return [0.0] * len(completions_0)
        return [float(a.count("e") - b.count("e")) for a, b in zip(completions_0, completions_1)]


def fitted_trainer(tiny_llama, reward, rows=4, **kwargs) -> MARLHFTrainer:
    dataset = Dataset.from_dict({"prompt": [f"write a story about the {w}" for w in ("cat", "dog", "sun", "moon")[:rows]]})
    trainer = MARLHFTrainer(agent_model=tiny_llama, reward_func=reward, train_dataset=dataset,
                            args=MARLHFConfig(**FAST), **kwargs)
    trainer.run_next_stage()  # collect
    trainer.run_next_stage()  # fit
    return trainer


# ----- 1. the guard's warning when no fresh pair differs ---------------------------------------------------
def test_revert_warning_says_plainly_when_no_pair_could_be_judged():
    ties = torch.tensor([[0.5, 0.5, 0.5], [1.0, 1.0, 1.0]])  # task rewards: no two samples of a row differ
    agreement = pairwise_agreement(torch.tensor([[0.1, 0.9, 0.3], [0.2, 0.0, 0.4]]), ties)
    message = revert_warning(0, 0.5, 0.25, agreement)
    assert "nan" not in message.lower()
    assert "no fresh pair" in message.lower() and "0.5000 -> 0.2500" in message
    judged = revert_warning(0, 0.5, 0.25, pairwise_agreement(torch.tensor([[0.1, 0.9]]), torch.tensor([[0.0, 1.0]])))
    assert "in 100% of" in judged


def test_apply_guard_warns_without_nan_when_every_fresh_sample_ties(tiny_llama, caplog):
    reward = Recorder()
    trainer = fitted_trainer(tiny_llama, reward)
    reward.constant = True  # the guard's fresh samples all tie: no pair to judge the reward model on
    trainer.guard = PolicySnapshot.take(trainer.policy_trainer, task_reward=1.0)  # after: 0.0, so it reverts
    with caplog.at_level(logging.WARNING, logger="comlrl.trainers.preference.marlhf"):
        metrics = trainer.apply_guard()
    assert metrics["policy/guard_reverted"] == 1.0
    warning = " ".join(record.getMessage() for record in caplog.records)
    assert "weights are restored" in warning and "no fresh pair" in warning.lower()
    assert "nan" not in warning.lower()


# ----- 2. rollout_buffer_size with an actor-critic policy stage --------------------------------------------
@pytest.mark.parametrize("rl_algorithm, config_class", [("iac", IACConfig), ("maac", MAACConfig)])
@pytest.mark.parametrize("size, prompts", [(8, 2), (32, 8), (4, 1)])
def test_actor_critic_buffer_that_maps_is_accepted(rl_algorithm, config_class, size, prompts):
    args = MARLHFConfig(rl_algorithm=rl_algorithm, rollout_buffer_size=size)  # 4 generations: size / 4 prompts
    assert args.per_device_train_batch_size == prompts
    policy = policy_config(args, config_class)
    assert policy.per_device_train_batch_size == prompts and policy.num_generations == 4


@pytest.mark.parametrize("rl_algorithm, config_class, kwargs", [
    ("iac", IACConfig, dict(rollout_buffer_size=6)),  # not a whole number of prompts at 4 generations
    ("maac", MAACConfig, dict(rollout_buffer_size=3)),
    ("iac", IACConfig, dict(rollout_buffer_size=8, per_device_train_batch_size=1)),  # batch fields disagree
    ("magrpo", None, dict(rollout_buffer_size=8, per_device_train_batch_size=1)),
])
def test_buffer_that_cannot_map_is_refused_with_advice_that_works(rl_algorithm, config_class, kwargs):
    with pytest.raises(ValueError) as refused:
        MARLHFConfig(rl_algorithm=rl_algorithm, **kwargs)
    advice = re.search(r"give rollout_buffer_size=(\d+)", str(refused.value))
    assert advice, str(refused.value)
    args = MARLHFConfig(rl_algorithm=rl_algorithm, **{**kwargs, "rollout_buffer_size": int(advice.group(1))})
    if config_class is not None:
        policy_config(args, config_class)


def test_actor_critic_buffer_follows_the_policy_stage_generations():
    args = MARLHFConfig(rl_algorithm="iac", rollout_buffer_size=6, policy_overrides={"num_generations": 2})
    assert args.per_device_train_batch_size == 3
    assert policy_config(args, IACConfig).per_device_train_batch_size == 3


# ----- 3. the guard never scores the eval rows ---------------------------------------------------------------
def test_guard_never_scores_the_eval_rows(tiny_llama):
    reward = Recorder()
    eval_dataset = Dataset.from_dict({"prompt": ["eval row one", "eval row two"], "held_out": [True, True]})
    trainer = fitted_trainer(tiny_llama, reward, eval_dataset=eval_dataset)
    reward.rows.clear()
    trainer.guard = PolicySnapshot.take(trainer.policy_trainer, trainer.guard_scores()["task_reward"])
    trainer.apply_guard()
    assert reward.rows, "the guard scored nothing"
    assert not any(row.get("held_out") for row in reward.rows)
    assert {row["prompt"] for row in reward.rows} <= set(trainer.policy_trainer.train_dataset["prompt"])


# ----- 4. the policy stage's default batch is capped at the rows; a chosen one is not ------------------------
def test_one_row_dataset_trains_one_policy_step(tiny_llama):
    dataset = Dataset.from_dict({"prompt": ["write a story about the cat"]})
    trainer = MARLHFTrainer(agent_model=tiny_llama, reward_func=Recorder(), train_dataset=dataset,
                            args=MARLHFConfig(**FAST))
    assert trainer.policy_trainer.batch_size == 1
    trainer.train()
    assert trainer.policy_trainer.state.global_step == 1


def test_chosen_batch_larger_than_the_dataset_is_still_refused(tiny_llama):
    dataset = Dataset.from_dict({"prompt": ["write a story about the cat"]})
    with pytest.raises(ValueError, match=r"fewer than one batch \(per_device_train_batch_size=2\)"):
        trainer = MARLHFTrainer(agent_model=tiny_llama, reward_func=Recorder(), train_dataset=dataset,
                                args=MARLHFConfig(per_device_train_batch_size=2, **FAST))
        trainer.train()
