"""The algorithm family, ours vs the reference comlrl 1.4.3: MAREINFORCE, MAReMax, MARLOO, MADPO, centralized MAGRPO.

Each run is its own process (ours with the project's .venv and ``run_ours_family.py``, the
reference with benchmarks/.venv-peers and ``run_reference_family.py``; ``bash
benchmarks/setup_peers.sh`` creates it) on the same workload: the tiny model of
``make_model.py``, the letters task, 2 agents, one prompt per step, every sampling and
optimisation setting given explicitly on both sides. Sides alternate which goes first over
``--repeats`` rounds. The table gives per algorithm and library the median time of a training
step (median over repeats of each run's median), the peak resident memory, and the eval reward
(the same held-out prompts and sampling code on both sides) before and after the run's steps.

    .venv/bin/python benchmarks/compare_family.py --repeats 1 --steps 4 --learning-rate 1e-3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Callable

from compare import HERE, OURS_PYTHON, PEERS_PYTHON, build_model, run_runner

ALGORITHMS = ("mareinforce", "maremax", "marloo", "madpo", "magrpo_centralized")
LABELS = {"mareinforce": "MAREINFORCE", "maremax": "MAReMax", "marloo": "MARLOO", "madpo": "MADPO",
          "magrpo_centralized": "centralized MAGRPO"}
RUNNERS = {"ours": "run_ours_family.py", "reference": "run_reference_family.py"}
# What differs between the two sides for each algorithm, whatever the settings (see benchmarks/README.md).
CAVEATS = {
    "mareinforce": "loss: ours dr_grpo (token sum / (N x max_new_tokens)), ref summed log-prob; same direction, Adam scale-invariant",
    "maremax": "as MAREINFORCE",
    "marloo": "as MAREINFORCE",
    "madpo": "ref collects all pairs once with the initial policy, then trains (offline); ours collects per step (online); "
             "ref step = one prompt's collection + one batch update",
    "magrpo_centralized": "ours clipped ratio (=1 at one epoch) with dr_grpo; ref summed joint log-prob",
}


def note_value(result: dict, key: str) -> float:
    for note in result["notes"]:
        if note.startswith(key + "="):
            return float(note.split("=", 1)[1])
    raise KeyError(f"{key} missing from the runner's notes: {result['notes']}")


def summarise(results: list[dict]) -> dict[str, float]:
    """Medians over repeats: step time (each run's median), peak RSS, eval reward before/after."""
    return {
        "step_time": statistics.median(statistics.median(s["step_time"] for s in r["steps"]) for r in results),
        "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in results),
        "eval_before": statistics.median(note_value(r, "eval_reward_before") for r in results),
        "eval_after": statistics.median(note_value(r, "eval_reward_after") for r in results),
        "steps_run": note_value(results[0], "steps_run"),
    }


def family_table(results: dict[str, dict[str, list[dict]]]) -> str:
    lines = ["| algorithm | library | median time per step (s) | peak RSS (MB) | eval reward before | eval reward after "
             "| steps | notes |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for algorithm, sides in results.items():
        for side, runs in sides.items():
            if not runs:
                continue
            summary = summarise(runs)
            library = "ours" if side == "ours" else f"comlrl {runs[0]['versions'].get('comlrl')}"
            note = CAVEATS[algorithm] if side == "reference" else ""
            lines.append(f"| {LABELS[algorithm]} | {library} | {summary['step_time']:.3f} | {summary['peak_rss_mb']:.0f} "
                         f"| {summary['eval_before']:.4f} | {summary['eval_after']:.4f} | {summary['steps_run']:.0f} | {note} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithms", nargs="+", choices=ALGORITHMS, default=list(ALGORITHMS))
    p.add_argument("--sides", nargs="+", choices=tuple(RUNNERS), default=list(RUNNERS),
                   help="which libraries to run (the smoke test runs ours only)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--steps", type=int, default=4, help="timed steps (after --warmup-steps)")
    p.add_argument("--warmup-steps", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--num-generations", type=int, default=4, help="group size (MADPO: candidates per prompt)")
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--pairs-per-prompt", type=int, default=2, help="MADPO pairs kept per prompt")
    p.add_argument("--eval-prompts", type=int, default=4)
    p.add_argument("--eval-samples", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--model-dir", type=Path, help="an existing tiny model (default: build one with make_model.py)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--peers-python", type=Path, default=PEERS_PYTHON)
    p.add_argument("--output", type=Path, default=HERE / "runs" / "compare_family.json")
    return p


def runner_options(args: argparse.Namespace, model_dir: Path, algorithm: str, seed: int) -> list[str]:
    return ["--algorithm", algorithm, "--model-dir", str(model_dir), "--steps", str(args.steps),
            "--warmup-steps", str(args.warmup_steps), "--max-new-tokens", str(args.max_new_tokens),
            "--num-generations", str(args.num_generations), "--learning-rate", str(args.learning_rate),
            "--pairs-per-prompt", str(args.pairs_per_prompt), "--eval-prompts", str(args.eval_prompts),
            "--eval-samples", str(args.eval_samples), "--device", args.device, "--threads", str(args.threads),
            "--seed", str(seed)]


def main(argv: list[str] | None = None, run_one: Callable[[str, list[str]], dict] | None = None) -> dict[str, dict[str, list[dict]]]:
    """Run the comparison; ``run_one(side, options)`` runs one runner (default: its own process in its venv)."""
    args = parser().parse_args(argv)
    if "reference" in args.sides and not args.peers_python.exists():
        sys.exit(f"{args.peers_python} is missing; create it with: bash benchmarks/setup_peers.sh "
                 "(or run ours only: --sides ours)")
    model_dir = args.model_dir or build_model(HERE / "runs" / f"model-h{args.hidden_size}", args.hidden_size)
    pythons = {"ours": OURS_PYTHON, "reference": args.peers_python}
    if run_one is None:
        def run_one(side: str, options: list[str]) -> dict:
            return run_runner(pythons[side], RUNNERS[side], options)
    results = {algorithm: {side: [] for side in args.sides} for algorithm in args.algorithms}
    for repeat in range(args.repeats):
        for algorithm in args.algorithms:
            # Rotate who goes first, so no side always runs on a cold (or warm) machine.
            shift = repeat % len(args.sides)
            for side in args.sides[shift:] + args.sides[:shift]:
                print(f"repeat {repeat + 1}/{args.repeats}: {algorithm} / {side}", file=sys.stderr, flush=True)
                options = runner_options(args, model_dir, algorithm, seed=repeat)
                results[algorithm][side].append(run_one(side, options))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results))
    print(family_table(results))
    print()
    print(f"(2 agents, letters task, num_generations={args.num_generations}, max_new_tokens={args.max_new_tokens}, "
          f"learning_rate={args.learning_rate}, hidden_size={args.hidden_size}, {args.steps} timed steps after "
          f"{args.warmup_steps} warm-up, eval on {args.eval_prompts} held-out prompts x {args.eval_samples} samples, "
          f"median of {args.repeats} repeat(s); raw: {args.output})")
    return results


if __name__ == "__main__":
    main()
