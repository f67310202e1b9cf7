"""Run Python that a model wrote: the only door through which untrusted code runs (docs/sandbox.md).

:func:`run_python` runs one program and :class:`Sandbox` many in parallel, each in a process tree of its
own, walled off by the operating system (:mod:`comlrl.sandbox.isolation`), limited by the kernel
(:class:`SandboxLimits`) and killed whole at its deadline. Neither raises for anything the program does:
the result (:class:`SandboxResult`) says how it ended. Whether a program *passed* something is never read
from its exit status: a caller that needs a verdict runs a harness that records it (as
:mod:`comlrl.tasks.coding` does).
"""

from __future__ import annotations

from comlrl.errors import SandboxUnavailable
from comlrl.sandbox.limits import ISOLATIONS, SandboxLimits, SandboxResult
from comlrl.sandbox.pool import Sandbox

__all__ = ["ISOLATIONS", "Sandbox", "SandboxLimits", "SandboxResult", "SandboxUnavailable", "run_python"]


def run_python(source: str, *, timeout: float = 10.0, memory_mb: int = 512, stdin: str | bytes = "",
               isolation: str = "full", **limit_fields: object) -> SandboxResult:
    """Run ``source`` as a Python program in a fresh sandbox and return its output and how it ended.

    ``timeout`` (wall-clock seconds) and ``memory_mb`` (address space) are the common limits; the others
    are :class:`SandboxLimits` fields. Raises :class:`SandboxUnavailable` before running anything when the
    isolation asked for cannot run here; never raises for what the program does.
    """
    limits = SandboxLimits(timeout=timeout, memory_mb=memory_mb, **limit_fields)  # type: ignore[arg-type]
    return Sandbox(1, isolation=isolation, limits=limits).run(source, stdin)
