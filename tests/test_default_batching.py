"""The MAGRPO family's default batching means what comlrl 1.4.3's does (issue 30).

1.4.3 buffers ``rollout_buffer_size`` (default 2) prompts' groups, all drawn from one policy, then
takes one optimizer step over them. Here the default ``per_device_train_batch_size`` is 2: two
prompts decoded together from one policy, one update. A 1.4.3 script that sets
``rollout_buffer_size`` alone gets that batching.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from torch.optim.optimizer import register_optimizer_step_post_hook

from comlrl.trainers import (CentralizedMAGRPOConfig, IACConfig, MAACConfig, MAGRPOConfig, MAGRPOTrainer,
                             MAREINFORCEConfig, MAReMaxConfig, MARLHFConfig, MARLOOConfig)


@pytest.mark.parametrize("config_class", [MAGRPOConfig, MAREINFORCEConfig, MAReMaxConfig, MARLOOConfig,
                                          CentralizedMAGRPOConfig, MARLHFConfig])
def test_magrpo_family_defaults_to_two_prompts_per_update(config_class):
    config = config_class()
    assert config.per_device_train_batch_size == 2
    assert not config.was_given("per_device_train_batch_size")


@pytest.mark.parametrize("config_class", [IACConfig, MAACConfig])
def test_actor_critic_keeps_one_prompt_per_update(config_class):
    # 1.4.3's actor-critic buffers 8 single completions; 4 completions of 2 prompts here (docs/migrating.md).
    assert config_class().per_device_train_batch_size == 1


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_rollout_buffer_size_alone_sets_the_batch(size):
    config = MAGRPOConfig(rollout_buffer_size=size)
    assert (config.per_device_train_batch_size, config.gradient_accumulation_steps) == (size, 1)
    assert MAGRPOConfig(rollout_buffer_size=size, train_batch_size=size).per_device_train_batch_size == size


def test_actor_critic_buffer_counts_completions():
    # 1.4.3's actor-critic buffer holds single completions: 8 of them are 2 prompts x 4 generations here.
    assert IACConfig(rollout_buffer_size=8).per_device_train_batch_size == 2
    assert MAACConfig(rollout_buffer_size=4, num_generations=2).per_device_train_batch_size == 2
    with pytest.raises(ValueError, match=r"IACConfig\.rollout_buffer_size=6 is not supported yet"):
        IACConfig(rollout_buffer_size=6)  # not a whole number of prompts at 4 generations


@pytest.mark.parametrize("kwargs, field", [
    (dict(rollout_buffer_size=2, per_device_train_batch_size=1), "rollout_buffer_size=2"),
    (dict(rollout_buffer_size=2, gradient_accumulation_steps=2), "rollout_buffer_size=2"),
    (dict(rollout_buffer_size=2, train_batch_size=1), "train_batch_size=1"),
])
def test_batch_fields_that_disagree_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=rf"MAGRPOConfig\.{field} is not supported yet"):
        MAGRPOConfig(**kwargs)


class Recorder:
    """A joint reward that records each call's prompts and a fingerprint of agent 0's weights at that call."""

    def __init__(self, trainer_box: list) -> None:
        self.calls: list[tuple[list[str], float]] = []
        self.box = trainer_box

    def __call__(self, completions_0, completions_1, batch_items=None):
        weights = self.box[0].agents[0].get_input_embeddings().weight
        self.calls.append(([item["prompt"] for item in batch_items], float(weights.detach().double().sum())))
        return [float(len(a) - len(b)) / 10 for a, b in zip(completions_0, completions_1)]


def build(tiny_llama, rows: int, **config) -> tuple[MAGRPOTrainer, Recorder]:
    box: list = []
    reward = Recorder(box)
    dataset = Dataset.from_dict({"prompt": [f"prompt number {i}" for i in range(rows)]})
    args = MAGRPOConfig(num_generations=2, max_new_tokens=4, num_train_epochs=1, shuffle=False, device="cpu",
                        disable_tqdm=True, agent_learning_rate=1e-2, seed=3, **config)
    trainer = MAGRPOTrainer(agent_model=tiny_llama, num_agents=2, reward_func=reward, train_dataset=dataset,
                            args=args)
    box.append(trainer)
    return trainer, reward


def test_default_run_samples_two_prompts_from_one_policy_then_updates_once(tiny_llama):
    trainer, reward = build(tiny_llama, rows=5)
    steps = [0]
    handle = register_optimizer_step_post_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))
    try:
        trainer.train()
    finally:
        handle.remove()
    # 5 rows in order: batches of 2, 2 and the last 1; one reward call per batch (both prompts' samples
    # in one rollout, so from one policy), one optimizer step per agent per batch.
    assert [prompts for prompts, _ in reward.calls] == [
        ["prompt number 0"] * 2 + ["prompt number 1"] * 2,
        ["prompt number 2"] * 2 + ["prompt number 3"] * 2,
        ["prompt number 4"] * 2,
    ]
    assert steps[0] == 3 * 2  # 3 updates x 2 agents
    fingerprints = [weights for _, weights in reward.calls]
    assert len(set(fingerprints)) == 3  # the weights changed between batches, never within one


def test_buffer_size_trains_exactly_as_the_batch_size(tiny_llama):
    via_buffer, _ = build(tiny_llama, rows=4, rollout_buffer_size=2)
    via_batch, _ = build(tiny_llama, rows=4, per_device_train_batch_size=2)
    via_default, _ = build(tiny_llama, rows=4)
    for trainer in (via_buffer, via_batch, via_default):
        trainer.train()
    for a, b, c in zip(via_buffer.agents[0].parameters(), via_batch.agents[0].parameters(),
                       via_default.agents[0].parameters()):
        assert torch.equal(a, b) and torch.equal(a, c)
    one, _ = build(tiny_llama, rows=4, per_device_train_batch_size=1)
    one.train()
    assert not all(torch.equal(a, b) for a, b in zip(one.agents[0].parameters(), via_default.agents[0].parameters()))


def test_the_default_batch_is_capped_at_the_rows_a_chosen_one_is_not(tiny_llama):
    trainer, reward = build(tiny_llama, rows=1)  # 1.4.3 trains a one-row dataset at its defaults: so does this
    assert trainer.batch_size == 1
    trainer.train()
    assert [prompts for prompts, _ in reward.calls] == [["prompt number 0"] * 2]
    for chosen in (dict(per_device_train_batch_size=2), dict(rollout_buffer_size=2)):
        with pytest.raises(ValueError, match=r"train_dataset has 1 rows, fewer than one batch "
                                             r"\(per_device_train_batch_size=2\); lower the batch size"):
            build(tiny_llama, rows=1, **chosen)
