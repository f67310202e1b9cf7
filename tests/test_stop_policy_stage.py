"""Issue 42 item 9: a stop inside a MARLHF policy stage keeps a mid-stage checkpoint. A real SIGTERM (through the
run's own handler) after the policy stage's second step: the run stops with ``checkpoint-2-step2`` (two stages
done, two policy steps), the resume runs only the stage's last two steps, and the result equals the run
uninterrupted (weights, per-step rewards, the stage's record)."""

import os
import signal

import pytest
import torch

from comlrl.callbacks import TrainerCallback
from comlrl.errors import TrainingInterrupted
from comlrl.trainers.preference import MARLHFConfig, MARLHFTrainer

FAST = dict(num_generations=4, max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=None, reward_model_device=None,
            disable_tqdm=True, per_device_train_batch_size=2, reward_train_epochs=1, reward_learning_rate=1e-4,
            num_train_epochs=1, num_agents=2, seed=7, agent_learning_rate=1e-3, logging_steps=1)
POLICY_STEPS = 4  # 8 prompts, batches of 2


class PolicySteps(TrainerCallback):
    """The steps of the policy stage this train() call ran (the steps its logs name); SIGTERM to this process
    once the step ``stop_after`` is logged."""

    def __init__(self, stop_after: int | None = None):
        self.steps, self.stop_after = [], stop_after

    def on_log(self, trainer, metrics, step):
        if "reward_mean" in metrics or any(key.startswith("agent_0/") for key in metrics):
            self.steps.append(step)
            if step == self.stop_after:
                os.kill(os.getpid(), signal.SIGTERM)


def build(model, dataset, reward, callback):
    return MARLHFTrainer(agent_model=model, num_agents=2, reward_func=reward, train_dataset=dataset,
                         args=MARLHFConfig(**FAST), callbacks=[callback])


def test_a_stop_inside_the_policy_stage_checkpoints_its_last_step_and_the_resume_runs_only_the_rest(
        tiny_llama, tiny_gpt2, train_dataset, reward_func, tmp_path):
    FAST["reward_model_name"] = tiny_gpt2
    straight_steps = PolicySteps()
    straight = build(tiny_llama, train_dataset, reward_func, straight_steps)
    straight.train()
    assert sorted(set(straight_steps.steps)) == list(range(1, POLICY_STEPS + 1))

    stopped_steps = PolicySteps(stop_after=2)
    stopped = build(tiny_llama, train_dataset, reward_func, stopped_steps)
    with pytest.raises(TrainingInterrupted) as info:
        stopped.train(checkpoint_dir=tmp_path)
    assert info.value.checkpoint is not None and info.value.checkpoint.endswith("checkpoint-2-step2"), info.value
    assert sorted(set(stopped_steps.steps)) == [1, 2]

    resumed_steps = PolicySteps()
    resumed = build(tiny_llama, train_dataset, reward_func, resumed_steps)
    resumed.train(resume_from_checkpoint=info.value.checkpoint, checkpoint_dir=tmp_path)
    assert sorted(set(resumed_steps.steps)) == [3, 4]  # no step of the stage is done twice
    for a, b in zip(straight.agents, resumed.agents):
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert [s["reward_mean"] for s in resumed.state.history] == [s["reward_mean"] for s in straight.state.history]
    policy = [record for record in resumed.state.stage_records if record["stage"] == "learn_policy"]
    expected = [record for record in straight.state.stage_records if record["stage"] == "learn_policy"]
    assert policy[0]["policy/steps"] == POLICY_STEPS and policy == expected
