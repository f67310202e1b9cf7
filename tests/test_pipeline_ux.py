"""The pipeline as an operator sees it, against real servers: infra/servers.sh starts a Prefect
server and an MLflow tracking server on loopback, two flow runs train against them (a deliberately
weak one, learning rate 1e-9, then a real one), and the tests ask both servers' APIs what an
operator would look at: subflows and their names, Prefect artifacts, the MLflow eval curve,
plot, spec and tags, model signatures, the champion/challenger gate, the team model loaded from
the registry and served over HTTP (the end-to-end tier, marker ``e2e``). The console pieces of the demo
are checked without servers.
"""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from comlrl.tasks.letters import write_dataset
from letters_spec import letters_spec
from test_servers import ROOT, free_port, get_json, wait_until_answers

SPEC = {
    # Measured: evaluation reward 0.102 untrained (and at lr 1e-9), 0.136 after these 4 steps at lr 0.02.
    **letters_spec("uxtest", num_generations=4, max_new_tokens=8, temperature=1.0, agent_learning_rate=0.02,
                   num_train_epochs=2, per_device_train_batch_size=2, eval_interval=2),  # an evaluation per epoch
    "execution": {"steps_per_task": 1},
}
PROMPT = "tell me about the cat"


# ----- the demo's console (no servers) -------------------------------------------------------------
def test_the_quiet_console_drops_known_harmless_lines_and_keeps_everything_else():
    from flows.console import FilteredStream

    terminal = io.StringIO()
    stream = FilteredStream(terminal)
    stream.write("2026/12/03 11:47:01 WARNING mlflow.transformers: The model card could not be retrieved from the "
                 "hub due to Repo id must be ...\nSuccessfully registered model 'x-agent-0'.\nCreated version '3' of ")
    stream.write("model 'x-agent-0'.\nWARNING: the reward returned NaN for row 3\n")
    assert terminal.getvalue() == "WARNING: the reward returned NaN for row 3\n"
    assert stream.dropped == 3


def test_the_demo_console_shows_one_bar_a_line_per_boundary_and_the_gate():
    from flows.console import ProgressConsole
    from flows.progress import emit

    terminal = io.StringIO()
    console = ProgressConsole(terminal)
    logger = logging.getLogger("flows.progress")
    level, propagate = logger.level, logger.propagate
    logger.addHandler(console)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        emit("start", "training run", total=4, done=0)
        for step in range(1, 3):
            emit("step", f"step {step}/4", done=step, total=4, reward=0.1 * step)
        emit("boundary", "epoch 1 · reward 0.150 · eval 0.200 · 0.4 s", number=1, total=2, row={})
        for step in range(3, 5):
            emit("step", f"step {step}/4", done=step, total=4, reward=0.1 * step)
        emit("boundary", "epoch 2 · reward 0.350 · eval 0.400 · 0.4 s", number=2, total=2, row={})
        emit("gate", "no champion yet", gate={"candidate": "x-team v1", "promoted": True, "reason": "no champion yet"})
    finally:
        logger.removeHandler(console)
        logger.setLevel(level)
        logger.propagate = propagate
    lines = [line for line in terminal.getvalue().replace("\r", "\n").splitlines() if line.strip()]
    assert [line.strip() for line in lines if "·" in line] == ["epoch 1 · reward 0.150 · eval 0.200 · 0.4 s",
                                                              "epoch 2 · reward 0.350 · eval 0.400 · 0.4 s"]
    assert lines[-1] == "gate: x-team v1 promoted to champion: no champion yet"
    assert all(line.startswith("training:") for line in lines if "·" not in line and not line.startswith("gate"))
    assert "4/4" in terminal.getvalue() and "reward=0.400" in terminal.getvalue()


# ----- against the real servers --------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    directory = tmp_path_factory.mktemp("services")
    env = {**os.environ, "COMLRL_SERVICES_DIR": str(directory), "PREFECT_PORT": str(free_port()),
           "MLFLOW_PORT": str(free_port()), "COMLRL_START_TIMEOUT": "150",
           "COMLRL_VENV": str(Path(sys.executable).parent.parent)}
    script = ["bash", str(ROOT / "infra" / "servers.sh")]
    try:
        started = subprocess.run(script + ["start"], env=env, capture_output=True, text=True, timeout=200)
        assert started.returncode == 0, started.stdout + started.stderr
        yield dict(line.removeprefix("export ").split("=", 1) for line in started.stdout.splitlines()
                   if line.startswith("export "))
    finally:
        try:  # deliver Prefect's queued events and logs before their server goes away
            from prefect.events.worker import EventsWorker

            EventsWorker.drain_all(timeout=10, at_exit=False)
        except Exception:
            pass
        subprocess.run(script + ["stop"], env=env, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def runs(servers, tmp_path_factory):
    """A weak run (no champion yet: promoted) and a real one (better: promoted over it), in this
    process against the servers."""
    from prefect.settings import PREFECT_API_URL, PREFECT_LOCAL_STORAGE_PATH, temporary_settings

    from flows.training import train_flow

    project = tmp_path_factory.mktemp("project")
    write_dataset(project / "data" / "letters", num_train=4, num_eval=2)
    work = tmp_path_factory.mktemp("work")
    states = {}
    settings = {PREFECT_API_URL: servers["PREFECT_API_URL"], PREFECT_LOCAL_STORAGE_PATH: str(work / "storage")}
    with temporary_settings(updates=settings):  # the boundary records of these runs only
        for name, learning_rate, epochs in (("weak", 1e-9, 1), ("strong", 0.02, 2)):
            path = project / f"{name}.yaml"
            config = {**SPEC["config"], "agent_learning_rate": learning_rate, "num_train_epochs": epochs}
            path.write_text(yaml.safe_dump({**SPEC, "config": config}))
            states[name] = train_flow(spec_path=str(path), run_id=f"ux-{name}", workdir=str(work), root=str(project),
                                      tracking_uri=servers["MLFLOW_TRACKING_URI"], return_state=True)
    assert all(state.is_completed() for state in states.values()), states
    return {"project": project, "work": work, **{name: state.result() for name, state in states.items()},
            "flow_run_id": str(states["strong"].state_details.flow_run_id)}


def prefect(servers, path: str, body: dict) -> list[dict]:
    return get_json(f"{servers['PREFECT_API_URL']}/{path}", body)


def subflows(servers, flow_run_id: str) -> list[dict]:
    found = prefect(servers, "flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [flow_run_id]}}})
    return sorted(found, key=lambda run: run["expected_start_time"])


def artifacts_of(servers, flow_run_ids: list[str], kind: str, timeout: float = 30.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        found = prefect(servers, "artifacts/filter", {"artifacts": {"flow_run_id": {"any_": flow_run_ids},
                                                                    "type": {"any_": [kind]}}})
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


@pytest.mark.e2e
def test_each_boundary_is_a_subflow_named_after_it_with_a_few_named_tasks(runs, servers):
    children = subflows(servers, runs["flow_run_id"])
    assert [run["name"] for run in children] == ["epoch 1 of 2", "epoch 2 of 2"]
    for run in children:
        assert run["state"]["type"] == "COMPLETED"
        assert "reward" in run["state"]["message"] and "eval" in run["state"]["message"]
    deadline = time.monotonic() + 30
    while True:  # task-run states arrive as events
        tasks = prefect(servers, "task_runs/filter", {"flow_runs": {"id": {"any_": [run["id"] for run in children]}},
                                                     "task_runs": {"state": {"type": {"any_": ["COMPLETED"]}}}})
        if len(tasks) >= 8 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    names = sorted(task["name"] for task in tasks)
    # execution.steps_per_task: 1 -> one task per step; the stages are the step's, timed as metrics.
    # The evaluation (eval_interval: one per epoch) is part of the step that reaches it.
    assert [name.split(":")[0] for name in names] == [
        "epoch 1 · checkpoint", "epoch 1 · end of epoch", "epoch 1 · step 1", "epoch 1 · step 2",
        "epoch 2 · checkpoint", "epoch 2 · end of epoch", "epoch 2 · step 1", "epoch 2 · step 2"]
    assert all(name.split(": ")[1].startswith("rollout, score") for name in names if " · step " in name)


@pytest.mark.e2e
def test_the_run_publishes_progress_table_link_and_summary_artifacts(runs, servers):
    family = [runs["flow_run_id"], *(run["id"] for run in subflows(servers, runs["flow_run_id"]))]
    [progress] = artifacts_of(servers, family, "progress")
    assert progress["key"] == "ux-strong-progress" and float(progress["data"]) == 100.0
    tables = artifacts_of(servers, family, "table")
    assert {table["key"] for table in tables} == {"ux-strong-boundaries"} and len(tables) == 2  # one per boundary
    rows = json.loads(max(tables, key=lambda table: table["created"])["data"])
    assert [row["boundary"] for row in rows] == ["epoch 1", "epoch 2"]
    assert rows[-1]["checkpoint"].endswith("checkpoint-2") and rows[-1]["step"] == 4
    assert rows[-1]["eval_reward"] == pytest.approx(runs["strong"]["gate"]["candidate_score"], abs=1e-4)
    assert all(row["reward"] is not None and row["loss"] is not None for row in rows)
    markdown = {artifact["key"]: artifact["data"] for artifact in artifacts_of(servers, family, "markdown")}
    links = markdown  # Prefect stores link artifacts as markdown "[text](url)"
    mlflow_url = servers["MLFLOW_TRACKING_URI"]
    assert links["ux-strong-mlflow-run"].startswith(f"[MLflow run {runs['strong']['mlflow_run_id']}]({mlflow_url}/#/")
    team = runs["strong"]["team"]
    assert f"({mlflow_url}/#/models/uxtest-team/versions/{team['version']})" in links["ux-strong-model-uxtest-team"]
    assert {"ux-strong-model-uxtest-agent-0", "ux-strong-model-uxtest-agent-1"} <= set(links)
    summary = markdown["ux-strong-summary"]
    for fact in ("Trained **magrpo** with 2 agents", "data/letters/train.parquet", "## Results", "epoch 2",
                 f"uxtest-team v{team['version']}", "checkpoint-2"):
        assert fact in summary, fact
    team_line = next(line for line in summary.splitlines() if f"uxtest-team v{team['version']}" in line)
    assert team_line.endswith("(aliases `candidate`, `champion`)"), team_line  # the gate promoted it
    assert "promoted to **champion**" in markdown["ux-strong-gate"]


@pytest.mark.e2e
def test_mlflow_has_the_eval_curve_the_plot_the_resolved_spec_and_the_flow_run(runs, servers):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(servers["MLFLOW_TRACKING_URI"])
    run = client.get_run(runs["strong"]["mlflow_run_id"])
    assert [(m.step) for m in sorted(client.get_metric_history(run.info.run_id, "eval/reward_mean"),
                                     key=lambda m: m.step)] == [2, 4]  # one point per boundary
    assert {"generation_time", "update_time"} <= set(run.data.metrics)  # stage timings: metrics, not tasks
    paths = {a.path for folder in ("plots", "spec", "checkpoints/checkpoint-2")
             for a in client.list_artifacts(run.info.run_id, folder)}
    assert {"plots/reward_curve.png", "spec/spec.yaml", "spec/resolved_spec.json",
            "checkpoints/checkpoint-2/metadata.json"} <= paths
    resolved = json.loads(Path(client.download_artifacts(run.info.run_id, "spec/resolved_spec.json",
                                                         str(runs["work"]))).read_text())
    assert resolved["config"]["agent_learning_rate"] == 0.02 and resolved["config"]["max_prompt_length"] is None
    tags = run.data.tags
    assert tags["comlrl.algorithm"] == "magrpo" and len(tags["comlrl.spec_hash"]) == 64
    assert tags["prefect.flow_run_id"] == runs["flow_run_id"]
    assert tags["prefect.flow_run_url"].endswith(runs["flow_run_id"])
    assert tags["prefect.flow_run_url"].startswith(servers["PREFECT_API_URL"].removesuffix("/api"))


@pytest.mark.e2e
def test_every_registered_model_has_a_signature_and_an_input_example(runs, servers):
    import mlflow

    mlflow.set_tracking_uri(servers["MLFLOW_TRACKING_URI"])
    for entry in [runs["strong"]["team"], *runs["strong"]["registered"]]:
        info = mlflow.models.get_model_info(f"models:/{entry['name']}/{entry['version']}")
        assert info.signature is not None and info.saved_input_example_info is not None, entry
    team = mlflow.models.get_model_info(f"models:/uxtest-team/{runs['strong']['team']['version']}")
    assert [column.name for column in team.signature.outputs.inputs] == ["agent_0", "agent_1"]


@pytest.mark.e2e
def test_the_gate_promotes_a_better_team_and_keeps_the_champion_against_a_worse_one(runs, servers):
    from mlflow.tracking import MlflowClient

    from flows import gate
    from flows.spec import load_spec

    uri = servers["MLFLOW_TRACKING_URI"]
    weak, strong = runs["weak"]["gate"], runs["strong"]["gate"]
    assert weak["promoted"] and weak["reason"] == "no champion yet"
    assert strong["promoted"] and strong["candidate_score"] > strong["champion_score"]
    assert strong["champion_score"] == pytest.approx(weak["candidate_score"])  # the champion, evaluated in the run
    # The weak team again, now against the strong champion: kept out.
    candidates = {e["name"]: e["version"] for e in [runs["weak"]["team"], *runs["weak"]["registered"]]}
    spec = load_spec(runs["project"] / "weak.yaml", runs["project"])
    decision = gate.run_gate(spec, runs["weak"]["evaluation"], candidates, uri, runs["project"], runs["work"],
                             "candidate")
    assert not decision.promoted and decision.champion_score == pytest.approx(strong["candidate_score"])
    client = MlflowClient(uri)
    for entry in [runs["strong"]["team"], *runs["strong"]["registered"]]:
        assert str(client.get_model_version_by_alias(entry["name"], "champion").version) == entry["version"]
    tags = client.get_model_version("uxtest-team", runs["weak"]["team"]["version"]).tags
    assert tags["comlrl.gate.decision"] == "kept champion"
    assert float(tags["comlrl.gate.candidate_score"]) < float(tags["comlrl.gate.champion_score"])


@pytest.mark.e2e
def test_the_champion_team_loads_from_the_registry_and_generates(runs, servers):
    import mlflow
    import pandas

    mlflow.set_tracking_uri(servers["MLFLOW_TRACKING_URI"])
    team = mlflow.pyfunc.load_model("models:/uxtest-team@champion")
    answers = team.predict(pandas.DataFrame({"prompt": [PROMPT, "a short note on the sun"]}), params={"seed": 0})
    assert list(answers.columns) == ["agent_0", "agent_1"] and len(answers) == 2
    assert all(isinstance(text, str) and text for text in answers.to_numpy().ravel())
    again = team.predict(pandas.DataFrame({"prompt": [PROMPT, "a short note on the sun"]}), params={"seed": 0})
    assert again.equals(answers)


@pytest.mark.e2e
def test_the_team_model_is_served_over_http(runs, servers, tmp_path):
    import mlflow
    import pandas

    port = free_port()
    bin_dir = str(Path(sys.executable).parent)  # mlflow starts the scoring server with the venv's uvicorn
    env = {**os.environ, "MLFLOW_TRACKING_URI": servers["MLFLOW_TRACKING_URI"], "HF_HUB_OFFLINE": "1",
           "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")])}
    command = [str(Path(bin_dir) / "mlflow"), "models", "serve", "-m", "models:/uxtest-team@champion",
               "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)]
    server = subprocess.Popen(command, env=env, stdout=open(tmp_path / "serve.log", "w"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        wait_until_answers(f"http://127.0.0.1:{port}/ping", server,
                           lambda: (tmp_path / "serve.log").read_text()[-3000:])
        served = get_json(f"http://127.0.0.1:{port}/invocations",
                          {"dataframe_records": [{"prompt": PROMPT}], "params": {"seed": 0}})["predictions"]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    mlflow.set_tracking_uri(servers["MLFLOW_TRACKING_URI"])
    local = mlflow.pyfunc.load_model("models:/uxtest-team@champion").predict(
        pandas.DataFrame({"prompt": [PROMPT]}), params={"seed": 0})
    assert served == local.to_dict(orient="records")


@pytest.mark.e2e
def test_promote_refuses_a_candidate_the_gate_kept_out_unless_forced(runs, servers, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    from flows.cli import main

    uri = servers["MLFLOW_TRACKING_URI"]
    client = MlflowClient(uri)
    for entry in [runs["weak"]["team"], *runs["weak"]["registered"]]:  # the gate kept these out (test above)
        client.set_registered_model_alias(entry["name"], "challenger", entry["version"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    arguments = ["promote", "uxtest", "--from", "challenger", "--workdir", str(runs["work"])]
    assert main(arguments) == 2
    assert "did not pass the champion/challenger gate" in capsys.readouterr().err
    assert str(client.get_model_version_by_alias("uxtest-team", "champion").version) == runs["strong"]["team"]["version"]
    assert main(arguments + ["--force"]) == 0
    for entry in [runs["weak"]["team"], *runs["weak"]["registered"]]:
        assert str(client.get_model_version_by_alias(entry["name"], "champion").version) == entry["version"]


@pytest.mark.e2e
def test_library_use_is_not_silenced(runs):
    """Flow runs in library use (the runs above) leave the console as it was: no handler on the
    progress records, standard error not filtered."""
    assert not logging.getLogger("flows.progress").handlers
    assert type(sys.stderr).__name__ != "FilteredStream"


def test_a_boundary_line_shows_the_gradient_norm_beside_a_near_zero_loss():
    from comlrl.progress import Boundary
    from comlrl.training.run import BoundaryReport
    from flows.boundaries import boundary_row, describe

    metrics = {"reward_mean": 0.25, "agent_0/loss": 3e-9, "agent_1/loss": -1e-9, "agent_0/grad_norm": 0.41,
               "agent_1/grad_norm": 0.2}
    report = BoundaryReport(Boundary(2, 3), "/runs/x/checkpoint-2", metrics, [(8, {"eval/reward_mean": 0.5})], 4, 8, 1.25)
    row = boundary_row(report)
    assert row["grad_norm"] == pytest.approx(0.305) and row["loss"] == 0.0
    assert describe(row) == "epoch 2 · reward 0.250 · eval 0.500 · loss 0 · grad 0.305 · 1.2 s"
    # a slightly negative mean rounds to 0, not "-0" (the demo printed "loss -0")
    metrics.update({"agent_0/loss": -3e-9})
    assert " · loss 0 · " in describe(boundary_row(report))


def test_a_long_run_says_where_it_is_every_interval():
    from flows.progress import StepProgress

    class Trainer:
        class state:
            global_step = 0

    now, said = [0.0], []
    progress = StepProgress(100, say=said.append, every=30.0, clock=lambda: now[0])
    for step in range(1, 101):
        now[0] += 2.0  # 2 s per step
        Trainer.state.global_step = step
        progress.on_log(Trainer, {"reward_mean": step / 100}, step)
    assert said[0] == "step 1/100 (1 %) · reward 0.010"
    assert said[1] == "step 16/100 (16 %) · reward 0.160 · 2 s/step · about 3 min left"  # 84 steps x 2 s = 168 s
    assert len(said) == 1 + 99 // 15  # one line per 30 s of 2-s steps after the first
    assert said[-1].startswith("step 91/100 (91 %)") and said[-1].endswith("about 18 s left")
