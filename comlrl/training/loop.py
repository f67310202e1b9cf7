"""The training loop's protocol: what a trainer provides so that one loop (:mod:`comlrl.training.run`)
can drive it, from ``train()`` or from a Prefect flow alike.

A run is a sequence of **boundaries**, each ending in a possible checkpoint: an epoch (its steps,
then the epoch's end) or a PbRL stage (one call). A trainer built on :class:`TrainingLoop` provides

- ``plan_boundaries(args)`` (a classmethod: the plan needs no model) and ``state`` (a :class:`comlrl.progress.TrainerState`);
- ``steps_left()``, ``take_step(window, progress)`` and ``close_boundary(window)``: the steps of the
  current boundary one at a time, then its end (an epoch's end, or the whole PbRL stage), the run's
  logging window (``logging_window()``: a :class:`~comlrl.training.metrics.MetricWindow`) passed to both;
- ``recover_after_failure()``: whether its state is consistent after an exception ended a step;
- ``history`` and ``evaluations``: the per-step metrics and the evaluations made so far;
- what the checkpoint runner reads (:mod:`comlrl.checkpointing.runner`): ``checkpoint_modules()``,
  ``state_dict()`` / ``load_state_dict()``, ``compat_settings()``, ``check_resume_progress()`` and
  ``data_parallel`` (a :class:`comlrl.parallel.distributed.DataParallel`, one process or several).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from comlrl.progress import Boundary
from comlrl.seeding import capture_rng_state, restore_rng_state
from comlrl.tokenizers import check_can_tokenize
from comlrl.training.metrics import MetricWindow
from comlrl.training.signals import StopRequest

logger = logging.getLogger(__name__)


class StepGuard:
    """Where an exception would leave a trainer: between steps (consistent), inside a step before
    any update (consistent again once the step's starting RNGs and counters are put back), or
    inside an update (weights, gradients or optimizer states half changed: not consistent).

    The step's owner calls :meth:`begin` with what restores its starting point, :meth:`updating`
    when the step starts changing weights or gradients, and :meth:`end` once the step is counted.
    """

    def __init__(self) -> None:
        self._restore: Callable[[], None] | None = None
        self._inside = False

    def begin(self, restore: Callable[[], None]) -> None:
        self._inside, self._restore = True, restore

    def updating(self) -> None:
        self._restore = None

    def end(self) -> None:
        self._inside, self._restore = False, None

    def recover(self) -> bool:
        """After an exception: put the step's starting point back if that makes the state consistent;
        whether the state is now consistent (a checkpoint of it continues the run exactly)."""
        if not self._inside:
            return True
        restore, self._restore = self._restore, None
        self._inside = False
        if restore is None:
            return False
        restore()
        return True


def rng_restorer() -> Callable[[], None]:
    """A function that puts every RNG back to its state now."""
    state = capture_rng_state()
    return lambda: restore_rng_state(state)


class TrainingLoop:
    """``train()`` and :meth:`start_run`: the one loop over a trainer's boundaries (see the module docstring)."""

    boundary_kind = "epoch"
    # Whether a stop between boundaries may be checkpointed (the loop can resume mid-boundary).
    supports_mid_boundary_checkpoints = True
    stop_request: StopRequest | None = None

    # ----- what a trainer provides ------------------------------------------------------------------
    @classmethod
    def plan_boundaries(cls, args: Any) -> list[Boundary]:
        """Every boundary of a run with config ``args`` (no model is needed)."""
        raise NotImplementedError

    def boundary_plan(self) -> list[Boundary]:
        return self.plan_boundaries(self.args)

    def total_boundaries(self) -> int:
        return len(self.boundary_plan())

    def steps_left(self) -> int:
        """Training steps left in the current boundary before :meth:`close_boundary` (0 for a PbRL stage)."""
        raise NotImplementedError

    def take_step(self, window: Any, progress: Any = None) -> None:
        """The next training step of the current boundary, counted and recorded."""
        raise NotImplementedError

    def close_boundary(self, window: Any = None) -> dict[str, float]:
        """End the current boundary (an epoch's end, logging what ``window`` holds, or a whole PbRL stage);
        the stage's metrics."""
        raise NotImplementedError

    def logging_window(self) -> MetricWindow:
        """The run's logging window as the trainer's progress leaves it (empty here: nothing is open between
        boundaries)."""
        return MetricWindow()

    def recover_after_failure(self) -> bool:
        """After an exception: whether the state is consistent (see :class:`StepGuard`)."""
        return self.step_guard.recover()

    def planned_training_steps(self) -> int:
        """Training steps of the whole run (the progress bar's total)."""
        raise NotImplementedError

    def on_run_begin(self, resuming: bool) -> None:
        """Hook: the run has been seeded or restored, before ``on_train_begin``."""

    def on_run_end(self) -> None:
        """Hook: every boundary is done, before the final checkpoint."""

    def watch_stop(self, request: StopRequest) -> None:
        """Where the steps look for a stop request (SIGTERM/SIGINT)."""
        self.stop_request = request

    @property
    def run_identity(self) -> dict[str, Any]:
        """The tracking runs this training logs to (``wandb``, ``mlflow``; None until known): every checkpoint
        records them, and a resume logs to them again. Set through :meth:`record_tracking_run`."""
        return self.__dict__.setdefault("_run_identity", {"wandb": None, "mlflow": None})

    def record_tracking_run(self, tracker: str, identity: dict[str, Any] | None) -> None:
        """Name the ``tracker`` run (``wandb`` / ``mlflow``) this training logs to."""
        if tracker not in ("wandb", "mlflow"):
            raise ValueError(f"tracker must be 'wandb' or 'mlflow', got {tracker!r}")
        self.run_identity[tracker] = identity

    @property
    def preference_pairs(self) -> Any:
        """The preference pairs collected so far (a ``datasets.Dataset``); None for trainers without."""
        return None

    @property
    def step_guard(self) -> StepGuard:
        guard = self.__dict__.get("_step_guard")
        if guard is None:
            guard = self.__dict__["_step_guard"] = StepGuard()
        return guard

    # ----- the loop ------------------------------------------------------------------------------------
    def start_run(
        self,
        resume_from_checkpoint: Any = None,
        checkpoint_dir: Any = None,
        checkpoint_interval: int = 1,
        checkpoint_total_limit: int | None = None,
        save_total_limit: int | None = None,
        progress_bar: bool | None = None,
    ) -> Any:
        """Seed a fresh run or restore a checkpoint; returns the :class:`~comlrl.training.run.TrainingRun`
        that runs the boundaries (``train()`` runs them all; a flow runs them a task at a time)."""
        from comlrl.training.run import TrainingRun

        return TrainingRun.start(self, resume_from_checkpoint=resume_from_checkpoint, checkpoint_dir=checkpoint_dir,
                                 checkpoint_interval=checkpoint_interval,
                                 checkpoint_total_limit=checkpoint_total_limit, save_total_limit=save_total_limit,
                                 progress_bar=progress_bar)

    def train(
        self,
        resume_from_checkpoint: Any = None,
        checkpoint_dir: Any = None,
        checkpoint_interval: int = 1,
        checkpoint_total_limit: int | None = None,
        save_total_limit: int | None = None,
    ) -> list[dict[str, float]]:
        """Run every remaining boundary; returns the per-step metrics history.

        ``checkpoint_total_limit`` keeps only the newest N complete checkpoints (the one the
        run resumed from is never deleted); ``save_total_limit`` is another name for it. A
        SIGTERM/SIGINT finishes the step in progress, writes ``checkpoint-N-stepS`` and raises
        :class:`~comlrl.errors.TrainingInterrupted`; an exception in a step before its update
        does the same (see :meth:`comlrl.training.run.TrainingRun.abort`).
        """
        with self.start_run(resume_from_checkpoint=resume_from_checkpoint, checkpoint_dir=checkpoint_dir,
                            checkpoint_interval=checkpoint_interval, checkpoint_total_limit=checkpoint_total_limit,
                            save_total_limit=save_total_limit) as run:
            run.run_all()
            if run.stopped is not None:
                raise run.stopped
            return run.finish()

    def check_can_train(self) -> None:
        """Refuse to start (before any work) when something training needs is missing: the training data, or a
        tokenizer method (a stand-in tokenizer builds a trainer, as in the original comlrl, but does not train)."""
        if getattr(self, "train_dataset", None) is None:
            raise ValueError(
                f"Trainer: training requires a train_dataset: {type(self).__name__} has none; give train_dataset= "
                "to the constructor or set trainer.train_dataset before train()"
            )
        check_can_tokenize(getattr(self, "tokenizers", None) or [])
