"""A command's stop signals around a critical section (``comlrl promote``'s alias writes).

Within :class:`StopSignals`, SIGINT and SIGTERM raise :class:`Stopped` at once, except inside
:meth:`StopSignals.critical`: there the first one waits for the block's end and is raised there, so the writes under
way finish; a second one raises at once, leaving them half done (what the block writes must then be safe to leave
half done, as it must be after a SIGKILL, which nothing catches). :attr:`Stopped.moment` tells which of the three it
was. Only the main thread can install handlers; elsewhere the signals keep the handlers they have.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
BEFORE, DURING, AFTER = "before", "during", "after"  # the moments a stop can come, relative to the critical section


class Stopped(KeyboardInterrupt):
    """A stop signal, at :attr:`moment` (`BEFORE`, `DURING` or `AFTER` the critical section)."""

    def __init__(self, number: int, moment: str) -> None:
        super().__init__(signal.Signals(number).name)
        self.number = number
        self.moment = moment

    @property
    def exit_status(self) -> int:
        return 128 + self.number


class StopSignals:
    """A context in which stop signals raise :class:`Stopped`, deferred inside :meth:`critical`."""

    def __init__(self) -> None:
        self.moment = BEFORE
        self.deferred: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {number: signal.signal(number, self._handle) for number in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def _handle(self, number: int, frame: object) -> None:
        if self.moment == DURING and self.deferred is None:
            self.deferred = number  # the writes under way finish first
            return
        raise Stopped(number, self.moment)

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        """The block's writes finish whatever the first stop signal; it is raised (`AFTER`) once they have."""
        self.moment = DURING
        try:
            yield
        finally:
            self.moment = AFTER
        if self.deferred is not None:
            raise Stopped(self.deferred, AFTER)
