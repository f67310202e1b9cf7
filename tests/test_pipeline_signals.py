"""Interruption and failure of ``comlrl run`` / ``comlrl resume`` as real processes, killed from outside.

A SIGTERM (or SIGINT) mid-epoch: the step in progress finishes, ``checkpoint-N-stepS`` is written,
the process exits 143 (130) with one line saying where the checkpoint is and no traceback, the
MLflow run is KILLED, the Prefect flow run Cancelled with the same message, and nothing of the
process (the embedded Prefect server included) is left running. An exception in a step before
its update: the last completed step is checkpointed, MLflow FAILED, Prefect Failed, exit 1 with
one closing line. Either way ``comlrl resume`` continues, and the final weights equal an
uninterrupted ``trainer.train()`` of the same spec, bit for bit.

The Prefect state is read from the embedded default's own database after the process is gone.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from comlrl.tasks.letters import write_dataset
from letters_spec import letters_spec

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

STEPS_PER_EPOCH = 12  # 24 rows, batch 2
FLAKY_REWARD = '''
import os
import time
from pathlib import Path

from comlrl.tasks.letters import letters_reward

CALLS = 0  # one call per training step (this spec evaluates nowhere during training)


def flaky_reward(completions_0, completions_1, batch_items=None):
    """The letters reward, steered by the test through the environment: from call SIGNALS_FAIL_AT on it
    raises; at call SIGNALS_HOLD_AT it writes SIGNALS_GATE/held and waits for SIGNALS_GATE/release, so
    that a signal sent meanwhile arrives during a known step, whatever the machine's speed."""
    global CALLS
    CALLS += 1
    if 0 < int(os.environ.get("SIGNALS_FAIL_AT", "0")) <= CALLS:
        raise RuntimeError("the reward service is down (injected)")
    if CALLS == int(os.environ.get("SIGNALS_HOLD_AT", "0")):
        gate = Path(os.environ["SIGNALS_GATE"])
        (gate / "held").touch()
        deadline = time.monotonic() + 120
        while not (gate / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    return letters_reward(completions_0, completions_1, batch_items)
'''


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("project")
    write_dataset(root / "data" / "letters", num_train=2 * STEPS_PER_EPOCH, num_eval=2)
    (root / "flaky_task.py").write_text(FLAKY_REWARD)
    spec = letters_spec("signals", num_generations=2, max_new_tokens=4, num_train_epochs=3,
                        per_device_train_batch_size=2, agent_learning_rate=3e-3)
    spec["reward"] = "flaky_task:flaky_reward"
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    return root


@pytest.fixture(scope="module")
def uninterrupted(project, tmp_path_factory) -> dict[str, dict]:
    """Final weights of the library's own train() on the same spec."""
    from flows.build import build_trainer
    from flows.spec import load_spec

    trainer = build_trainer(load_spec(project / "spec.yaml", project), project, tmp_path_factory.mktemp("reference"))
    trainer.train()
    return {f"agent_{i}": {k: v.clone() for k, v in agent.state_dict().items()} for i, agent in enumerate(trainer.agents)}


def comlrl(*arguments: str, workdir: Path, **steering: str) -> subprocess.Popen:
    """``comlrl ARGUMENTS --workdir WORKDIR`` as a process group of its own; ``steering`` (SIGNALS_*) goes
    to the flaky reward through the environment."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PREFECT_", "MLFLOW_", "SIGNALS_"))}  # the embedded default, as an operator runs it
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **steering)
    workdir.mkdir(parents=True, exist_ok=True)
    logs = [open(workdir / f"{arguments[0]}.{stream}.log", "w+") for stream in ("out", "err")]  # no pipe to fill
    process = subprocess.Popen([str(Path(sys.executable).parent / "comlrl"), *arguments, "--workdir", str(workdir)],
                               env=env, stdout=logs[0], stderr=logs[1], text=True, start_new_session=True)
    process.logs = logs
    return process


def wait_for(condition, process: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"comlrl exited early ({process.returncode}): {read(process.logs[1])[-3000:]}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def read(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()


def stop_during_step(process: subprocess.Popen, gate: Path, number: signal.Signals) -> float:
    """Wait until the reward holds its step (SIGNALS_HOLD_AT), send ``number`` to the process group,
    then let the step go on; returns when the signal was sent."""
    wait_for(lambda: (gate / "held").exists(), process)
    sent = time.monotonic()
    os.killpg(process.pid, number)  # as a terminal or a supervisor delivers it: to the whole group
    time.sleep(0.2)  # the handler has run: the request is recorded while the step is still in progress
    (gate / "release").touch()
    return sent


def held(workdir: Path, at: int) -> dict[str, str]:
    """Steering that holds reward call ``at`` (step ``at`` of this process) at a fresh gate under ``workdir``."""
    gate = workdir / f"gate-{at}"
    gate.mkdir(parents=True)
    return {"SIGNALS_HOLD_AT": str(at), "SIGNALS_GATE": str(gate)}


def finish(process: subprocess.Popen, timeout: float = 300.0) -> tuple[int, str, str]:
    process.wait(timeout=timeout)
    return process.returncode, read(process.logs[0]), read(process.logs[1])


def processes_of(workdir: Path) -> list[int]:
    """Processes whose environment names the run's working directory (the command, its embedded Prefect server)."""
    needle = f"PREFECT_HOME={(workdir / 'prefect').resolve()}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def all_gone(workdir: Path, timeout: float = 30.0) -> bool:
    """Whether every process of the run (its embedded Prefect server too) has ended."""
    deadline = time.monotonic() + timeout
    while processes_of(workdir):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def prefect_flow_runs(workdir: Path) -> list[tuple[str, str, str]]:
    """(name, state type, state message) of the embedded database's flow runs, oldest first."""
    [database] = list((workdir / "prefect").glob("*.db"))
    with sqlite3.connect(database) as connection:
        rows = connection.execute(
            "SELECT flow_run.name, flow_run.state_type, flow_run_state.message FROM flow_run "
            "JOIN flow_run_state ON flow_run.state_id = flow_run_state.id ORDER BY flow_run.created").fetchall()
    return [(name, state, message or "") for name, state, message in rows]


def mlflow_status(workdir: Path, run_id: str) -> str:
    from mlflow.tracking import MlflowClient

    from comlrl.tracking import RUN_KEY_TAG

    client = MlflowClient(f"sqlite:///{(workdir / 'mlflow' / 'mlflow.db').resolve()}")
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()],
                               filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_id}'")
    return run.info.status


def checkpoints(workdir: Path, run_id: str) -> list[str]:
    return sorted(p.name for p in (workdir / "runs" / run_id / "checkpoints").glob("checkpoint-*"))


def assert_final_weights(workdir: Path, run_id: str, uninterrupted: dict) -> None:
    final = workdir / "runs" / run_id / "checkpoints" / "checkpoint-3"
    for name, reference in uninterrupted.items():
        saved = load_file(str(final / "models" / f"{name}.safetensors"))
        assert all(saved[key].equal(reference[key]) for key in saved), f"{name} differs from the uninterrupted run"


HOLD_RUN = 18  # the run's step 18 (epoch 2 of 3) is in progress when the signal arrives
HOLD_RESUME = 10  # the resumed process's 10th step: 18 + 10 = step 28, in epoch 3


@pytest.mark.parametrize("number, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_checkpoints_the_last_step_and_resume_finishes_the_run(number, status, project, uninterrupted,
                                                                           tmp_path):
    workdir, run_id = tmp_path / "work", f"stopped-{number.name.lower()}"
    steering = held(workdir, HOLD_RUN)
    process = comlrl("run", str(project / "spec.yaml"), "--root", str(project), "--run-id", run_id,
                     workdir=workdir, **steering)
    sent = stop_during_step(process, Path(steering["SIGNALS_GATE"]), number)
    code, out, err = finish(process)
    assert time.monotonic() - sent < 60, "the stop took more than a minute"
    assert code == status, err[-3000:]
    assert "Traceback" not in err and "Traceback" not in out, err[-3000:]
    interrupted = f"checkpoint-1-step{HOLD_RUN}"  # the step in progress finished; nothing after it ran
    assert [name for name in checkpoints(workdir, run_id) if "-step" in name] == [interrupted]
    closing = [line for line in err.splitlines() if line.startswith("comlrl: ")]
    assert len(closing) == 1 and f"{number.name} received" in closing[0] and interrupted in closing[0], err[-3000:]
    assert f"comlrl resume {run_id}" in closing[0]
    assert all_gone(workdir), "a process of the run (the embedded Prefect server?) is still running"
    assert mlflow_status(workdir, run_id) == "KILLED"
    runs = prefect_flow_runs(workdir)
    assert (run_id, "CANCELLED") in [(name, state) for name, state, _ in runs], runs
    [message] = [message for name, state, message in runs if name == run_id]
    assert interrupted in message

    if number == signal.SIGINT:  # a stop reaches `comlrl resume` too: SIGTERM while it trains epoch 3
        steering = held(workdir, HOLD_RESUME)
        resumed = comlrl("resume", run_id, workdir=workdir, **steering)
        stop_during_step(resumed, Path(steering["SIGNALS_GATE"]), signal.SIGTERM)
        code, out, err = finish(resumed)
        assert code == 143 and "Traceback" not in err, err[-3000:]
        again = f"checkpoint-2-step{HOLD_RUN + HOLD_RESUME}"
        assert again in checkpoints(workdir, run_id), checkpoints(workdir, run_id)
        assert again in err and all_gone(workdir) and mlflow_status(workdir, run_id) == "KILLED"
    code, out, err = finish(comlrl("resume", run_id, workdir=workdir))
    assert code == 0, err[-3000:]
    assert mlflow_status(workdir, run_id) == "FINISHED"
    assert_final_weights(workdir, run_id, uninterrupted)


FAIL_AT = 18  # the reward raises in step 18 (epoch 2), before that step's update


def test_an_exception_in_a_step_keeps_the_last_completed_step_and_resume_finishes(project, uninterrupted, tmp_path):
    workdir, run_id = tmp_path / "work", "failed-reward"
    process = comlrl("run", str(project / "spec.yaml"), "--root", str(project), "--run-id", run_id,
                     workdir=workdir, SIGNALS_FAIL_AT=str(FAIL_AT))
    code, out, err = finish(process)
    assert code == 1, err[-3000:]
    assert [name for name in checkpoints(workdir, run_id) if "-step" in name] == [f"checkpoint-1-step{FAIL_AT - 1}"]
    closing = [line for line in err.splitlines() if line.startswith("comlrl: ")]
    assert len(closing) == 1 and "reward service is down" in closing[0] and f"comlrl resume {run_id}" in closing[0]
    assert all_gone(workdir)
    assert mlflow_status(workdir, run_id) == "FAILED"
    assert (run_id, "FAILED") in [(name, state) for name, state, _ in prefect_flow_runs(workdir)]

    code, out, err = finish(comlrl("resume", run_id, workdir=workdir))
    assert code == 0, err[-3000:]
    assert mlflow_status(workdir, run_id) == "FINISHED"
    assert_final_weights(workdir, run_id, uninterrupted)
