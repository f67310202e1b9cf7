"""MAAC, 2 agents and one centralised critic: ours vs the reference implementation, alternating runs.

Each run is its own process (ours with the project's .venv, the reference with
benchmarks/.venv-peers), alternating which side goes first over ``--repeats`` rounds; the
tables give the median over repeats of each run's median step. The first is the shared
comparison table (``report.comparison_table``); there "log-prob forward" is every forward
pass inside the update (actors' log-probs and the critic's values) and "other" holds the
rollout-time forwards, which the second table breaks out.

    .venv/bin/python benchmarks/compare_maac.py --repeats 3 --steps 5
"""

from __future__ import annotations

import json
import statistics
import sys

from compare import OURS_PYTHON, comparison_parser, common_options, run_runner
from report import comparison_table, summarise_runs

# Phases only the actor-critic runners record: (key, label).
MAAC_PHASES = [
    ("values", "critic value forward at rollout (s)"),
    ("old_logprobs", "log-prob forward at rollout (s)"),
    ("update", "whole update: advantages, forwards, backward, optimizers (s)"),
]


def phase_medians(results: list[dict]) -> dict[str, float]:
    """Median over repeats of each run's median step time in every MAAC phase (0 when a side has none)."""
    return {
        key: statistics.median(statistics.median(step["phases"].get(key, 0.0) for step in run["steps"]) for run in results)
        for key, _ in MAAC_PHASES
    }


def phase_table(ours: dict[str, float], theirs: dict[str, float], their_name: str) -> str:
    lines = [f"| rollout-time and update phases | ours | {their_name} | ours / {their_name} |", "|---|---:|---:|---:|"]
    for key, label in MAAC_PHASES:
        ratio = f"{ours[key] / theirs[key]:.2f}" if theirs[key] else "-"
        lines.append(f"| {label} | {ours[key]:.3f} | {theirs[key]:.3f} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    args = comparison_parser(__doc__, "compare_maac.json").parse_args()
    options = common_options(args) + ["--num-agents", "2"]
    order = [("ours", OURS_PYTHON, "run_ours_maac.py"), ("theirs", args.peers_python, "run_reference_maac.py")]
    results: dict[str, list[dict]] = {"ours": [], "theirs": []}
    for repeat in range(args.repeats):
        # Rotate who goes first, so no side always runs on a cold (or warm) machine.
        shift = repeat % len(order)
        for side, python, runner in order[shift:] + order[:shift]:
            print(f"repeat {repeat + 1}/{args.repeats}: maac / {side}", file=sys.stderr, flush=True)
            seed = ["--seed", str(repeat)]  # other samples every repeat, as in compare.py
            results[side].append(run_runner(python, runner, options + seed))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results))

    their_name = f"reference {results['theirs'][0]['versions'].get('comlrl')}"
    print(comparison_table(f"MAAC, 2 agents: ours vs reference comlrl ({args.device})",
                           summarise_runs(results["ours"]), summarise_runs(results["theirs"]), their_name))
    print()
    print(phase_table(phase_medians(results["ours"]), phase_medians(results["theirs"]), their_name))
    print()
    print(f"(num_generations={args.num_generations}, max_new_tokens={args.max_new_tokens}, hidden_size={args.hidden_size}, "
          f"centralised V critic, {args.steps} timed steps after 1 warm-up, median of {args.repeats} alternating repeats; "
          f"raw: {args.output})")


if __name__ == "__main__":
    main()
