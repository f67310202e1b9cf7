"""A deployment's run (`comlrl serve`) whose Prefect server hangs mid-run ends in bounded time, as `comlrl run`
does (tests/test_prefect_hang.py): the flow-run process that the runner started exits with status 69 and one
warning, every checkpoint is on disk, and after SIGCONT `comlrl resume` finishes the run (issue 26).

Before, the flow-run process finished training and then waited in Prefect's exit hook for ever, retrying every
queued event against a server that never answers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from flows.orchestrator import CLIENT_BOUNDS, DRAIN_TIMEOUT
from test_prefect_hang import client_env
from test_prefect_outage import EPOCHS, ROOT, kill_group, project, start_prefect, wait_up  # noqa: F401
from test_servers import get_json

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

REQUEST = float(CLIENT_BOUNDS["PREFECT_API_REQUEST_TIMEOUT"])
ONE_CALL = 2 * REQUEST + 2  # a request, Prefect's backoff, its one retry
MARGIN = 20.0  # a loaded 2-core machine


def flow_run_processes(runner: psutil.Process) -> list[psutil.Process]:
    """The processes under the runner that train: the flow run's subprocess (and anything it started), not the
    runner's multiprocessing resource tracker, which lives as long as the runner."""
    return [child for child in runner.children(recursive=True)
            if child.is_running() and "resource_tracker" not in " ".join(child.cmdline())]


def test_a_deployment_run_with_a_hung_server_exits_in_bounded_time_and_resume_finishes(project, tmp_path):
    home = tmp_path / "prefect-server"
    home.mkdir()
    server, api = start_prefect(home)
    runner = None
    try:
        wait_up(server, api)
        workdir = tmp_path / "work"
        env = client_env(api, tmp_path, PREFECT_RUNNER_POLL_FREQUENCY="1")
        log = open(tmp_path / "serve.log", "w+")
        runner = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", str(project / "spec.yaml"), "--cron",
                                   "0 3 * * *", "--root", str(project), "--workdir", str(workdir), "--name", "hang"],
                                  cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 180
        while True:  # the runner has registered its deployment
            try:
                deployment = get_json(f"{api}/deployments/name/comlrl-retrain/hang")
                break
            except Exception:
                assert runner.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
                time.sleep(0.5)
        get_json(f"{api}/deployments/{deployment['id']}/create_flow_run", {})
        while not list(workdir.glob("runs/*/checkpoints/checkpoint-1")):  # boundary 1 committed: the server hangs
            assert runner.poll() is None and time.monotonic() < deadline + 240, \
                (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.1)
        [run_dir] = [path.parents[1] for path in workdir.glob("runs/*/checkpoints/checkpoint-1")]
        training = flow_run_processes(psutil.Process(runner.pid))
        assert training, "no flow-run process under the runner"
        os.killpg(server.pid, signal.SIGSTOP)
        hung = time.monotonic()
        gone, alive = psutil.wait_procs(training, timeout=300)
        exited = time.monotonic() - hung
        print(f"deployment run, hung server: the flow-run process exited {exited:.1f} s after the hang")
        assert not alive, f"still running {time.monotonic() - hung:.0f} s after the hang: {alive}"
        # The run's work went on to the end without the server; the process then ended within the bound: the
        # calls that each give up once (boundary 1's subflow end, boundary 2's subflow start, the training flow's
        # and the retraining flow's final states), the health check and the drain. Measured: 95 s.
        saved = sorted(p.name for p in (run_dir / "checkpoints").glob("checkpoint-*"))
        assert saved == [f"checkpoint-{b}" for b in range(1, EPOCHS + 1)], saved
        assert exited < 4 * ONE_CALL + REQUEST + DRAIN_TIMEOUT + MARGIN, exited

        os.killpg(server.pid, signal.SIGCONT)
        wait_up(server, api)
        output = (tmp_path / "serve.log").read_text()
        warnings = [line for line in output.splitlines() if line.startswith(f"comlrl: the Prefect server at {api} ")]
        assert len(warnings) == 1, output[-4000:]
        assert f"comlrl resume {run_dir.name} --workdir {workdir}" in warnings[0]
        deadline = time.monotonic() + 120
        while "Process exited with status code: 69" not in (tmp_path / "serve.log").read_text():
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-4000:]
            time.sleep(0.5)
        resumed = subprocess.run([sys.executable, "-m", "flows.cli", "resume", run_dir.name, "--workdir",
                                  str(workdir)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stderr[-4000:]
        result = json.loads((run_dir / "result.json").read_text())
        assert result["checkpoint"] == str(run_dir / "checkpoints" / f"checkpoint-{EPOCHS}")
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGCONT)
        if runner is not None and runner.poll() is None:
            os.killpg(runner.pid, signal.SIGTERM)
            try:
                runner.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(runner.pid, signal.SIGKILL)
                runner.wait()
        kill_group(server)
