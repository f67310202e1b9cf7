"""Prefect tasks: each a thin, named wrapper over one public function of comlrl/ or flows/.

Tasks that hand over in-memory objects (the trainer, a rollout) neither persist results nor
cache: what makes a re-run skip completed work is the boundary transaction in
:mod:`flows.training`, whose committed record is the checkpoint path. Arguments are wrapped in
``quote`` by the flow so Prefect does not walk tensors looking for futures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from comlrl import tracking
from comlrl.training.metrics import MetricWindow
from comlrl.trainers.base import Stage
from comlrl.utils import read_checkpoint_metadata
from flows import build, spec as specs

# In-memory hand-overs: never cached, never persisted.
memory_task = task(cache_policy=NO_CACHE, persist_result=False)


@task(cache_policy=NO_CACHE, persist_result=False)
def validate_spec(spec_path: str, root: str) -> specs.RunSpec:
    return specs.load_spec(spec_path, root)


@task(cache_policy=NO_CACHE, persist_result=False, retries=2, retry_delay_seconds=5)
def use_registered_agents(spec: specs.RunSpec, tracking_uri: str, alias: str) -> specs.RunSpec:
    """Start from the registry's ``alias`` (e.g. ``champion``) agents when they exist."""
    return build.with_registered_agents(spec, tracking_uri, alias)


@task(cache_policy=NO_CACHE, persist_result=False, retries=2, retry_delay_seconds=5)
def open_tracking(tracking_uri: str, experiment: str, run_id: str, checkpoint: str | None,
                  artifact_root: str | None, tags: dict[str, str]) -> dict[str, Any]:
    """The MLflow run: the one recorded in the resume checkpoint's metadata, else found or created."""
    identity = read_checkpoint_metadata(checkpoint).get("mlflow") if checkpoint else None
    return tracking.open_run(tracking_uri, experiment, run_id, identity, artifact_root, tags)


@task(cache_policy=NO_CACHE, persist_result=False, retries=2, retry_delay_seconds=5)
def log_params(identity: dict[str, Any], params: dict[str, Any]) -> None:
    tracking.log_params(identity, params)


@memory_task
def load_entities(spec: specs.RunSpec, root: str, workdir: str, callbacks: list[Any], tracking_uri: str) -> Any:
    return build.build_trainer(spec, root, workdir, callbacks, tracking_uri)


@memory_task
def begin_training(trainer: Any, checkpoint_dir: str, resume_from: str | None, keep: int | None) -> Any:
    """Seed (fresh run) or restore ``resume_from``; returns the checkpoint runner."""
    return trainer.begin_training(checkpoint_dir=checkpoint_dir, resume_from_checkpoint=resume_from,
                                  save_total_limit=keep)


@memory_task
def run_stage(trainer: Any, stage: Stage, values: dict[str, Any]) -> None:
    """One step stage (rollout, score, advantages, update, ...); named after it by the flow."""
    trainer.run_stage(stage, values)


@memory_task
def record_step(trainer: Any, values: dict[str, Any], window: MetricWindow) -> dict[str, float]:
    metrics = trainer.step_metrics(values)
    trainer.record_step(metrics, window)
    return metrics


@memory_task
def train_step(trainer: Any, rows: list[dict[str, Any]], window: MetricWindow) -> dict[str, float]:
    """For trainers without declared ``step_stages``: the whole step as one task."""
    metrics = trainer.train_step(rows)
    trainer.record_step(metrics, window)
    return metrics


@memory_task
def end_epoch(trainer: Any) -> None:
    trainer.end_epoch()


@memory_task
def run_pbrl_stage(trainer: Any) -> dict[str, float]:
    """The next PbRL stage (preference collection, reward-model fit or policy learning)."""
    return trainer.run_next_stage()


@task(cache_policy=NO_CACHE, persist_result=False)
def save_checkpoint(runner: Any) -> str:
    """Write ``checkpoint-N`` for the boundary just completed; its path is the boundary's record."""
    return str(runner.save())


@memory_task
def end_training(trainer: Any, runner: Any) -> None:
    trainer.end_training(runner)


@task(cache_policy=NO_CACHE, persist_result=False)
def evaluate(trainer: Any) -> dict[str, float]:
    return trainer.evaluate() if trainer.eval_dataset is not None else {}


@task(cache_policy=NO_CACHE, persist_result=False)
def plot_rewards(history: list[dict[str, float]], path: str) -> str:
    return str(tracking.reward_curve(history, path))


@task(cache_policy=NO_CACHE, persist_result=False, retries=3, retry_delay_seconds=5)
def log_artifact(identity: dict[str, Any], path: str, artifact_path: str | None = None) -> None:
    tracking.log_artifact(identity, path, artifact_path)


@task(cache_policy=NO_CACHE, persist_result=False)
def save_preference_pairs(trainer: Any, path: str) -> str | None:
    from comlrl.rollout import preferences

    pairs = getattr(trainer, "preference_pairs", None)
    if pairs is None or len(pairs) == 0:
        return None
    preferences.save_pairs(pairs, Path(path))
    return path


@task(cache_policy=NO_CACHE, persist_result=False, retries=2, retry_delay_seconds=5)
def register_agents(identity: dict[str, Any], trainer: Any, base_name: str, tags: dict[str, str],
                    alias: str) -> list[dict[str, str]]:
    agents = trainer.policy_trainer if hasattr(trainer, "policy_trainer") else trainer
    return tracking.register_agents(identity, agents.agents, agents.tokenizers, base_name, tags, alias)


@task(cache_policy=NO_CACHE, persist_result=False, retries=2, retry_delay_seconds=5)
def flush_metrics(callback: tracking.MLflowCallback) -> bool:
    return callback.flush()


@task(cache_policy=NO_CACHE, persist_result=False, retries=2, retry_delay_seconds=5)
def finish_run(identity: dict[str, Any]) -> None:
    tracking.finish_run(identity)


@task(cache_policy=NO_CACHE, persist_result=False, retries=2, retry_delay_seconds=5)
def promote(tracking_uri: str, names: list[str], from_alias: str, to_alias: str) -> list[dict[str, str]]:
    return tracking.promote(tracking_uri, names, from_alias, to_alias)
