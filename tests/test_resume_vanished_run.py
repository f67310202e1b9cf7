"""Issue "Faults in the field, part 3", case 4: a run whose MLflow run MLflow no longer has. ``comlrl resume`` used to
train on with every record refused (a deleted run that a killed process had left RUNNING: 93 "MLflow refused" lines
for six steps, ~850 for a longer run), or fail after the start ("must be in the 'active' state", "Run ... not found"),
exit 1, advising the same resume again. The preflight now sees it before anything starts: exit 2, one line naming
the MLflow run and what became of it, offering ``comlrl resume RUN_ID --new-mlflow-run`` (and, for a deleted run,
MLflow's own restore); each offered command is run here as printed and finishes the run.

The end-to-end tests share one real ``comlrl run`` that fails at the first step of its second epoch (its reward
is told by a file when to fail: tests/judged_run.py), leaving ``checkpoint-1``; each test starts from a copy of what
it left, at the same path (the embedded store keeps absolute paths). MLflow is changed through its own client in a
process of its own, as an operator would (this one would keep the replaced store's file open), and the store is read
with ``sqlite3``."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
from contextlib import closing
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest

from comlrl.checkpointing import read_history, read_metadata
from flows import new_mlflow_run, preflight as pf
from flows.runs import RunPaths
from flows.tracking_store import embedded_tracking_uri, ensure_embedded_store
from judged_run import heal, judged_project

REPOSITORY = Path(__file__).resolve().parent.parent
COMLRL = str(Path(sys.executable).parent / "comlrl")
REFUSAL_SECONDS = 60  # spec validation included (torch imported): see tests/test_preflight.py
RUN_ID = "vanish-1"
def environment() -> dict[str, str]:
    clean = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_", "MLFLOW_"))}
    return {**clean, "HF_HUB_OFFLINE": "1"}


def comlrl(*arguments: str) -> tuple[int, str, float]:
    started = time.monotonic()
    result = subprocess.run([COMLRL, *arguments], env=environment(), capture_output=True, text=True, cwd=REPOSITORY,
                            timeout=600)
    return result.returncode, result.stderr, time.monotonic() - started


def as_printed(command: str) -> tuple[int, str]:
    """``command`` pasted into a shell, as an operator follows advice."""
    result = subprocess.run(["bash", "-c", command], env=environment(), capture_output=True, text=True,
                            cwd=REPOSITORY, timeout=600)
    return result.returncode, result.stderr


def refusal(code: int, stderr: str, seconds: float) -> str:
    """Exit 2 in time, no traceback, one line: that line."""
    assert code == 2 and seconds < REFUSAL_SECONDS, (code, seconds, stderr[-4000:])
    assert "Traceback" not in stderr, stderr[-4000:]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("comlrl: "), lines
    return lines[0]


def offered(line: str, after: str, until: str = ";") -> str:
    return line.split(after, 1)[1].split(until, 1)[0].strip()


def finished_cleanly(code: int, stderr: str) -> None:
    assert code == 0, stderr[-4000:]
    assert "Traceback" not in stderr and "MLflow refused" not in stderr, stderr[-4000:]
    assert not [line for line in stderr.splitlines() if line.startswith("comlrl:")], stderr[-4000:]


def query(workdir: Path, sql: str, *parameters: str) -> list[tuple]:
    with closing(sqlite3.connect(workdir / "mlflow" / "mlflow.db")) as db:
        return sorted(db.execute(sql, parameters).fetchall())


def runs_table(workdir: Path) -> list[tuple[str, str, str]]:
    return query(workdir, "SELECT run_uuid, status, lifecycle_stage FROM runs")


def in_mlflow(uri: str, code: str) -> None:
    """``code`` with ``client``, an ``MlflowClient`` of ``uri``, in a Python process of its own."""
    program = f"import mlflow\nclient = mlflow.MlflowClient({uri!r})\n{code}"
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]


class FailedRun:
    """What ``comlrl run`` left after failing in epoch 2: ``reset()`` puts it back (same paths) with the judge well."""

    def __init__(self, base: Path) -> None:
        self.root, self.workdir, self.saved = base / "project", base / "work", base / "saved"
        self.run = RunPaths(RUN_ID, self.workdir.resolve())
        self.uri = embedded_tracking_uri(self.workdir)

    def reset(self) -> None:
        shutil.rmtree(self.workdir)
        shutil.copytree(self.saved, self.workdir, symlinks=True)
        heal(self.root)

    @property
    def mlflow_run_id(self) -> str:
        return read_metadata(self.run.checkpoints / "checkpoint-1")["mlflow"]["run_id"]

    def checkpoints(self) -> list[str]:
        return sorted(path.name for path in self.run.checkpoints.glob("checkpoint-*"))

    def rewards_so_far(self) -> list[tuple[int, float]]:
        """``reward_mean`` of the steps before the failure, from the checkpoint's history (not from MLflow)."""
        return [(row["step"], row["reward_mean"]) for row in read_history(self.run.checkpoints / "checkpoint-1")]


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory) -> FailedRun:
    run = FailedRun(tmp_path_factory.mktemp("vanished"))
    spec = judged_project(run.root, "vanish", epochs=3, fail_at=3)  # fails in epoch 2, after checkpoint-1
    code, stderr, _ = comlrl("run", str(spec), "--root", str(run.root), "--workdir",
                             str(run.workdir), "--run-id", RUN_ID)
    assert code == 1 and "the judge is down (call 3)" in stderr, stderr[-4000:]
    assert run.checkpoints() == ["checkpoint-1"]
    shutil.copytree(run.workdir, run.saved, symlinks=True)
    return run


def assert_continued(run: FailedRun, new_id: str) -> None:
    """The run finished in MLflow run ``new_id``, which holds every step's reward: the steps before the failure
    with the checkpoint's values, the rest trained by the resume."""
    [(status, stage, experiment)] = query(run.workdir, "SELECT status, runs.lifecycle_stage, experiments.name FROM "
                                                       "runs JOIN experiments USING (experiment_id) WHERE run_uuid = ?",
                                          new_id)
    assert (status, stage, experiment) == ("FINISHED", "active", "vanish")
    tags = dict(query(run.workdir, "SELECT key, value FROM tags WHERE run_uuid = ?", new_id))
    assert tags["comlrl.run_id"] == RUN_ID and tags[new_mlflow_run.CONTINUED_TAG] == "checkpoint-1"
    assert tags[new_mlflow_run.PREVIOUS_TAG] == run.mlflow_run_id
    history = query(run.workdir, "SELECT step, value FROM metrics WHERE run_uuid = ? AND key = 'reward_mean'", new_id)
    assert [step for step, _ in history] == [1, 2, 3, 4, 5, 6], history  # each step once
    before = run.rewards_so_far()
    assert [step for step, _ in before] == [1, 2]
    assert [value for _, value in history[:2]] == pytest.approx([value for _, value in before])
    result = json.loads((run.run.directory / "result.json").read_text())
    assert result["mlflow_run_id"] == new_id
    assert query(run.workdir, "SELECT name, run_id FROM model_versions") == [
        ("vanish-agent-0", new_id), ("vanish-agent-1", new_id), ("vanish-team", new_id)]
    assert run.checkpoints() == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    # The checkpoints the resume wrote name the new run: a later resume logs there, the record aside.
    assert read_metadata(run.run.checkpoints / "checkpoint-3")["mlflow"]["run_id"] == new_id


@pytest.mark.e2e  # a shared real run (~60 s), then a refusal (~15 s) and the resume it offers (~60 s)
def test_a_deleted_mlflow_run_is_refused_before_training_and_resumes_into_a_new_one(failed_run):
    run = failed_run
    run.reset()
    # RUNNING, as a killed process leaves it (the old code then trained on, every record refused), then deleted.
    in_mlflow(run.uri, f"client.update_run({run.mlflow_run_id!r}, status='RUNNING')\n"
                       f"client.delete_run({run.mlflow_run_id!r})")
    before = runs_table(run.workdir)
    assert before == [(run.mlflow_run_id, "RUNNING", "deleted")]

    line = refusal(*comlrl("resume", RUN_ID, "--workdir", str(run.workdir)))
    assert f"MLflow run {run.mlflow_run_id} (checkpoint-1 names it), but it was deleted in MLflow" in line, line
    assert "--new-mlflow-run" in line and "runs restore" in line, line
    # Nothing started: no step trained, no MLflow run made or changed, nothing recorded.
    assert run.checkpoints() == ["checkpoint-1"] and runs_table(run.workdir) == before
    assert not (run.run.directory / new_mlflow_run.RECORD).exists()

    command = offered(line, "continue it in a new MLflow run", ";").split("with:", 1)[1]
    assert command.endswith("--new-mlflow-run"), command
    finished_cleanly(*as_printed(command))
    record = json.loads((run.run.directory / new_mlflow_run.RECORD).read_text())
    assert record["replaces"] == run.mlflow_run_id and record["run_id"] != run.mlflow_run_id
    assert_continued(run, record["run_id"])
    assert runs_table(run.workdir) == sorted([(run.mlflow_run_id, "RUNNING", "deleted"),  # left as it was
                                              (record["run_id"], "FINISHED", "active")])


@pytest.mark.e2e  # the shared real run, a refusal (~15 s) and the resume it offers (~60 s)
def test_a_removed_mlflow_store_is_refused_before_training_and_resumes_into_a_new_one(failed_run):
    run = failed_run
    run.reset()
    shutil.rmtree(run.workdir / "mlflow")

    line = refusal(*comlrl("resume", RUN_ID, "--workdir", str(run.workdir)))
    store = run.workdir.resolve() / "mlflow" / "mlflow.db"
    assert f"MLflow run {run.mlflow_run_id} (checkpoint-1 names it), but its MLflow store '{store}' is gone" in line
    assert "runs restore" not in line  # nothing to restore
    assert not (run.workdir / "mlflow").exists() and run.checkpoints() == ["checkpoint-1"]  # no store made

    finished_cleanly(*as_printed(offered(line, "with:", "\n")))
    [(new_id, _, _)] = runs_table(run.workdir)
    assert_continued(run, new_id)


@pytest.mark.e2e  # the shared real run, a refusal (~15 s), MLflow's restore and the resume (~60 s)
def test_a_deleted_mlflow_run_restored_as_offered_resumes_in_place(failed_run):
    run = failed_run
    run.reset()
    in_mlflow(run.uri, f"client.delete_run({run.mlflow_run_id!r})")  # as the failed run left it: FAILED

    line = refusal(*comlrl("resume", RUN_ID, "--workdir", str(run.workdir)))
    restore, resume = offered(line, "or restore the deleted run with:", "\n").split("and then:")
    code, stderr = as_printed(restore)
    assert code == 0, stderr[-3000:]
    finished_cleanly(*as_printed(resume))
    assert runs_table(run.workdir) == [(run.mlflow_run_id, "FINISHED", "active")]
    steps = query(run.workdir, "SELECT step FROM metrics WHERE run_uuid = ? AND key = 'reward_mean'", run.mlflow_run_id)
    assert steps == [(1,), (2,), (3,), (4,), (5,), (6,)]


# ---- the parts, on a real store ------------------------------------------------------------------------------

def test_mlflow_says_whether_a_run_was_deleted_or_is_not_there(tmp_path):
    uri = embedded_tracking_uri(tmp_path)
    ensure_embedded_store(tmp_path)
    client = mlflow.MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    assert pf.mlflow_run_gone(uri, run_id) is None
    client.delete_run(run_id)
    deleted, words = pf.mlflow_run_gone(uri, run_id)
    assert deleted and words == f"it was deleted in MLflow at {uri}"
    missing, words = pf.mlflow_run_gone(uri, "0" * 32)
    assert not missing and words == f"MLflow at {uri} has no such run"


def test_a_request_needs_a_checkpoint_that_names_an_mlflow_run(tmp_path):
    run = RunPaths("r1", tmp_path)
    run.directory.mkdir(parents=True)
    with pytest.raises(ValueError, match="run 'r1' has no MLflow run to replace \\(it has no checkpoint yet\\)"):
        new_mlflow_run.request(run)
    assert not (run.directory / new_mlflow_run.RECORD).exists()


def test_the_record_applies_only_to_the_mlflow_run_it_replaces(tmp_path):
    """No record: the checkpoint's run; a record for that run: the new one (None until it is made); a record
    replacing another run (a later checkpoint names the new run itself): the checkpoint's."""
    run = RunPaths("r1", tmp_path)
    run.checkpoints.mkdir(parents=True)
    checkpoint = run.checkpoints / "checkpoint-1"  # where a checkpoint lies; these cases read none
    old = {"run_id": "a" * 32, "experiment_id": "1", "tracking_uri": "sqlite:///x", "owner": {"comlrl.run_id": "r1"}}
    arguments = ("sqlite:///y", "e", None, {"comlrl.run_id": "r1"})
    assert new_mlflow_run.logs_to(run, old) == "a" * 32
    assert new_mlflow_run.identity(checkpoint, old, *arguments) is old
    new_mlflow_run.write_record(run.directory, {"replaces": "a" * 32, "run_id": None})
    assert new_mlflow_run.logs_to(run, old) is None  # made when the run opens tracking
    new_mlflow_run.write_record(run.directory, {"replaces": "a" * 32, "run_id": "b" * 32, "experiment_id": "2",
                                                "history_bytes": 4096})
    assert new_mlflow_run.logs_to(run, old) == "b" * 32
    assert new_mlflow_run.identity(checkpoint, old, *arguments) == {
        "run_id": "b" * 32, "experiment_id": "2", "tracking_uri": "sqlite:///y", "owner": {"comlrl.run_id": "r1"},
        "history_bytes": 4096}
    later = {**old, "run_id": "b" * 32}
    assert new_mlflow_run.logs_to(run, later) == "b" * 32
    assert new_mlflow_run.identity(checkpoint, later, *arguments) is later
    assert new_mlflow_run.logs_to(run, None) is None
