"""Putting a checkpoint directory right after a killed save or archive, before a run picks "latest".

:func:`recover` runs when a run starts with a ``checkpoint_dir`` (in the process that writes
checkpoints, before the others look), and only there: a directory is recovered by the run that is
about to write into it. It

1. completes an unfinished archive journal (:func:`comlrl.checkpointing.lineage.finish_archive`);
2. settles every checkpoint name with leftovers of the save sequence (:mod:`comlrl.checkpointing.io`):

   - the newest sealed staging directory ``.checkpoint-N.tmp-*`` whose manifest verifies becomes
     ``checkpoint-N`` (its save had written everything; only the renames were cut short);
   - otherwise, if ``checkpoint-N`` is missing, the newest complete ``.checkpoint-N.old-*`` is put back;
   - every other leftover of that name is deleted: unfinished staging directories of killed saves,
     and ``.old`` copies that a finished save had replaced.

Leftovers whose writing process is still alive on this machine are left alone. Several runs
writing into one ``checkpoint_dir`` at once are not supported.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from comlrl.checkpointing import io, lineage, manifest
from comlrl.errors import CheckpointError

logger = logging.getLogger(__name__)

_LEFTOVER = re.compile(rf"^\.({io.CHECKPOINT_PREFIX}\d+(?:-step\d+)?)\.(tmp|old)-(.*)$")
_WRITER = re.compile(r"^(\d+)(?:-|$)")


def recover(checkpoint_dir: str | Path) -> list[str]:
    """Settle ``checkpoint_dir`` (steps 1-2 above); returns what was done, one line each (also logged)."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    actions = [f"archived {name} -> {destination} (an interrupted archive)"
               for name, destination in lineage.finish_archive(root)]
    leftovers: dict[str, dict[str, list[Path]]] = {}
    for entry in sorted(root.iterdir()):
        match = _LEFTOVER.match(entry.name)
        if match and entry.is_dir() and not _writer_alive(match.group(3)):
            leftovers.setdefault(match.group(1), {"tmp": [], "old": []})[match.group(2)].append(entry)
    for name, found in sorted(leftovers.items()):
        actions += _settle(root / name, found["tmp"], found["old"])
    for action in actions:
        logger.warning("checkpoint recovery in %s: %s", root, action)
    return actions


def _settle(final: Path, staged: list[Path], retired: list[Path]) -> list[str]:
    verified = [path for path in _newest_first(staged) if _verifies(path)]
    actions = []
    if verified:
        winner = verified[0]
        for path in [p for p in staged if p != winner] + retired:
            shutil.rmtree(path, ignore_errors=True)
            actions.append(f"removed {path.name}")
        io.install(winner, final)
        actions.append(f"{final.name} is the finished save {winner.name} (its renames had been cut short)")
        return actions
    if not final.exists():
        restorable = [path for path in _newest_first(retired) if io.is_complete(path)]
        if restorable:
            os.replace(restorable[0], final)
            retired = [path for path in retired if path != restorable[0]]
            actions.append(f"{final.name} restored from {restorable[0].name} (its replacement was never finished)")
    for path in staged + retired:
        shutil.rmtree(path, ignore_errors=True)
        actions.append(f"removed {path.name}")
    return actions


def _newest_first(paths: list[Path]) -> list[Path]:
    return sorted(paths, key=lambda path: path.stat().st_mtime_ns, reverse=True)


def _verifies(staging: Path) -> bool:
    """A staging directory whose save finished: complete, sealed, and its manifest verifies."""
    if not (io.is_complete(staging) and manifest.is_sealed(staging)):
        return False
    try:
        manifest.verify(staging)
    except (CheckpointError, OSError):
        return False
    return True


def _writer_alive(suffix: str) -> bool:
    """Whether the process named in a leftover's suffix (``<pid>-...`` or ``<pid>``) still runs here."""
    match = _WRITER.match(suffix)
    if match is None or int(match.group(1)) == os.getpid():  # no writer named, or this process (not saving now)
        return False
    try:
        os.kill(int(match.group(1)), 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
