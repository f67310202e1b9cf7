"""Issue 26, case 5: a flaky, failing, exiting or hanging reward function on a real trainer.

Retries must not change the run (the same weights as with a healthy reward); a reward that keeps
failing ends the run after checkpointing the last completed step, from which a resume ends where an
uninterrupted run ends; a stop signal while a call hangs stops the run within moments, not at the
timeout; ``sys.exit`` inside a reward is an error naming the function; numpy numbers are numbers.
"""

import os
import signal
import threading
import time

import numpy
import pytest
import torch

from comlrl.errors import TrainingInterrupted
from comlrl.rollout.reward_calls import RewardCallError
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from conftest import WORDS, joint_letter_reward
from datasets import Dataset

STEPS = 8  # one epoch: 8 prompts, one per step


def build(model_dir, dataset, reward_func, **config):
    settings = dict(num_agents=2, num_generations=2, max_new_tokens=6, agent_learning_rate=1e-3, num_train_epochs=1,
                    per_device_train_batch_size=1, seed=5, disable_tqdm=True, reward_retry_backoff=0.0)
    settings.update(config)
    return MAGRPOTrainer(agent_model=model_dir, reward_func=reward_func, train_dataset=dataset,
                         args=MAGRPOConfig(**settings))


class Scripted:
    """The healthy reward, except at the calls numbered in ``faults`` (1-based), which run ``fault()``."""

    def __init__(self, faults, fault):
        self.calls, self.faults, self.fault = 0, set(faults), fault

    def __call__(self, completions_0, completions_1):
        self.calls += 1
        if self.calls in self.faults:
            self.fault()
        return joint_letter_reward(completions_0, completions_1)


def weights(trainer):
    return [{k: v.clone() for k, v in agent.state_dict().items()} for agent in trainer.agents]


def assert_same_weights(a, b):
    for x, y in zip(a, b):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture(scope="module")
def uninterrupted(tiny_llama):
    trainer = build(tiny_llama, Dataset.from_dict({"prompt": [f"write a story about the {w}" for w in WORDS]}),
                    joint_letter_reward)
    trainer.train()
    return weights(trainer), [row["reward_mean"] for row in trainer.state.history]


def down():
    raise ConnectionError("reward service is down")


def test_retried_failures_leave_the_run_as_a_healthy_reward_leaves_it(tiny_llama, train_dataset, uninterrupted):
    flaky = Scripted(faults={3, 4, 9}, fault=down)  # step 3 fails twice, then succeeds; step 7 once
    trainer = build(tiny_llama, train_dataset, flaky, reward_retries=2)
    trainer.train()
    assert flaky.calls == STEPS + 3
    assert_same_weights(weights(trainer), uninterrupted[0])
    assert [row["reward_mean"] for row in trainer.state.history] == uninterrupted[1]


@pytest.mark.parametrize("fault, words", [(down, "raised ConnectionError: reward service is down (after 2 attempts)"),
                                          (lambda: exec("import sys; sys.exit(3)"), "called sys.exit(3) (after 2 attempts)")])
def test_a_reward_that_keeps_failing_keeps_every_completed_step(tiny_llama, train_dataset, uninterrupted, tmp_path,
                                                                fault, words):
    failing = Scripted(faults={7, 8}, fault=fault)  # step 7 and its retry fail: 6 steps done
    trainer = build(tiny_llama, train_dataset, failing, reward_retries=1)
    with pytest.raises(RewardCallError, match=words.replace("(", r"\(").replace(")", r"\)")):
        trainer.train(checkpoint_dir=tmp_path)
    kept = tmp_path / "checkpoint-0-step6"
    assert kept.is_dir(), sorted(p.name for p in tmp_path.iterdir())
    resumed = build(tiny_llama, train_dataset, joint_letter_reward)
    resumed.train(resume_from_checkpoint=str(kept), checkpoint_dir=tmp_path)
    assert_same_weights(weights(resumed), uninterrupted[0])
    assert [row["reward_mean"] for row in resumed.state.history] == uninterrupted[1]


def test_sigterm_while_a_reward_hangs_stops_at_once_and_the_resume_is_exact(tiny_llama, train_dataset, uninterrupted,
                                                                            tmp_path):
    hanging = threading.Event()

    def hang():
        hanging.set()
        time.sleep(120)

    def kill_when_hanging():
        hanging.wait(60)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)

    trainer = build(tiny_llama, train_dataset, Scripted(faults={4}, fault=hang), reward_timeout=60)
    threading.Thread(target=kill_when_hanging, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(TrainingInterrupted, match="SIGTERM received while waiting for a call of reward function") as info:
        trainer.train(checkpoint_dir=tmp_path)
    assert time.monotonic() - started < 30, "the stop waited for the reward's timeout"
    assert info.value.checkpoint.endswith("checkpoint-0-step3")  # step 4 was not finished: its start is restored
    resumed = build(tiny_llama, train_dataset, joint_letter_reward)
    resumed.train(resume_from_checkpoint=info.value.checkpoint, checkpoint_dir=tmp_path)
    assert_same_weights(weights(resumed), uninterrupted[0])


def test_a_timed_out_call_is_retried_and_then_named(tiny_llama, train_dataset):
    trainer = build(tiny_llama, train_dataset, Scripted(faults={2, 3}, fault=lambda: time.sleep(5)),
                    reward_timeout=0.3, reward_retries=1)
    started = time.monotonic()
    with pytest.raises(RewardCallError, match=r"did not return within reward_timeout=0.3 s \(after 2 attempts\)"):
        trainer.train()
    assert time.monotonic() - started < 4


def test_numpy_rewards_are_numbers(tiny_llama, train_dataset):
    def numpy_reward(completions_0, completions_1):
        return [numpy.float32(r) for r in joint_letter_reward(completions_0, completions_1)]

    def array_reward(completions_0, completions_1):
        return numpy.asarray(joint_letter_reward(completions_0, completions_1), dtype=numpy.float64)

    for reward in (numpy_reward, array_reward):
        history = build(tiny_llama, train_dataset, reward).train()
        assert len(history) == STEPS and all(numpy.isfinite(row["reward_mean"]) for row in history)


def test_the_reward_call_settings_are_checked():
    with pytest.raises(ValueError, match="reward_timeout"):
        MAGRPOConfig(reward_timeout=0)
    with pytest.raises(ValueError, match="reward_retries"):
        MAGRPOConfig(reward_retries=-1)
