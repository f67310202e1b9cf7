"""Every metric reaches MLflow, once a value, and a re-run's values win (issue 42, items 7 and 8).

Item 7: a non-finite update's loss and gradient norm are logged as NaN (MLflow keeps NaN), not left out as
"no value"; the optimizer step an epoch's end applies (a partial accumulation window) logs its
``grad_norm`` / ``learning_rate``; the last partial ``logging_steps`` window of every epoch is logged, and a
run stopped between two logs logs what an uninterrupted one does; evaluation drops are counted in
``eval/reward/dropped``, never in training's ``reward/dropped``.

Item 8: a re-run after a failure before the first checkpoint supersedes every value the dead attempt
logged; a resume from checkpoint step S keeps the points of steps <= S and supersedes the dead attempt's
points after S. The reward carries an offset per attempt (a judge that answers differently each time), so
whose value a reader sees is visible. Real tiny Llama agents, a real MLflow SQLite store.
"""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch
from datasets import Dataset

from comlrl import tracking
from comlrl.callbacks import MetricsRecorder, TrainerCallback
from comlrl.errors import TrainingInterrupted
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from comlrl.training.metrics import MetricWindow
from conftest import joint_letter_reward

pytest.importorskip("mlflow")

ROWS = 8  # the train_dataset fixture
BATCH = 2
STEPS_PER_EPOCH = ROWS // BATCH
TIMINGS = ("step_time", "generation_time", "reward_time", "update_time", "tokens_per_second")


def build(model, dataset, callbacks, reward=joint_letter_reward, eval_dataset=None, **config):
    settings = dict(num_agents=2, num_generations=2, max_new_tokens=4, agent_learning_rate=1e-3, num_train_epochs=1,
                    per_device_train_batch_size=BATCH, logging_steps=1, seed=5, disable_tqdm=True)
    settings.update(config)
    return MAGRPOTrainer(agent_model=model, num_agents=2, reward_func=reward, train_dataset=dataset,
                         eval_dataset=eval_dataset, callbacks=callbacks, args=MAGRPOConfig(**settings))


def offset_reward(offset: float):
    """The letters reward plus ``offset``: one attempt's judge."""
    return lambda c0, c1: [value + offset for value in joint_letter_reward(c0, c1)]


class FailUpdate(TrainerCallback):
    """Raises inside agent 0's update (its forward pass with gradients) after step ``after`` was logged:
    the step guard then leaves no checkpoint of that step."""

    def __init__(self, trainer, after):
        self.after, self.armed = after, False
        trainer.agents[0].lm_head.register_forward_hook(self.hook)

    def on_log(self, trainer, metrics, step):
        self.armed = self.armed or (step == self.after and "reward_mean" in metrics)

    def hook(self, module, inputs, output):
        if torch.is_grad_enabled() and self.armed:
            raise RuntimeError("injected failure inside an update")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


# ----- item 7a: a non-finite update -----------------------------------------------------------------
def test_the_window_keeps_a_nan_loss_or_grad_norm_of_a_trained_model_and_nothing_else_nan():
    window = MetricWindow()
    window.add({"agent_0/loss": 0.5, "agent_0/grad_norm": float("nan"), "reward_mean": float("nan"),
                "dpo/loss": float("nan"), "critic/value_loss": float("nan")}, models={"agent_0", "critic"})
    window.add({"agent_0/loss": 0.25, "agent_0/grad_norm": 2.0, "reward_mean": 0.5, "dpo/loss": 1.0,
                "critic/value_loss": 1.0}, models={"agent_0", "critic"})
    means = window.flush()
    assert means["agent_0/loss"] == 0.375 and means["reward_mean"] == 0.5 and means["dpo/loss"] == 1.0
    assert math.isnan(means["agent_0/grad_norm"]) and math.isnan(means["critic/value_loss"])


def test_a_nonfinite_update_logs_its_loss_and_grad_norm_to_mlflow_as_nan(tiny_llama, train_dataset, store, tmp_path):
    identity = tracking.open_run(store, "metrics", "nonfinite")
    callback = tracking.MLflowCallback(identity, spool_dir=tmp_path)
    trainer = build(tiny_llama, train_dataset, [callback], max_nonfinite_updates=100)
    trainer.agents[0].lm_head.register_forward_hook(  # agent 0's logits are NaN in every update, never in sampling
        lambda module, inputs, output: output * float("nan") if torch.is_grad_enabled() else None)
    history = trainer.train()
    assert callback.close(), callback.undelivered_message()
    steps = list(range(1, STEPS_PER_EPOCH + 1))
    assert trainer.state.nonfinite_updates == STEPS_PER_EPOCH  # agent 0's every update, skipped
    for key in ("agent_0/loss", "agent_0/grad_norm"):
        assert all(math.isnan(row[key]) for row in history), key
        points = tracking.metric_history(store, identity["run_id"], key)
        assert [step for step, _ in points] == steps and all(math.isnan(value) for _, value in points), key
    for key in ("agent_1/loss", "agent_1/grad_norm"):  # agent 1 trained as ever
        assert tracking.metric_history(store, identity["run_id"], key) == [(row["step"], row[key]) for row in history]


# ----- items 7b, 7c: the epoch's end and the last partial window --------------------------------------
EVERY, ACCUMULATION, EPOCHS = 3, 3, 2


def windows():
    """The (first, last) steps of every logged window, worked out from the schedule: a log every
    EVERY global steps and at each epoch's last step."""
    ends = sorted({s for s in range(1, EPOCHS * STEPS_PER_EPOCH + 1) if s % EVERY == 0 or s % STEPS_PER_EPOCH == 0})
    return [(previous + 1, end) for previous, end in zip([0] + ends[:-1], ends)]


def expected_logs(history):
    """Each window's mean of every metric of its history rows: what the callbacks must receive."""
    logs = {}
    for first, last in windows():
        values = {}
        for row in history[first - 1:last]:
            for key, value in row.items():
                if key not in ("step", "epoch") and not math.isnan(value):
                    values.setdefault(key, []).append(value)
        logs[last] = {key: sum(v) / len(v) for key, v in values.items()}
    return logs


def run_windows(model, dataset, callbacks):
    return build(model, dataset, callbacks, num_train_epochs=EPOCHS, logging_steps=EVERY,
                 gradient_accumulation_steps=ACCUMULATION)


@pytest.fixture(scope="module")
def uninterrupted(tiny_llama):
    recorder = MetricsRecorder()
    trainer = run_windows(tiny_llama, Dataset.from_dict({"prompt": [f"story {i}" for i in range(ROWS)]}), [recorder])
    trainer.train()
    return trainer, recorder.records


def test_the_epoch_end_optimizer_step_and_each_epochs_last_window_are_logged(uninterrupted):
    trainer, logs = uninterrupted
    assert windows() == [(1, 3), (4, 4), (5, 6), (7, 8)]
    assert [log["step"] for log in logs] == [last for _, last in windows()]
    # Optimizer steps: the window of 3 fills at step 3 and 7; the epoch's end applies steps 4 and 8 alone.
    assert [row["step"] for row in trainer.history if "agent_0/grad_norm" in row] == [3, 4, 7, 8]
    expected = expected_logs(trainer.history)
    for log in logs:
        got = {key: value for key, value in log.items() if key != "step"}
        assert got.keys() == expected[log["step"]].keys(), log["step"]
        assert all(got[key] == pytest.approx(expected[log["step"]][key], rel=1e-12) for key in got), log["step"]
    assert {"agent_0/grad_norm", "agent_1/learning_rate"} <= logs[1].keys()  # step 4: the flushed step's


def sigterm_in_update_of_step(trainer, step):
    """SIGTERM (a real one) while agent 0 updates in step ``step``: the run stops after that step."""
    def hook(module, inputs, output):
        if torch.is_grad_enabled() and trainer.state.global_step == step - 1:
            os.kill(os.getpid(), signal.SIGTERM)

    trainer.agents[0].lm_head.register_forward_hook(hook)


def test_a_run_stopped_between_two_logs_logs_what_an_uninterrupted_run_does(uninterrupted, tiny_llama, tmp_path):
    _, straight = uninterrupted
    dataset = Dataset.from_dict({"prompt": [f"story {i}" for i in range(ROWS)]})
    first, second = MetricsRecorder(), MetricsRecorder()
    stopped = run_windows(tiny_llama, dataset, [first])
    sigterm_in_update_of_step(stopped, 5)  # inside the window (5, 6): step 5 is not logged before the stop
    with pytest.raises(TrainingInterrupted) as info:
        stopped.train(checkpoint_dir=tmp_path)
    assert info.value.checkpoint.endswith("checkpoint-1-step5")
    resumed = run_windows(tiny_llama, dataset, [second])
    resumed.train(resume_from_checkpoint=info.value.checkpoint, checkpoint_dir=tmp_path)
    logs = first.records + second.records
    assert [log["step"] for log in logs] == [log["step"] for log in straight] == [last for _, last in windows()]

    def compared(log):
        return {key: value for key, value in log.items() if key not in TIMINGS and not key.startswith("memory")}

    for mine, theirs in zip(logs, straight):
        assert mine.keys() == theirs.keys() and compared(mine) == compared(theirs), mine["step"]


# ----- item 7d: evaluation drops are the evaluation's ---------------------------------------------------
def test_evaluation_drops_are_counted_in_eval_reward_dropped_never_in_training(tiny_llama, train_dataset):
    nans = {"train": 0, "eval": 0}

    def flaky(completions_0, completions_1, batch_items=None):
        kind = "eval" if batch_items[0]["prompt"].startswith("judge") else "train"
        nans[kind] += 1  # the first joint sample of every call is dropped
        return [math.nan] + [1.0 + i for i in range(1, len(completions_0))]

    seen = []

    class Check(TrainerCallback):
        def on_log(self, trainer, metrics, step):
            seen.append((step, dict(metrics), dict(nans)))

    evaluation = Dataset.from_dict({"prompt": ["judge the cat", "judge the sun"]})
    trainer = build(tiny_llama, train_dataset, [Check()], reward=flaky, eval_dataset=evaluation,
                    invalid_reward="drop", eval_interval=2, eval_num_samples=2)
    trainer.train()
    train_logs = [(step, m, n) for step, m, n in seen if "reward/dropped" in m]
    eval_logs = [(step, m, n) for step, m, n in seen if "eval/reward_mean" in m]
    assert [step for step, _, _ in train_logs] == list(range(1, STEPS_PER_EPOCH + 1))
    assert [step for step, _, _ in eval_logs] == [2, 4]
    for step, metrics, counted in train_logs:  # training's drops only, though evaluations came between
        assert metrics["reward/dropped"] == counted["train"], step
    before = 0
    for step, metrics, counted in eval_logs:  # each evaluation's own
        assert metrics["eval/reward/dropped"] == counted["eval"] - before > 0, step
        before = counted["eval"]
    assert trainer.reward.dropped == nans["train"]


# ----- item 8: a re-run's values supersede a dead attempt's --------------------------------------------
def attempt(model, dataset, identity, spool, offset, fail_after=None, **config):
    callback = tracking.MLflowCallback(identity, spool_dir=spool)
    trainer = build(model, dataset, [callback], reward=offset_reward(offset), **config)
    if fail_after is not None:
        trainer.callbacks.append(FailUpdate(trainer, fail_after))
    return trainer, callback


def test_a_rerun_after_a_failure_before_the_first_checkpoint_supersedes_every_dead_value(tiny_llama, train_dataset,
                                                                                          store, tmp_path):
    identity = tracking.open_run(store, "metrics", "dead-before-checkpoint")
    evaluation = dict(eval_dataset=train_dataset.select(range(2)), eval_interval=2, eval_num_samples=2)
    dead, callback = attempt(tiny_llama, train_dataset, identity, tmp_path / "spool", 10.0, fail_after=3, **evaluation)
    with pytest.raises(RuntimeError, match="injected failure"):
        dead.train(checkpoint_dir=tmp_path / "checkpoints")
    assert not list((tmp_path / "checkpoints").glob("checkpoint-*"))  # it died before its first checkpoint
    assert callback.close()
    assert [step for step, _ in tracking.metric_history(store, identity["run_id"], "reward_mean")] == [1, 2, 3]

    rerun, callback = attempt(tiny_llama, train_dataset, identity, tmp_path / "spool", 20.0, **evaluation)
    history = rerun.train(checkpoint_dir=tmp_path / "checkpoints")
    assert callback.close()
    assert callback.superseded_values > 0 and callback.skipped_values == 0
    expected = [(row["step"], row["reward_mean"]) for row in history]
    assert all(value > 20.0 for _, value in expected)  # the re-run's judge, not the dead one's (> 10)
    assert tracking.metric_history(store, identity["run_id"], "reward_mean") == expected
    assert tracking.logged_metrics(callback, "reward_mean")["reward_mean"] == expected
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store)
    assert sorted(m.step for m in client.get_metric_history(identity["run_id"], "reward_mean")) == \
        [1, 1, 2, 2, 3, 3, 4]  # MLflow keeps both; the later point of a step is the value
    assert client.get_run(identity["run_id"]).data.metrics["reward_mean"] == expected[-1][1]
    from flows import boundaries

    evaluations = [(step, metrics["eval/reward_mean"]) for step, metrics in rerun.evaluations]
    assert [step for step, _ in evaluations] == [2, 4] and all(value > 20.0 for _, value in evaluations)
    assert boundaries.eval_points(tracking.logged_metrics(callback, "eval/")) == evaluations


def test_a_resume_keeps_the_points_up_to_its_checkpoint_and_supersedes_the_dead_points_after(tiny_llama,
                                                                                          train_dataset, store,
                                                                                          tmp_path):
    identity = tracking.open_run(store, "metrics", "dead-after-checkpoint")
    checkpoints, spool = tmp_path / "checkpoints", tmp_path / "spool"
    dead, callback = attempt(tiny_llama, train_dataset, identity, spool, 10.0, fail_after=STEPS_PER_EPOCH + 2,
                             num_train_epochs=2)
    with pytest.raises(RuntimeError, match="injected failure"):
        dead.train(checkpoint_dir=checkpoints)
    assert callback.close()
    [checkpoint] = checkpoints.glob("checkpoint-*")  # the first epoch's; steps 5 and 6 died with the attempt
    assert checkpoint.name == "checkpoint-1"
    before = dict(tracking.metric_history(store, identity["run_id"], "reward_mean"))
    assert sorted(before) == list(range(1, STEPS_PER_EPOCH + 3))

    resumed, callback = attempt(tiny_llama, train_dataset, identity, spool, 20.0, num_train_epochs=2)
    history = resumed.train(checkpoint_dir=checkpoints, resume_from_checkpoint=str(checkpoint))
    assert callback.close()
    got = tracking.metric_history(store, identity["run_id"], "reward_mean")
    assert [step for step, _ in got] == list(range(1, 2 * STEPS_PER_EPOCH + 1))
    assert got[:STEPS_PER_EPOCH] == [(step, before[step]) for step in range(1, STEPS_PER_EPOCH + 1)]  # kept
    assert all(value > 20.0 for _, value in got[STEPS_PER_EPOCH:])  # the dead 5 and 6 superseded
    assert got == [(row["step"], row["reward_mean"]) for row in history]
    assert callback.kept_steps["reward_mean"] == STEPS_PER_EPOCH
    # A re-run of the finished run restores the final checkpoint: its history stands, a point of it is not logged again.
    finished, callback = attempt(tiny_llama, train_dataset, identity, spool, 30.0, num_train_epochs=2)
    finished.train(checkpoint_dir=checkpoints, resume_from_checkpoint="latest")
    callback.on_log(finished, {"reward_mean": -1.0}, 2 * STEPS_PER_EPOCH)
    assert callback.skipped_values == 1 and callback.superseded_values == 0 and callback.close()
    assert tracking.metric_history(store, identity["run_id"], "reward_mean") == got
