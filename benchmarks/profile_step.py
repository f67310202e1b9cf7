"""Profile training steps of this library with torch.profiler and print the top costs.

Usage: python profile_step.py --model-dir DIR [--steps 1] [--trace runs/trace.json]
Warm-up steps run first, unprofiled; the table sorts operators by their own (self) time.
"""

from __future__ import annotations

import time

from workload import PhaseTimer, Workload, runner_parser


def profile(workload: Workload, row_limit: int = 25, trace: str | None = None) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile, record_function

    from run_ours import build_trainer

    workload.setup_torch()
    trainer = build_trainer(workload, PhaseTimer(workload.device))
    rows = workload.rows()
    for row in rows[: workload.warmup_steps]:
        trainer.train_step([row])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if workload.device.startswith("cuda") else [])
    start = time.perf_counter()
    with torch_profile(activities=activities, record_shapes=False) as profiler:
        for row in rows[workload.warmup_steps:]:
            with record_function("train_step"):
                metrics = trainer.train_step([row])
    elapsed = time.perf_counter() - start
    if trace:
        profiler.export_chrome_trace(trace)
    sort_by = "self_cuda_time_total" if workload.device.startswith("cuda") else "self_cpu_time_total"
    table = profiler.key_averages().table(sort_by=sort_by, row_limit=row_limit)
    stages = ", ".join(f"{name}={metrics[name]:.3f}s" for name in ("generation_time", "reward_time", "update_time"))
    return f"{workload.steps} profiled step(s) in {elapsed:.3f}s (last step: {stages})\n{table}"


def main() -> None:
    parser = runner_parser(__doc__)
    parser.add_argument("--row-limit", type=int, default=25)
    parser.add_argument("--trace", help="also write a Chrome trace here")
    args = parser.parse_args()
    print(profile(Workload.from_arguments(args), args.row_limit, args.trace))


if __name__ == "__main__":
    main()
