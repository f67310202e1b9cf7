"""The production stack, run for real: `bash infra/servers.sh start --postgres` (one PostgreSQL on loopback
with the databases prefect and mlflow, the Prefect server on asyncpg, the MLflow server on psycopg with its
artifacts on disk), the process work pool and the deployment of infra/prefect.yaml created with Prefect's
CLI as its header says, and a `prefect worker` that runs the scheduled retraining twice.

The first run, triggered by hand, finds no champion: it trains the spec's models and the gate promotes it. The
second is a slot of a short interval schedule added beside the file's daily cron, picked up by the worker when
due; it trains from that champion (the registered versions), and the gate compares it with that champion. A run
triggered while that one runs is Cancelled by the deployment's concurrency limit (one retraining at a time). The
runs' records are read back from PostgreSQL itself, so a server that fell back to SQLite would fail here. The
champion is then served with docs/pipeline.md's `mlflow models serve` command, read from the doc and run as
printed there against this MLflow server. Last, PostgreSQL is stopped for 10 s during a third retraining
(infra/README.md says what that costs).
The deployment is the file's as is; each run only overrides its parameters (a tiny spec, a temp workdir).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import psutil
import pytest
import yaml

from comlrl.tasks.letters import write_dataset
from comlrl.tracking import RUN_KEY_TAG
from letters_spec import letters_spec
from test_printed_commands import block_commands
from test_servers import ROOT, free_port, get_json, started_servers, wait_until_answers


def postgres_installed() -> bool:
    """What infra/servers.sh looks for: initdb on PATH or in Debian's /usr/lib/postgresql/N/bin."""
    return bool(shutil.which("initdb") or glob.glob("/usr/lib/postgresql/*/bin/initdb"))


pytestmark = [
    pytest.mark.slow,
    pytest.mark.e2e,
    pytest.mark.skipif(not postgres_installed(), reason="PostgreSQL is not installed (apt-get install postgresql; "
                       "bash infra/bootstrap.sh test does it as root)"),
]
psycopg = pytest.importorskip("psycopg", reason="the postgres extra is not installed: pip install -e '.[postgres]'")

SPEC_NAME = "stacktest"
SPEC = letters_spec(SPEC_NAME, num_generations=2, max_new_tokens=6, num_train_epochs=1,
                    per_device_train_batch_size=2)  # 4 rows: 2 steps, then the eval set's 2 rows
DEPLOYMENT = yaml.safe_load((ROOT / "infra" / "prefect.yaml").read_text())["deployments"][0]
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


class Worker:
    """`prefect worker start --pool POOL` in its own process group, polling every second."""

    def __init__(self, pool: str, env: dict[str, str], log: Path) -> None:
        self.log = log
        with open(log, "wb") as output:
            self.process = subprocess.Popen([str(Path(sys.executable).parent / "prefect"), "worker", "start",
                                             "--pool", pool], cwd=ROOT, env=env, stdout=output,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def tail(self, characters: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-characters:]

    def stop(self) -> None:
        """SIGTERM, then SIGKILL: an idle Prefect 3.9.1 worker here logs that it got the signal but has not
        exited 25 s (or 30 min) later, and nothing runs by the time the tests are done with it."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def prefect(env: dict[str, str], *arguments: str) -> str:
    command = [str(Path(sys.executable).parent / "prefect"), *arguments]
    finished = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert finished.returncode == 0, f"{command}\n{finished.stdout[-3000:]}\n{finished.stderr[-3000:]}"
    return finished.stdout


@pytest.fixture(scope="module")
def stack():
    """The PostgreSQL-backed servers, the work pool, the deployment from infra/prefect.yaml and a worker."""
    # Not pytest's tmp_path: as root, PostgreSQL runs as the user postgres, who must reach its data directory.
    base = Path(tempfile.mkdtemp(prefix="comlrl-stack-"))
    base.chmod(0o711)
    project = base / "project"
    write_dataset(project / "data" / "letters", num_train=4, num_eval=2)
    (project / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    try:
        with started_servers(base / "services", "--postgres") as exports:
            env = {**os.environ, **exports, "PREFECT_HOME": str(base / "prefect-home"), "COMLRL_PROJECT_DIR": str(ROOT),
                   "HF_HUB_OFFLINE": "1", "PREFECT_WORKER_QUERY_SECONDS": "1", "DO_NOT_TRACK": "1",
                   "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
            env.pop("PREFECT_LOCAL_STORAGE_PATH", None)
            pool = DEPLOYMENT["work_pool"]["name"]
            prefect(env, "work-pool", "create", pool, "--type", "process")  # the commands of prefect.yaml's header
            worker = Worker(pool, env, base / "worker.log")
            try:
                prefect(env, "--no-prompt", "deploy", "--prefect-file", "infra/prefect.yaml", "--all")
                yield {"api": exports["PREFECT_API_URL"], "tracking_uri": exports["MLFLOW_TRACKING_URI"],
                       "project": project, "base": base, "worker": worker,
                       "env": env, "database": postgres_settings(base / "services" / "postgres.env")}
            finally:
                worker.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def postgres_settings(path: Path) -> dict[str, str]:
    """The port and passwords servers.sh chose at PostgreSQL's first start (its postgres.env)."""
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def query(database: dict[str, str], name: str, sql: str, *parameters) -> list[tuple]:
    """Rows of ``sql`` in the database ``name``, as its own role (as the server connects)."""
    with psycopg.connect(host="127.0.0.1", port=int(database["POSTGRES_PORT"]), dbname=name, user=name,
                         password=database[f"{name.upper()}_DB_PASSWORD"], connect_timeout=10) as connection:
        return connection.execute(sql, parameters).fetchall()


def deployment_run_parameters(stack: dict) -> dict[str, str]:
    """What each run changes of the file's deployment: the tiny spec and a temporary workdir."""
    return {"spec_path": str(stack["project"] / "spec.yaml"), "root": str(stack["project"]),
            "workdir": str(stack["base"] / "work")}


def trigger(stack: dict, deployment: dict) -> str:
    """A run of the deployment now (as `prefect deployment run` does); its flow run id."""
    flow_run = get_json(f"{stack['api']}/deployments/{deployment['id']}/create_flow_run",
                        {"parameters": deployment_run_parameters(stack)})
    return flow_run["id"]


def schedule_slot(stack: dict, deployment: dict, seconds_ahead: float = 5.0) -> tuple[str, datetime]:
    """A short interval schedule beside the file's daily cron, its first slot ``seconds_ahead`` from now
    materialised by the server's scheduler (what its service does every loop); that slot's flow run id."""
    api, slot = stack["api"], (datetime.now(timezone.utc) + timedelta(seconds=seconds_ahead)).replace(microsecond=0)
    get_json(f"{api}/deployments/{deployment['id']}/schedules", [{
        "schedule": {"interval": 3600, "anchor_date": slot.isoformat(), "timezone": "UTC"},
        "active": True, "parameters": deployment_run_parameters(stack), "slug": "test-slot"}])
    get_json(f"{api}/deployments/{deployment['id']}/schedule",
             {"start_time": datetime.now(timezone.utc).isoformat(), "end_time": (slot + timedelta(seconds=1)).isoformat()})
    scheduled = get_json(f"{api}/flow_runs/filter", {"flow_runs": {
        "deployment_id": {"any_": [deployment["id"]]}, "state": {"type": {"any_": ["SCHEDULED"]}},
        "expected_start_time": {"before_": (slot + timedelta(seconds=1)).isoformat()}}})
    [flow_run] = scheduled  # the file's cron (daily at 03:00) has no slot in this window
    assert datetime.fromisoformat(flow_run["expected_start_time"]) == slot, (flow_run["expected_start_time"], slot)
    return flow_run["id"], slot


def reached(stack: dict, flow_run_id: str, states: set[str], timeout: float = 240.0) -> dict:
    """The flow run once its state is one of ``states`` (the worker still alive meanwhile)."""
    api, worker = stack["api"], stack["worker"]
    deadline = time.monotonic() + timeout
    flow_run = get_json(f"{api}/flow_runs/{flow_run_id}")
    while flow_run["state_type"] not in states:
        assert time.monotonic() < deadline, f"flow run still {flow_run['state_type']}\n{worker.tail()}"
        assert worker.process.poll() is None, f"the worker exited\n{worker.tail()}"
        time.sleep(0.5)
        flow_run = get_json(f"{api}/flow_runs/{flow_run_id}")
    return flow_run


def finished(stack: dict, flow_run_id: str) -> dict:
    """The worker's flow run, Completed, with ``child``: the training flow run it started."""
    flow_run = reached(stack, flow_run_id, TERMINAL)
    assert flow_run["state_type"] == "COMPLETED", f"{flow_run['state']}\n{stack['worker'].tail()}"
    [child] = get_json(f"{stack['api']}/flow_runs/filter",
                       {"flow_runs": {"parent_flow_run_id": {"any_": [flow_run_id]}}})
    return {**flow_run, "child": child}


@pytest.fixture(scope="module")
def deployment(stack) -> dict:
    return get_json(f"{stack['api']}/deployments/name/comlrl-retrain/{DEPLOYMENT['name']}")


@pytest.fixture(scope="module")
def runs(stack, deployment) -> dict[str, dict]:
    """``manual``, triggered by hand, makes the first champion; ``scheduled``, a schedule slot that fires by
    itself, retrains from it; ``overlapping``, triggered while the slot's run runs, meets the deployment's
    concurrency limit."""
    manual = finished(stack, trigger(stack, deployment))
    slot_run, slot = schedule_slot(stack, deployment)
    reached(stack, slot_run, {"PENDING", "RUNNING"} | TERMINAL)
    overlapping = reached(stack, trigger(stack, deployment), TERMINAL, timeout=60)
    return {"manual": manual, "scheduled": {**finished(stack, slot_run), "slot": slot}, "overlapping": overlapping}


def team_versions(stack: dict) -> dict[str, dict[str, str]]:
    """Version -> its tags, for every version of the team model, from the MLflow server."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(stack["tracking_uri"])
    return {v.version: dict(v.tags) for v in client.search_model_versions(f"name = '{SPEC_NAME}-team'")}


def test_the_files_daily_cron_has_its_next_slot_scheduled_on_the_server(stack, deployment):
    """infra/prefect.yaml's own schedule (03:00 UTC daily), as deployed: the server holds a scheduled flow run of
    the deployment at the next 03:00 UTC, computed here from the clock, with the file's parameters."""
    [schedule] = DEPLOYMENT["schedules"]
    assert (schedule["cron"], schedule["timezone"]) == ("0 3 * * *", "UTC")
    now = datetime.now(timezone.utc)
    slot = now.replace(hour=3, minute=0, second=0, microsecond=0)
    slot += timedelta(days=1) if slot <= now else timedelta(0)
    api = stack["api"]
    get_json(f"{api}/deployments/{deployment['id']}/schedule",  # what the scheduler service does each loop
             {"start_time": now.isoformat(), "end_time": (slot + timedelta(minutes=1)).isoformat()})
    scheduled = get_json(f"{api}/flow_runs/filter", {"flow_runs": {
        "deployment_id": {"any_": [deployment["id"]]}, "state": {"type": {"any_": ["SCHEDULED"]}}}})
    at_slot = [run for run in scheduled if datetime.fromisoformat(run["expected_start_time"]) == slot]
    assert len(at_slot) == 1, sorted(run["expected_start_time"] for run in scheduled)
    assert at_slot[0]["parameters"] == deployment["parameters"] == DEPLOYMENT.get("parameters", {}), at_slot[0]


def test_the_worker_runs_the_deployment_from_prefect_yaml_to_completed(stack, deployment, runs):
    assert deployment["work_pool_name"] == DEPLOYMENT["work_pool"]["name"]
    assert deployment["entrypoint"] == DEPLOYMENT["entrypoint"]
    for run in (runs["manual"], runs["scheduled"]):
        assert run["deployment_id"] == deployment["id"] and run["work_pool_name"] == DEPLOYMENT["work_pool"]["name"]
        assert run["infrastructure_pid"], run  # a subprocess the worker started, not this process
        assert run["child"]["name"].startswith(f"{SPEC_NAME}-retrain-") and run["child"]["state_type"] == "COMPLETED"
        assert f"Flow run '{run['child']['name']}' - Finished in state Completed" in stack["worker"].tail(200_000)
    # The scheduled slot named the retraining run after its time (flows/deployments.py).
    scheduled = runs["scheduled"]
    assert scheduled["child"]["name"] == f"{SPEC_NAME}-retrain-{scheduled['slot']:%Y%m%dT%H%M%S}"
    assert scheduled["auto_scheduled"] and not runs["manual"]["auto_scheduled"]
    # The Prefect server keeps its records in PostgreSQL.
    ids = [runs["manual"]["id"], scheduled["id"]]
    rows = query(stack["database"], "prefect", "SELECT id::text, state_type FROM flow_run WHERE id::text = ANY(%s)",
                 ids)
    assert sorted(rows) == sorted((run_id, "COMPLETED") for run_id in ids)


def test_the_first_run_becomes_champion_and_the_second_trains_from_it_through_the_gate(stack, runs):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(stack["tracking_uri"])
    first, second = runs["manual"]["child"]["name"], runs["scheduled"]["child"]["name"]
    by_run = {tags["comlrl.run_id"]: (version, tags) for version, tags in team_versions(stack).items()}
    assert set(by_run) == {first, second}
    (first_version, first_tags), (second_version, second_tags) = by_run[first], by_run[second]
    assert first_tags["comlrl.gate.decision"] == "promoted" and first_tags["comlrl.gate.reason"] == "no champion yet"
    # The second run started from the champion's agent versions (the first run's), pinned in its spec...
    first_agents = json.loads(first_tags["comlrl.agent_versions"])
    assert sorted(first_agents) == [f"{SPEC_NAME}-agent-{i}" for i in range(2)]
    experiment = client.get_experiment_by_name(SPEC_NAME).experiment_id
    [mlflow_run] = client.search_runs([experiment], f"tags.`{RUN_KEY_TAG}` = '{second}'")
    assert mlflow_run.data.params["spec.models.agents"] == str(
        [f"models:/{name}/{version}" for name, version in sorted(first_agents.items())])
    # ... and the gate evaluated that champion against the retrained team.
    assert second_tags["comlrl.gate.champion"] == f"{SPEC_NAME}-team v{first_version}"
    assert second_tags["comlrl.gate.metric"] == "eval/reward_mean"
    assert second_tags["comlrl.gate.champion_score"] and second_tags["comlrl.gate.candidate_score"]
    promoted = second_tags["comlrl.gate.decision"] == "promoted"
    assert second_tags["comlrl.gate.decision"] in ("promoted", "kept champion")
    champion = client.get_model_version_by_alias(f"{SPEC_NAME}-team", "champion")
    assert champion.version == (second_version if promoted else first_version)


def documented_serving(tracking_uri: str, model: str, port: int) -> tuple[str, dict]:
    """docs/pipeline.md's serve command against this MLflow server (its MLFLOW_TRACKING_URI, as the doc says),
    for ``model`` on ``port``, and the request body of the documented curl beside it."""
    commands = [command.text for command in block_commands(ROOT / "docs" / "pipeline.md",
                                                            (ROOT / "docs" / "pipeline.md").read_text())]
    [serve] = [text for text in commands if " models serve " in text]
    [curl] = [text for text in commands if text.startswith("curl ") and "/invocations" in text]
    venv_bin = os.path.relpath(Path(sys.executable).parent, ROOT)  # .venv/bin in a checkout set up as documented
    serve = re.sub(r"MLFLOW_TRACKING_URI=\S+", f"MLFLOW_TRACKING_URI={tracking_uri}", serve)
    serve = re.sub(r"models:/[\w.-]+@champion", f"models:/{model}@champion", serve.replace(".venv/bin", venv_bin))
    serve, replaced = re.subn(r"-p \d+$", f"-p {port}", serve)
    assert replaced == 1, serve
    arguments = shlex.split(curl)
    return serve, json.loads(arguments[arguments.index("-d") + 1])


def served_model_path(server: subprocess.Popen) -> Path:
    """The local copy of the model the scoring server loaded: MLflow downloads the model URI, then starts
    uvicorn with that directory in its environment (``__pyfunc_model_path__``, a file: URI)."""
    for process in psutil.Process(server.pid).children(recursive=True) + [psutil.Process(server.pid)]:
        path = process.environ().get("__pyfunc_model_path__")
        if path:
            return Path(path.removeprefix("file://"))
    raise AssertionError("no scoring server process with __pyfunc_model_path__ under the serve command")


def serve_champion(stack: dict, log: Path) -> tuple[dict, list, dict]:
    """Serve the team's champion with the documented command, ask it the documented request, stop it: the
    MLmodel of what it loaded, its answers and the request."""
    port = free_port()
    command, request = documented_serving(stack["tracking_uri"], f"{SPEC_NAME}-team", port)
    with open(log, "wb") as output:
        server = subprocess.Popen(["bash", "-c", command], cwd=ROOT, env=stack["env"], stdout=output,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_answers(f"http://127.0.0.1:{port}/ping", server, lambda: f"{command}\n{log.read_text()[-3000:]}")
        loaded = yaml.safe_load((served_model_path(server) / "MLmodel").read_text())
        served = get_json(f"http://127.0.0.1:{port}/invocations", request)["predictions"]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    return loaded, served, request


def answers_of(stack: dict, version: str, request: dict) -> list:
    """What team ``version``, loaded here, answers to ``request`` (its seed included)."""
    import mlflow
    import pandas

    mlflow.set_tracking_uri(stack["tracking_uri"])
    local = mlflow.pyfunc.load_model(f"models:/{SPEC_NAME}-team/{version}").predict(
        pandas.DataFrame(request["dataframe_records"]), params=request["params"])
    return local.to_dict(orient="records")


def test_the_champion_team_is_served_over_http_with_the_documented_command(stack, runs, tmp_path):
    from mlflow.tracking import MlflowClient

    champion = MlflowClient(stack["tracking_uri"]).get_model_version_by_alias(f"{SPEC_NAME}-team", "champion")
    loaded, served, request = serve_champion(stack, tmp_path / "serve.log")
    # The server loaded the version the alias names: the logged model that version was registered from (its
    # source names it: flows/registry.py registers models:/<model id>) and the run that logged it.
    assert loaded["model_id"] in champion.source and loaded["run_id"] == champion.run_id, (loaded, champion)
    assert [sorted(answer) for answer in served] == [["agent_0", "agent_1"]] * len(request["dataframe_records"])
    assert all(isinstance(text, str) and text for answer in served for text in answer.values()), served
    # ... and answers as that version does, loaded here with the request's seed.
    assert served == answers_of(stack, champion.version, request)


def test_after_comlrl_promote_a_fresh_serve_answers_as_the_new_champion(stack, runs, tmp_path):
    """Roll the champion over to the other team version with `comlrl promote --from ALIAS --force` (team and
    agents together), then serve again with the documented command: the new champion is what answers."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(stack["tracking_uri"])
    champion = client.get_model_version_by_alias(f"{SPEC_NAME}-team", "champion")
    [other] = [version for version in team_versions(stack) if version != champion.version]
    other_tags = team_versions(stack)[other]
    client.set_registered_model_alias(f"{SPEC_NAME}-team", "rollback", other)
    for name, version in json.loads(other_tags["comlrl.agent_versions"]).items():
        client.set_registered_model_alias(name, "rollback", str(version))
    done = subprocess.run([str(Path(sys.executable).parent / "comlrl"), "promote", SPEC_NAME, "--from", "rollback",
                           "--force", "--workdir", str(tmp_path / "work")], env=stack["env"], capture_output=True,
                          text=True, cwd=ROOT, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{SPEC_NAME}-team: champion -> version {other} (was {champion.version})" in done.stdout, done.stdout
    assert client.get_model_version_by_alias(f"{SPEC_NAME}-team", "champion").version == other
    loaded, served, request = serve_champion(stack, tmp_path / "serve.log")
    now = client.get_model_version(f"{SPEC_NAME}-team", other)
    assert loaded["model_id"] in now.source and loaded["run_id"] == now.run_id != champion.run_id, (loaded, now)
    assert served == answers_of(stack, other, request)


def test_the_runs_are_logged_in_the_postgresql_backed_mlflow(stack, runs):
    names = [runs["manual"]["child"]["name"], runs["scheduled"]["child"]["name"]]
    rows = query(stack["database"], "mlflow", "SELECT run_uuid, name, status FROM runs WHERE name = ANY(%s)", names)
    assert sorted((name, status) for _, name, status in rows) == sorted((name, "FINISHED") for name in names)
    for run_uuid, _, _ in rows:
        steps = query(stack["database"], "mlflow", "SELECT step FROM metrics WHERE run_uuid = %s AND key = %s",
                      run_uuid, "reward_mean")
        assert sorted(step for (step,) in steps) == [1, 2]
    aliases = query(stack["database"], "mlflow", "SELECT name, alias FROM registered_model_aliases")
    assert {(f"{SPEC_NAME}-team", "champion"), (f"{SPEC_NAME}-agent-0", "champion")} <= set(aliases)
    # The artifact root is on disk under the services directory (servers.sh's --artifacts-destination).
    artifacts = stack["base"] / "services" / "mlflow" / "artifacts"
    assert any(path.name == "reward_curve.png" for path in artifacts.rglob("*.png")), list(artifacts.rglob("*"))[:20]


def test_a_run_that_would_overlap_a_running_one_is_cancelled_as_prefect_yaml_says(stack, runs):
    assert DEPLOYMENT["concurrency_limit"] == {"limit": 1, "collision_strategy": "CANCEL_NEW"}
    overlapping = runs["overlapping"]
    assert overlapping["state_type"] == "CANCELLED", overlapping["state"]
    assert overlapping["state"]["message"] == "Deployment concurrency limit reached."
    assert not get_json(f"{stack['api']}/flow_runs/filter",
                        {"flow_runs": {"parent_flow_run_id": {"any_": [overlapping["id"]]}}})  # it trained nothing


RESTART_EPOCHS = 4


def servers_script(stack: dict, *arguments: str) -> str:
    """`bash infra/servers.sh ARGUMENTS` on this stack's services directory (db-stop and db-start)."""
    env = {**stack["env"], "COMLRL_SERVICES_DIR": str(stack["base"] / "services")}
    done = subprocess.run(["bash", str(ROOT / "infra" / "servers.sh"), *arguments], env=env, capture_output=True,
                          text=True, timeout=150)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.parametrize("mode", ["fast", "immediate"])  # immediate: as a crash (recovery at the next start)
def test_postgresql_stopped_for_ten_seconds_mid_run_loses_no_training_and_no_mlflow_records(stack, deployment, runs,
                                                                                          mode):
    """`servers.sh db-stop MODE`, 10 s, `db-start` while a retraining is in its first epoch. Last in the module:
    this run may move the champion alias the tests above read."""
    spec_path = stack["project"] / f"restart-{mode}.yaml"
    spec = {**SPEC, "config": {**SPEC["config"], "num_train_epochs": RESTART_EPOCHS}}
    spec_path.write_text(yaml.safe_dump(spec))
    flow_run = get_json(f"{stack['api']}/deployments/{deployment['id']}/create_flow_run",
                        {"parameters": {**deployment_run_parameters(stack), "spec_path": str(spec_path)}})
    deadline = time.monotonic() + 180
    while True:  # the training flow run, once its first boundary's subflow exists
        children = get_json(f"{stack['api']}/flow_runs/filter",
                            {"flow_runs": {"parent_flow_run_id": {"any_": [flow_run["id"]]}}})
        epochs = children and get_json(f"{stack['api']}/flow_runs/filter",
                                       {"flow_runs": {"parent_flow_run_id": {"any_": [children[0]["id"]]}}})
        if epochs:
            break
        assert time.monotonic() < deadline, stack["worker"].tail()
        time.sleep(0.3)
    assert "stopped postgres" in servers_script(stack, "db-stop", mode)
    time.sleep(10)
    servers_script(stack, "db-start")
    child = finished(stack, flow_run["id"])["child"]
    assert child["state_type"] == "COMPLETED", child["state"]
    # MLflow lost nothing: every step's reward, and the run finished.
    rows = query(stack["database"], "mlflow", "SELECT run_uuid, status FROM runs WHERE name = %s", child["name"])
    assert [status for _, status in rows] == ["FINISHED"], rows
    steps = query(stack["database"], "mlflow", "SELECT step FROM metrics WHERE run_uuid = %s AND key = %s",
                  rows[0][0], "reward_mean")
    assert sorted(step for (step,) in steps) == list(range(1, 2 * RESTART_EPOCHS + 1))
    # Prefect lost nothing either: every boundary ran as its own subflow, recorded Completed (a start the server
    # refused during the outage was asked again, an end it refused recorded once it answered: flows/training.py),
    # with its task runs; what a refused start left is Cancelled as superseded; no boundary fell back to running
    # inside the flow run.
    subflows = get_json(f"{stack['api']}/flow_runs/filter",
                        {"flow_runs": {"parent_flow_run_id": {"any_": [child["id"]]}}})
    completed = [run for run in subflows if run["state_type"] == "COMPLETED"]
    assert sorted(run["name"] for run in completed) == [f"epoch {n} of {RESTART_EPOCHS}"
                                                        for n in range(1, RESTART_EPOCHS + 1)], subflows
    superseded = [run for run in subflows if run["state_type"] != "COMPLETED"]
    assert all(run["state_type"] == "CANCELLED" and run["state"]["message"].startswith("superseded")
               for run in superseded), superseded
    for run in completed:
        task_runs = get_json(f"{stack['api']}/task_runs/filter", {"flow_runs": {"id": {"any_": [run["id"]]}}})
        assert task_runs and all(task["state_type"] == "COMPLETED" for task in task_runs), (run["name"], task_runs)
    assert "the Prefect API could not start the subflow of" not in stack["worker"].tail(2_000_000)
