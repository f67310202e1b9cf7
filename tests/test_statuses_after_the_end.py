"""Issue "Faults in the field, part 3", case 3: the MLflow run's status when a run ends during its registration.

The end of a run closes its tracking callback once everything is delivered, then registers the agents, each
logged inside ``mlflow.start_run``, whose block ends the MLflow run FINISHED (or FAILED) as it exits. The status a
stop or a failure sent afterwards went to the closed callback's spool only: a SIGTERM during registration left the
run FINISHED, a full MLflow store left it RUNNING. A status sent after the close is now delivered at once.

Real ``comlrl run`` processes on the letters task (the project of tests/test_run_failures.py); the MLflow store is
read with ``sqlite3``, not through the code under test."""

from __future__ import annotations

import re
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from comlrl import tracking
from test_run_failures import COMLRL, RUN_ID, closing_line, environment, finished, project, start, statuses, store


def mlflow_status(database: Path, run_id: str) -> str:
    with sqlite3.connect(database) as db:
        return db.execute("SELECT status FROM runs WHERE run_uuid = ?", (run_id,)).fetchone()[0]


@pytest.mark.parametrize("status", ["KILLED", "FAILED"])
def test_a_status_sent_after_the_callback_closed_reaches_mlflow_over_the_one_registration_left(status, tmp_path):
    import mlflow

    database = tmp_path / "mlflow.db"
    identity = tracking.open_run(f"sqlite:///{database}", "ends", "run-1", artifact_root=tmp_path / "artifacts")
    callback = tracking.MLflowCallback(identity, spool_dir=tmp_path / "spool")
    callback.on_log(None, {"reward_mean": 0.5}, 1)
    assert callback.close()  # everything delivered: what the end of a run does before it registers the agents
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"sqlite:///{database}")
    try:
        with mlflow.start_run(run_id=identity["run_id"]):  # how an agent is logged ...
            pass
    finally:
        mlflow.set_tracking_uri(previous)
    assert mlflow_status(database, identity["run_id"]) == "FINISHED"  # ... and what its block's end leaves
    delivered = callback.set_status(status)  # a stop (or a failure) before the next stage
    assert mlflow_status(database, identity["run_id"]) == status  # was FINISHED: the status stayed in the spool
    assert delivered
    records = [record for _, record in callback.spool.entries(callback.spool.header_end)]
    assert records[-1]["status"] == status and not list(callback.spool.pending())  # kept, and never sent again


def registration_under_way(workdir: Path) -> bool:
    """Whether the first agent's model has been logged (its MLmodel file is in the store's artifacts)."""
    artifacts = workdir / "mlflow" / "artifacts"
    return artifacts.is_dir() and any(artifacts.rglob("MLmodel"))


@pytest.mark.e2e  # a real comlrl run, ~60 s on a loaded 2-core machine
def test_a_sigterm_during_registration_leaves_the_mlflow_run_killed(tmp_path):
    spec, root = project(tmp_path, mode="ok")
    workdir, cwd = tmp_path / "work", tmp_path / "cwd"
    process = start(["run", str(spec), "--root", str(root), "--workdir", str(workdir), "--run-id", RUN_ID], cwd)
    deadline = time.monotonic() + 400
    while not registration_under_way(workdir):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-4000:]
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    code, _, stderr = finished(process)
    assert code == 128 + signal.SIGTERM, stderr[-4000:]
    line = closing_line(stderr)  # one comlrl: line, the last; no traceback on the console
    stopped = re.search(r"SIGTERM received: stopped before (team registration|the gate); training is complete", line)
    assert stopped is not None and f"resume {RUN_ID} --workdir {workdir}" in line, line
    assert statuses(workdir) == ["KILLED"]  # was FINISHED
    with store(workdir) as db:
        names = sorted(name for (name,) in db.execute("SELECT name FROM model_versions"))
    assert names[:2] == ["failures-agent-0", "failures-agent-1"]  # the stage under way completed


@pytest.mark.e2e  # a real comlrl run on a full store, ~60 s on a loaded 2-core machine
def test_a_full_mlflow_store_during_registration_leaves_the_mlflow_run_failed_and_names_the_disk(tmp_path):
    """The MLflow store's folder is a 1.4 MB tmpfs (bubblewrap's ``--size``): the store and the run's metrics fit,
    the registered models do not. (tests/test_run_failures.py resumes such a run once there is room.)"""
    from comlrl.sandbox.isolation import bwrap_binary

    spec, root = project(tmp_path, mode="ok")
    workdir, cwd, saved = tmp_path / "work", tmp_path / "cwd", tmp_path / "saved"
    (workdir / "mlflow").mkdir(parents=True)
    cwd.mkdir()
    script = f'"$0" run "$1" --root "$2" --workdir "$3" --run-id {RUN_ID}; code=$?; cp -a "$3/mlflow" "$4"; exit $code'
    full = subprocess.run([bwrap_binary(), "--dev-bind", "/", "/", "--size", str(1_400_000), "--tmpfs",
                           str(workdir / "mlflow"), "--", "sh", "-c", script, COMLRL, str(spec), str(root),
                           str(workdir), str(saved)],
                          env=environment(), cwd=cwd, capture_output=True, text=True, timeout=400)
    assert full.returncode == 1, full.stderr[-4000:]
    line = closing_line(full.stderr)
    assert "--- Logging error ---" not in full.stderr, full.stderr[-4000:]
    assert line.startswith(f"comlrl: run {RUN_ID} failed: MlflowException: ") and "database or disk is full" in line
    assert re.search(rf"; the disk is full: [\d.]+ (bytes|KB) free of 1\.3 MB on the file system mounted at "
                     rf"{re.escape(str(workdir / 'mlflow'))} \(tmpfs\)", line), line
    assert f"after freeing space on {workdir / 'mlflow'}, continue with:" in line, line
    (workdir / "mlflow").rmdir()
    saved.rename(workdir / "mlflow")
    assert statuses(workdir) == ["FAILED"]  # was RUNNING
    assert not list(workdir.rglob(".comlrl-room-*"))
