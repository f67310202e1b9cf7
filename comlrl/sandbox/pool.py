"""Many programs at once: :class:`Sandbox`, a pool of worker slots, each running one sandboxed program at a time.

Each program still gets a sandbox of its own (its own namespaces, scratch and, under root, uid); the pool
only bounds how many run at once and keeps their order. Its threads do nothing but wait on the programs'
pipes, so the work happens in the sandboxed worker processes.
"""

from __future__ import annotations

import os
import queue
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Sequence

from comlrl.sandbox import isolation as mechanisms
from comlrl.sandbox.limits import ISOLATIONS, SandboxLimits, SandboxResult
from comlrl.sandbox.process import run_program
from comlrl.sandbox.warm import WarmSlot


class Sandbox:
    """Run untrusted Python programs in parallel, each isolated (``isolation="full"``) or, when asked for by
    name, limited by rlimits and a separate uid only (``"rlimits"``).

    >>> with Sandbox(workers=2) as sandbox:
    ...     results = sandbox.map(["print(1)", "print(2)"])
    >>> [r.stdout for r in results]
    ['1\\n', '2\\n']

    Construction checks that the isolation can run here and raises :class:`~comlrl.errors.SandboxUnavailable`
    (one line naming what is missing and the opt-in) before any program runs.
    """

    def __init__(self, workers: int | None = None, *, isolation: str = "full", limits: SandboxLimits | None = None,
                 warm: bool = False, preload: Sequence[str] = (), **limit_fields: object) -> None:
        if isolation not in ISOLATIONS:
            raise ValueError(f"sandbox isolation must be one of {', '.join(map(repr, ISOLATIONS))}, got {isolation!r}")
        if limits is not None and limit_fields:
            raise ValueError(f"give either limits= or limit fields ({', '.join(limit_fields)}), not both")
        self.limits = limits or SandboxLimits(**limit_fields)  # type: ignore[arg-type]
        workers = (os.cpu_count() or 1) if workers is None else workers
        if not isinstance(workers, int) or workers < 1 or workers > mechanisms.MAX_SLOTS:
            raise ValueError(f"sandbox workers must be an integer from 1 to {mechanisms.MAX_SLOTS}, got {workers!r}")
        if warm and isolation != "full":
            raise ValueError("warm workers need isolation='full' (the worker cleans up inside its own namespaces)")
        mechanisms.require(isolation)
        self.isolation = isolation
        self.workers = workers
        self.warm = warm
        self._executor: ThreadPoolExecutor | None = None
        self._warm_slots: queue.Queue | None = None
        if warm:  # each worker holds its slot (its uid) for the pool's lifetime
            self._warm_slots = queue.Queue()
            for _ in range(workers):
                self._warm_slots.put(WarmSlot(mechanisms.SLOTS.acquire(), self.limits, tuple(preload)))

    def run(self, source: str, stdin: str | bytes = "") -> SandboxResult:
        """Run one program and return what it did; never raises for anything the program does."""
        if self._warm_slots is not None:
            worker = self._warm_slots.get()
            try:
                return worker.run(source, stdin)
            finally:
                self._warm_slots.put(worker)
        slot = mechanisms.SLOTS.acquire()
        try:
            return run_program(source, stdin, self.limits, self.isolation, slot)
        finally:
            mechanisms.SLOTS.release(slot)

    def map(self, sources: Sequence[str], stdins: Iterable[str | bytes] | None = None) -> list[SandboxResult]:
        """Run every program (at most ``workers`` at once); results in the order of ``sources``."""
        stdins = list(stdins) if stdins is not None else [""] * len(sources)
        if len(stdins) != len(sources):
            raise ValueError(f"Sandbox.map got {len(sources)} programs but {len(stdins)} stdins")
        if len(sources) <= 1:
            return [self.run(source, stdin) for source, stdin in zip(sources, stdins)]
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="comlrl-sandbox")
        return list(self._executor.map(self.run, sources, stdins))

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._warm_slots is not None:
            while not self._warm_slots.empty():
                worker = self._warm_slots.get()
                worker.close()
                mechanisms.SLOTS.release(worker.slot)
            self._warm_slots = None

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

