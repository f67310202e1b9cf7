"""What a run's boundaries are, what they are called in the Prefect UI, and what each one achieved.

A boundary is one checkpoint of a run: an epoch (MAGRPO, IAC, MAAC, ...) or a PbRL stage
(preference collection, reward-model fit, policy update). The flow runs each as a subflow named
by :attr:`Boundary.title` ("epoch 2 of 3", "iteration 1 · reward-model fit (2/3)") whose tasks
are named by :meth:`Boundary.task_name` ("epoch 2 · steps 1–8: rollout, score, advantages,
update"). :func:`boundary_row` condenses a finished boundary into the row of the run's table
artifact. Everything here is a pure function of the spec, the trainer class or the metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from flows.spec import RunSpec, algorithm_of

# Readable names of the PbRL stages (the trainers' STAGES are method names).
STAGE_TITLES = {
    "collect_preferences": "preference collection",
    "fit_reward_model": "reward-model fit",
    "learn_policy": "policy update",
}
# The evaluation metric a run is judged by: the task reward where a learned reward also exists.
EVAL_METRICS = ("eval/task_reward_mean", "eval/reward_mean")
REWARD_METRICS = ("reward_mean", "policy/task_reward_mean", "pbrl/policy/task_reward_mean")


@dataclass(frozen=True)
class Boundary:
    number: int  # 1-based
    total: int
    stage: str | None = None  # a PbRL stage's method name; None for an epoch
    iteration: int | None = None  # 1-based PbRL iteration

    @property
    def label(self) -> str:
        if self.stage is None:
            return f"epoch {self.number}"
        return f"iteration {self.iteration} · {STAGE_TITLES.get(self.stage, self.stage.replace('_', ' '))}"

    @property
    def title(self) -> str:
        """The boundary subflow's run name."""
        if self.stage is None:
            return f"epoch {self.number} of {self.total}"
        return f"{self.label} ({self.number}/{self.total})"

    def task_name(self, what: str) -> str:
        return f"{self.label} · {what}"


def plan(spec: RunSpec) -> list[Boundary]:
    """Every boundary of the run ``spec`` describes, from its trainer class and config (nothing loads)."""
    algorithm = algorithm_of(spec)
    trainer_class, config_class = algorithm.load()
    config = config_class(**spec.config)
    if algorithm.kind != "pbrl":
        return [Boundary(number, config.num_train_epochs) for number in range(1, config.num_train_epochs + 1)]
    stages = tuple(getattr(trainer_class, "STAGES", ()) or STAGE_TITLES)
    planned = getattr(trainer_class, "planned_boundaries", None)
    total = planned(config) if planned is not None else len(stages) * (
        config.num_iterations if algorithm.name == "marlhf_iter" else 1)
    return [Boundary(number, total, stages[(number - 1) % len(stages)], (number - 1) // len(stages) + 1)
            for number in range(1, total + 1)]


def chunks(num_steps: int, steps_per_task: int | None) -> list[range]:
    """Consecutive ranges of step indices (0-based) of at most ``steps_per_task`` (None: one range)."""
    if num_steps <= 0:
        return []
    size = num_steps if not steps_per_task else steps_per_task
    return [range(start, min(start + size, num_steps)) for start in range(0, num_steps, size)]


def steps_task_name(boundary: Boundary, first: int, last: int, stages: Sequence[str]) -> str:
    """``epoch 2 · steps 1–8: rollout, score, advantages, update`` (steps numbered from 1 within the epoch)."""
    steps = f"step {first}" if first == last else f"steps {first}–{last}"
    return boundary.task_name(f"{steps}: {', '.join(stages)}" if stages else steps)


def primary_eval(evaluation: dict[str, float]) -> tuple[str | None, float | None]:
    """``(metric, value)`` a run is judged by (:data:`EVAL_METRICS`), ``(None, None)`` without evaluation."""
    for metric in EVAL_METRICS:
        value = evaluation.get(metric)
        if value is not None and math.isfinite(value):
            return metric, float(value)
    return None, None


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def boundary_metrics(history: Sequence[dict[str, Any]], first_step: int, stage_metrics: dict[str, float] | None) -> dict[str, Any]:
    """The boundary's training metrics: its stage's (PbRL), else the mean over its steps
    (history rows after global step ``first_step``)."""
    if stage_metrics is not None:
        return dict(stage_metrics)
    rows = [row for row in history if row.get("step", 0) > first_step]
    keys = {key for row in rows for key, value in row.items() if isinstance(value, (int, float))}
    return {key: _mean([row[key] for row in rows if key in row]) for key in sorted(keys)}


def boundary_row(boundary: Boundary, metrics: dict[str, Any], evaluation: dict[str, float], global_step: int,
                 checkpoint: str, seconds: float) -> dict[str, Any]:
    """One row of the run's table artifact: reward, eval reward, loss and KL where the metrics have them."""
    reward = next((metrics[key] for key in REWARD_METRICS if metrics.get(key) is not None), None)
    losses = [value for key, value in metrics.items() if (key == "loss" or key.endswith("/loss")) and value is not None]
    kls = [value for key, value in metrics.items() if key.endswith("kl_mean") and value is not None]
    _, eval_reward = primary_eval(evaluation)
    return {
        "boundary": boundary.label,
        "step": global_step,
        "reward": _round(reward),
        "eval_reward": _round(eval_reward),
        "loss": _round(_mean(losses)),
        "kl": _round(_mean(kls)),
        "checkpoint": checkpoint,
        "seconds": round(seconds, 2),
    }


def _round(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else round(float(value), 4)


def describe(row: dict[str, Any]) -> str:
    """A boundary's one-line summary (the subflow's state message, the console's line)."""
    parts = [row["boundary"]]
    for key, name in (("reward", "reward"), ("eval_reward", "eval"), ("loss", "loss"), ("kl", "kl")):
        if row.get(key) is not None:
            parts.append(f"{name} {row[key]:.3f}")
    parts.append(f"{row['seconds']:.1f} s")
    return " · ".join(parts)
