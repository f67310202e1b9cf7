"""Small public helpers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from comlrl.checkpointing.io import read_metadata


def read_checkpoint_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata of a complete checkpoint as a dict.

    Its ``"wandb"`` entry is the saved W&B run identity (``id``, ``project``, ``entity``, ...)
    or ``None``; ``"mlflow"`` likewise holds the MLflow run identity of a pipeline run.
    """
    return read_metadata(path)


__all__ = ["read_checkpoint_metadata"]
