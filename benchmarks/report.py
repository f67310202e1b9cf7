"""Summaries and tables of runner results (JSON from workload.RunResult); standard library only."""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from workload import split_step

# (key, label, format)
METRICS = [
    ("step_time", "step time (s)", "{:.3f}"),
    ("cpu_time", "step CPU time (s)", "{:.3f}"),
    ("generation", "  generation (s)", "{:.3f}"),
    ("reward", "  reward scoring (s)", "{:.4f}"),
    ("forward", "  log-prob forward (s)", "{:.3f}"),
    ("backward_optimizer", "  backward + optimizer (s)", "{:.3f}"),
    ("other", "  other (s)", "{:.3f}"),
    ("samples_per_second", "samples/s", "{:.1f}"),
    ("tokens_per_second", "generated tokens/s (whole step)", "{:.0f}"),
    ("generation_tokens_per_second", "generated tokens/s (generation only)", "{:.0f}"),
    ("generated_tokens", "generated tokens per step", "{:.0f}"),
    ("decode_steps", "decode steps per step", "{:.0f}"),
    ("ms_per_decode_step", "generation ms per decode step", "{:.2f}"),
    ("peak_rss_mb", "peak resident memory (MiB)", "{:.0f}"),
    ("peak_cuda_mb", "peak CUDA memory (MiB)", "{:.0f}"),
    ("startup_time", "start-up to first step (s)", "{:.2f}"),
]


def summarise_run(result: dict[str, Any]) -> dict[str, float]:
    """Medians over one run's timed steps, plus its memory and start-up figures."""
    steps = result["steps"]
    per_step = []
    for step in steps:
        split = split_step(step["step_time"], step["phases"])
        split["step_time"] = step["step_time"]
        split["cpu_time"] = step.get("cpu_time", 0.0)
        split["samples_per_second"] = step["samples"] / step["step_time"]
        split["tokens_per_second"] = step["generated_tokens"] / step["step_time"]
        split["generation_tokens_per_second"] = step["generated_tokens"] / max(split["generation"], 1e-9)
        split["generated_tokens"] = step["generated_tokens"]
        if step.get("decode_steps"):
            split["decode_steps"] = step["decode_steps"]
            split["ms_per_decode_step"] = 1000 * split["generation"] / step["decode_steps"]
        per_step.append(split)
    summary = {key: statistics.median(s[key] for s in per_step) for key in per_step[0]}
    summary["peak_rss_mb"] = result["peak_rss_mb"]
    if result.get("peak_cuda_mb") is not None:
        summary["peak_cuda_mb"] = result["peak_cuda_mb"]
    summary["startup_time"] = result["startup_time"]
    return summary


def summarise_runs(results: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Median over repeats of each run's medians."""
    runs = [summarise_run(result) for result in results]
    keys = set.intersection(*(set(run) for run in runs))
    return {key: statistics.median(run[key] for run in runs) for key in keys}


def comparison_table(title: str, ours: dict[str, float], theirs: dict[str, float], their_name: str) -> str:
    """Markdown table of medians with the ratio ours / theirs."""
    lines = [f"### {title}", "", f"| metric | ours | {their_name} | ours / {their_name} |", "|---|---:|---:|---:|"]
    for key, label, fmt in METRICS:
        if key not in ours or key not in theirs:
            continue
        ratio = ours[key] / theirs[key] if theirs[key] else float("nan")
        lines.append(f"| {label} | {fmt.format(ours[key])} | {fmt.format(theirs[key])} | {ratio:.2f} |")
    return "\n".join(lines)


def single_table(title: str, rows: Sequence[tuple[str, dict[str, float]]], keys: Sequence[str]) -> str:
    labels = {key: (label.strip(), fmt) for key, label, fmt in METRICS}
    lines = [f"### {title}", "", "| run | " + " | ".join(labels[k][0] for k in keys) + " |",
             "|---|" + "---:|" * len(keys)]
    for name, summary in rows:
        lines.append(f"| {name} | " + " | ".join(labels[k][1].format(summary.get(k, float('nan'))) for k in keys) + " |")
    return "\n".join(lines)
