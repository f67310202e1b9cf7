"""One program, start to end: its job folder, its process tree under the chosen isolation, its capped output.

The job folder (the program as ``main.py``, readable by the slot's uid) lives on the host only while the
program runs and is removed afterwards, whatever the program did; under full isolation the program's
writable scratch is a tmpfs that disappears with its namespaces. A wall-clock deadline or output past
the limit kills the whole process tree: under full isolation by killing bubblewrap, whose PID namespace
takes every descendant with it; under ``rlimits`` every process of the slot's uid (as root) or of the
program's process group.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import time

from comlrl.sandbox import isolation
from comlrl.sandbox.limits import SandboxLimits, SandboxResult

PRELUDE = isolation.tool_folder() / "prelude.py"
READ_CHUNK = 1 << 16


def run_program(source: str, stdin: str | bytes, limits: SandboxLimits, mode: str, slot: int) -> SandboxResult:
    """Run ``source`` in a fresh sandbox (``mode`` already checked by :func:`isolation.require`)."""
    uid, gid = isolation.slot_identity(slot)
    job_dir = isolation.job_folder("comlrl-sandbox-")
    try:
        isolation.write_job_file(job_dir, "main.py", source)
        isolation.write_job_file(job_dir, "prelude.py", PRELUDE.read_text(encoding="utf-8"))
        executable, _ = isolation.interpreter()
        settings = [f"{name}={value}" for name, value in kernel_limits(limits, uid).items()]
        environment = dict(isolation.ENVIRONMENT)
        if mode == "full":
            argv = [executable, "-I", "-S", f"{isolation.JOB_DIR}/prelude.py", *settings]
            command = isolation.bwrap_command(isolation.runnable_bwrap(), job_dir, limits.scratch_mb, argv)
            cwd = None
        else:
            scratch = os.path.join(job_dir, "scratch")
            os.mkdir(scratch, 0o700)
            if uid is not None:
                os.chown(scratch, uid, gid)
            environment.update(HOME=scratch, TMPDIR=scratch, COMLRL_SANDBOX_JOB=job_dir)
            command = [executable, "-I", "-S", os.path.join(job_dir, "prelude.py"), *settings]
            cwd = scratch
        return _supervise(command, cwd, environment, stdin, limits, mode, uid, gid)
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)


def kernel_limits(limits: SandboxLimits, uid: int | None) -> dict[str, int]:
    """The limits the prelude sets. The kernel counts RLIMIT_NPROC over every process of the real uid: a slot's
    own uid under root; otherwise the caller's, whose processes are counted in so the program still gets its share."""
    values = limits.rlimits()
    if uid is None:
        values["RLIMIT_NPROC"] += _processes_of(os.getuid())
    return values


def _processes_of(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        try:
            count += entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid
        except FileNotFoundError:
            continue
    return count


def _supervise(command: list[str], cwd: str | None, environment: dict[str, str], stdin: str | bytes, limits: SandboxLimits,
               mode: str, uid: int | None, gid: int | None) -> SandboxResult:
    started = time.monotonic()
    command, identity = isolation.as_identity(command, uid, gid)
    process = subprocess.Popen(command, cwd=cwd, env=environment, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, start_new_session=True, close_fds=True, **identity)
    timed_out = truncated = False
    out, err = bytearray(), bytearray()
    try:
        _feed(process, stdin.encode("utf-8") if isinstance(stdin, str) else stdin)
        timed_out, truncated = _collect(process, out, err, started + limits.timeout, limits.max_output_bytes)
    finally:
        if timed_out or truncated or process.poll() is None or (mode == "rlimits" and uid is not None):
            kill_tree(process, mode, uid)  # under rlimits a setsid daemon may outlive a program that ended
        status = signal_status(process.wait())
        for stream in (process.stdout, process.stderr):
            stream.close()
    exit_code = None if (timed_out or truncated) else status
    return SandboxResult(stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace"),
                         exit_code=exit_code, timed_out=timed_out, output_truncated=truncated,
                         duration=time.monotonic() - started, isolation=mode)


def signal_status(code: int) -> int:
    """A death by signal N as exit status ``128 + N``, the one way every path reports it: bubblewrap's way
    (the only one a fresh full-isolation sandbox can give); ``subprocess`` says ``-N`` under ``rlimits``."""
    return 128 - code if code < 0 else code


def _feed(process: subprocess.Popen, data: bytes) -> None:
    """Write the program's standard input (ignoring a program that never reads or exits first)."""
    try:
        if data:
            os.set_blocking(process.stdin.fileno(), False)
            view, deadline = memoryview(data), time.monotonic() + 5.0
            while view and time.monotonic() < deadline:
                try:
                    view = view[os.write(process.stdin.fileno(), view):]
                except BlockingIOError:
                    time.sleep(0.001)
        process.stdin.close()
    except (BrokenPipeError, OSError):
        pass


def _collect(process: subprocess.Popen, out: bytearray, err: bytearray, deadline: float,
             cap: int) -> tuple[bool, bool]:
    """Read both streams until they close; (timed out, output over ``cap``)."""
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ, out)
        selector.register(process.stderr, selectors.EVENT_READ, err)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return True, False
            for key, _ in selector.select(timeout=min(left, 0.5)):
                chunk = os.read(key.fd, READ_CHUNK)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                key.data.extend(chunk)
                if len(key.data) > cap:
                    del key.data[cap:]
                    return False, True
    left = deadline - time.monotonic()
    try:
        process.wait(timeout=max(left, 0.0))
    except subprocess.TimeoutExpired:
        return True, False
    return False, False


def kill_tree(process: subprocess.Popen, mode: str, uid: int | None) -> None:
    """Kill the program and everything it started."""
    try:
        os.killpg(process.pid, signal.SIGKILL)  # bubblewrap (full) or the interpreter (rlimits) and its group
    except (ProcessLookupError, PermissionError):
        pass
    if mode == "rlimits" and uid is not None:
        _kill_uid(uid)  # descendants that left the process group (setsid) still run as the slot's uid


def _kill_uid(uid: int) -> None:
    for _ in range(3):  # a process may fork while the list is read: sweep until none is left
        found = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    os.kill(int(entry), signal.SIGKILL)
                    found = True
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
        if not found:
            return
