"""The commands a printed hint names (resume, sync, the UIs), spelled so that they run as printed."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def executable(name: str) -> str:
    """How a printed hint calls one of this environment's commands (``comlrl``, ``mlflow``, ``prefect``): the
    file beside the running interpreter, relative when it lies under the current directory (``.venv/bin/comlrl``),
    so the line works as printed from a fresh shell, without activating the virtual environment."""
    path = Path(os.path.abspath(sys.executable)).parent / name
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
