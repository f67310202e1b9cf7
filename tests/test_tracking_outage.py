"""A real `mlflow server` that dies mid-run: training goes on at full speed, every record reaches
the same MLflow run once the server is back, and a process whose server never returns exits
within its drain timeout, leaving a spool that `comlrl sync` replays exactly once.

The server runs on loopback in its own process group (the test kills the whole group, as an
outage would), with its job runner off so that a restart takes seconds.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from datasets import Dataset

from comlrl import tracking
from comlrl.callbacks import TrainerCallback

pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class MLflowServer:
    """`mlflow server` on one loopback port and one SQLite store, started and killed at will."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.url = f"http://127.0.0.1:{free_port()}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        command = [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1",
                   "--port", self.url.rsplit(":", 1)[1], "--workers", "1",
                   "--backend-store-uri", f"sqlite:///{self.directory / 'mlflow.db'}",
                   "--artifacts-destination", str(self.directory / "artifacts")]
        log = open(self.directory / "server.log", "ab")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})

    def wait_up(self, timeout: float = 150.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except OSError:
                assert self.process.poll() is None, (self.directory / "server.log").read_text()[-3000:]
                assert time.monotonic() < deadline, f"mlflow server not up after {timeout} s"
                time.sleep(0.3)

    def kill(self) -> None:
        """SIGKILL the server's whole process group (uvicorn and its workers)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def pause(self) -> None:
        """SIGSTOP the whole group: connections are still accepted (by the kernel), never answered."""
        os.killpg(self.process.pid, signal.SIGSTOP)

    def unpause(self) -> None:
        os.killpg(self.process.pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = MLflowServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    try:
        server.wait_up()
        yield server
    finally:
        server.kill()


class Outage(TrainerCallback):
    """Kills the server after boundary ``down_after``, starts it again after ``up_after``; logs an
    artifact per boundary (through the spool) and records when each step's metrics were sent."""

    def __init__(self, server: MLflowServer, identity: dict, directory: Path, down_after: int, up_after: int) -> None:
        self.server, self.identity, self.directory = server, identity, directory
        self.down_after, self.up_after = down_after, up_after
        self.sent: list[tuple[int, float, dict]] = []  # (step, perf_counter, metrics)
        self.down_steps: set[int] = set()
        self.restarted_ms: int | None = None
        self.outage = False

    def on_log(self, trainer, metrics, step):
        self.sent.append((step, time.perf_counter(), dict(metrics)))
        if self.outage:
            self.down_steps.add(step)

    def on_epoch_end(self, trainer, epoch):
        path = self.directory / f"boundary-{epoch}.txt"
        path.write_text(f"boundary {epoch} at step {trainer.state.global_step}\n")
        tracking.log_artifact(self.identity, path, "boundaries")
        if epoch == self.down_after:
            self.server.kill()
            self.outage = True
            tracking.log_params(self.identity, {"logged_during": {"the_outage": epoch}})
            tracking.open_callback(self.identity).set_tags({"outage.after_boundary": epoch})
        elif epoch == self.up_after:
            self.outage = False
            self.restarted_ms = int(time.time() * 1000)
            self.server.start()  # boots while the last boundaries train


def step_seconds(sent, steps) -> list[float]:
    times = {step: at for step, at, _ in sent}
    return [times[s] - times[s - 1] for s in sorted(steps) if s - 1 in times]


def test_an_outage_never_slows_training_and_every_record_arrives_in_the_same_run(server, tiny_llama, reward_func,
                                                                                 tmp_path, caplog, monkeypatch):
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    # A slower client policy than HTTP_BOUNDS (the environment wins): a send that waited for MLflow
    # would now take 2 + 4 s per step of the outage; the background sender must not care.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    identity = tracking.open_run(server.url, "outage", "run-comes-back")
    callback = tracking.MLflowCallback(identity, spool_dir=tmp_path / "spool", drain_timeout=120, max_retry_interval=1.0)
    outage = Outage(server, identity, tmp_path, down_after=2, up_after=4)
    dataset = Dataset.from_dict({"prompt": [f"tell me about the {w}" for w in "cat dog sun moon tree hill".split()]})
    trainer = MAGRPOTrainer(agent_model=tiny_llama, num_agents=2, reward_func=reward_func, train_dataset=dataset,
                            callbacks=[callback, outage],
                            args=MAGRPOConfig(num_agents=2, num_generations=2, max_new_tokens=4, num_train_epochs=6,
                                              per_device_train_batch_size=2, logging_steps=1, seed=0, disable_tqdm=True))
    trainer.train()

    # Full speed through the outage: the old client blocked ~4 minutes on the first failed send.
    before = step_seconds(outage.sent, [s for s, _, _ in outage.sent if s <= 6 and s > 1])
    during = step_seconds(outage.sent, outage.down_steps)
    assert len(during) == 6, outage.down_steps  # boundaries 3 and 4, 3 steps each
    assert max(during) < 3 * max(before) + 1.0, (before, during)
    assert statistics.mean(during) < 3 * statistics.mean(before) + 1.0, (before, during)

    assert callback.close(), callback.undelivered_message()  # waits for the restarted server
    assert callback.sender.failures == 0 and callback.spool.pending_bytes == 0
    outage_lines = [r.getMessage() for r in caplog.records if r.name == "comlrl.tracking_spool"]
    # One warning when it went away, one line when it came back; none when the sender's one request in flight
    # (MLflow's own retries) outlasted the outage under load, which the clean-clone suite run showed once.
    assert len(outage_lines) in (0, 2), outage_lines
    if outage_lines:
        assert "unreachable" in outage_lines[0] and "reachable again" in outage_lines[1]

    client = MlflowClient(server.url)
    run_id = identity["run_id"]
    experiment = client.get_experiment_by_name("outage").experiment_id
    assert [r.info.run_id for r in client.search_runs([experiment], f"tags.`{tracking.RUN_KEY_TAG}` = 'run-comes-back'")] == [run_id]
    for name in outage.sent[0][2]:
        history = client.get_metric_history(run_id, name)
        sent = [(step, float(metrics[name])) for step, _, metrics in outage.sent if name in metrics]
        assert sorted((m.step, m.value) for m in history) == sorted(sent), name  # every step, once
    # Metrics sent during the outage keep the time they were recorded, not the time of delivery.
    reward = {m.step: m.timestamp for m in client.get_metric_history(run_id, "reward_mean")}
    assert all(reward[step] <= outage.restarted_ms for step in outage.down_steps), (reward, outage.restarted_ms)
    artifacts = sorted(Path(a.path).name for a in client.list_artifacts(run_id, "boundaries"))
    assert artifacts == [f"boundary-{epoch}.txt" for epoch in range(1, 7)]
    local = client.download_artifacts(run_id, "boundaries/boundary-3.txt", str(tmp_path / "download"))
    assert Path(local).read_text() == "boundary 3 at step 9\n"
    data = client.get_run(run_id).data
    assert data.params["logged_during.the_outage"] == "2" and data.tags["outage.after_boundary"] == "2"


SENDER_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from comlrl import tracking

    identity, spool_dir, artifact = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    callback = tracking.MLflowCallback(identity, spool_dir=spool_dir, drain_timeout=3.0)
    for step in range(1, 41):
        callback.on_log(None, {"reward_mean": step / 40, "loss": -float(step)}, step)
    tracking.log_artifact(identity, artifact, "plots")
    tracking.log_params(identity, {"lr": 0.1})
    tracking.finish_run(identity)
    print("done sending at", time.monotonic(), flush=True)
    # the interpreter's exit closes the callback: at most drain_timeout (+1 s) more
""")


def test_a_process_whose_server_never_answers_exits_promptly_and_comlrl_sync_replays_its_spool(server, tmp_path):
    # The run exists on the real server; this process only ever knows an address where nothing answers.
    identity = tracking.open_run(server.url, "outage", "run-never-answers")
    gone = {**identity, "tracking_uri": f"http://127.0.0.1:{free_port()}"}
    artifact = tmp_path / "curve.txt"
    artifact.write_text("a reward curve\n")
    spools = tmp_path / "run" / "tracking"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    finished = subprocess.run([sys.executable, "-c", SENDER_SCRIPT, json.dumps(gone), str(spools), str(artifact)],
                              capture_output=True, text=True, timeout=120, env=env)
    exited = time.monotonic()
    assert finished.returncode == 0, finished.stderr[-3000:]
    done = float(finished.stdout.split("done sending at")[1])
    assert exited - done < 3.0 + 3.0, exited - done  # drain_timeout, the sender's join, interpreter exit
    spool = spools / identity["run_id"]
    warnings = [line for line in finished.stderr.splitlines() if "comlrl sync" in line]
    assert len(warnings) == 1, finished.stderr[-3000:]
    assert f"comlrl sync {spool}" in warnings[0] and str(spool / "spool.jsonl") in warnings[0]
    assert "43 records (80 metric values, 1 artifacts)" in warnings[0]

    from comlrl import tracking_spool

    from flows import cli

    assert cli.main(["sync", str(tmp_path / "run")]) == cli.EXIT_TRACKING_UNREACHABLE  # the recorded address
    assert len(list(tracking_spool.Spool(spool).pending())) == 43  # nothing lost, nothing acknowledged

    sync = [sys.executable, "-m", "flows.cli", "sync", str(tmp_path / "run"), "--tracking-uri", server.url]
    replayed = subprocess.run(sync, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr[-3000:]
    assert "delivered 43 records (80 metric values, 1 artifacts)" in replayed.stdout

    client = MlflowClient(server.url)
    run = client.get_run(identity["run_id"])
    assert sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward_mean")) == \
        [(step, step / 40) for step in range(1, 41)]
    assert run.data.params == {"lr": "0.1"} and run.info.status == "FINISHED"
    assert [a.path for a in client.list_artifacts(run.info.run_id, "plots")] == ["plots/curve.txt"]

    # Idempotent: a second replay sends nothing.
    _, again = tracking_spool.replay(spool, server.url)
    assert again.records == 0
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 40


# ----- the spool on its own, delivered to the module's server ------------------------------------
@pytest.fixture
def store(server) -> str:
    return server.url


def test_a_line_cut_short_by_a_kill_is_dropped_and_the_rest_delivered(store, tmp_path, caplog):
    from comlrl.tracking_spool import Spool

    identity = tracking.open_run(store, "spool", "cut-short")
    spool = Spool(tmp_path, identity)
    spool.append([{"metrics": [["loss", 1.0, 1000, 1]]}, {"metrics": [["loss", 2.0, 2000, 2]]}])
    with open(spool.path, "ab") as handle:
        handle.write(b'{"metrics": [["loss", 3.0, 30')  # the process died mid-write
    reopened = Spool(tmp_path, identity)
    reopened.lock()  # the writing process's first act
    assert "dropped an unfinished last line" in caplog.text
    assert [record["metrics"][0][1] for _, record in reopened.pending()] == [1.0, 2.0]
    report = reopened.deliver(MlflowClient(store))
    assert (report.records, report.metrics, report.refused) == (2, 2, [])
    history = MlflowClient(store).get_metric_history(identity["run_id"], "loss")
    assert sorted((m.step, m.value, m.timestamp) for m in history) == [(1, 1.0, 1000), (2, 2.0, 2000)]
    # Killed after the store's answer but before the acknowledgement was written: sent again, kept once.
    (tmp_path / "acked").write_text(f"{len(spool.path.read_bytes().splitlines()[0]) + 1}\n")
    assert Spool(tmp_path, identity).deliver(MlflowClient(store)).metrics == 2
    assert len(MlflowClient(store).get_metric_history(identity["run_id"], "loss")) == 2


def test_what_the_store_refuses_is_skipped_and_everything_else_delivered(store, tmp_path):
    from comlrl.tracking_spool import Spool

    identity = tracking.open_run(store, "spool", "refused")
    client = MlflowClient(store)
    tracking.log_params(identity, {"lr": 0.1})
    spool = Spool(tmp_path, identity)
    spool.append([{"metrics": [["loss", 1.0, 1000, 1]]},
                  {"params": [["batch", "4"]]}, {"params": [["lr", "0.2"]]},  # one call; MLflow refuses lr
                  {"tags": [["note", "kept"]]}, {"metrics": [["loss", 2.0, 2000, 2]]}])
    report = spool.deliver(client)
    assert len(report.refused) == 1 and "params ['lr', '0.2']" in report.refused[0], report.refused
    run = client.get_run(identity["run_id"])
    assert run.data.params == {"lr": "0.1", "batch": "4"} and run.data.tags["note"] == "kept"
    assert [m.step for m in client.get_metric_history(identity["run_id"], "loss")] == [1, 2]
    assert spool.pending_bytes == 0 and spool.deliver(client).records == 0


def test_a_spool_belongs_to_one_run_and_one_delivering_process(tmp_path):
    from comlrl.tracking_spool import Spool, SpoolBusy, SpoolError

    mine = {"run_id": "run-a", "tracking_uri": "http://127.0.0.1:9"}
    first = Spool(tmp_path, mine)
    with pytest.raises(SpoolError, match="spools MLflow run run-a, not run-b"):
        Spool(tmp_path, {**mine, "run_id": "run-b"})
    first.lock()
    with pytest.raises(SpoolBusy, match=f"being delivered by process {os.getpid()}"):
        Spool(tmp_path).lock()
    first.unlock()
    Spool(tmp_path).lock()


def test_open_run_bounds_mlflow_http_retries_unless_the_environment_says_otherwise(store, monkeypatch):
    for key in tracking.HTTP_BOUNDS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    tracking.open_run(store, "spool", "bounds")
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "5"
    for key in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"):
        assert os.environ[key] == tracking.HTTP_BOUNDS[key]
