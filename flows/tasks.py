"""Prefect tasks: each a thin, named wrapper over public functions of comlrl/ or flows/.

Tasks that hand over in-memory objects (the trainer, a rollout) neither persist results nor
cache: what makes a re-run skip completed work is the boundary transaction in
:mod:`flows.training`, whose committed record holds the checkpoint path. Arguments are wrapped
in ``quote`` by the flow so Prefect does not walk tensors looking for futures. The flow names
each task run after where it is (``epoch 2 · steps 1–8: rollout, score, ...``, :mod:`flows.boundaries`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from comlrl import tracking
from comlrl.training.metrics import MetricWindow
from comlrl.utils import read_checkpoint_metadata
from flows import agents, build, gate as gates, registry, spec as specs

# In-memory hand-overs: never cached, never persisted.
memory_task = task(cache_policy=NO_CACHE, persist_result=False)
# Calls to a tracking server: retried through short outages.
tracking_task = task(cache_policy=NO_CACHE, persist_result=False, retries=2, retry_delay_seconds=5)


@task(cache_policy=NO_CACHE, persist_result=False, task_run_name="validate spec")
def validate_spec(spec_path: str, root: str) -> specs.RunSpec:
    return specs.load_spec(spec_path, root)


@task(cache_policy=NO_CACHE, persist_result=False, retries=2, retry_delay_seconds=5,
      task_run_name="use the registry's {alias} agents")
def use_registered_agents(spec: specs.RunSpec, tracking_uri: str, alias: str) -> specs.RunSpec:
    """Start from the registry's ``alias`` (e.g. ``champion``) agents when they exist."""
    return build.with_registered_agents(spec, tracking_uri, alias)


@task(cache_policy=NO_CACHE, persist_result=False, retries=2, retry_delay_seconds=5, task_run_name="open MLflow run")
def open_tracking(tracking_uri: str, experiment: str, run_id: str, checkpoint: str | None,
                  artifact_root: str | None, tags: dict[str, str]) -> dict[str, Any]:
    """The MLflow run: the one recorded in the resume checkpoint's metadata, else found or created."""
    identity = read_checkpoint_metadata(checkpoint).get("mlflow") if checkpoint else None
    return tracking.open_run(tracking_uri, experiment, run_id, identity, artifact_root, tags)


@tracking_task
def log_params(identity: dict[str, Any], params: dict[str, Any]) -> None:
    tracking.log_params(identity, params)


@task(cache_policy=NO_CACHE, persist_result=False, task_run_name="load entities")
def load_entities(spec: specs.RunSpec, root: str, workdir: str, callbacks: list[Any], tracking_uri: str) -> Any:
    return build.build_trainer(spec, root, workdir, callbacks, tracking_uri)


@memory_task
def begin_training(trainer: Any, checkpoint_dir: str, resume_from: str | None, keep: int | None) -> Any:
    """Seed (fresh run) or restore ``resume_from``; returns the checkpoint runner."""
    return trainer.begin_training(checkpoint_dir=checkpoint_dir, resume_from_checkpoint=resume_from,
                                  save_total_limit=keep)


@memory_task
def run_steps(trainer: Any, batches: list[list[dict[str, Any]]], window: MetricWindow, boundary: int,
              first_step: int, end_epoch: bool) -> None:
    """Training steps ``first_step``.. of the epoch (``batches``: their rows), each running the trainer's
    ``step_stages`` (rollout, score, advantages, update, ...) and ``record_step``; ``end_epoch`` closes
    the epoch after the last one. Stage timings are step metrics (``generation_time``, ...), not task runs."""
    for step, rows in enumerate(batches, start=first_step):
        if not trainer.step_stages:  # trainers without declared stages: the whole step at once
            with agents.stage_label(f"train_step-b{boundary}-s{step}"):
                trainer.record_step(trainer.train_step(rows), window)
            continue
        values = trainer.begin_step(rows)
        for stage in trainer.step_stages:
            with agents.stage_label(f"{stage.method}-b{boundary}-s{step}"):
                trainer.run_stage(stage, values)
        trainer.record_step(trainer.step_metrics(values), window)
    if end_epoch:
        trainer.end_epoch()


@memory_task
def run_pbrl_stage(trainer: Any, boundary: int) -> dict[str, float]:
    """The next PbRL stage (preference collection, reward-model fit or policy update)."""
    with agents.stage_label(f"pbrl_stage-b{boundary}"):
        return trainer.run_next_stage()


@memory_task
def evaluate(trainer: Any, label: str) -> dict[str, float]:
    """The trainer's evaluation on the spec's eval set (``{}`` without one); fixed seed, training unaffected."""
    if trainer.eval_dataset is None:
        return {}
    with agents.stage_label(label):
        return trainer.evaluate()


@memory_task
def save_checkpoint(runner: Any) -> str:
    """Write ``checkpoint-N`` for the boundary just completed; its path goes in the boundary's record."""
    return str(runner.save())


@memory_task
def end_training(trainer: Any, runner: Any) -> None:
    trainer.end_training(runner)


@task(cache_policy=NO_CACHE, persist_result=False, task_run_name="plot reward and eval curves")
def plot_curves(history: list[dict[str, float]], evaluations: list[tuple[int, float]], path: str) -> str:
    return str(tracking.reward_curve(history, path, evaluations=evaluations))


@task(cache_policy=NO_CACHE, persist_result=False, retries=3, retry_delay_seconds=5,
      task_run_name="log run records to MLflow")
def log_artifacts(identity: dict[str, Any], files: list[tuple[str, str | None]]) -> None:
    """``(path, artifact_path)`` pairs: the curves, the spec as given and resolved, checkpoint metadata."""
    for path, artifact_path in files:
        tracking.log_artifact(identity, path, artifact_path)


@task(cache_policy=NO_CACHE, persist_result=False, task_run_name="save preference pairs")
def save_preference_pairs(trainer: Any, path: str) -> str | None:
    from comlrl.rollout import preferences

    pairs = getattr(trainer, "preference_pairs", None)
    if pairs is None or len(pairs) == 0:
        return None
    preferences.save_pairs(pairs, Path(path))
    return path


@task(cache_policy=NO_CACHE, persist_result=False, retries=2, retry_delay_seconds=5,
      task_run_name="register agent models")
def register_agents(identity: dict[str, Any], trainer: Any, spec: specs.RunSpec, tags: dict[str, str],
                    alias: str) -> list[dict[str, str]]:
    return registry.register_agents(identity, trainer, spec, tags, alias)


@task(cache_policy=NO_CACHE, persist_result=False, retries=2, retry_delay_seconds=5,
      task_run_name="register team model")
def register_team(identity: dict[str, Any], trainer: Any, spec: specs.RunSpec, tags: dict[str, str], alias: str,
                  directory: str, agent_versions: list[dict[str, str]]) -> dict[str, str]:
    return registry.register_team(identity, trainer, spec, tags, alias, directory, agent_versions)


@task(cache_policy=NO_CACHE, persist_result=False, task_run_name="champion/challenger gate")
def gate(spec: specs.RunSpec, evaluation: dict[str, float], candidates: dict[str, str], tracking_uri: str,
         root: str, workdir: str, alias: str) -> gates.GateDecision:
    return gates.run_gate(spec, evaluation, candidates, tracking_uri, root, workdir, alias)


@tracking_task
def flush_metrics(callback: tracking.MLflowCallback) -> bool:
    return callback.flush()


@tracking_task
def finish_run(identity: dict[str, Any]) -> None:
    tracking.finish_run(identity)
