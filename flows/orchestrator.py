"""The Prefect server as a dependency that can go away or hang mid-run: bounded waits and a bounded exit.

Once a flow run has started, training goes on without the Prefect server: task-run states travel
as events that Prefect's ``EventsWorker`` queues in memory, boundary records live in local result
storage and checkpoints on disk, so a run whose server dies still reaches its last boundary. What
waits on the server is its API calls (a boundary subflow's start and end, artifacts, the flow
run's final state) and, at interpreter exit, Prefect's hook that sends every queued event and log
record, which never gives up (each event is retried for about seven seconds and a long run queues
thousands). A server that hangs (accepts connections, never answers) makes every call wait for its
whole timeout, so the deadlines are what bound a run:

- :func:`bound_client_waits` (called before Prefect is imported) sets ``PREFECT_API_REQUEST_TIMEOUT``
  (seconds one request may take) and ``PREFECT_CLIENT_MAX_RETRIES`` (:data:`CLIENT_BOUNDS`) unless
  the environment sets them: one call to a server that never answers gives up after two timeouts
  and Prefect's 2 s backoff, about 22 s with the defaults (Prefect's own: 60 s and 5 retries);
- the first call that gets no answer (:func:`unanswered`: no connection, or none in time), or a health
  check before a boundary (:func:`answers`) that gets none within one request timeout, records an
  outage for the rest of the run (:func:`record_outage`): the remaining boundaries run inside the flow
  run, without subflows, and artifacts are skipped, so training waits on a hung server for at most
  one call;
- :func:`exit_if_unreachable`, after the flow, asks the server's ``/health``; when it does not
  answer, Prefect's own ``QueueService.drain_all(timeout=...)`` gets ``drain_timeout`` seconds for
  the queued events and logs, what is left is dropped with one warning, and the process ends at
  once (``os._exit``: Prefect's exit hook would wait for every item) with status
  :data:`EXIT_ORCHESTRATOR_UNREACHABLE`. Checkpoints are on disk; ``comlrl resume`` continues.

:func:`await_task_recorded` lets a boundary subflow start once the server has written the states
of the tasks before it (see there). :func:`crash_stale_flow_runs` closes, when a run is resumed,
the flow runs of the same run that an outage left "Running" on the server.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

from comlrl.executables import executable

EXIT_ORCHESTRATOR_UNREACHABLE = 69  # sysexits' EX_UNAVAILABLE: a service the command needs is down
# One retry (after about 2 s) rides out a dropped connection or a locked database; a request gets
# 10 s (Prefect's default: 60), so a call to a server that accepts connections but never answers
# gives up after about 22 s, and one to a server that is gone after about 2 s.
CLIENT_BOUNDS = {"PREFECT_CLIENT_MAX_RETRIES": "1", "PREFECT_API_REQUEST_TIMEOUT": "10"}
DRAIN_TIMEOUT = 10.0  # seconds for Prefect's queued events and logs once the server is found down
RECORDER_WAIT = 1.0  # seconds a boundary subflow waits at most for the server to record the task before it


def bound_client_waits() -> dict[str, str]:
    """Set :data:`CLIENT_BOUNDS` where the environment does not; call before importing prefect."""
    applied = {key: value for key, value in CLIENT_BOUNDS.items() if key not in os.environ}
    os.environ.update(applied)
    return applied


def request_timeout() -> float:
    """Seconds one request to the Prefect API may take (``PREFECT_API_REQUEST_TIMEOUT``), health checks included."""
    from prefect.settings import PREFECT_API_REQUEST_TIMEOUT

    return float(PREFECT_API_REQUEST_TIMEOUT.value())


# Why this run stopped calling the Prefect server (None while it answers). Per process, like Prefect's
# client and its settings; a new run (clear_outage) starts by trusting the server again.
_outage: str | None = None


def outage() -> str | None:
    """Why the server was found not answering during this run (None: no outage seen)."""
    return _outage


def record_outage(cause: BaseException | str) -> None:
    """Stop calling the Prefect server for the rest of the run (the first cause is kept; the run says what
    it does without the server, and :func:`exit_if_unreachable` what to do)."""
    global _outage
    if _outage is None:
        _outage = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else cause


def causes(error: BaseException | None, limit: int = 10) -> Iterator[BaseException]:
    """``error`` and the errors that caused it, nearest first (at most ``limit``: a chain, not a cycle)."""
    for _ in range(limit):
        if error is None:
            return
        yield error
        error = error.__cause__ or error.__context__


def unanswered(error: BaseException | None) -> bool:
    """Whether ``error``, or an error that caused it, says the server gave no answer (no connection, or
    none in time) rather than an answer it did not like (an HTTP error status)."""
    import httpx

    return any(isinstance(cause, (httpx.TransportError, OSError)) for cause in causes(error))


def prefect_api_unanswered(error: BaseException | None) -> bool:
    """Whether ``error`` or one of its causes is a request to this process's Prefect API that got no answer
    (``PREFECT_API_URL``): an outage of the orchestrator, not a failure of the run's own work."""
    import httpx

    api_url = os.environ.get("PREFECT_API_URL", "").rstrip("/")
    if not api_url:
        return False
    for cause in causes(error):
        if isinstance(cause, httpx.TransportError):
            try:
                if str(cause.request.url).startswith(api_url):
                    return True
            except RuntimeError:  # an error raised without its request
                pass
    return False


class OutageTracebacks(logging.Filter):
    """Keeps the console line of a record whose error is a Prefect API call that got no answer, without its
    traceback (tens of lines each): the run reports the outage once, in its own words. Other errors keep
    theirs."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and prefect_api_unanswered(record.exc_info[1]):
            record.exc_info = record.exc_text = None
        return True


def quiet_outage_tracebacks() -> None:
    """Put :class:`OutageTracebacks` on Prefect's console handlers (the root logger's, once Prefect has set up
    logging in this process); call again after a logging reset, it is added once per handler."""
    from prefect.logging.handlers import PrefectConsoleHandler

    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler) and not any(
                isinstance(f, OutageTracebacks) for f in handler.filters):
            handler.addFilter(OutageTracebacks())


def clear_outage() -> None:
    """Trust the server again: a new run starts here."""
    global _outage
    _outage = None


def answers() -> bool:
    """Whether the run may call the Prefect server: no outage recorded, and ``/health`` answers within
    :func:`request_timeout` (no server configured: True). A server that does not is recorded down."""
    if _outage is not None:
        return False
    api_url = os.environ.get("PREFECT_API_URL")
    if not api_url or reachable(api_url, request_timeout()):
        return True
    record_outage(f"no answer from {api_url.rstrip('/')}/health within {request_timeout():g} s")
    return False


def await_task_recorded(task_run_id: Any, timeout: float = RECORDER_WAIT, poll: float = 0.02) -> bool:
    """Wait until the Prefect API shows task run ``task_run_id`` in a final state, at most ``timeout``
    seconds; whether it does (False also when the API cannot be asked; one that does not answer is
    recorded down, :func:`record_outage`).

    Task-run states reach a Prefect 3 server as events, which its task-run recorder writes to the
    database a moment later. A subflow started while the recorder is still writing has its first
    API write (the subflow's task run in the parent) refused by a locked SQLite database (HTTP 503),
    and Prefect's client retries it only after about 2 s: measured on the embedded default, about
    one boundary start in four (benchmarks/README.md, "Orchestration overhead"). The task a flow
    ran last is the last one the recorder writes, so one or a few reads of it (tens of
    milliseconds) avoid that wait.
    """
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    deadline = time.monotonic() + timeout
    try:
        with get_client(sync_client=True) as client:
            while True:
                try:
                    state = client.read_task_run(task_run_id).state
                except ObjectNotFound:  # its first event is not written yet
                    state = None
                if state is not None and state.is_final():
                    return True
                if time.monotonic() + poll > deadline:
                    return False
                time.sleep(poll)
    except Exception as error:
        if unanswered(error):  # no subflow is started
            record_outage(error)
        return False


def crash_stale_flow_runs(run_id: str, flow_run_id: Any, flow_run_name: str,
                          flow_name: str = "comlrl-train") -> list[str]:
    """Mark ``Crashed`` the earlier flow runs of run ``run_id`` (flow ``flow_name``, run name ``run_id``)
    that the server still shows Running or Pending, and their boundary subflows likewise, with a
    message naming the flow run ``flow_run_id`` that resumed them; returns their ids.

    Call it only while holding the run's lock (:class:`flows.runs.RunLock`): then no other process
    trains this run, so such flow runs are left over from a process that is gone (a server that
    went away mid-run never learned how its flow run ended). Best effort: when the API cannot be
    asked, nothing is marked and the run goes on.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterName,
                                                FlowRunFilterParentFlowRunId, FlowRunFilterState,
                                                FlowRunFilterStateType)
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    unfinished = FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING, StateType.PENDING]))
    message = (f"its process is gone (the server lost track of it); flow run {flow_run_name!r} ({flow_run_id}) "
               "resumed the run")
    marked: list[str] = []
    try:
        with get_client(sync_client=True) as client:
            stale = [run for run in client.read_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])),
                flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[run_id]), state=unfinished))
                if str(run.id) != str(flow_run_id)]
            if stale:
                stale += client.read_flow_runs(flow_run_filter=FlowRunFilter(
                    parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id for run in stale]), state=unfinished))
            for run in stale:
                client.set_flow_run_state(run.id, Crashed(message=message), force=True)
                marked.append(str(run.id))
    except Exception as error:
        logging.getLogger(__name__).warning("could not mark the earlier flow runs of %s Crashed: %s", run_id, error)
    return marked


def reachable(api_url: str, timeout: float) -> bool:
    """Whether the Prefect API at ``api_url`` answers its health check within ``timeout`` seconds."""
    try:
        with urllib.request.urlopen(f"{api_url.rstrip('/')}/health", timeout=timeout) as response:
            return response.status == 200
    except OSError:
        return False


def _drain_prefect_services(timeout: float) -> int:
    """Give Prefect's queue services (the events worker, the API log worker) ``timeout`` seconds
    through their own ``drain_all``; the number of items still queued afterwards (-1 when this
    Prefect release does not say)."""
    from prefect.events.worker import EventsWorker

    instances = list(getattr(EventsWorker, "_instances", {}).values())  # shared by every queue service
    EventsWorker.drain_all(timeout=timeout, at_exit=False)
    try:
        return sum(instance._queue.qsize() for instance in instances)
    except AttributeError:
        return -1


def exit_if_unreachable(run_id: str | None, workdir: str, error: BaseException | None = None,
                        drain_timeout: float = DRAIN_TIMEOUT) -> None:
    """Return when no Prefect server is configured or it answers; otherwise end the process with
    :data:`EXIT_ORCHESTRATOR_UNREACHABLE` after at most :func:`request_timeout` (the health check) +
    ``drain_timeout`` (+ what is left of the drain timeout of an MLflowCallback still open), with one warning saying
    what was dropped and how to resume ``run_id``."""
    api_url = os.environ.get("PREFECT_API_URL")
    if not api_url or reachable(api_url, request_timeout()):
        return
    from comlrl import tracking

    tracking.close_all()  # the MLflow spools are on disk either way; this delivers what it can
    started = time.monotonic()
    left = _drain_prefect_services(drain_timeout)
    dropped = "its queued events and logs" if left < 0 else f"{left} queued Prefect events and log records"
    why = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}" if error else outage()
    cause = f" ({why[:300]})" if why else ""
    run = Path(workdir) / "runs" / (run_id or "")  # None: --init-from derived it; not known here
    if run_id and (run / "spec.yaml").is_file():
        then = (f"Training state is safe: every completed boundary's checkpoint is under {run / 'checkpoints'}. "
                f"Restart the server, then finish the run from its last checkpoint with:  "
                f"{executable('comlrl')} resume {run_id} --workdir {workdir}")
    else:
        then = "The run had not started. Run the same command again once the server answers."
    sys.stdout.flush()
    print(f"\ncomlrl: the Prefect server at {api_url} is unreachable{cause}; dropped {dropped} after waiting "
          f"{time.monotonic() - started:.0f} s (the server may show this flow run as still running). {then}   "
          f"(exit status {EXIT_ORCHESTRATOR_UNREACHABLE}: orchestrator unreachable)", file=sys.stderr)
    sys.stderr.flush()
    os._exit(EXIT_ORCHESTRATOR_UNREACHABLE)
