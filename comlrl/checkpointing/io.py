"""Checkpoint directories on disk, written atomically.

Layout of ``checkpoint-N`` (N = completed boundaries)::

    metadata.json          progress, resolved config, model fingerprints, run identities
    history.json           the per-step metrics so far
    models/<name>.safetensors   the weights of every trained model (``trainer.checkpoint_modules()``)
    state.pt               ``trainer.state_dict()`` less its history: progress, optimizer-step components
                           (optimizer, LR schedule, pending gradients), RNG states, stateful user
                           objects, and trainer-specific state (PbRL pairs and reward model)
    COMPLETE               written last; a directory without it is never loaded

A checkpoint is assembled in ``.checkpoint-N.tmp-*`` and renamed into place only once
complete, so a crash mid-save leaves every earlier checkpoint intact. Every ``.pt`` file
holds tensors and plain values only and is read with ``torch.load(..., weights_only=True)``.

Weights and optimizer states are always full (unsharded): sharded (FSDP) models arrive here
gathered by :func:`comlrl.parallel.sharding.gather_weights`, their optimizer states gathered by
:meth:`comlrl.training.optimizer_step.ModelOptimizer.state_dict`, and both load back through
:mod:`comlrl.parallel.sharding`, so a checkpoint does not depend on how many processes wrote or read it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from comlrl.parallel import sharding

CHECKPOINT_PREFIX = "checkpoint-"
COMPLETE_MARKER = "COMPLETE"
METADATA_FILE = "metadata.json"
HISTORY_FILE = "history.json"
STATE_FILE = "state.pt"


_NAME = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)(?:-step(\d+))?$")


def checkpoint_order(path: Path) -> tuple[int, int] | None:
    """Sort key of a checkpoint directory name, or None for anything else.

    ``checkpoint-N`` is saved at boundary N; ``checkpoint-N-stepS`` is a stop between
    boundaries N and N+1 at global step S, so it sorts after ``checkpoint-N``.
    """
    match = _NAME.match(path.name)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2)) if match.group(2) is not None else -1


def checkpoint_number(path: Path) -> int | None:
    order = checkpoint_order(path)
    return order[0] if order is not None else None


def is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file() and (path / METADATA_FILE).is_file()


def list_checkpoints(checkpoint_dir: str | Path) -> list[Path]:
    """Complete checkpoints in ``checkpoint_dir``, oldest first (partial ones are skipped)."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    found = [(checkpoint_order(p), p) for p in root.iterdir() if p.is_dir() and checkpoint_order(p) is not None]
    return [p for _, p in sorted(found) if is_complete(p)]


def latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    complete = list_checkpoints(checkpoint_dir)
    return complete[-1] if complete else None


def read_metadata(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    if not is_complete(path):
        raise ValueError(f"checkpoint {str(path)!r} is incomplete (no {COMPLETE_MARKER} marker); it cannot be loaded")
    return json.loads((path / METADATA_FILE).read_text())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_state(state: dict[str, torch.Tensor], file: str) -> None:
    """A gathered state dict written as ``save_model`` writes its module: a tensor under several (tied)
    names is stored once, under the first name in sorted order, the others named in the metadata."""
    kept: dict[int, str] = {}
    for name in sorted(state):
        kept.setdefault(id(state[name]), name)
    dropped = {name: kept[id(tensor)] for name, tensor in state.items() if kept[id(tensor)] != name}
    save_file({name: state[name].contiguous() for name in kept.values()}, file, metadata=dropped or None)


def write_checkpoint(
    checkpoint_dir: str | Path,
    name: str,
    modules: dict[str, torch.nn.Module | dict[str, torch.Tensor]],
    state: dict[str, Any],
    metadata: dict[str, Any],
    history: list[dict[str, Any]] | None = None,
) -> Path:
    """Write the checkpoint directory ``name`` atomically and return its path.

    ``modules`` holds modules, or the full state dicts gathered from sharded ones; ``state`` is the
    trainer's state dict (tensors and plain values).
    """
    root = Path(checkpoint_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        (staging / "models").mkdir()
        for name, module in modules.items():
            file = str(staging / "models" / f"{name}.safetensors")
            if isinstance(module, torch.nn.Module):
                save_model(module, file)
            else:
                save_state(module, file)
        torch.save(state, staging / STATE_FILE)
        (staging / HISTORY_FILE).write_text(json.dumps(history or []))
        (staging / METADATA_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True))
        (staging / COMPLETE_MARKER).write_text("ok\n")
        _fsync_dir(staging)
        if final.exists():
            # Re-saving a boundary (e.g. after a resume that repeated work): swap atomically.
            retired = root / f".{final.name}.old-{os.getpid()}"
            os.replace(final, retired)
            os.replace(staging, final)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def load_modules(path: Path, modules: dict[str, torch.nn.Module]) -> None:
    for name, module in modules.items():
        file = path / "models" / f"{name}.safetensors"
        if not file.is_file():
            raise ValueError(f"checkpoint {str(path)!r} has no weights for {name!r}")
        try:
            if sharding.is_sharded(module):  # every rank joins; rank 0 reads
                sharding.load_model_state(module, lambda: load_file(str(file)))
            else:
                load_model(module, str(file), strict=True)
        except RuntimeError as error:
            raise ValueError(f"checkpoint weights for {name!r} do not fit the model: {error}") from None


def load_pt(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def prune(checkpoint_dir: str | Path, keep: int, spare: str | Path | None = None) -> None:
    """Delete all but the newest ``keep`` complete checkpoints; ``spare`` (the checkpoint a run
    resumed from) is never deleted, even when it is older than those."""
    spared = Path(spare).resolve() if spare is not None else None
    for old in list_checkpoints(checkpoint_dir)[:-keep]:
        if spared is not None and old.resolve() == spared:
            continue
        shutil.rmtree(old, ignore_errors=True)
