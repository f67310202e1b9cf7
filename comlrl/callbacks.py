"""Trainer callbacks: how the pipeline (or a user) receives metrics and boundary events."""

from __future__ import annotations

from typing import Any


class TrainerCallback:
    """Override any of these; the trainer calls them in order for each registered callback."""

    def on_train_begin(self, trainer: Any) -> None:
        pass

    def on_log(self, trainer: Any, metrics: dict[str, float], step: int) -> None:
        pass

    def on_epoch_end(self, trainer: Any, epoch: int) -> None:
        pass

    def on_train_end(self, trainer: Any) -> None:
        pass


class MetricsRecorder(TrainerCallback):
    """Keeps every logged metrics dict (with its step) in memory."""

    def __init__(self) -> None:
        self.records: list[dict[str, float]] = []

    def on_log(self, trainer: Any, metrics: dict[str, float], step: int) -> None:
        self.records.append({"step": step, **metrics})


def dispatch(callbacks: list[TrainerCallback], event: str, *args: Any) -> None:
    for callback in callbacks:
        getattr(callback, event)(*args)
