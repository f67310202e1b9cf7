"""A full disk under a run: the room a run keeps to record its end, and the words that name the disk.

When the file system under the working directory fills mid-run, every write fails at once: the checkpoint, the
tracking spool, the log file, the MLflow store's journal. The run still has to end as the docs promise (its MLflow
run FAILED or KILLED, one closing line), and those writes need a little room. :func:`keep_room` sets a small file
aside on each file system the run's end writes to (the run directory's, the embedded MLflow store's) when the run
starts, and :func:`release_room` deletes it as the run records its end. :func:`described` is the closing line's
account of a full disk: which file system, mounted where, with how many bytes free of how many.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable
from urllib.parse import unquote, unquote_to_bytes, urlparse

from flows.orchestrator import causes

ROOM_BYTES = 256 * 1024  # a status update in the MLflow store (its journal: a few pages), log lines, spool records
FULL_BELOW = 1024 * 1024  # a file system with less free than this is full for a run that writes checkpoints
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
FULL_WORDS = ("no space left on device", "database or disk is full", "disk quota exceeded")

_room: list[Path] = []  # the files this process set aside (one per file system)


def keep_room(directories: Iterable[Path], name: str) -> list[Path]:
    """Set :data:`ROOM_BYTES` aside in a file ``name`` in the first of ``directories`` on each file system (written
    bytes, not a sparse file); a file system without that much room gets none. Returns the files kept."""
    release_room()
    seen: set[int] = set()
    for directory in directories:
        try:
            device = os.stat(directory).st_dev
        except OSError:
            continue
        if device in seen:
            continue
        seen.add(device)
        path = Path(directory) / name
        try:
            with open(path, "wb") as handle:
                handle.write(b"\0" * ROOM_BYTES)
                handle.flush()
                os.fsync(handle.fileno())
        except OSError:
            path.unlink(missing_ok=True)
            continue
        _room.append(path)
    return list(_room)


def release_room() -> int:
    """Delete the files :func:`keep_room` set aside; the bytes freed."""
    freed = 0
    while _room:
        path = _room.pop()
        try:
            freed += path.stat().st_size
            path.unlink()
        except OSError:
            pass
    return freed


def store_directory(tracking_uri: str | None) -> Path | None:
    """The local folder of the MLflow store ``tracking_uri`` names (an SQLite file's, a ``file:`` or plain path),
    None for a server. Reads both forms of :func:`flows.tracking_store.sqlite_uri`."""
    if not tracking_uri:
        return None
    if tracking_uri.startswith("sqlite:///"):
        database = tracking_uri[len("sqlite:///"):]
        if database.endswith("?uri=true"):  # an SQLite file: URI, encoded twice
            inner = unquote(database.removesuffix("?uri=true")).removeprefix("file:")
            database = os.fsdecode(unquote_to_bytes(inner))
        return Path(database).parent
    if tracking_uri.startswith("file:"):
        return Path(os.fsdecode(unquote_to_bytes(urlparse(tracking_uri).path)))
    return Path(tracking_uri) if "://" not in tracking_uri else None


def says_full(error: BaseException | str | None) -> bool:
    """Whether ``error`` (or an error below it) is a write refused for want of space: ENOSPC / EDQUOT, SQLite's
    "database or disk is full" (also as MLflow and SQLAlchemy wrap it)."""
    if isinstance(error, str):
        return any(words in error.lower() for words in FULL_WORDS)
    return any((isinstance(cause, OSError) and cause.errno in FULL_ERRNOS)
               or any(words in str(cause).lower() for words in FULL_WORDS) for cause in causes(error))


@dataclass(frozen=True)
class FileSystem:
    """The file system holding ``path``: mounted at ``mount`` (of type ``kind``), ``free`` of ``total`` bytes."""

    path: Path
    mount: Path
    kind: str
    free: int
    total: int

    def describe(self) -> str:
        kind = f" ({self.kind})" if self.kind else ""
        return (f"{size(self.free)} free of {size(self.total)} on the file system mounted at {self.mount}{kind}, "
                f"which holds {self.path}")


def size(count: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} bytes"


def file_system(path: Path) -> FileSystem | None:
    """The file system holding ``path`` (its nearest existing parent); None when it cannot be asked."""
    path = Path(os.path.abspath(path))
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None:
        return None
    try:
        usage = os.statvfs(existing)
        device = os.stat(existing).st_dev
        mount = existing
        while mount != mount.parent and os.stat(mount.parent).st_dev == device:
            mount = mount.parent
    except OSError:
        return None
    return FileSystem(path, mount, mount_kind(mount), usage.f_bavail * usage.f_frsize, usage.f_blocks * usage.f_frsize)


def mount_kind(mount: Path) -> str:
    """The type of the file system mounted at ``mount`` (``/proc/self/mounts``; the last mount there wins)."""
    kind = ""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) > 2 and unescaped(fields[1]) == str(mount):
                    kind = fields[2]
    except OSError:
        pass
    return kind


def unescaped(field: str) -> str:
    """A path as ``/proc/self/mounts`` writes it, with its octal escapes (space, tab, newline, backslash) undone."""
    for escape, character in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(escape, character)
    return field


def fullest(paths: Iterable[Path]) -> FileSystem | None:
    """Of the file systems holding ``paths``, the one with the least free space (the first path named on it)."""
    found: dict[Path, FileSystem] = {}
    for path in paths:
        system = file_system(path)
        if system is not None and system.total > 0 and system.mount not in found:  # not /proc and its kind
            found[system.mount] = system
    return min(found.values(), key=lambda system: system.free, default=None)


def described(error: BaseException | str | None, paths: Iterable[Path]) -> FileSystem | None:
    """The full file system to name in a failure's closing line: the fullest of those holding ``paths`` when
    ``error`` says a disk was full, or when that one has less than :data:`FULL_BELOW` free whatever ``error`` says
    (the disk full under a writer that reports something else: a server's error answer, a torn file). None
    otherwise."""
    system = fullest(paths)
    if system is None:
        return None
    return system if says_full(error) or system.free < FULL_BELOW else None
