"""Faults in the tracking path, against real files and a real `mlflow server` on loopback (issue 26):
a torn or corrupted spool is delivered but for its damaged bytes, a failed write never leaves half
a record, a step whose ``on_log`` returned survives SIGKILL, a killed and resumed run gives MLflow
every step with the resumed run's value, and `comlrl sync` / `comlrl promote` end within their deadline
against a hung server, telling "unreachable" (75) from "unreadable" (65).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from datasets import Dataset

from comlrl import tracking
from test_tracking_outage import free_port, server  # noqa: F401  (server: that module's fixture, reused)

pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402

from comlrl.tracking_spool import Damaged, Spool, encode_record  # noqa: E402
from flows import cli  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def metrics(step: int, timestamp: int | None = None) -> dict[str, Any]:
    stamp = 1000 * step if timestamp is None else timestamp
    return {"metrics": [["loss", -float(step), stamp, step], ["reward_mean", step / 10, stamp, step]]}


def version_1_line(record: dict[str, Any]) -> bytes:
    """A line as the previous version wrote it: plain JSON, no length, no checksum."""
    return json.dumps(record, separators=(",", ":")).encode() + b"\n"


def history(url: str, run_id: str, key: str = "loss") -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in MlflowClient(url).get_metric_history(run_id, key))


def test_comlrl_sync_delivers_a_torn_version_1_spool_but_its_torn_bytes(server, tmp_path, capsys, caplog):
    identity = tracking.open_run(server.url, "faults", "torn-version-1")
    header = version_1_line({"spool": 1, **identity})
    whole = [version_1_line(metrics(step)) for step in range(1, 7)]
    # The previous version's failure: a write cut short by a file-size limit left part of step 4's
    # record, and its retry wrote the record whole after those bytes, on the same line; then the
    # process was killed while writing step 6.
    torn, unfinished = whole[3][:25], whole[5][:30]
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "spool.jsonl").write_bytes(header + b"".join(whole[:3]) + torn + b"".join(whole[3:5]) + unfinished)
    torn_at = len(header) + sum(map(len, whole[:3]))
    unfinished_at = torn_at + len(torn) + len(whole[3]) + len(whole[4])

    assert cli.main(["sync", str(spool)]) == tracking.EXIT_DAMAGED == 65  # was 75 "unreachable", for ever
    err = capsys.readouterr().err
    assert "delivered 5 records (10 metric values, 0 artifacts)" in err, err
    assert f"{len(torn)} bytes at byte offset {torn_at} held no whole record" in err, err
    warnings = [r.getMessage() for r in caplog.records if r.name == "comlrl.tracking_spool"]
    assert any(str(spool / "spool.jsonl") in w and f"skipped {len(torn)} bytes at byte offset {torn_at}" in w
               for w in warnings), warnings
    assert any(f"dropped an unfinished last line ({len(unfinished)} bytes at byte offset {unfinished_at})" in w
               for w in warnings), warnings
    assert history(server.url, identity["run_id"]) == [(step, -float(step)) for step in range(1, 6)]  # each once
    assert cli.main(["sync", str(spool)]) == 0  # acknowledged past the damage: nothing left, nothing sent twice
    assert "delivered 0 records" in capsys.readouterr().out
    assert len(history(server.url, identity["run_id"], "reward_mean")) == 5


def test_a_callback_continues_a_torn_and_corrupted_spool_and_delivers_every_whole_record(server, tmp_path, caplog):
    identity = tracking.open_run(server.url, "faults", "torn-version-2")
    spool = Spool(tmp_path / identity["run_id"], identity)
    spool.append([metrics(1), metrics(2)])
    torn_at = spool.path.stat().st_size
    with open(spool.path, "ab") as handle:
        handle.write(encode_record(metrics(3))[:40])  # a write cut short (by an older writer)
    spool.append([metrics(3)])
    flipped_at = spool.path.stat().st_size
    line = encode_record(metrics(4))
    with open(spool.path, "ab") as handle:  # one flipped digit: well-formed JSON, caught by the checksum
        handle.write(line.replace(b"-4.0", b"-5.0"))
    callback = tracking.MLflowCallback(identity, spool_dir=tmp_path, drain_timeout=60)
    for step in (5, 6):
        callback.on_log(None, {"loss": -float(step), "reward_mean": step / 10}, step)
    assert callback.close(), callback.undelivered_message()  # used to raise JSONDecodeError
    assert history(server.url, identity["run_id"]) == [(s, -float(s)) for s in (1, 2, 3, 5, 6)]
    damaged = sorted((d.offset, d.length) for d in callback.sender.damaged)
    assert damaged == [(torn_at, 40), (flipped_at, len(line))], damaged
    assert sum(f"byte offset {torn_at}" in r.getMessage() or f"byte offset {flipped_at}" in r.getMessage()
               for r in caplog.records if r.name == "comlrl.tracking_spool") == 2  # one warning each


WRITE_FAILS = textwrap.dedent("""
    import json, resource, sys
    from comlrl import tracking

    identity, spool_dir = json.loads(sys.argv[1]), sys.argv[2]
    callback = tracking.MLflowCallback(identity, spool_dir=spool_dir, send_interval=3600, drain_timeout=60)
    log = lambda step: callback.on_log(None, {"loss": -float(step), "reward_mean": step / 10}, step)
    log(1), log(2)
    size = callback.spool.path.stat().st_size
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 40, resource.RLIM_INFINITY))  # step 3 fits only in part
    log(3)
    after = callback.spool.path.stat().st_size
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    log(4)  # writes step 3 (kept in memory) whole, then step 4
    print(json.dumps({"before": size, "after_failure": after, "delivered": callback.close()}), flush=True)
""")


def test_a_failed_spool_write_leaves_no_half_record_and_is_written_whole_later(server, tmp_path):
    identity = tracking.open_run(server.url, "faults", "write-fails")
    finished = subprocess.run([sys.executable, "-c", WRITE_FAILS, json.dumps(identity), str(tmp_path)],
                              capture_output=True, text=True, timeout=120, env=ENV)
    assert finished.returncode == 0, finished.stderr[-3000:]
    outcome = json.loads(finished.stdout)
    assert outcome["after_failure"] == outcome["before"] and outcome["delivered"], outcome  # cut back, then sent
    assert finished.stderr.count("cannot write the tracking spool") == 1, finished.stderr[-3000:]
    assert "written again after failed writes" in finished.stderr
    spool = Spool(tmp_path / identity["run_id"])
    assert not [entry for _, entry in spool.entries(spool.header_end) if isinstance(entry, Damaged)]  # nothing torn
    assert history(server.url, identity["run_id"]) == [(step, -float(step)) for step in range(1, 5)]


KILLED_AFTER_ON_LOG = textwrap.dedent("""
    import json, os, signal, sys
    from comlrl import tracking

    identity, spool_dir = json.loads(sys.argv[1]), sys.argv[2]
    callback = tracking.MLflowCallback(identity, spool_dir=spool_dir, send_interval=3600)
    for step in (1, 2, 3):
        callback.on_log(None, {"loss": -float(step)}, step)
    os.kill(os.getpid(), signal.SIGKILL)  # the moment on_log returned
""")


def test_a_step_whose_on_log_returned_survives_sigkill(tmp_path):
    identity = {"run_id": "killed-run", "tracking_uri": f"http://127.0.0.1:{free_port()}"}
    killed = subprocess.run([sys.executable, "-c", KILLED_AFTER_ON_LOG, json.dumps(identity), str(tmp_path)],
                            capture_output=True, text=True, timeout=60, env=ENV)
    assert killed.returncode == -9, killed.stderr[-3000:]
    spooled = [entry for _, record in Spool(tmp_path / "killed-run").pending() for entry in record["metrics"]]
    assert [(key, value, step) for key, value, _, step in spooled] == [("loss", -1.0, 1), ("loss", -2.0, 2),
                                                                       ("loss", -3.0, 3)]


def tiny_trainer(model: str, callbacks: list[Any]) -> Any:
    """Two tiny Llama agents, 3 epochs of 3 steps, a metrics dict per step."""
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
    from conftest import joint_letter_reward

    dataset = Dataset.from_dict({"prompt": [f"tell me about the {w}" for w in "cat dog sun moon tree hill".split()]})
    return MAGRPOTrainer(agent_model=model, num_agents=2, reward_func=joint_letter_reward, train_dataset=dataset,
                         callbacks=callbacks,
                         args=MAGRPOConfig(num_agents=2, num_generations=2, max_new_tokens=4, num_train_epochs=3,
                                           per_device_train_batch_size=2, logging_steps=1, seed=0, disable_tqdm=True))


KILLED_RUN = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, sys.argv[1])
    import conftest  # noqa: F401  (the tests' offline, one-thread settings)
    from comlrl import tracking
    from comlrl.callbacks import TrainerCallback
    from test_tracking_faults import tiny_trainer

    identity, model, spool_dir, checkpoints = json.loads(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    callback = tracking.MLflowCallback(identity, spool_dir=spool_dir, send_interval=3600, drain_timeout=60)


    class KillPoint(TrainerCallback):
        def on_log(self, trainer, metrics, step):
            if step == 4:  # steps 1-4 reach MLflow; the checkpoint holds steps 1-3, so the resume re-runs 4
                assert callback.flush()
            if step == 5:  # in the spool only
                print("logged step 5", flush=True)
                time.sleep(600)


    tiny_trainer(model, [callback, KillPoint()]).train(checkpoint_dir=checkpoints)
""")


def test_a_run_killed_and_resumed_gives_mlflow_every_step_with_the_resumed_runs_value(server, tiny_llama, tmp_path):
    identity = tracking.open_run(server.url, "faults", "killed-and-resumed")
    spools, checkpoints = tmp_path / "tracking", tmp_path / "checkpoints"
    with open(tmp_path / "killed.log", "w") as log:
        process = subprocess.Popen([sys.executable, "-c", KILLED_RUN, str(TESTS), json.dumps(identity), tiny_llama,
                                    str(spools), str(checkpoints)], stdout=subprocess.PIPE, stderr=log, text=True,
                                   env=ENV)
        try:
            line = process.stdout.readline()
        finally:
            process.kill()  # SIGKILL, from outside, while it waits after step 5
            process.wait()
    assert line == "logged step 5\n", (tmp_path / "killed.log").read_text()[-3000:]
    client = MlflowClient(server.url)
    assert [m.step for m in client.get_metric_history(identity["run_id"], "reward_mean")] == [1, 2, 3, 4]

    callback = tracking.MLflowCallback(identity, spool_dir=spools, drain_timeout=60)
    tiny_trainer(tiny_llama, [callback]).train(checkpoint_dir=checkpoints, resume_from_checkpoint="latest")
    assert callback.close(), callback.undelivered_message()
    keys = list(client.get_run(identity["run_id"]).data.metrics)
    # Steps 4 and 5 came after the checkpoint: the resumed run computes them again, bit-exactly, so a point
    # the killed attempt logged with the same value is not logged twice; one with another value (a time, a
    # memory figure) supersedes it (MLflow keeps both, the later is the value). Steps 1-3 are not logged again.
    assert "reward_mean" in keys and callback.superseded_values == 2 * len(keys) and callback.skipped_values == 0
    assert callback.repeated_values > 0
    for key in keys:
        history = client.get_metric_history(identity["run_id"], key)
        for step in range(1, 10):
            values = [m.value for m in history if m.step == step]
            assert len(values) == 1 or (step in (4, 5) and len(values) == 2 and values[0] != values[1]), (key, step)
        assert [step for step, _ in tracking.metric_history(server.url, identity["run_id"], key)] == list(range(1, 10))
    assert len([m for m in client.get_metric_history(identity["run_id"], "reward_mean")]) == 9  # once each


COMMAND = textwrap.dedent("""
    import json, sys, time
    import mlflow.tracking  # noqa: F401  (imported before the clock starts)
    from flows import cli, gate, orchestrator, runs  # noqa: F401

    started = time.monotonic()
    status = cli.main(sys.argv[1:])
    print(json.dumps({"status": status, "seconds": time.monotonic() - started}), flush=True)
""")


def test_comlrl_sync_tells_an_unreadable_spool_from_an_unreachable_server(tmp_path, capsys):
    unreadable, unreachable = tmp_path / "run" / "a", tmp_path / "run" / "b"
    unreadable.mkdir(parents=True)
    (unreadable / "spool.jsonl").write_bytes(b"\x00\x00\x00 zeroed by a crash\n" + version_1_line(metrics(1)))
    Spool(unreachable, {"run_id": "r", "tracking_uri": f"http://127.0.0.1:{free_port()}"}).append([metrics(1)])
    assert cli.main(["sync", str(unreadable)]) == tracking.EXIT_DAMAGED
    assert "unreadable" in capsys.readouterr().err
    assert cli.main(["sync", str(unreachable)]) == tracking.EXIT_UNREACHABLE
    err = capsys.readouterr().err
    assert "MLflow unreachable" in err and "nothing was lost" in err
    assert cli.main(["sync", str(tmp_path / "run")]) == tracking.EXIT_UNREACHABLE  # the one to try again wins
    assert len(list(Spool(unreachable).pending())) == 1


def test_sync_and_promote_against_a_hung_server_end_within_the_deadline(server, tmp_path):
    identity = tracking.open_run(server.url, "faults", "hung-server")
    Spool(tmp_path / "spool", identity).append([metrics(1)])
    env = {**ENV, "MLFLOW_TRACKING_URI": server.url, tracking.DEADLINE_ENV: "3"}
    commands = {"sync": ["sync", str(tmp_path / "spool")],
                "promote": ["promote", "faults-model", "--workdir", str(tmp_path / "work")]}
    server.pause()
    try:
        processes = {name: subprocess.Popen([sys.executable, "-c", COMMAND, *arguments], stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, text=True, env=env)
                     for name, arguments in commands.items()}
        finished = {name: (process, *process.communicate(timeout=120)) for name, process in processes.items()}
    finally:
        server.unpause()
    for name, (process, out, err) in finished.items():
        assert process.returncode == 0, (name, err[-3000:])
        outcome = json.loads(out.splitlines()[-1])
        assert outcome["status"] == tracking.EXIT_UNREACHABLE, (name, err[-3000:])
        assert outcome["seconds"] < 3 + 3, (name, outcome)  # the deadline, the watchdog's half-second ticks
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and "did not answer within 3 s" in lines[0], (name, err[-3000:])
    server.wait_up()
    assert tracking.sync(tmp_path / "spool")[0].exit_status == 0  # answered again: delivered
    assert history(server.url, identity["run_id"]) == [(1, -1.0)]
