"""The tracking spool: everything sent to an MLflow run goes to disk first, then to the server.

A :class:`Spool` is one directory per MLflow run::

    spool.jsonl   append-only JSON lines: a header naming the run, then one record per line
    acked         byte offset in spool.jsonl up to which the tracking store acknowledged
    artifacts/    copies of logged files and folders, taken when they were spooled
    lock          held (``flock``) by the one process writing and delivering this spool

Records are ``{"metrics": [[key, value, timestamp_ms, step], ...]}``, ``{"params": [[k, v]]}``,
``{"tags": [[k, v]]}``, ``{"artifact": "artifacts/<n>/<name>", "artifact_path": ...}`` and
``{"status": "FINISHED" | "FAILED", "end_time": ms}``. Delivery (:meth:`Spool.deliver`) sends the
records after ``acked`` in order, consecutive records of one kind in one ``log_batch`` call, and
moves ``acked`` past each call the store acknowledged: a delivered record is not sent again
(unless the process died between the store's answer and the ``acked`` write; the SQL stores then
keep one copy of an identical metric). What the store refuses (a 4xx answer, e.g. a param
re-logged with another value) is skipped with an error naming it, so it cannot block the rest.

A :class:`Sender` delivers a spool from a background thread: :meth:`Sender.put` is a deque
append; the thread writes what was put to the spool (one write and ``fsync`` per batch) and
delivers it, retrying with a capped exponential backoff while the server is down.
:func:`replay` delivers a spool left by an earlier process (``comlrl sync``).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

logger = logging.getLogger(__name__)
SENDER_THREAD = "mlflow-sender"


class _QuietSenderRetries(logging.Filter):
    """urllib3 logs every retry of a refused connection; from a sender thread those lines only
    repeat the one warning that marks an outage."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not threading.current_thread().name.startswith(SENDER_THREAD)


logging.getLogger("urllib3.connectionpool").addFilter(_QuietSenderRetries())

SPOOL_FILE = "spool.jsonl"
VERSION = 1
BATCHED = ("metrics", "params", "tags")
LIMITS = {"metrics": 1000, "params": 100, "tags": 100}  # MLflow's log_batch limits, per call


class SpoolError(RuntimeError):
    """A spool that cannot be used (another run's, in use by another process, unreadable)."""


class SpoolBusy(SpoolError):
    """Another process holds the spool's lock and is delivering it."""


def permanent_error(error: BaseException) -> bool:
    """A refusal by the tracking store (4xx but 429): resending the same record cannot succeed."""
    status = getattr(error, "get_http_status_code", None)
    if not callable(status):
        return False
    code = status()
    return 400 <= code < 500 and code != 429


@dataclass
class DeliveryReport:
    """What one :meth:`Spool.deliver` call did."""

    records: int = 0
    metrics: int = 0
    artifacts: int = 0
    refused: list[str] = field(default_factory=list)


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
            self.directory.mkdir(parents=True, exist_ok=True)
            header = {"spool": VERSION, "run_id": identity["run_id"], "experiment_id": identity.get("experiment_id"),
                      "tracking_uri": identity["tracking_uri"]}
            self._write_lines([header], truncate=True)
            self._write_acked(self.path.stat().st_size)
        self.header = self._read_header()
        if identity is not None and identity["run_id"] != self.header["run_id"]:
            raise SpoolError(f"{self.path} spools MLflow run {self.header['run_id']}, not {identity['run_id']}; "
                             f"give each MLflow run its own spool directory")
        self.size = self.path.stat().st_size
        self.acked = self._read_acked()

    # ----- bookkeeping ------------------------------------------------------------------------
    @property
    def pending_bytes(self) -> int:
        return max(0, self.size - self.acked)  # the sender may read a line before append updates size

    def _read_header(self) -> dict[str, Any]:
        with open(self.path, "rb") as handle:
            first = handle.readline()
        try:
            header = json.loads(first)
        except ValueError:
            header = None
        if not (isinstance(header, dict) and header.get("spool") == VERSION and header.get("run_id")):
            raise SpoolError(f"{self.path}: the first line is not a version-{VERSION} spool header "
                             f"(got {first[:80]!r})")
        return header

    def _drop_partial_line(self) -> None:
        with open(self.path, "rb+") as handle:
            data_end = handle.seek(0, os.SEEK_END)
            if data_end == 0:
                return
            handle.seek(data_end - 1)
            if handle.read(1) == b"\n":
                return
            handle.seek(0)
            complete = handle.read().rfind(b"\n") + 1
            handle.truncate(complete)
            logger.warning("%s: dropped an unfinished last line (%d bytes) left by a killed process",
                           self.path, data_end - complete)

    def _read_acked(self) -> int:
        try:
            acked = int(self._acked_path.read_text().strip())
        except (FileNotFoundError, ValueError):
            acked = len(self.path.read_bytes().split(b"\n", 1)[0]) + 1  # only the header
        return min(acked, self.size)

    def _write_acked(self, offset: int) -> None:
        staging = self._acked_path.with_name("acked.tmp")
        with open(staging, "w") as handle:
            handle.write(f"{offset}\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, self._acked_path)
        self.acked = offset

    # ----- writing ----------------------------------------------------------------------------
    def _write_lines(self, records: list[dict[str, Any]], truncate: bool = False) -> None:
        data = b"".join(json.dumps(r, separators=(",", ":"), allow_nan=True).encode() + b"\n" for r in records)
        with open(self.path, "wb" if truncate else "ab") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        self.size = self.path.stat().st_size

    def append(self, records: list[dict[str, Any]]) -> None:
        """Write ``records`` (one ``fsync``); artifact records are copied into ``artifacts/`` first."""
        with self._write_lock:
            lines = []
            for record in records:
                if "artifact_source" in record:
                    record = self._copy_artifact(record)
                    if record is None:
                        continue
                lines.extend(split_record(record))
            if lines:
                self._write_lines(lines)

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
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copy2(source, target)
        return {"artifact": str(target.relative_to(self.directory)), "artifact_path": record.get("artifact_path")}

    # ----- reading and delivering -------------------------------------------------------------
    def pending(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(end offset, record)`` for every complete record after ``acked``."""
        with open(self.path, "rb") as handle:
            handle.seek(self.acked)
            offset = self.acked
            for line in handle:
                if not line.endswith(b"\n"):
                    return  # being written
                offset += len(line)
                yield offset, json.loads(line)

    def deliver(self, client: Any) -> DeliveryReport:
        """Send every pending record to the run through ``client`` (an ``MlflowClient``); raises
        on the first transport failure, with ``acked`` past everything acknowledged before it.

        Consecutive records of one kind (metrics, params or tags) go in one ``log_batch`` call
        within MLflow's limits; when the store refuses such a call, its records are sent one by
        one so that only the refused ones are skipped.
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

        for end, record in self.pending():
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
        self._drop_partial_line()
        self.size = self.path.stat().st_size
        self.acked = min(self.acked, self.size)

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


def replay(directory: str | Path, tracking_uri: str | None = None) -> tuple[Spool, DeliveryReport]:
    """Deliver what the spool in ``directory`` still holds to its run (at ``tracking_uri``, default
    the one the spool recorded). Raises the transport error if the server is still down."""
    spool = Spool(directory)
    spool.lock()
    try:
        return spool, spool.deliver(mlflow_client(tracking_uri or spool.header["tracking_uri"]))
    finally:
        spool.unlock()


class Sender:
    """Delivers a :class:`Spool` from a background thread while training goes on.

    :meth:`put` only appends to a deque. Every ``interval`` seconds (sooner after :meth:`wake`)
    the thread writes what was put to the spool and, when a retry is due, delivers the spool.
    After a failed delivery it waits ``retry_interval`` seconds, doubling up to
    ``max_retry_interval``; one warning marks the outage and one line its end.
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
        self.refused: list[str] = []
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
        """Queue one record; the training loop's whole cost of a send."""
        self._queue.append(record)

    def wake(self) -> None:
        self._wake.set()

    @property
    def delivered(self) -> bool:
        """Everything put so far is acknowledged by the store."""
        return not self._queue and self.spool.pending_bytes == 0

    def spool_queued(self) -> None:
        """Move what was put into the spool file (thread-safe; also used once the thread stopped)."""
        with self._spool_lock:  # one writer at a time keeps the records in the order they were put
            records = []
            while self._queue:
                records.append(self._queue.popleft())
            if records:
                try:
                    self.spool.append(records)
                except OSError:
                    self._queue.extendleft(reversed(records))  # kept for the next try
                    raise

    def _run(self) -> None:
        client, delay, next_try = None, self.retry_interval, 0.0
        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            stopping = self._stopping
            try:
                self.spool_queued()
            except OSError as error:  # a full disk must not kill the thread; the deque keeps the records
                logger.error("cannot write the tracking spool %s: %s", self.spool.path, error)
            if self.spool.pending_bytes and time.monotonic() >= next_try and not stopping:
                try:
                    client = client or mlflow_client(self.tracking_uri)
                    report = self.spool.deliver(client)
                    self.refused += report.refused
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
        """Stop the thread; whatever was put is in the spool file afterwards."""
        self._stopping = True
        self.wake()
        self._thread.join(join_timeout)
        self.spool_queued()  # the thread may still be in a request: spool the rest from here
        self._end("stop")  # releases the spool now, or when that request returns
