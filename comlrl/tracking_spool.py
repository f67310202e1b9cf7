"""The tracking spool: everything sent to an MLflow run goes to disk first, then to the server.

A :class:`Spool` is one directory per MLflow run::

    spool.jsonl   append-only: a JSON header line naming the run, then one record per line
    acked         byte offset in spool.jsonl up to which the tracking store acknowledged
    artifacts/    copies of logged files and folders, taken when they were spooled
    lock          held (``flock``) by the one process writing and delivering this spool

Records are ``{"metrics": [[key, value, timestamp_ms, step], ...]}``, ``{"params": [[k, v]]}``,
``{"tags": [[k, v]]}``, ``{"artifact": "artifacts/<n>/<name>", "artifact_path": ...}`` and
``{"status": "FINISHED" | "FAILED", "end_time": ms}``. Since spool version 2 each record line is
a checked frame, ``#<length> <crc32 hex> <json>``: a reader knows a whole record from a torn or
corrupted one. Version-1 spools (plain JSON lines, written before) are still read, and a
version-1 spool that a newer process continues gets version-2 frames after its old lines.

Writing (:meth:`Spool.append`): whole records in one ``write`` and one ``fsync``; when either
fails (a full disk, a file-size limit) the file is cut back to where it was, so a retry writes
every record whole and never after half of one.

Reading (:meth:`Spool.entries`): a line that is not a whole record (a write cut short by an
older version, a corrupted byte) is skipped with a warning naming the file, the byte offset and
the length, and a whole record written right after the torn bytes on the same line is still
found; an unfinished last line (a process killed mid-write) is not read, and dropped by the next
process that takes the spool (:meth:`Spool.lock`). A damaged spool therefore never blocks what
comes after the damage. Only a spool whose header or file cannot be read is unusable
(:class:`SpoolDamaged`).

Delivery (:meth:`Spool.deliver`) sends the records after ``acked`` in order, consecutive records
of one kind in one ``log_batch`` call, and moves ``acked`` past each call the store acknowledged:
a delivered record is not sent again (unless the process died between the store's answer and
the ``acked`` write; the SQL stores then keep one copy of an identical metric). What the store
refuses (a 4xx answer, e.g. a param re-logged with another value) is skipped with an error
naming it, so it cannot block the rest.

A :class:`Sender` delivers a spool from a background thread, retrying with a capped exponential
backoff while the server is down; what its owner writes with :meth:`Sender.put` and
:meth:`Sender.write_queued` is on disk before the call returns (a record whose write failed
stays queued and the thread writes it again). :func:`replay` delivers a spool left by an earlier
process (``comlrl sync``).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import threading
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

logger = logging.getLogger(__name__)
SENDER_THREAD = "mlflow-sender"
CALL_THREAD = "mlflow-call"  # a command's MLflow work under a deadline (comlrl.tracking.call_with_deadline)


class _QuietBackgroundRetries(logging.Filter):
    """urllib3 logs every retry of a refused connection; from a sender or deadline thread those
    lines only repeat the one message that marks an outage."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not threading.current_thread().name.startswith((SENDER_THREAD, CALL_THREAD))


logging.getLogger("urllib3.connectionpool").addFilter(_QuietBackgroundRetries())

SPOOL_FILE = "spool.jsonl"
VERSION = 2
READABLE_VERSIONS = (1, 2)
BATCHED = ("metrics", "params", "tags")
LIMITS = {"metrics": 1000, "params": 100, "tags": 100}  # MLflow's log_batch limits, per call


class SpoolError(RuntimeError):
    """A spool that cannot be used (another run's, in use by another process, unreadable)."""


class SpoolBusy(SpoolError):
    """Another process holds the spool's lock and is delivering it."""


class SpoolDamaged(SpoolError):
    """The spool's file or header cannot be read: nothing in it can be delivered."""


def permanent_error(error: BaseException) -> bool:
    """A refusal by the tracking store (4xx but 429): resending the same record cannot succeed."""
    status = getattr(error, "get_http_status_code", None)
    if not callable(status):
        return False
    code = status()
    return 400 <= code < 500 and code != 429


# ----- one record, one line -----------------------------------------------------------------------
_FRAME = re.compile(rb"#(\d{1,10}) ([0-9a-f]{8}) ")
_RECORD_START = re.compile(rb'#\d|\{"')  # where a version-2 frame or a version-1 line begins
_FRAME_END = re.compile(rb"#\d{1,10} [0-9a-f]{8} $")  # a frame's prefix, right before its JSON


def encode_record(record: dict[str, Any]) -> bytes:
    """``#<length> <crc32> <json>\\n``; the JSON is ASCII and holds no newline (``json.dumps`` escapes them)."""
    payload = json.dumps(record, separators=(",", ":"), allow_nan=True).encode()
    return b"#%d %08x %s\n" % (len(payload), zlib.crc32(payload), payload)


def decode_record(line: bytes, plain: bool = False) -> dict[str, Any] | None:
    """The record ``line`` (without its newline) holds, or None when it is not exactly one whole,
    well-formed record: a version-2 frame whose length and checksum match, or (``plain``: in a
    version-1 spool) a version-1 JSON line."""
    if line.startswith(b"#"):
        frame = _FRAME.match(line)
        if frame is None:
            return None
        payload = line[frame.end():]
        if len(payload) != int(frame[1]) or zlib.crc32(payload) != int(frame[2], 16):
            return None
    elif plain and line.startswith(b"{"):
        payload = line
    else:
        return None
    try:
        record = json.loads(payload)
    except ValueError:
        return None
    return record if _well_formed(record) else None


def _pairs(entries: Any) -> bool:
    return isinstance(entries, list) and all(isinstance(e, list) and len(e) == 2 and isinstance(e[0], str)
                                             for e in entries)


def _well_formed(record: Any) -> bool:
    if not isinstance(record, dict):
        return False
    if "metrics" in record:
        entries = record["metrics"]
        return isinstance(entries, list) and all(
            isinstance(e, list) and len(e) == 4 and isinstance(e[0], str)
            and all(isinstance(x, (int, float)) for x in e[1:]) for e in entries)
    if "params" in record:
        return _pairs(record["params"])
    if "tags" in record:
        return _pairs(record["tags"])
    if "artifact" in record:
        return isinstance(record["artifact"], str)
    return isinstance(record.get("status"), str)


def read_line(line: bytes, plain: bool = False) -> tuple[int, dict[str, Any] | None]:
    """``(damaged, record)`` for one line without its newline: ``damaged`` leading bytes that hold
    no record (0 for a whole record). A write cut short leaves its torn bytes in front of the next
    record written, on the same line; that record is found after them. (``plain``: version-1
    lines count, but never the JSON of a frame whose checksum failed.)"""
    record = decode_record(line, plain)
    if record is not None:
        return 0, record
    for start in _RECORD_START.finditer(line, 1):
        if line[start.start()] != ord("#") and _FRAME_END.search(line, max(0, start.start() - 22), start.start()):
            continue
        record = decode_record(line[start.start():], plain)
        if record is not None:
            return start.start(), record
    return len(line), None


@dataclass(frozen=True)
class Damaged:
    """Bytes of a spool file that hold no whole record, skipped by every reader."""

    path: Path
    offset: int
    length: int
    preview: bytes

    def describe(self) -> str:
        return (f"tracking spool {self.path}: skipped {self.length} bytes at byte offset {self.offset} that hold no "
                f"whole record (a write cut short or a corrupted record; they start {self.preview!r}); "
                f"the records after them are delivered")


@dataclass
class DeliveryReport:
    """What one :meth:`Spool.deliver` call did."""

    records: int = 0
    metrics: int = 0
    artifacts: int = 0
    refused: list[str] = field(default_factory=list)
    damaged: list[Damaged] = field(default_factory=list)


class Spool:
    """The on-disk spool of one MLflow run (see the module docstring for the layout)."""

    def __init__(self, directory: str | Path, identity: dict[str, Any] | None = None) -> None:
        """Open (or, given ``identity``, create) the spool in ``directory``; an existing spool
        must belong to ``identity["run_id"]``. Only :meth:`lock` holders write to it."""
        self.directory = Path(directory)
        self.path = self.directory / SPOOL_FILE
        self._acked_path = self.directory / "acked"
        self._write_lock = threading.Lock()
        self._lock_file: Any = None
        if not self.path.is_file():
            if identity is None:
                raise SpoolError(f"no tracking spool in {self.directory} (expected {self.path})")
            self._create(identity)
        self.header, self.header_end = self._read_header()
        if identity is not None and identity["run_id"] != self.header["run_id"]:
            raise SpoolError(f"{self.path} spools MLflow run {self.header['run_id']}, not {identity['run_id']}; "
                             f"give each MLflow run its own spool directory")
        self.size = self.path.stat().st_size
        self.acked = self._read_acked()

    # ----- bookkeeping ------------------------------------------------------------------------
    @property
    def pending_bytes(self) -> int:
        return max(0, self.size - self.acked)

    def _create(self, identity: dict[str, Any]) -> None:
        """The header line, written whole (a staging file renamed) so that a spool is never headless."""
        self.directory.mkdir(parents=True, exist_ok=True)
        header = {"spool": VERSION, "run_id": identity["run_id"], "experiment_id": identity.get("experiment_id"),
                  "tracking_uri": identity["tracking_uri"]}
        staging = self.path.with_name(SPOOL_FILE + ".new")
        with open(staging, "wb") as handle:
            handle.write(json.dumps(header, separators=(",", ":")).encode() + b"\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, self.path)
        self._write_acked(self.path.stat().st_size)

    def _read_header(self) -> tuple[dict[str, Any], int]:
        try:
            with open(self.path, "rb") as handle:
                first = handle.readline()
        except OSError as error:
            raise SpoolDamaged(f"{self.path} cannot be read ({error}); nothing in it can be delivered") from None
        try:
            header = json.loads(first)
        except ValueError:
            header = None
        if not (isinstance(header, dict) and header.get("spool") in READABLE_VERSIONS and header.get("run_id")
                and first.endswith(b"\n")):
            raise SpoolDamaged(f"{self.path}: the first line is not a tracking spool header (versions "
                               f"{', '.join(map(str, READABLE_VERSIONS))}; got {first[:80]!r}); the spool names no "
                               f"MLflow run, so nothing in it can be delivered")
        return header, len(first)

    def _read_acked(self) -> int:
        try:
            acked = int(self._acked_path.read_text().strip())
        except (FileNotFoundError, ValueError):
            acked = self.header_end
        return min(max(acked, self.header_end), self.size)

    def _write_acked(self, offset: int) -> None:
        staging = self._acked_path.with_name("acked.tmp")
        with open(staging, "w") as handle:
            handle.write(f"{offset}\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, self._acked_path)
        self.acked = offset

    # ----- writing ----------------------------------------------------------------------------
    def append(self, records: list[dict[str, Any]]) -> None:
        """Write ``records`` whole, with one ``write`` and one ``fsync`` (artifact records are copied
        into ``artifacts/`` first). On an ``OSError`` nothing of them stays in the spool: the file is
        cut back to where it was, the copies removed, and the error raised for the caller to retry."""
        with self._write_lock:
            frames, copies = [], []
            try:
                for record in records:
                    if "artifact_source" in record:
                        record = self._copy_artifact(record)
                        if record is None:
                            continue
                        copies.append(self.directory / Path(record["artifact"]).parent)
                    frames.extend(encode_record(line) for line in split_record(record))
                if frames:
                    self._write(b"".join(frames))
            except OSError:
                for copy in copies:
                    shutil.rmtree(copy, ignore_errors=True)
                raise

    def _write(self, data: bytes) -> None:
        descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            end = os.fstat(descriptor).st_size
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(descriptor, view):]
                os.fsync(descriptor)
            except OSError:
                self._cut_back(descriptor, end)
                raise
            self.size = end + len(data)
        finally:
            os.close(descriptor)

    def _cut_back(self, descriptor: int, end: int) -> None:
        try:
            os.ftruncate(descriptor, end)
        except OSError as error:  # readers stop at `size` = end, and skip these bytes once records follow
            written = os.fstat(descriptor).st_size - end
            logger.error("tracking spool %s: a failed write left %d bytes at byte offset %d that could not be "
                         "removed (%s); readers skip them", self.path, written, end, error)
        self.size = end

    def _copy_artifact(self, record: dict[str, Any]) -> dict[str, Any] | None:
        source = Path(record["artifact_source"])
        if not source.exists():
            logger.error("tracking spool %s: artifact %s no longer exists; not logged", self.directory, source)
            return None
        store = self.directory / "artifacts"
        store.mkdir(exist_ok=True)
        slot = store / f"{sum(1 for _ in store.iterdir()):06d}"
        target = slot / source.name
        slot.mkdir()
        try:
            if source.is_dir():
                shutil.copytree(source, target)
            else:
                shutil.copy2(source, target)
        except OSError:
            shutil.rmtree(slot, ignore_errors=True)
            raise
        return {"artifact": str(target.relative_to(self.directory)), "artifact_path": record.get("artifact_path")}

    # ----- reading and delivering -------------------------------------------------------------
    def entries(self, start: int | None = None) -> Iterator[tuple[int, dict[str, Any] | Damaged]]:
        """``(end offset, record)`` for every whole record from ``start`` (default ``acked``) up to
        :attr:`size` (what this process's writes have made durable), and ``(end offset, Damaged)``
        for the bytes between them that hold none; an unfinished last line (being written, or cut
        short by a killed process) ends the iteration."""
        offset = self.acked if start is None else start
        plain = self.header["spool"] == 1
        with open(self.path, "rb") as handle:
            handle.seek(offset)
            for line in handle:
                if not line.endswith(b"\n") or offset + len(line) > self.size:
                    return
                damaged, record = read_line(line[:-1], plain)
                if record is None:
                    damaged = len(line)
                if damaged:
                    yield offset + damaged, Damaged(self.path, offset, damaged, line[:min(damaged, 40)])
                offset += len(line)
                if record is not None:
                    yield offset, record

    def pending(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(end offset, record)`` for every whole record after ``acked``."""
        return ((end, record) for end, record in self.entries() if not isinstance(record, Damaged))

    def metric_points(self) -> Iterator[tuple[int, list[Any]]]:
        """``(end offset of its record, [key, value, timestamp_ms, step])`` of every metric point in the whole
        spool (delivered or not), in the order they were logged."""
        for end, record in self.entries(self.header_end):
            if not isinstance(record, Damaged):
                for point in record.get("metrics", ()):
                    yield end, point

    def logged_steps(self, until: int | None = None) -> dict[str, int]:
        """The highest step of every metric key in the whole spool (delivered or not), or in the records
        that end at or before byte ``until``."""
        steps: dict[str, int] = {}
        for end, (key, _, _, step) in self.metric_points():
            if (until is None or end <= until) and (key not in steps or step > steps[key]):
                steps[key] = int(step)
        return steps

    def deliver(self, client: Any) -> DeliveryReport:
        """Send every pending record to the run through ``client`` (an ``MlflowClient``); raises
        on the first transport failure, with ``acked`` past everything acknowledged before it.

        Consecutive records of one kind (metrics, params or tags) go in one ``log_batch`` call
        within MLflow's limits; when the store refuses such a call, its records are sent one by
        one so that only the refused ones are skipped. Damaged bytes are skipped with a warning
        (once: ``acked`` moves past them).
        """
        report = DeliveryReport()
        kind, batch, batch_end = None, [], self.acked  # the records of the call being gathered

        def send_batch() -> None:
            if batch:
                if not self._call(report, f"{kind} up to byte {batch_end}", self._log_batch, client, kind, batch) \
                        and len(batch) > 1:
                    report.refused.pop()  # find the record(s) the store refuses
                    for one in batch:
                        self._call(report, f"{kind} {one[:3]}", self._log_batch, client, kind, [one])
                report.metrics += len(batch) if kind == "metrics" else 0
                self._write_acked(batch_end)
            batch.clear()

        for end, record in self.entries():
            if isinstance(record, Damaged):
                send_batch()
                kind = None
                logger.warning(record.describe())
                report.damaged.append(record)
                self._write_acked(end)
                batch_end = end
                continue
            report.records += 1
            record_kind = next((k for k in BATCHED if k in record), None)
            if record_kind is not None:
                if record_kind != kind or len(batch) + len(record[record_kind]) > LIMITS[record_kind]:
                    send_batch()
                    kind = record_kind
                batch.extend(record[record_kind])
                batch_end = end
                continue
            send_batch()
            kind = None
            if "artifact" in record:
                self._call(report, f"artifact {record['artifact']}", self._log_artifact, client, record)
                report.artifacts += 1
            elif "status" in record:
                self._call(report, f"status {record['status']}", client.set_terminated,
                           self.header["run_id"], record["status"], record.get("end_time"))
            self._write_acked(end)
            batch_end = end
        send_batch()
        return report

    def _call(self, report: DeliveryReport, what: str, function: Any, *args: Any) -> bool:
        """``function(*args)``; ``False`` when the store refused it (recorded and logged), raises otherwise."""
        try:
            function(*args)
            return True
        except Exception as error:
            if not permanent_error(error):
                raise
            message = f"{what}: {str(error)[:300]}"
            report.refused.append(message)
            logger.error("MLflow refused %s of spool %s; skipped it (resending cannot help)", message, self.path)
            return False

    def _log_batch(self, client: Any, kind: str, entries: list[list[Any]]) -> None:
        from mlflow.entities import Metric, Param, RunTag

        if kind == "metrics":
            client.log_batch(self.header["run_id"], metrics=[Metric(k, float(v), int(t), int(s)) for k, v, t, s in entries])
        elif kind == "params":
            client.log_batch(self.header["run_id"], params=[Param(k, v) for k, v in entries])
        else:
            client.log_batch(self.header["run_id"], tags=[RunTag(k, v) for k, v in entries])

    def _log_artifact(self, client: Any, record: dict[str, Any]) -> None:
        local = self.directory / record["artifact"]
        if local.is_dir():
            destination = "/".join(p for p in (record.get("artifact_path"), local.name) if p)
            client.log_artifacts(self.header["run_id"], str(local), destination)
        else:
            client.log_artifact(self.header["run_id"], str(local), record.get("artifact_path"))

    # ----- the delivering process's lock ------------------------------------------------------
    def lock(self) -> None:
        """Become the one process writing and delivering this spool (:class:`SpoolBusy` if another
        is); a last line cut short by a killed process is dropped first."""
        handle = open(self.directory / "lock", "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise SpoolBusy(f"{self.path} is being delivered by {holder}; wait for it to exit") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"process {os.getpid()}\n")
        handle.flush()
        self._lock_file = handle
        self._drop_unfinished_line()
        self.size = self.path.stat().st_size
        self.acked = min(self.acked, self.size)

    def _drop_unfinished_line(self) -> None:
        with open(self.path, "rb+") as handle:
            end = position = handle.seek(0, os.SEEK_END)
            complete = self.header_end
            while position > self.header_end:  # back to the last newline, a block at a time
                start = max(self.header_end, position - 65536)
                handle.seek(start)
                newline = handle.read(position - start).rfind(b"\n")
                if newline >= 0:
                    complete = start + newline + 1
                    break
                position = start
            if complete < end:
                handle.truncate(complete)
                logger.warning("tracking spool %s: dropped an unfinished last line (%d bytes at byte offset %d) left "
                               "by a killed process or a failed write", self.path, end - complete, complete)

    def unlock(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # closing releases the flock
            self._lock_file = None


def split_record(record: dict[str, Any]) -> list[dict[str, Any]]:
    """A metrics/params/tags record cut to MLflow's per-call limits, so any record fits one call."""
    for kind, limit in LIMITS.items():
        if kind in record and len(record[kind]) > limit:
            return [{kind: record[kind][i:i + limit]} for i in range(0, len(record[kind]), limit)]
    return [record]


def find_spools(path: str | Path) -> list[Path]:
    """The spool directories at ``path``: itself when it is one, else every one below it."""
    path = Path(path)
    if (path / SPOOL_FILE).is_file():
        return [path]
    if not path.is_dir():
        raise SpoolError(f"{path} is neither a tracking spool directory nor a folder holding one")
    return sorted(found.parent for found in path.rglob(SPOOL_FILE))


def mlflow_client(tracking_uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def replay(directory: str | Path | Spool, tracking_uri: str | None = None) -> tuple[Spool, DeliveryReport]:
    """Deliver what the spool in ``directory`` still holds to its run (at ``tracking_uri``, default
    the one the spool recorded). Raises the transport error if the server is still down."""
    spool = directory if isinstance(directory, Spool) else Spool(directory)
    spool.lock()
    try:
        return spool, spool.deliver(mlflow_client(tracking_uri or spool.header["tracking_uri"]))
    finally:
        spool.unlock()


class Sender:
    """Delivers a :class:`Spool` from a background thread while training goes on.

    :meth:`put` queues a record and :meth:`write_queued` writes the queue to the spool; a record
    whose write failed stays queued, and the thread writes it again. Every ``interval`` seconds
    (sooner after :meth:`wake`) the thread delivers the spool when a retry is due. After a failed
    delivery it waits ``retry_interval`` seconds, doubling up to ``max_retry_interval``; one
    warning marks the outage and one line its end.
    """

    def __init__(self, spool: Spool, tracking_uri: str | None = None, interval: float = 0.5,
                 retry_interval: float = 1.0, max_retry_interval: float = 5.0) -> None:
        self.spool = spool
        self.tracking_uri = tracking_uri or spool.header["tracking_uri"]
        self.interval = interval
        self.retry_interval = retry_interval
        self.max_retry_interval = max_retry_interval
        self.failures = 0  # failed deliveries in the current outage
        self.last_error: BaseException | None = None
        self.write_error: OSError | None = None  # the spool write failing now, if any
        self.refused: list[str] = []
        self.damaged: list[Damaged] = []
        self._queue: deque[dict[str, Any]] = deque()
        self._wake = threading.Event()
        self._progress = threading.Condition()
        self._stopping = False
        self._spool_lock = threading.Lock()
        self._handoff = threading.Lock()  # whichever of the thread and stop() ends last releases the spool
        self._ended = {"thread": False, "stop": False}
        spool.lock()
        self._thread = threading.Thread(target=self._run, name=f"{SENDER_THREAD}-{spool.header['run_id'][:8]}",
                                        daemon=True)
        self._thread.start()

    def put(self, record: dict[str, Any]) -> None:
        """Queue one record (for :meth:`write_queued`)."""
        self._queue.append(record)

    def wake(self) -> None:
        self._wake.set()

    @property
    def unwritten(self) -> int:
        """Records put but not in the spool file (its last write failed)."""
        return len(self._queue)

    @property
    def delivered(self) -> bool:
        """Everything put so far is acknowledged by the store."""
        return not self._queue and self.spool.pending_bytes == 0

    def write_queued(self) -> bool:
        """Write what was put into the spool file, whole and in order (thread-safe; also once the
        thread stopped); whether it was written. On a failed write the records stay queued: one
        error marks a failing spool write and one line its end."""
        with self._spool_lock:  # one writer at a time keeps the records in the order they were put
            records = []
            while self._queue:
                records.append(self._queue.popleft())
            if not records:
                return True
            try:
                self.spool.append(records)
            except OSError as error:
                self._queue.extendleft(reversed(records))  # kept whole for the next try
                if self.write_error is None:
                    logger.error("cannot write the tracking spool %s (%s); %d records wait in memory and are written "
                                 "whole once the disk takes them", self.spool.path, error, len(self._queue))
                self.write_error = error
                return False
            if self.write_error is not None:
                logger.warning("tracking spool %s written again after failed writes; no record was lost or torn",
                               self.spool.path)
                self.write_error = None
            return True

    def _run(self) -> None:
        client, delay, next_try = None, self.retry_interval, 0.0
        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            stopping = self._stopping
            self.write_queued()  # what a failed write left queued
            if self.spool.pending_bytes and time.monotonic() >= next_try and not stopping:
                try:
                    client = client or mlflow_client(self.tracking_uri)
                    report = self.spool.deliver(client)
                    self.refused += report.refused
                    self.damaged += report.damaged
                    if self.failures:
                        logger.warning("MLflow at %s reachable again after %d failed deliveries; the spooled "
                                       "records were delivered", self.tracking_uri, self.failures)
                    self.failures, self.last_error, delay = 0, None, self.retry_interval
                except Exception as error:
                    if self.failures == 0:
                        logger.warning("MLflow at %s unreachable (%s); training goes on, records are kept in %s "
                                       "and resent when it answers", self.tracking_uri, str(error)[:200], self.spool.path)
                    self.failures += 1
                    self.last_error = error
                    next_try = time.monotonic() + delay
                    delay = min(2 * delay, self.max_retry_interval)
            with self._progress:
                self._progress.notify_all()
            if stopping:
                self._end("thread")
                return

    def _end(self, party: str) -> None:
        with self._handoff:
            self._ended[party] = True
            release = all(self._ended.values())
        if release:
            self.spool.unlock()

    def wait_delivered(self, timeout: float) -> bool:
        """Wait until :attr:`delivered`, at most ``timeout`` seconds; whether it was reached."""
        deadline = time.monotonic() + timeout
        self.wake()
        with self._progress:
            while not self.delivered:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    break
                self._progress.wait(min(left, self.interval))
                self.wake()
        return self.delivered

    def stop(self, join_timeout: float = 1.0) -> None:
        """Stop the thread; whatever was put is in the spool file afterwards (unless the disk refuses it)."""
        self._stopping = True
        self.wake()
        self._thread.join(join_timeout)
        self.write_queued()  # the thread may still be in a request: spool the rest from here
        self._end("stop")  # releases the spool now, or when that request returns
