"""Connects a trainer's ``train()`` to checkpoints: resume at the start, save at boundaries.

A trainer exposes exactly three things: ``checkpoint_modules()`` (the trained models, saved as
safetensors), ``state_dict()``/``load_state_dict()`` (everything else that a resume needs) and
``compat_settings()`` (what must match for the state to mean the same). This module owns the
rest: when to save, what the metadata holds, and what makes a resume incompatible.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

import comlrl
from comlrl.parallel import sharding
from comlrl.checkpointing import io

FORMAT_VERSION = 2
logger = logging.getLogger(__name__)


def model_fingerprint(module: torch.nn.Module) -> dict[str, Any]:
    """What must match for saved weights to mean the same thing: class and parameter shapes."""
    shapes = {name: list(tensor.shape) for name, tensor in module.state_dict().items()}
    return {"class": sharding.model_class(module).__name__, "num_tensors": len(shapes), "shapes": shapes}


def _describe_shape_difference(saved: dict[str, Any], current: dict[str, Any]) -> str:
    if saved["class"] != current["class"]:
        return f"architecture {current['class']} here but {saved['class']} in the checkpoint"
    for key in sorted(set(saved["shapes"]) | set(current["shapes"])):
        if saved["shapes"].get(key) != current["shapes"].get(key):
            return f"tensor {key!r} has shape {current['shapes'].get(key)} here but {saved['shapes'].get(key)} in the checkpoint"
    return "weights differ"


class CheckpointRunner:
    """Options of ``train(checkpoint_dir=..., checkpoint_interval=..., resume_from_checkpoint=...)``."""

    def __init__(
        self,
        trainer: Any,
        checkpoint_dir: str | Path | None = None,
        checkpoint_interval: int = 1,
        resume_from_checkpoint: str | Path | bool | None = None,
        save_total_limit: int | None = None,
    ) -> None:
        if isinstance(checkpoint_interval, bool) or not isinstance(checkpoint_interval, int) or checkpoint_interval < 1:
            raise ValueError(f"checkpoint_interval must be a positive integer, got {checkpoint_interval!r}")
        if save_total_limit is not None and (not isinstance(save_total_limit, int) or save_total_limit < 1):
            raise ValueError(f"save_total_limit must be a positive integer or None, got {save_total_limit!r}")
        self.trainer = trainer
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.interval = checkpoint_interval
        self.save_total_limit = save_total_limit
        self.resume_path = self._resolve_resume(resume_from_checkpoint)
        self.last_saved: int | None = None
        self.failures = 0

    def _resolve_resume(self, resume: str | Path | bool | None) -> Path | None:
        if resume in (None, False):
            return None
        if resume is True or resume == "latest":
            if self.checkpoint_dir is None:
                raise ValueError("resume_from_checkpoint='latest' needs checkpoint_dir")
            return io.latest_checkpoint(self.checkpoint_dir)
        path = Path(resume)
        io.read_metadata(path)  # raises for missing or incomplete checkpoints
        return path

    # ----- resume -----------------------------------------------------------------------------
    def begin(self) -> None:
        if self.resume_path is None:
            return
        metadata = io.read_metadata(self.resume_path)
        self.check_compatible(metadata)
        trainer = self.trainer
        io.load_modules(self.resume_path, trainer.checkpoint_modules())
        state = io.load_pt(self.resume_path / io.STATE_FILE)
        state["progress"]["history"] = json.loads((self.resume_path / io.HISTORY_FILE).read_text())
        trainer.load_state_dict(state, f"checkpoint {str(self.resume_path)!r}")  # the RNGs last
        trainer.run_identity.update({key: metadata.get(key) for key in ("wandb", "mlflow") if metadata.get(key)})
        self.last_saved = metadata["boundary"]

    def check_compatible(self, metadata: dict[str, Any]) -> None:
        trainer = self.trainer
        where = f"cannot resume from {str(self.resume_path)!r}"
        if metadata.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{where}: checkpoint format {metadata.get('format_version')} is not this library's "
                             f"format {FORMAT_VERSION}; start a new run from the exported models instead")
        if metadata.get("trainer") != type(trainer).__name__:
            raise ValueError(f"{where}: it was written by {metadata.get('trainer')}, not {type(trainer).__name__}")
        current = trainer.compat_settings()
        for key, value in current.items():
            saved = metadata["compat"].get(key)
            if saved != value:
                raise ValueError(f"{where}: {key} is {value!r} here but {saved!r} in the checkpoint")
        modules = trainer.checkpoint_modules()
        if set(modules) != set(metadata["models"]):
            raise ValueError(f"{where}: models {sorted(modules)} here but {sorted(metadata['models'])} in the checkpoint")
        for name, module in modules.items():
            fingerprint = model_fingerprint(module)
            if fingerprint != metadata["models"][name]:
                raise ValueError(f"{where}: {name}: {_describe_shape_difference(metadata['models'][name], fingerprint)}")
        trainer.check_resume_progress(metadata["state"])

    # ----- save -------------------------------------------------------------------------------
    def on_boundary(self) -> None:
        boundary = self.trainer.state.boundaries
        if self.checkpoint_dir is not None and boundary % self.interval == 0:
            self.save()

    def end(self) -> None:
        if self.checkpoint_dir is not None and self.last_saved != self.trainer.state.boundaries:
            self.save()

    def save_interrupted(self) -> str | None:
        """A checkpoint between boundaries (after a stop request or a run-ending error)."""
        if self.checkpoint_dir is None:
            return None
        state = self.trainer.state
        path = self.save(f"{io.CHECKPOINT_PREFIX}{state.boundaries}-step{state.global_step}")
        return str(path) if path is not None else None

    def save(self, name: str | None = None) -> Path | None:
        """Write a checkpoint; a failed write (e.g. a full disk) is logged and leaves older ones intact.

        Under data parallelism rank 0 writes (every rank holds the same weights) and the others
        wait at a barrier until it is on disk; sharded models are first gathered to rank 0 (every
        rank takes part).
        """
        name = name or f"{io.CHECKPOINT_PREFIX}{self.trainer.state.boundaries}"
        parallel = getattr(self.trainer, "data_parallel", None)
        modules = sharding.gather_weights(self.trainer.checkpoint_modules())
        state = self.trainer.state_dict()
        if parallel is not None and not parallel.is_main:
            parallel.barrier()
            self.last_saved = self.trainer.state.boundaries
            return self.checkpoint_dir / name
        try:
            return self._write(name, modules, state)
        except (OSError, SafetensorError) as error:
            self.failures += 1
            logger.error("checkpoint save failed (%s); earlier checkpoints are intact and training goes on", error)
            return None
        finally:
            if parallel is not None:
                parallel.barrier()

    def _write(self, name: str, modules: dict[str, Any], state: dict[str, Any]) -> Path:
        """Write ``modules`` (as :func:`comlrl.parallel.sharding.gather_weights` returns them), ``state`` and the metadata."""
        trainer = self.trainer
        history = state["progress"].pop("history")
        metadata = {
            "format_version": FORMAT_VERSION,
            "library_version": comlrl.__version__,
            "trainer": type(trainer).__name__,
            "boundary": trainer.state.boundaries,
            "boundary_kind": trainer.boundary_kind,
            "state": state["progress"],
            "config": trainer.args.to_dict(),
            "compat": trainer.compat_settings(),
            "models": {name: model_fingerprint(module) for name, module in trainer.checkpoint_modules().items()},
            "wandb": trainer.run_identity.get("wandb"),
            "mlflow": trainer.run_identity.get("mlflow"),
        }
        path = io.write_checkpoint(self.checkpoint_dir, name, modules, state, metadata, history)
        self.last_saved = trainer.state.boundaries
        if self.save_total_limit is not None:
            io.prune(self.checkpoint_dir, self.save_total_limit, spare=self.resume_path)
        return path
