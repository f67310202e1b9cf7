"""Which checkpoints continue the run, and where the others go.

Every ``train()`` call is a run attempt with its own id. Each checkpoint it writes records
``lineage = {"attempt": id, "ancestors": [older attempts], "resumed_from": name or null}``.

"latest" is the newest complete checkpoint at the top level of ``checkpoint_dir``. So that it is
always the newest checkpoint of the run being continued, a run first archives every top-level
checkpoint later than where it starts (the checkpoint it resumed from, or its own progress for a
run that did not resume): they move to ``abandoned/<attempt that wrote them>/`` and are never deleted
(nor counted or pruned by ``checkpoint_total_limit``). A resume from ``checkpoint-3`` while
``checkpoint-4`` ... ``checkpoint-10`` of an earlier attempt exist therefore moves those seven away
before training starts, and every later "latest" is a checkpoint of the resumed run.

The moves are journalled: ``.archive.json`` lists them all before the first is made and is removed
after the last, and a run starting in the directory completes an unfinished journal
(:func:`finish_archive`) before it picks "latest".
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from comlrl.checkpointing import io
from comlrl.errors import CheckpointError

logger = logging.getLogger(__name__)

ARCHIVE_DIR = "abandoned"
JOURNAL_FILE = ".archive.json"
UNRECORDED = "unrecorded"  # the archive folder of checkpoints saved before lineage was recorded
_ATTEMPT = re.compile(r"[0-9A-Za-z][0-9A-Za-z_-]{0,63}")  # fullmatch: "$" would let a final newline in


def new_attempt() -> str:
    """A run attempt's id: when it started (UTC) and a random part, e.g. ``20250101T120000Z-1a2b3c4d``."""
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:8]}"


def record(attempt: str, resumed_from: Path | None, parent: dict[str, Any] | None) -> dict[str, Any]:
    """The ``lineage`` of a checkpoint written by ``attempt``, which resumed from ``resumed_from``
    (whose own lineage is ``parent``; None for a fresh run or a checkpoint saved before lineage)."""
    ancestors = [*parent["ancestors"], parent["attempt"]] if parent else []
    return {"attempt": attempt, "ancestors": ancestors,
            "resumed_from": resumed_from.name if resumed_from is not None else None}


def check_record(lineage: Any, fail: Callable[[str], None]) -> None:
    """A ``lineage`` record as :func:`record` writes it (the ids are used as folder names)."""
    if not isinstance(lineage, dict) or set(lineage) != {"attempt", "ancestors", "resumed_from"}:
        fail(f"lineage must be an object with exactly attempt, ancestors and resumed_from, got {lineage!r}"[:300])
    ids = [lineage["attempt"], *(lineage["ancestors"] if isinstance(lineage["ancestors"], list) else [None])]
    for value in ids:
        if not isinstance(value, str) or not _ATTEMPT.fullmatch(value):
            fail(f"lineage holds an invalid attempt id {value!r} (letters, digits, '-' and '_')")
    if lineage["resumed_from"] is not None and not isinstance(lineage["resumed_from"], str):
        fail(f"lineage.resumed_from is {lineage['resumed_from']!r}, expected a checkpoint name or null")


def attempt_of(checkpoint: Path) -> str:
    """The attempt that wrote ``checkpoint``, or ``unrecorded`` when its metadata does not say."""
    try:
        attempt = json.loads((checkpoint / io.METADATA_FILE).read_text())["lineage"]["attempt"]
    except (OSError, ValueError, KeyError, TypeError):
        return UNRECORDED
    return attempt if isinstance(attempt, str) and _ATTEMPT.fullmatch(attempt) else UNRECORDED


def later_checkpoints(checkpoint_dir: Path, position: tuple[int, int]) -> list[Path]:
    """Top-level complete checkpoints that sort after ``position`` (a ``checkpoint_order`` key)."""
    return [p for p in io.list_checkpoints(checkpoint_dir) if io.checkpoint_order(p) > position]


def archive_later(checkpoint_dir: Path, position: tuple[int, int]) -> list[tuple[str, str]]:
    """Move every checkpoint later than ``position`` to ``abandoned/<attempt>/`` (journalled);
    returns the moves as (name, destination relative to ``checkpoint_dir``)."""
    later = later_checkpoints(checkpoint_dir, position)
    if not later:
        return []
    for place in [checkpoint_dir / ARCHIVE_DIR, *(checkpoint_dir / ARCHIVE_DIR).glob("*")]:
        if place.is_symlink():  # it would move this run's checkpoints somewhere else
            raise CheckpointError(checkpoint_dir, place.relative_to(checkpoint_dir).as_posix(),
                                  f"is a symbolic link (to {os.readlink(place)!r}); the archive of abandoned "
                                  "checkpoints must lie inside the checkpoint directory")
    moves: list[tuple[str, str]] = []
    for checkpoint in later:
        folder = Path(ARCHIVE_DIR) / attempt_of(checkpoint)
        destination, number = folder / checkpoint.name, 1
        while (checkpoint_dir / destination).exists() or destination.as_posix() in {d for _, d in moves}:
            number += 1
            destination = folder / f"{checkpoint.name}.{number}"
        moves.append((checkpoint.name, destination.as_posix()))
    journal = checkpoint_dir / JOURNAL_FILE
    staged = journal.with_name(journal.name + ".tmp")
    staged.write_text(json.dumps({"moves": moves}, indent=1))
    os.replace(staged, journal)
    _apply(checkpoint_dir, moves)
    journal.unlink()
    logger.warning("moved %d checkpoint(s) later than the starting point of this run to %s/: %s",
                   len(moves), checkpoint_dir / ARCHIVE_DIR, ", ".join(f"{n} -> {d}" for n, d in moves))
    return moves


def _apply(checkpoint_dir: Path, moves: list[tuple[str, str]]) -> None:
    for name, destination in moves:
        source, target = checkpoint_dir / name, checkpoint_dir / destination
        if source.exists() and not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(source, target)


def finish_archive(checkpoint_dir: Path) -> list[tuple[str, str]]:
    """Complete the moves of a journal that a killed run left; returns them (empty when there was none)."""
    journal = checkpoint_dir / JOURNAL_FILE
    journal.with_name(journal.name + ".tmp").unlink(missing_ok=True)  # never applied: nothing was moved
    if not journal.exists():
        return []
    try:
        moves = [(str(name), str(destination)) for name, destination in json.loads(journal.read_text())["moves"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.error("ignoring the unreadable archive journal %s (%s)", journal, error)
        return []
    for name, destination in moves:  # a journal names top-level checkpoints and places under abandoned/ only
        if io.checkpoint_order(Path(name)) is None or Path(name).name != name or not destination.startswith(
                f"{ARCHIVE_DIR}/") or ".." in destination.split("/"):
            logger.error("ignoring the archive journal %s: it holds the move %r -> %r", journal, name, destination)
            return []
    _apply(checkpoint_dir, moves)
    journal.unlink()
    logger.warning("completed an interrupted archive in %s: %s", checkpoint_dir,
                   ", ".join(f"{n} -> {d}" for n, d in moves))
    return moves
