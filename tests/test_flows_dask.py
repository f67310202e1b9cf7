"""The Dask task runner (flows/agents.py): the training flow's per-agent tasks on a local Dask
cluster give exactly the default runner's result, they really run as Dask tasks, and workers
outside the flow's process are refused rather than handed copies of the models.

Uses the Prefect test harness and the temporary MLflow store of tests/test_flows.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from comlrl.checkpointing import read_history
from flows.spec import ExecutionSpec, SpecError, load_spec, parse_spec, spec_hash
from test_flows import SPEC, STEPS_PER_EPOCH, pipeline, project, task_run_names, write_spec  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

NUM_AGENTS = SPEC["config"]["num_agents"]
CONFIG = {**SPEC["config"], "num_train_epochs": 1}
DASK = {"task_runner": "dask", "dask_workers": 2}


def weights(checkpoint: str) -> list[dict[str, torch.Tensor]]:
    return [load_file(str(Path(checkpoint) / "models" / f"agent_{i}.safetensors")) for i in range(NUM_AGENTS)]


def rewards(checkpoint: str) -> list[dict[str, float]]:
    history = read_history(checkpoint)
    return [{key: value for key, value in row.items()
             if (key.startswith("reward") or key.endswith("/loss")) and not key.endswith("_time")} for row in history]


def run(pipeline, directory: str, run_id: str, **changes):
    from flows.training import training_flow

    changes.setdefault("config", CONFIG)
    path = write_spec(folder(pipeline["root"] / directory), name="dasktest", **changes)
    spec = load_spec(path, pipeline["root"])
    state = training_flow(spec)(spec_path=str(path), run_id=run_id, workdir=str(pipeline["workdir"]),
                                root=str(pipeline["root"]), tracking_uri=pipeline["tracking_uri"], return_state=True)
    assert state.is_completed(), state
    return spec, state


def folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def default_run(pipeline):
    return run(pipeline, "default", "default-runner")


@pytest.fixture(scope="module")
def dask_run(pipeline, default_run):
    """The same run on a local in-process Dask cluster, with Dask's own record of what its workers ran."""
    import distributed

    cluster = distributed.LocalCluster(processes=False, n_workers=2, threads_per_worker=1, dashboard_address=None)
    with cluster, distributed.Client(cluster, set_as_default=False) as client:
        with distributed.get_task_stream(client) as stream:
            execution = {"task_runner": "dask", "dask_address": cluster.scheduler_address}
            spec, state = run(pipeline, "dask", "dask-runner", execution=execution)
        workers = set(client.scheduler_info()["workers"])
    return spec, state, stream.data, workers


def test_the_dask_runner_gives_the_default_runners_weights_and_rewards(default_run, dask_run):
    (default_spec, default_state), (dask_spec, dask_state, _, _) = default_run, dask_run
    assert spec_hash(default_spec) == spec_hash(dask_spec)  # execution is not part of what is trained
    default_checkpoint, dask_checkpoint = default_state.result()["checkpoint"], dask_state.result()["checkpoint"]
    for index, (expected, actual) in enumerate(zip(weights(default_checkpoint), weights(dask_checkpoint))):
        assert expected.keys() == actual.keys()
        for name, tensor in expected.items():
            assert torch.equal(actual[name], tensor), f"agent_{index}.{name} differs"
    history = rewards(dask_checkpoint)
    assert len(history) == STEPS_PER_EPOCH and all("reward_mean" in row for row in history)
    assert history == rewards(default_checkpoint)
    assert dask_state.result()["evaluation"] == default_state.result()["evaluation"]


def test_each_agents_generation_and_backward_pass_is_a_task_run_on_the_dask_workers(default_run, dask_run):
    _, state, stream, workers = dask_run
    stage_runs = {f"agent_work-{stage}-b1-s{step}-agent{agent}" for stage in ("rollout", "update")
                  for step in range(1, STEPS_PER_EPOCH + 1) for agent in range(NUM_AGENTS)}
    names = task_run_names(state.state_details.flow_run_id, expected=len(stage_runs))
    agent_runs = [name for name in names if name.startswith("agent_work-")]
    assert stage_runs <= set(agent_runs)
    assert all(name.startswith("agent_work-evaluate") for name in set(agent_runs) - stage_runs)  # eval rollout
    # Dask's task stream: every agent_work task run was a Dask task executed by the cluster's workers.
    executed = [record for record in stream if record["key"].startswith("agent_work")]
    assert len(executed) == len(agent_runs)
    assert {record["worker"] for record in executed} <= workers
    default_names = task_run_names(default_run[1].state_details.flow_run_id)
    assert default_names and not [name for name in default_names if name.startswith("agent_work")]


def test_agent_tasks_on_the_flows_own_cluster_work_on_the_flows_objects(pipeline):
    """The flow's in-process LocalCluster: a per-agent function mutates objects of the flow's process
    (Dask would hand a task its arguments as pickled copies, so they never travel as arguments)."""
    from prefect import flow

    from flows.agents import dask_task_runner, run_agents_as_tasks

    seen: list[int] = []

    @flow
    def agents_flow() -> list[int]:
        return run_agents_as_tasks(lambda agent: seen.append(agent) or 10 * agent, [torch.device("cpu")] * 3)

    runner = dask_task_runner(ExecutionSpec(**DASK))
    assert runner.cluster_kwargs["processes"] is False
    assert agents_flow.with_options(task_runner=runner)() == [0, 10, 20]
    assert sorted(seen) == [0, 1, 2]


def test_workers_outside_the_flows_process_are_refused(pipeline):
    from prefect import flow
    from prefect_dask import DaskTaskRunner

    from flows.agents import run_agents_as_tasks

    @flow
    def agents_flow() -> list[int]:
        return run_agents_as_tasks(lambda agent: agent, [torch.device("cpu")] * 2)

    runner = DaskTaskRunner(cluster_kwargs={"processes": True, "n_workers": 1, "threads_per_worker": 1,
                                            "dashboard_address": None})
    with pytest.raises(RuntimeError, match="must run on Dask workers inside the flow's process"):
        agents_flow.with_options(task_runner=runner)()


def test_a_dask_spec_from_the_default_runner_is_refused(pipeline):
    """``train_flow`` called directly keeps its default runner; a spec asking for Dask says how to start it."""
    from flows.training import train_flow

    path = write_spec(folder(pipeline["root"] / "mismatch"), name="dasktest", config=CONFIG, execution=DASK)
    state = train_flow(spec_path=str(path), run_id="runner-mismatch", workdir=str(pipeline["workdir"]),
                       root=str(pipeline["root"]), tracking_uri=pipeline["tracking_uri"], return_state=True)
    assert state.is_failed()
    with pytest.raises(RuntimeError, match=r"training_flow\(spec\)"):
        state.result()


def test_execution_section_errors_name_the_field(project):
    cases = {
        "execution.task_runner": {"task_runner": "ray"},
        "execution.dask_workers": {"task_runner": "dask", "dask_workers": 0},
        "execution.dask_address": {"task_runner": "dask", "dask_address": "not an address"},
    }
    for where, execution in cases.items():
        with pytest.raises(SpecError) as caught:
            parse_spec({**SPEC, "execution": execution}, "s.yaml", project)
        assert where in dict(caught.value.problems), caught.value.problems
    with pytest.raises(SpecError, match="apply only with task_runner: dask"):
        parse_spec({**SPEC, "execution": {"dask_workers": 4}}, "s.yaml", project)
    with pytest.raises(SpecError, match="drop one of the two"):
        parse_spec({**SPEC, "execution": {"task_runner": "dask", "dask_address": "tcp://10.0.0.5:8786",
                                           "dask_workers": 2}}, "s.yaml", project)


def test_a_preference_run_sends_its_agents_work_to_the_dask_runner(pipeline):
    """MARLHF's agents belong to its policy trainer: collection and policy steps both go through the task map."""
    config = {**CONFIG, "reward_model_device": None, "reward_train_epochs": 1, "reward_batch_size": 2}
    _, state = run(pipeline, "marlhf-dask", "marlhf-dask-run", algorithm="marlhf", config=config, execution=DASK)
    names = task_run_names(state.state_details.flow_run_id)
    agent_runs = [name for name in names if name.startswith("agent_work-")]
    assert len(agent_runs) >= 2 * NUM_AGENTS, names
    assert Path(state.result()["checkpoint"]).name == "checkpoint-3"
