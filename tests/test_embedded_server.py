"""Issue 42: a stopped or killed run leaves nothing running. The embedded Prefect server runs in a process group of
its own (so a terminal's Ctrl-C does not kill it before the run records its stop); a run that dies without its exit
hooks — SIGKILL, or a SIGTERM while the server starts — must still take it along (flows/embedded.py). Real
processes: a Python process starts the server as ``comlrl run`` does and is killed; the server must be gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parent.parent
STARTER = """
import sys, time
from flows.runs import configure_embedded_default
from flows import embedded
configure_embedded_default(sys.argv[1])
embedded.start()
print("started", flush=True)
time.sleep(600)
"""


def servers(pid: int) -> list[int]:
    """Live uvicorn processes whose parent is ``pid`` (from /proc; zombies and other children do not count)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                command = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[1]) == pid and b"uvicorn" in command:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def starter(workdir: Path) -> subprocess.Popen:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_", "MLFLOW_"))}
    return subprocess.Popen([sys.executable, "-c", STARTER, str(workdir)], cwd=REPOSITORY, env=env,
                            stdout=subprocess.PIPE, text=True)


def server_of(process: subprocess.Popen, timeout: float = 180) -> int:
    deadline = time.monotonic() + timeout
    while not (found := servers(process.pid)):
        assert process.poll() is None and time.monotonic() < deadline, "the server was never started"
        time.sleep(0.05)
    return found[0]


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid):
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)  # leave nothing behind, then fail
            return False
        time.sleep(0.1)
    return True


@pytest.mark.parametrize("moment, stop", [("serving", signal.SIGKILL), ("starting up", signal.SIGTERM)])
def test_a_run_that_dies_without_its_exit_hooks_takes_the_server_along(moment, stop, tmp_path):
    workdir = tmp_path / "work?x=1 %41"  # URI syntax: the server's database stays inside it all the same
    process = starter(workdir)
    server = server_of(process)
    if moment == "serving":
        assert process.stdout.readline().strip() == "started"
    else:
        assert process.poll() is None  # still waiting for the server's health answer
    assert os.getpgid(server) == server  # its own process group: a Ctrl-C to the run's group does not reach it
    process.send_signal(stop)
    process.wait(30)
    assert gone_within(server, 60), f"the embedded server (pid {server}) outlived its run ({moment})"
    assert [path.name for path in tmp_path.iterdir()] == [workdir.name]
