"""Graceful stop: SIGTERM/SIGINT set a flag that the training loop checks after each step."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


class StopRequest:
    def __init__(self) -> None:
        self.signal_name: str | None = None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None


@contextlib.contextmanager
def stop_on_signals(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> Iterator[StopRequest]:
    """While active, the given signals ask the loop to stop instead of killing the process.

    Only the main thread can install handlers; elsewhere (e.g. inside a worker thread of an
    orchestrator) the request object is returned but never set.
    """
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handler(number: int, frame: object) -> None:
        request.signal_name = signal.Signals(number).name

    previous = {number: signal.signal(number, handler) for number in signals}
    try:
        yield request
    finally:
        for number, old in previous.items():
            signal.signal(number, old)
