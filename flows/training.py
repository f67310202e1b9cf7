"""The training flow: a run spec in, checkpoints, an MLflow run, a gated registry and Prefect artifacts out.

Reads as a table of contents: validate the spec; for every boundary (epoch or PbRL stage) a
Prefect transaction keyed by run and boundary, inside it one **subflow** named after the boundary
("epoch 2 of 3") whose tasks are the boundary's steps in chunks (``execution.steps_per_task``,
default all), its evaluation and its checkpoint; the committed record is the checkpoint path and
the boundary's row (reward, eval reward, loss, KL). Then the curves, the spec and checkpoint
metadata go to MLflow, the agents and the team model are registered as candidates, and the
champion/challenger gate (:mod:`flows.gate`) decides about ``champion``. A re-run of the same run
finds the committed boundaries, skips them without executing a task, restores the last checkpoint
and continues — see docs/pipeline.md ("Resume"). With ``execution.task_runner: dask`` each agent's
share of a stage also runs as its own task on Dask (:mod:`flows.agents`).

Boundary subflows send no Prefect heartbeats of their own: the parent flow run's heartbeat covers
the process, and a subflow's heartbeat thread costs up to a second at its exit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import Flow, flow, get_run_logger
from prefect.runtime import flow_run
from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
from prefect.states import Completed, Failed, State
from prefect.transactions import transaction
from prefect.utilities.annotations import quote

from comlrl import tracking
from comlrl.training.metrics import MetricWindow
from flows import agents, artifacts, boundaries, orchestrator, tasks
from flows.boundaries import Boundary
from flows.progress import ProgressArtifact, StepProgress, emit, planned_steps
from flows.registry import team_model_name
from flows.runs import RunPaths, claim_run, default_tracking_uri, prepare_run
from flows.spec import RunSpec, spec_hash

# Run id -> the session training it in this process; how a boundary subflow (whose parameters
# Prefect records, so they stay small) finds the trainer. A process table: pickled (Dask ships a
# subflow's function by value, with the globals it reads), it stands for the same table.
LIVE: dict[str, "Session"] = agents.process_table("training-sessions")


# Seconds between deliveries of the MLflow spool and between updates of the progress artifact: each costs
# store or API work beside training on a small machine (benchmarks/README.md, "Orchestration overhead").
SEND_INTERVAL = 2.0
PROGRESS_INTERVAL = 2.0


def boundary_key(run_id: str, boundary: int) -> str:
    """The transaction (result-record) key of a run's boundary ``boundary`` (1-based)."""
    return f"comlrl-{run_id}-boundary-{boundary}"


def total_boundaries(spec: RunSpec) -> int:
    return len(boundaries.plan(spec))


def run_tags(spec: RunSpec, run: RunPaths) -> dict[str, str]:
    return {tracking.RUN_KEY_TAG: run.run_id, "comlrl.algorithm": spec.algorithm, "comlrl.spec_hash": spec_hash(spec)}


@dataclass
class Session:
    """What the flow holds once training has begun in this flow run."""

    trainer: Any
    runner: Any
    identity: dict[str, Any]
    callback: tracking.MLflowCallback
    progress: StepProgress
    spec: RunSpec
    run_id: str
    plan: list[Boundary]
    records: list[dict[str, Any]]
    publisher: artifacts.BackgroundPublisher
    window: MetricWindow = field(default_factory=MetricWindow)
    last_task_run: Any = None  # the id of the task run that ran last (see boundary_in_subflow)
    subflows: bool = True  # False once the Prefect API could not start a boundary subflow
    started: set[int] = field(default_factory=set)  # boundaries whose work began in this process
    finished: dict[int, dict[str, Any]] = field(default_factory=dict)  # ... and the records of those done


def start(spec: RunSpec, run: RunPaths, resume_from: str | None, root: str, tracking_uri: str,
          plan: list[Boundary], records: list[dict[str, Any]], progress_artifact: ProgressArtifact | None,
          publisher: artifacts.BackgroundPublisher) -> Session:
    identity = tasks.open_tracking(tracking_uri, spec.name, run.run_id, resume_from, str(run.artifact_root),
                                   run_tags(spec, run))
    tasks.log_params(identity, {"spec": spec.model_dump(mode="json"), "run_id": run.run_id})
    # Metrics reach MLflow every SEND_INTERVAL s (and all at the run's end): fewer store writes beside training.
    callback = tracking.MLflowCallback(identity, spool_dir=run.directory / "tracking", send_interval=SEND_INTERVAL)
    callback.set_tags({**run_tags(spec, run), **prefect_tags()})
    progress = StepProgress(1, progress_artifact)
    trainer = tasks.load_entities(spec, root, str(run.workdir), [callback, progress], tracking_uri)
    progress.total = max(planned_steps(trainer), 1)
    trainer.run_identity["mlflow"] = identity
    if spec.execution.task_runner == "dask":  # each agent's generation and backward pass: a task on Dask
        agents.install(trainer)
    began = tasks.begin_training.with_options(task_run_name=f"restore {Path(resume_from).name}" if resume_from
                                              else "begin training")(quote(trainer), str(run.checkpoints), resume_from,
                                                                     spec.checkpoint.keep, return_state=True)
    emit("start", f"training {run.run_id}", total=progress.total, done=trainer.state.global_step)
    return Session(trainer, began.result(), identity, callback, progress, spec, run.run_id, plan, records, publisher,
                   last_task_run=began.state_details.task_run_id)


def prefect_tags() -> dict[str, str]:
    """The Prefect flow run of this MLflow run (and its page, when a Prefect server is used: the
    embedded default's temporary server is gone once the run ends)."""
    tags = {"prefect.flow_run_id": str(flow_run.id)} if flow_run.id else {}
    if PREFECT_API_URL.value() and flow_run.ui_url:
        tags["prefect.flow_run_url"] = flow_run.ui_url
    return tags


def run_epoch(session: Session, boundary: Boundary) -> None:
    """The epoch's remaining steps, ``execution.steps_per_task`` per task (default: all in one)."""
    trainer = session.trainer
    batches = trainer.epoch_rows()
    first = trainer.state.step_in_epoch + 1
    stages = [stage.method for stage in trainer.step_stages] or ["train step"]
    parts = boundaries.chunks(len(batches), session.spec.execution.steps_per_task)
    for index, part in enumerate(parts):
        name = boundaries.steps_task_name(boundary, first + part.start, first + part.stop - 1, stages)
        tasks.run_steps.with_options(task_run_name=name)(
            quote(trainer), quote(batches[part.start:part.stop]), quote(session.window), boundary.number,
            first + part.start, index == len(parts) - 1)
    if not parts:  # resumed exactly at the end of an epoch's steps
        trainer.end_epoch()


def run_boundary(session: Session, number: int) -> dict[str, Any]:
    """One boundary: its steps (or PbRL stage), its evaluation, its checkpoint; returns its record."""
    trainer, boundary = session.trainer, session.plan[number - 1]
    session.started.add(number)
    started, first_step = time.perf_counter(), trainer.state.global_step
    stage_metrics = None
    if boundary.stage is not None:
        stage_metrics = tasks.run_pbrl_stage.with_options(task_run_name=boundary.label)(quote(trainer), number)
    else:
        run_epoch(session, boundary)
    evaluation = tasks.evaluate.with_options(task_run_name=boundary.task_name("evaluation"))(
        quote(trainer), f"evaluate-b{number}")
    if evaluation:  # the eval curve: one point per boundary
        session.callback.on_log(trainer, evaluation, trainer.state.global_step)
    saved = tasks.save_checkpoint.with_options(task_run_name=boundary.task_name("checkpoint"))(
        quote(session.runner), return_state=True)
    checkpoint, session.last_task_run = saved.result(), saved.state_details.task_run_id
    metrics = boundaries.boundary_metrics(trainer.state.history, first_step, stage_metrics)
    row = boundaries.boundary_row(boundary, metrics, evaluation, trainer.state.global_step, checkpoint,
                                  time.perf_counter() - started)
    record = {"checkpoint": checkpoint, "row": row, "evaluation": evaluation}
    session.finished[number] = record
    session.publisher.submit(artifacts.publish_table, session.run_id,
                             [r["row"] for r in session.records if r["row"]] + [row])
    line = boundaries.describe(row)
    get_run_logger().info(line)
    emit("boundary", line, row=row, number=number, total=boundary.total)
    return record


@flow(name="comlrl-boundary", persist_result=False, validate_parameters=False, log_prints=True)
def boundary_flow(run_id: str, number: int) -> State:
    """A boundary as its own subflow run; its final state's message is the boundary's summary."""
    record = run_boundary(LIVE[run_id], number)
    return Completed(message=boundaries.describe(record["row"]), data=record)


def boundary_in_subflow(session: Session, boundary: Boundary) -> dict[str, Any]:
    """The boundary as a subflow; if the Prefect API cannot even start one (a server outage), the
    boundary runs inside the parent flow run instead: training never needs the server once started."""
    if session.subflows:
        if session.last_task_run is not None:  # the server has written the last task's states
            orchestrator.await_task_recorded(session.last_task_run)
        try:
            state = boundary_flow.with_options(flow_run_name=boundary.title)(session.run_id, boundary.number,
                                                                             return_state=True)
            return state.result()  # raises the boundary's error
        except Exception as error:
            if boundary.number in session.finished:  # done; only its final state was not recorded
                return session.finished[boundary.number]
            if boundary.number in session.started:
                raise
            session.subflows = False
            get_run_logger().warning("the Prefect API could not start the subflow of %s (%s); this and the "
                                     "remaining boundaries run inside the flow run", boundary.label, error)
    return run_boundary(session, boundary.number)


def as_record(value: Any) -> dict[str, Any]:
    """A committed boundary record (runs of older versions recorded the checkpoint path alone)."""
    return value if isinstance(value, dict) else {"checkpoint": value, "row": None, "evaluation": {}}


def mark_failed(identity: dict[str, Any]) -> None:
    """Mark the MLflow run FAILED (a resume sets it RUNNING again); never masks the real error."""
    try:
        tracking.finish_run(identity, status="FAILED")
    except Exception as error:  # the tracking server may be the thing that failed
        get_run_logger().warning("could not mark the MLflow run FAILED: %s", error)


def run_boundaries(spec: RunSpec, run: RunPaths, root: str, tracking_uri: str, plan: list[Boundary],
                   progress_artifact: ProgressArtifact | None,
                   publisher: artifacts.BackgroundPublisher) -> tuple[Session | None, list[dict[str, Any]]]:
    """Every boundary not yet committed, each a subflow in its transaction; returns the session (None
    when nothing had to run) and every boundary's record."""
    logger = get_run_logger()
    session: Session | None = None
    records: list[dict[str, Any]] = []
    try:
        # One settings context for all boundary subflows: no heartbeat threads (see the module docstring).
        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            for boundary in plan:
                with transaction(key=boundary_key(run.run_id, boundary.number)) as txn:
                    if txn.is_committed():
                        records.append(as_record(txn.read().result))
                        logger.info("%s already completed: %s", boundary.label, records[-1]["checkpoint"])
                        continue
                    if session is None:
                        resume_from = records[-1]["checkpoint"] if records else None
                        session = start(spec, run, resume_from, root, tracking_uri, plan, records, progress_artifact,
                                        publisher)
                        LIVE[run.run_id] = session
                    record = boundary_in_subflow(session, boundary)
                    records.append(record)
                    txn.stage(record)
    except Exception:
        if session is not None:  # a resume sets the MLflow run RUNNING again
            mark_failed(session.identity)
            session.callback.close()  # deliver what the spool holds (bounded); the rest waits for a resume
        raise
    finally:
        LIVE.pop(run.run_id, None)
    return session, records


def _flow_run_name() -> str:
    parameters = flow_run.parameters
    return parameters.get("run_id") or Path(parameters.get("spec_path", "run")).stem


@flow(name="comlrl-train", flow_run_name=_flow_run_name, log_prints=True)
def train_flow(
    spec_path: str,
    run_id: str | None = None,
    workdir: str = ".comlrl",
    root: str | None = None,
    tracking_uri: str | None = None,
    init_from_alias: str | None = None,
) -> dict[str, Any]:
    """Train, checkpoint, track, register and gate the run that ``spec_path`` describes.

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
    lock = claim_run(run)  # refused while another process trains this run
    try:  # so earlier flow runs of this run that the server still shows "Running" are stale
        orchestrator.crash_stale_flow_runs(run.run_id, flow_run.id, flow_run.name or run.run_id)
        return train_run(spec, run, root, tracking_uri)
    finally:
        lock.release()


def train_run(spec: RunSpec, run: RunPaths, root: str, tracking_uri: str) -> Any:
    """Every boundary not yet committed, then the end of the run (:func:`finish`)."""
    plan = boundaries.plan(spec)
    progress_artifact = ProgressArtifact(artifacts.artifact_key(run.run_id, "progress"),
                                         f"Run {run.run_id}: training steps done", interval=PROGRESS_INTERVAL)
    publisher = artifacts.BackgroundPublisher()  # the boundaries' table artifact, off the training thread
    try:
        session, records = run_boundaries(spec, run, root, tracking_uri, plan, progress_artifact, publisher)
        if session is None:  # every boundary was committed: restore the final state to register it
            session = start(spec, run, records[-1]["checkpoint"], root, tracking_uri, plan, records, progress_artifact,
                            publisher)
        tasks.end_training(quote(session.trainer), quote(session.runner))
    finally:
        progress_artifact.close()
        publisher.close()
    return finish(session, spec, run, records, root)


def training_flow(spec: RunSpec) -> Flow:
    """``train_flow`` with the task runner the spec's ``execution`` section names."""
    if spec.execution.task_runner == "dask":
        return train_flow.with_options(task_runner=agents.dask_task_runner(spec.execution))
    return train_flow


def run_files(session: Session, spec: RunSpec, run: RunPaths, records: list[dict[str, Any]]) -> list[tuple[str, str | None]]:
    """What the MLflow run keeps besides metrics: curves, the spec as given and resolved, checkpoint metadata."""
    trainer = session.trainer
    evaluations = [(r["row"]["step"], r["row"]["eval_reward"]) for r in records
                   if r["row"] and r["row"]["eval_reward"] is not None]
    curve = tasks.plot_curves(quote(trainer.state.history), evaluations, str(run.directory / "reward_curve.png"))
    resolved = run.directory / "resolved_spec.json"
    config = dataclasses.asdict(getattr(trainer, "args"))
    resolved.write_text(json.dumps({**spec.model_dump(mode="json"), "config": config}, indent=2, default=str))
    files = [(curve, "plots"), (str(run.spec_copy), "spec"), (str(resolved), "spec")]
    files += [(str(path / "metadata.json"), f"checkpoints/{path.name}")
              for path in sorted(run.checkpoints.glob("checkpoint-*")) if (path / "metadata.json").is_file()]
    pairs = tasks.save_preference_pairs(quote(trainer), str(run.directory / "preference_pairs.parquet"))
    if pairs:
        files.append((pairs, "preferences"))
    return files


def finish(session: Session, spec: RunSpec, run: RunPaths, records: list[dict[str, Any]], root: str) -> Any:
    identity, trainer = session.identity, session.trainer
    evaluation = records[-1]["evaluation"] if records else {}
    tasks.log_artifacts(identity, run_files(session, spec, run, records))
    if not session.callback.close(warn=False):  # MLflow still down after the bounded wait: the spool keeps it all
        unavailable = session.callback.unavailable()
        return Failed(message=str(unavailable), data=unavailable)  # `comlrl sync` / `comlrl resume` finish it
    tags = {**run_tags(spec, run), "mlflow.run_id": identity["run_id"]}
    alias = spec.registry.alias
    registered = tasks.register_agents(identity, quote(trainer), spec, tags, alias)
    team = tasks.register_team(identity, quote(trainer), spec, tags, alias, str(run.directory / "team"), registered)
    candidates = {entry["name"]: entry["version"] for entry in [team, *registered]}
    decision = tasks.gate(spec, evaluation, candidates, identity["tracking_uri"], root, str(run.workdir), alias)
    tasks.finish_run(identity)
    result = {"run_id": run.run_id, "mlflow_run_id": identity["run_id"], "tracking_uri": identity["tracking_uri"],
              "checkpoint": records[-1]["checkpoint"] if records else None, "evaluation": evaluation,
              "registered": registered, "team": team, "gate": decision.as_dict(),
              "boundaries": [r["row"] for r in records if r["row"]]}
    artifacts.best_effort(publish, session, spec, run, result)
    (run.directory / "result.json").write_text(json.dumps(result, indent=2))
    emit("gate", decision.reason, gate=decision.as_dict())
    return result


def publish(session: Session, spec: RunSpec, run: RunPaths, result: dict[str, Any]) -> None:
    """The run's Prefect artifacts at the end: the gate decision, links to MLflow, the summary."""
    identity, trainer = session.identity, session.trainer
    entries = [result["team"], *result["registered"]]
    artifacts.publish_gate(run.run_id, result["gate"])
    urls = artifacts.publish_links(run.run_id, identity, entries)
    metric, score = boundaries.primary_eval(result["evaluation"])
    policy = getattr(trainer, "policy_trainer", trainer)
    train, evaluation = spec.dataset.train, spec.dataset.eval
    artifacts.publish_summary(run.run_id, {
        "name": spec.name, "run_id": run.run_id, "algorithm": spec.algorithm, "num_agents": policy.num_agents,
        "models": [str(source) for source in policy.agent_sources], "spec_hash": spec_hash(spec),
        "train": getattr(train, "path", None) or str(train), "train_rows": len(trainer.train_dataset),
        "eval": (getattr(evaluation, "path", None) or str(evaluation)) if evaluation else None,
        "eval_rows": len(trainer.eval_dataset) if trainer.eval_dataset is not None else None,
        "steps": trainer.state.global_step, "boundaries": result["boundaries"], "eval_metric": metric,
        "eval_score": score, "registered": [{**entry, "url": url} for entry, url in zip(entries, urls[1:])],
        "gate": result["gate"], "mlflow_run_id": identity["run_id"], "mlflow_run_url": urls[0],
        "checkpoint": result["checkpoint"], "team": team_model_name(spec.registered_name),
    })
