"""The embedded default's Prefect server, in a process group of its own.

Without ``PREFECT_API_URL`` Prefect starts a temporary API server (its "ephemeral mode") as a
child in the caller's process group. A terminal's Ctrl-C, or a supervisor's SIGTERM to the group,
then reaches that server too: it dies with the run, and the run, which stops cleanly after its
current step, can no longer record that its flow run was cancelled. So the command line starts
the same server app itself (Prefect's ``prefect.server.api.server:create_app`` under uvicorn, the
UI off, as the ephemeral mode does), on loopback, in its own process group, points
``PREFECT_API_URL`` at it and stops it when the process ends (after Prefect has sent its queued
events). It keeps its database under ``PREFECT_HOME`` as before. A run that ends without its exit hooks (SIGKILL,
a SIGTERM while the server starts, its process group killed) takes the server with it: the kernel sends the
server SIGTERM when the process that started it dies (``PR_SET_PDEATHSIG``), so no server outlives its run.

Call :func:`start` before Prefect is imported (Prefect reads ``PREFECT_API_URL`` then).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

MARKER = "COMLRL_EMBEDDED_PREFECT"  # set to the server's API URL while this process runs one
_SERVER: subprocess.Popen | None = None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _dies_with(parent: int):
    """For ``preexec_fn``: the child gets SIGTERM when ``parent`` dies, and exits at once if it already has (the
    parent may die between the fork and the ``prctl``). Only async-signal-safe calls: libc's ``prctl`` via
    ctypes, loaded before the fork."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def arm() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return arm


def start(timeout: float = 90.0) -> str:
    """Start the server (once per process), set ``PREFECT_API_URL``; its API URL."""
    global _SERVER
    if _SERVER is not None:
        return os.environ["PREFECT_API_URL"]
    package = importlib.util.find_spec("prefect")
    if package is None or not package.submodule_search_locations:
        raise RuntimeError("the pipeline needs prefect: pip install 'comlrl[pipeline]'")
    app_dir = Path(list(package.submodule_search_locations)[0]).parent
    port = _free_port()
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    command = [sys.executable, "-m", "uvicorn", "--app-dir", str(app_dir), "--factory",
               "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "error", "--lifespan", "on"]
    _SERVER = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, process_group=0,
                               preexec_fn=_dies_with(os.getpid()))
    api_url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + timeout
    while not _healthy(api_url):
        if _SERVER.poll() is not None or time.monotonic() > deadline:
            stop()
            raise RuntimeError(f"the embedded Prefect server did not start within {timeout:.0f} s (its logs: run the "
                               "same command with PREFECT_API_URL unset and --verbose, or start a server with "
                               "bash infra/servers.sh start)")
        time.sleep(0.1)
    atexit.register(stop)  # registered before Prefect's own exit hooks, so it runs after them
    os.environ["PREFECT_API_URL"] = os.environ[MARKER] = api_url
    return api_url


def stop(timeout: float = 10.0) -> None:
    """Stop the server and every process it started."""
    global _SERVER
    server, _SERVER = _SERVER, None
    if server is None or server.poll() is not None:
        return
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    except ProcessLookupError:
        pass


def running() -> bool:
    """Whether this process runs the embedded server."""
    return _SERVER is not None
