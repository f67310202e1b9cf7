"""Issue 42 item 2: a SIGTERM between a boundary's tasks (or between two boundaries) ends the flow run Cancelled,
as the docs say, not Crashed: the run's stop request is held there too, and the next task stops before any
further step. A real signal (``os.kill`` of this process) sent from the flow's own code between two tasks; the
flow runs in process under Prefect's test harness with a temporary MLflow SQLite store, read back with
MlflowClient."""

from __future__ import annotations

import os
import signal

import pytest

from conftest import letters_pipeline
from letters_spec import letters_spec

STEPS_PER_EPOCH = 2
SPEC = letters_spec("betweentest", num_generations=2, max_new_tokens=4, num_train_epochs=2,
                    per_device_train_batch_size=2)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    yield from letters_pipeline(tmp_path_factory, SPEC, num_train=2 * STEPS_PER_EPOCH)


@pytest.mark.e2e  # a flow run in process, ~40 s on a loaded 2-core machine
@pytest.mark.parametrize("moment", ["between the steps task and the end of epoch 1", "between epoch 1 and epoch 2"])
def test_a_sigterm_between_tasks_cancels_the_flow_run_after_the_last_step(moment, pipeline, monkeypatch):
    from mlflow.tracking import MlflowClient

    from comlrl.checkpointing import read_metadata
    from flows import boundaries
    from flows.training import train_flow

    sent = []
    if moment.startswith("between the steps"):
        name = boundaries.task_name

        def task_name(boundary, what):  # called by the boundary's flow after its steps task, before the next task
            if what == "end of epoch" and not sent:
                sent.append(os.kill(os.getpid(), signal.SIGTERM))
            return name(boundary, what)

        monkeypatch.setattr(boundaries, "task_name", task_name)
    else:
        record = boundaries.record

        def after_epoch(report):  # called once epoch 1's checkpoint is written, back in the parent flow's loop
            if not sent:
                sent.append(os.kill(os.getpid(), signal.SIGTERM))
            return record(report)

        monkeypatch.setattr(boundaries, "record", after_epoch)
    run_id = f"between-{len(moment)}"
    state = train_flow(spec_path=str(pipeline["root"] / "spec.yaml"), run_id=run_id, workdir=str(pipeline["workdir"]),
                       root=str(pipeline["root"]), tracking_uri=pipeline["tracking_uri"], return_state=True)
    assert sent and state.is_cancelled(), (state.type, state.message)
    data = state.result(raise_on_failure=False)
    assert data["exit_status"] == 128 + signal.SIGTERM and data["signal"] == "SIGTERM"
    # No step after the signal: epoch 1's steps, and a checkpoint where they end (step 2) to resume from.
    assert "SIGTERM received" in state.message and data["checkpoint"], state.message
    checkpoints = pipeline["workdir"] / "runs" / run_id / "checkpoints"
    steps = {read_metadata(path)["state"]["global_step"] for path in checkpoints.glob("checkpoint-*")}
    assert steps == {STEPS_PER_EPOCH}, steps
    client = MlflowClient(pipeline["tracking_uri"])
    [mlflow_run] = client.search_runs([client.get_experiment_by_name("betweentest").experiment_id],
                                      filter_string=f"tags.`comlrl.run_id` = '{run_id}'")
    assert mlflow_run.info.status == "KILLED"
    assert max(metric.step for metric in client.get_metric_history(mlflow_run.info.run_id, "reward_mean")) == \
        STEPS_PER_EPOCH
