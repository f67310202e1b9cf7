"""Training checkpoints: atomic on-disk layout (``io``) and the trainer hook (``runner``)."""

from comlrl.checkpointing.io import (
    CHECKPOINT_PREFIX,
    COMPLETE_MARKER,
    latest_checkpoint,
    list_checkpoints,
    read_metadata,
)

__all__ = ["CHECKPOINT_PREFIX", "COMPLETE_MARKER", "latest_checkpoint", "list_checkpoints", "read_metadata"]
