"""Is a checkpoint whole and sound? Checked completely before anything is loaded into a trainer.

:func:`read_checkpoint` reads every file of a checkpoint once and checks, in this order:

1. presence: the directory, ``COMPLETE`` and ``metadata.json``;
2. the seal (:mod:`comlrl.checkpointing.manifest`): ``COMPLETE`` matches ``manifest.json``, every
   listed file has its recorded size and sha256, and no other file is present. A checkpoint without
   ``manifest.json`` whose metadata does not claim one (saved before manifests existed) is accepted
   with a warning, and every check below still applies to it;
3. ``metadata.json``: its schema (keys, types, non-negative counts) and its consistency: the boundary
   equals the progress's, the directory name ``checkpoint-N[-stepS]`` matches them, the progress fits
   its boundary kind, and the models listed are exactly the weight files present;
4. the history: the rows ``metadata.json``'s ``history`` record names in the run's history file
   (:mod:`comlrl.checkpointing.history`: their size and sha256), or a format-2 checkpoint's
   ``history.json``: one metric row per completed step, numbered 1, 2, ...;
5. every weight file: readable safetensors holding the tensors of the metadata's fingerprint, all finite;
6. ``state.pt``: tensors and plain values only, a progress equal to the metadata's, every tensor
   finite (except pending gradients: a window's NaN/inf gradient is saved as it was, and the optimizer
   step that uses it is skipped and counted, as it would have been without the stop).

:func:`check_state_structure` then compares ``state.pt`` with the resuming trainer's own
``state_dict()``: every key its ``load_state_dict`` reads, with the same kind of value.
Every failure is a :class:`~comlrl.errors.CheckpointError` naming the checkpoint, the file and the problem.
"""

from __future__ import annotations

import dataclasses
import json
import os
import logging
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError, safe_open

from comlrl.checkpointing import history as history_log
from comlrl.checkpointing import io, lineage, manifest
from comlrl.errors import CheckpointError
from comlrl.progress import TrainerState

logger = logging.getLogger(__name__)

# metadata.json: key -> allowed types (None: JSON null). "manifest" and "lineage" are written since
# checkpoints carry a manifest; a checkpoint without them is an older one.
METADATA_FIELDS: dict[str, tuple[Any, ...]] = {
    "format_version": (int,), "library_version": (str,), "trainer": (str,), "boundary": (int,),
    "boundary_kind": (str,), "state": (dict,), "config": (dict,), "compat": (dict,), "models": (dict,),
    "wandb": (dict, None), "mlflow": (dict, None),
}
SEALED_FIELDS: dict[str, tuple[Any, ...]] = {"manifest": (bool,), "lineage": (dict,)}
# state.pt keys whose value is a table of the user's or torch's choosing, not a fixed structure: user
# objects' states, and torch's LR-schedule state (whose field types vary by torch version and setting).
OPEN_KEYS = {"stateful", "scheduler"}
# torch optimizer states: checked for what torch's load_state_dict relies on (see _match_optimizer).
OPTIMIZER_KEY = "optimizer"
# state.pt keys that load_state_dict reads as optional.
OPTIONAL_KEYS = {"per_sample", "scheduler", "rng"}


@dataclass
class CheckpointContents:
    """A checkpoint's files, read and checked: what a resume loads."""

    path: Path
    metadata: dict[str, Any]
    history: list[dict[str, Any]]
    state: dict[str, Any]


def read_checkpoint(path: str | Path, trainer: Any = None) -> CheckpointContents:
    """Check ``path`` completely (steps 1-6 above) and return its contents.

    With ``trainer``, the progress must have exactly the fields of ``type(trainer.state)`` and the
    checkpoint must have been written by the trainer's class.
    """
    path = Path(path)
    io.require_present(path)
    check_no_links(path)
    sealed = manifest.is_sealed(path)
    if sealed:
        manifest.verify(path)
    metadata = io.read_metadata(path)
    check_metadata(path, metadata, sealed, trainer)
    history, history_file = history_log.read(path, metadata)
    check_history(path, history, metadata, history_file)
    check_layout(path, metadata)
    for name, fingerprint in metadata["models"].items():
        check_weights(path, io.weights_file(name), fingerprint)
    state = io.load_pt(path / io.STATE_FILE)
    check_state(path, state, metadata, trainer)
    return CheckpointContents(path, metadata, history, state)


# ----- values -------------------------------------------------------------------------------------
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fits(value: Any, allowed: tuple[Any, ...]) -> bool:
    """``value`` is one of ``allowed``: None (JSON null), int (not a bool), float (or an int), or a type."""
    for kind in allowed:
        if kind is None:
            fits = value is None
        elif kind is int:
            fits = _is_int(value)
        elif kind is float:
            fits = isinstance(value, float) or _is_int(value)
        else:
            fits = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        if fits:
            return True
    return False


def _kind_names(allowed: tuple[Any, ...]) -> str:
    names = {None: "null", int: "an integer", float: "a number", str: "a string", dict: "an object", bool: "true/false",
             list: "a list"}
    return " or ".join(names.get(kind, getattr(kind, "__name__", str(kind))) for kind in allowed)


def _shown(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


# ----- metadata.json ------------------------------------------------------------------------------
def check_metadata(path: Path, metadata: dict[str, Any], sealed: bool, trainer: Any = None) -> None:
    fail = _failing(path, io.METADATA_FILE)
    if metadata.get("format_version") not in io.READABLE_FORMATS:
        fail(f"format_version is {_shown(metadata.get('format_version'))}, not this library's format "
             f"{io.FORMAT_VERSION} (or the earlier {io.LEGACY_FORMAT}); start a new run from the exported models "
             "instead")
    claims_manifest = metadata.get("manifest") is True
    if claims_manifest and not sealed:
        raise CheckpointError(path, manifest.MANIFEST_FILE, "is missing (metadata.json says the checkpoint was "
                              "saved with one)")
    if not sealed:
        logger.warning("checkpoint %r has no %s (saved before checkpoints carried one): its files' sizes and "
                       "checksums cannot be verified; every other check still applies", str(path),
                       manifest.MANIFEST_FILE)
    history_field = {history_log.RECORD_KEY: (dict,)} if metadata["format_version"] == io.FORMAT_VERSION else {}
    required = {**METADATA_FIELDS, **(SEALED_FIELDS if sealed else {}), **history_field}
    known = {**METADATA_FIELDS, **SEALED_FIELDS, **history_field}
    for key in sorted(metadata):
        if key not in known:
            fail(f"unknown key {key!r} (known: {', '.join(sorted(known))})")
    for key, allowed in required.items():
        if key not in metadata:
            fail(f"missing key {key!r}")
    for key, allowed in known.items():
        if key in metadata and not _fits(metadata[key], allowed):
            fail(f"{key} is {_shown(metadata[key])}, expected {_kind_names(allowed)}")
    if trainer is not None and metadata["trainer"] != type(trainer).__name__:
        fail(f"it was written by {metadata['trainer']}, not {type(trainer).__name__}")
    if metadata["boundary"] < 0:
        fail(f"boundary is {metadata['boundary']}, expected a non-negative integer")
    if "lineage" in metadata:
        lineage.check_record(metadata["lineage"], fail)
    if history_field:
        history_log.check_record(metadata[history_log.RECORD_KEY], fail)
    check_models_record(metadata["models"], fail)
    check_progress(metadata["state"], progress_fields(trainer), fail, "state", exact=trainer is not None)
    check_progress_consistency(path, metadata, fail, trainer)


def check_models_record(models: dict[str, Any], fail: Callable[[str], None]) -> None:
    if not models:
        fail("models is empty: a checkpoint holds at least one model")
    for name, fingerprint in models.items():
        if not name or "/" in name or name.startswith("."):
            fail(f"models has an invalid model name {name!r}")
        shapes = fingerprint.get("shapes") if isinstance(fingerprint, dict) else None
        if (not isinstance(fingerprint, dict) or not isinstance(fingerprint.get("class"), str)
                or not isinstance(shapes, dict) or fingerprint.get("num_tensors") != len(shapes)):
            fail(f"models.{name} is not a fingerprint {{class, num_tensors, shapes}} with num_tensors = "
                 f"the number of shapes: {_shown(fingerprint)}")
        for tensor, shape in shapes.items():
            if not isinstance(shape, list) or not all(_is_int(size) and size >= 0 for size in shape):
                fail(f"models.{name}.shapes[{tensor!r}] is {_shown(shape)}, expected a list of sizes")
        dtypes = fingerprint.get("dtypes")
        if dtypes is not None and (not isinstance(dtypes, dict) or set(dtypes) != set(shapes)
                                   or not all(isinstance(d, str) and isinstance(getattr(torch, d, None), torch.dtype)
                                              for d in dtypes.values())):
            fail(f"models.{name}.dtypes is {_shown(dtypes)}, expected a torch dtype name for every tensor of shapes")


def progress_fields(trainer: Any = None) -> dict[str, type]:
    """The progress fields (less ``history``) and their kind (int or list): those of ``type(trainer.state)``."""
    cls = type(trainer.state) if trainer is not None and dataclasses.is_dataclass(trainer.state) else TrainerState
    hints = typing.get_type_hints(cls)
    return {f.name: typing.get_origin(hints[f.name]) or hints[f.name]
            for f in dataclasses.fields(cls) if f.name != "history"}


# Progress fields added after checkpoints of this format were first written: one without them holds the
# value given here (a checkpoint written before it existed has no evaluation left to make).
LATER_PROGRESS_FIELDS = {"pending_evaluation": 0}


def check_progress(progress: Any, fields: dict[str, type], fail: Callable[[str], None], where: str,
                   exact: bool = True) -> None:
    """A progress record: every field of its dataclass (counts non-negative; one of ``LATER_PROGRESS_FIELDS``
    may be absent), and no other (with ``exact``)."""
    if not isinstance(progress, dict):
        fail(f"{where} is {_shown(progress)}, expected an object")
    for key in progress:
        if key not in fields and (exact or not (_is_int(progress[key]) or isinstance(progress[key], list))):
            fail(f"{where} has an unknown field {key!r} (fields: {', '.join(fields)})")
    for key, kind in fields.items():
        if key not in progress:
            if key in LATER_PROGRESS_FIELDS:
                continue
            fail(f"{where} is missing the field {key!r}")
        value = progress[key]
        if kind is int and not (_is_int(value) and value >= 0):
            fail(f"{where}.{key} is {_shown(value)}, expected a non-negative integer")
        if kind is list and not (isinstance(value, list) and all(isinstance(item, dict) for item in value)):
            fail(f"{where}.{key} is {_shown(value)}, expected a list of objects")


def check_progress_consistency(path: Path, metadata: dict[str, Any], fail: Callable[[str], None],
                               trainer: Any = None) -> None:
    """The boundary, the progress, the directory name and the run's planned length agree (for a
    preference run, given its ``trainer``: boundaries = iteration x stages per iteration + stage)."""
    state, kind = metadata["state"], metadata["boundary_kind"]
    if metadata["boundary"] != state["boundaries"]:
        fail(f"boundary is {metadata['boundary']} but state.boundaries is {state['boundaries']}")
    order = io.checkpoint_order(path)
    if order is not None and order[0] != state["boundaries"]:
        fail(f"the directory is named for boundary {order[0]} but the checkpoint is at boundary {state['boundaries']}")
    if order is not None and order[1] >= 0 and order[1] != state["global_step"]:
        fail(f"the directory is named for step {order[1]} but state.global_step is {state['global_step']}")
    if state["consecutive_nonfinite"] > state["nonfinite_updates"]:
        fail(f"state.consecutive_nonfinite ({state['consecutive_nonfinite']}) exceeds state.nonfinite_updates "
             f"({state['nonfinite_updates']})")
    if kind == "epoch":
        if state["boundaries"] != state["epoch"]:
            fail(f"state.boundaries is {state['boundaries']} but an epoch checkpoint has boundaries = epoch "
                 f"({state['epoch']})")
        planned = metadata["config"].get("num_train_epochs")
        if _is_int(planned) and state["epoch"] > planned:
            fail(f"state.epoch is {state['epoch']}, beyond the run's planned num_train_epochs={planned}")
        if state["step_in_epoch"] > state["global_step"]:
            fail(f"state.step_in_epoch ({state['step_in_epoch']}) exceeds state.global_step ({state['global_step']})")
    elif kind == "pbrl_stage" and getattr(trainer, "STAGES", None):
        stages = len(trainer.STAGES)
        if not (_is_int(state.get("stage")) and _is_int(state.get("iteration")) and state["stage"] <= stages
                and state["boundaries"] == state["iteration"] * stages + state["stage"]):
            fail(f"state.boundaries ({state['boundaries']}) is not iteration x {stages} + stage "
                 f"(iteration {_shown(state.get('iteration'))}, stage {_shown(state.get('stage'))})")


# ----- history -------------------------------------------------------------------------------------
def check_history(path: Path, history: Any, metadata: dict[str, Any], file: str = io.HISTORY_FILE) -> None:
    """One row per completed step, numbered 1, 2, ... (a preference run's history also holds the
    policy steps of a stage in progress, ahead of its global_step); ``file`` is where the rows came from."""
    fail = _failing(path, file)
    if not isinstance(history, list) or not all(isinstance(row, dict) for row in history):
        fail(f"holds {_shown(history)}, expected a list of metric rows (objects)")
    for index, row in enumerate(history):
        if "step" in row and row["step"] != index + 1:
            fail(f"row {index} has step {_shown(row['step'])}, expected {index + 1}")
    steps, kind = metadata["state"]["global_step"], metadata["boundary_kind"]
    if kind == "epoch" and len(history) != steps:
        fail(f"has {len(history)} rows but metadata.json's state.global_step is {steps} (one row per step)")
    if kind == "pbrl_stage" and len(history) < steps:
        fail(f"has {len(history)} rows, fewer than metadata.json's state.global_step ({steps})")


# ----- files --------------------------------------------------------------------------------------
def check_no_links(path: Path) -> None:
    """A checkpoint's files are its own: neither the directory nor anything in it is a symbolic link
    (a link could lend another run's weights to this one's optimizer state)."""
    if path.is_symlink():
        raise CheckpointError(path, None, f"is a symbolic link (to {os.readlink(path)!r}); a checkpoint must be a "
                              "directory of its own")
    for entry in sorted(path.rglob("*")):
        if entry.is_symlink():
            raise CheckpointError(path, entry.relative_to(path).as_posix(),
                                  f"is a symbolic link (to {os.readlink(entry)!r}); a checkpoint's files must be its own")


def check_layout(path: Path, metadata: dict[str, Any]) -> None:
    """The files present are exactly the layout's: the weights of the models listed, nothing else."""
    expected = {io.METADATA_FILE, io.STATE_FILE} | {io.weights_file(n) for n in metadata["models"]}
    if metadata["format_version"] == io.LEGACY_FORMAT:
        expected.add(io.HISTORY_FILE)
    present = set(manifest.checkpoint_files(path))
    for name in sorted(expected - present):
        raise CheckpointError(path, name, f"is missing (metadata.json lists models {sorted(metadata['models'])})"
                              if name.startswith(io.MODELS_DIR) else "is missing")
    for name in sorted(present - expected):
        raise CheckpointError(path, name, "is not part of a checkpoint (metadata.json lists models "
                              f"{sorted(metadata['models'])}; a checkpoint holds only {', '.join(sorted(expected))})")


def check_weights(path: Path, relative: str, fingerprint: dict[str, Any]) -> None:
    """Readable safetensors with the fingerprint's tensors (tied names as aliases) at its shapes, all finite."""
    fail = _failing(path, relative)
    shapes = fingerprint["shapes"]
    try:
        with safe_open(str(path / relative), framework="pt") as handle:
            names = set(handle.keys())
            aliases = {key: target for key, target in (handle.metadata() or {}).items() if key in shapes}
            for name in sorted(names):
                if name not in shapes:
                    fail(f"holds tensor {name!r}, which metadata.json's models fingerprint does not list")
                tensor = handle.get_tensor(name)
                if list(tensor.shape) != shapes[name]:
                    fail(f"tensor {name!r} has shape {list(tensor.shape)} but metadata.json records {shapes[name]}")
                dtype = fingerprint.get("dtypes", {}).get(name)
                if dtype is not None and str(tensor.dtype).removeprefix("torch.") != dtype:
                    fail(f"tensor {name!r} is {str(tensor.dtype).removeprefix('torch.')} but metadata.json records "
                         f"{dtype}")
                if not all_finite(tensor):
                    fail(f"tensor {name!r} holds NaN or infinite values")
    except (SafetensorError, OSError, RuntimeError, ValueError) as error:
        if isinstance(error, CheckpointError):
            raise
        fail(f"is not a readable safetensors file ({error})")
    for name in sorted(set(shapes) - names):
        if aliases.get(name) not in names:
            fail(f"has no tensor {name!r} (listed in metadata.json's models fingerprint)")


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or inf in ``tensor``. Its sum in float64 is finite exactly then (weights' values cannot
    overflow it), and it is ~10x faster than ``isfinite(tensor).all()`` on large tensors."""
    if not tensor.is_floating_point():
        return True
    try:
        return bool(torch.isfinite(tensor.sum(dtype=torch.float64)))
    except (RuntimeError, TypeError):  # a dtype without a float64 sum
        return bool(torch.isfinite(tensor).all())


def _tensors(value: Any, where: str = "") -> typing.Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield where, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors(item, f"{where}[{index}]")


def check_state(path: Path, state: Any, metadata: dict[str, Any], trainer: Any = None) -> None:
    """``state.pt``: an object with a progress equal to metadata.json's, every tensor finite."""
    fail = _failing(path, io.STATE_FILE)
    if not isinstance(state, dict) or not all(isinstance(key, str) for key in state):
        fail(f"holds {type(state).__name__}, expected a dict of named states")
    if "progress" not in state:
        fail("has no 'progress'")
    saved, recorded = state["progress"], metadata["state"]
    check_progress(saved, progress_fields(trainer), fail, "progress", exact=trainer is not None)
    differing = sorted(k for k in set(saved) | set(recorded) if _canonical(saved.get(k)) != _canonical(recorded.get(k)))
    if differing:
        fail(f"its progress differs from metadata.json's state in {differing}: "
             + ", ".join(f"{k} {_shown(saved.get(k))} here, {_shown(recorded.get(k))} there" for k in differing))
    for where, tensor in _tensors(state):
        if "pending_grads" in where.split("."):
            continue
        if not all_finite(tensor):
            fail(f"{where} holds NaN or infinite values")


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


# ----- state.pt against the trainer ---------------------------------------------------------------
def check_state_structure(contents: CheckpointContents, trainer: Any) -> None:
    """Every key of ``trainer.state_dict()`` that ``load_state_dict`` reads is in ``state.pt``, with the
    same kind of value (a table, a list, a tensor of the same kind, an integer, a string, ...)."""
    template = trainer.state_dict()
    template.pop("progress", None)  # checked against the progress fields already
    if "rng" in template and isinstance(contents.state, dict) and "rng" not in contents.state:
        _failing(contents.path, io.STATE_FILE)("has no 'rng' (the RNG states): resumed without them the run would "
                                               "not continue as it would have")
    _match(contents.state, template, "", _failing(contents.path, io.STATE_FILE))


def _match(saved: Any, template: Any, where: str, fail: Callable[[str], None]) -> None:
    label = where or "the top level"
    if template is None:
        return
    if isinstance(template, dict):
        if saved is None:
            return  # an optional part (a schedule, a reward model) absent in the saved run
        if not isinstance(saved, dict):
            fail(f"{label} is {_shown(saved)}, expected a table")
        if where.rsplit(".", 1)[-1] == OPTIMIZER_KEY:
            return _match_optimizer(saved, template, label, fail)
        if where.rsplit(".", 1)[-1] in OPEN_KEYS or not template or not all(isinstance(k, str) for k in template):
            return
        for key, expected in template.items():
            path = f"{where}.{key}" if where else key
            if key not in saved:
                if key in OPTIONAL_KEYS:
                    continue
                fail(f"{path} is missing")
            _match(saved[key], expected, path, fail)
        if where.rsplit(".", 1)[-1] == "progress":
            extra = sorted(set(saved) - set(template))
            if extra:
                fail(f"{label} has unknown fields {extra}")
        return
    if isinstance(template, (list, tuple)):
        if not isinstance(saved, (list, tuple)):
            fail(f"{label} is {_shown(saved)}, expected a list")
        if template and all(isinstance(item, dict) for item in template):
            for index, item in enumerate(saved):
                _match(item, template[0], f"{where}[{index}]", fail)
        return
    if isinstance(template, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            fail(f"{label} is {_shown(saved)}, expected a tensor")
        if template.is_floating_point() != saved.is_floating_point() or (
                not template.is_floating_point() and template.dtype != saved.dtype):
            fail(f"{label} is a {saved.dtype} tensor, expected {template.dtype}")
        return
    kinds: tuple[Any, ...] = (bool,) if isinstance(template, bool) else (int,) if _is_int(template) else (
        (float, None) if isinstance(template, float) else (type(template),))
    if not _fits(saved, kinds):
        fail(f"{label} is {_shown(saved)}, expected {_kind_names(kinds)}")


def _match_optimizer(saved: dict[str, Any], template: dict[str, Any], label: str,
                     fail: Callable[[str], None]) -> None:
    """A torch optimizer state: per-parameter slots and parameter groups holding as many parameters
    as this run's optimizer (their hyperparameters' types vary with torch's settings, e.g. ``fused``)."""
    if not isinstance(saved.get("state"), dict) or not isinstance(saved.get("param_groups"), list):
        fail(f"{label} is not a torch optimizer state (a table with 'state' and 'param_groups')")
    groups, expected = saved["param_groups"], template.get("param_groups") or []
    sizes = [len(g["params"]) if isinstance(g, dict) and isinstance(g.get("params"), list) else None for g in groups]
    expected_sizes = [len(group["params"]) for group in expected]
    if expected and sizes != expected_sizes:  # (under FSDP only rank 0 holds the gathered groups)
        fail(f"{label} has parameter groups of sizes {sizes}, but this run's optimizer has {expected_sizes}")


def _failing(path: Path, file: str) -> Callable[[str], typing.NoReturn]:
    def fail(problem: str) -> typing.NoReturn:
        raise CheckpointError(path, file, problem)

    return fail
