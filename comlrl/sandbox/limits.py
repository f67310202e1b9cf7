"""What a sandboxed program may use, and what it left behind: :class:`SandboxLimits` and :class:`SandboxResult`."""

from __future__ import annotations

import math
from dataclasses import dataclass

ISOLATIONS = ("full", "rlimits")


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed program; every field is checked at construction.

    ``timeout`` is wall-clock: when it runs out the whole process tree is killed. The rest are the
    kernel's limits (``setrlimit``), applied inside the sandbox before the program's first line runs,
    except ``max_output_bytes`` (enforced by the reader: past it the tree is killed) and
    ``scratch_mb`` (the size of the private writable directory, a tmpfs under full isolation).
    """

    timeout: float = 10.0
    memory_mb: int = 512
    cpu_seconds: int | None = None  # default: the timeout rounded up, plus one second
    max_processes: int = 32
    max_open_files: int = 64
    max_file_mb: int = 16
    scratch_mb: int = 64
    max_output_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if not (isinstance(self.timeout, (int, float)) and math.isfinite(self.timeout) and self.timeout > 0):
            raise ValueError(f"sandbox timeout must be a positive number of seconds, got {self.timeout!r}")
        for name, low in (("memory_mb", 32), ("max_processes", 1), ("max_open_files", 16), ("max_file_mb", 1),
                          ("scratch_mb", 1), ("max_output_bytes", 1024)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"sandbox {name} must be an integer of at least {low}, got {value!r}")
        if self.cpu_seconds is not None and (not isinstance(self.cpu_seconds, int) or self.cpu_seconds < 1):
            raise ValueError(f"sandbox cpu_seconds must be a positive integer or None, got {self.cpu_seconds!r}")

    @property
    def cpu_limit(self) -> int:
        return self.cpu_seconds if self.cpu_seconds is not None else math.ceil(self.timeout) + 1

    def rlimits(self) -> dict[str, int]:
        """The kernel limits the prelude sets, by ``resource`` name (soft = hard)."""
        mib = 1 << 20
        return {
            "RLIMIT_AS": self.memory_mb * mib,
            "RLIMIT_CPU": self.cpu_limit,
            "RLIMIT_NPROC": self.max_processes,
            "RLIMIT_NOFILE": self.max_open_files,
            "RLIMIT_FSIZE": self.max_file_mb * mib,
            "RLIMIT_CORE": 0,
        }


@dataclass(frozen=True)
class SandboxResult:
    """What one program did, as seen from outside: its output (each stream cut at the limit), how it ended.

    ``exit_code`` is the program's status (``None`` when the sandbox killed it: ``timed_out`` or
    ``output_truncated`` says why). A program that signal N ended reports ``128 + N`` whichever path ran it
    (bubblewrap's report from a fresh sandbox, where the program is its namespace's PID 1 and the kernel
    ignores the signals it sends itself without a handler; a warm worker and ``rlimits`` report the same). Nothing here comes from the program's
    say-so except its output: a harness that needs a verdict writes it there and checks it itself.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool = False
    output_truncated: bool = False
    duration: float = 0.0
    isolation: str = "full"

    @property
    def ok(self) -> bool:
        """The program ran to its end with status 0 (not a verdict on what it computed)."""
        return self.exit_code == 0 and not self.timed_out and not self.output_truncated
