"""The epoch loop's side of a trainer: the boundaries are epochs, each a sequence of steps.

:class:`EpochSteps` implements the protocol of :mod:`comlrl.training.loop` for the trainers that
own their agents (:class:`~comlrl.trainers.base.MultiAgentTrainer`): the plan (one boundary per
epoch), the next step of the epoch (its stages in order, then :meth:`EpochSteps.record_step`:
history, logging, the ``eval_interval`` evaluation, the stop request) and the epoch's end. The
run around it (:mod:`comlrl.training.run`) is the same for ``train()`` and for the flows.

A step is a short sequence of public stage methods (``step_stages``: rollout -> score ->
advantages -> update); :meth:`EpochSteps.train_step` runs them in order. Stages marked
``updates`` change weights or gradients: an exception before the first of them leaves the
trainer consistent once the step's RNGs and reward counters are put back (:class:`~comlrl.training.loop.StepGuard`).

Logging. A step's metrics join the run's logging window (:class:`~comlrl.training.metrics.MetricWindow`),
whose means reach the callbacks' ``on_log`` every ``logging_steps`` global steps and at the end of every
epoch: the epoch's last window, partial or not, with the metrics of the optimizer steps the epoch's end
applies (a partial accumulation window). What is logged therefore never depends on where a run was
stopped and resumed: an epoch's checkpoint holds no open window, and a mid-epoch one holds its steps in
the history, from which :meth:`EpochSteps.logging_window` reopens it.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from comlrl.callbacks import dispatch
from comlrl.data import batches, epoch_order
from comlrl.errors import TrainingInterrupted
from comlrl.parallel.memory import device_memory_metrics
from comlrl.progress import Boundary, epoch_plan
from comlrl.rollout.reward_calls import RewardWaitInterrupted
from comlrl.training.loop import TrainingLoop, rng_restorer
from comlrl.training.metrics import MetricWindow

logger = logging.getLogger(__name__)

# What the current thread's trainer is doing (``rollout-s3``: a stage and the step within the epoch,
# ``evaluate``), for whoever runs per-agent work on its behalf (the flows name their tasks after it).
_ACTIVITY: contextvars.ContextVar[str | None] = contextvars.ContextVar("comlrl_activity", default=None)


def current_activity() -> str | None:
    """The stage (and step within the epoch) or evaluation the trainer is in, e.g. ``update-s2``; None outside."""
    return _ACTIVITY.get()


@contextlib.contextmanager
def activity(name: str):
    token = _ACTIVITY.set(name)
    try:
        yield
    finally:
        _ACTIVITY.reset(token)


@dataclass(frozen=True)
class Stage:
    """One stage of a training step: ``values[output] = trainer.<method>(*values[inputs])``.

    ``values`` starts as ``{"rows": rows}``; ``timing`` names the metric its wall time adds to;
    ``updates`` marks a stage that changes weights, gradients or optimizer states.
    """

    method: str
    inputs: tuple[str, ...]
    output: str
    timing: str | None = None
    updates: bool = False


class EpochSteps(TrainingLoop):
    """Epoch boundaries made of steps (see the module docstring)."""

    step_stages: tuple[Stage, ...] = ()
    # Times the run's epochs repeat (a preference run's policy stage: once per iteration).
    schedule_repeats = 1
    # Fields added to every history row (set through :meth:`tag_steps`).
    history_tags: dict[str, Any] = {}
    evaluator: Callable[[], dict[str, float]] | None = None
    progress: Any = None

    # ----- the plan ------------------------------------------------------------------------------
    @classmethod
    def plan_boundaries(cls, args: Any) -> list[Boundary]:
        return epoch_plan(args.num_train_epochs)

    def planned_training_steps(self) -> int:
        return self.args.num_train_epochs * self.batches_per_epoch() * self.schedule_repeats

    @property
    def history(self) -> list[dict[str, float]]:
        """Every counted step's metrics (``step``, ``epoch``, the tags, the metrics), oldest first."""
        return self.state.history

    @property
    def evaluations(self) -> list[tuple[int, dict[str, float]]]:
        """``(global step, metrics)`` of every evaluation the ``eval_interval`` cadence made in this process."""
        return self.__dict__.setdefault("_evaluations", [])

    def watch_stop(self, request: Any, progress: Any = None) -> None:
        """Where the steps look for a stop request, and the progress bar they advance."""
        self.stop_request = request
        self.progress = progress
        self.reward.watch_stop(request)  # a wait for a reward call ends on a stop request too

    def tag_steps(self, **tags: Any) -> None:
        """Fields added to every following history row (e.g. a preference run's ``iteration``)."""
        self.history_tags = dict(tags)

    def use_evaluator(self, evaluator: Callable[[], dict[str, float]] | None) -> None:
        """What the ``eval_interval`` cadence calls instead of ``evaluate()`` (None: ``evaluate``)."""
        self.evaluator = evaluator

    # ----- the steps of an epoch -------------------------------------------------------------------
    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This process's prompts of every global batch of ``epoch`` (all of them in one process)."""
        cached = self.__dict__.get("_epoch_batches")
        key = (epoch, len(self.train_dataset), self.global_batch_size)
        if cached is None or cached[0] != key:
            order = epoch_order(len(self.train_dataset), self.args.seed, epoch, self.args.shuffle)
            cached = (key, [self.data_parallel.shard(batch) for batch in batches(order, self.global_batch_size)])
            self.__dict__["_epoch_batches"] = cached
        return cached[1]

    def epoch_rows(self) -> list[list[dict[str, Any]]]:
        """The rows of every batch left in the current epoch (from ``state.step_in_epoch``)."""
        remaining = self.epoch_batches(self.state.epoch)[self.state.step_in_epoch:]
        return [[self.train_dataset[int(index)] for index in batch] for batch in remaining]

    def steps_left(self) -> int:
        return max(len(self.epoch_batches(self.state.epoch)) - self.state.step_in_epoch, 0)

    def step_restorer(self) -> Callable[[], None]:
        """What puts the RNGs and the reward's counters back to where they are now."""
        rng, reward = rng_restorer(), copy.deepcopy(self.reward.state_dict())

        def restore() -> None:
            rng()
            self.reward.load_state_dict(reward)

        return restore

    def take_step(self, window: MetricWindow, progress: Any = None) -> None:
        self.finish_pending_evaluation()
        batch = self.epoch_batches(self.state.epoch)[self.state.step_in_epoch]
        rows = [self.train_dataset[int(index)] for index in batch]
        self.step_guard.begin(self.step_restorer())
        self.record_step(self.train_step(rows), window, progress if progress is not None else self.progress)

    def train_steps(self, until_epoch: int, window: MetricWindow) -> None:
        """Steps and epoch ends until ``state.epoch`` reaches ``until_epoch`` (a preference run's policy
        stage); stop requests, evaluation, history and logging as in a run of this trainer."""
        while self.state.epoch < until_epoch:
            while self.steps_left():
                self.take_step(window)
            self.end_epoch(window)

    def close_boundary(self, window: MetricWindow | None = None) -> dict[str, float]:
        if self.steps_left():
            raise RuntimeError(f"close_boundary() with {self.steps_left()} steps of epoch {self.state.epoch + 1} left")
        self.end_epoch(window)
        return {}

    def logging_window(self) -> MetricWindow:
        """The logging window where the run stands: the history's steps since the last log (none at an
        epoch's start), so a run resumed between two logs sends the same means as one never stopped."""
        step, in_epoch, every = self.state.global_step, self.state.step_in_epoch, self.args.logging_steps
        last_logged = max(step - in_epoch, step // every * every) if in_epoch else step
        window, fields = MetricWindow(), {"step", "epoch", *self.history_tags}
        for row in self.history:
            if row.get("step", 0) > last_logged:
                window.add({k: v for k, v in row.items() if k not in fields}, self.model_optimizers)
        return window

    def begin_step(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """The values a step's stages read and write, starting from the batch's rows."""
        self.reward.drain_monitor_metrics()  # discard what evaluation may have left
        return {"rows": rows, "step_started": time.perf_counter(), "timings": {}}

    def run_stage(self, stage: Stage, values: dict[str, Any]) -> Any:
        """Run one stage on ``values`` (in place), adding its wall time to ``values["timings"]``."""
        if stage.updates:
            self.step_guard.updating()
        started = time.perf_counter()
        with activity(f"{stage.method}-s{self.state.step_in_epoch + 1}"):
            values[stage.output] = getattr(self, stage.method)(*(values[name] for name in stage.inputs))
        if stage.timing:
            timings = values["timings"]
            timings[stage.timing] = timings.get(stage.timing, 0.0) + time.perf_counter() - started
        return values[stage.output]

    def step_metrics(self, values: dict[str, Any]) -> dict[str, float]:
        raise NotImplementedError

    def train_step(self, rows: list[dict[str, Any]]) -> dict[str, float]:
        """One step: every stage of ``step_stages`` in order, then the step's metrics (not yet counted)."""
        values = self.begin_step(rows)
        for stage in self.step_stages:
            self.run_stage(stage, values)
        return self.step_metrics(values)

    def dropped_so_far(self) -> int:
        """Training's samples whose reward was dropped, up to this step, over every process: under data
        parallelism each process counts its own share (of a step, or of a preference collection before a DPO
        stage's steps), so what each counted since the last recorded step is summed over the processes, and
        every process keeps that total (the one a checkpoint saves), from which the next counts start."""
        reward = self.reward
        if self.data_parallel.enabled:
            since = self.data_parallel.all_sum(torch.tensor([float(reward.dropped - reward.dropped_counted)]))
            reward.dropped = reward.dropped_counted + int(since.item())
        reward.dropped_counted = reward.dropped
        return reward.dropped

    def record_step(self, metrics: dict[str, float], window: MetricWindow, progress: Any = None) -> None:
        """Count a finished step: monitor metrics, progress, history, callbacks, periodic evaluation;
        then honour a stop request (:class:`~comlrl.errors.TrainingInterrupted`)."""
        metrics.update(self.reward.drain_monitor_metrics())
        metrics.update({"reward/dropped": float(self.dropped_so_far()),
                        "nonfinite_updates": float(self.state.nonfinite_updates)})
        metrics = self.data_parallel.average_metrics(metrics)
        metrics.update(device_memory_metrics(self.model_devices()))
        self.state.step_in_epoch += 1
        self.state.global_step += 1
        self.state.history.append({"step": self.state.global_step, "epoch": self.state.epoch, **self.history_tags,
                                   **metrics})
        self.step_guard.end()  # counted: the state is consistent again
        window.add(metrics, self.model_optimizers)
        if self.state.global_step % self.args.logging_steps == 0:
            self.log_window(window)
        self._maybe_evaluate()
        if progress is not None:
            progress.update(1)
            progress.set_postfix(reward=f"{metrics.get('reward_mean', float('nan')):.3f}")
        request = self.stop_request
        if request is not None and request.requested:
            raise TrainingInterrupted(f"{request.signal_name} received: stopped after step {self.state.global_step}")

    def end_epoch(self, window: MetricWindow | None = None) -> None:
        """Apply the epoch's pending gradients and log the epoch's last ``window`` with those optimizer
        steps' metrics (without a window, those metrics alone), then move to the next epoch."""
        self.finish_pending_evaluation()
        window = window if window is not None else MetricWindow()
        window.add(self.flush_optimizers(), self.model_optimizers)
        self.log_window(window)
        self.state.epoch += 1
        self.state.step_in_epoch = 0
        self.state.boundaries += 1
        dispatch(self.callbacks, "on_epoch_end", self, self.state.epoch)

    def log_window(self, window: MetricWindow) -> None:
        """Send ``window``'s means to the callbacks at the current global step and empty it (nothing when empty)."""
        averaged = window.flush()
        if averaged:
            logger.info("step %d: %s", self.state.global_step, averaged)
            dispatch(self.callbacks, "on_log", self, averaged, self.state.global_step)

    def _maybe_evaluate(self) -> None:
        interval = self.args.eval_interval
        if self.eval_dataset is not None and interval and self.state.global_step % interval == 0:
            self.state.pending_evaluation = self.state.global_step
            self.finish_pending_evaluation()

    def finish_pending_evaluation(self) -> None:
        """Make the ``eval_interval`` evaluation of the step just counted if it is still to be made. It is part
        of the step's completion: a stop or a failure inside it puts back the state from before it (RNGs,
        reward counters) and leaves it pending, so the checkpoint then written makes the resume run it, and
        only it, before the next step or the epoch's end."""
        step = self.state.pending_evaluation
        if not step:
            return
        self.step_guard.begin(self.step_restorer())
        try:
            self._record_evaluation()
        except RewardWaitInterrupted as stopped:
            raise RewardWaitInterrupted(
                f"{self.stop_request.signal_name} received: the evaluation at step {step} was not finished (step "
                f"{step} itself was); the resume makes that evaluation first") from stopped
        self.step_guard.end()
        self.state.pending_evaluation = 0

    def evaluate_before_training(self) -> None:
        """A fresh run's step-0 evaluation when ``eval_before_training`` is set (recorded and logged like the others)."""
        if self.eval_dataset is not None and getattr(self.args, "eval_before_training", False):
            self._record_evaluation()

    def _record_evaluation(self) -> None:
        metrics = (self.evaluator or self.evaluate)()
        self.evaluations.append((self.state.global_step, dict(metrics)))
        dispatch(self.callbacks, "on_log", self, metrics, self.state.global_step)
