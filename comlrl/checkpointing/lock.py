"""One writer per directory: an advisory lock (``flock``) held while a process writes there.

The lock is taken on the directory itself (or, for a named lock, on a file in it), so a
checkpoint directory gains no file. The operating system drops it when its process ends, however
it ends, so a held lock means a live process; a second process that finds it taken gets
:class:`DirectoryLockedError` naming the holder's pid (read from ``/proc/locks``). With
``shared=True`` the lock is shared within one process: a trainer built after an earlier one in the
same process (a resume in the same interpreter) takes it over rather than locking itself out;
otherwise every :class:`DirectoryLock` object is a holder of its own (a second one in the same
process is refused).
"""

from __future__ import annotations

import fcntl
import os
import socket
import threading
from pathlib import Path

_held: dict[str, tuple[int, int]] = {}  # resolved path -> (locked descriptor, holders in this process)
_guard = threading.Lock()


class DirectoryLockedError(RuntimeError):
    """Another live process holds the lock: ``path`` (the lock file) and ``holder`` (what it wrote)."""

    def __init__(self, path: Path, holder: str, what: str) -> None:
        self.path, self.holder = path, holder
        super().__init__(f"{what} is in use by another process ({holder or 'holder unknown'}; it holds an flock on "
                         f"{path}): wait for it to end, or use another directory")


def _holder_text(descriptor: int) -> str:
    """``pid N`` of the process holding an flock on the file behind ``descriptor`` (Linux /proc/locks)."""
    try:
        inode = os.fstat(descriptor).st_ino
        with open("/proc/locks") as locks:
            for line in locks:
                fields = line.split()
                if len(fields) > 5 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(inode):
                    return f"pid {fields[4]} on {socket.gethostname()}"
    except (OSError, ValueError):
        pass
    return ""


class DirectoryLock:
    """The lock of ``directory`` (file ``name`` in it); :meth:`acquire` never waits."""

    def __init__(self, directory: str | Path, name: str | None = None, what: str | None = None,
                 shared: bool = True) -> None:
        self.directory = Path(directory)
        self.path = self.directory / name if name else self.directory
        self.what = what or f"directory {directory}"
        self.shared = shared
        self._key: str | None = None
        self._own: int | None = None  # the locked descriptor of an unshared lock

    def acquire(self) -> "DirectoryLock":
        """Take the lock, or raise :class:`DirectoryLockedError` naming the holder."""
        if self.held:
            return self
        self.directory.mkdir(parents=True, exist_ok=True)
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

    def _lock_file(self) -> int:
        flags = os.O_RDONLY if self.path == self.directory else os.O_RDWR | os.O_CREAT
        descriptor = os.open(self.path, flags, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _holder_text(descriptor)
            os.close(descriptor)
            raise DirectoryLockedError(self.path, holder, self.what) from None
        return descriptor

    def release(self) -> None:
        if self._own is not None:
            os.close(self._own)  # closing the descriptor releases the lock
            self._own = None
        if self._key is None:
            return
        with _guard:
            handle, count = _held[self._key]
            if count > 1:
                _held[self._key] = (handle, count - 1)
            else:
                del _held[self._key]
                os.close(handle)  # closing the descriptor releases the lock
        self._key = None

    @property
    def held(self) -> bool:
        return self._key is not None or self._own is not None
