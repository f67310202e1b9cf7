"""Step time of this library as num_agents, num_generations and max_new_tokens grow.

One factor at a time around a base (2 agents, 4 generations, 64 new tokens); each
configuration is its own process (a clean peak-memory figure). The last columns divide
the step time by the work, so growth faster than the work shows as a rising figure.

    .venv/bin/python benchmarks/scaling.py --steps 3
"""

from __future__ import annotations

import argparse
from pathlib import Path

from compare import HERE, OURS_PYTHON, build_model, run_runner
from report import summarise_run

BASE = {"num_agents": 2, "num_generations": 4, "max_new_tokens": 64}
GRID = {"num_agents": (1, 2, 4), "num_generations": (2, 4, 8), "max_new_tokens": (32, 64, 128)}


def configurations(grid: dict[str, tuple[int, ...]] = GRID) -> list[dict[str, int]]:
    seen, configs = set(), []
    for factor, values in grid.items():
        for value in values:
            config = {**BASE, factor: value}
            key = tuple(config.values())
            if key not in seen:
                seen.add(key)
                configs.append(config)
    return configs


def parse_grid(text: str) -> dict[str, tuple[int, ...]]:
    grid = {}
    for part in filter(None, text.split(";")):
        name, _, values = part.partition("=")
        if name not in GRID:
            raise argparse.ArgumentTypeError(f"unknown factor {name!r}; choose from {sorted(GRID)}")
        grid[name] = tuple(int(value) for value in values.split(","))
    return grid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model-dir", type=Path, help="use this model instead of building one")
    parser.add_argument("--grid", type=parse_grid, default=GRID,
                        help="factors to vary, e.g. 'num_agents=1,2;max_new_tokens=32' (default: the full grid)")
    args = parser.parse_args()
    model_dir = args.model_dir or build_model(HERE / "runs" / f"model-h{args.hidden_size}", args.hidden_size)
    print(f"### Scaling ({args.device}, hidden_size={args.hidden_size}, median of {args.steps} steps after 1 warm-up)\n")
    print("| agents | generations | max new tokens | step (s) | generation (s) | update (s) | tokens/step | "
          "ms per generated token | ms per (agent x generation) | peak RSS (MiB) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for config in configurations(args.grid):
        options = ["--model-dir", str(model_dir), "--steps", str(args.steps), "--device", args.device,
                   "--threads", str(args.threads)]
        options += [f"--{name.replace('_', '-')}={value}" for name, value in config.items()]
        summary = summarise_run(run_runner(OURS_PYTHON, "run_ours.py", options))
        update = summary["forward"] + summary["backward_optimizer"]
        per_token = 1000 * summary["step_time"] / max(summary["generated_tokens"], 1)
        per_sample = 1000 * summary["step_time"] / (config["num_agents"] * config["num_generations"])
        print(f"| {config['num_agents']} | {config['num_generations']} | {config['max_new_tokens']} | "
              f"{summary['step_time']:.3f} | {summary['generation']:.3f} | {update:.3f} | "
              f"{summary['generated_tokens']:.0f} | {per_token:.2f} | {per_sample:.0f} | {summary['peak_rss_mb']:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
