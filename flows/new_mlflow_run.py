"""A run continued in a new MLflow run: what ``comlrl resume RUN_ID --new-mlflow-run`` records and the flow acts on.

A run's checkpoints name the MLflow run it logs to, and a resume logs there again. When that MLflow run is gone
(deleted in MLflow, or its store removed) the operator's ``--new-mlflow-run`` writes ``runs/RUN_ID/mlflow_run.json``
(:func:`request`): the MLflow run that the newest checkpoint names is replaced. When the flow opens tracking,
:func:`identity` turns the checkpoint's identity into the new run's: on first use it starts an MLflow run in the same
experiment (by name), tagged with the run id, the spec hash and the replaced run's id (:data:`PREVIOUS_TAG`), and puts
the history so far into that run's tracking spool, where the run's sender delivers it first: the replaced run's metric
points up to the checkpoint (from the run's own spool of it, every point with its step and time), or, without that
spool, the checkpoint's step history. The record then names the new run, so a retry or a later resume before the next
checkpoint logs there too; the next checkpoint names it itself, and the record no longer applies. The identity also
carries ``history_bytes``, the spool offset where the run's own records begin (the points before it are the history
the checkpoint resumes, as a checkpoint's spool offset says for the run it names).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from flows.runs import RunPaths

RECORD = "mlflow_run.json"  # in the run's directory
PREVIOUS_TAG = "comlrl.previous_mlflow_run_id"
CONTINUED_TAG = "comlrl.continued_from"  # the checkpoint the new MLflow run continues from
NOTE_TAG = "mlflow.note.content"  # the run's description in MLflow's UI
POINTS_PER_RECORD = 1000  # MLflow's log_batch limit for metrics
NOT_LOGGED = ("step", "epoch")  # history columns that are the step's coordinates, not metrics

logger = logging.getLogger(__name__)


def newest_identity(run: RunPaths) -> tuple[Path | None, dict[str, Any] | None]:
    """The run's newest complete checkpoint and the MLflow identity its metadata records (None, None: no checkpoint)."""
    from comlrl.checkpointing import latest_checkpoint, read_metadata

    checkpoint = latest_checkpoint(run.checkpoints) if run.checkpoints.is_dir() else None
    if checkpoint is None:
        return None, None
    return checkpoint, read_metadata(checkpoint).get("mlflow")


def read_record(directory: Path) -> dict[str, Any] | None:
    """The run directory's request for a new MLflow run (None: there is none, or it is unreadable: then the
    checkpoint's MLflow run is used)."""
    try:
        record = json.loads((directory / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("replaces") else None


def write_record(directory: Path, record: dict[str, Any]) -> None:
    """Whole or not at all: a staging file renamed over the record."""
    staging = directory / f"{RECORD}.new"
    with open(staging, "w") as handle:
        handle.write(json.dumps(record, indent=1) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staging, directory / RECORD)


def request(run: RunPaths) -> str:
    """Record that the run continues in a new MLflow run, replacing the one its newest checkpoint names; returns that
    one's id. ``ValueError`` when no checkpoint names an MLflow run (a resume then finds or starts one itself)."""
    checkpoint, recorded = newest_identity(run)
    if not recorded or not recorded.get("run_id"):
        where = f"its newest checkpoint {checkpoint.name} names none" if checkpoint else "it has no checkpoint yet"
        raise ValueError(f"run {run.run_id!r} has no MLflow run to replace ({where}): resume it without "
                         "--new-mlflow-run; it logs to the MLflow run tagged with its run id, or starts one")
    write_record(run.directory, {"replaces": recorded["run_id"], "run_id": None, "checkpoint": checkpoint.name,
                                 "requested": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    return recorded["run_id"]


def logs_to(run: RunPaths, recorded: dict[str, Any] | None) -> str | None:
    """The MLflow run id a resume from a checkpoint that records ``recorded`` logs to: the checkpoint's, or the one
    that replaced it; None when there is none yet (a fresh run, or a new MLflow run requested and not yet made)."""
    if not recorded or not recorded.get("run_id"):
        return None
    record = read_record(run.directory)
    if record is not None and record["replaces"] == recorded["run_id"]:
        return record.get("run_id")
    return recorded["run_id"]


def identity(checkpoint: str | Path, recorded: dict[str, Any] | None, tracking_uri: str, experiment: str,
             artifact_root: str | Path | None, tags: dict[str, str]) -> dict[str, Any] | None:
    """The MLflow identity a run resumed from ``checkpoint`` (in ``runs/RUN_ID/checkpoints``) opens: ``recorded``,
    the checkpoint's own, unless the run directory's record replaces it; then the new run, started (with the history
    so far in its spool) the first time."""
    checkpoint = Path(checkpoint)
    directory = checkpoint.parent.parent
    record = read_record(directory)
    if not recorded or record is None or record["replaces"] != recorded.get("run_id"):
        return recorded
    owner = recorded.get("owner") or {}
    if record.get("run_id"):
        return {"run_id": record["run_id"], "experiment_id": record.get("experiment_id"), "tracking_uri": tracking_uri,
                "owner": owner, "history_bytes": record.get("history_bytes")}
    new = start_run(checkpoint, recorded, tracking_uri, experiment, artifact_root, tags)
    points = history_points(directory, checkpoint, recorded)
    new["history_bytes"] = write_history(directory / "tracking" / new["run_id"], new, points)
    write_record(directory, {**record, "run_id": new["run_id"], "experiment_id": new["experiment_id"],
                             "tracking_uri": tracking_uri, "history_bytes": new["history_bytes"]})
    steps = sorted({point[3] for point in points})
    logger.warning("run %s continues in the new MLflow run %s of experiment %r, replacing %s (tag %s); the %d metric "
                   "values it logged up to %s (steps %s) are logged there first", tags.get("comlrl.run_id"),
                   new["run_id"], experiment, recorded["run_id"], PREVIOUS_TAG, len(points), checkpoint.name,
                   f"{steps[0]}-{steps[-1]}" if steps else "none")
    return {**new, "owner": owner}


def start_run(checkpoint: Path, recorded: dict[str, Any], tracking_uri: str, experiment: str,
              artifact_root: str | Path | None, tags: dict[str, str]) -> dict[str, Any]:
    """The new MLflow run in experiment ``experiment`` (made when missing); one that an earlier attempt of this very
    request started (same run id, same replaced run) is taken again, so a retry makes no second run."""
    from comlrl import tracking

    client = tracking.mlflow_client(tracking_uri)
    experiment_id = tracking.ensure_experiment(tracking_uri, experiment, artifact_root)
    run_key, previous = tags[tracking.RUN_KEY_TAG], recorded["run_id"]
    found = client.search_runs([experiment_id], max_results=1, filter_string=(
        f"tags.`{tracking.RUN_KEY_TAG}` = '{run_key}' and tags.`{PREVIOUS_TAG}` = '{previous}'"))
    if found:
        return {"run_id": found[0].info.run_id, "experiment_id": experiment_id, "tracking_uri": tracking_uri}
    note = (f"Continues the training run {run_key} from {checkpoint.name}: the MLflow run it logged to before, {previous} "
            f"(recorded at {recorded.get('tracking_uri', tracking_uri)}), was gone when it resumed, so it resumed into "
            "this new run (a resume with --new-mlflow-run). The metrics up to that checkpoint were logged here from "
            "the run's own records, with their steps and times.")
    run = client.create_run(experiment_id, run_name=run_key, tags={
        **tags, PREVIOUS_TAG: previous, CONTINUED_TAG: checkpoint.name, NOTE_TAG: note})
    return {"run_id": run.info.run_id, "experiment_id": experiment_id, "tracking_uri": tracking_uri}


def history_points(directory: Path, checkpoint: Path, recorded: dict[str, Any]) -> list[list[Any]]:
    """``[key, value, timestamp_ms, step]`` of every metric the replaced MLflow run held when ``checkpoint`` was
    taken: from the run's spool of it (the latest point of each key and step written before the checkpoint), or,
    without a readable spool, from the checkpoint's step history (timed at the checkpoint)."""
    from comlrl.checkpointing import read_history, read_metadata
    from comlrl.tracking_spool import Spool, SpoolError

    state = read_metadata(checkpoint)["state"]
    cut = spool_offset(checkpoint, recorded["run_id"])
    try:
        spool = Spool(directory / "tracking" / recorded["run_id"])
        latest: dict[tuple[str, int], list[Any]] = {}
        for end, (key, value, timestamp, step) in spool.metric_points():
            if (end <= cut) if cut is not None else (int(step) <= state["global_step"]):
                latest[(key, int(step))] = [key, float(value), int(timestamp), int(step)]
        return [latest[key] for key in sorted(latest, key=lambda key: (key[1], key[0]))]
    except (SpoolError, OSError):
        pass
    when = int((checkpoint / "metadata.json").stat().st_mtime * 1000)
    return [[key, float(value), when, int(row["step"])] for row in read_history(checkpoint)
            for key, value in row.items() if key not in NOT_LOGGED and isinstance(value, (int, float))]


def spool_offset(checkpoint: Path, mlflow_run_id: str) -> int | None:
    """How far the run's spool of ``mlflow_run_id`` had come when ``checkpoint`` was taken (what the MLflow callback's
    state in it records), or None when it does not say."""
    from comlrl.checkpointing.io import STATE_FILE, load_pt
    from comlrl.errors import CheckpointError

    try:
        stateful = load_pt(checkpoint / STATE_FILE).get("stateful", {})
    except CheckpointError:
        return None
    for saved in stateful.values():
        if isinstance(saved, dict) and saved.get("run_id") == mlflow_run_id and "spool_bytes" in saved:
            return int(saved["spool_bytes"])
    return None


def write_history(spool_directory: Path, new: dict[str, Any], points: list[list[Any]]) -> int:
    """``points`` as the first records of the new run's spool (created), which the run's sender delivers; the
    spool's size after them (``history_bytes``: where the run's own records begin)."""
    from comlrl.tracking_spool import Spool

    spool = Spool(spool_directory, new)
    if spool.size > spool.header_end:
        return spool.size  # an earlier attempt of this request wrote them, and nothing came after
    spool.lock()
    try:
        spool.append([{"metrics": points[start:start + POINTS_PER_RECORD]}
                      for start in range(0, len(points), POINTS_PER_RECORD)])
    finally:
        spool.unlock()
    return spool.size
