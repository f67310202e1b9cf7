"""How the cost of a step grows: agents, generations, new tokens and prompts per step, against a floor.

One factor at a time around a base (2 agents, 4 generations, 32 new tokens, 2 prompts per
step = ``per_device_train_batch_size=2``) on the benchmark's tiny model; each configuration is
its own process (a clean peak-memory figure), with one torch thread; the median of ``--steps``
timed steps after a warm-up. Every step is timed in wall seconds and in the process's CPU
seconds (``time.process_time``: with one torch thread, the work the step did; a loaded machine
stretches the wall time, and the CPU time less so), and its phases in CPU seconds.

Beside each configuration, its **floor** (:func:`floor`): the least work the step needs at this
machine's rates, measured in the same invocation (before and after the sweep, per CPU second;
the best): the fp32 1024^3 matmul rate and the read bandwidth of buffers the size of the data
each part streams. The work divided out is the tokens the step generated: a figure that stays
flat as a factor grows is growth linear in the work. ``--from`` reports saved sweeps, several
at once: per configuration the least disturbed (``--statistic min``, the default) or the median.

    .venv/bin/python benchmarks/scaling.py --steps 3                       # the table
    .venv/bin/python benchmarks/scaling.py --steps 5 --plot                # + benchmarks/scaling.png
    .venv/bin/python benchmarks/scaling.py --grid 'num_agents=2,4'         # one factor only
    .venv/bin/python benchmarks/scaling.py --steps 5 --plot --real         # + SmolLM2-135M at 16/32/64 tokens
    .venv/bin/python benchmarks/scaling.py --from A.json B.json --plot     # redraw from saved sweeps
    .venv/bin/python benchmarks/scaling.py run --model-dir DIR ...         # one runner, in this process
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BASE = {"num_agents": 2, "num_generations": 4, "max_new_tokens": 32, "per_device_train_batch_size": 2}
GRID = {"num_agents": (2, 3, 4), "num_generations": (2, 4, 8, 16), "max_new_tokens": (16, 32, 64, 128),
        "per_device_train_batch_size": (1, 2, 4)}
LABELS = {"num_agents": "agents", "num_generations": "generations", "max_new_tokens": "max new tokens",
          "per_device_train_batch_size": "prompts per step"}
REAL_MODEL = HERE.parent / ".comlrl" / "models" / "smollm2-135m-instruct"


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


# ----- the runner (one configuration, in its own process) -------------------------------------------------
def scaling_workload_class():
    """``workload.Workload`` with ``per_device_train_batch_size`` prompts per step (the shared workload
    trains one prompt per step)."""
    from workload import FORMS, SUBJECTS, Workload

    @dataclass
    class ScalingWorkload(Workload):
        per_device_train_batch_size: int = 1

        def ours_config(self) -> dict[str, Any]:
            return {**super().ours_config(), "per_device_train_batch_size": self.per_device_train_batch_size}

        def rows(self) -> list[dict[str, str]]:
            prompts = [form.format(subject) for subject in SUBJECTS for form in FORMS]
            return [{"prompt": prompts[i % len(prompts)]}
                    for i in range(self.total_steps * self.per_device_train_batch_size)]

    return ScalingWorkload


def run_main(argv: list[str]) -> None:
    import run_ours
    from real_model import CPUPhaseTimer
    from workload import runner_parser

    run_ours.PhaseTimer = CPUPhaseTimer  # phases in CPU seconds, as the step's CPU time

    parser = runner_parser("One configuration of the scaling sweep: run_ours.py with prompts per step.")
    parser.add_argument("--per-device-train-batch-size", type=int, default=1)
    args = parser.parse_args(argv)
    cls = scaling_workload_class()
    workload = cls(**{name: getattr(args, name) for name in cls.__dataclass_fields__})
    run_ours.run(workload).emit(args.output)


# ----- the machine's rates and the step's floor -------------------------------------------------------------
def best_rate(work: float, operation, seconds: float, repeats: int = 1) -> float:
    """Best ``work`` per CPU second of ``repeats`` calls of ``operation`` (CPU time, as the steps are timed:
    a loaded machine stretches the wall time of a measurement, not its CPU time)."""
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.process_time()
        for _ in range(repeats):
            operation()
        best = max(best, repeats * work / max(time.process_time() - start, 1e-9))
    return best


def read_rate(nbytes: int, seconds: float = 0.5) -> float:
    """Best bytes per CPU second of summing a float32 buffer of ``nbytes`` (in cache when it fits)."""
    import torch

    buffer = torch.randn(max(nbytes // 4, 1024))
    repeats = max(1, (64 * 2**20) // buffer.numel())  # about 256 MB read per timing
    return best_rate(buffer.numel() * 4, buffer.sum, seconds, repeats)


def machine_rates(shapes: dict[str, int], seconds: float = 0.5) -> dict[str, float]:
    """fp32 1024^3 matmul FLOP/s; read bandwidth of one agent's weights (what a decode step reads), of
    one agent's AdamW working set (weights, gradients, two moments) and of 256 MB (main memory)."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    return {
        "fp32_flops": best_rate(2 * 1024**3, lambda: a @ b, 2 * seconds, 5),
        "weights_read": read_rate(4 * shapes["matmul_params"], seconds),
        "adamw_read": read_rate(16 * shapes["params"], seconds),
        "memory_read": read_rate(256 * 2**20, seconds),
    }


def floor(shapes: dict[str, int], rates: dict[str, float], agents: int, prompts: int, generations: int,
          prompt_tokens: float, new_tokens: float, decode_steps: float) -> dict[str, float]:
    """Least time of one step: each part at the fp32 1024^3 matmul rate or its read bandwidth,
    whichever is slower (``real_model.floor``, for any number of agents and prompts, with attention).

    The work: each distinct prompt prefilled once per agent; ``new_tokens`` sampled per completion
    (every dense layer and the output head per token); ``decode_steps`` sequential decode steps per
    agent, each reading every matmul weight once (float32); the update's forward over each prompt
    once plus every completion's tokens, the output head only where a log-prob is used, backward at
    twice the forward; AdamW reading and writing 7 float32 tensors per parameter. Attention's
    QK^T and AV (4 x layers x hidden FLOPs per token per earlier position) are counted, without
    padding; activation and KV-cache traffic are not.
    """
    body, head = 2 * shapes["body"], 2 * shapes["head"]
    attention = 4 * shapes["layers"] * shapes["hidden"]
    rows = prompts * generations
    p, n = prompt_tokens, new_tokens
    prompt_attention = attention * p * p / 2
    completion_attention = attention * (p * n + n * n / 2)  # one completion's tokens over its prompt and itself
    prefill = agents * prompts * (p * body + head + prompt_attention)
    decode_flops = agents * rows * (n * (body + head) + completion_attention)
    decode_bytes = agents * decode_steps * 4 * shapes["matmul_params"]
    forward = prompts * (p * body + prompt_attention) + rows * (n * (body + head) + completion_attention)
    update_flops = agents * 3 * forward
    adamw_bytes = agents * 7 * 4 * shapes["params"]
    rate = rates["fp32_flops"]
    parts = {
        "generation": prefill / rate + max(decode_flops / rate, decode_bytes / rates["weights_read"]),
        "update": update_flops / rate + adamw_bytes / rates["adamw_read"],
    }
    parts["step"] = parts["generation"] + parts["update"]
    parts["gflop"] = (prefill + decode_flops + update_flops) / 1e9
    parts["decode_bound"] = "bytes" if decode_bytes / rates["weights_read"] > decode_flops / rate else "flops"
    return parts


def prompt_tokens(model_dir: Path, config: dict[str, int], steps: int, warmup: int = 1) -> float:
    """Mean prompt length (tokens) of the timed steps' prompts, as the runner builds them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rows = scaling_workload_class()(model_dir=str(model_dir), steps=steps, warmup_steps=warmup,
                                    per_device_train_batch_size=config["per_device_train_batch_size"]).rows()
    timed = rows[warmup * config["per_device_train_batch_size"]:]
    return statistics.mean(len(tokenizer(row["prompt"])["input_ids"]) for row in timed)


# ----- the sweep ----------------------------------------------------------------------------------------------
def row_figures(config: dict[str, int], result: dict[str, Any], shapes: dict[str, int], rates: dict[str, float],
                prompt_length: float) -> dict[str, Any]:
    from report import summarise_run

    summary = summarise_run(result)
    agents, prompts = config["num_agents"], config["per_device_train_batch_size"]
    rows = agents * prompts * config["num_generations"]
    tokens = summary["generated_tokens"]
    bound = floor(shapes, rates, agents, prompts, config["num_generations"], prompt_length, tokens / rows,
                  summary.get("decode_steps", agents * config["max_new_tokens"]) / agents)
    return {
        **config,
        "step_wall": summary["step_time"],
        "step_cpu": summary["cpu_time"],
        "generation": summary["generation"],
        "update": summary["forward"] + summary["backward_optimizer"],
        "tokens": tokens,
        "decode_steps": summary.get("decode_steps", float("nan")),
        "cpu_ms_per_token": 1000 * summary["cpu_time"] / max(tokens, 1),
        "floor": bound["step"],
        "floor_generation": bound["generation"],
        "floor_update": bound["update"],
        "floor_gflop": bound["gflop"],
        "decode_bound": bound["decode_bound"],
        "floor_ms_per_token": 1000 * bound["step"] / max(tokens, 1),
        "cpu_over_floor": summary["cpu_time"] / bound["step"],
        "peak_rss_mb": summary["peak_rss_mb"],
        "prompt_tokens": prompt_length,
    }


TABLE_HEADER = ("| agents | generations | max new tokens | prompts/step | step wall (s) | step CPU (s) | generation (CPU s) "
                "| update (CPU s) | tokens/step | CPU ms per generated token | floor (s) | CPU / floor | peak RSS (MiB) "
                "| step CPU, each sweep (s) |\n"
                "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def table_row(row: dict[str, Any]) -> str:
    return (f"| {row['num_agents']} | {row['num_generations']} | {row['max_new_tokens']} | "
            f"{row['per_device_train_batch_size']} | {row['step_wall']:.3f} | {row['step_cpu']:.3f} | "
            f"{row['generation']:.3f} | {row['update']:.3f} | {row['tokens']:.0f} | {row['cpu_ms_per_token']:.2f} | "
            f"{row['floor']:.4f} | {row['cpu_over_floor']:.1f} | {row['peak_rss_mb']:.0f} | "
            f"{', '.join(f'{x:.3f}' for x in row.get('step_cpu_runs', [row['step_cpu']]))} |")


def growth_lines(rows: list[dict[str, Any]], grid: dict[str, tuple[int, ...]]) -> list[str]:
    """Per factor: how the CPU step and the tokens grow from its first value to its last."""
    lines = []
    for factor, values in grid.items():
        chosen = [next((r for r in rows if all(r[k] == ({**BASE, factor: v})[k] for k in BASE)), None) for v in values]
        chosen = [r for r in chosen if r is not None]
        if len(chosen) < 2:
            continue
        first, last = chosen[0], chosen[-1]
        per_token = ", ".join(f"{r['cpu_ms_per_token']:.2f}" for r in chosen)
        lines.append(f"- {LABELS[factor]} {first[factor]} -> {last[factor]} (x{last[factor] / first[factor]:g}): "
                     f"CPU step x{last['step_cpu'] / first['step_cpu']:.2f}, tokens x{last['tokens'] / first['tokens']:.2f}, "
                     f"floor x{last['floor'] / first['floor']:.2f}, peak RSS {first['peak_rss_mb']:.0f} -> "
                     f"{last['peak_rss_mb']:.0f} MiB; CPU ms per generated token {per_token}")
    return lines


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    from compare import OURS_PYTHON, build_model, run_runner
    from roofline import model_shapes

    model_dir = args.model_dir or build_model(HERE / "runs" / f"model-h{args.hidden_size}", args.hidden_size)
    shapes = model_shapes(Path(model_dir))
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    rates = [machine_rates(shapes)]
    results = []
    for config in configurations(args.grid):
        options = ["run", "--model-dir", str(model_dir), "--steps", str(args.steps), "--device", args.device,
                   "--threads", str(args.threads)]
        options += [f"--{name.replace('_', '-')}={value}" for name, value in config.items()]
        print(f"running {config}", file=sys.stderr, flush=True)
        results.append({"config": config, "result": run_runner(OURS_PYTHON, "scaling.py", options),
                        "prompt_tokens": prompt_tokens(Path(model_dir), config, args.steps)})
    rates.append(machine_rates(shapes))
    real = real_sweep(args) if args.real else None
    return {"started": started, "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "model_dir": str(model_dir), "shapes": shapes, "steps": args.steps, "grid": args.grid, "base": BASE,
            "rates": rates, "runs": results, "real": real, "load_average": list(__import__("os").getloadavg())}


# ----- the real-model check ---------------------------------------------------------------------------------
def real_sweep(args: argparse.Namespace) -> dict[str, Any]:
    """SmolLM2-135M-Instruct, real_model.py's workload (2 agents, 2 prompts, 4 generations) at each of
    ``--real-tokens``, ``--real-epochs`` timed epochs after ``--real-warmup-epochs``, each its own process.
    The machine's rates for ``real_model.floor`` in CPU time (the 256 MB read: the weights are 0.54 GB)."""
    import real_model

    from compare import run_runner

    def rates() -> dict[str, float]:
        import torch

        torch.set_num_threads(1)
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        return {"fp32_flops": best_rate(2 * 1024**3, lambda: a @ b, 1.0, 5), "read_bytes": read_rate(256 * 2**20)}

    runs = {}
    measured = [rates()]
    for tokens in args.real_tokens:
        print(f"running SmolLM2, max_new_tokens={tokens}", file=sys.stderr, flush=True)
        runs[tokens] = run_runner(real_model.OURS_PYTHON, "real_model.py",
                                  ["run", "ours", "--model-dir", str(args.real_model_dir), "--max-new-tokens", str(tokens),
                                   "--epochs", str(args.real_epochs), "--warmup-epochs", str(args.real_warmup_epochs),
                                   "--threads", "1"])
    measured.append(rates())
    return {"model_dir": str(args.real_model_dir), "rates": measured, "runs": runs, "epochs": args.real_epochs,
            "warmup_epochs": args.real_warmup_epochs}


def real_rows(real: dict[str, Any], rates: dict[str, float] | None = None) -> list[dict[str, Any]]:
    import real_model
    from report import summarise_run
    from roofline import model_shapes

    rates = rates or {key: max(m[key] for m in real["rates"]) for key in real["rates"][0]}
    model_dir = Path(real["model_dir"])
    shapes = model_shapes(model_dir)
    rows = []
    for tokens, result in sorted(real["runs"].items(), key=lambda item: int(item[0])):
        workload = real_model.RealWorkload(model_dir=str(model_dir), max_new_tokens=int(tokens))
        cpu = summarise_run(real_model.cpu_view(result))
        wall = statistics.median(step["step_time"] for step in result["steps"])
        completions = 2 * workload.num_prompts * workload.num_generations
        bound = real_model.floor(shapes, real_model.prompt_tokens(model_dir, workload),
                                 cpu["generated_tokens"] / completions, workload, rates)
        rows.append({"max_new_tokens": int(tokens), "step_wall": wall, "step_cpu": cpu["step_time"],
                     "generation": cpu["generation"], "update": cpu["forward"] + cpu["backward_optimizer"],
                     "tokens": cpu["generated_tokens"], "decode_steps": cpu.get("decode_steps", float("nan")),
                     "cpu_ms_per_token": 1000 * cpu["step_time"] / cpu["generated_tokens"],
                     "floor": bound["step"], "cpu_over_floor": cpu["step_time"] / bound["step"],
                     "peak_rss_mb": cpu["peak_rss_mb"]})
    return rows


# ----- report and figure --------------------------------------------------------------------------------------
def merge(per_run: list[list[dict[str, Any]]], key: tuple[str, ...], statistic: str = "min") -> list[dict[str, Any]]:
    """One row per configuration (by ``key``) over several sweeps, in the order the configurations first
    appear, with each sweep's CPU step and CPU ms per generated token (``*_runs``).

    ``statistic="min"``: the sweep with the least CPU step, all its figures (other processes only add CPU
    time to a step, through the caches and memory bandwidth they share, so the least is the least
    disturbed); ``"median"``: the median over sweeps of each figure."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for rows in per_run:
        for row in rows:
            groups.setdefault(tuple(row[k] for k in key), []).append(row)
    merged = []
    for group in groups.values():
        if statistic == "min":
            row = dict(min(group, key=lambda r: r["step_cpu"]))
        else:
            row = {name: (statistics.median(r[name] for r in group)
                          if isinstance(value, (int, float)) and name not in key else value)
                   for name, value in group[0].items()}
        row["step_cpu_runs"] = [r["step_cpu"] for r in group]
        row["cpu_ms_per_token_runs"] = [r["cpu_ms_per_token"] for r in group]
        row["cpu_over_floor"] = row["step_cpu"] / row["floor"]
        row["cpu_ms_per_token"] = 1000 * row["step_cpu"] / row["tokens"]
        merged.append(row)
    return merged


def report(runs: list[dict[str, Any]], statistic: str = "min") -> list[dict[str, Any]]:
    """Tables of one or more sweeps (per configuration, ``statistic`` over sweeps: see :func:`merge`)."""
    shapes = runs[0]["shapes"]
    # One set of rates for every floor: the best each was measured at, over the sweeps (before and after each).
    measured = [m for data in runs for m in data["rates"]]
    rates = {key: max(m[key] for m in measured) for key in measured[0]}
    per_run = []
    for data in runs:
        per_run.append([row_figures(run["config"], run["result"], shapes, rates, run["prompt_tokens"])
                        for run in data["runs"]])
    rows = merge(per_run, tuple(BASE), statistic)
    grid = {name: tuple(values) for name, values in runs[0]["grid"].items()}
    print(f"### Scaling (cpu, 1 thread, tiny model {shapes['all_params'] / 1e6:.2f} M parameters; each run: median "
          f"of {runs[0]['steps']} steps after 1 warm-up; {len(runs)} sweep(s), per configuration the {statistic} "
          f"over sweeps)\n")
    for number, data in enumerate(runs, 1):
        print(f"sweep {number}: {data['started']} to {data['finished'][11:]}, load average at its end "
              f"{', '.join(f'{x:.1f}' for x in data['load_average'])}")
        for when, m in zip(("before", "after"), data["rates"]):
            print(f"  machine ({when}, per CPU second): fp32 matmul 1024^3 {m['fp32_flops'] / 1e9:.1f} GFLOP/s; read "
                  f"{m['weights_read'] / 1e9:.1f} GB/s (one agent's weights, {4 * shapes['matmul_params'] / 2**20:.1f} MiB), "
                  f"{m['adamw_read'] / 1e9:.1f} GB/s (its AdamW set, {16 * shapes['params'] / 2**20:.1f} MiB), "
                  f"{m['memory_read'] / 1e9:.1f} GB/s (256 MiB)")
    print(f"floors at fp32 {rates['fp32_flops'] / 1e9:.1f} GFLOP/s, reads {rates['weights_read'] / 1e9:.1f} GB/s "
          f"(weights) and {rates['adamw_read'] / 1e9:.1f} GB/s (AdamW): the best of these measurements\n")
    print(TABLE_HEADER)
    for row in rows:
        print(table_row(row))
    print()
    print("\n".join(growth_lines(rows, grid)))
    # The SmolLM2 check: the sweeps that ran it after a warm-up epoch (earlier ones timed a cold first epoch).
    real = [data["real"] for data in runs if data.get("real") and data["real"].get("warmup_epochs", 0) >= 1]
    if real:
        measured = [m for r in real for m in r["rates"]]
        real_rates = {key: max(m[key] for m in measured) for key in measured[0]}
        real_merged = merge([real_rows(r, real_rates) for r in real], ("max_new_tokens",), statistic)
        print(f"\n### SmolLM2-135M-Instruct, 2 agents, 2 prompts, 4 generations (one epoch = one step; CPU seconds; "
              f"{real[0].get('epochs', 1)} timed epoch after {real[0].get('warmup_epochs', 0)} warm-up; "
              f"{statistic} over {len(real)} sweep(s))\n")
        print("| max new tokens | step wall (s) | step CPU (s) | generation (CPU s) | update (CPU s) | tokens/step "
              "| decode steps | CPU ms per generated token | floor (s) | CPU / floor | peak RSS (MiB) | step CPU, each sweep (s) |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for row in real_merged:
            print(f"| {row['max_new_tokens']} | {row['step_wall']:.2f} | {row['step_cpu']:.2f} | {row['generation']:.2f} "
                  f"| {row['update']:.2f} | {row['tokens']:.0f} | {row['decode_steps']:.0f} | "
                  f"{row['cpu_ms_per_token']:.1f} | {row['floor']:.2f} | {row['cpu_over_floor']:.2f} | "
                  f"{row['peak_rss_mb']:.0f} | {', '.join(f'{x:.2f}' for x in row['step_cpu_runs'])} |")
        print(f"floor at fp32 {real_rates['fp32_flops'] / 1e9:.1f} GFLOP/s and memory read "
              f"{real_rates['read_bytes'] / 1e9:.1f} GB/s (the best of these measurements):")
        for r in real:
            print("machine (before, after the SmolLM2 runs, per CPU second): " + "; ".join(
                f"fp32 {m['fp32_flops'] / 1e9:.1f} GFLOP/s, memory read {m['read_bytes'] / 1e9:.1f} GB/s"
                for m in r["rates"]))
    return rows


def plot(rows: list[dict[str, Any]], grid: dict[str, tuple[int, ...]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    factors = [f for f in grid if len(grid[f]) > 1]
    figure, axes = plt.subplots(2, len(factors), figsize=(4.2 * len(factors), 7.2), squeeze=False)
    for column, factor in enumerate(factors):
        chosen = [next((r for r in rows if all(r[k] == ({**BASE, factor: v})[k] for k in BASE)), None)
                  for v in grid[factor]]
        chosen = [r for r in chosen if r is not None]
        x = [r[factor] for r in chosen]
        top, bottom = axes[0][column], axes[1][column]
        top.plot(x, [r["step_wall"] for r in chosen], "o-", color="tab:blue", label="measured, wall")
        cpu = [r["step_cpu"] for r in chosen]
        spread = [[c - min(r["step_cpu_runs"]) for c, r in zip(cpu, chosen)],
                  [max(r["step_cpu_runs"]) - c for c, r in zip(cpu, chosen)]]
        top.errorbar(x, cpu, yerr=spread, fmt="s-", color="tab:green", capsize=3, label="measured, CPU (bars: range over sweeps)")
        top.plot(x, [r["floor"] for r in chosen], "v--", color="tab:red", label="floor")
        # Growth linear in the work: the base's CPU time scaled by the tokens generated.
        base = next(r for r in chosen if r[factor] == BASE[factor]) if BASE[factor] in x else chosen[0]
        top.plot(x, [base["step_cpu"] * r["tokens"] / base["tokens"] for r in chosen], ":", color="gray",
                 label="CPU if linear in tokens (from the base)")
        top.set_xscale("log", base=2)
        top.set_xticks(x, [str(v) for v in x])
        top.set_title(f"{LABELS[factor]} (base {BASE[factor]})")
        top.set_ylabel("step (s)")
        top.set_ylim(bottom=0)
        rss = top.twinx()
        rss.plot(x, [r["peak_rss_mb"] for r in chosen], "d-.", color="tab:purple", alpha=0.7, label="peak RSS")
        rss.set_ylabel("peak RSS (MiB)", color="tab:purple")
        rss.set_ylim(0, max(r["peak_rss_mb"] for r in rows) * 1.1)
        if column == 0:
            handles = top.get_legend_handles_labels()[0] + rss.get_legend_handles_labels()[0]
            labels = top.get_legend_handles_labels()[1] + rss.get_legend_handles_labels()[1]
        per_token = [r["cpu_ms_per_token"] for r in chosen]
        spread = [[c - min(r["cpu_ms_per_token_runs"]) for c, r in zip(per_token, chosen)],
                  [max(r["cpu_ms_per_token_runs"]) - c for c, r in zip(per_token, chosen)]]
        bottom.errorbar(x, per_token, yerr=spread, fmt="s-", color="tab:green", capsize=3, label="measured, CPU")
        bottom.plot(x, [1000 * r["step_wall"] / r["tokens"] for r in chosen], "o-", color="tab:blue", alpha=0.6,
                    label="measured, wall")
        bottom.plot(x, [r["floor_ms_per_token"] for r in chosen], "v--", color="tab:red", label="floor")
        for r in chosen:
            bottom.annotate(f"{r['cpu_over_floor']:.0f}x", (r[factor], r["cpu_ms_per_token"]), fontsize=7,
                            textcoords="offset points", xytext=(0, 5), ha="center")
        bottom.set_xscale("log", base=2)
        bottom.set_xticks(x, [str(v) for v in x])
        bottom.set_xlabel(LABELS[factor])
        bottom.set_ylabel("step ms per generated token (labels: CPU / floor)", fontsize=8)
        bottom.set_ylim(bottom=0)
    figure.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout(rect=(0, 0.04, 1, 1))
    figure.savefig(path, dpi=110)
    print(f"\nfigure: {path}")


def main() -> None:
    if sys.argv[1:2] == ["run"]:
        run_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model-dir", type=Path, help="use this model instead of building one")
    parser.add_argument("--grid", type=parse_grid, default=GRID,
                        help="factors to vary, e.g. 'num_agents=2,3;max_new_tokens=32' (default: the full grid)")
    parser.add_argument("--output", type=Path, help="raw results (default: benchmarks/runs/scaling-latest.json, overwritten)")
    parser.add_argument("--from", dest="sources", type=Path, nargs="+",
                        help="report (and plot) saved sweeps instead of running (several: the median over them)")
    parser.add_argument("--statistic", choices=("min", "median"), default="min",
                        help="per configuration over several --from sweeps: the least disturbed (min) or the median")
    parser.add_argument("--plot", nargs="?", const=HERE / "scaling.png", type=Path,
                        help="draw the figure (default path: benchmarks/scaling.png)")
    parser.add_argument("--real", action="store_true", help="also run SmolLM2-135M at --real-tokens (minutes)")
    parser.add_argument("--real-tokens", type=lambda text: [int(v) for v in text.split(",")], default=[16, 32, 64])
    parser.add_argument("--real-epochs", type=int, default=1, help="timed epochs per SmolLM2 run")
    parser.add_argument("--real-warmup-epochs", type=int, default=1)
    parser.add_argument("--real-model-dir", type=Path, default=REAL_MODEL)
    args = parser.parse_args()
    if args.sources:
        runs = [json.loads(source.read_text()) for source in args.sources]
    else:
        data = sweep(args)
        output = args.output or HERE / "runs" / "scaling-latest.json"
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(data))
        print(f"raw: {output}\n")
        runs = [data]
    rows = report(runs, args.statistic)
    if args.plot:
        data, shapes = runs[0], runs[0]["shapes"]
        when = data["started"][:16] + (f" to {runs[-1]['finished'][11:16]} UTC, {args.statistic} of {len(runs)} sweeps"
                                       if len(runs) > 1 else " UTC")
        plot(rows, {name: tuple(values) for name, values in data["grid"].items()}, args.plot,
             f"This library's MAGRPO step on the tiny model ({shapes['all_params'] / 1e6:.1f} M parameters), cpu, "
             f"1 thread; one factor at a time\naround 2 agents, 4 generations, 32 new tokens, 2 prompts/step "
             f"({when}); CPU: process_time, wall: perf_counter; error bars: range over sweeps")


if __name__ == "__main__":
    main()
