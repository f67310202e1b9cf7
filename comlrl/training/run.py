"""One training run of a trainer: the loop over its boundaries that ``train()`` and the Prefect flows share.

:meth:`TrainingRun.start` seeds a fresh run or restores a checkpoint. Then, boundary by boundary:
:meth:`TrainingRun.run_steps` (some or all of the boundary's steps), :meth:`TrainingRun.close_boundary`
(an epoch's end, or a whole PbRL stage) and :meth:`TrainingRun.save_boundary` (the checkpoint,
every ``checkpoint_interval`` boundaries); :meth:`TrainingRun.run_boundary` does all three and
:meth:`TrainingRun.run_all` every boundary. :meth:`TrainingRun.finish` ends the run.

Everything a run guarantees lives here once, whoever drives it:

- **Stop signals**: while a method of the run works, SIGTERM/SIGINT let the current step finish,
  then ``checkpoint-N-stepS`` is written and :attr:`TrainingRun.stopped` is set (the method returns;
  ``train()`` raises it). A signal during a checkpoint's write stops the run right after that
  checkpoint (after the final one too: the training is complete, but the run did not end). A
  second signal interrupts at once.
- **Failures**: an exception in a step is checkpointed the same way when the step had not yet
  changed any weight (the step's RNGs and counters are put back first, so the resume repeats the
  step exactly); otherwise the last checkpoint stands (:meth:`TrainingRun.abort`).
- **Evaluation cadence** (``eval_interval`` steps), logging, the non-finite guard and the metrics
  history are the trainer's step (:meth:`~comlrl.training.loop.TrainingLoop.take_step`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from tqdm.auto import tqdm

from comlrl.callbacks import dispatch
from comlrl.errors import CheckpointWriteError, TrainingInterrupted, TrainingStopped
from comlrl.progress import Boundary
from comlrl.seeding import set_seed
from comlrl.training.signals import StopRequest, stop_on_signals

logger = logging.getLogger(__name__)


def resolve_total_limit(checkpoint_total_limit: int | None, save_total_limit: int | None) -> int | None:
    """One checkpoint limit from its two names (``checkpoint_total_limit``, ``save_total_limit``)."""
    for name, value in (("checkpoint_total_limit", checkpoint_total_limit), ("save_total_limit", save_total_limit)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
    if checkpoint_total_limit is None:
        return save_total_limit
    if save_total_limit is not None and save_total_limit != checkpoint_total_limit:
        raise ValueError(
            f"checkpoint_total_limit={checkpoint_total_limit!r} and save_total_limit={save_total_limit!r} disagree; "
            "they name the same setting, give one of them"
        )
    return checkpoint_total_limit



@dataclass
class BoundaryReport:
    """What one boundary achieved: its checkpoint (None when the cadence skipped it), its metrics (a
    PbRL stage's own, else the mean of its steps'), the evaluations made during it, its steps and time."""

    boundary: Boundary
    checkpoint: str | None
    metrics: dict[str, float]
    evaluations: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    first_step: int = 0  # global step before the boundary's first step
    last_step: int = 0
    seconds: float = 0.0

    @property
    def evaluation(self) -> dict[str, float]:
        """The last evaluation made during the boundary ({} without one)."""
        return dict(self.evaluations[-1][1]) if self.evaluations else {}


def mean_step_metrics(history: Sequence[dict[str, Any]], after_step: int) -> dict[str, float]:
    """The mean of every numeric metric over the history rows after global step ``after_step`` (non-finite values skipped)."""
    rows = [row for row in history if row.get("step", 0) > after_step]
    sums: dict[str, list[float]] = {}
    for row in rows:
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                sums.setdefault(key, []).append(float(value))
    return {key: sum(values) / len(values) for key, values in sorted(sums.items())}


class TrainingRun:
    """A started run (see the module docstring); use it as a context manager so that an exception
    escaping the block is checkpointed (:meth:`abort`)."""

    def __init__(self, trainer: Any, runner: Any, progress_bar: bool | None = None) -> None:
        self.trainer = trainer
        self.runner = runner
        self.request = StopRequest()
        self.window = trainer.logging_window()  # a run resumed between two logs reopens the window
        self.stopped: TrainingStopped | None = None
        self.failure_checkpoint: str | None = None
        self.reports: list[BoundaryReport] = []
        self.plan: list[Boundary] = trainer.boundary_plan()
        self._boundary_started: tuple[float, int, int] | None = None  # (time, global step, evaluations seen)
        trainer.watch_stop(self.request)
        show = progress_bar if progress_bar is not None else not getattr(trainer.args, "disable_tqdm", False)
        self.progress = tqdm(total=trainer.planned_training_steps(), initial=trainer.state.global_step,
                             disable=not show or not trainer.data_parallel.is_main, desc="train")

    @classmethod
    def start(cls, trainer: Any, resume_from_checkpoint: Any = None, checkpoint_dir: Any = None,
              checkpoint_interval: int = 1, checkpoint_total_limit: int | None = None,
              save_total_limit: int | None = None, progress_bar: bool | None = None) -> "TrainingRun":
        """Seed a fresh run or restore ``resume_from_checkpoint`` (every check before anything loads), then
        ``on_train_begin``."""
        from comlrl.checkpointing.runner import CheckpointRunner

        limit = resolve_total_limit(checkpoint_total_limit, save_total_limit)
        trainer.check_can_train()
        runner = CheckpointRunner(trainer, checkpoint_dir=checkpoint_dir, checkpoint_interval=checkpoint_interval,
                                  resume_from_checkpoint=resume_from_checkpoint, save_total_limit=limit)
        try:
            fresh = runner.resume_path is None and trainer.state.global_step == 0 and trainer.state.boundaries == 0
            if fresh:
                set_seed(trainer.args.seed)  # a fresh run is reproducible whatever ran before it
            runner.begin()
            trainer.data_parallel.seed(trainer.args.seed, trainer.state.global_step)
            trainer.on_run_begin(resuming=runner.resume_path is not None)
            dispatch(trainer.callbacks, "on_train_begin", trainer)
            if fresh and hasattr(trainer, "evaluate_before_training"):
                trainer.evaluate_before_training()  # forks the RNG: training draws the same numbers either way
            return cls(trainer, runner, progress_bar)
        except BaseException:
            runner.release()
            raise

    # ----- where the run is ------------------------------------------------------------------------
    @property
    def next_boundary(self) -> Boundary | None:
        """The boundary to run next; None once every boundary is done or the run stopped."""
        done = self.trainer.state.boundaries
        return self.plan[done] if self.stopped is None and done < len(self.plan) else None

    def steps_left(self) -> int:
        """Steps of the current boundary still to run before :meth:`close_boundary`."""
        return self.trainer.steps_left() if self.next_boundary is not None else 0

    # ----- running ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def signals(self) -> Iterator[StopRequest]:
        """SIGTERM/SIGINT set this run's stop request while the block runs (main thread only)."""
        with stop_on_signals(self.request) as request:
            yield request

    @contextlib.contextmanager
    def _working(self) -> Iterator[None]:
        """Signals handled, and a stop (a signal, the non-finite guard) turned into :attr:`stopped`."""
        with self.signals():
            try:
                yield
            except TrainingStopped as stopped:
                self._stop(stopped)

    def _begin_boundary(self) -> None:
        if self._boundary_started is None:
            self._boundary_started = (time.perf_counter(), self.trainer.state.global_step,
                                      len(self.trainer.evaluations))

    def run_steps(self, count: int | None = None) -> int:
        """Run up to ``count`` (None: all) of the current boundary's remaining steps; how many ran."""
        ran = 0
        with self._working():
            if self.next_boundary is None:
                return 0
            if self.request.requested:  # the signal came between two calls (an orchestrator's tasks): no more steps
                raise TrainingInterrupted(f"{self.request.signal_name} received: stopped after step "
                                          f"{self.trainer.state.global_step}")
            self._begin_boundary()
            total = self.trainer.steps_left() if count is None else min(count, self.trainer.steps_left())
            for _ in range(total):
                self.trainer.take_step(self.window, self.progress)  # raises TrainingInterrupted on a stop request
                ran += 1
        return ran

    def close_boundary(self) -> dict[str, float] | None:
        """End the current boundary once its steps are done (a PbRL stage runs here, whole); its
        metrics, or None when the run stopped."""
        if self.steps_left():
            self.run_steps()
        with self._working():
            if self.next_boundary is None:
                return None
            self._begin_boundary()
            metrics = self.trainer.close_boundary(self.window)
            if self.request.requested:
                raise TrainingInterrupted(f"{self.request.signal_name} received: stopped after "
                                          f"{self.plan[self.trainer.state.boundaries - 1].label}")
            return metrics
        return None

    def save_boundary(self, metrics: dict[str, float] | None = None) -> BoundaryReport:
        """The checkpoint of the boundary just closed (when ``checkpoint_interval`` says so) and its report."""
        boundary = self.plan[self.trainer.state.boundaries - 1]
        started, first_step, seen = self._boundary_started or (time.perf_counter(), self.trainer.state.global_step,
                                                                len(self.trainer.evaluations))
        with self.signals():
            checkpoint = self.runner.on_boundary()
        if metrics is None or boundary.stage is None:
            metrics = mean_step_metrics(self.trainer.history, first_step)
        report = BoundaryReport(boundary, str(checkpoint) if checkpoint is not None else None, metrics,
                                list(self.trainer.evaluations[seen:]), first_step, self.trainer.state.global_step,
                                time.perf_counter() - started)
        self._boundary_started = None
        self.reports.append(report)
        if self.request.requested:  # the signal came while the checkpoint was written: stop right after it
            with self.signals():
                self._stop_after_save(report.checkpoint, boundary.label)
        return report

    def run_boundary(self) -> BoundaryReport | None:
        """The current boundary's remaining steps, its end and its checkpoint; None when the run stopped."""
        metrics = self.close_boundary()
        if self.stopped is not None:
            return None
        return self.save_boundary(metrics)

    def run_all(self) -> list[BoundaryReport]:
        """Every remaining boundary (until a stop); the reports of this call's boundaries."""
        reports = []
        while self.next_boundary is not None:
            report = self.run_boundary()
            if report is not None:
                reports.append(report)
        return reports

    def finish(self) -> list[dict[str, float]]:
        """End a completed run: the final checkpoint if the cadence skipped it, ``on_train_end``; the history."""
        if self.stopped is not None:
            raise RuntimeError(f"the run stopped ({self.stopped}); resume it instead of finishing it")
        if self.trainer.state.boundaries < len(self.plan):
            raise RuntimeError(f"finish() with {len(self.plan) - self.trainer.state.boundaries} boundaries left")
        self.trainer.on_run_end()
        with self.signals():
            final = self.runner.end()
        if self.request.requested:
            self._stop_after_save(str(final) if final is not None else self.last_checkpoint(), self.plan[-1].label)
            raise self.stopped
        self.runner.release()
        self.progress.close()
        dispatch(self.trainer.callbacks, "on_train_end", self.trainer)
        return self.trainer.history

    # ----- stops and failures ----------------------------------------------------------------------
    def _stop(self, stopped: TrainingStopped) -> None:
        """A stop between steps: checkpoint where the run is (if it can resume there) and remember why."""
        trainer = self.trainer
        # A stop inside a step (a reward call was awaited) first puts the step's starting point back.
        consistent = not stopped.mid_step or trainer.recover_after_failure()
        if stopped.checkpoint is None and trainer.supports_mid_boundary_checkpoints and consistent:
            path = self.runner.save_interrupted()
            stopped.checkpoint = str(path) if path is not None else None
        where = f"; resume from {stopped.checkpoint}" if stopped.checkpoint else ""
        logger.error("%s%s", stopped, where)
        self.stopped = stopped
        self.runner.release()
        self.progress.close()

    def _stop_after_save(self, checkpoint: str | None, label: str) -> None:
        """A stop request that arrived while a boundary's (or the final) checkpoint was written: honoured
        now, before any further step, naming that checkpoint."""
        signal_name = self.request.signal_name
        written = f"while {checkpoint} was written" if checkpoint else f"while {label} was saved"
        if self.trainer.state.boundaries >= len(self.plan):
            message = (f"{signal_name} received {written}: training is complete and saved; the run stopped "
                       "before its end (resuming from that checkpoint only ends it)")
        else:
            message = f"{signal_name} received {written}: stopped after {label}"
        self._stop(TrainingInterrupted(message, checkpoint=checkpoint))

    def abort(self, error: BaseException) -> str | None:
        """Save what a resume needs after ``error`` ended the run outside the loop's own stops: a
        checkpoint of the last completed step when the trainer's state is consistent (the failed
        step had not changed any weight; its RNGs and counters are put back), else none (the last
        checkpoint stands). Returns the checkpoint written (also :attr:`failure_checkpoint`)."""
        try:
            return self._save_after_failure(error)
        finally:
            self.runner.release()

    def _save_after_failure(self, error: BaseException) -> str | None:
        if self.stopped is not None:
            return self.stopped.checkpoint
        self.progress.close()
        if isinstance(error, CheckpointWriteError):  # the disk refused a checkpoint: another one would fail too
            return None
        if not self.trainer.recover_after_failure() or not self.trainer.supports_mid_boundary_checkpoints:
            logger.error("%s ended the run inside an update; nothing new was saved (the last checkpoint is %s)",
                         type(error).__name__, self.runner.last_path or "none")
            return None
        try:
            path = self.runner.save_interrupted()
        except Exception as save_error:  # never mask the error that ended the run
            logger.error("could not checkpoint after %s: %s", type(error).__name__, save_error)
            return None
        self.failure_checkpoint = str(path) if path is not None else None
        pending = getattr(self.trainer.state, "pending_evaluation", 0)
        if path is not None and pending:
            logger.error("%s ended the run during the evaluation at step %d (the step itself was finished); "
                         "resume from %s, which makes that evaluation first", type(error).__name__, pending, path)
        elif path is not None:
            logger.error("%s ended the run after step %d; resume from %s", type(error).__name__,
                         self.trainer.state.global_step, path)
        return self.failure_checkpoint

    def last_checkpoint(self) -> str | None:
        """The newest checkpoint this run wrote or resumed from."""
        if self.stopped is not None and self.stopped.checkpoint:
            return self.stopped.checkpoint
        return self.failure_checkpoint or (str(self.runner.last_path) if self.runner.last_path else None)

    def __enter__(self) -> "TrainingRun":
        return self

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> bool:
        if error is not None:
            self.abort(error)
        return False
