"""Scheduled retraining: a flow that continues from the registry's champion, and how it is served.

``retrain_flow`` names each run after its scheduled time, so every schedule slot is its own
resumable run (a Prefect retry of that flow run resumes it), and starts the agents from the
current ``champion`` versions (the spec's models before the first promotion). Like every run it
ends at the champion/challenger gate (:mod:`flows.gate`): the retrained team replaces the
champion only if it evaluates at least as well on the spec's eval set. When the Prefect server has
stopped answering by the end of the run, the flow-run process ends as ``comlrl run`` does
(:func:`flows.orchestrator.exit_if_unreachable`: status 69 within a bound, checkpoints on disk),
instead of waiting for ever in Prefect's exit hook; the worker or ``comlrl serve`` sees it exit with
status 69, and ``comlrl resume RUN_ID`` finishes the run (tests/test_deployment_hang.py).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from flows.orchestrator import exit_if_unreachable
from flows.spec import load_spec
from flows.training import training_flow


@flow(name="comlrl-retrain", log_prints=True)
def retrain_flow(spec_path: str, workdir: str = ".comlrl", root: str | None = None,
                 tracking_uri: str | None = None, alias: str = "champion") -> dict[str, Any]:
    """Retrain the spec's agents starting from the registry's ``alias`` versions."""
    scheduled = flow_run.scheduled_start_time or datetime.now(timezone.utc)
    spec = load_spec(spec_path, root)
    run_id = f"{spec.name}-retrain-{scheduled:%Y%m%dT%H%M%S}"
    try:
        result = training_flow(spec)(spec_path=spec_path, run_id=run_id, workdir=workdir, root=root,
                                     tracking_uri=tracking_uri, init_from_alias=alias)
    except Exception as error:
        exit_if_unreachable(run_id, workdir, error)  # as `comlrl run`: a hung server ends this process (69)
        raise
    exit_if_unreachable(run_id, workdir)  # a worker's or `comlrl serve`'s flow-run process: the same bounded exit
    return result


def serve(spec_path: str, cron: str, workdir: str, root: str, tracking_uri: str | None, name: str) -> None:
    """Serve ``retrain_flow`` as a deployment on ``cron`` (needs a Prefect server: PREFECT_API_URL)."""
    retrain_flow.serve(
        name=name,
        cron=cron,
        parameters={"spec_path": spec_path, "workdir": workdir, "root": root, "tracking_uri": tracking_uri},
        description="Scheduled retraining from the registry's champion agents.",
        tags=["comlrl", "retrain"],
    )
