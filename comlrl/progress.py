"""A run's progress and plan as data: what a checkpoint restores (:class:`TrainerState`) and the boundaries
a trainer's run is made of (:class:`Boundary`). Shared by the training loop, the checkpoints and the flows."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainerState:
    """Training progress: what a checkpoint must restore to continue exactly."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    boundaries: int = 0
    nonfinite_updates: int = 0
    consecutive_nonfinite: int = 0
    # The global step whose ``eval_interval`` evaluation a stop or failure cut short (0: none); a
    # checkpoint holding it makes the resume run that evaluation, and only it, before going on.
    pending_evaluation: int = 0
    history: list[dict[str, float]] = field(default_factory=list)


@dataclass(frozen=True)
class Boundary:
    """One boundary of a run's plan: an epoch (``stage`` None) or a PbRL stage of an iteration."""

    number: int  # 1-based
    total: int
    stage: str | None = None  # a PbRL stage's method name
    iteration: int | None = None  # 1-based PbRL iteration

    @property
    def kind(self) -> str:
        return "epoch" if self.stage is None else "pbrl_stage"

    @property
    def label(self) -> str:
        if self.stage is None:
            return f"epoch {self.number}"
        return f"iteration {self.iteration} · {self.stage.replace('_', ' ')}"


def epoch_plan(num_epochs: int) -> list[Boundary]:
    return [Boundary(number, num_epochs) for number in range(1, num_epochs + 1)]


def stage_plan(stages: tuple[str, ...], iterations: int) -> list[Boundary]:
    total = len(stages) * iterations
    return [Boundary(number, total, stages[(number - 1) % len(stages)], (number - 1) // len(stages) + 1)
            for number in range(1, total + 1)]
