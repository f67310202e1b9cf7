"""The training flow: a run spec in, checkpoints, an MLflow run and registered agents out.

Reads as a table of contents: validate the spec; for every boundary (epoch or PbRL stage) a
Prefect transaction keyed by run and boundary whose committed record is that boundary's
checkpoint path; then evaluation, artifacts and the model registry. A re-run of the same run
finds the committed boundaries, skips them without executing a task, restores the last
checkpoint and continues — see docs/pipeline.md ("Resume"). With ``execution.task_runner: dask``
each agent's share of a stage also runs as its own task on Dask (:mod:`flows.agents`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import Flow, flow, get_run_logger
from prefect.transactions import transaction
from prefect.utilities.annotations import quote

from comlrl import tracking
from comlrl.training.metrics import MetricWindow
from flows import agents, tasks
from flows.runs import RunPaths, default_tracking_uri, prepare_run
from flows.spec import RunSpec, algorithm_of, spec_hash


def boundary_key(run_id: str, boundary: int) -> str:
    """The transaction (result-record) key of a run's boundary ``boundary`` (1-based)."""
    return f"comlrl-{run_id}-boundary-{boundary}"


def total_boundaries(spec: RunSpec) -> int:
    algorithm = algorithm_of(spec)
    _, config_class = algorithm.load()
    config = config_class(**spec.config)
    if algorithm.kind == "pbrl":
        iterations = config.num_iterations if algorithm.name == "marlhf_iter" else 1
        return 3 * iterations
    return config.num_train_epochs


@dataclass
class Session:
    """What the flow holds once training has begun in this flow run."""

    trainer: Any
    runner: Any
    identity: dict[str, Any]
    callback: tracking.MLflowCallback
    window: MetricWindow


def start(spec: RunSpec, run: RunPaths, resume_from: str | None, root: str, tracking_uri: str) -> Session:
    tags = {tracking.RUN_KEY_TAG: run.run_id, "comlrl.algorithm": spec.algorithm, "comlrl.spec_hash": spec_hash(spec)}
    identity = tasks.open_tracking(tracking_uri, spec.name, run.run_id, resume_from, str(run.artifact_root), tags)
    tasks.log_params(identity, {"spec": spec.model_dump(mode="json"), "run_id": run.run_id})
    callback = tracking.MLflowCallback(identity)
    trainer = tasks.load_entities(spec, root, str(run.workdir), [callback], tracking_uri)
    trainer.run_identity["mlflow"] = identity
    if spec.execution.task_runner == "dask":  # each agent's generation and backward pass: a task on Dask
        agents.install(trainer)
    runner = tasks.begin_training(quote(trainer), str(run.checkpoints), resume_from, spec.checkpoint.keep)
    return Session(trainer, runner, identity, callback, MetricWindow())


def run_epoch(session: Session, boundary: int) -> None:
    """One epoch: each step's stages as tasks named after the trainer's stage methods."""
    trainer = session.trainer
    for step, rows in enumerate(trainer.epoch_rows(), start=trainer.state.step_in_epoch + 1):
        label = f"b{boundary}-s{step}"
        if not trainer.step_stages:
            tasks.train_step.with_options(task_run_name=f"train_step-{label}")(quote(trainer), quote(rows), quote(session.window))
            continue
        values = trainer.begin_step(rows)
        for stage in trainer.step_stages:
            tasks.run_stage.with_options(name=stage.method, task_run_name=f"{stage.method}-{label}")(
                quote(trainer), stage, quote(values))
        tasks.record_step.with_options(task_run_name=f"record_step-{label}")(quote(trainer), quote(values), quote(session.window))
    tasks.end_epoch.with_options(task_run_name=f"end_epoch-b{boundary}")(quote(trainer))


def run_boundary(session: Session, spec: RunSpec, boundary: int) -> None:
    if algorithm_of(spec).kind == "pbrl":
        tasks.run_pbrl_stage.with_options(task_run_name=f"pbrl_stage-b{boundary}")(quote(session.trainer))
    else:
        run_epoch(session, boundary)


def summary(session: Session, boundary: int, total: int) -> str:
    history = [row for row in session.trainer.state.history if "reward_mean" in row]
    recent = [row["reward_mean"] for row in history[-max(1, len(history) // max(boundary, 1)):]]
    mean = sum(recent) / len(recent) if recent else float("nan")
    return f"boundary {boundary}/{total} done: steps {session.trainer.state.global_step}, reward_mean {mean:.3f}"


def mark_failed(identity: dict[str, Any]) -> None:
    """Mark the MLflow run FAILED (a resume sets it RUNNING again); never masks the real error."""
    try:
        tracking.finish_run(identity, status="FAILED")
    except Exception as error:  # the tracking server may be the thing that failed
        get_run_logger().warning("could not mark the MLflow run FAILED: %s", error)


def run_boundaries(spec: RunSpec, run: RunPaths, root: str, tracking_uri: str, total: int) -> tuple[Session | None, str | None]:
    """Every boundary not yet committed, each in its transaction; returns the session (None when
    nothing had to run) and the last checkpoint."""
    logger = get_run_logger()
    session: Session | None = None
    checkpoint: str | None = None
    try:
        for boundary in range(1, total + 1):
            with transaction(key=boundary_key(run.run_id, boundary)) as txn:
                if txn.is_committed():
                    checkpoint = txn.read().result
                    logger.info("boundary %d/%d already completed: %s", boundary, total, checkpoint)
                    continue
                if session is None:
                    session = start(spec, run, checkpoint, root, tracking_uri)
                run_boundary(session, spec, boundary)
                checkpoint = tasks.save_checkpoint(quote(session.runner))
                txn.stage(checkpoint)
                logger.info(summary(session, boundary, total))
    except Exception:
        if session is not None:  # a resume sets the MLflow run RUNNING again
            mark_failed(session.identity)
        raise
    return session, checkpoint


@flow(name="comlrl-train", log_prints=True)
def train_flow(
    spec_path: str,
    run_id: str | None = None,
    workdir: str = ".comlrl",
    root: str | None = None,
    tracking_uri: str | None = None,
    init_from_alias: str | None = None,
) -> dict[str, Any]:
    """Train, checkpoint, track and register the run that ``spec_path`` describes.

    ``run_id`` names the run (default ``<name>-<spec hash>``); re-running with the same run id
    resumes after its last completed boundary. ``init_from_alias`` (e.g. ``champion``) starts
    the agents from the registry's current holder of that alias when it exists.
    """
    root = str(Path(root or os.getcwd()).resolve())
    tracking_uri = tracking_uri or default_tracking_uri(workdir)
    spec = tasks.validate_spec(spec_path, root)
    if init_from_alias:
        spec = tasks.use_registered_agents(spec, tracking_uri, init_from_alias)
    run = prepare_run(spec, spec_path, run_id, workdir, root)
    total = total_boundaries(spec)
    session, checkpoint = run_boundaries(spec, run, root, tracking_uri, total)
    if session is None:  # every boundary was committed: restore the final state to register it
        session = start(spec, run, checkpoint, root, tracking_uri)
    tasks.end_training(quote(session.trainer), quote(session.runner))
    return finish(session, spec, run, spec_path, checkpoint)


def training_flow(spec: RunSpec) -> Flow:
    """``train_flow`` with the task runner the spec's ``execution`` section names."""
    if spec.execution.task_runner == "dask":
        return train_flow.with_options(task_runner=agents.dask_task_runner(spec.execution))
    return train_flow


def finish(session: Session, spec: RunSpec, run: RunPaths, spec_path: str, checkpoint: str | None) -> dict[str, Any]:
    identity, trainer = session.identity, session.trainer
    evaluation = tasks.evaluate(quote(trainer))
    session.callback.on_log(trainer, evaluation, trainer.state.global_step)
    tasks.flush_metrics(quote(session.callback))
    curve = tasks.plot_rewards(quote(trainer.state.history), str(run.directory / "reward_curve.png"))
    tasks.log_artifact(identity, curve, "plots")
    tasks.log_artifact(identity, str(run.spec_copy), "spec")
    if checkpoint:
        tasks.log_artifact(identity, str(Path(checkpoint) / "metadata.json"), f"checkpoints/{Path(checkpoint).name}")
    pairs = tasks.save_preference_pairs(quote(trainer), str(run.directory / "preference_pairs.parquet"))
    if pairs:
        tasks.log_artifact(identity, pairs, "preferences")
    tags = {tracking.RUN_KEY_TAG: run.run_id, "comlrl.algorithm": spec.algorithm, "comlrl.spec_hash": spec_hash(spec),
            "mlflow.run_id": identity["run_id"]}
    registered = tasks.register_agents(identity, quote(trainer), spec.registered_name, tags, spec.registry.alias)
    tasks.finish_run(identity)
    result = {"run_id": run.run_id, "mlflow_run_id": identity["run_id"], "tracking_uri": identity["tracking_uri"],
              "checkpoint": checkpoint, "evaluation": evaluation, "registered": registered}
    (run.directory / "result.json").write_text(json.dumps(result, indent=2))
    return result
