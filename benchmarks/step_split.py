"""Where the real-model fp32 step's time goes: its matrix products against everything else, per phase,
next to the floor (issue 30's "fp32 step within 1.5x of the floor").

The workload is ``real_model.py``'s (2 SmolLM2-135M agents, 2 prompts, 4 generations, 32 new
tokens, one MAGRPO epoch per step, 1 thread), built as ``real_levers.py`` builds it. After a
warm-up step, ``--steps`` steps run under torch's profiler; every operator's own CPU time is
summed by phase (generation = the rollout, update = the log-prob forward, backward and AdamW) and
split into matrix products (``aten::mm``/``addmm``/``bmm``, oneDNN's packed linear) and the rest.
One more step runs unprofiled for the step's CPU time without the profiler's overhead. The floor
(``real_model.floor``) uses this machine's matmul rate and bandwidth measured in the same run.

    .venv/bin/python benchmarks/step_split.py [--steps 1] [--output runs/step_split.json]

The matrix products' share is what the step would cost if every other operator (attention,
normalisation, activation, sampling noise, log-softmax, AdamW, weight packing, Python dispatch)
were free: a lower bound of the step with the kernels this torch build has, on these shapes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from real_levers import build_trainer
from real_model import MODEL_DIR, RealWorkload, floor, machine_rates, prompt_tokens
from roofline import model_shapes
from run_ours import counted_rollout
from workload import swapped

HERE = Path(__file__).resolve().parent
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise")
PHASES = ("generation", "update")


def phase_of(event: Any, spans: dict[str, list[tuple[float, float]]]) -> str | None:
    start = event.time_range.start
    return next((name for name, ranges in spans.items() if any(a <= start < b for a, b in ranges)), None)


def split(profiler: Any) -> dict[str, dict[str, float]]:
    """Self CPU seconds of matrix products and of everything else, in each phase's labelled spans."""
    events = profiler.events()
    spans = {name: [(e.time_range.start, e.time_range.end) for e in events if e.name == name] for name in PHASES}
    totals = {name: {"matmul": 0.0, "other": 0.0} for name in PHASES}
    for event in events:
        if event.name in PHASES:
            continue
        phase = phase_of(event, spans)
        if phase is not None:
            totals[phase]["matmul" if event.name in MATMULS else "other"] += event.self_cpu_time_total / 1e6
    return totals


class TokenCount:
    """Generated tokens per completion of the profiled rollouts (``run_ours.counted_rollout`` calls ``count``)."""

    def __init__(self, completions: int) -> None:
        self.completions, self.tokens = completions, []

    def count(self, tokens: int, decode_steps: int) -> None:
        self.tokens.append(tokens / self.completions)


def labelled(trainer: Any, counter: TokenCount) -> Any:
    """The trainer's rollout and update, each run inside a profiler label named after its phase."""
    from torch.profiler import record_function

    def label(name: str, function: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            with record_function(name):
                return function(*args, **kwargs)
        return call

    return swapped((trainer, "rollout", label("generation", counted_rollout(trainer.rollout, counter))),
                   (trainer, "update", label("update", trainer.update)))


def measure(steps: int, threads: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    rates_before = machine_rates(threads)
    trainer, rows = build_trainer(threads)
    trainer.train_step(rows)  # warm-up
    workload = RealWorkload()
    counter = TokenCount(2 * workload.num_prompts * workload.num_generations)
    with labelled(trainer, counter), profile(activities=[ProfilerActivity.CPU]) as profiler:
        for _ in range(steps):
            trainer.train_step(rows)
    totals = split(profiler)
    for phase in totals.values():
        for key in phase:
            phase[key] /= steps
    start = time.process_time()
    trainer.train_step(rows)
    unprofiled = time.process_time() - start
    rates_after = machine_rates(threads)
    rates = {key: max(rates_before[key], rates_after[key]) for key in rates_before}
    generated = sum(counter.tokens) / len(counter.tokens)
    bound = floor(model_shapes(MODEL_DIR), prompt_tokens(MODEL_DIR, workload), generated, workload, rates)
    return {"split": totals, "unprofiled_step": unprofiled, "floor": bound, "rates": rates, "steps": steps,
            "threads": threads, "new_tokens_per_completion": generated}


def table(result: dict[str, Any]) -> str:
    bound, split_ = result["floor"], result["split"]
    lines = ["| phase | matrix products (CPU s) | everything else (CPU s) | profiled total | floor (s) | "
             "matrix products / floor |", "|---|---:|---:|---:|---:|---:|"]
    matmul = other = 0.0
    for phase in PHASES:
        part = split_[phase]
        matmul, other = matmul + part["matmul"], other + part["other"]
        lines.append(f"| {phase} | {part['matmul']:.2f} | {part['other']:.2f} | {part['matmul'] + part['other']:.2f} | "
                     f"{bound[phase]:.2f} | {part['matmul'] / bound[phase]:.2f} |")
    lines.append(f"| step | {matmul:.2f} | {other:.2f} | {matmul + other:.2f} | {bound['step']:.2f} | "
                 f"{matmul / bound['step']:.2f} |")
    lines.append(f"\nunprofiled step: {result['unprofiled_step']:.2f} CPU s = "
                 f"{result['unprofiled_step'] / bound['step']:.2f} x the floor; 1.5 x the floor = "
                 f"{1.5 * bound['step']:.2f} s")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1, help="profiled steps after the warm-up")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", type=Path, default=HERE / "runs" / "step_split.json")
    args = parser.parse_args()
    result = measure(args.steps, args.threads)
    print(table(result))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
