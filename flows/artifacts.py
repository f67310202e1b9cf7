"""What an operator sees of a run in the Prefect UI: table, link and markdown artifacts, and MLflow URLs.

Every artifact of a run has a key derived from its run id (:func:`artifact_key`), so the
Artifacts page lists a run's table, links, gate decision and summary together and keeps one
version per flow run. The markdown is built by pure functions (:func:`summary_markdown`,
:func:`gate_markdown`) and published by thin wrappers. MLflow has web pages only behind a server:
for a local store the links point at ``http://127.0.0.1:5000``, where ``mlflow ui`` serves them.
"""

from __future__ import annotations

import contextvars
import logging
import queue
import re
import threading
import urllib.parse
from typing import Any, Callable, Sequence

from comlrl.tracking import is_local_store
from flows import orchestrator

LOCAL_MLFLOW_UI = "http://127.0.0.1:5000"
logger = logging.getLogger(__name__)


def best_effort(publish: Callable[..., Any], *args: Any) -> Any:
    """Call an artifact publisher; a failure costs the artifact (one warning), never the run. A server that
    does not answer records an outage (:func:`flows.orchestrator.record_outage`, reported once by the run),
    after which nothing is published."""
    if orchestrator.outage() is not None:
        return None
    try:
        return publish(*args)
    except Exception as error:
        if orchestrator.unanswered(error):  # no more artifacts are tried; the run reports the outage once
            orchestrator.record_outage(error)
        else:
            logger.warning("could not publish the Prefect artifact (%s: %s); the run goes on without it",
                           getattr(publish, "__name__", publish), error)
        return None


class BackgroundPublisher:
    """Publishes artifacts from a background thread, so the training thread does not wait on the API.

    Every :meth:`submit` is published, in the order submitted (a table artifact gets one version per
    boundary), through :func:`best_effort`, in a copy of the Prefect context it was submitted from
    (so an artifact belongs to the flow run that submitted it). :meth:`close` publishes what is
    left, waiting at most ``timeout`` seconds; whatever is still queued then is dropped with a warning.
    """

    def __init__(self, name: str = "artifact-publisher") -> None:
        self._queue: queue.Queue[tuple[contextvars.Context, Callable[..., Any], tuple[Any, ...]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=name)
        self._thread.start()
        self.closed = False

    def submit(self, publish: Callable[..., Any], *args: Any) -> None:
        if self.closed:
            best_effort(publish, *args)
            return
        self._queue.put((contextvars.copy_context(), publish, args))

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            context, publish, args = item
            context.run(best_effort, publish, *args)

    def close(self, timeout: float = 10.0) -> bool:
        """Publish what was submitted (at most ``timeout`` seconds, none during an outage); whether everything was."""
        if not self.closed:
            self.closed = True
            self._queue.put(None)
        self._thread.join(0 if orchestrator.outage() else timeout)
        if self._thread.is_alive():
            if orchestrator.outage() is None:  # an outage is reported once, when the run ends
                logger.warning("Prefect artifacts not published within %.0f s were dropped", timeout)
            return False
        return True


def artifact_key(run_id: str, what: str) -> str:
    """A Prefect artifact key (lowercase letters, digits and dashes) for ``what`` of run ``run_id``."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{run_id}-{what}".lower()).strip("-")[:120]


def mlflow_base_url(tracking_uri: str) -> str:
    return LOCAL_MLFLOW_UI if is_local_store(tracking_uri) else tracking_uri.rstrip("/")


def mlflow_run_url(identity: dict[str, Any]) -> str:
    return (f"{mlflow_base_url(identity['tracking_uri'])}/#/experiments/{identity['experiment_id']}"
            f"/runs/{identity['run_id']}")


def mlflow_version_url(tracking_uri: str, name: str, version: str) -> str:
    return f"{mlflow_base_url(tracking_uri)}/#/models/{urllib.parse.quote(name)}/versions/{version}"


def publish_table(run_id: str, rows: list[dict[str, Any]]) -> None:
    """The run's boundaries so far as a table artifact (a new version each boundary)."""
    from prefect.artifacts import create_table_artifact

    create_table_artifact(rows, key=artifact_key(run_id, "boundaries"),
                          description=f"Run {run_id}: reward, eval reward, loss, KL and checkpoint per boundary")


def publish_links(run_id: str, identity: dict[str, Any], registered: Sequence[dict[str, str]]) -> list[str]:
    """Link artifacts to the MLflow run and to every registered model version; returns the links."""
    from prefect.artifacts import create_link_artifact

    links = [(mlflow_run_url(identity), f"MLflow run {identity['run_id']}", "mlflow-run")]
    links += [(mlflow_version_url(identity["tracking_uri"], entry["name"], entry["version"]),
               f"{entry['name']} version {entry['version']}", f"model-{entry['name']}") for entry in registered]
    for link, text, what in links:
        create_link_artifact(link, link_text=text, key=artifact_key(run_id, what))
    return [link for link, _, _ in links]


def _cell(value: Any) -> str:
    if value is None:
        return "–"
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return "(none)"
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(column)) for column in columns) + " |" for row in rows]
    return "\n".join(lines)


def gate_markdown(decision: dict[str, Any]) -> str:
    verdict = "promoted to **champion**" if decision["promoted"] else "**not promoted**: the champion stays"
    return "\n".join([
        f"# Champion/challenger gate: {decision['candidate']} {verdict}",
        "",
        f"Reason: {decision['reason']}.",
        "",
        markdown_table([{"model": decision["candidate"], "role": "candidate",
                         decision.get("metric") or "eval": decision.get("candidate_score")},
                        {"model": decision.get("champion") or "(none)", "role": "champion",
                         decision.get("metric") or "eval": decision.get("champion_score")}]),
    ])


def publish_gate(run_id: str, decision: dict[str, Any]) -> None:
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(gate_markdown(decision), key=artifact_key(run_id, "gate"),
                             description=f"Run {run_id}: champion/challenger decision")


def summary_markdown(summary: dict[str, Any]) -> str:
    """The run's closing summary: what was trained, on what, the results, where the models are."""
    lines = [
        f"# {summary['name']} · run {summary['run_id']}",
        "",
        f"Trained **{summary['algorithm']}** with {summary['num_agents']} agents ({', '.join(summary['models'])}) "
        f"on `{summary['train']}` ({summary['train_rows']} rows), evaluated on `{summary['eval'] or 'nothing'}`"
        + (f" ({summary['eval_rows']} rows)" if summary.get("eval_rows") else "")
        + f"; {summary['steps']} steps, spec hash `{summary['spec_hash'][:12]}`.",
        "",
        "## Results",
        "",
        markdown_table(summary["boundaries"]),
        "",
        f"Final evaluation: {_cell(summary.get('eval_score'))} ({summary.get('eval_metric') or 'no eval set'}).",
        "",
        "## Models",
        "",
    ]
    gate = summary.get("gate")
    for entry in summary["registered"]:
        aliases = [entry["alias"]] + (["champion"] if gate and gate["promoted"] and entry["alias"] != "champion" else [])
        names = ", ".join(f"`{alias}`" for alias in aliases)
        lines.append(f"- [{entry['name']} v{entry['version']}]({entry['url']}) (alias{'es' if len(aliases) > 1 else ''} "
                     f"{names})")
    if gate:
        lines += ["", f"Gate: {'promoted to champion' if gate['promoted'] else 'not promoted'} ({gate['reason']})."]
    lines += ["", "## Where", "", f"- MLflow run: [{summary['mlflow_run_id']}]({summary['mlflow_run_url']})",
              f"- last checkpoint: `{summary['checkpoint']}`",
              f"- team model: `mlflow.pyfunc.load_model(\"models:/{summary['team']}@champion\")`"]
    return "\n".join(lines)


def publish_summary(run_id: str, summary: dict[str, Any]) -> str:
    from prefect.artifacts import create_markdown_artifact

    text = summary_markdown(summary)
    create_markdown_artifact(text, key=artifact_key(run_id, "summary"), description=f"Run {run_id}: summary")
    return text
