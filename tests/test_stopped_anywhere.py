"""Issue 42, the stopped-anywhere property: a run stopped at any moment (SIGTERM, SIGINT, SIGKILL or an exception
from its reward; during start-up, a step, an evaluation, a checkpoint write, artifact logging, registration or
the gate) and resumed until it finishes leaves the same record as the same run uninterrupted:

- every metric point once, with the same value (timings aside), so the same eval points;
- the same boundary rows (``boundaries.jsonl``), the same table artifact in Prefect and the same ``result.json``;
- the same curve (the PNG's bytes);
- the same registered versions, aliases and version tags; the MLflow run FINISHED;
- while it is stopped, the MLflow run is KILLED or FAILED, never RUNNING (a SIGKILL excepted: a killed process
  marks nothing; the resume does).

Real ``comlrl run`` / ``resume`` processes; the stop moments are drawn from a seed (a delay after the start,
uniform over the uninterrupted run's duration, or the reward call that fails). Every store is read with
``sqlite3`` (MLflow's and the embedded Prefect server's), not through the code under test."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import time
from pathlib import Path

import pytest
import yaml

from letters_spec import letters_spec
from test_run_failures import COMLRL, environment, finished, start
from comlrl.tasks.letters import write_dataset

RUN_ID = "anywhere-1"
# The e2e tier's draws (kinds and moments printed with -s): a SIGKILL in epoch 2, then a reward failure in the
# resume (MAGRPO); a SIGTERM inside the policy stage (MARLHF). Two cases keep the tier inside CI's time;
# COMLRL_STOP_SEEDS=1-20 draws more (each ~90 s; 1-8 pass for both algorithms, see the closing note).
SEEDS = {"magrpo": (5,), "marlhf": (1,)}
if os.environ.get("COMLRL_STOP_SEEDS"):
    first, _, last = os.environ["COMLRL_STOP_SEEDS"].partition("-")
    SEEDS = {algorithm: tuple(range(int(first), int(last or first) + 1)) for algorithm in SEEDS}
CASES = [(algorithm, seed) for algorithm, seeds in SEEDS.items() for seed in seeds]
KINDS = ("SIGTERM", "SIGINT", "SIGKILL", "exception")
# Metrics that measure the machine (time, memory), not training: they differ between any two runs.
TIMINGS = ("seconds", "time", "per_second", "throughput", "duration", "elapsed", "memory/")
JUDGE = '''
import time
from pathlib import Path

from comlrl.tasks.letters import letters_reward

HERE = Path(__file__).parent


def reward(completions_0, completions_1, batch_items=None):
    """The letters reward; raises once at the call ``fail-at`` names (counted across processes in ``calls``)."""
    calls = HERE / "calls"
    count = int(calls.read_text()) + 1 if calls.exists() else 1
    calls.write_text(str(count))
    with open(HERE / "calls.log", "a") as log:  # when each call came: the moments a stop is drawn between
        log.write(f"{time.monotonic()}\\n")
    fail = HERE / "fail-at"
    if fail.exists() and int(fail.read_text()) == count:
        fail.unlink()
        raise RuntimeError(f"the judge failed at call {count}")
    return letters_reward(completions_0, completions_1, batch_items)
'''


def project(tmp_path: Path, algorithm: str) -> tuple[Path, Path]:
    """The letters task with ``judge.py`` as its reward: MAGRPO for two epochs with an evaluation after every
    step, or MARLHF (collection, a reward-model fit, a policy stage of one epoch)."""
    root = tmp_path / "project"
    write_dataset(root / "data" / "letters", num_train=4, num_eval=2)
    (root / "judge.py").write_text(JUDGE)
    if algorithm == "magrpo":
        spec = letters_spec("anywhere", num_generations=2, max_new_tokens=4, num_train_epochs=2,
                            per_device_train_batch_size=2, eval_interval=1, logging_steps=1)
    else:
        spec = letters_spec("anywhere", num_generations=2, max_new_tokens=4, num_train_epochs=1,
                            per_device_train_batch_size=2, logging_steps=1, reward_model_device=None,
                            reward_train_epochs=2, reward_batch_size=2)
        spec["algorithm"] = algorithm
    spec["reward"] = "judge:reward"
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    return root / "spec.yaml", root


# ---- the record, read from the stores ----------------------------------------------------------------------

def timing(key: str) -> bool:
    return any(word in key.lower() for word in TIMINGS)


def normalized(value, workdir: Path, runs: set[str]):
    """``value`` without timings, with the workdir's path as ``<workdir>`` and the MLflow run's id as
    ``<the run>`` (both differ between any two runs)."""
    if isinstance(value, dict):
        return {key: normalized(item, workdir, runs) for key, item in value.items() if not timing(key)}
    if isinstance(value, list):
        return [normalized(item, workdir, runs) for item in value]
    if isinstance(value, str):
        return "<the run>" if value in runs else value.replace(str(workdir), "<workdir>")
    return value


def mlflow_runs(workdir: Path) -> set[str]:
    with sqlite3.connect(workdir / "mlflow" / "mlflow.db") as db:
        return {run for (run,) in db.execute("SELECT run_uuid FROM runs")}


def mlflow_record(workdir: Path) -> dict:
    with sqlite3.connect(workdir / "mlflow" / "mlflow.db") as db:
        statuses = [status for (status,) in db.execute("SELECT status FROM runs")]
        metrics = sorted((key, step, value) for key, step, value in
                         db.execute("SELECT key, step, value FROM metrics") if not timing(key))
        versions = sorted(db.execute("SELECT name, version FROM model_versions"))
        aliases = sorted(db.execute("SELECT name, alias, version FROM registered_model_aliases"))
        runs = {run for (run,) in db.execute("SELECT run_uuid FROM runs")}
        # The MLflow run's id differs between any two runs: the tags that name it are compared as "<the run>".
        tags = sorted((name, version, key, "<the run>" if value in runs else value) for name, version, key, value
                      in db.execute("SELECT name, version, key, value FROM model_version_tags"))
    return dict(statuses=statuses, metrics=metrics, versions=versions, aliases=aliases, tags=tags)


def run_status(workdir: Path) -> list[str]:
    with sqlite3.connect(workdir / "mlflow" / "mlflow.db") as db:
        return [status for (status,) in db.execute("SELECT status FROM runs")]


def table_artifact(workdir: Path) -> list[dict]:
    """The newest version of the run's boundaries table in the embedded Prefect server's database."""
    with sqlite3.connect(workdir / "prefect" / "prefect.db") as db:
        rows = db.execute("SELECT data FROM artifact WHERE type = 'table' ORDER BY created DESC LIMIT 1").fetchall()
    data = json.loads(rows[0][0])
    return json.loads(data) if isinstance(data, str) else data


def record(workdir: Path) -> dict:
    run, runs = workdir / "runs" / RUN_ID, mlflow_runs(workdir)
    rows = [json.loads(line) for line in (run / "boundaries.jsonl").read_text().splitlines() if line.strip()]
    curves = sorted((workdir / "mlflow" / "artifacts").rglob("reward_curve.png"))
    return dict(mlflow_record(workdir), table=normalized(table_artifact(workdir), workdir, runs),
                rows=normalized(rows, workdir, runs),
                result=normalized(json.loads((run / "result.json").read_text()), workdir, runs),
                curve=[path.read_bytes() for path in curves],
                boundary_checkpoints=sorted(path.name for path in (run / "checkpoints").glob("checkpoint-*")
                                            if "-step" not in path.name))


# ---- stops -------------------------------------------------------------------------------------------------

def draw(rng: random.Random, gaps: list[float], calls: int) -> tuple[str, int, float]:
    """One stop: its kind and its moment. A signal comes ``delay`` seconds after the reward's call ``after``
    (0: the start), the delay uniform over what that gap lasted in the uninterrupted run, so start-up, each
    step, evaluation and checkpoint, and the end of the run (gate, artifacts, registration) are equally likely
    gaps; an exception is the reward failing at its call ``after``."""
    kind = rng.choice(KINDS)
    if kind == "exception":
        return kind, rng.randint(1, calls), 0.0
    after = rng.randint(0, len(gaps) - 1)
    return kind, after, round(rng.uniform(0.0, gaps[after]), 2)


def calls_so_far(root: Path) -> int:
    """Reward calls made so far: the lines of the append-only ``calls.log`` (``calls`` is rewritten in place)."""
    return len((root / "calls.log").read_text().split()) if (root / "calls.log").exists() else 0


def attempt(command: list[str], cwd: Path, root: Path, stop: tuple[str, int, float] | None) -> tuple[int, str, str]:
    """One process, stopped as ``stop`` says; its exit status, standard error, and where the stop came."""
    first = calls_so_far(root)
    if stop is not None and stop[0] == "exception":
        (root / "fail-at").write_text(str(first + stop[1]))
    process = start(command, cwd)
    where = "not sent: the run ended first"
    if stop is not None and stop[0] != "exception":
        kind, after, delay = stop
        while process.poll() is None and calls_so_far(root) < first + after:
            time.sleep(0.02)
        time.sleep(delay)
        if process.poll() is None:
            process.send_signal(getattr(signal, kind))
            where = f"sent {delay:.2f} s after call {calls_so_far(root) - first} of this process"
    code, _, stderr = finished(process)
    if stop is not None and stop[0] == "exception":
        where = f"raised at call {stop[1]} of this process"
    if (root / "fail-at").exists():
        where = "not raised: the run ended first"
        (root / "fail-at").unlink()
    return code, stderr, where


def gaps_of(started: float, root: Path, ended: float) -> list[float]:
    times = [started, *(float(line) for line in (root / "calls.log").read_text().split()), ended]
    return [later - earlier for earlier, later in zip(times, times[1:])]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The record, reward-call gaps and calls of each algorithm's run never stopped (made once per module)."""
    made = {}

    def of(algorithm: str) -> dict:
        if algorithm not in made:
            tmp_path = tmp_path_factory.mktemp(f"uninterrupted-{algorithm}")
            spec, root = project(tmp_path, algorithm)
            workdir = tmp_path / "work"
            started = time.monotonic()
            code, _, stderr = finished(start(["run", str(spec), "--root", str(root), "--workdir", str(workdir),
                                              "--run-id", RUN_ID], tmp_path / "cwd"))
            assert code == 0, stderr[-4000:]
            made[algorithm] = dict(record=record(workdir), gaps=gaps_of(started, root, time.monotonic()),
                                   calls=calls_so_far(root))
        return made[algorithm]

    return of


@pytest.mark.e2e  # per seed: a stopped real run and its resumes, ~90 s on a loaded 2-core machine
@pytest.mark.parametrize("algorithm, seed", CASES)
def test_a_run_stopped_anywhere_and_resumed_leaves_the_record_of_one_never_stopped(algorithm, seed, uninterrupted,
                                                                                   tmp_path):
    uninterrupted = uninterrupted(algorithm)
    rng = random.Random(seed)
    stops = [draw(rng, uninterrupted["gaps"], uninterrupted["calls"]) for _ in range(rng.choice((1, 2)))]
    spec, root = project(tmp_path, algorithm)
    workdir, cwd = tmp_path / "work", tmp_path / "cwd"
    command = ["run", str(spec), "--root", str(root), "--workdir", str(workdir), "--run-id", RUN_ID]
    seen = []
    for attempt_number in range(len(stops) + 2):
        stop = stops[attempt_number] if attempt_number < len(stops) else None
        code, stderr, where = attempt(command, cwd, root, stop)
        last = stderr.strip().splitlines()[-1:]
        seen.append((stop, code, where, last))
        print(f"seed {seed} attempt {attempt_number + 1}: {stop} {where} -> exit {code}; last line: {last}")
        if where.startswith(("sent", "raised")) and code != 0:
            kind = stop[0]
            # 128 + the signal's number, as the shell reports it; killed by the signal itself only once the
            # command has returned (the interpreter's exit), when the run's end is already written.
            finished_first = kind != "exception" and code == -getattr(signal, kind) and \
                (workdir / "runs" / RUN_ID / "result.json").exists()
            assert code == {"SIGTERM": 143, "SIGINT": 130, "SIGKILL": -9, "exception": 1}[kind] or finished_first, \
                (stop, code, stderr[-3000:])
        if code == 0:
            break
        assert "Traceback" not in stderr, stderr[-4000:]
        if (workdir / "mlflow" / "mlflow.db").exists() and stop is not None and stop[0] != "SIGKILL":
            assert "RUNNING" not in run_status(workdir), (stop, stderr[-3000:])
        if (workdir / "runs" / RUN_ID / "spec.yaml").exists():
            command = ["resume", RUN_ID, "--workdir", str(workdir)]
    assert seen[-1][1] == 0, seen
    got, expected = record(workdir), uninterrupted["record"]
    for part in expected:
        if isinstance(expected[part], list) and got[part] != expected[part] and part != "curve":
            extra = [item for item in got[part] if item not in expected[part]]
            missing = [item for item in expected[part] if item not in got[part]]
            print(f"{part}: extra {extra[:12]} missing {missing[:12]} ({len(got[part])} vs {len(expected[part])})")
        assert got[part] == expected[part], (part, seen)
