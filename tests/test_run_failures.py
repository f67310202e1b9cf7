"""Issue 38, "Errors after the start" (and issue 42 item 2): a run that fails or is stopped once it has started
ends with one ``comlrl:`` line saying what failed, where the traceback went and what to do; its MLflow run is
FAILED or KILLED, never left RUNNING. Real ``comlrl run``/``resume`` processes on the letters task, whose reward
(``judge.py``, written here) is told by a file in the project which rows to fail on or when to stall; the MLflow
store is read with ``sqlite3``, not through the code under test."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from comlrl.tasks.letters import write_dataset
from flows import cli
from letters_spec import letters_spec

REPOSITORY = Path(__file__).resolve().parent.parent
COMLRL = str(Path(sys.executable).parent / "comlrl")
REFUSAL_SECONDS = 60  # spec validation included (torch imported): see tests/test_preflight.py
JUDGE = '''
import time
from pathlib import Path

from comlrl.tasks.letters import letters_reward

HERE = Path(__file__).parent


def reward(completions_0, completions_1, batch_items=None):
    split = (batch_items or [{}])[0].get("split")
    mode = (HERE / "mode").read_text().strip() if (HERE / "mode").exists() else "ok"
    if mode == f"fail-{split}":
        raise ValueError(f"the judge is down ({split} rows)")
    if mode == "stall-eval" and split == "eval" and not (HERE / "gate-started").exists():
        (HERE / "gate-started").write_text("the gate's evaluation has started")
        time.sleep(8)
    return letters_reward(completions_0, completions_1, batch_items)
'''


def project(tmp_path: Path, mode: str) -> tuple[Path, Path]:
    """A --root with the letters rows (a ``split`` column says which file a row came from), ``judge.py`` and a
    spec without evaluations during training: the eval rows are judged only by the gate's evaluation."""
    root = tmp_path / "project"
    paths = write_dataset(root / "data" / "letters", num_train=4, num_eval=2)
    for split in ("train", "eval"):
        table = pq.read_table(paths[split])
        pq.write_table(table.append_column("split", pa.array([split] * table.num_rows)), paths[split])
    (root / "judge.py").write_text(JUDGE)
    (root / "mode").write_text(mode)
    spec = letters_spec("failures", num_generations=2, max_new_tokens=4, num_train_epochs=1,
                        per_device_train_batch_size=2)
    spec["reward"] = "judge:reward"
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    return root / "spec.yaml", root


def environment() -> dict[str, str]:
    clean = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_", "MLFLOW_"))}
    return {**clean, "HF_HUB_OFFLINE": "1"}


def start(arguments: list[str], cwd: Path, file_size_limit: int | None = None) -> subprocess.Popen:
    """``comlrl`` with ``arguments``; ``file_size_limit`` bytes per file (RLIMIT_FSIZE: a write beyond it fails
    with EFBIG, as on a full disk; Python ignores SIGXFSZ) stands for a disk with that little room."""
    cwd.mkdir(exist_ok=True)
    limit = None if file_size_limit is None else (
        lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit)))
    return subprocess.Popen([COMLRL, *arguments], env=environment(), cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=limit)


def finished(process: subprocess.Popen, timeout: float = 400) -> tuple[int, str, str]:
    stdout, stderr = process.communicate(timeout=timeout)
    return process.returncode, stdout, stderr


def store(workdir: Path) -> sqlite3.Connection:
    return sqlite3.connect(workdir / "mlflow" / "mlflow.db")


def statuses(workdir: Path) -> list[str]:
    with store(workdir) as db:
        return [status for (status,) in db.execute("SELECT status FROM runs")]


def closing_line(stderr: str) -> str:
    """The one ``comlrl:`` line: the last line, and the only one of its kind; no traceback anywhere."""
    assert "Traceback" not in stderr, stderr[-4000:]
    ours = [line for line in stderr.splitlines() if line.startswith("comlrl:")]
    assert len(ours) == 1 and stderr.rstrip().splitlines()[-1] == ours[0], stderr[-4000:]
    return ours[0]


def traceback_file(line: str, workdir: Path) -> str:
    """The log file the line names, under the workdir, holding the traceback the console did not show."""
    named = line.split("(traceback: ", 1)[1].split(")", 1)[0]
    assert Path(named) == workdir.resolve() / "logs" / f"{RUN_ID}.log", line
    text = Path(named).read_text()
    assert "Traceback (most recent call last)" in text
    return text


RUN_ID = "failures-1"


@pytest.mark.e2e  # a real comlrl run each, ~50 s on a loaded 2-core machine
@pytest.mark.parametrize("split, stage", [("train", "the first step"), ("eval", "the gate's evaluation")])
def test_a_failure_after_the_start_is_one_line_a_log_file_and_a_failed_mlflow_run(split, stage, tmp_path):
    spec, root = project(tmp_path, mode=f"fail-{split}")
    workdir, cwd = tmp_path / "work", tmp_path / "cwd"
    before = sorted(path.relative_to(tmp_path) for path in tmp_path.rglob("*"))
    command = ["run", str(spec), "--root", str(root), "--workdir", str(workdir), "--run-id", RUN_ID]
    if split == "train":  # first on a disk too full for the MLflow store: refused, nothing half-made, retry works
        started = time.monotonic()
        code, _, stderr = finished(start(command, cwd, file_size_limit=250_000))
        assert code == 2 and time.monotonic() - started < REFUSAL_SECONDS, stderr[-4000:]
        line = closing_line(stderr)
        assert f"could not create the MLflow store {workdir / 'mlflow' / 'mlflow.db'}" in line, line
        assert "run the same command again" in line and not list((workdir / "mlflow").glob("mlflow.db*"))
        assert not (workdir / "prefect").exists() and not (workdir / "runs").exists()  # no server, no run
    code, stdout, stderr = finished(start(command, cwd))
    assert code == 1, stderr[-4000:]
    line = closing_line(stderr)
    assert f"run {RUN_ID} failed: RewardCallError: reward function reward raised ValueError: the judge is down " \
           f"({split} rows)" in line, line
    assert f"the judge is down ({split} rows)" in traceback_file(line, workdir)
    checkpoints = sorted(path.name for path in (workdir / "runs" / RUN_ID / "checkpoints").glob("checkpoint-*"))
    assert checkpoints, "a run that started keeps a checkpoint to resume from"
    # The advice names the newest checkpoint and the resume that continues from it.
    newest = max(checkpoints, key=lambda name: [int(part.removeprefix("step")) for part in name.split("-")[1:]])
    assert f"completed work is in {newest}" in line and f"resume {RUN_ID} --workdir {workdir}" in line, line
    assert statuses(workdir) == ["FAILED"], stage
    # Nothing outside the workdir: the project and the working directory are as they were.
    after = sorted(path.relative_to(tmp_path) for path in tmp_path.rglob("*")
                   if not path.is_relative_to(workdir) and "__pycache__" not in path.parts)
    assert after == sorted([path for path in before if "__pycache__" not in path.parts] + [Path("cwd")])


@pytest.mark.e2e  # two real comlrl processes (~90 s on a loaded 2-core machine) and one refusal (~15 s)
def test_a_stop_during_the_end_of_a_run_leaves_it_killed_and_resume_finishes_it(tmp_path):
    """SIGTERM while the gate's evaluation runs: it completes, nothing is registered, exit 143, the MLflow run
    KILLED; ``comlrl resume`` then registers the agents and the team and ends it FINISHED. Then the run's spec
    copy is edited and the run's lock held by this process: ``comlrl resume`` lists both, exit 2, no server."""
    spec, root = project(tmp_path, mode="stall-eval")
    # A workdir name that is URI syntax in each part (a query, a percent escape, a fragment, a space, not ASCII):
    # the MLflow store, its artifacts and the registry stay inside it.
    workdir, cwd = tmp_path / "work?x=1 %41#é", tmp_path / "cwd"
    process = start(["run", str(spec), "--root", str(root), "--workdir", str(workdir), "--run-id", RUN_ID], cwd)
    deadline = time.monotonic() + 400
    while not (root / "gate-started").exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-4000:]
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    code, _, stderr = finished(process)
    assert code == 128 + signal.SIGTERM, stderr[-4000:]
    line = closing_line(stderr)
    assert "SIGTERM received: stopped before artifact logging; training is complete" in line, line
    assert f"resume {RUN_ID} --workdir {workdir}" in line, line
    assert statuses(workdir) == ["KILLED"]
    with store(workdir) as db:
        assert db.execute("SELECT COUNT(*) FROM model_versions").fetchone() == (0,)

    code, stdout, stderr = finished(start(["resume", RUN_ID, "--workdir", str(workdir)], cwd))
    assert code == 0, stderr[-4000:]
    assert not [line for line in stderr.splitlines() if line.startswith("comlrl:")], stderr[-4000:]
    assert statuses(workdir) == ["FINISHED"]
    with store(workdir) as db:
        names = sorted(name for (name,) in db.execute("SELECT name FROM model_versions"))
        aliases = sorted(db.execute("SELECT name, alias FROM registered_model_aliases"))
    assert names == ["failures-agent-0", "failures-agent-1", "failures-team"]
    # The first run of a model has no champion to beat: the gate promotes it.
    assert aliases == [(name, alias) for name in names for alias in ("candidate", "champion")]

    from comlrl.checkpointing.lock import DirectoryLock

    copy = workdir / "runs" / RUN_ID / "spec.yaml"
    copy.write_text(copy.read_text().replace("max_new_tokens: 4", "max_new_tokens: 5"))
    held = DirectoryLock(workdir / "runs" / RUN_ID, "flow.lock", shared=False).acquire()
    try:
        started = time.monotonic()
        code, _, stderr = finished(start(["resume", RUN_ID, "--workdir", str(workdir)], cwd))
    finally:
        held.release()
    assert code == 2 and time.monotonic() - started < REFUSAL_SECONDS, stderr[-4000:]
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 2 and all(line.startswith("comlrl: ") for line in lines), lines
    assert "was started from another spec" in lines[0] and str(copy) in lines[0], lines
    assert "is being trained by another process" in lines[1] and "flow.lock" in lines[1], lines
    assert statuses(workdir) == ["FINISHED"]  # the refusal touched nothing
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(["project", "cwd", workdir.name])
    assert not list(cwd.iterdir()) and list((workdir / "mlflow" / "artifacts").rglob("MLmodel"))


# ---- the closing line's advice, on real run directories --------------------------------------------------------

def test_the_advice_offers_resume_only_with_a_checkpoint_and_never_for_a_refused_run(tmp_path):
    from comlrl.errors import CheckpointError
    from flows.runs import RunRefused

    log = tmp_path / "logs" / "r.log"
    fresh = cli.failure_line("r", str(tmp_path), ValueError("boom"), log)
    assert fresh == f"run r failed: ValueError: boom (traceback: {log}); nothing was checkpointed; after fixing " \
                    "the cause, run the same command again"
    (tmp_path / "runs" / "r" / "checkpoints" / "checkpoint-1").mkdir(parents=True)  # never completed: no marker
    assert "nothing was checkpointed" in cli.failure_line("r", str(tmp_path), ValueError("boom"), None)
    for name in ("checkpoint-1", "checkpoint-2-step5"):
        done = tmp_path / "runs" / "r" / "checkpoints" / name
        done.mkdir(parents=True, exist_ok=True)
        (done / "COMPLETE").write_text("")
        (done / "metadata.json").write_text("{}")
    line = cli.failure_line("r", str(tmp_path), ValueError("boom"), None)
    assert line.endswith(f"completed work is in checkpoint-2-step5; after fixing the cause, continue with:  "
                         f"{cli.executable('comlrl')} resume r --workdir {tmp_path}"), line
    for refusal in (RunRefused("started from another spec"), CheckpointError(tmp_path, None, "is foreign")):
        line = cli.failure_line("r", str(tmp_path), refusal, None)
        assert line == f"run r was refused: {refusal}", line  # no advice: a resume meets the same refusal


def test_a_failure_is_summed_up_in_one_line_naming_the_first_error_of_its_chain():
    import sqlite3

    def wrapped() -> None:
        try:
            raise sqlite3.OperationalError("database or disk is full")
        except sqlite3.OperationalError:
            raise RuntimeError("(sqlite3.OperationalError) database or disk is full\n[SQL: INSERT …]\n(Background…)")

    with pytest.raises(RuntimeError) as raised:
        wrapped()
    # The wrapper already says it: its first line only, nothing added.
    assert cli.summary(raised.value) == "RuntimeError: (sqlite3.OperationalError) database or disk is full"
    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError as full:
            raise KeyError("the registry") from full
    except KeyError as secondary:
        line = cli.summary(secondary)
    assert line == "KeyError: 'the registry' (first: OSError: [Errno 28] No space left on device)"
    assert "\n" not in cli.failure_line("r", "/nowhere", "a message\nover two lines", None)


@pytest.mark.e2e  # a real comlrl run on a full store (~60 s on a loaded 2-core machine) and its resume (~45 s)
def test_a_store_disk_full_later_ends_in_one_line_naming_it_and_a_resume_after_freeing_space_finishes(tmp_path):
    """The MLflow store's folder is a 1.4 MB tmpfs (bubblewrap's ``--size``, the sandbox's binary): the store
    (~0.95 MB) and the run's metrics fit, the registered models (0.3 MB each) do not. Training completes; the
    registration meets the full disk: exit 1, one line naming the database's "disk is full", every traceback
    (MLflow's own logger's too) in the log file, the MLflow run FAILED. The store, copied to a disk with room
    (the space freed), then lets ``comlrl resume`` register everything and end the run FINISHED."""
    from comlrl.sandbox.isolation import bwrap_binary

    spec, root = project(tmp_path, mode="ok")
    workdir, cwd = tmp_path / "work", tmp_path / "cwd"
    (workdir / "mlflow").mkdir(parents=True)
    cwd.mkdir()
    saved = tmp_path / "saved"
    script = (f'"$0" run "$1" --root "$2" --workdir "$3" --run-id {RUN_ID}; code=$?; '
              f'cp -a "$3/mlflow" "$4"; exit $code')
    full = subprocess.run([bwrap_binary(), "--dev-bind", "/", "/", "--size", str(1_400_000), "--tmpfs",
                           str(workdir / "mlflow"), "--", "sh", "-c", script, COMLRL, str(spec), str(root),
                           str(workdir), str(saved)],
                          env=environment(), cwd=cwd, capture_output=True, text=True, timeout=400)
    assert full.returncode == 1, full.stderr[-4000:]
    line = closing_line(full.stderr)
    assert line.startswith(f"comlrl: run {RUN_ID} failed: MlflowException: ") and "database or disk is full" in line
    assert f"resume {RUN_ID} --workdir {workdir}" in line, line  # training completed: its checkpoint is there
    assert "database or disk is full" in traceback_file(line, workdir)
    assert "sqlalchemy_store.py" in (workdir / "logs" / f"{RUN_ID}.log").read_text()  # MLflow's logger's traceback
    assert not list((workdir / "mlflow").iterdir())  # the tmpfs is gone with the process: its copy is the store
    shutil.rmtree(workdir / "mlflow")
    shutil.copytree(saved, workdir / "mlflow", symlinks=True)
    assert statuses(workdir) == ["FAILED"]

    code, _, stderr = finished(start(["resume", RUN_ID, "--workdir", str(workdir)], cwd))
    assert code == 0, stderr[-4000:]
    assert statuses(workdir) == ["FINISHED"]
    with store(workdir) as db:
        versions = sorted(db.execute("SELECT name, version FROM model_versions"))
    assert versions == [("failures-agent-0", 1), ("failures-agent-1", 1), ("failures-team", 1)]  # agent-0 v1 reused
