"""Exceptions that end a training run on purpose (after its state is saved), and the refusal of a bad checkpoint."""

from __future__ import annotations


class TrainingStopped(Exception):
    """Training ended before completion; ``checkpoint`` is where it can resume (or None). ``mid_step``:
    raised inside a step that did not finish (its starting point is put back before a checkpoint)."""

    mid_step = False

    def __init__(self, message: str, checkpoint: str | None = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


class TrainingInterrupted(TrainingStopped):
    """SIGTERM or SIGINT arrived: the current step finished, then the run stopped."""


class NonFiniteTrainingError(TrainingStopped):
    """Too many consecutive updates had a NaN/inf loss or gradient."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed, raised before any work starts: ``checkpoint`` (its
    directory), ``file`` (relative to it, or None for the whole directory) and ``problem``."""

    def __init__(self, checkpoint: object, file: str | None, problem: str) -> None:
        self.checkpoint, self.file, self.problem = str(checkpoint), file, problem
        super().__init__(f"checkpoint {self.checkpoint!r}{f', {file}' if file else ''}: {problem}")

    def __reduce__(self):  # picklable (a Dask or Prefect worker sends errors back)
        return type(self), (self.checkpoint, self.file, self.problem)


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint directory does not exist."""


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (a full disk, a file-size limit, a permission): ``checkpoint`` (the
    directory being written), ``file`` (relative to it) and ``cause`` in words. Earlier checkpoints
    are intact and no staging directory is left; ``last_good`` names the newest checkpoint on disk
    (set by the runner)."""

    def __init__(self, checkpoint: object, file: str, cause: str, errno_code: int | None = None,
                 last_good: str | None = None) -> None:
        self.checkpoint, self.file, self.cause, self.last_good = str(checkpoint), file, cause, last_good
        super().__init__(errno_code, f"writing {file} of checkpoint {self.checkpoint!r} failed: {cause}")

    def __str__(self) -> str:
        return self.strerror + (f"; the last good checkpoint is {self.last_good}" if self.last_good else "")

    def __reduce__(self):
        return type(self), (self.checkpoint, self.file, self.cause, self.errno, self.last_good)


class SandboxUnavailable(RuntimeError):
    """The sandbox's isolation cannot run on this machine; the message names the missing mechanism and the
    weaker mode a user may opt into (``isolation="rlimits"``). Raised before any program runs."""
