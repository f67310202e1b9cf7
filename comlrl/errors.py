"""Exceptions that end a training run on purpose, after its state is saved."""

from __future__ import annotations


class TrainingStopped(Exception):
    """Training ended before completion; ``checkpoint`` is where it can resume (or None)."""

    def __init__(self, message: str, checkpoint: str | None = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


class TrainingInterrupted(TrainingStopped):
    """SIGTERM or SIGINT arrived: the current step finished, then the run stopped."""


class NonFiniteTrainingError(TrainingStopped):
    """Too many consecutive updates had a NaN/inf loss or gradient."""
