"""Warm worker slots: a sandbox that stays up and runs one program after another (``Sandbox(warm=True)``).

Starting a sandbox costs a new interpreter and new namespaces (about 19 ms of CPU, and each module the
programs import again). A warm slot pays that once: :mod:`comlrl.sandbox.worker` runs inside the slot's
sandbox (full isolation, the slot's uid) and forks each program from there, cleaning up after it (see
its docstring for what programs of one slot share and what they do not). The trainer keeps its own
deadline over the worker's: a worker that does not answer in time (stopped, killed, busy) is killed with
its sandbox and started anew for the next program.
"""

from __future__ import annotations

import marshal
import os
import select
import shutil
import subprocess
import time

from comlrl.sandbox import isolation
from comlrl.sandbox.limits import SandboxLimits, SandboxResult
from comlrl.sandbox.process import kernel_limits, kill_tree

WORKER = isolation.tool_folder() / "worker.py"
HEADER = 12
GRACE = 5.0  # seconds the trainer waits past a program's deadline before it gives the worker up


class WarmSlot:
    """One slot's worker: started on first use, restarted after a failure."""

    def __init__(self, slot: int, limits: SandboxLimits, preload: tuple[str, ...]) -> None:
        self.slot, self.limits, self.preload = slot, limits, preload
        self.uid, self.gid = isolation.slot_identity(slot)
        self.process: subprocess.Popen | None = None
        self.job_dir: str | None = None

    def start(self) -> None:
        self.job_dir = isolation.job_folder("comlrl-sandbox-warm-")
        isolation.write_job_file(self.job_dir, "worker.py", WORKER.read_text(encoding="utf-8"))
        executable, _ = isolation.interpreter()
        argv = [executable, "-I", "-S", f"{isolation.JOB_DIR}/worker.py", *self.preload]
        command = isolation.bwrap_command(isolation.runnable_bwrap(), self.job_dir, self.limits.scratch_mb, argv)
        command, identity = isolation.as_identity(command, self.uid, self.gid)
        self.process = subprocess.Popen(command, env=dict(isolation.ENVIRONMENT), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
                                        close_fds=True, **identity)

    def run(self, source: str, stdin: str | bytes) -> SandboxResult:
        started = time.monotonic()
        if self.process is None:
            self.start()
        data = stdin.encode("utf-8") if isinstance(stdin, str) else bytes(stdin)
        job = marshal.dumps((source, len(data), kernel_limits(self.limits, self.uid), float(self.limits.timeout),
                             self.limits.max_output_bytes))
        try:
            self._write_all(b"%0*d" % (HEADER, len(job)) + job + data)
            answer = self._receive(started + self.limits.timeout + GRACE)
        except (OSError, ValueError, EOFError, TimeoutError) as error:
            timed_out = isinstance(error, TimeoutError)
            self.close()
            return SandboxResult("", "", None, timed_out=timed_out, duration=time.monotonic() - started,
                                 isolation="full")
        status, out, err, timed_out, truncated = answer
        return SandboxResult(out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), status,
                             timed_out=timed_out, output_truncated=truncated, duration=time.monotonic() - started,
                             isolation="full")

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.process.stdin.fileno(), view):]

    def _receive(self, deadline: float) -> tuple:
        """The worker's chunks and last line (see :mod:`comlrl.sandbox.worker`); ValueError when malformed."""
        streams = {"O": bytearray(), "E": bytearray()}
        while True:
            fields = self._line(deadline).split()
            if fields[:1] == ["S"] and len(fields) == 4 and fields[2] in "01" and fields[3] in "01" and (
                    fields[1] == "-" or fields[1].lstrip("-").isdigit()):
                status = None if fields[1] == "-" else int(fields[1])
                return status, bytes(streams["O"]), bytes(streams["E"]), fields[2] == "1", fields[3] == "1"
            if len(fields) != 2 or fields[0] not in streams or not fields[1].isdigit():
                raise ValueError("the worker's answer is malformed")
            stream, count = streams[fields[0]], int(fields[1])
            if len(stream) + count > self.limits.max_output_bytes:
                raise ValueError("the worker sent more output than the cap")
            stream += self._read(count, deadline)

    def _line(self, deadline: float) -> str:
        line = bytearray()
        while not line.endswith(b"\n"):
            line += self._read(1, deadline)
            if len(line) > 64:
                raise ValueError("the worker's answer is malformed")
        return line.decode("ascii", "replace")

    def _read(self, count: int, deadline: float) -> bytes:
        fd, chunks, left = self.process.stdout.fileno(), [], count
        while left > 0:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise TimeoutError
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        if self.process is not None:
            kill_tree(self.process, "full", self.uid)
            self.process.wait()
            for stream in (self.process.stdin, self.process.stdout):
                stream.close()
            self.process = None
        if self.job_dir is not None:
            shutil.rmtree(self.job_dir, ignore_errors=True)
            self.job_dir = None
