"""The working directory of pipeline runs and the embedded-default service settings.

Layout under the working directory (default ``.comlrl/``)::

    prefect/              PREFECT_HOME of the embedded default (ephemeral API database)
    prefect/storage/      Prefect result storage (the flows persist no results)
    mlflow/mlflow.db      the MLflow SQLite store (when MLFLOW_TRACKING_URI is not set)
    mlflow/artifacts/     its artifact root
    models/               tiny demo models, agents exported from the registry
    runs/<run_id>/        spec.yaml (as first run), checkpoints/checkpoint-N[-stepS], boundaries.jsonl, reward_curve.png,
                          resolved_spec.json, team/ (the team model as registered), tracking/
                          (the MLflow spool), result.json, flow.lock (held while a process trains it),
                          mlflow_run.json (the MLflow run that replaced the one its checkpoints name:
                          ``comlrl resume --new-mlflow-run``, flows/new_mlflow_run.py)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from comlrl.checkpointing.lock import DirectoryLock, DirectoryLockedError
from flows.spec import RunSpec, check_run_id, spec_hash
from flows.tracking_store import default_tracking_uri, sqlite_uri

logger = logging.getLogger(__name__)


# Models and datasets come from disk (or the local cache) unless the environment says otherwise; the CLI applies
# these before it validates a spec, so validation and the run agree on whether a hub id can be found.
OFFLINE_DEFAULTS = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def apply_offline_defaults() -> None:
    for key, value in OFFLINE_DEFAULTS.items():
        os.environ.setdefault(key, value)


def configure_embedded_default(workdir: str | Path) -> dict[str, str]:
    """Environment for Prefect's ephemeral mode and the local MLflow store under ``workdir``.

    Call before importing prefect. Settings already in the environment win, so
    ``PREFECT_API_URL`` / ``MLFLOW_TRACKING_URI`` point the same flows at real servers.
    """
    workdir = Path(workdir).resolve()
    defaults = {
        "PREFECT_HOME": str(workdir / "prefect"),
        "PREFECT_LOCAL_STORAGE_PATH": str(workdir / "prefect" / "storage"),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        **OFFLINE_DEFAULTS,
        "TOKENIZERS_PARALLELISM": "false",
        "GIT_PYTHON_REFRESH": "quiet",
        # One "Finished in state Completed()" line per task drowns the per-boundary summaries
        # on a console; the task-run states stay in Prefect's records and UI.
        "PREFECT_LOGGING_LOGGERS_PREFECT_TASK_RUNS_LEVEL": "WARNING",
    }
    if "PREFECT_API_URL" not in os.environ:
        # The ephemeral server has no CSRF protection; without this the client asks it for a token
        # (a refused extra request) for every new API client, one per boundary subflow.
        defaults["PREFECT_CLIENT_CSRF_SUPPORT_ENABLED"] = "false"
        # Prefect pastes PREFECT_HOME into its database URI, where a "?" or "%" in the workdir's name would name
        # another file: for such a name, the same database (PREFECT_HOME/prefect.db) by a URI that survives it.
        database = workdir / "prefect" / "prefect.db"
        if (uri := sqlite_uri(database, "sqlite+aiosqlite")) != f"sqlite+aiosqlite:///{database}":
            defaults["PREFECT_API_DATABASE_CONNECTION_URL"] = uri
    applied = {}
    for key, value in defaults.items():
        if key not in os.environ:
            os.environ[key] = value
            applied[key] = value
    os.environ.setdefault("MLFLOW_TRACKING_URI", default_tracking_uri(workdir))  # creates the embedded store
    if "PREFECT_HOME" in applied:  # Prefect makes PREFECT_HOME without its parents, and none when its database URI
        # is given; with MLFLOW_TRACKING_URI set, no embedded store has made the working directory either
        (workdir / "prefect").mkdir(parents=True, exist_ok=True)
    return applied


@dataclass(frozen=True)
class RunPaths:
    run_id: str
    workdir: Path

    @property
    def directory(self) -> Path:
        return self.workdir / "runs" / self.run_id

    @property
    def checkpoints(self) -> Path:
        return self.directory / "checkpoints"

    @property
    def spec_copy(self) -> Path:
        return self.directory / "spec.yaml"

    @property
    def root_file(self) -> Path:
        return self.directory / "root.txt"

    @property
    def boundary_records(self) -> Path:
        return self.directory / "boundaries.jsonl"

    @property
    def artifact_root(self) -> Path:
        return self.workdir / "mlflow" / "artifacts"


def parse_record(line: bytes) -> dict[str, Any] | None:
    """A ``boundaries.jsonl`` line's record, None when the line holds none. An older version appended onto a
    torn line; the whole record after the torn bytes is still found."""
    start = line.rfind(b'{"number": ')
    for candidate in (line, line[start:]) if start > 0 else (line,):
        try:
            record = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("number"), int):
            return record
    return None


def read_boundary_records(run: RunPaths) -> list[dict[str, Any]]:
    """The records of the boundaries finished so far (``boundaries.jsonl``), one per boundary (the last line
    of each wins), in order. A line that holds no whole record (a write cut short by a crash) is skipped with
    a warning, and the lines after it are read."""
    path = run.boundary_records
    if not path.is_file():
        return []
    by_number: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(path.read_bytes().split(b"\n"), start=1):
        if not line.strip():
            continue
        record = parse_record(line)
        if record is None:
            logger.warning("%s: line %d holds no whole boundary record (a write cut short; %d bytes starting %r); "
                           "skipped: its boundary is recovered from its checkpoint or trained again",
                           path, number, len(line), line[:40])
            continue
        by_number[record["number"]] = record
    return [by_number[number] for number in sorted(by_number)]


def append_boundary_record(run: RunPaths, record: dict[str, Any]) -> None:
    """Append ``record`` to ``boundaries.jsonl`` as one line, in one write, fsync'd; after a torn last line
    (a crash mid-write) it starts a fresh line, so the torn bytes never take a whole record with them."""
    line = (json.dumps(record, default=str) + "\n").encode("utf-8")
    with open(run.boundary_records, "ab+", buffering=0) as handle:
        if handle.seek(0, os.SEEK_END) > 0:
            handle.seek(-1, os.SEEK_END)
            if handle.read(1) != b"\n":
                line = b"\n" + line
        if handle.write(line) != len(line):
            raise OSError(f"{run.boundary_records}: a boundary record was written only in part")
        os.fsync(handle.fileno())


class RunRefused(ValueError):
    """This command cannot train the run it names, and resuming cannot help: it was started from another spec."""


class RunBusy(RunRefused, RuntimeError):
    """Another live process trains the run right now."""


class RunLock:
    """``runs/<run_id>/flow.lock``, locked by the process that trains the run
    (:class:`comlrl.checkpointing.lock.DirectoryLock`, one holder per object: the OS drops it when
    that process ends, however it ends)."""

    def __init__(self, run: RunPaths) -> None:
        self._lock = DirectoryLock(run.directory, "flow.lock", what=f"run {run.run_id!r}", shared=False)
        self.path = self._lock.path

    def acquire(self) -> bool:
        """Take the lock if it is free (never waits); whether this process holds it now."""
        try:
            self._lock.acquire()
        except DirectoryLockedError:
            return False
        return True

    def release(self) -> None:
        self._lock.release()


def claim_run(run: RunPaths) -> RunLock:
    """The run's lock, held by this process; :class:`RunBusy` (a ``RuntimeError``) naming the lock file when another live
    process trains the same run (two processes would write the same checkpoints)."""
    lock = RunLock(run)
    if not lock.acquire():
        raise RunBusy(f"run {run.run_id!r} is being trained by another process (it holds {lock.path}); "
                           "wait for it to end, or give this run another run_id")
    return lock


def default_run_id(spec: RunSpec) -> str:
    return f"{spec.name}-{spec_hash(spec)[:10]}"


def prepare_run(spec: RunSpec, spec_path: str | Path, run_id: str | None, workdir: str | Path, root: str | Path) -> RunPaths:
    """The run's directory; a new run keeps a copy of its spec (and the root its paths are
    relative to, for ``comlrl resume``); a re-run must bring the same spec."""
    run_id = run_id or default_run_id(spec)
    check_run_id(run_id)
    run = RunPaths(run_id, Path(workdir).resolve())
    run.directory.mkdir(parents=True, exist_ok=True)
    digest = spec_hash(spec)
    stamp = run.directory / "spec.sha256"
    if stamp.is_file() and stamp.read_text().strip() != digest:
        raise RunRefused(
            f"run {run_id!r} was started from a different spec (hash {stamp.read_text().strip()[:10]}, this one "
            f"{digest[:10]}); resume it with its own spec ({run.spec_copy}) or choose a new --run-id"
        )
    if not stamp.is_file():
        shutil.copyfile(spec_path, run.spec_copy)
        run.root_file.write_text(str(Path(root).resolve()) + "\n")
        stamp.write_text(digest + "\n")
    return run

