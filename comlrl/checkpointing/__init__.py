"""Training checkpoints: the atomic on-disk layout (``io``), its seal (``manifest``), the per-step
history the run's checkpoints share (``history``), complete checks before a load (``validate``), which
checkpoints continue a run (``lineage``), repair after a killed save (``recovery``) and the trainer
hook (``runner``)."""

from comlrl.checkpointing.io import (
    CHECKPOINT_PREFIX,
    COMPLETE_MARKER,
    latest_checkpoint,
    list_checkpoints,
    read_metadata,
)
from comlrl.checkpointing.history import read_history
from comlrl.checkpointing.validate import read_checkpoint

__all__ = ["CHECKPOINT_PREFIX", "COMPLETE_MARKER", "latest_checkpoint", "list_checkpoints", "read_checkpoint",
           "read_history", "read_metadata"]
