"""A real `prefect server` that hangs mid-run (its process group SIGSTOPped: the kernel still accepts
connections, nothing answers them): training waits for at most one Prefect call, the process exits
within a bound with status 69 and one warning, every checkpoint is on disk, and after SIGCONT
`comlrl resume` finishes the run.

The bounds come from flows.orchestrator: a call to a server that never answers gives up after two
request timeouts and Prefect's backoff (about 2 s); after the flow's work, what is left is the flow
run's final-state call, a health check (one request timeout) and the queue drain.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from prefect.settings import PREFECT_API_REQUEST_TIMEOUT, temporary_settings

from flows import artifacts, orchestrator
from flows.orchestrator import CLIENT_BOUNDS, DRAIN_TIMEOUT, EXIT_ORCHESTRATOR_UNREACHABLE
from test_prefect_outage import EPOCHS, ROOT, kill_group, project, start_prefect, wait_up  # noqa: F401 (fixture)

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

REQUEST = float(CLIENT_BOUNDS["PREFECT_API_REQUEST_TIMEOUT"])
ONE_CALL = 2 * REQUEST + 2  # a request, Prefect's backoff, its one retry
MARGIN = 15.0  # a loaded 2-core machine


def client_env(api: str, tmp_path, **extra: str) -> dict[str, str]:
    """The environment of a `comlrl` process against the Prefect server at ``api``: MLflow on SQLite under
    ``tmp_path``, offline, and Prefect's client bounds left to flows.orchestrator (none inherited)."""
    env = {**os.environ, "PREFECT_API_URL": api, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
           "HF_HUB_OFFLINE": "1", **extra}
    for key in ("PREFECT_HOME", "PREFECT_LOCAL_STORAGE_PATH", *CLIENT_BOUNDS):
        env.pop(key, None)
    return env


def test_a_hung_prefect_server_costs_one_call_and_a_bounded_exit_and_resume_finishes(project, tmp_path):
    home = tmp_path / "prefect-server"
    home.mkdir()
    server, api = start_prefect(home)
    run = None
    try:
        wait_up(server, api)
        workdir = tmp_path / "work"
        env = client_env(api, tmp_path)
        command = [sys.executable, "-m", "flows.cli", "run", str(project / "spec.yaml"), "--root", str(project),
                   "--run-id", "hang-run", "--workdir", str(workdir)]
        out, err = open(tmp_path / "run.out", "w+"), open(tmp_path / "run.err", "w+")  # files: a pipe could fill up
        run = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=err)
        run_dir = workdir / "runs" / "hang-run"
        checkpoints = run_dir / "checkpoints"
        while not (checkpoints / "checkpoint-1").is_dir():  # boundary 1 committed: the server hangs
            assert run.poll() is None, (tmp_path / "run.err").read_text()[-3000:]
            time.sleep(0.1)
        os.killpg(server.pid, signal.SIGSTOP)
        hung = time.monotonic()
        while not (checkpoints / "checkpoint-2").is_dir() and run.poll() is None:
            time.sleep(0.1)
        stall = time.monotonic() - hung
        run.wait(timeout=300)
        exited = time.monotonic() - hung
        done = time.time() - (run_dir / "result.json").stat().st_mtime  # the run's work before it exited
        out.close()
        err.close()
        stderr = (tmp_path / "run.err").read_text()
        print(f"hung server: checkpoint-2 {stall:.1f} s after the hang, exit {exited:.1f} s after it "
              f"({done:.1f} s after result.json); stderr {len(stderr.splitlines())} lines, "
              f"{stderr.count('Traceback')} tracebacks, {stderr.count('| ERROR')} Prefect ERROR lines")

        assert run.returncode == EXIT_ORCHESTRATOR_UNREACHABLE, stderr[-4000:]
        saved = sorted(p.name for p in checkpoints.glob("checkpoint-*"))
        assert saved == [f"checkpoint-{b}" for b in range(1, EPOCHS + 1)]  # nothing finished was lost
        # Boundary 2 trains in a fraction of a second: what it waited was boundary 1's subflow ending
        # (one call that gave up) and nothing after; before, three such calls of 62 s each (186 s).
        assert stall < ONE_CALL + MARGIN, stall
        # After the work: the flow run's final state (one call), the health check, the drain. Before: 406 s
        # from the hang, each artifact and state call waiting out its retries.
        assert done < ONE_CALL + REQUEST + DRAIN_TIMEOUT + MARGIN, done
        warnings = [line for line in stderr.splitlines() if "comlrl resume" in line]
        assert len(warnings) == 1 and warnings[0].startswith(f"comlrl: the Prefect server at {api} "), stderr[-4000:]
        assert f"comlrl resume hang-run --workdir {workdir}" in warnings[0] and str(checkpoints) in warnings[0]

        os.killpg(server.pid, signal.SIGCONT)
        wait_up(server, api)
        resume = [sys.executable, "-m", "flows.cli", "resume", "hang-run", "--workdir", str(workdir)]
        resumed = subprocess.run(resume, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stderr[-4000:]
        result = json.loads((run_dir / "result.json").read_text())
        assert result["checkpoint"] == str(checkpoints / f"checkpoint-{EPOCHS}")
    finally:
        if run is not None and run.poll() is None:  # the bug this test is about: a run that does not exit
            run.kill()
            run.wait()
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGCONT)
        kill_group(server)


def test_a_server_that_accepts_but_never_answers_is_found_within_one_request_timeout(monkeypatch):
    with socket.socket() as hung:  # listening, never accepting: the kernel completes the handshake
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)
        monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{hung.getsockname()[1]}/api")
        orchestrator.clear_outage()
        try:
            with temporary_settings(updates={PREFECT_API_REQUEST_TIMEOUT: 1.0}):
                started = time.monotonic()
                assert not orchestrator.answers()
                assert time.monotonic() - started < 1.0 + 2.0
                assert "within 1 s" in orchestrator.outage()
                started = time.monotonic()
                assert not orchestrator.answers()  # recorded: not asked again
                assert time.monotonic() - started < 0.1
            published = []
            assert artifacts.best_effort(published.append, "table") is None and published == []  # skipped
        finally:
            orchestrator.clear_outage()
    assert orchestrator.outage() is None


def test_only_a_call_that_got_no_answer_is_an_outage():
    request = httpx.Request("GET", "http://127.0.0.1/api/health")
    assert orchestrator.unanswered(httpx.ReadTimeout("timed out", request=request))
    assert orchestrator.unanswered(ConnectionRefusedError())
    try:
        try:
            raise httpx.ConnectError("refused", request=request)
        except httpx.ConnectError as error:
            raise RuntimeError("the engine could not set the state") from error
    except RuntimeError as wrapped:
        assert orchestrator.unanswered(wrapped)
    refused = httpx.HTTPStatusError("503", request=request, response=httpx.Response(503, request=request))
    assert not orchestrator.unanswered(refused)  # the server answered: a locked database, not a hung server
    assert not orchestrator.unanswered(ValueError("bad artifact"))
