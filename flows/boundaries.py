"""What a run's boundaries are called in the Prefect UI, and the row each one adds to the run's table.

A boundary (:class:`comlrl.progress.Boundary`, planned by the trainer class) is one
checkpoint of a run: an epoch (MAGRPO, IAC, MAAC, ...) or a PbRL stage (preference collection,
reward-model fit, policy update). The flow runs each as a subflow named by :func:`title`
("epoch 2 of 3", "iteration 1 · reward-model fit (2/3)") whose tasks are named by
:func:`task_name` ("epoch 2 · steps 1–8: rollout, score, advantages, update").
:func:`boundary_row` condenses a finished boundary's report into the row of the run's table
artifact; :func:`recovered_report` rebuilds the report of a boundary whose checkpoint outlived its
row (a process killed in between) from the checkpoint and the run's logged metrics, and
:func:`eval_points` draws the eval curve from those metrics. Everything here is a pure function of
the spec, the trainer class, a report or records read from disk.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from comlrl.progress import Boundary
from comlrl.training.run import BoundaryReport, mean_step_metrics
from flows.spec import RunSpec

# Readable names of the PbRL stages (the trainers' STAGES are method names).
STAGE_TITLES = {
    "collect_preferences": "preference collection",
    "fit_reward_model": "reward-model fit",
    "learn_policy": "policy update",
}
# The evaluation metric a run is judged by: the task reward where a learned reward also exists.
EVAL_METRICS = ("eval/task_reward_mean", "eval/reward_mean")
REWARD_METRICS = ("reward_mean", "policy/task_reward_mean", "pbrl/policy/task_reward_mean")


def label(boundary: Boundary) -> str:
    """``epoch 2`` / ``iteration 1 · reward-model fit``."""
    if boundary.stage is None:
        return f"epoch {boundary.number}"
    return f"iteration {boundary.iteration} · {STAGE_TITLES.get(boundary.stage, boundary.stage.replace('_', ' '))}"


def title(boundary: Boundary) -> str:
    """The boundary subflow's run name."""
    if boundary.stage is None:
        return f"epoch {boundary.number} of {boundary.total}"
    return f"{label(boundary)} ({boundary.number}/{boundary.total})"


def task_name(boundary: Boundary, what: str) -> str:
    return f"{label(boundary)} · {what}"


def plan(spec: RunSpec) -> list[Boundary]:
    """Every boundary of the run ``spec`` describes, from its trainer class and config (nothing loads)."""
    return spec.classes()[0].plan_boundaries(spec.trainer_config)


def chunks(num_steps: int, steps_per_task: int | None) -> list[range]:
    """Consecutive ranges of step indices (0-based) of at most ``steps_per_task`` (None: one range)."""
    if num_steps <= 0:
        return []
    size = num_steps if not steps_per_task else steps_per_task
    return [range(start, min(start + size, num_steps)) for start in range(0, num_steps, size)]


def steps_task_name(boundary: Boundary, first: int, last: int, stages: Sequence[str]) -> str:
    """``epoch 2 · steps 1–8: rollout, score, advantages, update`` (steps numbered from 1 within the epoch)."""
    steps = f"step {first}" if first == last else f"steps {first}–{last}"
    return task_name(boundary, f"{steps}: {', '.join(stages)}" if stages else steps)


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


def boundary_row(report: Any) -> dict[str, Any]:
    """One row of the run's table artifact from a :class:`~comlrl.training.run.BoundaryReport`: reward, the
    boundary's last evaluation, loss and KL where the metrics have them."""
    metrics, evaluation = report.metrics, report.evaluation
    reward = next((metrics[key] for key in REWARD_METRICS if metrics.get(key) is not None), None)
    losses = [value for key, value in metrics.items() if (key == "loss" or key.endswith("/loss")) and value is not None]
    kls = [value for key, value in metrics.items() if key.endswith("kl_mean") and value is not None]
    norms = [value for key, value in metrics.items() if key.endswith("/grad_norm") and value is not None]
    _, eval_reward = primary_eval(evaluation)
    return {
        "boundary": label(report.boundary),
        "step": report.last_step,
        "reward": _round(reward),
        "eval_reward": _round(eval_reward),
        "loss": _round(_mean(losses)),
        "kl": _round(_mean(kls)),
        "grad_norm": _round(_mean(norms)),
        "checkpoint": report.checkpoint,
        "seconds": round(report.seconds, 2) if math.isfinite(report.seconds) else None,  # NaN: not measured
    }


def record(report: Any) -> dict[str, Any]:
    """What ``boundaries.jsonl`` keeps of a finished boundary: its number, checkpoint, row and last evaluation."""
    return {"number": report.boundary.number, "checkpoint": report.checkpoint, "row": boundary_row(report),
            "evaluation": report.evaluation}


def evaluations(logged: dict[str, list[tuple[int, float]]]) -> list[tuple[int, dict[str, float]]]:
    """``(step, {eval/...: value})`` of every evaluation in a run's logged metrics (``key -> [(step, value)]``,
    :func:`comlrl.tracking.logged_metrics`), by step."""
    by_step: dict[int, dict[str, float]] = {}
    for key, points in logged.items():
        if key.startswith("eval/"):
            for step, value in points:
                by_step.setdefault(step, {})[key] = value
    return sorted(by_step.items())


def eval_points(logged: dict[str, list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """The eval curve: ``(step, value)`` of the metric a run is judged by (:func:`primary_eval`) at every
    evaluation in the run's logged metrics, whichever process made it."""
    return [(step, value) for step, metrics in evaluations(logged) if (value := primary_eval(metrics)[1]) is not None]


def recovered_report(boundary: Boundary, checkpoint: str, state: dict[str, Any], history: list[dict[str, Any]],
                     logged: dict[str, list[tuple[int, float]]], first_step: int) -> BoundaryReport:
    """The report of ``boundary`` rebuilt from what outlives the process that wrote its ``checkpoint``: the
    checkpoint's progress (``state``, its metadata's) and ``history``, and the run's logged evaluations after
    ``first_step`` (the previous boundary's last step). Its metrics are what
    :meth:`~comlrl.training.run.TrainingRun.save_boundary` computes: a PbRL stage's own (its stage record),
    else the mean of the boundary's steps; its time was not measured (NaN)."""
    last_step = int(state["global_step"])
    if boundary.stage is None:
        metrics = mean_step_metrics(history, first_step)
    else:
        metrics = {k: v for k, v in state["stage_records"][-1].items() if k not in ("iteration", "stage")}
    during = [(step, values) for step, values in evaluations(logged) if first_step < step <= last_step]
    return BoundaryReport(boundary, checkpoint, metrics, during, first_step, last_step, math.nan)


def _round(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else round(float(value), 4) + 0.0  # never -0.0


def describe(row: dict[str, Any]) -> str:
    """A boundary's one-line summary (the subflow's state message, the console's line). A policy-gradient
    loss is ~0 by construction (normalised advantages at ratio 1), so the gradient norm says more about
    whether the update moves the weights; the loss is shown to 3 significant digits."""
    parts = [row["boundary"]]
    for key, name, form in (("reward", "reward", ".3f"), ("eval_reward", "eval", ".3f"), ("loss", "loss", ".3g"),
                            ("grad_norm", "grad", ".3g"), ("kl", "kl", ".3f")):
        if row.get(key) is not None:
            parts.append(f"{name} {row[key]:{form}}")
    if row.get("seconds") is not None:
        parts.append(f"{row['seconds']:.1f} s")
    return " · ".join(parts)
