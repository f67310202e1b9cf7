"""A resume checks whose checkpoint it is before it touches MLflow (issue 42, item 12).

A checkpoint records the MLflow run it logs to and the pipeline run that owns it (``comlrl.run_id``, the spec
hash). Another run's checkpoint in a run's folder is refused, a ``CheckpointError`` naming what differs, and
the other run's MLflow run keeps its status and tags. The library tests call ``tracking.open_run`` on a
temporary SQLite store; the flow tests train run A in-process (Prefect's test harness), copy its checkpoints
into the folders of runs B (same spec) and C (another spec), and resume those.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from comlrl import tracking
from comlrl.errors import CheckpointError
from comlrl.tasks.letters import write_dataset
from conftest import prefect_pipeline
from letters_spec import letters_spec

pytest.importorskip("mlflow")

SPEC = letters_spec("identitytest", num_generations=2, max_new_tokens=4, num_train_epochs=1,
                    per_device_train_batch_size=2)
OTHER_SPEC = letters_spec("identitytest", num_generations=2, max_new_tokens=4, num_train_epochs=1,
                          per_device_train_batch_size=2, agent_learning_rate=0.01)


def run_record(tracking_uri: str, mlflow_run_id: str) -> dict:
    """What a resume must leave as it is: the MLflow run's status, end time and tags."""
    from mlflow.tracking import MlflowClient

    run = MlflowClient(tracking_uri).get_run(mlflow_run_id)
    return {"status": run.info.status, "end_time": run.info.end_time, "tags": dict(run.data.tags)}


def runs_tagged(tracking_uri: str, run_key: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    experiments = [experiment.experiment_id for experiment in client.search_experiments()]
    return client.search_runs(experiments, filter_string=f"tags.`{tracking.RUN_KEY_TAG}` = '{run_key}'")


# ----- the library: tracking.open_run with a checkpoint's identity ------------------------------------
@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"


@pytest.fixture
def finished_run(store, request, tmp_path):
    """Run ``run-a`` (spec hash ``aaa``, in an experiment of its own) opened and ended FINISHED, as a completed
    pipeline run leaves it."""
    from mlflow.tracking import MlflowClient

    identity = tracking.open_run(store, request.node.name, "run-a", artifact_root=tmp_path,
                                 tags={"comlrl.spec_hash": "aaa"})
    MlflowClient(store).set_terminated(identity["run_id"], "FINISHED")
    return store, identity


def test_an_identity_recorded_by_another_run_is_refused_and_its_mlflow_run_is_left_as_it_is(finished_run):
    store, identity = finished_run
    before = run_record(store, identity["run_id"])
    with pytest.raises(CheckpointError) as refused:
        tracking.open_run(store, "other", "run-b", identity, tags={"comlrl.spec_hash": "aaa"},
                          checkpoint="runs/run-b/checkpoints/checkpoint-1")
    message = str(refused.value)
    assert "runs/run-b/checkpoints/checkpoint-1" in message and "belongs to another run" in message
    assert "comlrl.run_id 'run-a' (this run: 'run-b')" in message and "spec_hash" not in message
    assert run_record(store, identity["run_id"]) == before and before["status"] == "FINISHED"
    assert runs_tagged(store, "run-b") == []


def test_a_checkpoint_of_another_spec_is_refused_under_the_same_run_id(finished_run):
    store, identity = finished_run
    before = run_record(store, identity["run_id"])
    with pytest.raises(CheckpointError, match=r"comlrl.spec_hash 'aaa' \(this run: 'bbb'\)"):
        tracking.open_run(store, "other", "run-a", identity, tags={"comlrl.spec_hash": "bbb"}, checkpoint="ck")
    assert run_record(store, identity["run_id"]) == before


def test_an_older_checkpoint_naming_another_runs_mlflow_run_is_refused_by_that_runs_tags(finished_run):
    """Checkpoints written before the owner was recorded name only the MLflow run: its tags decide."""
    store, identity = finished_run
    older = {key: identity[key] for key in ("run_id", "experiment_id", "tracking_uri")}
    before = run_record(store, identity["run_id"])
    with pytest.raises(CheckpointError, match="the MLflow run it names is tagged comlrl.run_id 'run-a'"):
        tracking.open_run(store, "other", "run-b", older, tags={"comlrl.spec_hash": "aaa"}, checkpoint="ck")
    assert run_record(store, identity["run_id"]) == before
    # The run's own older checkpoint is still resumed: its MLflow run reopened.
    assert tracking.open_run(store, "other", "run-a", older, tags={"comlrl.spec_hash": "aaa"})["run_id"] == \
        identity["run_id"]
    assert run_record(store, identity["run_id"])["status"] == "RUNNING"


# ----- the pipeline: run A's checkpoint in run B's and run C's folders ----------------------------------
@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("project")
    write_dataset(root / "data" / "letters", num_train=2, num_eval=2)
    (root / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    (root / "other.yaml").write_text(yaml.safe_dump(OTHER_SPEC))
    yield from prefect_pipeline(tmp_path_factory, root)


@pytest.fixture(scope="module")
def run_a(pipeline):
    """Run A trained to the end (FINISHED, its agents registered), and its MLflow run's record."""
    from flows.training import train_flow

    state = train_flow(spec_path=str(pipeline["root"] / "spec.yaml"), run_id="run-a", workdir=str(pipeline["workdir"]),
                       root=str(pipeline["root"]), tracking_uri=pipeline["tracking_uri"], return_state=True)
    assert state.is_completed(), state.message
    mlflow_run_id = state.result()["mlflow_run_id"]
    return {"mlflow_run_id": mlflow_run_id, "record": run_record(pipeline["tracking_uri"], mlflow_run_id)}


def resume_with_run_a_checkpoints(pipeline, run_id: str, spec: str):
    """Run ``run_id`` with run A's checkpoints copied into its folder: the flow's end state and its error."""
    from flows.training import train_flow

    workdir = Path(pipeline["workdir"])
    shutil.copytree(workdir / "runs" / "run-a" / "checkpoints", workdir / "runs" / run_id / "checkpoints")
    state = train_flow(spec_path=str(pipeline["root"] / spec), run_id=run_id, workdir=str(workdir),
                       root=str(pipeline["root"]), tracking_uri=pipeline["tracking_uri"], return_state=True)
    return state, state.result(raise_on_failure=False)


@pytest.mark.slow
@pytest.mark.e2e  # trains run A through the flow in-process: tens of seconds
@pytest.mark.parametrize("run_id, spec, differs", [("run-b", "spec.yaml", ["comlrl.run_id 'run-a'"]),
                                                   ("run-c", "other.yaml", ["comlrl.run_id 'run-a'",
                                                                            "comlrl.spec_hash"])])
def test_another_runs_checkpoint_is_refused_before_mlflow_is_touched(pipeline, run_a, run_id, spec, differs):
    from flows.cli import failure_line

    state, error = resume_with_run_a_checkpoints(pipeline, run_id, spec)
    assert state.is_failed() and isinstance(error, CheckpointError), (state.message, error)
    assert f"runs/{run_id}/checkpoints/checkpoint-" in str(error) and "belongs to another run" in str(error)
    assert all(part in str(error) for part in differs), str(error)
    # Run A's MLflow run keeps FINISHED, its end time and its comlrl.run_id / spec_hash tags; no run is opened.
    assert run_record(pipeline["tracking_uri"], run_a["mlflow_run_id"]) == run_a["record"]
    assert run_a["record"]["status"] == "FINISHED" and run_a["record"]["tags"][tracking.RUN_KEY_TAG] == "run-a"
    assert runs_tagged(pipeline["tracking_uri"], run_id) == []
    # The CLI reports a refusal, without advice to resume.
    line = failure_line(run_id, str(pipeline["workdir"]), error, None)
    assert line.startswith(f"run {run_id} was refused: ") and f"resume {run_id} --workdir" not in line
