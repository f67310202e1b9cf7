"""One writer per directory: an advisory lock (``flock``) on a file in it, held while a process writes there.

The operating system drops the lock when its process ends, however it ends, so a held lock means a
live process. The lock file names its holder (host, pid, since when), and a second process that
finds the lock taken gets :class:`DirectoryLockedError` saying who holds it. With ``shared=True`` the
lock is shared within one process: a trainer built after an earlier one in the same process (a
resume in the same interpreter) takes it over rather than locking itself out; otherwise every
:class:`DirectoryLock` object is a holder of its own (a second one in the same process is refused).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import IO

LOCK_FILE = ".comlrl.lock"

_held: dict[str, tuple[IO[str], int]] = {}  # resolved path -> (open locked file, holders in this process)
_guard = threading.Lock()


class DirectoryLockedError(RuntimeError):
    """Another live process holds the lock: ``path`` (the lock file) and ``holder`` (what it wrote)."""

    def __init__(self, path: Path, holder: str, what: str) -> None:
        self.path, self.holder = path, holder
        super().__init__(f"{what} is in use by another process ({holder or 'holder unknown'}; lock file {path}): "
                         "wait for it to end, or use another directory")


def _holder_text(handle: IO[str]) -> str:
    try:
        handle.seek(0)
        record = json.loads(handle.read() or "{}")
        return f"pid {record['pid']} on {record['host']} since {record['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


class DirectoryLock:
    """The lock of ``directory`` (file ``name`` in it); :meth:`acquire` never waits."""

    def __init__(self, directory: str | Path, name: str = LOCK_FILE, what: str | None = None,
                 shared: bool = True) -> None:
        self.path = Path(directory) / name
        self.what = what or f"directory {directory}"
        self.shared = shared
        self._key: str | None = None
        self._own: IO[str] | None = None  # the locked file of an unshared lock

    def acquire(self) -> "DirectoryLock":
        """Take the lock, or raise :class:`DirectoryLockedError` naming the holder."""
        if self.held:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.shared:
            self._own = self._lock_file()
            return self
        key = str(self.path.resolve())
        with _guard:
            if key in _held:
                handle, count = _held[key]
                _held[key] = (handle, count + 1)
            else:
                _held[key] = (self._lock_file(), 1)
            self._key = key
        return self

    def _lock_file(self) -> IO[str]:
        handle = open(self.path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _holder_text(handle)
            handle.close()
            raise DirectoryLockedError(self.path, holder, self.what) from None
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "since": time.strftime("%Y-%m-%d %H:%M:%S")}))
        handle.flush()
        return handle

    def release(self) -> None:
        if self._own is not None:
            self._own.close()  # closing the file releases the lock
            self._own = None
        if self._key is None:
            return
        with _guard:
            handle, count = _held[self._key]
            if count > 1:
                _held[self._key] = (handle, count - 1)
            else:
                del _held[self._key]
                handle.close()  # closing the file releases the lock
        self._key = None

    @property
    def held(self) -> bool:
        return self._key is not None or self._own is not None
