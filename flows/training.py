"""The training flow: a run spec in, checkpoints, an MLflow run, a gated registry and Prefect artifacts out.

Reads as a table of contents: validate the spec; start the library's training run
(:class:`comlrl.training.run.TrainingRun`: seeded, or restored from the run's newest checkpoint);
for every boundary (epoch or PbRL stage) one **subflow** named after it ("epoch 2 of 3") whose
tasks are the boundary's steps in chunks (``execution.steps_per_task``, default all) and its
end and checkpoint — each task one call of the run's public API, so stop signals, failures,
evaluation cadence and checkpoints behave exactly as in ``trainer.train()``. Each finished
boundary adds a row to ``boundaries.jsonl`` in the run directory (rebuilt from its checkpoint at the next
start when a kill came between the two: :func:`restored_records`) and to the table artifact. Then
the curves, the spec and checkpoint metadata go to MLflow, the agents and the team model are
registered as candidates, and the champion/challenger gate (:mod:`flows.gate`) decides about
``champion``. A re-run of the same run id restores the newest checkpoint and continues (see
docs/pipeline.md, "Resume"). With ``execution.task_runner: dask`` each agent's share of a stage
also runs as its own task on Dask (:mod:`flows.agents`).

A stop signal (SIGTERM/SIGINT) ends the step in progress, writes ``checkpoint-N-stepS``, marks
the MLflow run KILLED and ends the flow run Cancelled with a message naming the checkpoint; an
exception marks the MLflow run FAILED after checkpointing the last completed step when it can.

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
from prefect.exceptions import TerminationSignal
from prefect.states import Cancelled, Completed, Failed, State
from prefect.utilities.annotations import quote

from comlrl import tracking
from comlrl.checkpointing import CHECKPOINT_PREFIX, list_checkpoints, read_history, read_metadata
from comlrl.errors import TrainingInterrupted
from comlrl.progress import Boundary
from flows import agents, artifacts, boundaries, full_disk, orchestrator, tasks
from comlrl.executables import executable
from flows.progress import ProgressArtifact, StepProgress, emit
from flows.registry import team_model_name
from flows.runs import RunPaths, append_boundary_record, claim_run, prepare_run, read_boundary_records
from flows.tracking_store import default_tracking_uri
from flows.spec import RunSpec, spec_hash

# Run id -> the session training it in this process; how a boundary subflow (whose parameters
# Prefect records, so they stay small) finds the trainer. A process table: pickled (Dask ships a
# subflow's function by value, with the globals it reads), it stands for the same table.
LIVE: dict[str, "Session"] = agents.process_table("training-sessions")


# Seconds between deliveries of the MLflow spool and between updates of the progress artifact: each costs
# store or API work beside training on a small machine (benchmarks/README.md, "Orchestration overhead").
SEND_INTERVAL = 2.0
# A server that answers a subflow's start with an error (a database restarting) is asked again every
# ANSWERED_ERROR_PAUSE s for up to ANSWERED_ERROR_WINDOW s before the run stops using subflows: a short database
# outage then costs a pause, not the records of the boundaries after it.
ANSWERED_ERROR_WINDOW = 60.0
ANSWERED_ERROR_PAUSE = 2.0
PROGRESS_INTERVAL = 2.0


def run_tags(spec: RunSpec, run: RunPaths) -> dict[str, str]:
    return {tracking.RUN_KEY_TAG: run.run_id, "comlrl.algorithm": spec.algorithm, "comlrl.spec_hash": spec_hash(spec)}


@dataclass
class Session:
    """What the flow holds once training has begun in this flow run."""

    trainer: Any
    run: Any  # comlrl.training.run.TrainingRun
    identity: dict[str, Any]
    callback: tracking.MLflowCallback
    progress: StepProgress
    spec: RunSpec
    paths: RunPaths
    records: list[dict[str, Any]]
    publisher: artifacts.BackgroundPublisher
    last_task_run: Any = None  # the id of the task run that ran last (see boundary_in_subflow)
    subflows: bool = True  # False once the Prefect server stopped answering (flows.orchestrator.outage)
    started: set[int] = field(default_factory=set)  # boundaries whose work began in this process
    finished: dict[int, dict[str, Any]] = field(default_factory=dict)  # ... and the records of those done
    unrecorded: dict[int, str] = field(default_factory=dict)  # done, end state refused by the server: number -> title


def start(spec: RunSpec, run: RunPaths, root: str, tracking_uri: str, records: list[dict[str, Any]],
          progress_artifact: ProgressArtifact | None, publisher: artifacts.BackgroundPublisher) -> Session:
    """Open the MLflow run, build the trainer, and start (or resume) its training run."""
    resume_from = latest_checkpoint(run)
    identity = tasks.open_tracking(tracking_uri, spec.name, run.run_id, resume_from, str(run.artifact_root),
                                   run_tags(spec, run))
    tasks.log_params(identity, {"spec": spec.model_dump(mode="json"), "run_id": run.run_id})
    # Metrics reach MLflow every SEND_INTERVAL s (and all at the run's end): fewer store writes beside training.
    callback = tracking.MLflowCallback(identity, spool_dir=run.directory / "tracking", send_interval=SEND_INTERVAL)
    callback.set_tags({**run_tags(spec, run), **prefect_tags()})
    progress = StepProgress(1, progress_artifact, say=say_progress)
    trainer = tasks.load_entities(spec, root, str(run.workdir), [callback, progress], tracking_uri)
    progress.total = max(trainer.planned_training_steps(), 1)
    if spec.execution.task_runner == "dask":  # each agent's generation and backward pass: a task on Dask
        agents.install(trainer)
    name = f"restore {Path(resume_from).name}" if resume_from else "begin training"
    began = tasks.start_run.with_options(task_run_name=name)(quote(trainer), str(run.checkpoints), resume_from,
                                                            spec.checkpoint.keep, return_state=True)
    training = began.result()
    emit("start", f"training {run.run_id}", total=progress.total, done=trainer.state.global_step)
    records[:] = restored_records(run, training.plan[:trainer.state.boundaries], records, callback)
    if records:  # a resume: the table as the records have it (a stop between a checkpoint and its table is
        # not redone by any boundary when it was the last one; found by tests/test_stopped_anywhere.py)
        publisher.submit(artifacts.publish_table, run.run_id, [r["row"] for r in records if r["row"]])
    return Session(trainer, training, identity, callback, progress, spec, run, records, publisher,
                   last_task_run=began.state_details.task_run_id)


def restored_records(run: RunPaths, done: list[Boundary], records: list[dict[str, Any]],
                     callback: tracking.MLflowCallback) -> list[dict[str, Any]]:
    """The records of the boundaries ``done`` before this start (the rows of later ones are redone). A
    boundary whose checkpoint was written but whose row was not (a process killed in between) gets its
    record back from the checkpoint and the run's logged evaluations, appended to ``boundaries.jsonl``."""
    kept = {record["number"]: record for record in records if record["number"] <= len(done)}
    saved = {path.name: path for path in list_checkpoints(run.checkpoints)}
    logged = None
    for boundary in done:
        checkpoint, previous = saved.get(f"{CHECKPOINT_PREFIX}{boundary.number}"), kept.get(boundary.number - 1)
        if boundary.number in kept or checkpoint is None or (boundary.number > 1 and previous is None):
            continue  # recorded; or redone (no checkpoint); or where it began is not known
        logged = tracking.logged_metrics(callback, "eval/") if logged is None else logged
        first_step = previous["row"]["step"] if previous else 0
        report = boundaries.recovered_report(boundary, str(checkpoint), read_metadata(checkpoint)["state"],
                                             read_history(checkpoint), logged, first_step)
        kept[boundary.number] = boundaries.record(report)
        append_boundary_record(run, kept[boundary.number])
        get_run_logger().warning("%s: the row of %s was not written before its process ended; recovered from %s",
                                 run.boundary_records, boundaries.label(boundary), checkpoint.name)
    return [kept[number] for number in sorted(kept)]


def say_progress(line: str) -> None:
    """A progress line in the current (boundary) flow run's log — the console of ``comlrl run`` and the
    Prefect UI; task-run loggers are quiet on the console (flows/runs.py) — and nothing outside a run."""
    from prefect.context import FlowRunContext
    from prefect.logging.loggers import flow_run_logger

    context = FlowRunContext.get()
    if context is not None and context.flow_run is not None:
        flow_run_logger(context.flow_run, context.flow).info(line)


def latest_checkpoint(run: RunPaths) -> str | None:
    """The run's newest complete checkpoint (None for a new run)."""
    from comlrl.checkpointing.io import latest_checkpoint as newest

    found = newest(run.checkpoints) if run.checkpoints.is_dir() else None
    return None if found is None else str(found)


def prefect_tags() -> dict[str, str]:
    """The Prefect flow run of this MLflow run (and its page, when a Prefect server is used: the
    embedded default's temporary server is gone once the run ends)."""
    tags = {"prefect.flow_run_id": str(flow_run.id)} if flow_run.id else {}
    if PREFECT_API_URL.value() and flow_run.ui_url:
        tags["prefect.flow_run_url"] = flow_run.ui_url
    return tags


def durable_report(session: Session, report: Any) -> Any:
    """``report`` of an epoch as the run's record has it, not as this process saw it: the mean of every step
    since the previous boundary in the history (restored with the checkpoint, so a resumed epoch's steps before
    the stop count) and the evaluations in the run's logged metrics (whichever process made them); its time
    stays this process's."""
    rows = [record["row"] for record in session.records if record.get("row")]
    first_step = rows[-1]["step"] if rows else 0
    durable = boundaries.recovered_report(report.boundary, report.checkpoint, {"global_step": report.last_step},
                                          session.trainer.history,
                                          tracking.logged_metrics(session.callback, "eval/"), first_step)
    return dataclasses.replace(durable, seconds=report.seconds)


def run_boundary(session: Session, number: int) -> dict[str, Any] | None:
    """One boundary through the training run's API: its steps (a task per ``execution.steps_per_task``),
    its end (a PbRL stage runs here) and its checkpoint; returns its record, None when the run stopped. A stop
    signal between its tasks (where Prefect's own handler would crash the flow run) sets the run's stop request:
    the next task stops before any further step."""
    with session.run.signals():
        return boundary_tasks(session, number)


def boundary_tasks(session: Session, number: int) -> dict[str, Any] | None:
    training, boundary = session.run, session.run.plan[number - 1]
    session.started.add(number)
    steps = training.steps_left()
    if steps:
        stages = [stage.method for stage in session.trainer.step_stages] or ["train step"]
        first = session.trainer.state.step_in_epoch + 1
        for part in boundaries.chunks(steps, session.spec.execution.steps_per_task):
            name = boundaries.steps_task_name(boundary, first + part.start, first + part.stop - 1, stages)
            tasks.run_steps.with_options(task_run_name=name)(quote(training), len(part), f"b{number}")
            if training.stopped is not None:
                return None
    metrics = None
    if boundary.stage is not None:  # a PbRL stage's work is its end: one task named after the stage
        metrics = tasks.close_boundary.with_options(task_run_name=boundaries.label(boundary))(
            quote(training), f"{boundary.stage}-b{number}")
    else:
        tasks.close_boundary.with_options(task_run_name=boundaries.task_name(boundary, "end of epoch"))(
            quote(training), f"b{number}")
    if training.stopped is not None:
        return None
    saved = tasks.save_boundary.with_options(task_run_name=boundaries.task_name(boundary, "checkpoint"))(
        quote(training), metrics, return_state=True)
    report, session.last_task_run = saved.result(), saved.state_details.task_run_id
    if boundary.stage is None:  # the whole epoch's row, however many processes trained it (see durable_report)
        report = durable_report(session, report)
    record = boundaries.record(report)
    row = record["row"]
    session.finished[number] = record
    session.publisher.submit(artifacts.publish_table, session.paths.run_id,
                             [r["row"] for r in session.records if r["row"]] + [row])
    line = boundaries.describe(row)
    get_run_logger().info(line)
    emit("boundary", line, row=row, number=number, total=boundary.total)
    return record


@flow(name="comlrl-boundary", persist_result=False, validate_parameters=False, log_prints=True)
def boundary_flow(run_id: str, number: int) -> State:
    """A boundary as its own subflow run; its final state's message is the boundary's summary (Cancelled
    when a stop signal ended the run inside it)."""
    session = LIVE[run_id]
    record = run_boundary(session, number)
    if record is None:
        return Cancelled(message=stop_message(session))
    return Completed(message=boundaries.describe(record["row"]), data=record)


def boundary_in_subflow(session: Session, boundary: Boundary) -> dict[str, Any] | None:
    """The boundary as a subflow (None when the run stopped in it). Once the Prefect server does not
    answer (a health check first, then the subflow's own calls; :mod:`flows.orchestrator`), this and the
    remaining boundaries run inside the parent flow run instead: training waits on a server that hangs
    for at most one call. A server that answers with an error (its database restarting, say) is asked
    again for up to :data:`ANSWERED_ERROR_WINDOW` seconds before that, and an end state it refused is
    recorded once it accepts one (:func:`record_refused_ends`), so a database restart loses no record."""
    if session.subflows:
        if orchestrator.answers() and session.last_task_run is not None:  # the server has written the last task
            orchestrator.await_task_recorded(session.last_task_run)
        deadline, refused = time.monotonic() + ANSWERED_ERROR_WINDOW, 0
        while orchestrator.outage() is None:
            try:
                state = boundary_flow.with_options(flow_run_name=boundaries.title(boundary))(
                    session.paths.run_id, boundary.number, return_state=True)
                if refused:
                    supersede_refused_starts(boundaries.title(boundary), state.state_details.flow_run_id)
                record_refused_ends(session)
                if state.is_cancelled():
                    return None
                return state.result()  # raises the boundary's error
            except Exception as error:
                if boundary.number in session.finished:  # done; only its final state was not recorded
                    if orchestrator.unanswered(error):  # else the health check before the next one decides
                        orchestrator.record_outage(error)
                    else:
                        session.unrecorded[boundary.number] = boundaries.title(boundary)
                    return session.finished[boundary.number]
                if boundary.number in session.started or session.run.stopped is not None:
                    raise
                if orchestrator.unanswered(error) or time.monotonic() >= deadline:
                    orchestrator.record_outage(error)
                    break
                if not refused:
                    get_run_logger().warning("the Prefect API refused to start the subflow of %s (%s); asking again "
                                             "for up to %g s", boundaries.label(boundary), str(error)[:200],
                                             ANSWERED_ERROR_WINDOW)
                refused += 1
                time.sleep(ANSWERED_ERROR_PAUSE)
        session.subflows = False
        get_run_logger().warning("the Prefect API could not start the subflow of %s (%s); this and the remaining "
                                 "boundaries run inside the flow run", boundaries.label(boundary),
                                 (orchestrator.outage() or "")[:300])
    return run_boundary(session, boundary.number)


def subflows_named(client: Any, titles: list[str]) -> list[Any]:
    """This flow run's subflow runs named one of ``titles``, as the server has them."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, FlowRunFilterParentFlowRunId

    return client.read_flow_runs(flow_run_filter=FlowRunFilter(
        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run.id]), name=FlowRunFilterName(any_=titles)))


def unfinished(run: Any) -> bool:
    return run.state is None or not run.state.is_final()


def supersede_refused_starts(title: str, kept: Any) -> None:
    """Cancel what refused starts of subflow ``title`` left on the server (a flow run created before its state
    was refused), keeping ``kept``, the one that ran. Best effort."""
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            for child in subflows_named(client, [title]):
                if str(child.id) != str(kept) and unfinished(child):
                    client.set_flow_run_state(child.id, Cancelled(
                        message=f"superseded: the server refused this start; flow run {kept} ran {title}"), force=True)
    except Exception as error:
        get_run_logger().debug("could not cancel the refused starts of %s: %s", title, error)


def record_refused_ends(session: Session) -> None:
    """Record the end state that the server refused for finished boundaries' subflows (still shown Running):
    Completed, with the boundary's summary. Best effort, while the server answers."""
    if not session.unrecorded or orchestrator.outage() is not None:
        return
    from prefect.client.orchestration import get_client

    titles = {title: number for number, title in session.unrecorded.items()}
    try:
        with get_client(sync_client=True) as client:
            for child in subflows_named(client, list(titles)):
                number = titles[child.name]
                if unfinished(child):
                    client.set_flow_run_state(child.id, Completed(message=boundaries.describe(
                        session.finished[number]["row"])), force=True)
                session.unrecorded.pop(number, None)
    except Exception as error:  # tried again after the next boundary
        get_run_logger().debug("could not record the end of %s yet: %s", sorted(titles), error)


def stop_message(session: Session) -> str:
    stopped = session.run.stopped
    where = f"checkpoint {stopped.checkpoint}" if stopped.checkpoint else "no checkpoint could be written"
    return (f"{stopped} — {where}; continue with: {executable('comlrl')} resume {session.paths.run_id} "
            f"--workdir {session.paths.workdir}")


def end_tracking(session: Session, status: str) -> None:
    """Mark the MLflow run ``status`` (KILLED, FAILED; a resume sets it RUNNING again) and deliver what the
    spool holds (bounded; the rest waits for a resume or ``comlrl sync``); never masks the real error. The room
    the run kept (:func:`flows.full_disk.keep_room`) is freed first: on a full disk, it takes the status."""
    full_disk.release_room()
    try:
        session.callback.set_status(status)
        session.callback.close()
    except Exception as error:  # the tracking server may be the thing that failed
        get_run_logger().warning("could not mark the MLflow run %s: %s", status, error)


def run_boundaries(spec: RunSpec, run: RunPaths, root: str, tracking_uri: str,
                   progress_artifact: ProgressArtifact | None,
                   publisher: artifacts.BackgroundPublisher) -> Session:
    """Start the training run and every boundary it has left, each a subflow; returns the session (its
    run's ``stopped`` says whether a stop signal ended it early)."""
    session = start(spec, run, root, tracking_uri, read_boundary_records(run), progress_artifact, publisher)
    LIVE[run.run_id] = session
    try:
        # One settings context for all boundary subflows: no heartbeat threads (see the module docstring).
        # A stop signal between two boundaries sets the stop request (not Prefect's crash): the next one stops.
        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}), session.run.signals():
            while (boundary := session.run.next_boundary) is not None:
                record = boundary_in_subflow(session, boundary)
                if record is None:
                    break
                session.records.append(record)
                append_boundary_record(run, record)
            record_refused_ends(session)  # the last boundary's, if the server refused it
    except BaseException as error:
        session.run.abort(error)  # the last completed step's checkpoint, when the state allows it
        end_tracking(session, "KILLED" if isinstance(error, (KeyboardInterrupt, TerminationSignal)) else "FAILED")
        raise
    finally:
        LIVE.pop(run.run_id, None)
    if session.run.stopped is not None:
        killed = isinstance(session.run.stopped, TrainingInterrupted)
        end_tracking(session, "KILLED" if killed else "FAILED")
    return session


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
    orchestrator.clear_outage()  # a new run trusts the server until it stops answering
    orchestrator.quiet_outage_tracebacks()  # if it does, one line per failed call, not a traceback wall
    root = str(Path(root or os.getcwd()).resolve())
    tracking_uri = tracking_uri or default_tracking_uri(workdir)
    spec = tasks.validate_spec(spec_path, root)
    if init_from_alias:
        spec = tasks.use_registered_agents(spec, tracking_uri, init_from_alias)
    run = prepare_run(spec, spec_path, run_id, workdir, root)
    lock = claim_run(run)  # refused while another process trains this run
    # Room to record the run's end if its disk fills (released by end_tracking, and here at any end).
    full_disk.keep_room([run.directory, *filter(None, [full_disk.store_directory(tracking_uri)])],
                        f".comlrl-room-{run.run_id}")
    try:  # so earlier flow runs of this run that the server still shows "Running" are stale
        orchestrator.crash_stale_flow_runs(run.run_id, flow_run.id, flow_run.name or run.run_id)
        return train_run(spec, run, root, tracking_uri)
    finally:
        full_disk.release_room()
        lock.release()


def stopped_state(session: Session, stopped: Exception, message: str) -> State:
    """The flow's end state for a run that stopped early (``message`` logged): Cancelled for a stop signal,
    Failed for the non-finite guard; its data say where it can resume and the process's exit status."""
    request = session.run.request
    info = {"run_id": session.paths.run_id, "checkpoint": getattr(stopped, "checkpoint", None),
            "reason": str(stopped), "signal": request.signal_name, "exit_status": request.exit_status}
    get_run_logger().warning(message)
    if isinstance(stopped, TrainingInterrupted):
        return Cancelled(message=message, data=info)
    return Failed(message=message, data=info)


def train_run(spec: RunSpec, run: RunPaths, root: str, tracking_uri: str) -> Any:
    """Every boundary left, then the end of the run (:func:`finish`); a Cancelled (stop signal) or Failed
    (non-finite guard) state when the training run stopped early."""
    progress_artifact = ProgressArtifact(artifacts.artifact_key(run.run_id, "progress"),
                                         f"Run {run.run_id}: training steps done", interval=PROGRESS_INTERVAL)
    publisher = artifacts.BackgroundPublisher()  # the boundaries' table artifact, off the training thread
    session = None
    try:
        try:
            session = run_boundaries(spec, run, root, tracking_uri, progress_artifact, publisher)
            stopped = session.run.stopped
            if stopped is not None:
                return stopped_state(session, stopped, stop_message(session))
            try:
                tasks.finish_training(quote(session.run))
            except TrainingInterrupted as stopped:  # a stop signal while the final checkpoint was written
                end_tracking(session, "KILLED")
                return stopped_state(session, stopped, f"{stopped}; finish it with: {executable('comlrl')} resume "
                                                       f"{run.run_id} --workdir {run.workdir}")
        finally:
            progress_artifact.close()
            publisher.close()
        return finish(session, spec, run, root)
    finally:
        if session is not None:  # what the run's rewards hold (the coding task's sandbox) ends with the run
            close_rewards(session.trainer)


def close_rewards(trainer: Any) -> None:
    """Close the trainer's joint rewards: the one it trains on and, for MARLHF, the task reward its learned reward
    replaced (each :meth:`~comlrl.rollout.rewards.JointReward.close` closes its functions once)."""
    rewards = [getattr(trainer, name, None) for name in ("reward", "task_reward")]  # MARLHF's reward comes later
    for index, reward in enumerate(rewards):
        if reward is not None and all(reward is not earlier for earlier in rewards[:index]):
            reward.close()


def training_flow(spec: RunSpec) -> Flow:
    """``train_flow`` with the task runner the spec's ``execution`` section names."""
    if spec.execution.task_runner == "dask":
        return train_flow.with_options(task_runner=agents.dask_task_runner(spec.execution))
    return train_flow


def run_files(session: Session, spec: RunSpec, run: RunPaths) -> list[tuple[str, str | None]]:
    """What the MLflow run keeps besides metrics: curves, the spec as given and resolved, checkpoint metadata."""
    trainer = session.trainer
    # The whole run's curves, whichever processes trained it: the history restored with the checkpoints and
    # the evaluations in the run's spool (its MLflow metric history), not this process's evaluations only.
    evaluations = boundaries.eval_points(tracking.logged_metrics(session.callback, "eval/"))
    curve = tasks.plot_curves(quote(trainer.history), evaluations, str(run.directory / "reward_curve.png"))
    resolved = run.directory / "resolved_spec.json"
    config = dataclasses.asdict(trainer.args)
    resolved.write_text(json.dumps({**spec.model_dump(mode="json"), "config": config}, indent=2, default=str))
    files = [(curve, "plots"), (str(run.spec_copy), "spec"), (str(resolved), "spec")]
    files += [(str(path / "metadata.json"), f"checkpoints/{path.name}")
              for path in sorted(run.checkpoints.glob("checkpoint-*")) if (path / "metadata.json").is_file()]
    samples = tasks.save_sample_table(quote(trainer), str(run.directory / "sample_answers.json"))
    if samples is not None:  # rewards that keep what they judged (the coding task's programs and verdicts)
        files.append((samples, "samples"))
    pairs = trainer.preference_pairs
    if pairs is not None and len(pairs):  # preference runs only: no such task elsewhere
        files.append((tasks.save_preference_pairs(quote(pairs), str(run.directory / "preference_pairs.parquet")),
                      "preferences"))
    return files


FINISH_STAGES = ("the gate's evaluation", "artifact logging", "agent registration", "team registration", "the gate")


def finish(session: Session, spec: RunSpec, run: RunPaths, root: str) -> Any:
    """The end of a trained run: the gate's evaluation, artifacts, registration, the gate, the MLflow run FINISHED.
    A stop signal here is honoured at the next of :data:`FINISH_STAGES` (the one under way completes) and ends in
    a Cancelled state; a stop or an error leaves the MLflow run KILLED or FAILED, never RUNNING, and
    ``comlrl resume`` does the end again (training is complete: no step runs twice)."""
    stages = iter(FINISH_STAGES)

    def next_stage() -> None:
        stage = next(stages)
        if session.run.request.requested:
            raise TrainingInterrupted(f"{session.run.request.signal_name} received: stopped before {stage}; training "
                                      "is complete", session.run.last_checkpoint())

    try:
        with session.run.signals():
            result = finish_stages(session, spec, run, root, next_stage)
        if isinstance(result, State):
            return result
    except TrainingInterrupted as stopped:
        end_tracking(session, "KILLED")
        where = Path(stopped.checkpoint).name if stopped.checkpoint else "no checkpoint"
        return stopped_state(session, stopped, f"{stopped} ({where}); finish it with: {executable('comlrl')} resume "
                                               f"{run.run_id} --workdir {run.workdir}")
    except BaseException as error:
        end_tracking(session, "KILLED" if isinstance(error, (KeyboardInterrupt, TerminationSignal)) else "FAILED")
        raise
    artifacts.best_effort(publish, session, spec, run, result)
    (run.directory / "result.json").write_text(json.dumps(result, indent=2))
    emit("gate", result["gate"]["reason"], gate=result["gate"])
    return result


def finish_stages(session: Session, spec: RunSpec, run: RunPaths, root: str, next_stage: Any) -> dict[str, Any] | State:
    """:data:`FINISH_STAGES` in order, ``next_stage()`` before each; the run's result once MLflow has it FINISHED
    (a Failed state when MLflow did not take the records in time: they wait in the spool)."""
    identity, trainer, records = session.identity, session.trainer, session.records
    # The gate judges the final agents: one evaluation now (not a training eval point, so not logged as one).
    next_stage()
    evaluation = tasks.evaluate.with_options(task_run_name="evaluate the candidate")(quote(trainer), "gate")
    next_stage()
    tasks.log_artifacts(identity, run_files(session, spec, run))
    if not session.callback.close(warn=False):  # MLflow still down after the bounded wait: the spool keeps it all
        unavailable = session.callback.unavailable()
        return Failed(message=str(unavailable), data=unavailable)  # `comlrl sync` / `comlrl resume` finish it
    tags = {**run_tags(spec, run), "mlflow.run_id": identity["run_id"]}
    alias = spec.registry.alias
    next_stage()
    registered = tasks.register_agents(identity, quote(trainer), spec, tags, alias)
    next_stage()
    team = tasks.register_team(identity, quote(trainer), spec, tags, alias, str(run.directory / "team"), registered)
    tasks.point_alias(identity["tracking_uri"], team, registered, alias)  # once all are registered and tagged
    candidates = {entry["name"]: entry["version"] for entry in [team, *registered]}
    next_stage()
    decision = tasks.gate(spec, evaluation, candidates, identity["tracking_uri"], root, str(run.workdir), alias)
    tasks.finish_run(identity)
    return {"run_id": run.run_id, "mlflow_run_id": identity["run_id"], "tracking_uri": identity["tracking_uri"],
            "checkpoint": session.run.last_checkpoint(), "evaluation": evaluation,
            "registered": registered, "team": team, "gate": decision.as_dict(),
            "boundaries": [r["row"] for r in records if r["row"]]}


def publish(session: Session, spec: RunSpec, run: RunPaths, result: dict[str, Any]) -> None:
    """The run's Prefect artifacts at the end: the gate decision, links to MLflow, the summary."""
    identity, trainer = session.identity, session.trainer
    entries = [result["team"], *result["registered"]]
    artifacts.publish_gate(run.run_id, result["gate"])
    urls = artifacts.publish_links(run.run_id, identity, entries)
    metric, score = boundaries.primary_eval(result["evaluation"])
    train, evaluation = spec.dataset.train, spec.dataset.eval
    artifacts.publish_summary(run.run_id, {
        "name": spec.name, "run_id": run.run_id, "algorithm": spec.algorithm, "num_agents": trainer.num_agents,
        "models": [str(source) for source in trainer.agent_sources], "spec_hash": spec_hash(spec),
        "train": getattr(train, "path", None) or str(train), "train_rows": len(trainer.train_dataset),
        "eval": (getattr(evaluation, "path", None) or str(evaluation)) if evaluation else None,
        "eval_rows": len(trainer.eval_dataset) if trainer.eval_dataset is not None else None,
        "steps": trainer.state.global_step, "boundaries": result["boundaries"], "eval_metric": metric,
        "eval_score": score, "registered": [{**entry, "url": url} for entry, url in zip(entries, urls[1:])],
        "gate": result["gate"], "mlflow_run_id": identity["run_id"], "mlflow_run_url": urls[0],
        "checkpoint": result["checkpoint"], "team": team_model_name(spec.registered_name),
    })
