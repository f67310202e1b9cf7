"""Checkpoint directories on disk: the layout, the atomic save and reading the files back.

Layout of ``checkpoint-N`` (N = completed boundaries)::

    metadata.json          progress, resolved config, model fingerprints, run identities, lineage,
                           and which rows of the run's history file are this checkpoint's
                           (:mod:`comlrl.checkpointing.history`; format 2 held them in ``history.json``)
    models/<name>.safetensors   the weights of every trained model (``trainer.checkpoint_modules()``)
    state.pt               ``trainer.state_dict()`` less its history: progress, optimizer-step components
                           (optimizer, LR schedule, pending gradients), RNG states, stateful user
                           objects, and trainer-specific state (PbRL pairs and reward model)
    manifest.json          every other file's size and sha256 (:mod:`comlrl.checkpointing.manifest`)
    COMPLETE               written last: the sha256 of manifest.json; a directory without it is never loaded

The save, step by step (``<pid>`` is the writing process):

1. assemble the files in ``.checkpoint-N.tmp-<pid>-*``, seal it (``manifest.json``, then ``COMPLETE``) and fsync
   every file and folder in it;
2. if ``checkpoint-N`` exists (a boundary saved again): rename it to ``.checkpoint-N.old-<pid>``;
3. rename the staging directory to ``checkpoint-N``;
4. delete ``.checkpoint-N.old-<pid>``.

A kill at any point leaves every other checkpoint intact; what it leaves of ``checkpoint-N`` is put
right when a run next starts in this directory (:mod:`comlrl.checkpointing.recovery`): a sealed staging
directory whose manifest verifies becomes ``checkpoint-N``, otherwise the ``.old`` copy is restored,
and unsealed staging directories are deleted. Every ``.pt`` file holds tensors and plain values only and
is read with ``torch.load(..., weights_only=True)``; a pickled object is refused, never loaded.

"latest" is the newest complete ``checkpoint-*`` at the top level of the directory. A run that starts
there first moves every checkpoint later than its starting point to ``abandoned/<attempt>/``
(:mod:`comlrl.checkpointing.lineage`), so "latest" is always a checkpoint of the run being continued.

Weights and optimizer states are always full (unsharded): sharded (FSDP) models arrive here
gathered by :func:`comlrl.parallel.sharding.gather_weights`, their optimizer states gathered by
:meth:`comlrl.training.optimizer_step.ModelOptimizer.state_dict`, and both load back through
:mod:`comlrl.parallel.sharding`, so a checkpoint does not depend on how many processes wrote or read it.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model

from comlrl.checkpointing import manifest, write_errors
from comlrl.checkpointing.manifest import COMPLETE_MARKER
from comlrl.errors import CheckpointError, CheckpointNotFoundError, CheckpointWriteError
from comlrl.parallel import sharding

FORMAT_VERSION = 3  # of the layout; a checkpoint of another format is refused, except:
LEGACY_FORMAT = 2  # the history in the checkpoint's own HISTORY_FILE rather than a shared file
READABLE_FORMATS = (LEGACY_FORMAT, FORMAT_VERSION)
CHECKPOINT_PREFIX = "checkpoint-"
METADATA_FILE = "metadata.json"
HISTORY_FILE = "history.json"  # format 2 only
STATE_FILE = "state.pt"
MODELS_DIR = "models"
WEIGHTS_SUFFIX = ".safetensors"

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


def weights_file(name: str) -> str:
    """The path, relative to a checkpoint, of model ``name``'s weights."""
    return f"{MODELS_DIR}/{name}{WEIGHTS_SUFFIX}"


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


# ----- reading ------------------------------------------------------------------------------------
def require_present(path: Path) -> None:
    """``path`` is a checkpoint directory whose save finished (it has ``COMPLETE`` and metadata)."""
    if not path.is_dir():
        raise CheckpointNotFoundError(path, None, "does not exist")
    if not (path / COMPLETE_MARKER).is_file():
        raise CheckpointError(path, None, f"is incomplete (no {COMPLETE_MARKER} marker: its save was interrupted); "
                              "it cannot be loaded")
    if not (path / METADATA_FILE).is_file():
        raise CheckpointError(path, METADATA_FILE, "is missing")


def read_json(directory: Path, name: str) -> Any:
    try:
        return json.loads((directory / name).read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(directory, name, "is missing") from None
    except UnicodeDecodeError as error:
        raise CheckpointError(directory, name, f"is not UTF-8 text ({error})") from None
    except json.JSONDecodeError as error:
        raise CheckpointError(directory, name, f"is not valid JSON ({error})") from None


def read_metadata(path: str | Path) -> dict[str, Any]:
    """``metadata.json`` of a finished checkpoint (checked against its manifest when it has one)."""
    path = Path(path)
    require_present(path)
    if manifest.is_sealed(path):
        manifest.verify_file(path, METADATA_FILE, manifest.read_manifest(path).get(METADATA_FILE))
    metadata = read_json(path, METADATA_FILE)
    if not isinstance(metadata, dict):
        raise CheckpointError(path, METADATA_FILE, f"holds a JSON {type(metadata).__name__}, not an object")
    return metadata


def load_pt(file: Path) -> Any:
    """A ``.pt`` file of tensors and plain values; anything else (a pickled object) is refused."""
    file = Path(file)
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(file.parent, file.name, "is missing") from None
    except Exception as error:  # torch raises many kinds on a damaged file (RuntimeError, EOFError, KeyError, ...)
        detail = _load_error_detail(error)
        if isinstance(error, pickle.UnpicklingError) and "GLOBAL" in detail:
            raise CheckpointError(file.parent, file.name, "holds pickled Python objects, which are never loaded "
                                  f"(only tensors and plain values are): {detail}") from None
        raise CheckpointError(file.parent, file.name, f"is not a readable torch file ({detail})") from None


def _load_error_detail(error: Exception) -> str:
    """The line of a ``torch.load`` error that says what is wrong (not its boilerplate about weights_only,
    whose numbered options suggest loading the file with ``weights_only=False``)."""
    boilerplate = ("In PyTorch 2.6", "This file can still be loaded", "Please file an issue", "Check the documentation",
                   "(1) ", "(2) ")
    lines = [line.strip().removeprefix("Weights only load failed.").strip() for line in str(error).splitlines()]
    lines = [line for line in lines if line and not line.startswith(boilerplate)]
    return f"{type(error).__name__}: {(lines[0] if lines else str(error))[:200]}"


def load_modules(path: Path, modules: dict[str, torch.nn.Module]) -> None:
    for name, module in modules.items():
        relative = weights_file(name)
        file = path / relative
        if not file.is_file():
            raise CheckpointError(path, relative, f"is missing: the checkpoint has no weights for {name!r}")
        try:
            if sharding.is_sharded(module):  # every rank joins; rank 0 reads
                sharding.load_model_state(module, lambda: load_file(str(file)))
            else:
                load_model(module, str(file), strict=True)
        except (RuntimeError, SafetensorError) as error:
            raise CheckpointError(path, relative, f"the weights for {name!r} do not fit the model: {error}") from None


# ----- writing ------------------------------------------------------------------------------------
def fsync_path(path: Path) -> None:
    """``path`` (a directory, or a file) on disk; nothing when it cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    """Every file and folder under ``directory``, and ``directory`` itself, on disk: a power loss after the
    rename into place must not leave a checkpoint whose names survived but whose bytes did not."""
    for path in sorted(directory.rglob("*"), reverse=True) + [directory]:
        fsync_path(path)


def save_state(state: dict[str, torch.Tensor], file: str) -> None:
    """A gathered state dict written as ``save_model`` writes its module: a tensor under several (tied)
    names is stored once, under the first name in sorted order, the others named in the metadata."""
    kept: dict[int, str] = {}
    for name in sorted(state):
        kept.setdefault(id(state[name]), name)
    dropped = {name: kept[id(tensor)] for name, tensor in state.items() if kept[id(tensor)] != name}
    save_file({name: state[name].contiguous() for name in kept.values()}, file, metadata=dropped or None)


def staging_prefix(name: str) -> str:
    """``.checkpoint-N.tmp-<pid>-``: a staging directory names its writer (see the recovery)."""
    return f".{name}.tmp-{os.getpid()}-"


def write_checkpoint(
    checkpoint_dir: str | Path,
    name: str,
    modules: dict[str, torch.nn.Module | dict[str, torch.Tensor]],
    state: dict[str, Any],
    metadata: dict[str, Any],
) -> Path:
    """Write the checkpoint directory ``name`` atomically (the sequence above) and return its path.

    ``modules`` holds modules, or the full state dicts gathered from sharded ones; ``state`` is the
    trainer's state dict (tensors and plain values) less its history, whose rows are already in the
    run's history file and named by ``metadata["history"]`` (:mod:`comlrl.checkpointing.history`).
    """
    root = Path(checkpoint_dir)
    final = root / name
    current = "the checkpoint directory"
    staging: Path | None = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=staging_prefix(final.name), dir=root))
        (staging / MODELS_DIR).mkdir()
        for model_name, module in modules.items():
            current = weights_file(model_name)
            if isinstance(module, torch.nn.Module):
                save_model(module, str(staging / current))
            else:
                save_state(module, str(staging / current))
        current = STATE_FILE
        torch.save(state, staging / STATE_FILE)
        current = METADATA_FILE
        (staging / METADATA_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True))
        current = "manifest.json and COMPLETE"
        manifest.seal(staging)
        fsync_tree(staging)
        current = "the directory (rename into place)"
        install(staging, final)
        fsync_path(root)
    except (OSError, RuntimeError, SafetensorError) as error:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if isinstance(error, RuntimeError) and not _looks_like_a_write_failure(error):
            raise
        needed = write_errors.tensor_bytes(modules) + write_errors.tensor_bytes(state)
        cause, code = write_errors.describe(error, root, needed)
        raise CheckpointWriteError(final, current, cause, code) from error
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def _looks_like_a_write_failure(error: RuntimeError) -> bool:
    """torch's serializer reports a failed write as a RuntimeError (``inline_container``, ``file write failed``)."""
    text = str(error)
    return any(mark in text for mark in ("inline_container", "unexpected pos", "write failed", "PytorchStreamWriter"))


def install(staging: Path, final: Path) -> None:
    """Steps 2-4 of the save: the sealed ``staging`` directory becomes ``final``; an existing ``final``
    is set aside as ``.<name>.old-<pid>`` until then (and put back if the rename fails)."""
    retired = final.parent / f".{final.name}.old-{os.getpid()}"
    if final.exists():
        os.replace(final, retired)
    try:
        os.replace(staging, final)
    except BaseException:
        if retired.exists() and not final.exists():
            os.replace(retired, final)
        raise
    shutil.rmtree(retired, ignore_errors=True)


def prune(checkpoint_dir: str | Path, keep: int, spare: str | Path | None = None) -> None:
    """Delete all but the newest ``keep`` complete checkpoints of ``checkpoint_dir``; ``spare`` (the
    checkpoint a run resumed from) is never deleted, even when it is older than those. Archived
    checkpoints (``abandoned/``, see :mod:`comlrl.checkpointing.lineage`) are not counted or touched."""
    spared = Path(spare).resolve() if spare is not None else None
    for old in list_checkpoints(checkpoint_dir)[:-keep]:
        if spared is not None and old.resolve() == spared:
            continue
        shutil.rmtree(old, ignore_errors=True)
