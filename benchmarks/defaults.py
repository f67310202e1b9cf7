"""The benchmark of record: the same user script under both libraries, each at its own defaults.

``user_script.py`` is run once per measurement, in this library's ``.venv`` and in
``benchmarks/.venv-peers`` (comlrl 1.4.3; ``bash benchmarks/setup_peers.sh``), in turns: each round
runs every (threads, setup) cell on both sides, the side that goes first alternating by round, and
the tables give medians over rounds. Threads: ``default`` leaves torch's own choice (one per core),
a number sets ``OMP_NUM_THREADS``/``MKL_NUM_THREADS``. Setups:

* ``defaults``: nothing but the workload (the user's view).
* ``one-prompt-per-update``: both given ``rollout_buffer_size=1`` (a name both accept): one update per
  prompt on both sides, this library's default before it matched 1.4.3's two.

    .venv/bin/python benchmarks/defaults.py                              # real model (SmolLM2), 3 rounds
    .venv/bin/python benchmarks/defaults.py --task letters --prompts 12  # the tiny model
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PYTHONS = {"ours": ROOT / ".venv" / "bin" / "python", "original": HERE / ".venv-peers" / "bin" / "python"}
SETUPS = {"defaults": {}, "one-prompt-per-update": {"rollout_buffer_size": 1}}
REAL_MODEL = ROOT / ".comlrl" / "models" / "smollm2-135m-instruct"
TINY_MODEL = ROOT / ".comlrl" / "models" / "bench-tiny"


def run(side: str, job: dict, threads: str) -> dict:
    env = {key: value for key, value in os.environ.items() if key not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if threads != "default":
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = threads
    env["PYTHONPATH"] = ""  # each venv imports its own comlrl
    started = time.perf_counter()
    done = subprocess.run([str(PYTHONS[side]), str(HERE / "user_script.py"), json.dumps(job)], env=env, cwd=HERE,
                          capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"{side} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return {**json.loads(lines[-1][len("RESULT "):]), "process_s": time.perf_counter() - started}


def table(runs: list[dict], threads_list: list[str], setup: str) -> str:
    rows = ["| threads | | ours | original 1.4.3 | ours / original |", "|---|---|---:|---:|---:|"]
    for threads in threads_list:
        cell = {side: [r for r in runs if r["side"] == side and r["threads_asked"] == threads and r["setup"] == setup]
                for side in PYTHONS}
        if not all(cell.values()):
            continue
        for key, label, digits in (("train_s", "`train()` wall s, median", 1), ("script_s", "whole script s", 1),
                                   ("train_cpu_s", "`train()` CPU s", 1), ("peak_rss_mib", "peak RSS MiB", 0),
                                   ("optimizer_steps", "optimizer steps (all agents)", 0)):
            ours = statistics.median(r[key] for r in cell["ours"])
            original = statistics.median(r[key] for r in cell["original"])
            rows.append(f"| {threads} ({cell['ours'][0]['threads']}) | {label} | {ours:.{digits}f} | "
                        f"{original:.{digits}f} | {ours / original:.2f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=("writing", "letters"), default="writing")
    parser.add_argument("--model-dir", help="default: SmolLM2 for writing, the tiny benchmark model for letters")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", default="default,1", help="comma-separated: 'default' and/or numbers")
    parser.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {sorted(SETUPS)}")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    model_dir = Path(args.model_dir) if args.model_dir else (REAL_MODEL if args.task == "writing" else TINY_MODEL)
    if args.task == "letters" and not args.model_dir:
        sys.path.insert(0, str(HERE))
        from make_model import make_model

        make_model(model_dir)
    threads_list, setups = args.threads.split(","), args.setups.split(",")
    output = args.output or HERE / "runs" / f"defaults-{args.task}.json"
    runs: list[dict] = []
    for round_index in range(args.rounds):
        sides = list(PYTHONS) if round_index % 2 == 0 else list(PYTHONS)[::-1]
        for threads in threads_list:
            for setup in setups:
                for side in sides:
                    job = {"model_dir": str(model_dir), "task": args.task, "prompts": args.prompts,
                           "num_generations": args.num_generations, "max_new_tokens": args.max_new_tokens,
                           "config": SETUPS[setup]}
                    result = {**run(side, job, threads), "side": side, "setup": setup, "threads_asked": threads,
                              "round": round_index, "load_before": os.getloadavg()[0]}
                    runs.append(result)
                    print(f"round {round_index} {threads:>7} {setup:<22} {side:<8} train {result['train_s']:6.1f} s "
                          f"script {result['script_s']:6.1f} s  rss {result['peak_rss_mib']:6.0f} MiB  "
                          f"steps {result['optimizer_steps']}", flush=True)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}, indent=1))
    for setup in setups:
        print(f"\n#### {setup}\n\n{table(runs, threads_list, setup)}")


if __name__ == "__main__":
    main()
