"""MLflow tracking of training runs: the run, buffered metrics, artifacts and the model registry.

MLflow is optional (the ``pipeline`` extra); it is imported only when one of these is used.

- :func:`open_run` finds or creates the MLflow run of a pipeline run (a resumed run logs into
  the run recorded in its checkpoint's metadata, see ``trainer.run_identity["mlflow"]``).
- :class:`MLflowCallback` sends the trainer's metrics; a tracking outage never stops training:
  metrics stay buffered (bounded) and are sent with the next successful call or at the end.
- :func:`register_agents` logs each agent as an MLflow ``transformers`` model, registers one
  model per agent role (``<name>-agent-<i>``) with run/algorithm/spec-hash tags and sets an
  alias (``candidate``); :func:`promote` moves ``champion`` to the candidate versions.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from pathlib import Path
from typing import Any, Sequence

from comlrl.callbacks import TrainerCallback

logger = logging.getLogger(__name__)

RUN_KEY_TAG = "comlrl.run_id"
# mlflow.transformers cannot infer requirements here (it trips over the missing torchvision),
# and a consumer needs only these to load an agent.
MODEL_REQUIREMENTS = ["torch", "transformers", "tokenizers", "safetensors", "accelerate"]


def _client(tracking_uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def is_local_store(tracking_uri: str) -> bool:
    """SQLite and file stores keep artifacts where the experiment says; a server manages its own."""
    return tracking_uri.startswith(("sqlite:", "file:")) or "://" not in tracking_uri


def ensure_experiment(tracking_uri: str, name: str, artifact_root: str | Path | None = None) -> str:
    """The id of experiment ``name``, created (with ``artifact_root/<name>`` for local stores) if missing."""
    client = _client(tracking_uri)
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    location = None
    if artifact_root is not None and is_local_store(tracking_uri):
        location = (Path(artifact_root).resolve() / name).as_uri()
    return client.create_experiment(name, artifact_location=location)


def open_run(
    tracking_uri: str,
    experiment: str,
    run_key: str,
    identity: dict[str, Any] | None = None,
    artifact_root: str | Path | None = None,
    tags: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The identity (``run_id``, ``experiment_id``, ``tracking_uri``) of the MLflow run of ``run_key``.

    ``identity`` (from a checkpoint's metadata) wins; otherwise a run tagged with ``run_key``
    is reused (a run that failed before its first checkpoint); otherwise a new run starts.
    """
    client = _client(tracking_uri)
    if identity and identity.get("run_id"):
        run = client.get_run(identity["run_id"])
        if run.info.status != "RUNNING":
            client.update_run(run.info.run_id, status="RUNNING")
        return {"run_id": run.info.run_id, "experiment_id": run.info.experiment_id, "tracking_uri": tracking_uri}
    experiment_id = ensure_experiment(tracking_uri, experiment, artifact_root)
    found = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}'", max_results=1)
    if found:
        run = found[0]
        if run.info.status != "RUNNING":
            client.update_run(run.info.run_id, status="RUNNING")
    else:
        run = client.create_run(experiment_id, run_name=run_key, tags={RUN_KEY_TAG: run_key, **(tags or {})})
    return {"run_id": run.info.run_id, "experiment_id": experiment_id, "tracking_uri": tracking_uri}


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


def log_params(identity: dict[str, Any], params: dict[str, Any]) -> None:
    """Log (nested) params once; a resumed run re-logging the same values is a no-op."""
    from mlflow.entities import Param

    client = _client(identity["tracking_uri"])
    existing = client.get_run(identity["run_id"]).data.params
    new = [Param(k, v) for k, v in flatten(params).items() if k not in existing]
    for start in range(0, len(new), 100):
        client.log_batch(identity["run_id"], params=new[start:start + 100])


def log_artifact(identity: dict[str, Any], path: str | Path, artifact_path: str | None = None) -> None:
    _client(identity["tracking_uri"]).log_artifact(identity["run_id"], str(path), artifact_path)


def finish_run(identity: dict[str, Any], status: str = "FINISHED") -> None:
    _client(identity["tracking_uri"]).set_terminated(identity["run_id"], status=status)


class MLflowCallback(TrainerCallback):
    """Sends every ``on_log`` metrics dict to an MLflow run, buffering through outages.

    A failed send keeps the metrics (at most ``max_buffered``; the oldest are dropped and
    counted beyond that) and logs one warning per outage; the next successful send, each
    epoch end and :meth:`flush` deliver the backlog. Training never fails because of tracking.
    """

    def __init__(self, identity: dict[str, Any], max_buffered: int = 100_000, retry_interval: float = 5.0) -> None:
        self.identity = identity
        self.buffer: deque[Any] = deque()
        self.max_buffered = max_buffered
        self.retry_interval = retry_interval
        self.dropped = 0
        self.failures = 0
        self._next_try = 0.0
        self._client = None

    def on_log(self, trainer: Any, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        for name, value in metrics.items():
            self.buffer.append(Metric(name.replace("@", "_"), float(value), now_ms, int(step)))
        while len(self.buffer) > self.max_buffered:
            self.buffer.popleft()
            self.dropped += 1
        if time.monotonic() >= self._next_try:
            self.flush()

    def on_epoch_end(self, trainer: Any, epoch: int) -> None:
        self.flush()

    def on_train_end(self, trainer: Any) -> None:
        self.flush()

    def flush(self) -> bool:
        """Send everything buffered; ``True`` when the buffer is empty afterwards."""
        try:
            if self._client is None:
                self._client = _client(self.identity["tracking_uri"])
            while self.buffer:
                batch = [self.buffer[i] for i in range(min(len(self.buffer), 1000))]
                self._client.log_batch(self.identity["run_id"], metrics=batch)
                for _ in batch:
                    self.buffer.popleft()
        except Exception as error:  # any outage: keep the metrics and carry on training
            if self.failures == 0:
                logger.warning("MLflow unreachable (%s); buffering %d metrics and retrying", error, len(self.buffer))
            self.failures += 1
            self._next_try = time.monotonic() + self.retry_interval
            return False
        if self.failures:
            logger.warning("MLflow reachable again after %d failed sends; backlog delivered", self.failures)
        self.failures = 0
        self._next_try = 0.0
        return True


def reward_curve(history: Sequence[dict[str, float]], path: str | Path, metric: str = "reward_mean") -> Path:
    """A PNG of ``metric`` over the steps of ``history``."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    points = [(row["step"], row[metric]) for row in history if metric in row and "step" in row]
    figure, axes = pyplot.subplots(figsize=(6, 3.5))
    if points:
        axes.plot([s for s, _ in points], [v for _, v in points], marker=".", linewidth=1)
    axes.set_xlabel("step")
    axes.set_ylabel(metric)
    axes.set_title(f"{metric} per training step")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
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
    alias: str = "candidate",
) -> list[dict[str, str]]:
    """Log every agent as a ``text-generation`` model in the run, register it as
    ``<base_name>-agent-<i>``, tag the version and point ``alias`` at it (once per run: a
    repeated call reuses the run's versions)."""
    import mlflow

    client = _client(identity["tracking_uri"])
    mlflow.set_tracking_uri(identity["tracking_uri"])
    registered = []
    for index, (model, tokenizer, name) in enumerate(zip(models, tokenizers, agent_model_names(base_name, len(models)))):
        # Idempotent: a re-run of a finished run finds the version it registered before.
        existing = [v for v in client.search_model_versions(f"name = '{name}'") if v.run_id == identity["run_id"]]
        if existing:
            version = str(existing[0].version)
            client.set_registered_model_alias(name, alias, version)
            registered.append({"name": name, "version": version, "alias": alias, "uri": f"models:/{name}@{alias}"})
            continue
        with mlflow.start_run(run_id=identity["run_id"]):
            info = mlflow.transformers.log_model(
                transformers_model={"model": model, "tokenizer": tokenizer},
                name=f"agent_{index}",
                task="text-generation",
                pip_requirements=MODEL_REQUIREMENTS,
                registered_model_name=name,
            )
        version = str(info.registered_model_version)
        for key, value in {**tags, "agent_index": str(index), RUN_KEY_TAG: tags.get(RUN_KEY_TAG, "")}.items():
            client.set_model_version_tag(name, version, key, value)
        client.set_registered_model_alias(name, alias, version)
        registered.append({"name": name, "version": version, "alias": alias, "uri": f"models:/{name}@{alias}"})
    return registered


def promote(
    tracking_uri: str,
    names: Sequence[str],
    from_alias: str = "candidate",
    to_alias: str = "champion",
) -> list[dict[str, str]]:
    """Point ``to_alias`` at the version ``from_alias`` names, for every registered model in ``names``.

    The previous holder is kept as tag ``previous_<to_alias>`` on the registered model, so a
    promotion can be rolled back by hand.
    """
    client = _client(tracking_uri)
    versions = {}
    for name in names:  # resolve them all first: a missing alias changes nothing
        try:
            versions[name] = client.get_model_version_by_alias(name, from_alias).version
        except Exception as error:
            raise ValueError(f"registered model {name!r} has no version with alias {from_alias!r}: {error}") from None
    moved = []
    for name, version in versions.items():
        try:
            previous = client.get_model_version_by_alias(name, to_alias).version
            client.set_registered_model_tag(name, f"previous_{to_alias}", str(previous))
        except Exception:
            previous = None
        client.set_registered_model_alias(name, to_alias, version)
        moved.append({"name": name, "version": str(version), "previous": str(previous) if previous else None})
    return moved


def aliased_versions(tracking_uri: str, names: Sequence[str], alias: str) -> dict[str, str] | None:
    """``name -> version`` for every name holding ``alias``, or ``None`` if any lacks it."""
    client = _client(tracking_uri)
    found = {}
    for name in names:
        try:
            found[name] = str(client.get_model_version_by_alias(name, alias).version)
        except Exception:
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
