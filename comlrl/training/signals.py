"""Graceful stop: SIGTERM/SIGINT set a flag that the training loop checks after each step.

A second signal while the first is still being honoured ends the wait: it raises
``KeyboardInterrupt`` at once (the step in progress is then lost, earlier checkpoints are not).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Set by the first stop signal; ``signal_name`` says which one (``SIGTERM`` / ``SIGINT``)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    @property
    def exit_status(self) -> int | None:
        """The shell's status for a process ended by that signal (128 + its number), None without one."""
        return None if self.signal_name is None else 128 + int(signal.Signals[self.signal_name])


@contextlib.contextmanager
def stop_on_signals(request: StopRequest | None = None,
                    signals: tuple[int, ...] = STOP_SIGNALS) -> Iterator[StopRequest]:
    """While active, the given signals set ``request`` (a new one if None) instead of killing the process.

    Scopes nest: an inner scope (re)installs the handler for its duration and puts back whatever
    was there before, so an orchestrator that installs handlers of its own between two scopes
    (Prefect does, for every flow run) gets them back. Only the main thread can install handlers;
    elsewhere the request object is returned untouched (an outer scope may still set it).
    """
    request = request if request is not None else StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handler(number: int, frame: object) -> None:
        if request.requested:
            raise KeyboardInterrupt(f"second stop signal ({signal.Signals(number).name}): stopping now")
        request.signal_name = signal.Signals(number).name

    previous = {number: signal.signal(number, handler) for number in signals}
    try:
        yield request
    finally:
        for number, old in previous.items():
            signal.signal(number, old)
