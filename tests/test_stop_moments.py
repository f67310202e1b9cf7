"""Stops at the loop's awkward moments (issue 42, items 3 and 6): a signal while a checkpoint is written, and an
evaluation cut short by a signal or a reward failure. Each run is stopped for real (a real SIGTERM through the
run's own handler, a real exception from the reward), resumed, and compared with the same run uninterrupted."""

import os
import signal
import time

import pytest
import torch
from datasets import Dataset

from comlrl.callbacks import TrainerCallback
from comlrl.checkpointing import io, latest_checkpoint
from comlrl.errors import TrainingInterrupted
from comlrl.rollout.reward_calls import RewardCallError
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from conftest import WORDS, joint_letter_reward

BATCH, EPOCHS = 2, 2
STEPS_PER_EPOCH = len(WORDS) // BATCH  # 4: every batch full
TOTAL_STEPS = STEPS_PER_EPOCH * EPOCHS


def build(dataset, model_dir, reward=joint_letter_reward, **config):
    settings = dict(num_agents=2, num_generations=2, max_new_tokens=4, agent_learning_rate=1e-3,
                    num_train_epochs=EPOCHS, per_device_train_batch_size=BATCH, seed=11, disable_tqdm=True)
    settings.update(config)
    eval_dataset = Dataset.from_dict({"prompt": ["tell of the sea", "tell of the sky"]})
    return MAGRPOTrainer(agent_model=model_dir, num_agents=2, reward_func=reward, train_dataset=dataset,
                         eval_dataset=eval_dataset if settings.get("eval_interval") else None,
                         args=MAGRPOConfig(**settings))


def same_weights(first, second) -> bool:
    return all(torch.equal(x, y) for a, b in zip(first.agents, second.agents)
               for x, y in zip(a.state_dict().values(), b.state_dict().values()))


class EvalPoints(TrainerCallback):
    """Every evaluation a run logs: ``(step, {eval/...})``, in order (what MLflow receives)."""

    def __init__(self, points):
        self.points = points

    def on_log(self, trainer, metrics, step):
        evaluated = {key: value for key, value in metrics.items() if key.startswith("eval/")}
        if evaluated:
            self.points.append((step, evaluated))


# ----- item 6: a signal while a checkpoint is written ------------------------------------------------------
def sigterm_while_writing(monkeypatch, checkpoint_name):
    """Send this process a SIGTERM from inside the write of checkpoint ``checkpoint_name`` (once)."""
    write = io.write_checkpoint
    sent = []

    def writing(directory, name, *args, **kwargs):
        if name == checkpoint_name and not sent:
            sent.append(name)
            os.kill(os.getpid(), signal.SIGTERM)
        return write(directory, name, *args, **kwargs)

    monkeypatch.setattr(io, "write_checkpoint", writing)
    return sent


def test_a_signal_during_a_middle_checkpoint_stops_right_after_it(tiny_llama, train_dataset, tmp_path, monkeypatch):
    straight = build(train_dataset, tiny_llama)
    straight.train()

    interrupted = build(train_dataset, tiny_llama)
    sent = sigterm_while_writing(monkeypatch, "checkpoint-1")
    with pytest.raises(TrainingInterrupted, match=r"SIGTERM received while .*checkpoint-1 was written: stopped after "
                                                  r"epoch 1") as info:
        interrupted.train(checkpoint_dir=tmp_path)
    assert sent == ["checkpoint-1"]
    assert info.value.checkpoint.endswith("checkpoint-1")
    assert interrupted.state.global_step == STEPS_PER_EPOCH  # no step after the checkpoint
    assert len(interrupted.state.history) == STEPS_PER_EPOCH
    assert [path.name for path in io.list_checkpoints(tmp_path)] == ["checkpoint-1"]

    resumed = build(train_dataset, tiny_llama)
    resumed.train(resume_from_checkpoint=info.value.checkpoint, checkpoint_dir=tmp_path)
    assert resumed.state.global_step == TOTAL_STEPS
    assert same_weights(straight, resumed)


def test_a_signal_during_the_final_checkpoint_is_not_swallowed(tiny_llama, train_dataset, tmp_path, monkeypatch):
    straight = build(train_dataset, tiny_llama)
    straight.train()

    interrupted = build(train_dataset, tiny_llama)
    final = f"checkpoint-{EPOCHS}"
    sigterm_while_writing(monkeypatch, final)
    with pytest.raises(TrainingInterrupted, match=rf"SIGTERM received while .*{final} was written: training is "
                                                  r"complete and saved") as info:
        interrupted.train(checkpoint_dir=tmp_path)
    assert info.value.checkpoint.endswith(final)
    assert interrupted.state.global_step == TOTAL_STEPS
    assert same_weights(straight, interrupted)

    resumed = build(train_dataset, tiny_llama)
    history = resumed.train(resume_from_checkpoint=info.value.checkpoint, checkpoint_dir=tmp_path)
    assert resumed.state.global_step == TOTAL_STEPS and len(history) == TOTAL_STEPS  # the resume only ends it
    assert same_weights(straight, resumed)
    assert latest_checkpoint(tmp_path).name == final


# ----- item 3: an evaluation cut short ---------------------------------------------------------------------
class Trap:
    """A reward that does something once, only inside the evaluation made at global step ``step``: the
    trainer's evaluator marks when an evaluation runs (the reward may run in a worker thread)."""

    def __init__(self, step, action):
        self.step, self.action, self.trainer, self.evaluating, self.fired = step, action, None, False, False
        self.__name__ = joint_letter_reward.__name__  # named as the uninterrupted run's reward

    def attach(self, trainer):
        self.trainer = trainer

        def evaluator():
            self.evaluating = True
            try:
                return trainer.evaluate()
            finally:
                self.evaluating = False

        trainer.use_evaluator(evaluator)
        return trainer

    def __call__(self, completions_0, completions_1):
        if self.evaluating and not self.fired and self.trainer.state.global_step == self.step:
            self.fired = True
            self.action()
        return joint_letter_reward(completions_0, completions_1)


def run_with_trap(model_dir, dataset, step, action, **config):
    """The uninterrupted run's eval points and trainer, and a trainer whose reward does ``action`` at ``step``'s evaluation."""
    straight_points, stopped_points = [], []
    straight = build(dataset, model_dir, **config)
    straight.callbacks.append(EvalPoints(straight_points))
    straight.train()
    trap = Trap(step, action)
    stopped = trap.attach(build(dataset, model_dir, reward=trap, **config))
    stopped.callbacks.append(EvalPoints(stopped_points))
    return straight, straight_points, stopped, stopped_points, trap


def resume_and_compare(model_dir, dataset, checkpoint, straight, straight_points, points, interval, **config):
    resumed = build(dataset, model_dir, eval_interval=interval, **config)
    resumed.callbacks.append(EvalPoints(points))
    resumed.train(resume_from_checkpoint=checkpoint)
    expected_steps = list(range(interval, TOTAL_STEPS + 1, interval))
    assert [step for step, _ in straight_points] == expected_steps
    assert points == straight_points  # each evaluation made once, at its step, with the same values
    assert resumed.state.global_step == TOTAL_STEPS
    assert same_weights(straight, resumed)


def test_a_signal_during_an_epoch_end_evaluation_resumes_with_that_evaluation(tiny_llama, train_dataset, tmp_path):
    interval = STEPS_PER_EPOCH  # evaluations at each epoch's last step
    config = dict(eval_interval=interval, reward_timeout=60.0)  # a timeout: the reward wait watches the stop request

    def slow_judge_and_sigterm():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1.0)  # still waited for when the signal is seen (the call runs in a worker thread)

    straight, straight_points, stopped, points, trap = run_with_trap(
        tiny_llama, train_dataset, interval, slow_judge_and_sigterm, **config)
    with pytest.raises(TrainingInterrupted, match=rf"SIGTERM received: the evaluation at step {interval} was not "
                                                  rf"finished \(step {interval} itself was\)") as info:
        stopped.train(checkpoint_dir=tmp_path)
    assert trap.fired and stopped.state.global_step == interval
    assert points == []  # the evaluation never finished
    assert os.path.basename(info.value.checkpoint) == f"checkpoint-0-step{interval}"
    resume_and_compare(tiny_llama, train_dataset, info.value.checkpoint, straight, straight_points, points,
                       interval, reward_timeout=60.0)


def test_a_reward_failure_during_an_evaluation_resumes_with_that_evaluation(tiny_llama, train_dataset, tmp_path):
    interval, failing = 2, STEPS_PER_EPOCH + 2  # the second evaluation of epoch 2

    def fail():
        raise ConnectionError("the judge is down")

    straight, straight_points, stopped, points, trap = run_with_trap(
        tiny_llama, train_dataset, failing, fail, eval_interval=interval)
    with pytest.raises(RewardCallError, match="the judge is down"):
        stopped.train(checkpoint_dir=tmp_path)
    assert trap.fired and stopped.state.global_step == failing
    assert [step for step, _ in points] == list(range(interval, failing, interval))
    checkpoint = latest_checkpoint(tmp_path)
    assert checkpoint.name == f"checkpoint-1-step{failing}"
    resume_and_compare(tiny_llama, train_dataset, checkpoint, straight, straight_points, points, interval)


def test_a_checkpoint_written_before_pending_evaluations_existed_still_resumes(tiny_llama, train_dataset, tmp_path):
    """Format-3 checkpoints saved before the progress had ``pending_evaluation`` resume as having none."""
    import json

    from comlrl.checkpointing.manifest import seal

    straight = build(train_dataset, tiny_llama)
    straight.train()
    first = build(train_dataset, tiny_llama, num_train_epochs=1)
    first.train(checkpoint_dir=tmp_path)
    checkpoint = tmp_path / "checkpoint-1"
    metadata = json.loads((checkpoint / "metadata.json").read_text())
    del metadata["state"]["pending_evaluation"]
    (checkpoint / "metadata.json").write_text(json.dumps(metadata))
    state = torch.load(checkpoint / "state.pt", weights_only=True)
    del state["progress"]["pending_evaluation"]
    torch.save(state, checkpoint / "state.pt")
    seal(checkpoint)

    resumed = build(train_dataset, tiny_llama)
    resumed.train(resume_from_checkpoint=checkpoint)
    assert resumed.state.global_step == TOTAL_STEPS and resumed.state.pending_evaluation == 0
    assert same_weights(straight, resumed)
