"""The real-model benchmark: one MAGRPO epoch of two SmolLM2-135M-Instruct agents, ours vs the reference.

Workload (issue 18): 2 agents, each a copy of SmolLM2-135M-Instruct (float32, from
``data/real_model/make_smollm2.py``), 2 prompts of the writing task (the first two rows of
``data/writing/train.jsonl`` with the task's two instructions as plain text, see
:func:`plain_formatters`; reward ``comlrl.tasks.writing``),
``num_generations=4``, ``max_new_tokens=32``, temperature 1.0, AdamW at lr 1e-5, one MAGRPO epoch
= 2 prompts. This library takes the 2 prompts as one batch (``per_device_train_batch_size=2``);
the reference trains one prompt per step (``rollout_buffer_size=1``), so its epoch is 2 steps.
A "step" below is one epoch on both sides. Each run is its own process (both libraries import as
``comlrl``): ours in ``.venv``, the reference in ``benchmarks/.venv-peers``
(``bash benchmarks/setup_peers.sh``). The task module is loaded from its file in both, so both
sides score with the same code.

    .venv/bin/python benchmarks/real_model.py                  # ours, reference, ours+LoRA; tables
    .venv/bin/python benchmarks/real_model.py --runs ours ours-bf16-mixed reference ours-lora ours-lora-kl
    .venv/bin/python benchmarks/real_model.py --runs ours      # one side only
    .venv/bin/python benchmarks/real_model.py run ours --output r.json   # one runner, in this process

Runs named ``*-bf16-mixed`` train ours with ``precision="bf16-mixed"`` (float32 weights and AdamW,
bf16 sampling copies, bf16 autocast of the log-prob forwards). The same invocation measures this
machine's fp32 and bf16 matmul rates and its memory bandwidth and prints two floors of the step
(see :func:`floor`): at the fp32 rate with float32 weight reads, and at the bf16 rate with bf16
weight reads for decoding. Phases are timed by wrapping each library's own functions,
as ``run_ours.py`` / ``run_reference.py`` do; ``--threads`` defaults to 1 (shared machine), and the
step's CPU time is reported beside its wall time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

from run_ours import counted_rollout
from run_reference import instrument as instrument_reference
from roofline import model_shapes
from workload import PROCESS_START, PhaseTimer, RunResult, StepRecord, versions

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OURS_PYTHON = ROOT / ".venv" / "bin" / "python"
PEERS_PYTHON = HERE / ".venv-peers" / "bin" / "python"
MODEL_DIR = ROOT / ".comlrl" / "models" / "smollm2-135m-instruct"


def load_file(name: str, path: Path) -> ModuleType:
    """A module from its file, without importing its package (the reference's process has another ``comlrl``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def writing_task() -> ModuleType:
    return load_file("writing_task", ROOT / "comlrl" / "tasks" / "writing.py")


def plain_formatters(task: ModuleType) -> list[Callable[[dict[str, Any]], str]]:
    """The task's two instructions over the passage, as plain text. Not the task's chat prompts: the
    reference takes a prompt's first pad token for its end, and SmolLM2's pad token is the chat
    template's ``<|im_end|>``, so the reference would train on the template's tail and score empty texts."""
    return [lambda row, instruction=instruction: f"{instruction}\n\n{row['passage']}\n"
            for instruction in (task.SUMMARY_INSTRUCTION, task.EXPANSION_INSTRUCTION)]


@dataclass
class RealWorkload:
    model_dir: str = str(MODEL_DIR)
    num_prompts: int = 2
    num_generations: int = 4
    max_new_tokens: int = 32
    epochs: int = 2  # timed epochs
    warmup_epochs: int = 1
    learning_rate: float = 1e-5
    seed: int = 0
    threads: int = 1
    lora_rank: int | None = None
    reference_kl: bool = False
    precision: str = "fp32"  # ours only: "bf16-mixed" (bf16 sampling copies, bf16 autocast of the log-prob forwards)

    def rows(self) -> list[dict[str, str]]:
        lines = (ROOT / "data" / "writing" / "train.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines[:self.num_prompts]]

    def setup_torch(self) -> None:
        import torch

        if self.threads:
            torch.set_num_threads(self.threads)
        torch.manual_seed(self.seed)


class CPUPhaseTimer(PhaseTimer):
    """Phases in CPU seconds of this process: with one torch thread, the work a phase did, whatever else
    the shared machine runs (its wall time stretches with the load)."""

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.process_time()
        self._open.append(name)
        try:
            yield
        finally:
            self._open.pop()
            self.totals[name] = self.totals.get(name, 0.0) + time.process_time() - start


def cpu_view(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` with each step's CPU time as its step time, so a step's phases (CPU) and its
    "other" share one clock; the wall time is kept as ``wall_time``."""
    steps = [{**step, "step_time": step["cpu_time"], "wall_time": step["step_time"]} for step in result["steps"]]
    return {**result, "steps": steps}


class EpochClock:
    """Records whole epochs: ``steps_per_epoch`` calls of a library's step function are one record."""

    def __init__(self, result: RunResult, timer: PhaseTimer, steps_per_epoch: int, samples: int) -> None:
        self.result, self.timer = result, timer
        self.steps_per_epoch, self.samples = steps_per_epoch, samples
        self.calls = self.tokens = self.decode_steps = 0
        self._start = self._cpu = 0.0

    def count(self, tokens: int, decode_steps: int) -> None:
        self.tokens += tokens
        self.decode_steps += decode_steps

    def timed(self, step: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.calls % self.steps_per_epoch == 0:
                self.timer.take()
                self.tokens = self.decode_steps = 0
                self._start, self._cpu = time.perf_counter(), time.process_time()
                if not self.result.startup_time:
                    self.result.startup_time = self._start - PROCESS_START
            value = step(*args, **kwargs)
            self.calls += 1
            if self.calls % self.steps_per_epoch == 0:
                self.result.steps.append(StepRecord(time.perf_counter() - self._start, self.timer.take(), self.samples,
                                                    self.tokens, time.process_time() - self._cpu, self.decode_steps))
            return value

        return call


def run_ours(workload: RealWorkload) -> RunResult:
    from datasets import Dataset

    import comlrl.training.policy_update as policy_update
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    task = writing_task()
    timer = CPUPhaseTimer("cpu")
    result = RunResult("ours", asdict(workload), versions("torch", "transformers", "comlrl"))
    original = getattr(policy_update.completion_logprobs, "__wrapped__", policy_update.completion_logprobs)
    policy_update.completion_logprobs = timer.wrap("forward", original)
    config = MAGRPOConfig(
        num_agents=2, num_generations=workload.num_generations, max_new_tokens=workload.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=None, agent_learning_rate=workload.learning_rate,
        num_train_epochs=workload.warmup_epochs + workload.epochs, per_device_train_batch_size=workload.num_prompts,
        shuffle=False, seed=workload.seed, device="cpu", disable_tqdm=True, logging_steps=10**6,
        lora_rank=workload.lora_rank, reference_kl_enabled=workload.reference_kl, precision=workload.precision,
    )
    trainer = MAGRPOTrainer(agent_model=workload.model_dir, num_agents=2, reward_func=task.writing_reward,
                            formatters=plain_formatters(task), train_dataset=Dataset.from_list(workload.rows()),
                            args=config)
    clock = EpochClock(result, timer, steps_per_epoch=1, samples=2 * workload.num_generations * workload.num_prompts)
    trainer.rollout = timer.wrap("generation", counted_rollout(trainer.rollout, clock))
    trainer.score = timer.wrap("reward", trainer.score)
    trainer.update = timer.wrap("update", trainer.update)
    trainer.train_step = clock.timed(trainer.train_step)
    trainer.train()
    return result


def run_reference(workload: RealWorkload) -> RunResult:
    import torch
    from datasets import Dataset

    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    if workload.lora_rank or workload.reference_kl or workload.precision != "fp32":
        raise SystemExit("the reference runner measures float32 full fine-tuning without a reference KL only")
    task = writing_task()
    timer = CPUPhaseTimer("cpu")
    result = RunResult("reference", asdict(workload), versions("torch", "transformers", "comlrl"))
    config = MAGRPOConfig(
        num_train_epochs=workload.warmup_epochs + workload.epochs, agent_learning_rate=workload.learning_rate,
        logging_steps=10**6, num_agents=2, agent_devices="cpu", num_generations=workload.num_generations,
        max_new_tokens=workload.max_new_tokens, temperature=1.0, top_p=1.0, top_k=None, num_turns=1,
        early_termination_threshold=None, eval_interval=0, rollout_buffer_size=1, train_batch_size=1,
    )
    trainer = MAGRPOTrainer(agent_model=workload.model_dir, num_agents=2, model_config={"dtype": torch.float32},
                            formatters=plain_formatters(task), train_dataset=Dataset.from_list(workload.rows()),
                            reward_func=task.writing_reward, wandb_config=None, args=config)
    trainer.verbose = False
    clock = EpochClock(result, timer, steps_per_epoch=workload.num_prompts,
                       samples=2 * workload.num_generations * workload.num_prompts)
    instrument_reference(trainer, timer, clock)
    trainer.train()
    return result


def run_one(implementation: str, workload: RealWorkload, output: Path | None) -> None:
    workload.setup_torch()
    result = (run_ours if implementation == "ours" else run_reference)(workload)
    warmup = workload.warmup_epochs
    result.steps = result.steps[warmup:]
    import resource

    result.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result.emit(str(output) if output else None)


# ----- the machine's limits and the step's floor --------------------------------------------------------
def machine_rates(threads: int, seconds: float = 1.0) -> dict[str, float]:
    """Best fp32 and bf16 rates of a 1024^3 matmul and the memory read bandwidth (a 256 MB sum)."""
    import torch

    torch.set_num_threads(threads)
    rates: dict[str, float] = {}
    for name, dtype in (("fp32_flops", torch.float32), ("bf16_flops", torch.bfloat16)):
        a, b = torch.randn(1024, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
        best, deadline = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            a @ b
            best = max(best, 2 * 1024**3 / (time.perf_counter() - start))
        rates[name] = best
    big = torch.randn(64 * 2**20)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        big.sum()
        best = max(best, big.numel() * 4 / (time.perf_counter() - start))
    rates["read_bytes"] = best
    return rates


def floor(shapes: dict[str, int], prompt_tokens: float, new_tokens: float, workload: RealWorkload,
          rates: dict[str, float], precision: str = "fp32") -> dict[str, float]:
    """Lower bound of one epoch's time: each part at the machine's 1024^3 matmul rate or its read
    bandwidth, whichever is slower.

    The work is the least the step needs: each distinct prompt prefilled once per agent, one
    decode step per new token (reading every weight once per agent), the update's forward over each
    prompt once plus every completion, its backward at twice the forward, and AdamW reading and
    writing 7 float32 tensors per parameter. The output head runs only where a logit is needed.
    Attention's own FLOPs (small at these lengths) and activation traffic are left out.

    ``precision="fp32"``: every matmul at the fp32 rate, decoding reads 4-byte weights (the issue's
    floor). ``"bf16"``: the floor of ``precision="bf16-mixed"``: matmuls at the bf16 rate, decoding
    reads 2-byte weights, plus the cast of each agent's weights to its bf16 sampling copy (4 bytes
    read, 2 written per parameter); AdamW stays float32.
    """
    agents, rows = 2, workload.num_prompts * workload.num_generations
    body, head = 2 * shapes["body"], 2 * shapes["head"]
    prefill = agents * workload.num_prompts * (prompt_tokens * body + head)
    decode_flops = agents * rows * new_tokens * (body + head)
    weight_bytes = 2 if precision == "bf16" else 4
    decode_bytes = agents * workload.max_new_tokens * weight_bytes * (shapes["body"] + shapes["head"])
    cast_bytes = agents * 6 * shapes["params"] if precision == "bf16" else 0
    update_tokens = workload.num_prompts * prompt_tokens + rows * new_tokens
    update = agents * 3 * (update_tokens * body + rows * new_tokens * head)
    adamw_bytes = agents * 7 * 4 * shapes["params"]
    flops, read = rates["bf16_flops" if precision == "bf16" else "fp32_flops"], rates["read_bytes"]
    parts = {
        "generation": cast_bytes / read + prefill / flops + max(decode_flops / flops, decode_bytes / read),
        "update": update / flops + adamw_bytes / read,
    }
    parts["step"] = parts["generation"] + parts["update"]
    parts["tflop"] = (prefill + decode_flops + update) / 1e12
    return parts


# ----- comparison --------------------------------------------------------------------------------------
RUNS = {
    "ours": ("ours", OURS_PYTHON, []),
    "reference": ("reference", PEERS_PYTHON, []),
    "ours-lora": ("ours", OURS_PYTHON, ["--lora-rank", "8"]),
    "ours-lora-kl": ("ours", OURS_PYTHON, ["--lora-rank", "8", "--reference-kl"]),
    "ours-bf16-mixed": ("ours", OURS_PYTHON, ["--precision", "bf16-mixed"]),
    "ours-lora-bf16-mixed": ("ours", OURS_PYTHON, ["--lora-rank", "8", "--precision", "bf16-mixed"]),
}
# Full fine-tuning runs, compared with the floor (LoRA's backward does less than the floor's).
FULL_FINE_TUNING = ("ours", "ours-bf16-mixed", "reference")


def launch(name: str, args: argparse.Namespace) -> dict[str, Any]:
    implementation, python, extra = RUNS[name]
    with tempfile.NamedTemporaryFile(suffix=".json") as output:
        command = [str(python), str(HERE / "real_model.py"), "run", implementation, *extra, *workload_options(args),
                   "--output", output.name]
        completed = subprocess.run(command, cwd=HERE, capture_output=True, text=True)
        if completed.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({completed.returncode}):\n{completed.stderr[-3000:]}")
        return json.loads(Path(output.name).read_text())


def workload_options(args: argparse.Namespace) -> list[str]:
    return ["--epochs", str(args.epochs), "--warmup-epochs", str(args.warmup_epochs), "--threads", str(args.threads),
            "--max-new-tokens", str(args.max_new_tokens), "--model-dir", str(args.model_dir)]


def prompt_tokens(model_dir: Path, workload: RealWorkload) -> float:
    from transformers import AutoTokenizer

    task = writing_task()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    lengths = [len(tokenizer(formatter(row), add_special_tokens=False)["input_ids"])
               for row in workload.rows() for formatter in plain_formatters(task)]
    return max(lengths)  # prompts are left-padded to the longest of a batch


def compare(args: argparse.Namespace) -> None:
    from report import comparison_table, single_table, summarise_run

    make = load_file("make_smollm2", ROOT / "data" / "real_model" / "make_smollm2.py")
    model_dir = make.make_model(args.model_dir)
    measured = [machine_rates(args.threads)]  # before and after the runs: the load on a shared machine varies
    results = {name: launch(name, args) for name in args.runs}
    measured.append(machine_rates(args.threads))
    rates = {key: max(m[key] for m in measured) for key in measured[0]}
    workload = RealWorkload(model_dir=str(model_dir), max_new_tokens=args.max_new_tokens, threads=args.threads)
    summaries = {name: summarise_run(cpu_view(result)) for name, result in results.items()}
    for name, result in results.items():
        summaries[name]["wall_time"] = statistics.median(step["step_time"] for step in result["steps"])
    for when, m in zip(("before", "after"), measured):
        print(f"machine ({when} the runs): {args.threads} thread(s); matmul 1024^3 fp32 {m['fp32_flops'] / 1e9:.1f} "
              f"GFLOP/s, bf16 {m['bf16_flops'] / 1e9:.1f} GFLOP/s; memory read {m['read_bytes'] / 1e9:.1f} GB/s")
    print()
    if "ours" in summaries and "reference" in summaries:
        print(comparison_table("MAGRPO epoch, 2 SmolLM2-135M agents: ours vs reference comlrl (cpu; times in CPU "
                               "seconds)", summaries["ours"], summaries["reference"], "reference 1.4.3"))
        ours, theirs = summaries["ours"]["wall_time"], summaries["reference"]["wall_time"]
        print(f"| wall time of the step (s) | {ours:.3f} | {theirs:.3f} | {ours / theirs:.2f} |\n")
    if "ours-bf16-mixed" in summaries and "reference" in summaries:
        print(comparison_table("The same, ours with precision='bf16-mixed' (cpu; times in CPU seconds)",
                               summaries["ours-bf16-mixed"], summaries["reference"], "reference 1.4.3"))
        ours, theirs = summaries["ours-bf16-mixed"]["wall_time"], summaries["reference"]["wall_time"]
        print(f"| wall time of the step (s) | {ours:.3f} | {theirs:.3f} | {ours / theirs:.2f} |\n")
    keys = ["step_time", "generation", "forward", "backward_optimizer", "other", "peak_rss_mb"]
    print(single_table("Every run (CPU seconds)", list(summaries.items()), keys) + "\n")
    bounds = {}
    measured_runs = [name for name in FULL_FINE_TUNING if name in summaries and name != "reference"]
    if measured_runs:
        shapes = model_shapes(Path(model_dir))
        # The floor of the new tokens ours generated (the first of ours' full fine-tuning runs).
        per_row = summaries[measured_runs[0]]["generated_tokens"] / (2 * workload.num_prompts * workload.num_generations)
        tokens = prompt_tokens(Path(model_dir), workload)
        for precision in ("fp32", "bf16"):
            bound = bounds[precision] = floor(shapes, tokens, per_row, workload, rates, precision)
            print(f"{precision} floor of the step ({bound['tflop']:.3f} TFLOP, {per_row:.1f} new tokens per "
                  f"completion): generation {bound['generation']:.2f} s, update {bound['update']:.2f} s, "
                  f"step {bound['step']:.2f} s")
        for name in FULL_FINE_TUNING:
            if name in summaries:
                step = summaries[name]["step_time"]
                print(f"  {name}: step CPU time {step:.2f} s = {step / bounds['fp32']['step']:.2f} x the fp32 floor, "
                      f"{step / bounds['bf16']['step']:.2f} x the bf16 floor")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"results": results, "rates": measured, "floor": bounds}, indent=1))
    print(f"\nraw: {args.output}")


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=int, default=RealWorkload.epochs, help="timed epochs per run")
    parser.add_argument("--warmup-epochs", type=int, default=RealWorkload.warmup_epochs)
    parser.add_argument("--threads", type=int, default=RealWorkload.threads)
    parser.add_argument("--max-new-tokens", type=int, default=RealWorkload.max_new_tokens)
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command")
    one = commands.add_parser("run", help="one runner in this process (its library must be importable here)")
    one.add_argument("implementation", choices=("ours", "reference"))
    one.add_argument("--lora-rank", type=int)
    one.add_argument("--reference-kl", action="store_true")
    one.add_argument("--precision", default="fp32", choices=("fp32", "bf16-mixed"), help="ours' MAGRPOConfig.precision")
    one.add_argument("--output", type=Path)
    add_workload_arguments(one)
    add_workload_arguments(parser)
    parser.add_argument("--runs", nargs="+", choices=sorted(RUNS), default=["ours", "reference", "ours-lora"])
    parser.add_argument("--output", type=Path, default=HERE / "runs" / "real_model.json")
    args = parser.parse_args()
    if args.command == "run":
        workload = RealWorkload(model_dir=str(args.model_dir), epochs=args.epochs, warmup_epochs=args.warmup_epochs,
                                threads=args.threads, max_new_tokens=args.max_new_tokens, lora_rank=args.lora_rank,
                                reference_kl=args.reference_kl, precision=args.precision)
        run_one(args.implementation, workload, args.output)
    else:
        compare(args)


if __name__ == "__main__":
    main()
