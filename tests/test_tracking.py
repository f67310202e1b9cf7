"""comlrl.tracking: an MLflow outage never stops training; the backlog arrives when it is back."""

from __future__ import annotations

import socket

import pytest

from comlrl import tracking


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_metrics_are_buffered_through_an_outage_and_delivered_afterwards(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    identity = tracking.open_run(store, "outage", "run-1", artifact_root=tmp_path / "artifacts")
    down = {**identity, "tracking_uri": f"http://127.0.0.1:{closed_port()}"}
    callback = tracking.MLflowCallback(down, retry_interval=0.0)
    for step in range(1, 4):
        callback.on_log(None, {"reward_mean": step / 10}, step)  # must not raise
    assert len(callback.buffer) == 3 and callback.failures == 3
    callback.identity, callback._client = identity, None  # the service is back
    callback.on_log(None, {"reward_mean": 0.4}, 4)
    assert not callback.buffer and callback.failures == 0
    history = MlflowClient(store).get_metric_history(identity["run_id"], "reward_mean")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]


def test_the_buffer_is_bounded(tmp_path):
    pytest.importorskip("mlflow")
    callback = tracking.MLflowCallback({"run_id": "x", "tracking_uri": f"http://127.0.0.1:{closed_port()}"},
                                       max_buffered=2, retry_interval=3600.0)
    callback._next_try = float("inf")  # do not even try: the buffer alone is under test
    for step in range(5):
        callback.on_log(None, {"loss": float(step)}, step)
    assert [m.step for m in callback.buffer] == [3, 4] and callback.dropped == 3


def test_open_run_reuses_the_run_of_a_run_id_and_the_checkpoint_identity(tmp_path):
    pytest.importorskip("mlflow")
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = tracking.open_run(store, "exp", "run-a", artifact_root=tmp_path)
    assert tracking.open_run(store, "exp", "run-a")["run_id"] == first["run_id"]
    assert tracking.open_run(store, "exp", "run-b")["run_id"] != first["run_id"]
    assert tracking.open_run(store, "exp", "other", identity=first)["run_id"] == first["run_id"]
