"""Connects a trainer's ``train()`` to checkpoints: resume at the start, save at boundaries.

A trainer exposes exactly three things: ``checkpoint_modules()`` (the trained models, saved as
safetensors), ``state_dict()``/``load_state_dict()`` (everything else that a resume needs) and
``compat_settings()`` (what must match for the state to mean the same). This module owns the
rest: when to save, what the metadata holds, and what makes a resume incompatible.

At the start, before the first training step: the checkpoint directory is recovered from killed
saves (:mod:`~comlrl.checkpointing.recovery`), "latest" is resolved, the checkpoint to resume is
checked completely (:mod:`~comlrl.checkpointing.validate`) and against this trainer, loaded, and
checkpoints later than the starting point are archived (:mod:`~comlrl.checkpointing.lineage`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import torch

import comlrl
from comlrl.checkpointing import io, lineage, recovery, validate, write_errors
from comlrl.checkpointing.history import HISTORY_DIR, RECORD_KEY, HistoryLog, encode_rows
from comlrl.checkpointing.io import FORMAT_VERSION
from comlrl.checkpointing.lock import DirectoryLock
from comlrl.errors import CheckpointError, CheckpointWriteError
from comlrl.parallel import sharding

logger = logging.getLogger(__name__)


def model_fingerprint(module: torch.nn.Module) -> dict[str, Any]:
    """What must match for saved weights to mean the same thing: class, tensor shapes and dtypes."""
    tensors = module.state_dict()
    shapes = {name: list(tensor.shape) for name, tensor in tensors.items()}
    dtypes = {name: str(tensor.dtype).removeprefix("torch.") for name, tensor in tensors.items()}
    return {"class": sharding.model_class(module).__name__, "num_tensors": len(shapes), "shapes": shapes,
            "dtypes": dtypes}


def same_model(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether a checkpoint's fingerprint fits this model (a checkpoint written before dtypes were
    recorded is compared without them)."""
    if "dtypes" not in saved:
        current = {key: value for key, value in current.items() if key != "dtypes"}
    return saved == current


def _describe_shape_difference(saved: dict[str, Any], current: dict[str, Any]) -> str:
    if saved["class"] != current["class"]:
        return f"architecture {current['class']} here but {saved['class']} in the checkpoint"
    for key in sorted(set(saved["shapes"]) | set(current["shapes"])):
        if saved["shapes"].get(key) != current["shapes"].get(key):
            return f"tensor {key!r} has shape {current['shapes'].get(key)} here but {saved['shapes'].get(key)} in the checkpoint"
    for key in sorted(saved.get("dtypes", {})):
        if saved["dtypes"][key] != current.get("dtypes", {}).get(key):
            return (f"tensor {key!r} is {current.get('dtypes', {}).get(key)} here but {saved['dtypes'][key]} in the "
                    "checkpoint (load the models in the dtype the run was trained in)")
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
        self.trainer = trainer
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.interval = checkpoint_interval
        self.save_total_limit = save_total_limit
        self.attempt = lineage.new_attempt()
        self.parent_lineage: dict[str, Any] | None = None  # the resumed checkpoint's lineage
        self.recovered: list[str] = []
        # One writer per checkpoint directory: a second process is refused, naming the holder.
        self.lock = DirectoryLock(self.checkpoint_dir, what=f"checkpoint directory {self.checkpoint_dir}") \
            if self.checkpoint_dir is not None else None
        if self.lock is not None:
            self.on_main(self.lock.acquire)
        try:
            # The run's per-step rows, appended at each save (comlrl.checkpointing.history).
            self.history = HistoryLog(self.checkpoint_dir, self.attempt) if self.checkpoint_dir is not None else None
            if self.checkpoint_dir is not None:
                self.on_main(lambda: self.recovered.extend(recovery.recover(self.checkpoint_dir)))
            self.resume_path = self._resolve_resume(resume_from_checkpoint)
        except BaseException:
            self.release()
            raise
        self.last_saved: int | None = None
        self.last_path: Path | None = None  # the newest checkpoint written or resumed from
        self.last_position: tuple[int, int] | None = None  # its (boundaries, global step)

    def release(self) -> None:
        """Let other processes write to the checkpoint directory (the run ended, however it ended)."""
        if self.lock is not None:
            self.lock.release()

    def on_main(self, work: Callable[[], Any]) -> None:
        """``work`` in the process that writes checkpoints; the others wait until it is done."""
        parallel = self.trainer.data_parallel
        try:
            if parallel.is_main:
                work()
        finally:
            parallel.barrier()

    def _resolve_resume(self, resume: str | Path | bool | None) -> Path | None:
        if resume in (None, False):
            return None
        if resume is True or resume == "latest":
            if self.checkpoint_dir is None:
                raise ValueError("resume_from_checkpoint='latest' needs checkpoint_dir")
            return io.latest_checkpoint(self.checkpoint_dir)
        path = Path(resume)
        io.require_present(path)  # missing or incomplete: refused at once
        return path

    # ----- resume -----------------------------------------------------------------------------
    def begin(self) -> None:
        """Resume (every check before anything is loaded), then archive what lies beyond the start."""
        trainer = self.trainer
        if self.resume_path is not None:
            contents = validate.read_checkpoint(self.resume_path, trainer)
            self.check_compatible(contents.metadata)
            validate.check_state_structure(contents, trainer)
            self.load(contents)
            self.parent_lineage = contents.metadata.get("lineage")
            self.last_saved = contents.metadata["boundary"]
            self.last_path = self.resume_path
            self.last_position = (contents.metadata["state"]["boundaries"], contents.metadata["state"]["global_step"])
            state = contents.metadata["state"]
            position = io.checkpoint_order(self.resume_path) or (state["boundaries"], state["global_step"])
        else:
            position = (trainer.state.boundaries, trainer.state.global_step)
        if self.checkpoint_dir is not None:
            self.on_main(lambda: lineage.archive_later(self.checkpoint_dir, position))

    def load(self, contents: validate.CheckpointContents) -> None:
        trainer, path = self.trainer, contents.path
        io.load_modules(path, trainer.checkpoint_modules())
        state = contents.state
        if self.history is not None and RECORD_KEY in contents.metadata:
            self.history.continue_file(path, contents.metadata[RECORD_KEY], contents.history)
        state["progress"]["history"] = contents.history
        try:
            trainer.load_state_dict(state, f"checkpoint {str(path)!r}")  # the RNGs last
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as error:
            raise CheckpointError(path, io.STATE_FILE, f"{type(trainer).__name__}.load_state_dict refused it: "
                                  f"{type(error).__name__}: {error}") from error
        metadata = contents.metadata
        for tracker in ("wandb", "mlflow"):  # the checkpoint's record, absent or not, replaces this process's
            trainer.record_tracking_run(tracker, metadata.get(tracker) or None)

    def check_compatible(self, metadata: dict[str, Any]) -> None:
        """The checkpoint continues this trainer's run: same settings, models and a progress within the plan."""
        trainer = self.trainer

        def refuse(problem: str) -> None:
            raise CheckpointError(self.resume_path, None, f"cannot be resumed here: {problem}")

        current = trainer.compat_settings()
        for key, value in current.items():
            saved = metadata["compat"].get(key)
            if saved != value:
                refuse(f"{key} is {value!r} here but {saved!r} in the checkpoint")
        modules = trainer.checkpoint_modules()
        if set(modules) != set(metadata["models"]):
            refuse(f"models {sorted(modules)} here but {sorted(metadata['models'])} in the checkpoint")
        for name, module in modules.items():
            fingerprint = model_fingerprint(module)
            if not same_model(metadata["models"][name], fingerprint):
                refuse(f"{name}: {_describe_shape_difference(metadata['models'][name], fingerprint)}")
        trainer.check_resume_progress(metadata["state"])
        total = trainer.total_boundaries()
        if metadata["state"]["boundaries"] > total:
            refuse(f"it has completed {metadata['state']['boundaries']} boundaries ({metadata['boundary_kind']}) "
                   f"but this run plans {total}; the run's length counts the whole run, so raise it")

    # ----- save -------------------------------------------------------------------------------
    def on_boundary(self) -> Path | None:
        """The checkpoint of the boundary just completed, when ``checkpoint_interval`` says so (else None)."""
        boundary = self.trainer.state.boundaries
        if self.checkpoint_dir is not None and boundary % self.interval == 0:
            return self.save(required=boundary >= self.trainer.total_boundaries())
        return None

    def end(self) -> Path | None:
        """The final checkpoint, unless the last boundary's is already written. Its failure raises
        :class:`~comlrl.errors.CheckpointWriteError` (naming the last good checkpoint): a run never
        ends as if its final state were saved when it is not."""
        if self.checkpoint_dir is not None and self.last_saved != self.trainer.state.boundaries:
            return self.save(required=True)
        return None

    def save_interrupted(self) -> str | None:
        """A checkpoint between boundaries (after a stop request or a run-ending error)."""
        if self.checkpoint_dir is None:
            return None
        state = self.trainer.state
        if self.last_path is not None and self.last_position == (state.boundaries, state.global_step):
            return str(self.last_path)  # the newest checkpoint already holds exactly this state
        path = self.save(f"{io.CHECKPOINT_PREFIX}{state.boundaries}-step{state.global_step}")
        return str(path) if path is not None else None

    def save(self, name: str | None = None, required: bool = False) -> Path | None:
        """Write a checkpoint. A failed write (a full disk, a file-size limit) leaves older checkpoints
        intact and no staging directory; it is logged with its file and cause and the run goes on
        (None is returned), unless ``required`` (the final save), when it raises
        :class:`~comlrl.errors.CheckpointWriteError` naming the last good checkpoint.

        Under data parallelism rank 0 writes (every rank holds the same weights) and the others
        wait at a barrier until it is on disk; sharded models are first gathered to rank 0 (every
        rank takes part).
        """
        name = name or f"{io.CHECKPOINT_PREFIX}{self.trainer.state.boundaries}"
        parallel = self.trainer.data_parallel
        modules = sharding.gather_weights(self.trainer.checkpoint_modules())
        state = self.trainer.state_dict()
        if not parallel.is_main:
            parallel.barrier()
            self.last_saved = self.trainer.state.boundaries
            return self.checkpoint_dir / name
        try:
            return self._write(name, modules, state)
        except CheckpointWriteError as error:
            kept = io.list_checkpoints(self.checkpoint_dir)
            error.last_good = str(kept[-1]) if kept else "none"
            if required:
                logger.error("the final checkpoint was not saved: %s", error)
                raise
            logger.error("checkpoint save failed: %s. Training goes on; the run fails at its end unless a "
                         "later checkpoint is saved", error)
            return None
        finally:
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
            "lineage": lineage.record(self.attempt, self.resume_path, self.parent_lineage),
            "manifest": True,
            RECORD_KEY: self._append_history(name, history),
        }
        path = io.write_checkpoint(self.checkpoint_dir, name, modules, state, metadata)
        self.last_saved = trainer.state.boundaries
        self.last_path = path
        self.last_position = (trainer.state.boundaries, trainer.state.global_step)
        if self.save_total_limit is not None:
            io.prune(self.checkpoint_dir, self.save_total_limit, spare=self.resume_path)
        return path

    def _append_history(self, name: str, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The rows since the last save, appended (and fsync'd) before checkpoint ``name`` is written; its record."""
        try:
            return self.history.append(history)
        except OSError as error:
            cause, code = write_errors.describe(error, self.checkpoint_dir, len(encode_rows(history)))
            file = f"../{HISTORY_DIR}/{self.history.file or ''}"  # relative to the checkpoint, as errors name files
            raise CheckpointWriteError(self.checkpoint_dir / name, file, cause, code) from error
