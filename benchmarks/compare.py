"""Ours vs the reference implementation (2 agents) and vs TRL GRPO (1 agent), alternating runs.

Each run is its own process: this library with the project's .venv, the peers with
benchmarks/.venv-peers (``bash benchmarks/setup_peers.sh``), since the reference also imports
as ``comlrl``. Runs alternate (ours, theirs, then theirs, ours, ...) for ``--repeats`` rounds;
the table gives the median over repeats of each run's median step. With ``--before`` the
reference comparison also runs this library with ``generation_backend="transformers"``
(``model.generate``, what the library did before its own decode loop) in the same rotation,
and prints that before/after table too. With ``--baseline-src DIR`` (a directory holding another
copy of the ``comlrl`` package, e.g. the files before a change) it also runs this library from
``DIR`` (``PYTHONPATH=DIR``, ours' runs only) in the same rotation and prints ours against it.

    .venv/bin/python benchmarks/compare.py --repeats 3 --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from report import comparison_table, summarise_runs

HERE = Path(__file__).resolve().parent
OURS_PYTHON = HERE.parent / ".venv" / "bin" / "python"
PEERS_PYTHON = HERE / ".venv-peers" / "bin" / "python"


def run_runner(python: Path, script: str, options: list[str], source: Path | None = None) -> dict:
    """One runner process; ``source``: a directory whose ``comlrl`` package it imports instead of the installed one."""
    env = {**os.environ, "PYTHONPATH": str(source)} if source else None
    with tempfile.NamedTemporaryFile(suffix=".json") as output:
        command = [str(python), str(HERE / script), *options, "--output", output.name]
        completed = subprocess.run(command, cwd=HERE, capture_output=True, text=True, env=env)
        if completed.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({completed.returncode}):\n{completed.stderr[-3000:]}")
        return json.loads(Path(output.name).read_text())


def build_model(directory: Path, hidden_size: int) -> Path:
    subprocess.run([str(OURS_PYTHON), str(HERE / "make_model.py"), str(directory), "--hidden-size", str(hidden_size)],
                   check=True, capture_output=True)
    return directory


def comparison_parser(description: str, output: str) -> argparse.ArgumentParser:
    """The options every comparison script shares (workload size, device, peers' venv, output)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--peers-python", type=Path, default=PEERS_PYTHON)
    parser.add_argument("--output", type=Path, default=HERE / "runs" / output)
    return parser


def common_options(args: argparse.Namespace) -> list[str]:
    """Runner options for ``args``, once the peers' venv is known to exist and the model is built."""
    if not args.peers_python.exists():
        sys.exit(f"{args.peers_python} is missing; create it with: bash benchmarks/setup_peers.sh")
    model_dir = build_model(HERE / "runs" / f"model-h{args.hidden_size}", args.hidden_size)
    return ["--model-dir", str(model_dir), "--steps", str(args.steps), "--max-new-tokens", str(args.max_new_tokens),
            "--num-generations", str(args.num_generations), "--device", args.device, "--threads", str(args.threads)]


def main() -> None:
    parser = comparison_parser(__doc__, "compare.json")
    parser.add_argument("--only", choices=("reference", "trl"), help="run one comparison only")
    parser.add_argument("--before", action="store_true",
                        help="also run ours with generation_backend=transformers (before/after of the decode loop)")
    parser.add_argument("--baseline-src", type=Path,
                        help="also run ours importing the comlrl package under this directory (before/after of a change)")
    args = parser.parse_args()
    if args.baseline_src and not (args.baseline_src / "comlrl" / "__init__.py").exists():
        sys.exit(f"--baseline-src {args.baseline_src}: no comlrl package there (expected {args.baseline_src}/comlrl)")
    common = common_options(args)
    comparisons = {
        "reference": ("run_reference.py", ["--num-agents", "2"]),
        "trl": ("run_trl.py", ["--num-agents", "1"]),
    }
    if args.only:
        comparisons = {args.only: comparisons[args.only]}
    results: dict[str, dict[str, list]] = {name: {"ours": [], "theirs": []} for name in comparisons}
    for repeat in range(args.repeats):
        for name, (script, extra) in comparisons.items():
            order = [("ours", OURS_PYTHON, "run_ours.py", [], None), ("theirs", args.peers_python, script, [], None)]
            if args.before and name == "reference":
                order.append(("before", OURS_PYTHON, "run_ours.py", ["--generation-backend", "transformers"], None))
                results[name].setdefault("before", [])
            if args.baseline_src:
                order.append(("baseline", OURS_PYTHON, "run_ours.py", [], args.baseline_src))
                results[name].setdefault("baseline", [])
            # Rotate who goes first, so no side always runs on a cold (or warm) machine.
            shift = repeat % len(order)
            for side, python, runner, options, source in order[shift:] + order[:shift]:
                print(f"repeat {repeat + 1}/{args.repeats}: {name} / {side}", file=sys.stderr, flush=True)
                seed = ["--seed", str(repeat)]  # other samples every repeat, so sampling luck averages out
                results[name][side].append(run_runner(python, runner, common + extra + options + seed, source))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results))
    titles = {
        "reference": f"MAGRPO, 2 agents: ours vs reference comlrl ({args.device})",
        "trl": f"GRPO, 1 agent: ours (MAGRPO, num_agents=1) vs TRL GRPOTrainer ({args.device})",
    }
    for name, sides in results.items():
        version = sides["theirs"][0]["versions"].get("comlrl" if name == "reference" else "trl")
        print(comparison_table(titles[name], summarise_runs(sides["ours"]), summarise_runs(sides["theirs"]),
                               f"{name} {version}"))
        print()
        if sides.get("before"):
            print(comparison_table(f"Before/after: our decode loop vs model.generate, 2 agents ({args.device})",
                                   summarise_runs(sides["ours"]), summarise_runs(sides["before"]), "generate"))
            print()
        if sides.get("baseline"):
            print(comparison_table(f"Ours vs ours from {args.baseline_src} ({name} runs, {args.device})",
                                   summarise_runs(sides["ours"]), summarise_runs(sides["baseline"]), "baseline"))
            print(comparison_table(f"Ours from {args.baseline_src} vs {name}", summarise_runs(sides["baseline"]),
                                   summarise_runs(sides["theirs"]), f"{name} {version}"))
            print()
    print(f"(num_generations={args.num_generations}, max_new_tokens={args.max_new_tokens}, hidden_size={args.hidden_size}, "
          f"{args.steps} timed steps after 1 warm-up, median of {args.repeats} alternating repeats; raw: {args.output})")


if __name__ == "__main__":
    main()
