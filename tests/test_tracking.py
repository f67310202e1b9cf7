"""comlrl.tracking: an MLflow outage never stops training; the backlog arrives when it is back
(against a real server: tests/test_tracking_outage.py; faults in the spool and the commands:
tests/test_tracking_faults.py)."""

from __future__ import annotations

import socket
import time

import pytest

from comlrl import tracking


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_metrics_sent_during_an_outage_wait_in_the_spool_and_are_delivered_afterwards(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from comlrl import tracking_spool

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    identity = tracking.open_run(store, "outage", "run-1", artifact_root=tmp_path / "artifacts")
    down = {**identity, "tracking_uri": f"http://127.0.0.1:{closed_port()}"}
    callback = tracking.MLflowCallback(down, spool_dir=tmp_path / "spool", drain_timeout=0.5)
    for step in range(1, 4):
        callback.on_log(None, {"reward_mean": step / 10}, step)  # must not raise
    started = time.monotonic()
    assert not callback.flush() and not callback.close(warn=False)  # both waits together: drain_timeout
    assert time.monotonic() - started < 0.5 + 1.5  # ... then at most the sender's join
    assert len(list(callback.spool.pending())) == 3
    tracking_spool.replay(callback.spool.directory, store)  # the service is back
    history = MlflowClient(store).get_metric_history(identity["run_id"], "reward_mean")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.1), (2, 0.2), (3, 0.3)]


def test_a_send_is_on_disk_when_it_returns_and_never_waits_for_the_server(tmp_path):
    pytest.importorskip("mlflow")
    down = {"run_id": "x", "tracking_uri": f"http://127.0.0.1:{closed_port()}"}
    callback = tracking.MLflowCallback(down, spool_dir=tmp_path, drain_timeout=0.0, retry_interval=60.0)
    seconds, sizes = [], []
    for step in range(500):
        before = time.perf_counter()
        callback.on_log(None, {"loss": float(step), "reward_mean": 0.5}, step)
        seconds.append(time.perf_counter() - before)
        sizes.append(callback.spool.path.stat().st_size)
    assert all(later > earlier for earlier, later in zip(sizes, sizes[1:]))  # each step written before on_log returned
    # One write and one fsync: about 0.25 ms on an idle disk, a few ms on a busy shared one
    # (benchmarks/tracking_durability.py); never the seconds of MLflow's retries.
    seconds.sort()
    assert seconds[len(seconds) // 2] < 0.05, seconds[-5:]
    assert not callback.close(warn=False)
    assert sum(len(record["metrics"]) for _, record in callback.spool.pending()) == 1_000  # all kept


def test_open_run_reuses_the_run_of_a_run_id_and_the_checkpoint_identity(tmp_path):
    pytest.importorskip("mlflow")
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = tracking.open_run(store, "exp", "run-a", artifact_root=tmp_path)
    assert tracking.open_run(store, "exp", "run-a")["run_id"] == first["run_id"]
    assert tracking.open_run(store, "exp", "run-b")["run_id"] != first["run_id"]
    assert tracking.open_run(store, "exp", "run-a", identity=first)["run_id"] == first["run_id"]
