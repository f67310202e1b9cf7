"""Issue "Faults in the field, part 3", case 5: two faults that each ended in the wrong place.

- A resume whose run directory became read-only crashed in the preflight's lock check (a raw traceback, OSError
  Errno 30, exit 1); it is now refused like a read-only ``--workdir`` at ``run``: exit 2, one line naming the
  directory. Root ignores ``chmod``, so the run directory is a read-only bind mount in a mount namespace of the
  ``comlrl`` process's own (as tests/test_preflight.py mounts a workdir).
- ``MLFLOW_TRACKING_URI=sqlite:////proc/...``, a database that cannot be created, failed after the start (exit 1
  after 46-69 s, naming neither the variable nor the path); the preflight now refuses it in the seconds spec
  validation takes, naming both. Followed, the advice (a writable place) trains: which also needed the embedded
  Prefect server's home made when ``MLFLOW_TRACKING_URI`` is set and the working directory is new (it failed to
  start: nothing else had made the directory).
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows import preflight as pf
from flows.runs import configure_embedded_default
from flows.tracking_store import sqlite_uri
from judged_run import heal, judged_project

REPOSITORY = Path(__file__).resolve().parent.parent
COMLRL = str(Path(sys.executable).parent / "comlrl")
REFUSAL_SECONDS = 60  # spec validation included (torch imported): see tests/test_preflight.py
RUN_ID = "faults-1"


def comlrl(*arguments: str, wrapper: list[str] = (), **env: str) -> tuple[int, str, float]:
    clean = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_", "MLFLOW_"))}
    started = time.monotonic()
    result = subprocess.run([*wrapper, COMLRL, *arguments], env={**clean, "HF_HUB_OFFLINE": "1", **env},
                            capture_output=True, text=True, cwd=REPOSITORY, timeout=600)
    return result.returncode, result.stderr, time.monotonic() - started


def refusal(code: int, stderr: str, seconds: float) -> str:
    """Exit 2 in time, no traceback, one line: that line."""
    assert code == 2 and seconds < REFUSAL_SECONDS, (code, seconds, stderr[-4000:])
    assert "Traceback" not in stderr, stderr[-4000:]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("comlrl: "), lines
    return lines[0]


def trained(code: int, stderr: str, seconds: float) -> None:
    assert code == 0, stderr[-4000:]
    assert "Traceback" not in stderr and not [line for line in stderr.splitlines() if line.startswith("comlrl:")]


def read_only(directory: Path) -> list[str]:
    """A wrapper that runs a command with ``directory`` bind-mounted read-only (97: no mount allowed here; 98: the
    mount stayed writable)."""
    script = ('mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" || exit 97; '
              'touch "$0/probe" 2>/dev/null && exit 98; exec "$@"')
    namespace = ["unshare", "--mount", "--propagation", "private"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    return [*namespace, "sh", "-c", script, str(directory)]


@pytest.mark.e2e  # a real run that fails (~60 s), the refused resume (~15 s) and the resume once writable (~45 s)
def test_a_resume_whose_run_directory_became_read_only_is_refused_in_one_line(tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    root, workdir = tmp_path / "project", tmp_path / "work"
    spec = judged_project(root, "faults", epochs=2, fail_at=3)
    code, stderr, _ = comlrl("run", str(spec), "--root", str(root), "--workdir", str(workdir), "--run-id", RUN_ID)
    assert code == 1 and "the judge is down" in stderr, stderr[-4000:]
    heal(root)
    run = workdir / "runs" / RUN_ID
    assert (run / "flow.lock").is_file() and (run / "checkpoints" / "checkpoint-1").is_dir()
    before = sorted(path.relative_to(run) for path in run.rglob("*"))

    code, stderr, seconds = comlrl("resume", RUN_ID, "--workdir", str(workdir), wrapper=read_only(run))
    if code in (97, 98) or "unshare:" in stderr:
        pytest.skip(f"no read-only bind mount here: {stderr.strip()[-200:]}")
    line = refusal(code, stderr, seconds)
    assert f"run {RUN_ID!r} cannot be written: {str(run.resolve())!r} is not writable (Read-only file system)" in line
    assert "fix its permissions or mount, then run the same command again" in line, line
    assert sorted(path.relative_to(run) for path in run.rglob("*")) == before

    trained(*comlrl("resume", RUN_ID, "--workdir", str(workdir)))  # the same command, the mount gone
    assert (run / "checkpoints" / "checkpoint-2").is_dir() and (run / "result.json").is_file()


@pytest.mark.e2e  # a refusal (~15 s), then a real run against the store the advice asks for (~60 s)
def test_a_tracking_database_that_cannot_be_created_is_refused_naming_the_variable(tmp_path):
    root, workdir = tmp_path / "project", tmp_path / "work"
    spec = judged_project(root, "faults", epochs=1, fail_at=None)
    command = ("run", str(spec), "--root", str(root), "--workdir", str(workdir), "--run-id", RUN_ID)

    line = refusal(*comlrl(*command, MLFLOW_TRACKING_URI="sqlite:////proc/comlrl/mlflow.db"))
    assert line == ("comlrl: MLFLOW_TRACKING_URI='sqlite:////proc/comlrl/mlflow.db': its database "
                    "'/proc/comlrl/mlflow.db' cannot be created: '/proc' does not take a file (No such file or "
                    "directory): point it at a writable place, or unset it to use the embedded store under --workdir")
    assert not workdir.exists()  # nothing started

    # As advised: a writable place (its folder made by MLflow), and a working directory that does not exist yet.
    database = tmp_path / "tracking" / "store" / "mlflow.db"
    trained(*comlrl(*command, MLFLOW_TRACKING_URI=f"sqlite:///{database}"))
    with sqlite3.connect(database) as db:
        assert db.execute("SELECT status FROM runs").fetchall() == [("FINISHED",)]
    assert not (workdir / "mlflow" / "mlflow.db").exists()  # the store is where the variable says, not the embedded one


# ---- the parts ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("uri, store, why", [
    ("sqlite:////proc/comlrl/mlflow.db", "database '/proc/comlrl/mlflow.db'", "'/proc' does not take a file"),
    ("sqlite+pysqlite:////proc/x.db", "database '/proc/x.db'", "'/proc' does not take a file"),
    ("file:///proc/comlrl/mlruns", "store '/proc/comlrl/mlruns'", "'/proc' does not take a file"),
    ("/proc/comlrl/mlruns", "store '/proc/comlrl/mlruns'", "'/proc' does not take a file"),
    ("sqlite:///{tmp}/a-file/mlflow.db", "database '{tmp}/a-file/mlflow.db'", "'{tmp}/a-file' is a file, not a"),
])
def test_a_local_store_that_cannot_be_created_is_named(uri, store, why, tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    uri, store, why = (text.format(tmp=tmp_path) for text in (uri, store, why))
    [problem] = pf.service_problems({"MLFLOW_TRACKING_URI": uri})
    assert problem.startswith(f"MLFLOW_TRACKING_URI={uri!r}: its {store} cannot be created: {why}"), problem
    assert problem.endswith(f"point it at a writable place, {pf.TRACKING_FIX}")
    assert sorted(tmp_path.iterdir()) == [tmp_path / "a-file"]  # the check left nothing


def test_a_store_named_by_an_sqlite_file_uri_is_read_as_its_path(tmp_path):
    """The URI form flows.tracking_store gives awkward names (a ``file:`` URI inside, encoded twice)."""
    awkward = tmp_path / "we?ird %41#" / "mlflow.db"
    assert pf.local_store(sqlite_uri(awkward)) == awkward
    assert pf.tracking_uri_problem(sqlite_uri(awkward)) is None
    below_a_file = tmp_path / "a-file?" / "mlflow.db"
    below_a_file.parent.write_text("not a directory")
    assert f"its database {str(below_a_file)!r} cannot be created" in pf.tracking_uri_problem(sqlite_uri(below_a_file))
    assert pf.local_store("sqlite:///:memory:") is None and pf.local_store("postgresql://db/mlflow") is None


def test_a_new_workdir_gets_prefect_home_when_mlflow_is_elsewhere(tmp_path):
    """Prefect makes PREFECT_HOME without its parents; with MLFLOW_TRACKING_URI set no embedded store makes the
    working directory, so the embedded Prefect server could not start in a new one."""
    saved = dict(os.environ)
    try:
        for key in [key for key in os.environ if key.startswith(("PREFECT_", "MLFLOW_"))]:
            del os.environ[key]
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'elsewhere.db'}"
        configure_embedded_default(tmp_path / "new" / "work")
        assert os.environ["PREFECT_HOME"] == str(tmp_path / "new" / "work" / "prefect")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert (tmp_path / "new" / "work" / "prefect").is_dir()
    assert not (tmp_path / "new" / "work" / "mlflow").exists() and not (tmp_path / "elsewhere.db").exists()
