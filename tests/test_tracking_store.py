"""The embedded MLflow store (flows/runs.py): its URI names exactly ``<workdir>/mlflow/mlflow.db`` whatever the
workdir is called, nothing MLflow writes (the store, runs, artifacts, the registry) lands outside the workdir, and its
first creation is all or nothing (a full disk leaves no store behind, a retry works, two processes creating it at
once share one)."""

from __future__ import annotations

import multiprocessing
import os
import resource
import signal
import sqlite3
import time
from pathlib import Path

import pytest
import sqlalchemy

from flows.runs import configure_embedded_default
from flows.tracking_store import (default_tracking_uri, embedded_store, embedded_tracking_uri, ensure_embedded_store,
                                  publish_store, workdir_uri_problem)

# Each is read as URI syntax somewhere when written plainly: a query (?), a percent escape (%41 is "A", %% none), a
# fragment (#), a space, a character that is not printable (tab, newline) or not ASCII.
AWKWARD_NAMES = ["wd?x=1", "wd%41", "wd#frag", "wd with space", "wdé", "wd%%", "wd\tx", "wd\nx"]
NOT_UTF8 = os.fsdecode(b"wd\xff")  # the store works; MLflow's artifact URIs cannot name it (workdir_uri_problem)
ALL_AT_ONCE = "wd?x=1%41%%#frag é\t\n"
# RLIMIT_FSIZE that cuts MLflow's migrations short halfway (the whole store is ~0.95 MB); written in place, this
# left a store that no later run could open ("table logged_models already exists").
HALF_A_STORE = 250_000
CHILD_TIMEOUT = 120
FORK = multiprocessing.get_context("fork")  # the children start with MLflow already imported


@pytest.fixture
def environment(monkeypatch, tmp_path):
    """A clean MLflow setting, the environment restored afterwards (configure_embedded_default writes to it), and
    an empty current directory, where a stray store or ``./mlruns`` would show."""
    saved = dict(os.environ)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    yield
    os.environ.clear()
    os.environ.update(saved)


def workdir_in(tmp_path: Path, name: str) -> Path:
    """``name`` as the only entry of a directory of its own, so whatever lands beside it shows."""
    parent = tmp_path / "parent"
    parent.mkdir()
    return parent / name


def assert_nothing_beside(workdir: Path) -> None:
    assert os.listdir(workdir.parent) == [workdir.name]
    assert os.listdir(Path.cwd()) == []


def tables(database: Path) -> set[str]:
    with sqlite3.connect(database) as connection:
        return {row[0] for row in connection.execute("select name from sqlite_master where type = 'table'")}


def test_an_ordinary_workdir_keeps_the_plain_uri(tmp_path):
    workdir = tmp_path / "work"
    assert embedded_tracking_uri(workdir) == f"sqlite:///{workdir.resolve()}/mlflow/mlflow.db"
    assert embedded_store(workdir) == workdir.resolve() / "mlflow" / "mlflow.db"


@pytest.mark.parametrize("name", AWKWARD_NAMES + [ALL_AT_ONCE, NOT_UTF8], ids=ascii)
def test_sqlalchemy_opens_exactly_the_store_under_any_workdir_name(tmp_path, environment, name):
    workdir = workdir_in(tmp_path, name)
    (workdir / "mlflow").mkdir(parents=True)
    engine = sqlalchemy.create_engine(embedded_tracking_uri(workdir))
    with engine.begin() as connection:
        connection.exec_driver_sql("create table probe (x integer)")
    engine.dispose()
    assert tables(workdir / "mlflow" / "mlflow.db") == {"probe"}
    assert_nothing_beside(workdir)
    assert os.listdir(workdir / "mlflow") == ["mlflow.db"]


@pytest.mark.parametrize("name", AWKWARD_NAMES + [ALL_AT_ONCE, NOT_UTF8], ids=ascii)
def test_the_uri_names_no_other_directory_to_any_reader(tmp_path, name):
    """MLflow makes the store's parent directory from the URI before opening it, reading the text as it stands or
    decoded once (SQLAlchemy's database part) depending on its version. Each reading must be the store's absolute
    path itself or hold no ``/`` (its parent is ``.``): a relative path with a ``/`` makes a directory under the
    current one (MLflow 3.18 made a ``file:/…`` tree)."""
    workdir = workdir_in(tmp_path, name)
    uri = embedded_tracking_uri(workdir)
    readings = {uri.removeprefix("sqlite:///").removesuffix("?uri=true"), sqlalchemy.engine.make_url(uri).database}
    for reading in readings:
        assert reading == str(embedded_store(workdir)) or "/" not in reading, (uri, reading)


def track_and_register(uri: str, workdir: Path, tmp_path: Path) -> None:
    """A run with a metric and an artifact, and a registered model version whose source is that artifact, the
    way the pipeline makes them (comlrl.tracking), each checked from the store file itself."""
    from mlflow import MlflowClient

    from comlrl import tracking

    artifact_root = workdir / "mlflow" / "artifacts"
    identity = tracking.open_run(uri, "awkward", "run-1", None, artifact_root)
    client = MlflowClient(uri, uri)
    client.log_metric(identity["run_id"], "reward", 0.25, step=3)
    (tmp_path / "team.txt").write_text("weights")
    client.log_artifact(identity["run_id"], str(tmp_path / "team.txt"), "team")
    client.create_registered_model("awkward-team")
    run = client.get_run(identity["run_id"])
    version = client.create_model_version("awkward-team", f"{run.info.artifact_uri}/team", run_id=run.info.run_id)

    assert [m.value for m in client.get_metric_history(identity["run_id"], "reward")] == [0.25]
    assert client.get_model_version("awkward-team", version.version).run_id == identity["run_id"]
    assert [p.name for p in artifact_root.rglob("team.txt")] == ["team.txt"]
    assert client.get_experiment("0").artifact_location == (artifact_root / "0").as_uri()  # not ./mlruns/0
    with sqlite3.connect(workdir / "mlflow" / "mlflow.db") as connection:
        assert connection.execute("select run_uuid from runs").fetchall() == [(identity["run_id"],)]
        assert connection.execute("select name from model_versions").fetchall() == [("awkward-team",)]


@pytest.mark.parametrize("name", AWKWARD_NAMES + [ALL_AT_ONCE], ids=ascii)
def test_mlflow_writes_only_inside_each_awkward_workdir(tmp_path, environment, name):
    """The store's creation, then a tracked run, an artifact and a registered model: the current directory and the
    workdir's parent get nothing (MLflow 3.18 made a ``file:`` tree in the current directory for six of these)."""
    workdir = workdir_in(tmp_path, name)
    configure_embedded_default(workdir)
    uri = os.environ["MLFLOW_TRACKING_URI"]
    assert uri == embedded_tracking_uri(workdir)
    assert_nothing_beside(workdir)
    assert os.listdir(workdir / "mlflow") == ["mlflow.db"]
    track_and_register(uri, workdir, tmp_path)
    assert_nothing_beside(workdir)
    assert sorted(os.listdir(workdir / "mlflow")) == ["artifacts", "mlflow.db"]


def test_only_a_workdir_path_that_is_not_utf8_is_refused(tmp_path):
    for name in AWKWARD_NAMES + [ALL_AT_ONCE]:
        assert workdir_uri_problem(tmp_path / name) is None
    problem = workdir_uri_problem(tmp_path / NOT_UTF8 / "work")
    assert problem is not None and "\n" not in problem
    assert problem.startswith(f"--workdir {str(tmp_path / NOT_UTF8 / 'work')!r} holds the byte 0xff")
    assert problem.endswith("choose another --workdir")


def test_a_tracking_server_setting_creates_no_store(tmp_path, environment):
    os.environ["MLFLOW_TRACKING_URI"] = "http://127.0.0.1:9"
    configure_embedded_default(tmp_path / "work")
    assert os.environ["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:9"
    assert not (tmp_path / "work" / "mlflow").exists()


def in_child(target, *args) -> list:
    """What ``target(*args, send)`` sent, run in a forked process (which a file-size limit cannot outlive)."""
    receiver, sender = FORK.Pipe(duplex=False)
    child = FORK.Process(target=target, args=(*args, sender))
    child.start()
    sender.close()
    messages = []
    while receiver.poll(CHILD_TIMEOUT):
        try:
            messages.append(receiver.recv())
        except EOFError:
            break
    child.join(CHILD_TIMEOUT)
    assert child.exitcode == 0, messages
    return messages


def create_on_a_full_disk(workdir: Path, send) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (HALF_A_STORE, resource.RLIM_INFINITY))
    try:
        ensure_embedded_store(workdir)
        send.send(("created", ""))
    except OSError as error:
        send.send(("refused", str(error)))


def test_a_first_creation_cut_short_leaves_nothing_and_running_again_works(tmp_path, environment):
    workdir = tmp_path / "work"
    database = embedded_store(workdir)
    [(outcome, message)] = in_child(create_on_a_full_disk, workdir)
    assert outcome == "refused"
    assert str(database) in message and "run the same command again" in message
    assert os.listdir(database.parent) == []  # neither mlflow.db nor the temporary file

    uri = default_tracking_uri(workdir)  # the same command again, with room
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    run = client.create_run("0")
    client.log_metric(run.info.run_id, "reward", 1.5, step=1)
    assert [m.value for m in client.get_metric_history(run.info.run_id, "reward")] == [1.5]
    assert os.listdir(database.parent) == ["mlflow.db"]

    before = database.stat()
    started = time.perf_counter()
    assert ensure_embedded_store(workdir) == database
    assert time.perf_counter() - started < 0.05  # a stat, not MLflow
    assert (database.stat().st_ino, database.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_a_finished_store_never_replaces_one_already_there(tmp_path):
    winner, loser = tmp_path / "mlflow.db", tmp_path / "mlflow.db.x.creating"
    winner.write_text("the store a run already writes to")
    loser.write_text("a second, later store")
    publish_store(loser, winner)
    assert winner.read_text() == "the store a run already writes to"


def create_and_log(workdir: Path, start, send) -> None:
    from mlflow import MlflowClient

    start.wait(CHILD_TIMEOUT)
    client = MlflowClient(default_tracking_uri(workdir))
    run = client.create_run("0")
    client.log_metric(run.info.run_id, "reward", 1.0, step=1)
    send.send(run.info.run_id)


@pytest.mark.e2e  # two stores created side by side: ~8 s on two busy cores
def test_two_processes_creating_the_store_at_once_share_one(tmp_path, environment):
    workdir = tmp_path / "work"
    start = FORK.Barrier(2)
    receiver, sender = FORK.Pipe(duplex=False)
    children = [FORK.Process(target=create_and_log, args=(workdir, start, sender)) for _ in range(2)]
    for child in children:
        child.start()
    sender.close()
    run_ids = {receiver.recv() for _ in children if receiver.poll(CHILD_TIMEOUT)}
    for child in children:
        child.join(CHILD_TIMEOUT)
        assert child.exitcode == 0
    database = embedded_store(workdir)
    assert os.listdir(database.parent) == ["mlflow.db"]
    with sqlite3.connect(database) as connection:
        assert {row[0] for row in connection.execute("select run_uuid from runs")} == run_ids
    assert len(run_ids) == 2
