"""Orchestration overhead: the training flow against the plain trainer, same spec, same steps.

Every variant trains the bundled demo spec (``flows/specs/letters.yaml``: two tiny Llama agents,
MAGRPO, 3 epochs of 128 steps). Each process runs rounds of the three variants back to back, in
rotating order (after one unrecorded warm-up round), and the overheads are the medians of the
per-round ratios, so slow drifts of a shared machine's load cancel out:

- ``plain``: ``trainer.train()``, the library alone;
- ``plain+work``: ``trainer.train(checkpoint_dir=...)`` with ``trainer.evaluate()`` at every epoch
  end, the work the flow adds by design (a checkpoint and an evaluation per boundary);
- ``flow``: ``flows.training.train_flow`` on the embedded default (Prefect's ephemeral server,
  an MLflow SQLite store), as ``comlrl demo`` runs it. ``--flows-dir DIR`` imports the ``flows``
  package from DIR instead (e.g. an export of an older commit, for a before/after).

Measured in each: the **training phase**, from the end of ``begin_training`` (seeded or restored)
to the start of ``end_training`` — every boundary with its steps, and for the flow its subflows,
tasks, transactions, metrics, artifacts. These two methods are wrapped from outside; no library
code changes. Two clocks: wall time, and the CPU time of the run's whole process tree (the
process and its children, so the flow's ephemeral Prefect server is counted), which a machine
shared with other work inflates far less than wall time. The flow's fixed costs around the
phase (Prefect server start, spec, MLflow run, model load; registration, gate, artifacts) are
reported separately.

    .venv/bin/python benchmarks/flow_overhead.py --processes 2 --rounds 3
    .venv/bin/python benchmarks/flow_overhead.py --flows-dir /tmp/flows-before --label before
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("plain", "plain+work", "flow")


def tree_cpu_seconds() -> float:
    """User + system CPU seconds of this process and all its live children."""
    import psutil

    process = psutil.Process()
    total = 0.0
    for member in [process, *process.children(recursive=True)]:
        try:
            times = member.cpu_times()
            total += times.user + times.system
        except psutil.Error:  # a child that just ended
            pass
    return total


MARKS: dict[str, float] = {}


def phase_clock() -> dict[str, float]:
    """Wrap TrainingLoop.begin_training / end_training (once per process) to record when the training
    phase starts and ends; returns the cleared marks of the next run."""
    from comlrl.training.loop import TrainingLoop

    MARKS.clear()
    if getattr(TrainingLoop.begin_training, "phase_clock", False):
        return MARKS
    begin, end = TrainingLoop.begin_training, TrainingLoop.end_training

    def timed_begin(self, *args, **kwargs):
        runner = begin(self, *args, **kwargs)
        MARKS["begin"], MARKS["cpu_begin"] = time.perf_counter(), tree_cpu_seconds()
        return runner

    def timed_end(self, *args, **kwargs):
        MARKS["end"], MARKS["cpu_end"] = time.perf_counter(), tree_cpu_seconds()
        MARKS["steps"] = self.state.global_step
        return end(self, *args, **kwargs)

    timed_begin.phase_clock = True
    TrainingLoop.begin_training, TrainingLoop.end_training = timed_begin, timed_end
    return MARKS


def run_plain(work: bool, directory: Path) -> dict:
    from comlrl.callbacks import TrainerCallback
    from flows.build import build_trainer
    from flows.spec import load_spec

    class EvaluateEachEpoch(TrainerCallback):
        def on_epoch_end(self, trainer, epoch):
            trainer.evaluate()

    marks = phase_clock()
    spec = load_spec(ROOT / "flows" / "specs" / "letters.yaml", ROOT)
    trainer = build_trainer(spec, ROOT, directory, [EvaluateEachEpoch()] if work else [])
    if work:
        trainer.train(checkpoint_dir=str(directory / "checkpoints"), checkpoint_interval=1)
    else:
        trainer.train()
    return {"phase_seconds": marks["end"] - marks["begin"], "phase_cpu_seconds": marks["cpu_end"] - marks["cpu_begin"],
            "steps": marks["steps"]}


def run_flow(directory: Path, run_id: str) -> dict:
    from flows.training import train_flow

    marks = phase_clock()
    started = time.perf_counter()
    train_flow(spec_path=str(ROOT / "flows" / "specs" / "letters.yaml"), run_id=run_id, workdir=str(directory),
               root=str(ROOT), tracking_uri=f"sqlite:///{directory / 'mlflow.db'}")
    finished = time.perf_counter()
    return {"phase_seconds": marks["end"] - marks["begin"], "phase_cpu_seconds": marks["cpu_end"] - marks["cpu_begin"],
            "start_seconds": marks["begin"] - started, "finish_seconds": finished - marks["end"],
            "total_seconds": finished - started, "steps": marks["steps"]}


def series(rounds: int, threads: int) -> list[dict]:
    """``rounds`` rounds in this process, each the three variants back to back (rotating order), after
    one unrecorded warm-up round (first imports, the ephemeral Prefect server's start)."""
    import torch

    torch.set_num_threads(threads)
    base = Path(tempfile.mkdtemp(prefix="flow-overhead-"))
    from flows.runs import configure_embedded_default

    configure_embedded_default(base)
    records = []
    for number in range(rounds + 1):
        order = VARIANTS[number % len(VARIANTS):] + VARIANTS[:number % len(VARIANTS)]
        for variant in order:
            directory = base / f"round{number}-{variant.replace('+', '-')}"
            directory.mkdir()
            if variant == "flow":
                record = run_flow(directory, f"overhead-{os.getpid()}-{number}")
            else:
                record = run_plain(variant == "plain+work", directory)
            if number > 0:
                records.append({"variant": variant, "round": number, "pid": os.getpid(), **record})
    return records


def drive(args: argparse.Namespace) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if args.flows_dir:
        env["PYTHONPATH"] = os.pathsep.join([str(Path(args.flows_dir).resolve()), str(ROOT)])
    records: list[dict] = []
    for process in range(args.processes):
        command = [sys.executable, __file__, "--series", str(args.rounds), "--threads", str(args.threads)]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
        lines = [line for line in done.stdout.splitlines() if line.startswith("[")]
        if done.returncode != 0 or not lines:
            raise SystemExit(f"process {process + 1} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        for record in json.loads(lines[-1]):
            records.append(record)
            print(f"process {process + 1} round {record['round']} {record['variant']}: "
                  f"{record['phase_seconds']:.2f} s wall, {record['phase_cpu_seconds']:.2f} s CPU", flush=True)
    return records


def paired(records: list[dict], key: str, baseline: str) -> list[float]:
    """flow / baseline - 1 within each round (the same process, minutes apart at most)."""
    by_round: dict[tuple[int, int], dict[str, float]] = {}
    for record in records:
        by_round.setdefault((record["pid"], record["round"]), {})[record["variant"]] = record[key]
    return [values["flow"] / values[baseline] - 1 for values in by_round.values() if {"flow", baseline} <= set(values)]


def report(records: list[dict], label: str) -> str:
    def med(variant: str, key: str) -> float:
        return statistics.median(r[key] for r in records if r["variant"] == variant)

    flows = [r for r in records if r["variant"] == "flow"]
    steps = flows[0]["steps"]
    lines = [f"#### Training phase, {steps} steps ({label}; {len(flows)} rounds, medians)", "",
             "| variant | wall (s) | wall per step (s) | CPU, process tree (s) | flow over it, wall | flow over it, CPU |",
             "|---|---:|---:|---:|---:|---:|"]
    for variant in VARIANTS:
        over = ["", ""]
        if variant != "flow":
            over = [f"{100 * statistics.median(paired(records, key, variant)):+.0f}%"
                    for key in ("phase_seconds", "phase_cpu_seconds")]
        wall = med(variant, "phase_seconds")
        lines.append(f"| {variant} | {wall:.2f} | {wall / steps:.3f} | {med(variant, 'phase_cpu_seconds'):.2f} | "
                     f"{over[0]} | {over[1]} |")
    lines += ["", f"Overheads are medians of the per-round ratios. Flow fixed costs (medians): start "
              f"{med('flow', 'start_seconds'):.1f} s, finish {med('flow', 'finish_seconds'):.1f} s, whole flow "
              f"{med('flow', 'total_seconds'):.1f} s."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2, help="processes, one after the other (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="recorded rounds per process (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as the demo)")
    parser.add_argument("--flows-dir", help="import the flows package from this directory (a before/after)")
    parser.add_argument("--label", default="this tree")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "runs" / "flow_overhead.json"))
    parser.add_argument("--series", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.series:
        print(json.dumps(series(args.series, args.threads)), flush=True)
        return
    records = drive(args)
    text = report(records, args.label)
    print(text)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"label": args.label, "records": records, "report": text}, indent=2))


if __name__ == "__main__":
    main()
