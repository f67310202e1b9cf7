"""The pipeline against real servers: infra/servers.sh starts `prefect server start` and
`mlflow server` on free loopback ports (SQLite back ends), `comlrl run` trains a tiny run
against them, and both servers' HTTP APIs are asked for the flow run and the registered models.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from comlrl.tasks.letters import write_dataset
from letters_spec import letters_spec

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def get_json(url: str, body: dict | None = None, busy_for: float = 60.0) -> dict:
    """GET ``url`` (POST ``body`` when given) and decode the JSON answer. A 503 (a server whose database is
    busy, as SQLite is under a loaded machine's writes) is asked again for up to ``busy_for`` seconds, as
    Prefect's and MLflow's own clients do."""
    data = json.dumps(body).encode() if body is not None else None
    deadline = time.monotonic() + busy_for
    while True:
        request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            if error.code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def wait_until_answers(url: str, process: subprocess.Popen, why, timeout: float = 150.0) -> None:
    """Poll ``url`` each second until it answers; fail with ``why()`` if ``process`` ends or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, why()
            time.sleep(1)


@contextmanager
def started_servers(services: Path, *options: str) -> Iterator[dict[str, str]]:
    """`bash infra/servers.sh start OPTIONS` with its state in ``services`` and every server on a free loopback
    port; yields the variables it prints to export, and stops what it started (checking that it did)."""
    env = {**os.environ, "COMLRL_SERVICES_DIR": str(services), "PREFECT_PORT": str(free_port()),
           "MLFLOW_PORT": str(free_port()), "POSTGRES_PORT": str(free_port()), "COMLRL_START_TIMEOUT": "150",
           "COMLRL_VENV": str(Path(sys.executable).parent.parent)}
    script = ["bash", str(ROOT / "infra" / "servers.sh")]
    try:
        started = subprocess.run(script + ["start", *options], env=env, capture_output=True, text=True, timeout=240)
        assert started.returncode == 0, started.stdout + started.stderr
        yield dict(line.removeprefix("export ").split("=", 1) for line in started.stdout.splitlines()
                   if line.startswith("export "))
    finally:
        stopped = subprocess.run(script + ["stop"], env=env, capture_output=True, text=True, timeout=90)
        expected = ["prefect", "mlflow"] + (["postgres"] if "--postgres" in options else [])
        assert all(f"stopped {name}" in stopped.stdout for name in expected), stopped.stdout + stopped.stderr


@pytest.fixture
def servers(tmp_path):
    with started_servers(tmp_path / "services") as exports:
        yield exports


def test_the_flow_runs_against_real_prefect_and_mlflow_servers(servers, tmp_path):
    assert servers["PREFECT_API_URL"].startswith("http://127.0.0.1:")  # loopback by default
    assert servers["MLFLOW_TRACKING_URI"].startswith("http://127.0.0.1:")
    project = tmp_path / "project"
    write_dataset(project / "data" / "letters", num_train=4, num_eval=2)
    spec = letters_spec("servertest", num_generations=2, max_new_tokens=6, num_train_epochs=2,
                        per_device_train_batch_size=2)
    (project / "spec.yaml").write_text(yaml.safe_dump(spec))
    env = {**os.environ, **servers, "HF_HUB_OFFLINE": "1"}
    for key in ("PREFECT_HOME", "PREFECT_LOCAL_STORAGE_PATH"):
        env.pop(key, None)
    command = [sys.executable, "-m", "flows.cli", "run", str(project / "spec.yaml"), "--root", str(project),
               "--run-id", "server-run", "--workdir", str(tmp_path / "work")]
    finished = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]

    # Prefect: the flow run is recorded by the server, Completed.
    api = servers["PREFECT_API_URL"]
    runs = get_json(f"{api}/flow_runs/filter", {"limit": 10})
    states = {run["name"]: run["state_type"] for run in runs}
    assert states == {"server-run": "COMPLETED", "epoch 1 of 2": "COMPLETED", "epoch 2 of 2": "COMPLETED"}, states
    task_runs = get_json(f"{api}/task_runs/filter", {"limit": 200})
    assert sum(" · steps " in run["name"] for run in task_runs) == 2  # one steps task per epoch

    # MLflow: both agents registered, alias candidate on the version the run logged.
    mlflow_api = f"{servers['MLFLOW_TRACKING_URI']}/api/2.0/mlflow"
    for index in range(2):
        name = f"servertest-agent-{index}"
        query = urllib.parse.urlencode({"name": name, "alias": "candidate"})
        version = get_json(f"{mlflow_api}/registered-models/alias?{query}")["model_version"]
        assert version["name"] == name and version["status"] == "READY"
        tags = {tag["key"]: tag["value"] for tag in version.get("tags", [])}
        assert tags["comlrl.run_id"] == "server-run" and tags["comlrl.algorithm"] == "magrpo"
        run = get_json(f"{mlflow_api}/runs/get?run_id={version['run_id']}")["run"]
        assert run["info"]["status"] == "FINISHED"
