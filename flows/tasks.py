"""Prefect tasks: each a thin, named wrapper over public functions of comlrl/ or flows/.

Tasks that hand over in-memory objects (the trainer, its training run) neither persist results
nor cache: what makes a re-run skip completed work is the run's checkpoints (the library resumes
from the newest). Arguments are wrapped in ``quote`` by the flow so Prefect does not walk tensors
looking for futures. The flow names each task run after where it is (``epoch 2 · steps 1–8:
rollout, score, ...``, :mod:`flows.boundaries`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from comlrl import tracking
from comlrl.errors import CheckpointError
from comlrl.rollout.reward_function import KeepsSampleRows
from comlrl.utils import read_checkpoint_metadata
from flows import agents, build, gate as gates, new_mlflow_run, registry, spec as specs

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


def not_refused(task: Any, task_run: Any, state: Any) -> bool:
    """Retry unless the task refused a checkpoint: asking again meets the same checkpoint."""
    return not isinstance(state.data, CheckpointError)


@task(cache_policy=NO_CACHE, persist_result=False, retries=2, retry_delay_seconds=5, retry_condition_fn=not_refused,
      task_run_name="open MLflow run")
def open_tracking(tracking_uri: str, experiment: str, run_id: str, checkpoint: str | None,
                  artifact_root: str | None, tags: dict[str, str]) -> dict[str, Any]:
    """The MLflow run: the one recorded in the resume checkpoint's metadata, else found or created. A checkpoint
    of another run (its run id or spec hash, or the tags of the MLflow run it names, differ from ``tags``) is
    refused, a :class:`~comlrl.errors.CheckpointError`, before anything in MLflow changes."""
    identity = read_checkpoint_metadata(checkpoint).get("mlflow") if checkpoint else None
    if checkpoint:  # unless `comlrl resume --new-mlflow-run` replaced that MLflow run (flows/new_mlflow_run.py)
        identity = new_mlflow_run.identity(checkpoint, identity, tracking_uri, experiment, artifact_root, tags)
    return tracking.open_run(tracking_uri, experiment, run_id, identity, artifact_root, tags, checkpoint=checkpoint)


@tracking_task
def log_params(identity: dict[str, Any], params: dict[str, Any]) -> None:
    tracking.log_params(identity, params)


@task(cache_policy=NO_CACHE, persist_result=False, task_run_name="load entities")
def load_entities(spec: specs.RunSpec, root: str, workdir: str, callbacks: list[Any], tracking_uri: str) -> Any:
    return build.build_trainer(spec, root, workdir, callbacks, tracking_uri)


@memory_task
def start_run(trainer: Any, checkpoint_dir: str, resume_from: str | None, keep: int | None) -> Any:
    """Seed (fresh run) or restore ``resume_from``; the library's :class:`~comlrl.training.run.TrainingRun`."""
    return trainer.start_run(checkpoint_dir=checkpoint_dir, resume_from_checkpoint=resume_from,
                             save_total_limit=keep)


@memory_task
def run_steps(run: Any, count: int, label: str) -> int:
    """``count`` steps of the current epoch (each the trainer's ``step_stages``: rollout, score, advantages,
    update, ...); stage timings are step metrics (``generation_time``, ...), not task runs."""
    with agents.stage_label(label):
        return run.run_steps(count)


@memory_task
def close_boundary(run: Any, label: str) -> dict[str, float] | None:
    """The end of the current boundary: a whole PbRL stage (preference collection, reward-model fit, policy
    update), or an epoch's end."""
    with agents.stage_label(label):
        return run.close_boundary()


@memory_task
def save_boundary(run: Any, metrics: dict[str, float] | None) -> Any:
    """The boundary's checkpoint; its report (checkpoint path, metrics, evaluations)."""
    return run.save_boundary(metrics)


@memory_task
def finish_training(run: Any) -> None:
    run.finish()


@memory_task
def evaluate(trainer: Any, label: str) -> dict[str, float]:
    """The trainer's evaluation on the spec's eval set (``{}`` without one); fixed seed, training unaffected."""
    if trainer.eval_dataset is None:
        return {}
    with agents.stage_label(label):
        return trainer.evaluate()


@task(cache_policy=NO_CACHE, persist_result=False, task_run_name="plot reward and eval curves")
def plot_curves(history: list[dict[str, float]], evaluations: list[tuple[int, float]], path: str) -> str:
    return str(tracking.reward_curve(history, path, evaluations=evaluations))


@task(cache_policy=NO_CACHE, persist_result=False, retries=3, retry_delay_seconds=5,
      task_run_name="log run records to MLflow")
def log_artifacts(identity: dict[str, Any], files: list[tuple[str, str | None]]) -> None:
    """``(path, artifact_path)`` pairs: the curves, the spec as given and resolved, checkpoint metadata."""
    for path, artifact_path in files:
        tracking.log_artifact(identity, path, artifact_path)


@task(cache_policy=NO_CACHE, persist_result=False, task_run_name="save sample answers")
def save_sample_table(trainer: Any, path: str) -> str | None:
    """The answers the reward judged last, with their verdicts, as a table file (None when it keeps none)."""
    reward = getattr(trainer, "reward", None)  # a preference trainer holds none of its own
    rows = reward.sample_rows() if isinstance(reward, KeepsSampleRows) else []
    return str(tracking.write_table(rows, path)) if rows else None


@task(cache_policy=NO_CACHE, persist_result=False, task_run_name="save preference pairs")
def save_preference_pairs(pairs: Any, path: str) -> str:
    from comlrl.rollout import preferences

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


@task(cache_policy=NO_CACHE, persist_result=False, retries=2, retry_delay_seconds=5,
      task_run_name="point the alias at the team")
def point_alias(tracking_uri: str, team: dict[str, str], agents: list[dict[str, str]], alias: str) -> None:
    registry.point_alias(tracking_uri, team, agents, alias)


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
