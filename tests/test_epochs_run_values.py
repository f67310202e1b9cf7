"""The epoch loop and the run around it, checked by value (issue 39): steps and epochs run against the plan,
the history rows, the logging and evaluation cadences, what a boundary's report holds, the stop and failure
paths, the step guard and the run's refusals in their words.

Real tiny Llama agents (``tests/conftest.py``) trained by MAGRPO on four prompts, two per step, so an epoch
is two steps (and one MADPOIter run, whose boundaries are stages); every expected number is worked out here from
the history the run wrote or by hand. Every MAGRPO run carries a :class:`RunawayGuard`, so that a loop that no
longer ends fails at once.
"""

from __future__ import annotations

import copy
import io
import logging
import math
import os
import random
import signal
import time

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

from comlrl.callbacks import MetricsRecorder, TrainerCallback
from comlrl.errors import TrainingInterrupted
from comlrl.progress import Boundary
from comlrl.rollout.reward_calls import RewardCallError
from comlrl.tasks.letters import letters_reward
from comlrl.trainers.epochs import Stage, current_activity
from comlrl.trainers.preference import MADPOIterConfig, MADPOIterTrainer
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from comlrl.training.loop import StepGuard, TrainingLoop, rng_restorer
from comlrl.training.signals import StopRequest
from comlrl.training.metrics import MetricWindow
from comlrl.training.run import BoundaryReport, TrainingRun, mean_step_metrics, resolve_total_limit
from conftest import joint_letter_reward

PROMPTS = [f"write about the {word}" for word in ("cat", "dog", "sun", "moon")]
STEPS_PER_EPOCH = 2  # four prompts, two per step


class EpochEnds(TrainerCallback):
    """Records ``on_epoch_end``'s epoch number and ``on_train_begin`` / ``on_train_end``."""

    def __init__(self):
        self.epochs, self.events = [], []

    def on_epoch_end(self, trainer, epoch):
        self.epochs.append(epoch)

    def on_train_begin(self, trainer):
        self.events.append("begin")

    def on_train_end(self, trainer):
        self.events.append("end")


class RunawayGuard(TrainerCallback):
    """Fails a run that goes past its plan (more epoch ends than epochs, or far more logs than any test makes),
    so that a loop that no longer ends fails at once instead of running until a time limit."""

    def __init__(self, epochs):
        self.epochs, self.ended, self.logs = epochs, 0, 0

    def on_epoch_end(self, trainer, epoch):
        self.ended += 1
        if self.ended > self.epochs:
            raise AssertionError(f"epoch end number {self.ended} of a {self.epochs}-epoch run")

    def on_log(self, trainer, metrics, step):
        self.logs += 1
        if self.logs > 50:
            raise AssertionError(f"{self.logs} logs: the run does not end")


def build(model, callbacks=(), eval_dataset=None, reward=joint_letter_reward, prompts=PROMPTS, **config):
    settings = dict(num_agents=2, num_generations=2, max_new_tokens=2, agent_learning_rate=1e-2, num_train_epochs=2,
                    per_device_train_batch_size=2, logging_steps=1, seed=3, disable_tqdm=True, shuffle=False)
    settings.update(config)
    return MAGRPOTrainer(agent_model=model, num_agents=2, reward_func=reward,
                         train_dataset=Dataset.from_dict({"prompt": list(prompts)}), eval_dataset=eval_dataset,
                         callbacks=[*callbacks, RunawayGuard(settings["num_train_epochs"])],
                         args=MAGRPOConfig(**settings))


def training_logs(recorder):
    """The steps and records of the training windows a recorder saw (evaluations are left out)."""
    return [record for record in recorder.records if "reward_mean" in record]


def mean(values):
    values = list(values)
    return sum(values) / len(values)


def errors(caplog):
    """The messages the run logged as errors."""
    return [r.getMessage() for r in caplog.records if r.name == "comlrl.training.run" and r.levelno == logging.ERROR]


def weights(trainer):
    return [{name: tensor.detach().clone() for name, tensor in agent.state_dict().items()} for agent in trainer.agents]


# ----- the plan, the steps and the epochs --------------------------------------------------------------
def test_a_run_makes_every_planned_step_and_epoch_and_counts_them(tiny_llama):
    ends = EpochEnds()
    trainer = build(tiny_llama, [ends], num_train_epochs=3)
    assert MAGRPOTrainer.plan_boundaries(trainer.args) == [Boundary(1, 3), Boundary(2, 3), Boundary(3, 3)]
    assert trainer.total_boundaries() == 3 and trainer.boundary_kind == "epoch"
    assert trainer.planned_training_steps() == 3 * STEPS_PER_EPOCH
    history = trainer.train()
    assert [(row["step"], row["epoch"]) for row in history] == [(1, 0), (2, 0), (3, 1), (4, 1), (5, 2), (6, 2)]
    assert history == trainer.history
    state = trainer.state
    assert (state.epoch, state.step_in_epoch, state.global_step, state.boundaries) == (3, 0, 6, 3)
    assert ends.epochs == [1, 2, 3] and ends.events == ["begin", "end"]
    for row in history:
        assert row["reward/dropped"] == 0.0 and row["nonfinite_updates"] == 0.0
        assert row["step_time"] >= row["generation_time"] > 0 and row["update_time"] > 0 and row["reward_time"] > 0


def test_a_schedule_repeated_plans_its_epochs_steps_that_many_times(tiny_llama):
    trainer = build(tiny_llama, num_train_epochs=3)
    trainer.replan_schedules(2)  # as MARLHF's iterations do: the policy's epochs run once per iteration
    assert trainer.planned_training_steps() == 3 * STEPS_PER_EPOCH * 2


def test_the_steps_take_the_rows_of_the_epoch_in_order_and_the_stages_name_their_step(tiny_llama):
    seen = []

    def reward(completions_0, completions_1):
        seen.append((current_activity(), len(completions_0)))
        return joint_letter_reward(completions_0, completions_1)

    trainer = build(tiny_llama, reward=reward, num_train_epochs=1)
    assert current_activity() is None
    assert trainer.epoch_batches(0) == [[0, 1], [2, 3]]
    assert trainer.epoch_batches(0) is trainer.epoch_batches(0)  # the epoch's plan is made once, not every step
    assert trainer.epoch_rows() == [[{"prompt": PROMPTS[0]}, {"prompt": PROMPTS[1]}],
                                    [{"prompt": PROMPTS[2]}, {"prompt": PROMPTS[3]}]]
    assert trainer.steps_left() == 2
    run = trainer.start_run(progress_bar=False)
    assert run.run_steps(1) == 1 and trainer.steps_left() == 1 and run.steps_left() == 1
    assert trainer.epoch_rows() == [[{"prompt": PROMPTS[2]}, {"prompt": PROMPTS[3]}]]
    assert run.run_steps(5) == 1 and trainer.steps_left() == 0
    assert seen == [("score-s1", 2 * 2), ("score-s2", 2 * 2)]
    assert current_activity() is None
    run.close_boundary()
    run.save_boundary()
    assert run.next_boundary is None and run.steps_left() == 0 and run.run_steps() == 0
    run.finish()


def test_a_shuffled_epoch_takes_every_row_once_and_another_order_the_next_epoch(tiny_llama):
    prompts = [f"write about the {word}" for word in ("cat", "dog", "sun", "moon", "tree", "river")]
    trainer = build(tiny_llama, prompts=prompts, shuffle=True, num_train_epochs=3)
    orders = [[index for batch in trainer.epoch_batches(epoch) for index in batch] for epoch in range(3)]
    assert all(sorted(order) == list(range(6)) for order in orders)
    assert len({tuple(order) for order in orders}) == 3
    assert [len(batch) for batch in trainer.epoch_batches(1)] == [2, 2, 2]
    run = trainer.start_run(progress_bar=False)
    run.run_boundary()
    run.run_steps(1)  # epoch 2, its first batch done: the rest of epoch 2's order is left
    assert trainer.epoch_rows() == [[{"prompt": prompts[i]} for i in orders[1][start:start + 2]] for start in (2, 4)]
    run.abort(RuntimeError("test over"))
    # Seeded: a second trainer with the same seed draws the same orders; another seed others.
    again = build(tiny_llama, prompts=prompts, shuffle=True, num_train_epochs=3)
    assert [[i for b in again.epoch_batches(e) for i in b] for e in range(3)] == orders
    other = build(tiny_llama, prompts=prompts, shuffle=True, num_train_epochs=3, seed=4)
    assert [[i for b in other.epoch_batches(e) for i in b] for e in range(3)] != orders


def test_the_epoch_batches_follow_a_dataset_that_changed(tiny_llama):
    trainer = build(tiny_llama, num_train_epochs=1)
    assert trainer.epoch_batches(0) == [[0, 1], [2, 3]]
    trainer.train_dataset = Dataset.from_dict({"prompt": PROMPTS + PROMPTS[:2]})
    assert trainer.epoch_batches(0) == [[0, 1], [2, 3], [4, 5]]
    assert trainer.steps_left() == 3


def test_closing_an_epoch_with_steps_left_is_refused_naming_them(tiny_llama):
    trainer = build(tiny_llama, num_train_epochs=2)
    with pytest.raises(RuntimeError, match=r"^close_boundary\(\) with 2 steps of epoch 1 left$"):
        trainer.close_boundary()
    run = trainer.start_run(progress_bar=False)
    run.run_steps(1)
    with pytest.raises(RuntimeError, match=r"^close_boundary\(\) with 1 steps of epoch 1 left$"):
        trainer.close_boundary(run.window)
    run.run_steps()
    assert trainer.close_boundary() == {}  # without a window: the epoch ends all the same
    assert (trainer.state.epoch, trainer.state.step_in_epoch, trainer.state.boundaries) == (1, 0, 1)
    run.abort(RuntimeError("test over"))


def test_each_epoch_closed_by_hand_counts_one_epoch_and_one_boundary(tiny_llama):
    ends = EpochEnds()
    trainer = build(tiny_llama, [ends], num_train_epochs=2)
    run = trainer.start_run(progress_bar=False)
    counts = []
    for _ in range(2):  # run_steps and close_boundary only: a miscount shows here instead of looping on
        assert run.run_steps() == STEPS_PER_EPOCH
        run.close_boundary()
        state = trainer.state
        counts.append((state.epoch, state.step_in_epoch, state.global_step, state.boundaries))
    assert counts == [(1, 0, 2, 1), (2, 0, 4, 2)] and ends.epochs == [1, 2]
    assert run.next_boundary is None
    run.abort(RuntimeError("test over"))


def test_train_steps_runs_the_epochs_up_to_the_one_named(tiny_llama):
    ends, recorder = EpochEnds(), MetricsRecorder()
    trainer = build(tiny_llama, [ends, recorder], num_train_epochs=3, logging_steps=3)
    run = trainer.start_run(progress_bar=False)
    trainer.train_steps(2, run.window)
    assert (trainer.state.epoch, trainer.state.global_step, trainer.state.boundaries) == (2, 4, 2)
    assert ends.epochs == [1, 2]
    rewards = {row["step"]: row["reward_mean"] for row in trainer.history}
    logs = training_logs(recorder)
    assert [record["step"] for record in logs] == [2, 3, 4]  # each epoch's last window, and the cadence
    assert logs[0]["reward_mean"] == pytest.approx((rewards[1] + rewards[2]) / 2, rel=1e-6)
    trainer.train_steps(2, run.window)  # already there: nothing more
    assert trainer.state.global_step == 4
    run.abort(RuntimeError("test over"))


# ----- the history, the logging window -------------------------------------------------------------------
def test_the_logs_are_the_means_of_each_window_and_of_each_epochs_last(tiny_llama):
    recorder = MetricsRecorder()
    trainer = build(tiny_llama, [recorder], num_train_epochs=2, logging_steps=3)
    history = trainer.train()
    logs = training_logs(recorder)
    # Windows: steps 1-2 (epoch 1's end), step 3 (logging_steps), step 4 (epoch 2's end).
    assert [record["step"] for record in logs] == [2, 3, 4]
    rewards = {row["step"]: row["reward_mean"] for row in history}
    for record, steps in zip(logs, ([1, 2], [3], [4])):
        assert record["reward_mean"] == pytest.approx(mean(rewards[s] for s in steps), rel=1e-6)
        assert "step" in record and "epoch" not in record


def test_the_tags_go_into_every_row_and_never_into_the_logged_means(tiny_llama):
    recorder = MetricsRecorder()
    trainer = build(tiny_llama, [recorder], num_train_epochs=1)
    trainer.tag_steps(iteration=7)
    trainer.train()
    assert [row["iteration"] for row in trainer.history] == [7, 7]
    assert all("iteration" not in record for record in recorder.records)
    trainer.tag_steps()
    assert trainer.history_tags == {}


def test_the_logging_window_reopened_anywhere_holds_the_steps_since_the_last_log(tiny_llama):
    """Three steps an epoch and a log every 4 steps: the window after each step is rebuilt from the history
    and compared with the run's own live window and with the steps since the last log the recorder saw."""
    recorder = MetricsRecorder()
    prompts = [f"write about the {word}" for word in ("cat", "dog", "sun", "moon", "tree", "river")]
    trainer = build(tiny_llama, [recorder], prompts=prompts, num_train_epochs=3, logging_steps=4)
    trainer.tag_steps(iteration=1)
    run = trainer.start_run(progress_bar=False)
    opened = []
    while run.next_boundary is not None:
        while run.steps_left():
            run.run_steps(1)
            logged = [record["step"] for record in training_logs(recorder)]
            last_log = logged[-1] if logged else 0
            expected = [row["reward_mean"] for row in trainer.history if row["step"] > last_log]
            reopened = trainer.logging_window().flush()
            live = copy.deepcopy(run.window).flush()
            opened.append((trainer.state.global_step, len(expected)))
            if expected:
                assert reopened["reward_mean"] == pytest.approx(mean(expected), rel=1e-6)
                assert reopened["reward_mean"] == pytest.approx(live["reward_mean"], rel=1e-6)
                assert "iteration" not in reopened and "step" not in reopened
            else:
                assert reopened == {} and live == {}
        run.save_boundary(run.close_boundary())
        assert trainer.logging_window().flush() == {}
    run.finish()
    # Logs at 3 (epoch end), 4 (cadence), 6 (epoch end), 8 (cadence), 9 (epoch end).
    assert [record["step"] for record in training_logs(recorder)] == [3, 4, 6, 8, 9]
    assert opened == [(1, 1), (2, 2), (3, 3), (4, 0), (5, 1), (6, 2), (7, 1), (8, 0), (9, 1)]


def test_a_reopened_window_keeps_an_updates_nan_and_leaves_out_step_epoch_and_tags(tiny_llama):
    trainer = build(tiny_llama, num_train_epochs=1, logging_steps=4, max_nonfinite_updates=100)
    trainer.tag_steps(iteration=2)
    trainer.agents[0].lm_head.register_forward_hook(  # agent 0's update is NaN, its sampling is not
        lambda module, inputs, output: output * float("nan") if torch.is_grad_enabled() else None)
    run = trainer.start_run(progress_bar=False)
    run.run_steps(1)  # the window stays open: no log before step 4 or the epoch's end
    reopened, live = trainer.logging_window().flush(), copy.deepcopy(run.window).flush()
    row = trainer.history[-1]
    assert set(reopened) == set(live) == set(row) - {"step", "epoch", "iteration"}
    assert math.isnan(row["agent_0/loss"]) and math.isnan(reopened["agent_0/loss"])
    assert reopened["reward_mean"] == row["reward_mean"] and reopened["agent_1/loss"] == row["agent_1/loss"]
    run.abort(RuntimeError("test over"))


def test_the_window_of_a_fresh_trainer_is_empty():
    assert TrainingLoop().logging_window().flush() == {}


# ----- evaluation ------------------------------------------------------------------------------------------
class CountingEvaluator:
    def __init__(self):
        self.calls, self.activities = 0, []

    def __call__(self):
        self.calls += 1
        self.activities.append(current_activity())
        return {"eval/score": float(self.calls)}


EVAL_ROWS = Dataset.from_dict({"prompt": PROMPTS[:2]})


@pytest.mark.parametrize("interval, steps", [(3, [3]), (2, [2, 4]), (1, [1, 2, 3, 4]), (0, []), (None, [])])
def test_the_evaluations_come_every_eval_interval_steps(tiny_llama, interval, steps):
    recorder, evaluator = MetricsRecorder(), CountingEvaluator()
    trainer = build(tiny_llama, [recorder], eval_dataset=EVAL_ROWS, eval_interval=interval, num_train_epochs=2)
    trainer.use_evaluator(evaluator)
    trainer.train()
    assert [step for step, _ in trainer.evaluations] == steps
    assert [metrics for _, metrics in trainer.evaluations] == [{"eval/score": float(n)} for n in range(1, len(steps) + 1)]
    assert [(r["step"], r["eval/score"]) for r in recorder.records if "eval/score" in r] == [
        (step, float(n)) for n, step in enumerate(steps, 1)]
    assert trainer.state.pending_evaluation == 0


def test_without_an_eval_dataset_the_cadence_evaluates_nothing(tiny_llama):
    evaluator = CountingEvaluator()
    trainer = build(tiny_llama, eval_interval=1, eval_before_training=True, num_train_epochs=1)
    trainer.use_evaluator(evaluator)
    trainer.train()
    assert evaluator.calls == 0 and trainer.evaluations == []


def test_a_fresh_run_evaluates_at_step_0_when_asked_and_a_resume_does_not(tiny_llama, tmp_path):
    recorder, evaluator = MetricsRecorder(), CountingEvaluator()
    trainer = build(tiny_llama, [recorder], eval_dataset=EVAL_ROWS, eval_before_training=True, num_train_epochs=1)
    trainer.use_evaluator(evaluator)
    trainer.train(checkpoint_dir=tmp_path)
    assert trainer.evaluations == [(0, {"eval/score": 1.0})]
    assert recorder.records[0] == {"step": 0, "eval/score": 1.0}
    unasked = build(tiny_llama, eval_dataset=EVAL_ROWS, num_train_epochs=1)
    unasked.use_evaluator(CountingEvaluator())
    unasked.train()
    assert unasked.evaluations == []
    resumed = build(tiny_llama, eval_dataset=EVAL_ROWS, eval_before_training=True, num_train_epochs=2)
    resumed.use_evaluator(CountingEvaluator())
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"), checkpoint_dir=tmp_path)
    assert resumed.evaluations == []


def test_use_evaluator_none_goes_back_to_evaluate(tiny_llama):
    trainer = build(tiny_llama, eval_dataset=EVAL_ROWS, eval_interval=2, num_train_epochs=1, eval_num_samples=1)
    trainer.use_evaluator(CountingEvaluator())
    trainer.use_evaluator(None)
    trainer.train()
    [(step, metrics)] = trainer.evaluations
    assert step == 2 and "eval/score" not in metrics and any(name.startswith("eval/") for name in metrics)


# ----- the run's reports ------------------------------------------------------------------------------------
def test_each_boundary_reports_its_steps_mean_metrics_checkpoint_and_evaluations(tiny_llama, tmp_path):
    trainer = build(tiny_llama, eval_dataset=EVAL_ROWS, eval_interval=3, num_train_epochs=2)
    trainer.use_evaluator(CountingEvaluator())
    run = trainer.start_run(checkpoint_dir=tmp_path, progress_bar=False)
    assert run.progress.total == 4 and run.progress.n == 0 and run.progress.disable
    before = time.perf_counter()
    reports = run.run_all()
    took = time.perf_counter() - before
    assert run.run_all() == []
    history = run.finish()
    assert [(r.boundary, r.first_step, r.last_step) for r in reports] == [(Boundary(1, 2), 0, 2), (Boundary(2, 2), 2, 4)]
    assert [r.checkpoint for r in reports] == [str(tmp_path / "checkpoint-1"), str(tmp_path / "checkpoint-2")]
    assert run.reports == reports
    for report in reports:
        rows = [row for row in history if report.first_step < row["step"] <= report.last_step]
        assert report.metrics["reward_mean"] == pytest.approx(mean(row["reward_mean"] for row in rows), rel=1e-9)
        assert report.metrics["step"] == pytest.approx(mean(row["step"] for row in rows))
        assert 0 < report.seconds <= took
    assert reports[0].evaluations == [] and reports[0].evaluation == {}
    assert reports[1].evaluations == [(3, {"eval/score": 1.0})] and reports[1].evaluation == {"eval/score": 1.0}
    assert run.last_checkpoint() == str(tmp_path / "checkpoint-2")


def test_the_checkpoint_cadence_skips_boundaries_and_the_end_writes_the_last(tiny_llama, tmp_path):
    trainer = build(tiny_llama, num_train_epochs=3)
    run = trainer.start_run(checkpoint_dir=tmp_path, checkpoint_interval=2, progress_bar=False)
    reports = run.run_all()
    assert [r.checkpoint for r in reports] == [None, str(tmp_path / "checkpoint-2"), None]
    run.finish()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]


def test_the_progress_bar_counts_the_steps_from_where_the_run_resumes(tiny_llama, tmp_path):
    build(tiny_llama, num_train_epochs=1).train(checkpoint_dir=tmp_path)
    trainer = build(tiny_llama, num_train_epochs=3)
    run = trainer.start_run(resume_from_checkpoint=str(tmp_path / "checkpoint-1"), checkpoint_dir=tmp_path,
                            progress_bar=True)
    assert (run.progress.total, run.progress.n, run.progress.disable) == (6, 2, False)
    run.run_steps(1)
    assert run.progress.n == 3
    assert run.next_boundary == Boundary(2, 3)
    run.abort(RuntimeError("test over"))
    shown = build(tiny_llama, num_train_epochs=1, disable_tqdm=False).start_run()
    assert not shown.progress.disable
    shown.abort(RuntimeError("test over"))
    hidden = build(tiny_llama, num_train_epochs=1).start_run()  # disable_tqdm=True, no progress_bar given
    assert hidden.progress.disable
    hidden.abort(RuntimeError("test over"))


# ----- a resume continues the run exactly --------------------------------------------------------------------
def test_a_run_resumed_from_an_epoch_boundary_ends_with_the_weights_of_one_never_stopped(tiny_llama, tmp_path):
    whole = build(tiny_llama, num_train_epochs=2)
    whole.train()
    first = build(tiny_llama, num_train_epochs=2)
    run = first.start_run(checkpoint_dir=tmp_path / "split", progress_bar=False)
    run.run_boundary()
    run.abort(RuntimeError("stopped by the test after epoch 1"))
    random.random(), torch.rand(3)  # whatever ran in between must not matter
    second = build(tiny_llama, num_train_epochs=2)
    history = second.train(resume_from_checkpoint=str(tmp_path / "split" / "checkpoint-1"),
                           checkpoint_dir=tmp_path / "split")
    for mine, theirs in zip(weights(second), weights(whole)):
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert [row["reward_mean"] for row in history] == [row["reward_mean"] for row in whole.history]
    saved = load_file(str(tmp_path / "split" / "checkpoint-2" / "models" / "agent_0.safetensors"))
    assert all(torch.equal(saved[k], weights(whole)[0][k]) for k in saved)


def test_a_fresh_run_is_seeded_whatever_ran_before_it(tiny_llama):
    torch.manual_seed(123)
    one = build(tiny_llama, num_train_epochs=1)
    one.train()
    torch.rand(5)
    two = build(tiny_llama, num_train_epochs=1)
    two.train()
    assert [row["reward_mean"] for row in one.history] == [row["reward_mean"] for row in two.history]
    assert all(torch.equal(a[k], b[k]) for a, b in zip(weights(one), weights(two)) for k in a)


# ----- stops --------------------------------------------------------------------------------------------------
class StopAfter(TrainerCallback):
    """Sets the run's stop request (as SIGTERM's handler does) when step ``step`` is logged."""

    def __init__(self, step):
        self.step, self.run = step, None

    def on_log(self, trainer, metrics, step):
        if step == self.step and "reward_mean" in metrics:
            trainer.stop_request.signal_name = "SIGTERM"


def test_a_stop_request_ends_the_step_and_checkpoints_where_the_run_is(tiny_llama, tmp_path, caplog):
    trainer = build(tiny_llama, [StopAfter(3)], num_train_epochs=2)
    run = trainer.start_run(checkpoint_dir=tmp_path, progress_bar=False)
    with caplog.at_level(logging.ERROR, logger="comlrl.training.run"):
        reports = run.run_all()
    assert len(reports) == 1 and trainer.state.global_step == 3
    assert str(run.stopped) == "SIGTERM received: stopped after step 3"
    assert run.stopped.checkpoint == str(tmp_path / "checkpoint-1-step3")
    assert run.last_checkpoint() == run.stopped.checkpoint
    assert errors(caplog) == [f"SIGTERM received: stopped after step 3; resume from {tmp_path / 'checkpoint-1-step3'}"]
    assert run.next_boundary is None and run.run_steps() == 0 and run.close_boundary() is None
    assert run.run_boundary() is None
    with pytest.raises(RuntimeError, match=r"^the run stopped \(SIGTERM received: stopped after step 3\); "
                                           r"resume it instead of finishing it$"):
        run.finish()
    with pytest.raises(TrainingInterrupted, match="^SIGTERM received: stopped after step 3$"):
        build(tiny_llama, [StopAfter(3)], num_train_epochs=2).train(checkpoint_dir=tmp_path / "again")


def test_a_stop_requested_between_two_calls_runs_no_more_steps(tiny_llama, tmp_path):
    trainer = build(tiny_llama, num_train_epochs=2)
    run = trainer.start_run(checkpoint_dir=tmp_path, progress_bar=False)
    run.run_steps(1)
    run.request.signal_name = "SIGINT"
    assert run.run_steps(1) == 0 and trainer.state.global_step == 1
    assert str(run.stopped) == "SIGINT received: stopped after step 1"
    assert run.stopped.checkpoint == str(tmp_path / "checkpoint-0-step1")


def test_a_stop_requested_at_an_epochs_end_names_the_epoch(tiny_llama, tmp_path):
    class StopAtEnd(TrainerCallback):
        def on_epoch_end(self, trainer, epoch):
            trainer.stop_request.signal_name = "SIGTERM"

    trainer = build(tiny_llama, [StopAtEnd()], num_train_epochs=2)
    run = trainer.start_run(checkpoint_dir=tmp_path, progress_bar=False)
    run.run_steps()
    assert run.close_boundary() is None
    assert str(run.stopped) == "SIGTERM received: stopped after epoch 1"
    assert run.stopped.checkpoint == str(tmp_path / "checkpoint-1-step2") and trainer.state.boundaries == 1


def test_finishing_before_the_last_boundary_is_refused_with_the_count(tiny_llama):
    run = build(tiny_llama, num_train_epochs=3).start_run(progress_bar=False)
    run.run_boundary()
    with pytest.raises(RuntimeError, match=r"^finish\(\) with 2 boundaries left$"):
        run.finish()
    run.abort(RuntimeError("test over"))


# ----- failures ------------------------------------------------------------------------------------------------
def test_a_failure_before_the_update_is_checkpointed_and_its_resume_repeats_the_step(tiny_llama, tmp_path, caplog):
    calls = {"n": 0}

    def flaky(completions_0, completions_1):
        calls["n"] += 1
        if calls["n"] == 2:
            raise ValueError("the judge fell over")
        return joint_letter_reward(completions_0, completions_1)

    trainer = build(tiny_llama, reward=flaky, num_train_epochs=1)
    with caplog.at_level(logging.ERROR, logger="comlrl.training.run"):
        with pytest.raises(RewardCallError, match="raised ValueError: the judge fell over"):
            with trainer.start_run(checkpoint_dir=tmp_path, progress_bar=False) as run:
                run.run_all()
    path = tmp_path / "checkpoint-0-step1"
    assert run.failure_checkpoint == str(path) and run.last_checkpoint() == str(path)
    assert errors(caplog) == [f"RewardCallError ended the run after step 1; resume from {path}"]
    whole = build(tiny_llama, num_train_epochs=1)
    whole.train()
    resumed = build(tiny_llama, num_train_epochs=1)
    resumed.train(resume_from_checkpoint=str(path), checkpoint_dir=tmp_path)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(weights(resumed), weights(whole)) for k in a)


def fail_inside_updates(trainer) -> dict:
    """Once ``armed["on"]`` is set, agent 0's forward with gradients (an update's, not a rollout's) raises."""
    armed = {"on": False}

    def hook(module, inputs, output):
        if torch.is_grad_enabled() and armed["on"]:
            raise RuntimeError("injected failure inside an update")

    trainer.agents[0].lm_head.register_forward_hook(hook)
    return armed


@pytest.mark.parametrize("epochs, before_failure, last", [
    (1, lambda run: run.run_steps(1), None),  # no checkpoint yet
    (2, lambda run: run.run_boundary(), "checkpoint-1"),  # after epoch 1's checkpoint
])
def test_a_failure_inside_an_update_writes_nothing_and_names_the_last_checkpoint(tiny_llama, tmp_path, caplog,
                                                                                epochs, before_failure, last):
    trainer = build(tiny_llama, num_train_epochs=epochs)
    armed = fail_inside_updates(trainer)
    with caplog.at_level(logging.ERROR, logger="comlrl.training.run"):
        with pytest.raises(RuntimeError, match="injected"):
            with trainer.start_run(checkpoint_dir=tmp_path, progress_bar=False) as run:
                before_failure(run)
                armed["on"] = True
                run.run_steps(1)
    expected = None if last is None else str(tmp_path / last)
    assert run.failure_checkpoint is None and run.last_checkpoint() == expected
    assert sorted(path.name for path in tmp_path.glob("checkpoint-*")) == ([] if last is None else [last])
    assert errors(caplog) == ["RuntimeError ended the run inside an update; nothing new was saved (the last "
                              f"checkpoint is {'none' if last is None else expected})"]


# ----- the pieces: pure functions, the step guard, the refusals --------------------------------------------------
def test_mean_step_metrics_averages_the_finite_numbers_after_a_step():
    history = [
        {"step": 1, "loss": 100.0, "x": 1},
        {"step": 2, "loss": 1.0, "x": 2, "flag": True, "name": "a"},
        {"step": 3, "loss": float("nan"), "x": 4, "only": 5.0},
        {"step": 4, "loss": 4.0, "x": 6, "inf": float("inf")},
    ]
    assert mean_step_metrics(history, 1) == {"loss": 2.5, "only": 5.0, "step": 3.0, "x": 4.0}
    assert list(mean_step_metrics(history, 1)) == ["loss", "only", "step", "x"]
    assert mean_step_metrics(history, 4) == {}
    assert mean_step_metrics([{"loss": 3.0}], 0) == {}  # a row without a step counts as step 0


def test_a_report_without_evaluations_has_an_empty_evaluation():
    report = BoundaryReport(Boundary(1, 1), None, {})
    assert report.evaluations == [] and report.evaluation == {} and report.first_step == 0
    assert report.last_step == 0 and report.seconds == 0.0
    other = BoundaryReport(Boundary(1, 1), None, {})
    other.evaluations.append((1, {"a": 1.0}))
    assert report.evaluations == []  # each report its own list
    last = {"b": 2.0}
    other.evaluations.append((2, last))
    assert other.evaluation == last and other.evaluation is not last


@pytest.mark.parametrize("checkpoint, save, expected", [(None, None, None), (3, None, 3), (None, 2, 2), (4, 4, 4),
                                                             (1, None, 1), (None, 1, 1)])
def test_the_two_names_of_the_checkpoint_limit_give_one_value(checkpoint, save, expected):
    assert resolve_total_limit(checkpoint, save) == expected


@pytest.mark.parametrize("checkpoint, save, words", [
    (0, None, "checkpoint_total_limit must be a positive integer or None, got 0"),
    (True, None, "checkpoint_total_limit must be a positive integer or None, got True"),
    (None, 1.5, "save_total_limit must be a positive integer or None, got 1.5"),
    (None, -1, "save_total_limit must be a positive integer or None, got -1"),
    (2, 3, "checkpoint_total_limit=2 and save_total_limit=3 disagree; they name the same setting, give one of them"),
])
def test_a_bad_checkpoint_limit_is_refused_in_these_words(checkpoint, save, words):
    with pytest.raises(ValueError) as refused:
        resolve_total_limit(checkpoint, save)
    assert str(refused.value) == words


def test_the_step_guard_restores_before_an_update_and_refuses_inside_one():
    restored = []
    guard = StepGuard()
    assert guard.recover() is True and restored == []
    guard.begin(lambda: restored.append("back"))
    assert guard.recover() is True and restored == ["back"]
    assert guard.recover() is True and restored == ["back"]  # once only
    guard.begin(lambda: restored.append("again"))
    guard.updating()
    assert guard.recover() is False and restored == ["back"]
    assert guard.recover() is True  # the failed step is over
    guard.begin(lambda: restored.append("never"))
    guard.end()
    assert guard.recover() is True and restored == ["back"]


def test_rng_restorer_puts_every_generator_back():
    torch.manual_seed(0)
    random.seed(0)
    restore = rng_restorer()
    drawn = (torch.rand(4), random.random())
    torch.rand(7), random.random()
    restore()
    again = (torch.rand(4), random.random())
    assert torch.equal(drawn[0], again[0]) and drawn[1] == again[1]


def test_a_step_that_failed_before_its_update_is_put_back_exactly(tiny_llama):
    trainer = build(tiny_llama, num_train_epochs=1)
    run = trainer.start_run(progress_bar=False)
    reward_state = copy.deepcopy(trainer.reward.state_dict())
    restore = trainer.step_restorer()
    expected = torch.rand(3)
    trainer.reward.dropped += 5
    torch.rand(9)
    restore()
    assert torch.equal(torch.rand(3), expected) and trainer.reward.state_dict() == reward_state
    run.abort(RuntimeError("test over"))


def test_a_stage_by_default_neither_times_nor_updates():
    stage = Stage("rollout", ("rows",), "rollout")
    assert stage.timing is None and stage.updates is False


def test_the_tracking_runs_are_recorded_by_name_and_others_refused():
    loop = TrainingLoop()
    assert loop.run_identity == {"wandb": None, "mlflow": None}
    loop.record_tracking_run("mlflow", {"run_id": "r1"})
    assert loop.run_identity == {"wandb": None, "mlflow": {"run_id": "r1"}}
    loop.record_tracking_run("wandb", {"id": "w1"})
    assert loop.run_identity == {"wandb": {"id": "w1"}, "mlflow": {"run_id": "r1"}}
    with pytest.raises(ValueError) as refused:
        loop.record_tracking_run("tensorboard", {})
    assert str(refused.value) == "tracker must be 'wandb' or 'mlflow', got 'tensorboard'"
    assert loop.preference_pairs is None and loop.step_guard is loop.step_guard
    assert loop.supports_mid_boundary_checkpoints is True and loop.stop_request is None
    request = StopRequest()
    loop.watch_stop(request)
    assert loop.stop_request is request


def test_a_trainer_without_training_data_is_refused_before_any_work(tiny_llama, tmp_path):
    trainer = build(tiny_llama, num_train_epochs=1)
    trainer.train_dataset = None
    with pytest.raises(ValueError) as refused:
        trainer.train(checkpoint_dir=tmp_path)
    assert str(refused.value) == ("Trainer: training requires a train_dataset: MAGRPOTrainer has none; give "
                                  "train_dataset= to the constructor or set trainer.train_dataset before train()")
    assert list(tmp_path.iterdir()) == []


def test_train_passes_its_checkpoint_settings_to_the_run(tiny_llama, tmp_path):
    build(tiny_llama, num_train_epochs=3).train(checkpoint_dir=tmp_path, checkpoint_interval=1,
                                               checkpoint_total_limit=2)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    cadence = tmp_path / "cadence"
    build(tiny_llama, num_train_epochs=3).train(checkpoint_dir=cadence, checkpoint_interval=2)
    assert sorted(p.name for p in cadence.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    other = tmp_path / "other"
    build(tiny_llama, num_train_epochs=3).train(checkpoint_dir=other, save_total_limit=1)
    assert sorted(p.name for p in other.glob("checkpoint-*")) == ["checkpoint-3"]


# ----- what the callbacks, the log and the progress bar receive ---------------------------------------------------
class Receiver(TrainerCallback):
    """Which trainer object each event received."""

    def __init__(self):
        self.trainers = []

    def on_log(self, trainer, metrics, step):
        self.trainers.append(("on_log", trainer))

    def on_epoch_end(self, trainer, epoch):
        self.trainers.append(("on_epoch_end", trainer))

    def on_train_begin(self, trainer):
        self.trainers.append(("on_train_begin", trainer))

    def on_train_end(self, trainer):
        self.trainers.append(("on_train_end", trainer))


def test_every_event_reaches_the_callbacks_with_the_trainer_and_the_log_names_step_and_means(tiny_llama, caplog):
    receiver, recorder = Receiver(), MetricsRecorder()
    trainer = build(tiny_llama, [receiver, recorder], eval_dataset=EVAL_ROWS, eval_interval=2, num_train_epochs=1)
    trainer.use_evaluator(CountingEvaluator())
    with caplog.at_level(logging.INFO, logger="comlrl.trainers.epochs"):
        trainer.train()
    assert {event for event, _ in receiver.trainers} == {"on_log", "on_epoch_end", "on_train_begin", "on_train_end"}
    assert all(received is trainer for _, received in receiver.trainers)
    logged = [r.getMessage() for r in caplog.records if r.name == "comlrl.trainers.epochs"]
    windows = [{k: v for k, v in record.items() if k != "step"} for record in training_logs(recorder)]
    assert logged == [f"step {record['step']}: {window}" for record, window in zip(training_logs(recorder), windows)]
    assert len(logged) == 2


def test_the_progress_bar_counts_each_step_once_and_shows_its_reward(tiny_llama):
    trainer = build(tiny_llama, num_train_epochs=2)
    run = trainer.start_run(progress_bar=True)
    assert run.progress.desc == "train"
    run.run_steps(1)
    assert run.progress.n == 1
    assert run.progress.postfix == f"reward={trainer.history[-1]['reward_mean']:.3f}"
    run.abort(RuntimeError("test over"))
    # Steps taken outside a run advance the bar given to watch_stop.
    other = build(tiny_llama, num_train_epochs=1)
    bar = run.progress.__class__(total=2, file=io.StringIO())
    other.watch_stop(StopRequest(), bar)
    other.train_steps(1, MetricWindow())
    assert bar.n == 2 and other.state.global_step == 2


# ----- a stop that comes while a boundary is saved ------------------------------------------------------------------
def closed_run(model, tmp_path, interval, epochs=2):
    trainer = build(model, num_train_epochs=epochs)
    run = trainer.start_run(checkpoint_dir=tmp_path, checkpoint_interval=interval, progress_bar=False)
    for _ in range(epochs - 1):
        run.run_boundary()
    run.close_boundary()
    return trainer, run


def test_a_stop_that_came_while_a_boundary_was_written_stops_right_after_it(tiny_llama, tmp_path):
    trainer, run = closed_run(tiny_llama, tmp_path, interval=1, epochs=3)
    run.request.signal_name = "SIGTERM"
    report = run.save_boundary({})
    written = tmp_path / "checkpoint-3"
    assert report.checkpoint == str(written) and run.reports[-1] is report
    assert str(run.stopped) == ("SIGTERM received while " + str(written) + " was written: training is complete and "
                                "saved; the run stopped before its end (resuming from that checkpoint only ends it)")
    assert run.stopped.checkpoint == str(written)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


def test_a_stop_that_came_while_a_middle_boundary_was_saved_names_it(tiny_llama, tmp_path):
    trainer, run = closed_run(tiny_llama, tmp_path / "every", interval=1)
    run.request.signal_name = "SIGINT"
    run.save_boundary({})  # checkpoint-2 of 2
    assert str(run.stopped).startswith("SIGINT received while ")
    skipped = build(tiny_llama, num_train_epochs=3)
    run = skipped.start_run(checkpoint_dir=tmp_path / "skip", checkpoint_interval=2, progress_bar=False)
    run.close_boundary()
    run.request.signal_name = "SIGTERM"
    report = run.save_boundary()
    assert report.checkpoint is None
    assert str(run.stopped) == "SIGTERM received while epoch 1 was saved: stopped after epoch 1"
    # Nothing was written for epoch 1 (the cadence skipped it): the stop writes where the run is.
    assert run.stopped.checkpoint == str(tmp_path / "skip" / "checkpoint-1-step2") and run.next_boundary is None
    second = build(tiny_llama, num_train_epochs=3)
    run = second.start_run(checkpoint_dir=tmp_path / "second", checkpoint_interval=1, progress_bar=False)
    run.close_boundary()
    run.request.signal_name = "SIGTERM"
    run.save_boundary()
    written = tmp_path / "second" / "checkpoint-1"
    assert str(run.stopped) == f"SIGTERM received while {written} was written: stopped after epoch 1"
    assert run.stopped.checkpoint == str(written) and run.last_checkpoint() == str(written)
    assert sorted(p.name for p in (tmp_path / "second").glob("checkpoint-*")) == ["checkpoint-1"]


@pytest.mark.parametrize("epochs, interval", [(3, 2), (2, 1)], ids=["final-save-off-the-interval", "on-the-interval"])
def test_a_stop_that_came_while_the_last_checkpoint_was_written_is_raised_by_finish_naming_it(tiny_llama, tmp_path,
                                                                                               epochs, interval):
    trainer = build(tiny_llama, num_train_epochs=epochs)
    run = trainer.start_run(checkpoint_dir=tmp_path, checkpoint_interval=interval, progress_bar=False)
    run.run_all()
    run.request.signal_name = "SIGTERM"
    with pytest.raises(TrainingInterrupted) as stopped:
        run.finish()
    last = tmp_path / f"checkpoint-{epochs}"
    assert str(stopped.value) == (f"SIGTERM received while {last} was written: training is complete and saved; the "
                                  "run stopped before its end (resuming from that checkpoint only ends it)")
    assert stopped.value.checkpoint == str(last)


def test_a_stop_without_a_checkpoint_directory_is_logged_without_a_resume_path(tiny_llama, caplog):
    trainer = build(tiny_llama, [StopAfter(1)], num_train_epochs=1)
    run = trainer.start_run(progress_bar=False)
    with caplog.at_level(logging.ERROR, logger="comlrl.training.run"):
        run.run_all()
    assert run.stopped.checkpoint is None and run.last_checkpoint() is None
    assert errors(caplog) == ["SIGTERM received: stopped after step 1"]


def test_a_failure_without_a_checkpoint_directory_saves_nothing_and_names_nothing(tiny_llama, caplog):
    def judge(completions_0, completions_1):
        if trainer.state.global_step == 1:
            raise ValueError("the judge fell over")
        return joint_letter_reward(completions_0, completions_1)

    trainer = build(tiny_llama, reward=judge, num_train_epochs=1)
    with caplog.at_level(logging.ERROR, logger="comlrl.training.run"):
        with pytest.raises(RewardCallError):
            with trainer.start_run(progress_bar=False) as run:
                run.run_all()
    assert run.failure_checkpoint is None and run.last_checkpoint() is None and errors(caplog) == []


def sigterm_during_the_wait(trainer) -> None:
    """From inside a reward call: SIGTERM this process, wait until the trainer's handler has seen it, then stay
    in the call long enough that the waiting thread (which looks every 0.05 s) finds the request."""
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 60
    while not trainer.stop_request.requested and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(1.0)


def test_a_signal_while_a_step_waits_for_its_reward_puts_the_step_back_and_the_resume_repeats_it(tiny_llama, tmp_path):
    calls = {"n": 0}

    def judge_then_sigterm(completions_0, completions_1):
        calls["n"] += 1
        if calls["n"] == 2:
            sigterm_during_the_wait(stopped)
        return joint_letter_reward(completions_0, completions_1)

    stopped = build(tiny_llama, reward=judge_then_sigterm, num_train_epochs=1, reward_timeout=60.0)
    run = stopped.start_run(checkpoint_dir=tmp_path, progress_bar=False)
    run.run_all()
    assert run.stopped is not None and stopped.state.global_step == 1
    assert run.stopped.checkpoint == str(tmp_path / "checkpoint-0-step1")
    whole = build(tiny_llama, num_train_epochs=1)
    whole.train()
    resumed = build(tiny_llama, num_train_epochs=1)
    resumed.train(resume_from_checkpoint=run.stopped.checkpoint, checkpoint_dir=tmp_path)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(weights(resumed), weights(whole)) for k in a)


# ----- failures in an evaluation, after a checkpoint ----------------------------------------------------------------
def test_a_failure_in_an_evaluation_is_checkpointed_with_the_evaluation_left_to_the_resume(tiny_llama, tmp_path,
                                                                                            caplog):
    def failing():
        raise ValueError("the evaluation fell over")

    trainer = build(tiny_llama, eval_dataset=EVAL_ROWS, eval_interval=1, num_train_epochs=1)
    trainer.use_evaluator(failing)
    with caplog.at_level(logging.ERROR, logger="comlrl.training.run"):
        with pytest.raises(ValueError, match="the evaluation fell over"):
            with trainer.start_run(checkpoint_dir=tmp_path, progress_bar=False) as run:
                run.run_all()
    path = tmp_path / "checkpoint-0-step1"
    assert run.failure_checkpoint == str(path) and trainer.state.pending_evaluation == 1
    assert errors(caplog) == [f"ValueError ended the run during the evaluation at step 1 (the step itself was "
                              f"finished); resume {'from'} {path}, which makes that evaluation first"]
    resumed = build(tiny_llama, eval_dataset=EVAL_ROWS, eval_interval=1, num_train_epochs=1)
    resumed.use_evaluator(CountingEvaluator())
    resumed.train(resume_from_checkpoint=str(path), checkpoint_dir=tmp_path)
    assert [step for step, _ in resumed.evaluations] == [1, 2]


# ----- how a run starts ----------------------------------------------------------------------------------------------
def test_a_run_started_without_a_cadence_checkpoints_every_boundary(tiny_llama, tmp_path):
    run = TrainingRun.start(build(tiny_llama, num_train_epochs=2), checkpoint_dir=tmp_path / "start")
    assert [report.checkpoint for report in run.run_all()] == [str(tmp_path / "start" / f"checkpoint-{n}")
                                                               for n in (1, 2)]
    run.finish()
    run = build(tiny_llama, num_train_epochs=2).start_run(checkpoint_dir=tmp_path / "start_run")
    assert run.run_all()[0].checkpoint == str(tmp_path / "start_run" / "checkpoint-1")
    run.finish()
    build(tiny_llama, num_train_epochs=2).train(checkpoint_dir=tmp_path / "train")
    assert sorted(p.name for p in (tmp_path / "train").glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]


def test_only_a_fresh_run_evaluates_before_training(tiny_llama, tmp_path):
    first = build(tiny_llama, [StopAfter(1)], eval_dataset=EVAL_ROWS, eval_before_training=True, num_train_epochs=1)
    first.use_evaluator(CountingEvaluator())
    run = first.start_run(checkpoint_dir=tmp_path, progress_bar=False)
    run.run_all()
    assert first.evaluations == [(0, {"eval/score": 1.0})]
    # A resume from the middle of epoch 1 (no boundary done yet) is no fresh run.
    resumed = build(tiny_llama, eval_dataset=EVAL_ROWS, eval_before_training=True, num_train_epochs=1)
    resumed.use_evaluator(CountingEvaluator())
    resumed.train(resume_from_checkpoint=run.stopped.checkpoint, checkpoint_dir=tmp_path)
    assert resumed.evaluations == [] and resumed.state.global_step == 2
    # Nor is a second run of a trainer that has trained.
    again = resumed.start_run(progress_bar=False)
    assert resumed.evaluations == [] and again.next_boundary is None
    again.finish()


def test_a_trainer_whose_tokenizers_cannot_encode_is_refused_before_training():
    from types import SimpleNamespace

    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_ctx=16, n_embd=8, n_layer=1, n_head=1))
    stand_in = SimpleNamespace(pad_token="<pad>", eos_token="</s>", pad_token_id=0, eos_token_id=1)
    trainer = MAGRPOTrainer(agents=[model], tokenizer=[stand_in], reward_func=lambda c: [0.0] * len(c),
                            train_dataset=Dataset.from_dict({"prompt": ["a b"]}),
                            args=MAGRPOConfig(agent_devices="cpu", num_generations=2, num_agents=1))
    with pytest.raises(ValueError, match=r"^the tokenizer given for agent_0 \(SimpleNamespace\) lacks __call__, decode, "
                                         r"which training needs"):
        trainer.train()
    assert trainer.state.global_step == 0


# ----- a stage's time, an update's NaN, a stop inside an evaluation, a checkpoint that cannot be made ----------------
class PausedMAGRPO(MAGRPOTrainer):
    """MAGRPO with a stage of known length before its update stages, timed with them."""

    step_stages = (MAGRPOTrainer.step_stages[:2] + (Stage("pause", ("rows",), "paused", timing="update_time"),)
                   + MAGRPOTrainer.step_stages[2:])

    def pause(self, rows):
        time.sleep(0.5)


def test_every_stage_adds_its_wall_time_to_its_timing(tiny_llama):
    trainer = PausedMAGRPO(agent_model=tiny_llama, num_agents=2, reward_func=joint_letter_reward,
                           train_dataset=Dataset.from_dict({"prompt": PROMPTS[:2]}),
                           args=MAGRPOConfig(num_agents=2, num_generations=2, max_new_tokens=2, num_train_epochs=1,
                                             per_device_train_batch_size=2, disable_tqdm=True, seed=3))
    [row] = trainer.train()
    assert row["update_time"] >= 0.5  # the pause and the stages after it
    assert row["step_time"] >= row["generation_time"] + row["reward_time"] + row["update_time"]


def test_a_nan_update_is_logged_as_nan_and_the_epochs_end_step_with_it(tiny_llama):
    recorder = MetricsRecorder()
    trainer = build(tiny_llama, [recorder], num_train_epochs=1, gradient_accumulation_steps=3,
                    max_nonfinite_updates=100)
    trainer.agents[0].lm_head.register_forward_hook(  # agent 0's logits are NaN in every update, never in sampling
        lambda module, inputs, output: output * float("nan") if torch.is_grad_enabled() else None)
    history = trainer.train()
    logs = training_logs(recorder)
    assert [record["step"] for record in logs] == [1, 2]
    assert all(math.isnan(row["agent_0/loss"]) for row in history)
    assert all(math.isnan(record["agent_0/loss"]) for record in logs)
    # The partial accumulation window the epoch's end applied, logged at its last step.
    [applied] = [record for record in recorder.records if "agent_0/grad_norm" in record]
    assert applied["step"] == 2 and math.isnan(applied["agent_0/grad_norm"]) and applied["agent_1/grad_norm"] > 0


def test_a_signal_while_an_evaluation_waits_for_its_reward_leaves_that_evaluation_to_the_resume(tiny_llama, tmp_path):
    sent = []

    def judge(completions_0, completions_1):
        if trainer.state.global_step == 1 and not sent:  # the first call after step 1: its evaluation
            sent.append(True)
            sigterm_during_the_wait(trainer)
        return joint_letter_reward(completions_0, completions_1)

    trainer = build(tiny_llama, reward=judge, eval_dataset=EVAL_ROWS, eval_interval=1, eval_num_samples=1,
                    num_train_epochs=1, reward_timeout=60.0)
    run = trainer.start_run(checkpoint_dir=tmp_path, progress_bar=False)
    run.run_all()
    assert str(run.stopped) == ("SIGTERM received: the evaluation at step 1 was not finished (step 1 itself was); "
                                "the resume makes that evaluation first")
    assert trainer.state.pending_evaluation == 1 and run.stopped.checkpoint == str(tmp_path / "checkpoint-0-step1")


class StateThatFails(TrainerCallback):
    """A callback with state of its own whose ``state_dict`` fails once armed."""

    armed = False

    def state_dict(self):
        if self.armed:
            raise OSError("the state store is gone")
        return {}

    def load_state_dict(self, state):
        pass


def test_a_checkpoint_that_cannot_be_made_after_a_failure_is_logged_and_the_failure_raised(tiny_llama, tmp_path,
                                                                                          caplog):
    state = StateThatFails()

    def judge(completions_0, completions_1):
        if trainer.state.global_step == 1:
            state.armed = True
            raise ValueError("the judge fell over")
        return joint_letter_reward(completions_0, completions_1)

    trainer = build(tiny_llama, [state], reward=judge, num_train_epochs=1)
    with caplog.at_level(logging.ERROR, logger="comlrl.training.run"):
        with pytest.raises(RewardCallError, match="the judge fell over"):
            with trainer.start_run(checkpoint_dir=tmp_path, progress_bar=False) as run:
                run.run_all()
    assert run.failure_checkpoint is None
    assert errors(caplog) == ["could not checkpoint after RewardCallError: the state store is gone"]


def test_a_stop_before_the_end_of_a_run_without_checkpoints_names_the_last_epoch(tiny_llama):
    trainer = build(tiny_llama, num_train_epochs=3)
    run = trainer.start_run(progress_bar=False)
    run.run_all()
    run.request.signal_name = "SIGTERM"
    with pytest.raises(TrainingInterrupted) as stopped:
        run.finish()
    assert str(stopped.value) == ("SIGTERM received while epoch 3 was saved: training is complete and saved; the run "
                                  "stopped before its end (resuming from that checkpoint only ends it)")
    assert stopped.value.checkpoint is None


# ----- a run whose boundaries are a preference run's stages ---------------------------------------------------------
def preference_run(model, output_dir):
    args = MADPOIterConfig(num_agents=2, num_generations=2, max_new_tokens=3, num_iterations=1, dpo_batch_size=4,
                           agent_learning_rate=1e-2, max_pairs_per_prompt=2, disable_tqdm=True, seed=3,
                           output_dir=str(output_dir))
    return MADPOIterTrainer(agent_model=model, reward_func=letters_reward, args=args,
                            train_dataset=Dataset.from_dict({"prompt": PROMPTS[:2]}))


def test_a_stage_boundary_reports_the_stages_own_metrics_and_a_resume_writes_beside_the_first_output(tiny_llama,
                                                                                                      tmp_path):
    out = tmp_path / "out"
    trainer = preference_run(tiny_llama, out)
    run = trainer.start_run(checkpoint_dir=tmp_path / "ck", progress_bar=False)
    assert trainer.output_path == out  # a fresh run writes into the output directory itself
    report = run.run_boundary()  # the collection: no policy step, so the steps' mean would be empty
    [record] = trainer.state.stage_records
    collected = {key: value for key, value in record.items() if key not in ("iteration", "stage")}
    assert report.boundary == Boundary(1, 3, "collect_preferences", 1)
    assert report.metrics == collected and collected["preferences/prompts"] == 2.0
    # A stage closed and saved without its metrics: the mean of its steps, of which there are none.
    run.close_boundary()
    assert run.save_boundary().metrics == {} and trainer.state.boundaries == 2
    run.abort(RuntimeError("test over"))
    with pytest.raises(ValueError, match="already contains files"):  # a fresh run never writes over a run's files
        preference_run(tiny_llama, out).start_run(checkpoint_dir=tmp_path / "again", progress_bar=False)
    resumed = preference_run(tiny_llama, out)
    run = resumed.start_run(resume_from_checkpoint=str(tmp_path / "ck" / "checkpoint-1"),
                            checkpoint_dir=tmp_path / "ck", progress_bar=False)
    assert resumed.output_path == out / "resume-1"
    run.abort(RuntimeError("test over"))


class UnrewardedMAGRPO(MAGRPOTrainer):
    """MAGRPO whose step metrics leave out ``reward_mean`` (as a subclass with metrics of its own may)."""

    def step_metrics(self, values):
        metrics = super().step_metrics(values)
        del metrics["reward_mean"]
        return metrics


def test_a_step_without_a_reward_mean_shows_nan_on_the_progress_bar(tiny_llama):
    trainer = UnrewardedMAGRPO(agent_model=tiny_llama, num_agents=2, reward_func=joint_letter_reward,
                               train_dataset=Dataset.from_dict({"prompt": PROMPTS[:2]}),
                               args=MAGRPOConfig(num_agents=2, num_generations=2, max_new_tokens=2, num_train_epochs=1,
                                                 per_device_train_batch_size=2, seed=3))
    run = trainer.start_run(progress_bar=True)
    assert run.run_steps(1) == 1
    assert run.progress.postfix == "reward=nan" and "reward_mean" not in trainer.history[-1]
    run.abort(RuntimeError("test over"))
