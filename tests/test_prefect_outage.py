"""A real `prefect server` killed mid-run: training goes on to its last checkpoint, the process
exits within a bound with status 69 (orchestrator unreachable) instead of retrying its queued
events for ever, and `comlrl resume` against the restarted server finishes the run and marks the
interrupted flow run, which the server still shows Running, Crashed.

The server runs on loopback in its own process group; the test kills the whole group after the
first boundary. The restarted server opens the same database on another port, started as soon as
the first one dies so that its slow start overlaps the run's end (a server back on the same port
before the run ends would, correctly, let the run finish normally).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from comlrl.tasks.letters import write_dataset
from flows import orchestrator
from flows.orchestrator import DRAIN_TIMEOUT, EXIT_ORCHESTRATOR_UNREACHABLE
from letters_spec import letters_spec
from test_servers import get_json

ROOT = Path(__file__).resolve().parent.parent
EPOCHS = 3


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_prefect(home: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
           "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'prefect.db'}"}
    env.pop("PREFECT_API_URL", None)
    log = open(home / f"server-{port}.log", "ab")
    process = subprocess.Popen([str(Path(sys.executable).parent / "prefect"), "server", "start", "--host", "127.0.0.1",
                                "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    return process, f"http://127.0.0.1:{port}/api"


def wait_up(process: subprocess.Popen, api: str, timeout: float = 150.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{api}/health", timeout=2):
                return
        except OSError:
            assert process.poll() is None, f"prefect server exited with {process.returncode}"
            assert time.monotonic() < deadline, f"prefect server not up after {timeout} s"
            time.sleep(0.3)


def kill_group(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.fixture
def project(tmp_path) -> Path:
    root = tmp_path / "project"
    write_dataset(root / "data" / "letters", num_train=4, num_eval=2)
    spec = letters_spec("outage", num_generations=2, max_new_tokens=4, num_train_epochs=EPOCHS,
                        per_device_train_batch_size=2)
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    return root


@pytest.mark.slow
@pytest.mark.e2e
def test_a_prefect_outage_ends_the_process_in_bounded_time_and_resume_finishes_the_run(project, tmp_path):
    home = tmp_path / "prefect-server"
    home.mkdir()
    first, api = start_prefect(home)
    restarted = run = None
    try:
        wait_up(first, api)
        workdir = tmp_path / "work"
        env = {**os.environ, "PREFECT_API_URL": api, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
               "HF_HUB_OFFLINE": "1"}
        for key in ("PREFECT_HOME", "PREFECT_LOCAL_STORAGE_PATH"):
            env.pop(key, None)
        command = [sys.executable, "-m", "flows.cli", "run", str(project / "spec.yaml"), "--root", str(project),
                   "--run-id", "outage-run", "--workdir", str(workdir)]
        out, err = open(tmp_path / "run.out", "w+"), open(tmp_path / "run.err", "w+")  # files: a pipe could fill up
        run = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=err)
        checkpoints = workdir / "runs" / "outage-run" / "checkpoints"
        while not (checkpoints / "checkpoint-1").is_dir():  # boundary 1 committed: the server goes away
            assert run.poll() is None, (tmp_path / "run.err").read_text()[-3000:]
            time.sleep(0.2)
        kill_group(first)
        restarted, api_after = start_prefect(home)  # same database; boots while the run ends without it
        run.wait(timeout=300)
        exited = time.time()
        out.close()
        err.close()
        stderr = (tmp_path / "run.err").read_text()

        assert run.returncode == EXIT_ORCHESTRATOR_UNREACHABLE, stderr[-4000:]
        saved = sorted(p.name for p in checkpoints.glob("checkpoint-*"))
        assert saved == [f"checkpoint-{b}" for b in range(1, EPOCHS + 1)]  # training went on to the end
        # Bounded: once the flow's final-state call has failed (1 retry), the health check (at most
        # 3 s) and Prefect's queue (10 s) are all that remain; before, the process was still retrying
        # its queued events minutes later. The end of the run before that (evaluation, registry,
        # artifacts whose publishing also waits out the retries) is bounded the same way.
        final = re.findall(r"^(\d\d:\d\d:\d\d\.\d+) \| \w+ +\| Flow run '[^']*' - Finished in state", stderr, re.M)
        assert final, stderr[-4000:]
        final_at = datetime.datetime.combine(datetime.date.fromtimestamp(exited),
                                             datetime.time.fromisoformat(final[-1])).timestamp()
        assert 0 < exited - final_at < 3 + DRAIN_TIMEOUT + 5, exited - final_at
        assert exited - (checkpoints / f"checkpoint-{EPOCHS}").stat().st_mtime < 150
        warnings = [line for line in stderr.splitlines() if line.startswith("comlrl: the Prefect server")]
        assert len(warnings) == 1, stderr[-4000:]
        assert f"comlrl resume outage-run --workdir {workdir}" in warnings[0] and str(checkpoints) in warnings[0]

        wait_up(restarted, api_after)
        resume = [sys.executable, "-m", "flows.cli", "resume", "outage-run", "--workdir", str(workdir)]
        resumed = subprocess.run(resume, cwd=ROOT, env={**env, "PREFECT_API_URL": api_after}, capture_output=True,
                                 text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stderr[-4000:]
        result = json.loads((workdir / "runs" / "outage-run" / "result.json").read_text())
        assert result["checkpoint"] == str(checkpoints / f"checkpoint-{EPOCHS}")
        assert [entry["name"] for entry in result["registered"]] == ["outage-agent-0", "outage-agent-1"]
        # Nothing trained again: the newest checkpoint is the last boundary's, so no boundary subflow starts.
        assert "Beginning subflow run" not in resumed.stdout + resumed.stderr, resumed.stderr[-4000:]
        # The interrupted flow run, left "Running" by the outage, is closed by the resume as Crashed,
        # naming the flow run that resumed it; so is any boundary subflow it left unfinished.
        runs = get_json(f"{api_after}/flow_runs/filter", {"flow_runs": {"name": {"any_": ["outage-run"]}}})
        states = {run["state_type"]: run for run in runs}
        assert sorted(states) == ["COMPLETED", "CRASHED"], [(run["id"], run["state_type"]) for run in runs]
        assert f"({states['COMPLETED']['id']}) resumed the run" in states["CRASHED"]["state"]["message"]
        everything = get_json(f"{api_after}/flow_runs/filter", {"limit": 50})
        assert not [run["name"] for run in everything if run["state_type"] in ("RUNNING", "PENDING")], everything
    finally:
        if run is not None and run.poll() is None:  # the bug this test is about: a run that never exits
            run.kill()
            run.wait()
        kill_group(first)
        if restarted is not None:
            kill_group(restarted)


def test_prefect_client_waits_are_bounded_unless_the_environment_says_otherwise(monkeypatch):
    for key in orchestrator.CLIENT_BOUNDS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PREFECT_CLIENT_MAX_RETRIES", "7")
    assert orchestrator.bound_client_waits() == {"PREFECT_API_REQUEST_TIMEOUT": "10"}
    assert os.environ["PREFECT_CLIENT_MAX_RETRIES"] == "7"


def test_no_configured_server_or_one_that_answers_never_ends_the_process(monkeypatch, tmp_path):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    orchestrator.exit_if_unreachable("run", str(tmp_path))  # the embedded default: returns
    assert not orchestrator.reachable(f"http://127.0.0.1:{free_port()}/api", timeout=1.0)


def test_a_prefect_call_that_got_no_answer_logs_one_line_without_its_traceback(monkeypatch):
    import io
    import logging

    import httpx

    api = "http://127.0.0.1:4200/api"
    monkeypatch.setenv("PREFECT_API_URL", api)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    handler.addFilter(orchestrator.OutageTracebacks())
    logger = logging.getLogger("test.outage.tracebacks")
    logger.addHandler(handler)
    logger.propagate = False

    def logged(error: BaseException) -> str:
        stream.seek(0)
        stream.truncate()
        try:
            raise error
        except BaseException:
            logger.exception("Encountered exception during execution: %r", error)
        return stream.getvalue()

    try:
        to_api = httpx.ReadTimeout("timed out", request=httpx.Request("POST", f"{api}/flow_runs/x/set_state"))
        assert logged(to_api) == "ERROR Encountered exception during execution: ReadTimeout('timed out')\n"
        try:  # as the engine wraps it
            try:
                raise to_api
            except httpx.ReadTimeout as cause:
                raise RuntimeError("could not propose the state") from cause
        except RuntimeError as wrapped:
            assert "Traceback" not in logged(wrapped)
        elsewhere = httpx.ReadTimeout("timed out", request=httpx.Request("POST", "http://api.example/v1/chat"))
        assert "Traceback" in logged(elsewhere)  # a reward's or comparator's own call keeps its traceback
        assert "Traceback" in logged(OSError(28, "No space left on device"))
        assert "Traceback" in logged(httpx.ReadTimeout("timed out"))  # no request to tell where it went
    finally:
        logger.removeHandler(handler)
