"""The training flow end to end on a tiny run, in-process with Prefect's test harness and a
temporary MLflow SQLite store: fault injection and resume, registry aliases, a consumer load.

One harness and one tiny run set serve the whole module (Prefect and MLflow are slow to start
on small machines); the tests run in file order and build on each other's flow runs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import yaml

from comlrl.tasks.letters import write_dataset
from flows.spec import SpecError, load_spec, parse_spec
from letters_spec import letters_spec
from conftest import prefect_pipeline

pytestmark = pytest.mark.slow

STEPS_PER_EPOCH = 2  # 4 rows, batch 2
SPEC = letters_spec("flowtest", num_generations=2, max_new_tokens=6, temperature=1.0, agent_learning_rate=0.003,
                    num_train_epochs=3, per_device_train_batch_size=2, eval_interval=STEPS_PER_EPOCH)


def write_spec(directory: Path, **changes) -> Path:
    path = directory / "spec.yaml"
    path.write_text(yaml.safe_dump({**SPEC, **changes}))
    return path


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("project")
    write_dataset(root / "data" / "letters", num_train=4, num_eval=2)
    write_spec(root)
    return root


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, project):
    """Prefect's test harness (temporary API database) with result storage in a temp dir."""
    yield from prefect_pipeline(tmp_path_factory, project)


def subflow_runs(flow_run_id) -> list:
    """The boundary subflow runs of a flow run, in boundary order."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])), limit=200)
    return sorted(runs, key=lambda run: run.expected_start_time)


def task_run_names(flow_run_id, expected: int | None = None, timeout: float = 60.0) -> list[str]:
    """Completed task runs of a flow run and of its boundary subflows, from the Prefect API (state
    records arrive asynchronously)."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            family = [flow_run_id, *(run.id for run in subflow_runs(flow_run_id))]
            runs, page = [], None
            while page is None or len(page) == 200:
                page = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=family)),
                                             limit=200, offset=len(runs))
                runs += page
            names = sorted(run.name for run in runs if run.state and run.state.is_completed())
            if expected is None or len(names) >= expected or time.monotonic() > deadline:
                return names
            time.sleep(0.5)


def steps_tasks(names: list[str]) -> list[str]:
    """The step-chunk task runs, as ``epoch 2 · steps 1–2`` (their stage list cut off)."""
    return sorted(name.split(":")[0] for name in names if " · step" in name)


# ----- spec validation (no Prefect needed) --------------------------------------------------------
def test_invalid_spec_lists_every_problem_with_its_path(project, tmp_path):
    bad = {
        **SPEC,
        "name": "bad name!",
        "algorithm": "magrpo",
        "dataset": {"train": "../outside.parquet", "eval": {"path": "data/letters/eval.parquet", "name": "x"}},
        "reward": "comlrl.tasks.letters:no_such_function",
        "formatters": "not an import path",
        "config": {**SPEC["config"], "num_generations": 1, "temperature": -1.0},
        "colour": "blue",
    }
    with pytest.raises(SpecError) as caught:
        parse_spec(bad, "bad.yaml", project)
    paths = {path for path, _ in caught.value.problems}
    assert {"name", "colour", "dataset.eval", "config.temperature"} <= paths, caught.value.problems
    # The same file with only the schema-level problems fixed reports the semantic ones, all at once.
    fixed = {**bad, "name": "ok", "dataset": {"train": "../outside.parquet"}}
    fixed.pop("colour")
    with pytest.raises(SpecError) as caught:
        parse_spec(fixed, "bad.yaml", project)
    problems = dict(caught.value.problems)
    assert set(problems) == {"config.temperature", "dataset.train", "reward", "formatters"}, problems
    assert "outside the data directory" in problems["dataset.train"]
    assert "no attribute 'no_such_function'" in problems["reward"]
    assert "must be > 0" in problems["config.temperature"]
    assert "config.temperature" in str(caught.value) and "4 problem(s)" in str(caught.value)


def test_spec_cannot_execute_code(project, tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("name: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(path, project)


def test_unknown_algorithm_and_model_arguments(project):
    with pytest.raises(SpecError) as caught:
        parse_spec({**SPEC, "algorithm": "ppo", "models": {"critic": "x"}}, "s.yaml", project)
    problems = dict(caught.value.problems)
    assert "unknown algorithm 'ppo'" in problems["algorithm"]
    assert "models" in problems


def test_the_bundled_demo_spec_is_valid():
    root = Path(__file__).resolve().parent.parent
    spec = load_spec(root / "flows" / "specs" / "letters.yaml", root)
    assert spec.algorithm == "magrpo" and spec.registered_name == "letters-demo"


# ----- the flow -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference_weights(project, tmp_path_factory):
    """Final weights of an uninterrupted run: the library's own train() on the same spec."""
    from flows.build import build_trainer

    trainer = build_trainer(load_spec(project / "spec.yaml", project), project, tmp_path_factory.mktemp("ref"))
    trainer.train()
    return [{k: v.clone() for k, v in agent.state_dict().items()} for agent in trainer.agents]


class FailOnce:
    """Makes the policy update of one epoch raise the first time it runs."""

    def __init__(self, epoch: int) -> None:
        self.epoch, self.fired = epoch, False

    def install(self, monkeypatch) -> None:
        from comlrl.trainers.reinforce import MAGRPOTrainer

        original = MAGRPOTrainer.update
        guard = self

        def update(trainer, *args, **kwargs):
            if trainer.state.epoch == guard.epoch and not guard.fired:
                guard.fired = True
                raise RuntimeError("injected fault in the policy update")
            return original(trainer, *args, **kwargs)

        monkeypatch.setattr(MAGRPOTrainer, "update", update)


def test_one_process_at_a_time_holds_a_runs_lock(tmp_path):
    from flows.runs import RunLock, RunPaths, claim_run

    run = RunPaths("locked", tmp_path)
    run.directory.mkdir(parents=True)
    first, second = RunLock(run), RunLock(run)
    assert first.acquire() and first.acquire()  # held: acquiring again is a no-op
    assert not second.acquire()  # another holder (a flock of its own) is refused, without waiting
    with pytest.raises(RuntimeError, match="being trained by another process .*flow.lock"):
        claim_run(run)  # what train_flow does first: a second process on the same run is refused
    first.release()
    assert second.acquire()
    second.release()
    claim_run(run).release()  # free again


@pytest.fixture(scope="module")
def resumed(pipeline, reference_weights):
    """A flow run that fails in epoch 2's update, then a re-run of the same run id."""
    from flows.training import train_flow

    monkeypatch = pytest.MonkeyPatch()
    FailOnce(epoch=1).install(monkeypatch)
    arguments = dict(spec_path=str(pipeline["root"] / "spec.yaml"), run_id="fault-run", workdir=str(pipeline["workdir"]),
                     root=str(pipeline["root"]), tracking_uri=pipeline["tracking_uri"])
    failed = train_flow(**arguments, return_state=True)
    status_after_failure = mlflow_status_of(pipeline["tracking_uri"], "fault-run")
    completed = train_flow(**arguments, return_state=True)
    monkeypatch.undo()
    return {"failed": failed, "completed": completed, "result": completed.result(),
            "status_after_failure": status_after_failure}


def mlflow_status_of(tracking_uri: str, run_key: str) -> str:
    from mlflow.tracking import MlflowClient

    from comlrl.tracking import RUN_KEY_TAG

    client = MlflowClient(tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}'")
    assert len(runs) == 1, runs
    return runs[0].info.status


def test_a_failed_flow_run_resumes_after_the_last_completed_boundary(resumed):
    assert resumed["failed"].is_failed()
    assert resumed["completed"].is_completed()
    failed_id, completed_id = resumed["failed"].state_details.flow_run_id, resumed["completed"].state_details.flow_run_id
    first = task_run_names(failed_id)
    # The first run finished epoch 1 (its steps, end and checkpoint); epoch 2's steps task failed in its first
    # policy update, so epoch 2 has no completed task but its subflow run, failed.
    assert steps_tasks(first) == ["epoch 1 · steps 1–2"]
    assert [n for n in first if n.endswith("· checkpoint")] == ["epoch 1 · checkpoint"]
    assert [(run.name, run.state.type.value) for run in subflow_runs(failed_id)] == [
        ("epoch 1 of 3", "COMPLETED"), ("epoch 2 of 3", "FAILED")]
    expected = 3 * 2 + 6  # steps, end, checkpoint x2; restore, evaluate, register x2, gate, ...
    second = task_run_names(completed_id, expected=expected)
    assert not [n for n in second if n.startswith("epoch 1 ")], "epoch 1 ran again"
    assert steps_tasks(second) == ["epoch 2 · steps 1–2", "epoch 3 · steps 1–2"]
    # The failure was inside an update: nothing newer than checkpoint-1 could be saved, the resume starts there.
    assert "restore checkpoint-1" in second and "begin training" not in second
    assert [n for n in second if n.endswith("· checkpoint")] == ["epoch 2 · checkpoint", "epoch 3 · checkpoint"]
    assert [n for n in second if n.startswith("register")] == ["register agent models", "register team model"]
    # One subflow per boundary run here, each saying its reward (and eval, eval_interval = one epoch) in its
    # final state's message.
    subflows = subflow_runs(completed_id)
    assert [run.name for run in subflows] == ["epoch 2 of 3", "epoch 3 of 3"]
    assert all(run.state.is_completed() and "reward" in run.state.message and "eval" in run.state.message
               for run in subflows)
    # The task runs pay for themselves: per boundary its steps, its end and its checkpoint (and the subflow's
    # own record in the parent), not one per stage and step.
    assert [len([n for n in second if n.startswith(f"epoch {epoch} ")]) for epoch in (2, 3)] == [3, 3]
    assert len(second) <= 4 * 2 + 15, second


def test_resumed_weights_equal_an_uninterrupted_run(resumed, reference_weights):
    from comlrl.checkpointing.io import load_pt  # noqa: F401  (weights are safetensors)
    from safetensors.torch import load_file

    checkpoint = Path(resumed["result"]["checkpoint"])
    assert checkpoint.name == "checkpoint-3"
    for index, reference in enumerate(reference_weights):
        saved = load_file(str(checkpoint / "models" / f"agent_{index}.safetensors"))
        for name, tensor in reference.items():
            if name in saved:
                assert torch.equal(saved[name], tensor), f"agent_{index}.{name} differs"
        assert set(saved) <= set(reference)


def test_the_resumed_flow_logs_into_the_same_mlflow_run(resumed, pipeline):
    from mlflow.tracking import MlflowClient

    from comlrl.utils import read_checkpoint_metadata

    result = resumed["result"]
    first_checkpoint = Path(result["checkpoint"]).parent / "checkpoint-1"
    identity = read_checkpoint_metadata(first_checkpoint)["mlflow"]
    assert identity["run_id"] == result["mlflow_run_id"]
    client = MlflowClient(pipeline["tracking_uri"])
    run = client.get_run(result["mlflow_run_id"])
    assert resumed["status_after_failure"] == "FAILED"  # the failed flow run marked it; the resume reopened it
    assert run.info.status == "FINISHED"
    assert run.data.params["spec.algorithm"] == "magrpo"
    steps = {m.step for m in client.get_metric_history(run.info.run_id, "reward_mean")}
    assert steps == set(range(1, 3 * STEPS_PER_EPOCH + 1))
    # The eval curve: one point per boundary, epoch 1's from the failed flow run, 2-3 from the resumed one.
    evaluations = sorted(m.step for m in client.get_metric_history(run.info.run_id, "eval/reward_mean"))
    assert evaluations == [STEPS_PER_EPOCH * epoch for epoch in (1, 2, 3)]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"plots", "spec", "checkpoints"} <= artifacts
    assert [a.path for a in client.list_artifacts(run.info.run_id, "plots")] == ["plots/reward_curve.png"]


def test_agents_are_registered_promoted_and_load_by_alias(resumed, pipeline):
    import mlflow
    from mlflow.tracking import MlflowClient

    from comlrl import tracking

    uri = pipeline["tracking_uri"]
    registered = resumed["result"]["registered"]
    names = [entry["name"] for entry in registered]
    assert names == ["flowtest-agent-0", "flowtest-agent-1"]
    client = MlflowClient(uri)
    version = client.get_model_version_by_alias("flowtest-agent-0", "candidate")
    assert version.tags["comlrl.algorithm"] == "magrpo"
    assert version.tags["comlrl.run_id"] == "fault-run"
    assert len(version.tags["comlrl.spec_hash"]) == 64
    assert version.run_id == resumed["result"]["mlflow_run_id"]
    # The first candidate of a registry passes the gate: there is no champion to compare with.
    assert version.tags["comlrl.gate.decision"] == "promoted" and version.tags["comlrl.gate.reason"] == "no champion yet"
    assert str(client.get_model_version_by_alias("flowtest-team", "champion").version) == resumed["result"]["team"]["version"]
    with pytest.raises(ValueError, match="no version with alias 'nope'"):
        tracking.promote(uri, names, "nope", "champion")
    moved = tracking.promote(uri, names, "candidate", "champion")
    assert [m["version"] for m in moved] == [str(version.version), registered[1]["version"]]
    mlflow.set_tracking_uri(uri)
    generator = mlflow.transformers.load_model("models:/flowtest-agent-0@champion")
    text = generator("tell me about the cat", max_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert text.startswith("tell me about the cat") and len(text) > len("tell me about the cat")
    # The champion's weights are the trained ones.
    components = mlflow.transformers.load_model("models:/flowtest-agent-0@champion", return_type="components")
    saved = dict(components["model"].named_parameters())
    from safetensors.torch import load_file

    trained = load_file(str(Path(resumed["result"]["checkpoint"]) / "models" / "agent_0.safetensors"))
    assert all(torch.equal(saved[name].detach(), trained[name]) for name in trained if name in saved)


def test_rerunning_a_completed_run_trains_nothing_and_retraining_starts_from_the_champion(resumed, pipeline):
    from flows.training import train_flow

    arguments = dict(spec_path=str(pipeline["root"] / "spec.yaml"), workdir=str(pipeline["workdir"]),
                     root=str(pipeline["root"]), tracking_uri=pipeline["tracking_uri"])
    again = train_flow(**arguments, run_id="fault-run", return_state=True)
    names = task_run_names(again.state_details.flow_run_id, expected=5)
    assert again.is_completed() and not steps_tasks(names) and not subflow_runs(again.state_details.flow_run_id)
    assert [e["version"] for e in again.result()["registered"]] == ["1", "1"]  # not registered twice
    # A retraining run from the champion loads the registered agents (exported from MLflow).
    retrained = train_flow(**arguments, run_id="from-champion", init_from_alias="champion",
                           return_state=True).result()
    spec_copy = Path(pipeline["workdir"]) / "runs" / "from-champion"
    assert (Path(pipeline["workdir"]) / "models" / "registry" / "flowtest-agent-0-v1" / "config.json").is_file()
    assert retrained["registered"][0]["version"] == "2"
    assert spec_copy.is_dir()


def test_marlhf_iter_runs_one_task_per_pbrl_stage_and_logs_the_pairs(pipeline):
    from mlflow.tracking import MlflowClient

    from flows.training import train_flow

    directory = pipeline["root"] / "pbrl"
    directory.mkdir(exist_ok=True)
    config = {**SPEC["config"], "num_train_epochs": 1, "num_iterations": 2, "reward_model_device": None,
              "reward_train_epochs": 1, "reward_batch_size": 2}
    path = write_spec(directory, name="pbrltest", algorithm="marlhf_iter", config=config)
    state = train_flow(spec_path=str(path), run_id="pbrl-run", workdir=str(pipeline["workdir"]),
                       root=str(pipeline["root"]), tracking_uri=pipeline["tracking_uri"], return_state=True)
    result = state.result()
    names = task_run_names(state.state_details.flow_run_id, expected=20)
    stages = ["preference collection", "reward-model fit", "policy update"]
    assert [run.name for run in subflow_runs(state.state_details.flow_run_id)] == [
        f"iteration {i} · {stage} ({3 * (i - 1) + n + 1}/6)" for i in (1, 2) for n, stage in enumerate(stages)]
    assert sorted(n for n in names if n.startswith("iteration") and "·" in n and not n.endswith(
        "checkpoint")) == sorted(f"iteration {i} · {stage}" for i in (1, 2) for stage in stages)
    assert Path(result["checkpoint"]).name == "checkpoint-6"
    client = MlflowClient(pipeline["tracking_uri"])
    assert [a.path for a in client.list_artifacts(result["mlflow_run_id"], "preferences")] == [
        "preferences/preference_pairs.parquet"]
    assert [e["name"] for e in result["registered"]] == ["pbrltest-agent-0", "pbrltest-agent-1"]


def test_actor_critic_trainers_run_their_declared_stages_as_tasks(pipeline):
    from flows.training import train_flow

    directory = pipeline["root"] / "maac"
    directory.mkdir(exist_ok=True)
    config = {key: value for key, value in SPEC["config"].items() if key != "num_generations"}
    tiny = SPEC["models"]["agent_model"]
    path = write_spec(directory, name="maactest", algorithm="maac", config={**config, "num_train_epochs": 1},
                      models={"agent_model": tiny, "critic_model": tiny})
    state = train_flow(spec_path=str(path), run_id="maac-run", workdir=str(pipeline["workdir"]),
                       root=str(pipeline["root"]), tracking_uri=pipeline["tracking_uri"], return_state=True)
    assert state.is_completed()
    names = task_run_names(state.state_details.flow_run_id, expected=8)
    [steps] = [n for n in names if n.startswith("epoch 1 · steps 1–2: ")]
    assert {"rollout", "score", "critic_inputs", "values", "advantages", "update"} <= set(steps.split(": ")[1].split(", "))
