"""What every trainer's ``train()`` shares: seeding or resuming, the boundaries, checkpoints, a graceful stop.

A trainer built on :class:`TrainingLoop` provides ``args`` (with ``seed``), ``state`` (a
:class:`TrainerState`), ``data_parallel``, ``callbacks``, ``run_identity`` and
:meth:`TrainingLoop.run_boundaries`, plus what the checkpoint runner reads
(:mod:`comlrl.checkpointing.runner`): ``checkpoint_modules()``, ``state_dict()`` /
``load_state_dict()``, ``compat_settings()`` and ``check_resume_progress()``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from comlrl.callbacks import dispatch
from comlrl.errors import TrainingStopped
from comlrl.training.seeding import set_seed
from comlrl.training.signals import StopRequest, stop_on_signals

logger = logging.getLogger(__name__)


@dataclass
class TrainerState:
    """Training progress: what a checkpoint must restore to continue exactly."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    boundaries: int = 0
    nonfinite_updates: int = 0
    consecutive_nonfinite: int = 0
    history: list[dict[str, float]] = field(default_factory=list)


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


class TrainingLoop:
    """``train()``: begin (seed or resume), every remaining boundary with its checkpoint, end."""

    boundary_kind = "epoch"
    # Whether a stop between boundaries may be checkpointed (the loop can resume mid-boundary).
    supports_mid_boundary_checkpoints = True
    stop_request: StopRequest | None = None

    def run_boundaries(self, runner: Any) -> None:
        raise NotImplementedError

    def watch_stop(self, request: StopRequest) -> None:
        """Where the steps look for a stop request (SIGTERM/SIGINT)."""
        self.stop_request = request

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
        run resumed from is never deleted); ``save_total_limit`` is another name for it.
        """
        runner = self.begin_training(
            resume_from_checkpoint=resume_from_checkpoint, checkpoint_dir=checkpoint_dir,
            checkpoint_interval=checkpoint_interval, checkpoint_total_limit=checkpoint_total_limit,
            save_total_limit=save_total_limit,
        )
        with stop_on_signals() as request:
            self.watch_stop(request)
            try:
                self.run_boundaries(runner)
            except TrainingStopped as stopped:
                stopped.checkpoint = runner.save_interrupted() if self.supports_mid_boundary_checkpoints else None
                where = f"; resume from {stopped.checkpoint}" if stopped.checkpoint else ""
                logger.error("%s%s", stopped, where)
                raise
        self.end_training(runner)
        return self.state.history

    def check_can_train(self) -> None:
        """Refuse to start (before any work) when something training needs is missing: here, the training data."""
        if getattr(self, "train_dataset", None) is None:
            raise ValueError(
                f"{type(self).__name__} has no train_dataset: give train_dataset= to the constructor or set "
                "trainer.train_dataset before train()"
            )

    def begin_training(
        self,
        resume_from_checkpoint: Any = None,
        checkpoint_dir: Any = None,
        checkpoint_interval: int = 1,
        checkpoint_total_limit: int | None = None,
        save_total_limit: int | None = None,
    ) -> Any:
        """Seed a fresh run or restore a checkpoint, then ``on_train_begin``; returns the
        :class:`~comlrl.checkpointing.runner.CheckpointRunner` that saves the boundaries."""
        from comlrl.checkpointing.runner import CheckpointRunner

        limit = resolve_total_limit(checkpoint_total_limit, save_total_limit)
        self.check_can_train()
        runner = CheckpointRunner(self, checkpoint_dir=checkpoint_dir, checkpoint_interval=checkpoint_interval,
                                  resume_from_checkpoint=resume_from_checkpoint, save_total_limit=limit)
        if runner.resume_path is None and self.state.global_step == 0 and self.state.boundaries == 0:
            set_seed(self.args.seed)  # a fresh run is reproducible whatever ran before it
        runner.begin()
        self.data_parallel.seed(self.args.seed, self.state.global_step)
        dispatch(self.callbacks, "on_train_begin", self)
        return runner

    def end_training(self, runner: Any) -> None:
        runner.end()
        dispatch(self.callbacks, "on_train_end", self)
