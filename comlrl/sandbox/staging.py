"""A root-owned folder every sandbox uid can read: where the sandbox's own files are staged when the install cannot
be reached (a trainer running as root from a private folder: ``mktemp -d``, ``/root``, a 0700 home).

Under root, each program starts as an unprivileged slot uid, and that uid must execute ``bwrap`` (and load its
libraries) and read the job folder's files before any namespace exists. An install under a folder that only root
may enter gives the slot uid none of that. So what it needs is copied, once, into a *staging root* that is
reachable by construction: every folder from ``/`` down is owned by root and writable by nobody else (a sticky
folder such as ``/tmp`` aside), the staging root and everything in it is owned by root with mode 0755 or 0644.
Each staged set lies in a folder named by the SHA-256 of its contents and is checked byte for byte against its
source before every use in a process: a changed or foreign copy is replaced, never run.

The staging root is ``$COMLRL_SANDBOX_CACHE`` when set, else the first of :data:`ROOTS` that can be made safe
(``/var/cache`` on an ordinary system, ``/tmp`` where the root file system is read-only).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
from pathlib import Path

CACHE_VARIABLE = "COMLRL_SANDBOX_CACHE"
ROOTS = ("/var/cache/comlrl-sandbox", "/tmp/comlrl-sandbox-root")
FILE_MODE, FOLDER_MODE = 0o644, 0o755


class StagingError(OSError):
    """No staging root could be made safe, or a set could not be staged (the message says where and why)."""


def unsafe_folder(path: Path) -> str | None:
    """Why ``path`` (an existing folder) is not safe to hold what root runs: not owned by root, or writable by
    another user without the sticky bit; None when it is safe. Checked for the folder and every folder above it."""
    for folder in (path, *path.parents):
        info = os.lstat(folder)
        if stat.S_ISLNK(info.st_mode):
            return f"{folder} is a symbolic link"
        if info.st_uid != 0:
            return f"{folder} is owned by uid {info.st_uid}, not root"
        writable_by_others = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if writable_by_others and (folder == path or not info.st_mode & stat.S_ISVTX):
            return f"{folder} is writable by other users (mode {stat.S_IMODE(info.st_mode):04o})"
        if not info.st_mode & stat.S_IXOTH:
            return f"{folder} cannot be entered by other users (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def staging_root() -> Path:
    """The staging root (made if missing), safe as :func:`unsafe_folder` requires; :class:`StagingError` if none is."""
    chosen = os.environ.get(CACHE_VARIABLE)
    reasons = []
    for candidate in ([chosen] if chosen else ROOTS):
        path = Path(os.path.abspath(candidate))
        try:
            path.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
            info = os.lstat(path)
            if stat.S_ISDIR(info.st_mode) and info.st_uid == 0 and stat.S_IMODE(info.st_mode) != FOLDER_MODE:
                os.chmod(path, FOLDER_MODE)  # made under a restrictive umask
            problem = unsafe_folder(path)
        except OSError as error:
            problem = f"{path}: {error.strerror or error}"
        if problem is None:
            return path
        reasons.append(problem)
    where = f"${CACHE_VARIABLE}={chosen}" if chosen else " or ".join(ROOTS)
    raise StagingError(f"no safe folder to stage the sandbox's files in ({where}: {'; '.join(reasons)}); set "
                       f"{CACHE_VARIABLE} to a root-owned folder that only root can write")


def digest(path: Path) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            hasher.update(block)
    return hasher.hexdigest()


def set_digest(files: dict[str, Path]) -> str:
    """One SHA-256 over the set: each relative name and its content's digest, in name order."""
    hasher = hashlib.sha256()
    for name in sorted(files):
        hasher.update(f"{name}\0{digest(files[name])}\n".encode())
    return hasher.hexdigest()


def matches(folder: Path, files: dict[str, Path]) -> bool:
    """Whether ``folder`` holds exactly ``files`` (same bytes), each owned by root and writable by root alone."""
    try:
        if unsafe_folder(folder) is not None:
            return False
        for name, source in files.items():
            copy = folder / name
            info = os.lstat(copy)
            if (not stat.S_ISREG(info.st_mode) or info.st_uid != 0 or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
                    or unsafe_folder(copy.parent) is not None or digest(copy) != digest(source)):
                return False
    except OSError:
        return False
    return True


def stage(label: str, files: dict[str, Path]) -> Path:
    """The folder under the staging root holding ``files`` (relative name -> source), copied there if no verified
    copy exists; executables keep their execute bits (mode 0755), other files 0644."""
    root = staging_root()
    target = root / f"{label}-{set_digest(files)[:24]}"
    if matches(target, files):
        return target
    fresh = Path(tempfile.mkdtemp(prefix=f".{label}-", dir=root))
    try:
        for name, source in files.items():
            copy = fresh / name
            for folder in reversed([*copy.relative_to(fresh).parents][:-1]):
                (fresh / folder).mkdir(mode=FOLDER_MODE, exist_ok=True)
                os.chmod(fresh / folder, FOLDER_MODE)
            shutil.copyfile(source, copy)
            os.chmod(copy, FOLDER_MODE if os.stat(source).st_mode & stat.S_IXUSR else FILE_MODE)
        os.chmod(fresh, FOLDER_MODE)
        try:
            os.rename(fresh, target)  # only where no folder of that name exists
        except OSError:
            if not matches(target, files):  # not another process's finished copy: a changed one, never run
                aside = Path(tempfile.mkdtemp(prefix=".replaced-", dir=root))
                os.rename(target, aside / "old")
                shutil.rmtree(aside, ignore_errors=True)
                os.rename(fresh, target)
    except OSError as error:
        raise StagingError(f"could not stage the sandbox's files in {root}: {error}") from error
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
    if not matches(target, files):
        raise StagingError(f"the staged copy in {target} does not match its source")
    return target
