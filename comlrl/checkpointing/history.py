"""A run's per-step history on disk: append-only JSON-lines files that the run's checkpoints share.

Layout, beside the checkpoints::

    <checkpoint_dir>/history/<attempt>.jsonl    one JSON object per completed step, one per line

A checkpoint names its rows in ``metadata.json``'s ``history`` record: ``{"file", "rows", "bytes",
"sha256"}``, its history being the first ``rows`` lines of ``file``, ``bytes`` long, whose sha256 is
recorded. A save appends only the rows since the previous save and fsyncs them before the checkpoint
that counts them is written, so what a save writes does not grow with the run.

Bytes past a checkpoint's prefix (later checkpoints' rows, a branch abandoned for an earlier checkpoint,
a line torn by a killed process) are ignored when it is read (a torn last line with a warning) and are
never rewritten: a resumed run appends to the resumed checkpoint's file only when that file ends exactly
where the checkpoint's rows end, and otherwise starts a file of its own (the resumed rows first); it
does so too when a row already written has changed since (the epoch's end adds the last accumulation
window's metrics to its last row). So every checkpoint's prefix stays intact, archived ones included.

A checkpoint finds its file in the ``history/`` folder of its run: beside it, or beside ``abandoned/``
for one archived in ``abandoned/<attempt>/`` (:mod:`comlrl.checkpointing.lineage`); a checkpoint copied
elsewhere needs that folder copied beside it. A checkpoint of format 2 holds its whole history in its
own ``history.json`` instead; :func:`read` reads either.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, NoReturn

from comlrl.checkpointing import io
from comlrl.checkpointing.lineage import ARCHIVE_DIR
from comlrl.errors import CheckpointError

logger = logging.getLogger(__name__)

HISTORY_DIR = "history"
RECORD_KEY = "history"  # of metadata.json
RECORD_FIELDS = ("file", "rows", "bytes", "sha256")
_FILE = re.compile(r"^[0-9A-Za-z][0-9A-Za-z_-]{0,80}\.jsonl$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def encode_rows(rows: list[dict[str, Any]]) -> bytes:
    """Rows as JSON lines (floats written exactly, as ``json`` writes them)."""
    return "".join(json.dumps(row) + "\n" for row in rows).encode("utf-8")


# ----- reading ------------------------------------------------------------------------------------
def check_record(record: Any, fail: Callable[[str], None]) -> None:
    """A ``history`` record as :meth:`HistoryLog.append` writes it (its file name stays in ``history/``)."""
    if not isinstance(record, dict) or set(record) != set(RECORD_FIELDS):
        fail(f"history must be an object with exactly {', '.join(RECORD_FIELDS)}, got {record!r}"[:300])
    if not isinstance(record["file"], str) or not _FILE.match(record["file"]):
        fail(f"history.file is {record['file']!r}, expected a file name '<attempt>.jsonl'"[:300])
    for key in ("rows", "bytes"):
        value = record[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            fail(f"history.{key} is {value!r}, expected a non-negative integer"[:300])
    if not isinstance(record["sha256"], str) or not _SHA256.match(record["sha256"]):
        fail(f"history.sha256 is {record['sha256']!r}, expected 64 hexadecimal digits"[:300])


def locate(checkpoint: Path, record: dict[str, Any]) -> Path:
    """The history file of ``checkpoint`` (beside it, or beside ``abandoned/`` when archived); never a link."""
    places = [checkpoint.parent]
    if checkpoint.parent.parent.name == ARCHIVE_DIR:
        places.append(checkpoint.parent.parent.parent)
    for root in places:
        folder = root / HISTORY_DIR
        file = folder / record["file"]
        for entry in (folder, file):
            if entry.is_symlink():
                raise CheckpointError(checkpoint, label(checkpoint, entry), f"is a symbolic link (to "
                                      f"{os.readlink(entry)!r}); a run's history must lie in its own directory")
        if file.exists():
            return file
    raise CheckpointError(checkpoint, label(checkpoint, places[0] / HISTORY_DIR / record["file"]),
                          f"is missing: the checkpoint's {record['rows']} history rows are kept in the {HISTORY_DIR}/ "
                          "folder of its run directory; copy that folder beside a checkpoint that is moved or copied")


def label(checkpoint: Path, file: Path) -> str:
    """``file`` as an error names it: relative to the checkpoint (``../history/<attempt>.jsonl``)."""
    return os.path.relpath(file, checkpoint)


def read_rows(checkpoint: Path, record: dict[str, Any]) -> tuple[list[Any], str]:
    """The rows ``record`` names, checked against its size and sha256, and the file's name for errors."""
    file = locate(checkpoint, record)
    name, expected = label(checkpoint, file), record["bytes"]

    def fail(problem: str) -> NoReturn:
        raise CheckpointError(checkpoint, name, problem)

    try:
        with open(file, "rb") as handle:
            data = handle.read(expected)
            size = os.fstat(handle.fileno()).st_size
            torn = False  # a last line without its newline, past the checkpoint's rows
            if size > expected:
                handle.seek(size - 1)
                torn = handle.read(1) != b"\n"
    except OSError as error:
        fail(f"cannot be read ({error.strerror or error})")
    if len(data) < expected:
        fail(f"has {size} bytes, fewer than the {expected} of the {record['rows']} rows metadata.json's history "
             "record counts (truncated)")
    if hashlib.sha256(data).hexdigest() != record["sha256"]:
        fail(f"its first {expected} bytes changed since the checkpoint was saved (their sha256 differs from "
             "metadata.json's history record)")
    lines = data.split(b"\n")
    if lines[-1] != b"" or len(lines) - 1 != record["rows"]:
        fail(f"its first {expected} bytes hold {len(lines) - 1} whole lines, not the {record['rows']} rows "
             "metadata.json's history record counts")
    rows = []
    for number, line in enumerate(lines[:-1], 1):
        try:
            rows.append(json.loads(line.decode("utf-8")))
        except UnicodeDecodeError as error:
            fail(f"line {number} is not UTF-8 text ({error})")
        except json.JSONDecodeError as error:
            fail(f"line {number} is not valid JSON ({error})")
    if torn:
        logger.warning("history file %s ends with a partial row (a write cut short after checkpoint %s was saved); "
                       "it is ignored", file, checkpoint)
    return rows, name


def read(checkpoint: str | Path, metadata: dict[str, Any] | None = None) -> tuple[list[Any], str]:
    """``checkpoint``'s history rows (its record's, or a format-2 ``history.json``) and the file they came from."""
    checkpoint = Path(checkpoint)
    metadata = io.read_metadata(checkpoint) if metadata is None else metadata
    if RECORD_KEY in metadata:
        return read_rows(checkpoint, metadata[RECORD_KEY])
    return io.read_json(checkpoint, io.HISTORY_FILE), io.HISTORY_FILE


def read_history(checkpoint: str | Path) -> list[dict[str, Any]]:
    """The per-step history saved with ``checkpoint`` (what ``trainer.state.history`` was), oldest first."""
    return read(checkpoint)[0]


# ----- writing ------------------------------------------------------------------------------------
class HistoryLog:
    """The writer of one run attempt's rows, in the process that writes checkpoints: :meth:`append`
    before each save, :meth:`continue_file` after a resume."""

    def __init__(self, checkpoint_dir: str | Path, attempt: str) -> None:
        self.root = Path(checkpoint_dir)
        self.folder = self.root / HISTORY_DIR
        if self.folder.is_symlink():  # the rows would land outside the run (and its checkpoints be refused)
            raise CheckpointError(self.root, HISTORY_DIR, f"is a symbolic link (to {os.readlink(self.folder)!r}); "
                                  "a run's history must lie inside its checkpoint directory")
        self.attempt = attempt
        self.file: str | None = None  # the file appended to (None: the next append starts one)
        self.written: list[dict[str, Any]] = []  # copies of the rows in it
        self.size = 0
        self.digest = hashlib.sha256()

    def continue_file(self, checkpoint: Path, record: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        """Append to the resumed checkpoint's file if it is this run's and ends exactly at the checkpoint's rows."""
        file = self.folder / record["file"]
        try:
            if locate(checkpoint, record).resolve() != file.resolve() or file.stat().st_size != record["bytes"]:
                return
            data = file.read_bytes()
        except (OSError, CheckpointError):
            return
        if len(data) == record["bytes"] and hashlib.sha256(data).hexdigest() == record["sha256"]:
            self.file, self.written, self.size = record["file"], copy.deepcopy(rows), len(data)
            self.digest = hashlib.sha256(data)

    def append(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """Write (and fsync) the rows of ``history`` not yet in the file; returns ``history``'s record."""
        if self.file is None or history[:len(self.written)] != self.written:
            self._start()
        new = history[len(self.written):]
        data = encode_rows(new)
        path = self.folder / self.file
        created = not path.exists()
        with open(path, "ab") as handle:
            handle.truncate(self.size)  # what a failed append left past the rows written
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if created:
            io.fsync_path(self.folder)
        self.written += copy.deepcopy(new)
        self.size += len(data)
        self.digest.update(data)
        return {"file": self.file, "rows": len(self.written), "bytes": self.size, "sha256": self.digest.hexdigest()}

    def _start(self) -> None:
        """A new file of this attempt's: the whole history is written to it."""
        if not self.folder.is_dir():
            self.folder.mkdir(parents=True)
            io.fsync_path(self.root)
        name, number = f"{self.attempt}.jsonl", 1
        while (self.folder / name).exists():
            number += 1
            name = f"{self.attempt}-{number}.jsonl"
        self.file, self.written, self.size, self.digest = name, [], 0, hashlib.sha256()
