"""A run's record survives a crash anywhere (issue 42): ``boundaries.jsonl`` with a torn line, a boundary's
row lost between its checkpoint and its append, and the reward curve after a resume.

The file tests write ``boundaries.jsonl`` as a crash leaves it. The flow tests run a tiny run in-process
(Prefect's test harness, a temporary MLflow SQLite store): it fails in epoch 2, its last row (epoch 1's) is
deleted as a kill right after ``checkpoint-1`` would have left it, and a re-run of the run id finishes it.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from flows import boundaries
from flows.runs import RunPaths, append_boundary_record, read_boundary_records
from letters_spec import letters_spec
from conftest import letters_pipeline

STEPS_PER_EPOCH = 2  # 4 rows, batch 2
SPEC = letters_spec("recordtest", num_generations=2, max_new_tokens=6, temperature=1.0, agent_learning_rate=0.003,
                    num_train_epochs=3, per_device_train_batch_size=2, eval_interval=STEPS_PER_EPOCH)


def record(number: int) -> dict:
    return {"number": number, "checkpoint": f"checkpoint-{number}", "row": {"boundary": f"epoch {number}"},
            "evaluation": {"eval/reward_mean": 0.1 * number}}


# ----- boundaries.jsonl as a crash leaves it --------------------------------------------------------
def test_a_torn_line_costs_only_itself_and_the_next_append_starts_a_fresh_line(tmp_path, caplog):
    run = RunPaths("torn", tmp_path)
    run.directory.mkdir(parents=True)
    append_boundary_record(run, record(1))
    with open(run.boundary_records, "ab") as handle:  # boundary 2's append, cut short by a kill
        handle.write(json.dumps(record(2)).encode()[:30])
    append_boundary_record(run, record(2))  # the resumed run redoes boundary 2, then goes on
    append_boundary_record(run, record(3))
    lines = run.boundary_records.read_bytes().split(b"\n")
    assert lines[1] == json.dumps(record(2)).encode()[:30] and json.loads(lines[2]) == record(2)
    with caplog.at_level(logging.WARNING, logger="flows.runs"):
        assert read_boundary_records(run) == [record(1), record(2), record(3)]
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "line 2 holds no whole boundary record" in warning and str(run.boundary_records) in warning


def test_a_record_appended_onto_a_torn_line_by_an_older_version_is_still_read(tmp_path, caplog):
    run = RunPaths("old", tmp_path)
    run.directory.mkdir(parents=True)
    torn = json.dumps(record(2))[:30]
    run.boundary_records.write_text(json.dumps(record(1)) + "\n" + torn + json.dumps(record(3)) + "\n" + "{\"numb")
    with caplog.at_level(logging.WARNING, logger="flows.runs"):
        assert read_boundary_records(run) == [record(1), record(3)]
    assert ["line 3 holds no whole boundary record" in r.getMessage() for r in caplog.records] == [True]


def test_eval_points_take_the_metric_a_run_is_judged_by_at_every_evaluated_step():
    logged = {"eval/reward_mean": [(0, 0.05), (2, 0.1), (4, 0.2)], "eval/task_reward_mean": [(4, 0.5)],
              "reward_mean": [(1, 9.0)]}
    assert boundaries.eval_points(logged) == [(0, 0.05), (2, 0.1), (4, 0.5)]
    assert boundaries.evaluations(logged)[-1] == (4, {"eval/reward_mean": 0.2, "eval/task_reward_mean": 0.5})


def test_a_recovered_report_has_the_boundarys_own_steps_evaluations_and_stage_record():
    from comlrl.progress import Boundary

    history = [{"step": step, "reward_mean": step / 10, "agent_0/loss": 1.0} for step in (1, 2, 3, 4)]
    logged = {"eval/reward_mean": [(2, 0.7), (3, 0.8), (4, 0.9)]}
    epoch = boundaries.recovered_report(Boundary(2, 3), "ck/checkpoint-2", {"global_step": 4}, history, logged, 2)
    assert (epoch.first_step, epoch.last_step, epoch.metrics["reward_mean"]) == (2, 4, 0.35)  # steps 3 and 4
    assert epoch.evaluations == [(3, {"eval/reward_mean": 0.8}), (4, {"eval/reward_mean": 0.9})]
    row = boundaries.boundary_row(epoch)
    assert (row["reward"], row["eval_reward"], row["loss"], row["seconds"]) == (0.35, 0.9, 1.0, None)
    assert boundaries.describe(row) == "epoch 2 · reward 0.350 · eval 0.900 · loss 1"
    fit = Boundary(2, 6, "fit_reward_model", 1)
    state = {"global_step": 4, "stage_records": [{"iteration": 1, "stage": "collect_preferences", "pairs": 8},
                                                 {"iteration": 1, "stage": "fit_reward_model", "reward/loss": 0.5}]}
    stage = boundaries.recovered_report(fit, "ck/checkpoint-2", state, history, logged, 4)
    assert stage.metrics == {"reward/loss": 0.5} and stage.evaluations == []


# ----- a run stopped after its first boundary, its row lost, resumed --------------------------------
@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """Prefect's test harness (temporary API database), a project with the letters data and the spec."""
    yield from letters_pipeline(tmp_path_factory, SPEC, num_train=2 * STEPS_PER_EPOCH)


def fail_once_at_step(monkeypatch, step: int) -> None:
    """The scoring of global step ``step`` (counted from 1) raises the first time it runs: a fault outside the
    update, so the steps before it are checkpointed (``checkpoint-N-stepS``)."""
    from comlrl.trainers.reinforce import MAGRPOTrainer

    original, fired = MAGRPOTrainer.score, []

    def score(trainer, *args, **kwargs):
        if trainer.state.global_step == step - 1 and not fired:
            fired.append(True)
            raise RuntimeError("injected fault in the reward scoring")
        return original(trainer, *args, **kwargs)

    monkeypatch.setattr(MAGRPOTrainer, "score", score)


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def resumed(pipeline):
    """A flow run that fails in the middle of epoch 2 (its second step: ``checkpoint-1`` is the newest boundary's,
    ``checkpoint-1-step3`` the failure's), its epoch-1 row deleted, and a re-run of the run id, whose reward-curve
    data is kept (the plotting function's arguments)."""
    from comlrl import tracking
    from flows.training import train_flow

    monkeypatch = pytest.MonkeyPatch()
    fail_once_at_step(monkeypatch, STEPS_PER_EPOCH + 2)
    arguments = dict(spec_path=str(pipeline["root"] / "spec.yaml"), run_id="record-run",
                     workdir=str(pipeline["workdir"]), root=str(pipeline["root"]), tracking_uri=pipeline["tracking_uri"])
    failed = train_flow(**arguments, return_state=True)
    path = Path(pipeline["workdir"]) / "runs" / "record-run" / "boundaries.jsonl"
    *kept, lost = read_lines(path)  # epoch 1's, as its process wrote it
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))  # a kill between checkpoint-1 and its row
    plotted, plot = [], tracking.reward_curve

    def keep_plotted(history, path, metric="reward_mean", evaluations=()):
        plotted.append({"history": [dict(row) for row in history], "evaluations": list(evaluations)})
        return plot(history, path, metric, evaluations)

    monkeypatch.setattr(tracking, "reward_curve", keep_plotted)
    completed = train_flow(**arguments, return_state=True)
    monkeypatch.undo()
    return {"failed": failed, "completed": completed, "result": completed.result(), "lost": lost,
            "lines": read_lines(path), "plotted": plotted}


@pytest.mark.slow
@pytest.mark.e2e  # a failing and a resumed pipeline run in process, ~100 s: the end-to-end tier
def test_a_row_lost_after_its_checkpoint_is_recovered_on_resume(resumed):
    assert resumed["failed"].is_failed() and resumed["completed"].is_completed()
    lost = resumed["lost"]
    assert lost["number"] == 1 and Path(lost["checkpoint"]).name == "checkpoint-1"
    by_number = {r["number"]: r for r in resumed["lines"]}
    assert sorted(by_number) == [1, 2, 3]
    recovered = by_number[1]
    # Equal to the row its process would have written; only its time was not measured.
    assert {**recovered["row"], "seconds": None} == {**lost["row"], "seconds": None}
    assert recovered["evaluation"] == lost["evaluation"] and recovered["checkpoint"] == lost["checkpoint"]
    assert lost["row"]["reward"] is not None and lost["row"]["eval_reward"] is not None
    # The table, the summary and result.json take their rows from the records: every epoch is there.
    result = resumed["result"]
    assert [row["boundary"] for row in result["boundaries"]] == ["epoch 1", "epoch 2", "epoch 3"]
    assert result["boundaries"][0] == recovered["row"]
    saved = json.loads((Path(result["checkpoint"]).parent.parent / "result.json").read_text())
    assert [row["step"] for row in saved["boundaries"]] == [STEPS_PER_EPOCH * epoch for epoch in (1, 2, 3)]


@pytest.mark.slow
@pytest.mark.e2e
def test_a_row_of_an_epoch_resumed_mid_way_covers_the_whole_epoch(resumed, pipeline):
    """Issue 42 item 4: epoch 2's first step was trained by the failed process, its second by the resume; the row
    is the mean over both, as MLflow holds them, and its evaluation the one at the epoch's end."""
    from mlflow.tracking import MlflowClient

    client, run_id = MlflowClient(pipeline["tracking_uri"]), resumed["result"]["mlflow_run_id"]

    def latest(key: str) -> dict[int, float]:  # the value of each step: its latest point
        points = sorted(client.get_metric_history(run_id, key), key=lambda metric: (metric.step, metric.timestamp))
        return {metric.step: metric.value for metric in points}

    checkpoints = Path(resumed["result"]["checkpoint"]).parent
    assert (checkpoints / f"checkpoint-1-step{STEPS_PER_EPOCH + 1}").is_dir()  # the failure's, mid-epoch
    rewards = latest("reward_mean")
    epoch_2 = [rewards[step] for step in range(STEPS_PER_EPOCH + 1, 2 * STEPS_PER_EPOCH + 1)]
    row = {r["number"]: r for r in resumed["lines"]}[2]["row"]
    assert row["reward"] == round(sum(epoch_2) / len(epoch_2), 4) and row["step"] == 2 * STEPS_PER_EPOCH
    assert row["eval_reward"] == round(latest("eval/reward_mean")[2 * STEPS_PER_EPOCH], 4)


@pytest.mark.slow
@pytest.mark.e2e
def test_the_reward_curve_after_a_resume_plots_what_mlflow_holds(resumed, pipeline):
    from mlflow.tracking import MlflowClient

    client, run_id = MlflowClient(pipeline["tracking_uri"]), resumed["result"]["mlflow_run_id"]

    def history(key: str) -> list[tuple[int, float]]:
        return sorted((metric.step, metric.value) for metric in client.get_metric_history(run_id, key))

    [plotted] = resumed["plotted"]
    # Epoch 1's evaluation was made by the failed flow run; the curve has it, as MLflow does.
    assert [step for step, _ in history("eval/reward_mean")] == [STEPS_PER_EPOCH * epoch for epoch in (1, 2, 3)]
    assert plotted["evaluations"] == history("eval/reward_mean")
    train = [(row["step"], row["reward_mean"]) for row in plotted["history"] if "reward_mean" in row]
    assert train == history("reward_mean") and len(train) == 3 * STEPS_PER_EPOCH


def newest_table(run_id: str) -> list[dict]:
    """The rows of the newest version of the run's boundaries table on the Prefect server."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    from flows.artifacts import artifact_key

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(
            any_=[artifact_key(run_id, "boundaries")])), sort=ArtifactSort.CREATED_DESC, limit=1)
    data = found[0].data
    return json.loads(data) if isinstance(data, str) else data


@pytest.mark.slow
@pytest.mark.e2e  # a failing and a resumed pipeline run in process, ~100 s: the end-to-end tier
def test_a_stop_between_the_last_checkpoint_and_its_table_leaves_the_table_whole_after_resume(pipeline):
    """Found by tests/test_stopped_anywhere.py (a SIGKILL just after the last checkpoint): the process ends after
    the last boundary's checkpoint, before its row reaches the table or boundaries.jsonl; the resume has no
    boundary left to run, and still publishes the whole table."""
    from flows import artifacts, training
    from flows.training import train_flow

    last = SPEC["config"]["num_train_epochs"]
    publish, append = artifacts.publish_table, training.append_boundary_record

    def publish_but_the_last(run_id, rows):
        if len(rows) < last:
            publish(run_id, rows)

    def die_at_the_last(run, record):
        if record["number"] == last:
            raise RuntimeError("the process ended here")
        append(run, record)

    arguments = dict(spec_path=str(pipeline["root"] / "spec.yaml"), run_id="table-run",
                     workdir=str(pipeline["workdir"]), root=str(pipeline["root"]), tracking_uri=pipeline["tracking_uri"])
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(artifacts, "publish_table", publish_but_the_last)
        monkeypatch.setattr(training, "append_boundary_record", die_at_the_last)
        assert train_flow(**arguments, return_state=True).is_failed()
    assert [row["boundary"] for row in newest_table("table-run")] == ["epoch 1", "epoch 2"]
    assert train_flow(**arguments, return_state=True).is_completed()
    assert [row["boundary"] for row in newest_table("table-run")] == ["epoch 1", "epoch 2", "epoch 3"]
