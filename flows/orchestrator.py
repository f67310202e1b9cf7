"""The Prefect server as a dependency that can go away mid-run: bounded waits and a bounded exit.

Once a flow run has started, training goes on without the Prefect server: task-run states travel
as events that Prefect's ``EventsWorker`` queues in memory, boundary records live in local result
storage and checkpoints on disk, so a run whose server dies still reaches its last boundary. What
waits on the server is its API calls, each retried with exponential backoff (about a minute with
Prefect's defaults; the flow run's final state is one of them), and, at interpreter exit,
Prefect's hook that sends every queued event and log record, which never gives up (each event is
retried for about seven seconds and a long run queues thousands). The CLI bounds both:

- :func:`bound_client_waits` (called before Prefect is imported) sets ``PREFECT_CLIENT_MAX_RETRIES``
  and ``PREFECT_API_REQUEST_TIMEOUT`` (:data:`CLIENT_BOUNDS`) unless the environment sets them;
- :func:`exit_if_unreachable`, after the flow, asks the server's ``/health``; when it does not
  answer, Prefect's own ``QueueService.drain_all(timeout=...)`` gets ``drain_timeout`` seconds for
  the queued events and logs, what is left is dropped with one warning, and the process ends at
  once (``os._exit``: Prefect's exit hook would wait for every item) with status
  :data:`EXIT_ORCHESTRATOR_UNREACHABLE`. Checkpoints are on disk; ``comlrl resume`` continues.
"""

from __future__ import annotations

import os
import sys
import time
import urllib.request
from pathlib import Path

EXIT_ORCHESTRATOR_UNREACHABLE = 69  # sysexits' EX_UNAVAILABLE: a service the command needs is down
# One retry (after about 2 s) rides out a dropped connection; during an outage every API call of
# the flow (state changes, artifacts) then costs about 2 s instead of Prefect's default minute.
CLIENT_BOUNDS = {"PREFECT_CLIENT_MAX_RETRIES": "1", "PREFECT_API_REQUEST_TIMEOUT": "30"}
DRAIN_TIMEOUT = 10.0  # seconds for Prefect's queued events and logs once the server is found down


def bound_client_waits() -> dict[str, str]:
    """Set :data:`CLIENT_BOUNDS` where the environment does not; call before importing prefect."""
    applied = {key: value for key, value in CLIENT_BOUNDS.items() if key not in os.environ}
    os.environ.update(applied)
    return applied


def reachable(api_url: str, timeout: float = 3.0) -> bool:
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


def exit_if_unreachable(run_id: str, workdir: str, error: BaseException | None = None,
                        drain_timeout: float = DRAIN_TIMEOUT) -> None:
    """Return when no Prefect server is configured or it answers; otherwise end the process with
    :data:`EXIT_ORCHESTRATOR_UNREACHABLE` after at most 3 s (the health check) + ``drain_timeout``
    (+ what is left of the drain timeout of an MLflowCallback still open), with one warning saying
    what was dropped and how to resume ``run_id``."""
    api_url = os.environ.get("PREFECT_API_URL")
    if not api_url or reachable(api_url):
        return
    from comlrl import tracking

    tracking.close_all()  # the MLflow spools are on disk either way; this delivers what it can
    started = time.monotonic()
    left = _drain_prefect_services(drain_timeout)
    dropped = "its queued events and logs" if left < 0 else f"{left} queued Prefect events and log records"
    cause = f" ({type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''})" if error else ""
    run = Path(workdir) / "runs" / run_id
    if (run / "spec.yaml").is_file():
        then = (f"Training state is safe: every completed boundary's checkpoint is under {run / 'checkpoints'}. "
                f"Restart the server, then finish the run from its last checkpoint with:  "
                f"comlrl resume {run_id} --workdir {workdir}")
    else:
        then = "The run had not started. Run the same command again once the server answers."
    sys.stdout.flush()
    print(f"\ncomlrl: the Prefect server at {api_url} is unreachable{cause}; dropped {dropped} after waiting "
          f"{time.monotonic() - started:.0f} s (the server may show this flow run as still running). {then}   "
          f"(exit status {EXIT_ORCHESTRATOR_UNREACHABLE}: orchestrator unreachable)", file=sys.stderr)
    sys.stderr.flush()
    os._exit(EXIT_ORCHESTRATOR_UNREACHABLE)
