"""MLflow tracking of training runs: the run, metrics and artifacts through a spool, the registry.

MLflow is optional (the ``pipeline`` extra); it is imported only when one of these is used.

- :func:`open_run` finds or creates the MLflow run of a pipeline run (a resumed run logs into
  the run recorded in its checkpoint's metadata, see ``trainer.run_identity["mlflow"]``, once that
  checkpoint is known to be this pipeline run's: another run's is refused before MLflow changes).
- :class:`MLflowCallback` sends the trainer's metrics (and, through it, params, tags, artifacts
  and the run's final status) without ever waiting for the tracking server: a send writes the
  record to an on-disk spool (:mod:`comlrl.tracking_spool`) with one ``write`` and one ``fsync``
  before it returns, so a step whose ``on_log`` returned survives a killed process (and a lost
  machine); a background thread delivers the spool to the same MLflow run, metrics with their
  original step and timestamp, retrying while the server is down. A tracking outage therefore
  never slows or stops training. A resumed run re-runs what came after its checkpoint: the
  metric points spooled before the checkpoint was taken are the history of the weights it resumes
  and are not logged again, while a point an earlier attempt logged after it (or before a first
  checkpoint that never came) is **superseded**: the new attempt logs its own value at the same
  step, later (MLflow's metric history is append-only and keeps both), unless it is the same value
  (a resume is bit-exact where the reward is deterministic): then the earlier point stays the only
  one, so a run stopped anywhere logs each point once. The value of a (key, step)
  is its latest point: what :func:`logged_metrics`, :func:`metric_history` and MLflow's own
  latest-metric summary read. At the end
  (``on_train_end``, :meth:`MLflowCallback.close`, or interpreter exit) the process waits at
  most ``drain_timeout`` seconds in all for delivery (and up to a second more to stop the
  sender); whatever is still undelivered stays in the spool, with one warning naming it and the
  command ``comlrl sync <spool-or-run-dir>`` that replays it (:func:`sync`). Replay is
  idempotent: the spool records the byte offset the store acknowledged, so nothing already
  delivered is sent again.
- While a callback is open for an MLflow run, :func:`log_params`, :func:`log_artifact` and
  :func:`finish_run` for that run go through its spool too; otherwise they call MLflow directly.
- MLflow's HTTP client retries a failed call for about four minutes by default; the first
  :func:`open_run` or callback bounds it (:data:`HTTP_BOUNDS`, unless the environment already
  sets those variables). Commands (``comlrl sync``, ``comlrl promote``) also bound their MLflow
  work as a whole (:func:`call_with_deadline`): ``COMLRL_MLFLOW_DEADLINE`` seconds, default
  :data:`DEFAULT_DEADLINE`; a server that does not answer in time (down, or hung) ends the
  command with :data:`EXIT_UNREACHABLE`.
- :func:`register_agents` logs each agent as an MLflow ``transformers`` model, registers one
  model per agent role (``<name>-agent-<i>``) with run/algorithm/spec-hash tags and sets an
  alias (``candidate``), its prompts bounded as the rollout bounds them (:func:`left_truncating`);
  :func:`promote` moves ``champion`` to the candidate versions.
"""

from __future__ import annotations

import atexit
import copy
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

from comlrl.executables import executable
from comlrl.callbacks import TrainerCallback
from comlrl.tracking_spool import (CALL_THREAD, Sender, Spool, SpoolBusy, SpoolDamaged, SpoolError,
                                   find_spools, mlflow_client, permanent_error, replay)

logger = logging.getLogger(__name__)

RUN_KEY_TAG = "comlrl.run_id"
# mlflow.transformers cannot infer requirements here (it trips over the missing torchvision),
# and a consumer needs only these to load an agent.
MODEL_REQUIREMENTS = ["torch", "transformers", "tokenizers", "safetensors", "accelerate"]
# MLflow's own defaults (7 retries, backoff factor 2, 120 s timeout) keep one failed call going
# for about four minutes. The sender retries by itself, so a call may fail fast: one immediate
# retry (urllib3 waits only before the second) and 30 s without an answer.
HTTP_BOUNDS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
# A command's MLflow work as a whole: `comlrl promote` gives up after this many seconds, `comlrl sync`
# after this many seconds without an acknowledgement. A hung server (one that accepts connections
# but never answers) would otherwise keep a command for MLflow's retries of every call in turn.
DEADLINE_ENV = "COMLRL_MLFLOW_DEADLINE"
DEFAULT_DEADLINE = 60.0
# Exit statuses of the commands that talk to MLflow (sysexits.h).
EXIT_BAD_INPUT = 2
EXIT_DAMAGED = 65  # EX_DATAERR: a spool (or part of one) cannot be read; running again cannot help
EXIT_UNREACHABLE = 75  # EX_TEMPFAIL: MLflow did not answer in time; nothing was lost, run again later
T = TypeVar("T")


class TrackingUnavailable(RuntimeError):
    """The tracking server did not take a run's records in time; they wait in ``spool``."""

    def __init__(self, message: str, spool: Path) -> None:
        super().__init__(message)
        self.spool = spool


def bound_http_retries() -> dict[str, str]:
    """Set :data:`HTTP_BOUNDS` for this process where the environment does not set them; returns
    what was set. MLflow reads these variables at every call."""
    applied = {key: value for key, value in HTTP_BOUNDS.items() if key not in os.environ}
    os.environ.update(applied)
    return applied


class TrackingDeadline(TimeoutError):
    """MLflow did not answer a command's calls within its deadline (:func:`call_with_deadline`)."""


def command_deadline() -> float:
    """Seconds a command's MLflow work may take: ``COMLRL_MLFLOW_DEADLINE``, default :data:`DEFAULT_DEADLINE`."""
    raw = os.environ.get(DEADLINE_ENV)
    if raw is None:
        return DEFAULT_DEADLINE
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{DEADLINE_ENV} must be a positive number of seconds, got {raw!r}; unset it for the "
                         f"default ({DEFAULT_DEADLINE:g} s)")
    return seconds


def call_with_deadline(work: Callable[[], T], what: str, seconds: float | None = None,
                       progress: Callable[[], Any] | None = None) -> T:
    """``work()``, or :class:`TrackingDeadline` once ``seconds`` (default :func:`command_deadline`)
    pass without its end, or, given ``progress``, without a change of ``progress()``.

    The work runs in a daemon thread: a call blocked on a hung server cannot be interrupted, but it
    no longer holds the caller, and it ends with the process."""
    seconds = command_deadline() if seconds is None else seconds
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as error:  # handed to the caller
            outcome["error"] = error

    thread = threading.Thread(target=run, name=f"{CALL_THREAD}-{what[:40]}", daemon=True)
    thread.start()
    seen = progress() if progress is not None else None
    expires = time.monotonic() + seconds
    while thread.is_alive():
        thread.join(max(0.0, min(expires - time.monotonic(), 0.5)))
        if progress is not None and (now := progress()) != seen:
            seen, expires = now, time.monotonic() + seconds
        if thread.is_alive() and time.monotonic() >= expires:
            quiet = " without progress" if progress is not None else ""
            raise TrackingDeadline(f"{what} did not answer within {seconds:g} s{quiet} (deadline {DEADLINE_ENV})")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def unreachable(error: BaseException) -> bool:
    """Whether ``error`` says the tracking server could not be reached or did not answer (a transport
    failure, a 5xx or 429 answer, a deadline), rather than refused the request: trying again later may help."""
    if isinstance(error, TrackingDeadline):
        return True
    return callable(getattr(error, "get_http_status_code", None)) and not permanent_error(error)


@dataclass(frozen=True)
class SyncResult:
    """What :func:`sync` did with one spool: a message for people and the command's exit status."""

    directory: Path
    exit_status: int
    message: str


def sync(path: str | Path, tracking_uri: str | None = None, deadline: float | None = None) -> list[SyncResult]:
    """Deliver every spool at ``path`` (:func:`comlrl.tracking_spool.find_spools`) to its run.

    Per spool: ``0`` all delivered; :data:`EXIT_DAMAGED` unreadable (its header or file), or
    damaged bytes skipped (with a warning naming the offset and length) while everything readable
    was delivered; :data:`EXIT_UNREACHABLE` MLflow did not acknowledge anything for ``deadline``
    seconds (default :func:`command_deadline`): nothing was lost, the rest waits for another sync,
    and the spools behind the same server are not tried; :data:`EXIT_BAD_INPUT` another run's or a
    busy spool. Raises :class:`~comlrl.tracking_spool.SpoolError` when ``path`` holds no spool."""
    bound_http_retries()
    deadline = command_deadline() if deadline is None else deadline
    unanswered: set[str] = set()  # servers that did not answer: their other spools are not tried
    return [_sync_one(directory, tracking_uri, deadline, unanswered) for directory in find_spools(path)]


def _sync_one(directory: Path, tracking_uri: str | None, deadline: float, unanswered: set[str]) -> SyncResult:
    try:
        spool = Spool(directory)
    except SpoolDamaged as error:
        return SyncResult(directory, EXIT_DAMAGED, f"{directory}: unreadable: {error}")
    except SpoolError as error:
        return SyncResult(directory, EXIT_BAD_INPUT, str(error))
    uri = tracking_uri or spool.header["tracking_uri"]
    if uri in unanswered:
        return SyncResult(directory, EXIT_UNREACHABLE, f"{directory}: not tried: MLflow at {uri} did not answer "
                                                       f"for the spool before; nothing was lost, run this again later")
    try:
        _, report = call_with_deadline(lambda: replay(spool, uri), f"MLflow at {uri}", deadline,
                                       progress=lambda: spool.acked)
    except SpoolBusy as error:
        return SyncResult(directory, EXIT_BAD_INPUT, str(error))
    except Exception as error:
        if unreachable(error):
            unanswered.add(uri)
            return SyncResult(directory, EXIT_UNREACHABLE, f"{directory}: MLflow unreachable ({str(error)[:300]}); "
                                                           f"nothing was lost, run this again later")
        if isinstance(error, OSError):
            return SyncResult(directory, EXIT_DAMAGED, f"{directory}: unreadable: cannot read or write the spool "
                                                       f"({error}); nothing was lost, fix that and run this again")
        raise
    refused = f"; refused by MLflow and skipped: {report.refused}" if report.refused else ""
    delivered = (f"{directory}: delivered {report.records} records ({report.metrics} metric values, "
                 f"{report.artifacts} artifacts) to MLflow run {spool.header['run_id']}{refused}")
    if not report.damaged:
        return SyncResult(directory, 0, delivered)
    spans = ", ".join(f"{d.length} bytes at byte offset {d.offset}" for d in report.damaged)
    return SyncResult(directory, EXIT_DAMAGED, f"{delivered}; but {spool.path} was damaged: {spans} held no whole "
                                               f"record and were skipped (what they held cannot be delivered; "
                                               f"syncing again will not bring it back)")


def is_local_store(tracking_uri: str) -> bool:
    """SQLite and file stores keep artifacts where the experiment says; a server manages its own."""
    return tracking_uri.startswith(("sqlite:", "file:")) or "://" not in tracking_uri


def ensure_experiment(tracking_uri: str, name: str, artifact_root: str | Path | None = None) -> str:
    """The id of experiment ``name``, created (with ``artifact_root/<name>`` for local stores) if missing."""
    client = mlflow_client(tracking_uri)
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    location = None
    if artifact_root is not None and is_local_store(tracking_uri):
        location = (Path(artifact_root).resolve() / name).as_uri()
    return client.create_experiment(name, artifact_location=location)


# The tags that say which pipeline run an MLflow run belongs to (the run id, and the spec hash where the caller
# gives one). The identity a checkpoint records carries them as ``owner``: a resume checks them, and those of the
# MLflow run the checkpoint names, against its own before it changes anything in MLflow.
OWNER_TAGS = (RUN_KEY_TAG, "comlrl.spec_hash")


def open_run(
    tracking_uri: str,
    experiment: str,
    run_key: str,
    identity: dict[str, Any] | None = None,
    artifact_root: str | Path | None = None,
    tags: dict[str, str] | None = None,
    checkpoint: str | Path | None = None,
) -> dict[str, Any]:
    """The identity (``run_id``, ``experiment_id``, ``tracking_uri``, ``owner``) of the MLflow run of ``run_key``.

    ``identity`` (from the metadata of ``checkpoint``) wins when it belongs to this run: the :data:`OWNER_TAGS` it
    records, then the tags of the MLflow run it names, must match ``run_key`` and ``tags``; otherwise
    :class:`~comlrl.errors.CheckpointError` names ``checkpoint`` and what differs, and that MLflow run is left as
    it is (only read). Without ``identity``, a run tagged with ``run_key`` is reused (a run that failed before its
    first checkpoint); otherwise a new run starts.
    """
    bound_http_retries()
    client = mlflow_client(tracking_uri)
    given = {RUN_KEY_TAG: run_key, **(tags or {})}
    owner = {key: str(given[key]) for key in OWNER_TAGS if given.get(key) is not None}
    if identity and identity.get("run_id"):
        refuse_other_owner(identity.get("owner") or {}, owner, checkpoint, identity["run_id"], "its metadata records")
        run = client.get_run(identity["run_id"])  # read only until it is known to be this run's
        refuse_other_owner(run.data.tags, owner, checkpoint, identity["run_id"], "the MLflow run it names is tagged")
        if run.info.status != "RUNNING":
            client.update_run(run.info.run_id, status="RUNNING")
        return {"run_id": run.info.run_id, "experiment_id": run.info.experiment_id, "tracking_uri": tracking_uri,
                "owner": owner, "history_bytes": identity.get("history_bytes")}
    experiment_id = ensure_experiment(tracking_uri, experiment, artifact_root)
    found = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}'", max_results=1)
    if found:
        run = found[0]
        if run.info.status != "RUNNING":
            client.update_run(run.info.run_id, status="RUNNING")
    else:
        run = client.create_run(experiment_id, run_name=run_key, tags=given)
    return {"run_id": run.info.run_id, "experiment_id": experiment_id, "tracking_uri": tracking_uri, "owner": owner}


def refuse_other_owner(recorded: dict[str, Any], owner: dict[str, str], checkpoint: str | Path | None,
                       mlflow_run_id: str, where: str) -> None:
    """:class:`~comlrl.errors.CheckpointError` when ``recorded`` gives an :data:`OWNER_TAGS` value other than
    ``owner``'s (a value missing on either side is not compared: checkpoints from before ``owner`` was recorded)."""
    from comlrl.errors import CheckpointError

    differ = [f"{key} {recorded[key]!r} (this run: {value!r})" for key, value in owner.items()
              if recorded.get(key) is not None and str(recorded[key]) != value]
    if differ:
        raise CheckpointError(
            checkpoint if checkpoint is not None else f"naming MLflow run {mlflow_run_id}", None,
            f"belongs to another run: {where} {', '.join(differ)}. Nothing in MLflow was changed (MLflow run "
            f"{mlflow_run_id} keeps its status and tags). Move the checkpoint out of this run's checkpoints folder "
            "(this run then starts from its own newest checkpoint, or afresh), or resume the run it belongs to")


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested dicts as dotted keys with string values (MLflow params)."""
    flat: dict[str, str] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = str(value)[:6000]
    return flat


def open_callback(identity: dict[str, Any]) -> "MLflowCallback | None":
    """The open :class:`MLflowCallback` of ``identity``'s MLflow run in this process, if any."""
    return _OPEN.get(identity.get("run_id", ""))


def log_params(identity: dict[str, Any], params: dict[str, Any]) -> None:
    """Log (nested) params once; a resumed run re-logging the same values is a no-op.
    Spooled when a callback is open for the run."""
    if (callback := open_callback(identity)) is not None:
        callback.log_params(params)
        return
    from mlflow.entities import Param

    client = mlflow_client(identity["tracking_uri"])
    existing = client.get_run(identity["run_id"]).data.params
    new = [Param(k, v) for k, v in flatten(params).items() if k not in existing]
    for start in range(0, len(new), 100):
        client.log_batch(identity["run_id"], params=new[start:start + 100])


def log_artifact(identity: dict[str, Any], path: str | Path, artifact_path: str | None = None) -> None:
    """Log a file or folder; spooled (copied at once by the sender) when a callback is open for the run."""
    if (callback := open_callback(identity)) is not None:
        callback.log_artifact(path, artifact_path)
        return
    mlflow_client(identity["tracking_uri"]).log_artifact(identity["run_id"], str(path), artifact_path)


def finish_run(identity: dict[str, Any], status: str = "FINISHED") -> None:
    """Set the run's final status; spooled (after everything logged before it) when a callback is open."""
    if (callback := open_callback(identity)) is not None:
        callback.set_status(status)
        return
    mlflow_client(identity["tracking_uri"]).set_terminated(identity["run_id"], status=status)


# MLflow run id -> the callback delivering that run's spool in this process.
_OPEN: dict[str, "MLflowCallback"] = {}


class MLflowCallback(TrainerCallback):
    """Sends every ``on_log`` metrics dict to an MLflow run through a spool; never waits on MLflow
    during training (see the module docstring). Every send is written and ``fsync``'d to the spool
    before it returns; a spool write that fails (a full disk) is logged and retried by the sender.

    ``spool_dir``: the spool lives in ``spool_dir/<mlflow run id>/`` (default
    ``.comlrl/tracking`` under the working directory; the pipeline uses ``runs/<run_id>/tracking``).
    ``drain_timeout``: the most seconds all end-of-run waits for delivery take together.
    ``retry_interval`` / ``max_retry_interval``: the sender's backoff while the server is down.
    ``send_interval``: seconds between the sender's deliveries (a flush or close delivers at once).
    A spool left by an earlier process for the same run is delivered first. A checkpoint keeps how far
    the spool had come (:meth:`state_dict`); a run resumed from it does not log again a (key, step) spooled
    before that, and its values supersede what an earlier attempt spooled after it (the module docstring).
    """

    def __init__(self, identity: dict[str, Any], spool_dir: str | Path | None = None, drain_timeout: float = 20.0,
                 retry_interval: float = 1.0, max_retry_interval: float = 5.0, send_interval: float = 0.5) -> None:
        if drain_timeout < 0:
            raise ValueError(f"MLflowCallback drain_timeout must be >= 0 seconds, got {drain_timeout}")
        bound_http_retries()
        self.identity = identity
        self.drain_timeout = drain_timeout
        self._wait_left = drain_timeout
        directory = Path(spool_dir if spool_dir is not None else Path(".comlrl") / "tracking") / identity["run_id"]
        if (previous := _OPEN.get(identity["run_id"])) is not None:
            # A new flow run of the same run in this process (a resume): the new callback takes over;
            # what the old one still holds stays in the shared spool and is delivered by the new one.
            same = previous.spool.directory.resolve() == directory.resolve()
            previous.close(timeout=0.0 if same else None, warn=not same)
        self.spool = Spool(directory, identity)
        self.sender = Sender(self.spool, identity["tracking_uri"], interval=send_interval,
                             retry_interval=retry_interval, max_retry_interval=max_retry_interval)
        self._resumed_at: int | None = None  # spool bytes when the checkpoint being restored was taken
        self.kept_steps: dict[str, int] = {}  # key -> the last step of the resumed history (not logged again)
        self.skipped_values = 0
        self.superseded_values = 0  # points of an earlier attempt that this run's values replace
        self.earlier_values: dict[tuple[str, int], float] = {}  # (key, step) -> that attempt's latest value
        self.repeated_values = 0  # this run's points equal to an earlier attempt's: not logged again
        self._timestamp_floor = 0  # a superseding point is later than every point it may supersede
        self.closed = False
        _OPEN[identity["run_id"]] = self

    # ----- what the trainer and the flow send: durable spool appends ----------------------------
    def on_log(self, trainer: Any, metrics: dict[str, float], step: int) -> None:
        """Spool ``metrics`` of ``step``; on disk when this returns. A value of a key whose resumed history
        (spooled before the checkpoint this run resumed from) reaches this step is not logged again.
        A NaN or inf is logged as it is (MLflow keeps NaN, and stores +-inf as +-1.797e308)."""
        now_ms, skipped_before = max(int(time.time() * 1000), self._timestamp_floor), self.skipped_values
        entries = []
        for name, value in metrics.items():
            key = name.replace("@", "_")
            if key in self.kept_steps and step <= self.kept_steps[key]:
                self.skipped_values += 1
                continue
            if same_value(self.earlier_values.get((key, int(step))), float(value)):
                self.repeated_values += 1  # an earlier attempt logged this very point: once is the record
                continue
            entries.append([key, float(value), now_ms, int(step)])
        if skipped_before == 0 < self.skipped_values:
            logger.info("MLflow run %s: step %d and the steps after it that %s held when the run's checkpoint was "
                        "taken are not logged again", self.identity["run_id"], step, self.spool.path)
        if entries:
            self._put({"metrics": entries})

    def log_params(self, params: dict[str, Any]) -> None:
        self._put({"params": [[key, value] for key, value in flatten(params).items()]})

    def set_tags(self, tags: dict[str, Any]) -> None:
        self._put({"tags": [[key, str(value)[:5000]] for key, value in tags.items()]})

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._put({"artifact_source": str(Path(path).resolve()), "artifact_path": artifact_path})

    def set_status(self, status: str = "FINISHED") -> bool:
        """Spool the run's final ``status`` (delivered after everything sent before it). On a closed callback (the
        end of a run closes it before registration) it is delivered here, at once: MLflow's side of the run may
        already read another status (``mlflow.start_run`` ends the run it reopened FINISHED, or FAILED, as its
        block exits), which a status waiting in the spool would leave standing. Whether it was delivered (an open
        callback: whether it was spooled; its close delivers it)."""
        record = {"status": status, "end_time": int(time.time() * 1000)}
        if self.closed:
            return self._deliver_now(record)
        self._put(record)
        return not self.sender.unwritten

    def _deliver_now(self, record: dict[str, Any]) -> bool:
        """``record`` spooled and the spool delivered from this thread, within :attr:`drain_timeout` seconds (at
        least one); when the spool cannot take it (a full disk), sent straight to MLflow, and not kept for
        ``comlrl sync``. Whether MLflow took it; a warning says what was left where when it did not."""
        uri, run_id = self.identity["tracking_uri"], self.identity["run_id"]
        spooled = False

        def deliver() -> None:
            nonlocal spooled
            self.spool.lock()  # the sender released it when the callback closed
            try:
                try:
                    self.spool.append([record])
                    spooled = True
                except OSError as error:
                    logger.warning("tracking spool %s cannot take MLflow run %s's status %s (%s); sent to MLflow "
                                   "directly", self.spool.path, run_id, record["status"], error)
                    mlflow_client(uri).set_terminated(run_id, record["status"], record["end_time"])
                    return
                self.spool.deliver(mlflow_client(uri))
            finally:
                self.spool.unlock()

        try:
            call_with_deadline(deliver, f"MLflow at {uri}", max(self.drain_timeout, 1.0))
            return True
        except Exception as error:
            kept = (f"it waits in {self.spool.path}: {executable('comlrl')} sync {self.spool.directory} delivers it"
                    if spooled else "a resume of the run sets its status")
            logger.warning("MLflow run %s could not be marked %s (%s); %s", run_id, record["status"],
                           str(error)[:300], kept)
            return False

    def _put(self, record: dict[str, Any]) -> None:
        self.sender.put(record)
        self.sender.write_queued()  # durable before the send returns; a failed write stays queued
        if self.closed:  # nobody delivers any more: it waits in the spool for `comlrl sync`
            logger.warning("MLflowCallback of run %s is closed; a record sent afterwards waits in %s",
                           self.identity["run_id"], self.spool.path)

    # ----- the end of a run: bounded waits ------------------------------------------------------
    def on_train_begin(self, trainer: Any) -> None:
        trainer.record_tracking_run("mlflow", self.identity)  # checkpoints name the run; a resume logs to it again
        self._continue_history()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the callback: how far the run's spool had come when it was taken."""
        return {"run_id": self.identity["run_id"], "spool_bytes": self.spool.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a checkpoint of this MLflow run: the metric points spooled before it are its history."""
        if state.get("run_id") == self.identity["run_id"]:
            self._resumed_at = min(int(state["spool_bytes"]), self.spool.size)

    def _continue_history(self) -> None:
        """Split what the spool holds at the start of training: the resumed history (before the checkpoint's
        offset; nothing for a run that did not resume) and the points an earlier attempt logged after it."""
        resumed, self._resumed_at = self._resumed_at, None  # this start's, not the next one's
        # a new MLflow run continuing a vanished one starts with the history its spool was given (flows.new_mlflow_run)
        cut = resumed if resumed is not None else (self.identity.get("history_bytes") or self.spool.header_end)
        self.kept_steps, self.superseded_values, superseded_steps, latest = {}, 0, set(), 0
        self.earlier_values = {}
        for end, (key, value, timestamp, step) in self.spool.metric_points():
            latest = max(latest, int(timestamp))
            if end <= cut:
                self.kept_steps[key] = max(int(step), self.kept_steps.get(key, int(step)))
            else:
                self.superseded_values += 1
                superseded_steps.add(int(step))
                self.earlier_values[(key, int(step))] = float(value)
        self._timestamp_floor = latest + 1
        if superseded_steps:
            logger.warning("MLflow run %s: %d metric values that an earlier attempt logged after %s (steps %d-%d) give "
                           "way to this run's values where it logs the same steps and another value (MLflow keeps "
                           "both points, the later one is the value); the same value is not logged twice", self.identity["run_id"], self.superseded_values,
                           "the checkpoint restored" if resumed is not None else "the run's start",
                           min(superseded_steps), max(superseded_steps))

    def on_train_end(self, trainer: Any) -> None:
        self.flush()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything sent so far is delivered, at most ``timeout`` seconds (and never
        beyond what is left of ``drain_timeout``); whether it was."""
        budget = self._wait_left if timeout is None else min(timeout, self._wait_left)
        started = time.monotonic()
        delivered = self.sender.wait_delivered(max(budget, 0.0))
        self._wait_left = max(0.0, self._wait_left - (time.monotonic() - started))
        return delivered

    def close(self, timeout: float | None = None, warn: bool = True) -> bool:
        """Flush (bounded as :meth:`flush`), stop the sender and return whether everything was
        delivered; if not, the spool keeps it and ``warn`` logs :meth:`undelivered_message`."""
        if self.closed:
            return self.sender.delivered
        delivered = self.flush(timeout)
        self.sender.stop()
        self.closed = True
        if _OPEN.get(self.identity["run_id"]) is self:
            del _OPEN[self.identity["run_id"]]
        if not delivered and warn:
            logger.warning(self.undelivered_message())
        return delivered

    def undelivered_message(self) -> str:
        records = list(self.spool.pending())
        metrics = sum(len(r.get("metrics", ())) for _, r in records)
        artifacts = sum("artifact" in r for _, r in records)
        reason = f" (last error: {str(self.sender.last_error)[:200]})" if self.sender.last_error else ""
        unwritten = self.sender.unwritten
        lost = (f" But {unwritten} more records could not be written to the spool ({self.sender.write_error}) "
                f"and are lost with this process." if unwritten else "")
        return (f"MLflow at {self.identity['tracking_uri']} did not take all of run {self.identity['run_id']}'s "
                f"records within {self.drain_timeout:g} s{reason}. Training is unaffected and the spool keeps them: "
                f"{len(records)} records ({metrics} metric values, {artifacts} artifacts) wait in {self.spool.path}. "
                f"Once the server answers, replay them into the same run with:  {executable('comlrl')} sync {self.spool.directory}"
                f"{lost}")

    def unavailable(self) -> TrackingUnavailable:
        return TrackingUnavailable(self.undelivered_message(), self.spool.directory)


def close_all(timeout: float | None = None, warn: bool = True) -> bool:
    """Close every open :class:`MLflowCallback` of this process (also run at interpreter exit);
    whether all of them delivered everything."""
    return all([callback.close(timeout, warn) for callback in list(_OPEN.values())])


atexit.register(close_all)


def same_value(earlier: float | None, value: float) -> bool:
    """Whether ``value`` repeats a point already logged (NaN repeats NaN)."""
    return earlier is not None and (earlier == value or (earlier != earlier and value != value))


def logged_metrics(callback: MLflowCallback, prefix: str = "") -> dict[str, list[tuple[int, float]]]:
    """``key -> [(step, value), ...]`` (by step) of every metric named ``prefix...`` in the run's spool: what
    every process of the run logged, delivered or not, the latest point of each (key, step) (a resumed run's
    value over a dead attempt's, see the module docstring): the MLflow run's metrics whatever crashes and
    resumes came between."""
    points: dict[str, dict[int, float]] = {}
    for _, (key, value, _, step) in callback.spool.metric_points():
        if key.startswith(prefix):
            points.setdefault(key, {})[int(step)] = float(value)
    return {key: sorted(values.items()) for key, values in points.items()}


def metric_history(tracking_uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    """``[(step, value), ...]`` (by step) of ``key`` in an MLflow run as a reader should take it: each step's
    latest point, which supersedes what an attempt that died after its last checkpoint logged there."""
    latest: dict[int, tuple[int, float]] = {}
    for point in mlflow_client(tracking_uri).get_metric_history(run_id, key):
        if point.step not in latest or point.timestamp >= latest[point.step][0]:
            latest[point.step] = (point.timestamp, point.value)
    return [(step, value) for step, (_, value) in sorted(latest.items())]


def training_points(history: Sequence[dict[str, float]], metric: str = "reward_mean") -> list[tuple[int, float]]:
    """``(step, value)`` of ``metric`` in every row of ``history`` that has it: the training curve."""
    return [(row["step"], row[metric]) for row in history if metric in row and "step" in row]


def reward_curve(history: Sequence[dict[str, float]], path: str | Path, metric: str = "reward_mean",
                 evaluations: Sequence[tuple[int, float]] = ()) -> Path:
    """A PNG of ``metric`` over the steps of ``history`` (:func:`training_points`), and of ``evaluations``
    (``(step, eval reward)`` pairs, one per evaluation) on the same axes."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    points = training_points(history, metric)
    figure, axes = pyplot.subplots(figsize=(6, 3.5))
    if points:
        axes.plot([s for s, _ in points], [v for _, v in points], marker=".", linewidth=1, label=f"{metric} (train)")
    if evaluations:
        axes.plot([s for s, _ in evaluations], [v for _, v in evaluations], marker="o", linewidth=1.5,
                  label="eval reward")
        axes.legend(loc="best", fontsize="small")
    axes.set_xlabel("step")
    axes.set_ylabel(metric)
    axes.set_title(f"{metric} per training step" + (" and eval reward" if evaluations else ""))
    axes.grid(alpha=0.3)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    return path


def write_table(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """``rows`` as a JSON table in the shape MLflow's ``log_table`` writes (``columns``, ``data``), which its UI
    shows as a table; columns in first-seen order, a missing cell as null."""
    import json

    columns = list(dict.fromkeys(key for row in rows for key in row))
    table = {"columns": columns, "data": [[row.get(column) for column in columns] for row in rows]}
    path = Path(path)
    path.write_text(json.dumps(table, indent=1, default=str), encoding="utf-8")
    return path


def agent_model_names(base: str, num_agents: int) -> list[str]:
    """Registered-model names, one per agent role."""
    return [f"{base}-agent-{index}" for index in range(num_agents)]


def register_agents(
    identity: dict[str, Any],
    models: Sequence[Any],
    tokenizers: Sequence[Any],
    base_name: str,
    tags: dict[str, str],
    alias: str | None = "candidate",
    input_example: str | None = None,
    signature: Any = None,
    prompt_limits: Sequence[int | None] | None = None,
) -> list[dict[str, str]]:
    """Log every agent as a ``text-generation`` model in the run (with ``input_example``, a prompt, and
    ``signature``; MLflow infers the signature by generating when it is None), register it as
    ``<base_name>-agent-<i>``, tag the version and point ``alias`` at it (None: no alias) (once per run: a repeated
    call reuses the run's versions and tags them again). ``prompt_limits`` (one per agent, None: unbounded): the prompt tokens the served
    model keeps (:func:`left_truncating`), the rollout's bound (``comlrl.rollout.generation.prompt_token_limit``)."""
    import mlflow

    client = mlflow_client(identity["tracking_uri"])
    mlflow.set_tracking_uri(identity["tracking_uri"])
    registered = []
    for index, (model, tokenizer, name) in enumerate(zip(models, tokenizers, agent_model_names(base_name, len(models)))):
        # Idempotent: a re-run of a finished run finds the version it registered before.
        existing = [v for v in client.search_model_versions(f"name = '{name}'") if v.run_id == identity["run_id"]]
        if existing:
            version = str(existing[0].version)
        else:
            tokenizer, model_config = left_truncating(tokenizer, prompt_limits[index] if prompt_limits else None)
            with mlflow.start_run(run_id=identity["run_id"]):
                info = mlflow.transformers.log_model(
                    transformers_model={"model": model, "tokenizer": tokenizer},
                    name=f"agent_{index}",
                    task="text-generation",
                    pip_requirements=MODEL_REQUIREMENTS,
                    registered_model_name=name,
                    input_example=input_example,
                    signature=signature,
                    model_config=model_config,
                )
            version = str(info.registered_model_version)
        # Every call, the version found too: a registration stopped between the version and its tags is completed.
        for key, value in {**tags, "agent_index": str(index), RUN_KEY_TAG: tags.get(RUN_KEY_TAG, "")}.items():
            client.set_model_version_tag(name, version, key, value)
        if alias is not None:
            client.set_registered_model_alias(name, alias, version)
        registered.append({"name": name, "version": version, "alias": alias,
                           "uri": f"models:/{name}@{alias}" if alias else f"models:/{name}/{version}"})
    return registered


def left_truncating(tokenizer: Any, limit: int | None) -> tuple[Any, dict[str, Any] | None]:
    """A copy of ``tokenizer`` that truncates on the left, and the pipeline settings (MLflow's ``model_config``,
    saved with the model) that ask it for at most ``limit`` prompt tokens: a served agent keeps a prompt's last
    ``limit`` tokens, as the rollout does. ``(tokenizer, None)`` without a limit."""
    if limit is None:
        return tokenizer, None
    bounded = copy.deepcopy(tokenizer)  # the trainer's own tokenizer stays as it is
    bounded.truncation_side = "left"
    bounded.init_kwargs["truncation_side"] = "left"  # what save_pretrained writes, so loading keeps it
    return bounded, {"tokenizer_encode_kwargs": {"truncation": True, "max_length": int(limit)}}


def promote(
    tracking_uri: str,
    names: Sequence[str],
    from_alias: str = "candidate",
    to_alias: str = "champion",
) -> list[dict[str, str]]:
    """Point ``to_alias`` at the version ``from_alias`` names, for every registered model in ``names``
    (:func:`move_aliases`, in that order); nothing moves unless every model has a ``from_alias`` version."""
    client = mlflow_client(tracking_uri)
    versions = {}
    for name in names:  # resolve them all first: a missing alias changes nothing
        try:
            versions[name] = str(client.get_model_version_by_alias(name, from_alias).version)
        except Exception as error:
            if not permanent_error(error):  # no answer is not "no alias": the caller tells them apart
                raise
            raise ValueError(f"registered model {name!r} has no version with alias {from_alias!r}: {error}") from None
    return move_aliases(tracking_uri, versions, to_alias)


def move_aliases(tracking_uri: str, versions: Mapping[str, str], to_alias: str) -> list[dict[str, str]]:
    """Point ``to_alias`` of each registered model at its version in ``versions``, one model after another in
    the order given. The previous holder is kept as tag ``previous_<to_alias>`` on the registered model, so a
    move can be rolled back by hand."""
    client = mlflow_client(tracking_uri)
    moved = []
    for name, version in versions.items():
        try:
            previous = client.get_model_version_by_alias(name, to_alias).version
        except Exception as error:
            if not permanent_error(error):
                raise
            previous = None
        if previous is not None and str(previous) != str(version):
            client.set_registered_model_tag(name, f"previous_{to_alias}", str(previous))
        client.set_registered_model_alias(name, to_alias, str(version))
        moved.append({"name": name, "version": str(version), "previous": str(previous) if previous else None})
    return moved


def aliased_versions(tracking_uri: str, names: Sequence[str], alias: str) -> dict[str, str] | None:
    """``name -> version`` for every name holding ``alias``, or ``None`` if any lacks it."""
    client = mlflow_client(tracking_uri)
    found = {}
    for name in names:
        try:
            found[name] = str(client.get_model_version_by_alias(name, alias).version)
        except Exception as error:
            if not permanent_error(error):  # an unreachable server raises; only a refusal means "no alias"
                raise
            return None
    return found


def export_registered_model(tracking_uri: str, uri: str, directory: str | Path) -> Path:
    """Load ``models:/NAME@alias`` (or ``/version``) and save it as a Hugging Face directory
    that trainers take as ``agent_model`` / ``agents`` entries."""
    import mlflow

    directory = Path(directory)
    if (directory / "config.json").is_file():
        return directory
    mlflow.set_tracking_uri(tracking_uri)
    components = mlflow.transformers.load_model(uri, return_type="components")
    staging = directory.with_name(directory.name + ".partial")
    components["model"].save_pretrained(staging, safe_serialization=True)
    components["tokenizer"].save_pretrained(staging)
    staging.rename(directory)
    return directory
