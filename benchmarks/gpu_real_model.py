"""One MAGRPO epoch of two SmolLM2-135M-Instruct-shaped agents on a CUDA GPU in bf16: ours vs comlrl 1.4.3.

The workload of ``real_model.py`` (2 agents, the writing task's first 2 passages under its two
instructions as plain text, ``num_generations=4``, ``max_new_tokens=32``, temperature 1.0, no
top-k/top-p, AdamW at lr 1e-5, reward ``comlrl.tasks.writing`` loaded from its file on both sides),
1 warm-up epoch then ``--epochs`` timed epochs (median). Each library runs at its own defaults
apart from what the workload names: ours' ``per_device_train_batch_size`` and ``max_grad_norm``,
the original's ``rollout_buffer_size`` / ``train_batch_size`` are not set (the values used are
printed). Single turn, no early termination, no periodic evaluation, on both sides.

- **ours**: ``MAGRPOConfig(device="cuda", precision="bf16")`` (weights, gradients and AdamW state in
  bf16), and ``precision="bf16-mixed"`` (fp32 weights and AdamW, bf16 sampling copies and autocast).
- **original 1.4.3**: as its users place a model: ``model_config={"dtype": torch.bfloat16}`` (passed
  to ``from_pretrained``) and ``agent_devices="cuda"``.

The model is built here from the config alone (``--config-dir``: SmolLM2-135M-Instruct's
``config.json`` and tokenizer files, no weights), ``torch.manual_seed(0)`` +
``AutoModelForCausalLM.from_config``, saved with ``save_pretrained`` to ``--model-dir`` and loaded by
both libraries from there, as from a hub id. Random weights: completions run to
``max_new_tokens`` (EOS is about 1 in 49,152 draws), so both sides generate the same number of tokens.

Each run is its own process (both libraries import as ``comlrl``), started with its own
interpreter and ``PYTHONPATH``. An epoch is timed from its first step to its end (ours: first
``take_step`` to ``end_epoch``; the original: its epoch's ``get_train_dataloader`` to the next one, or
the end of ``train``), with ``torch.cuda.synchronize()`` at both ends and nowhere else. The
generation and update phases are timed with CUDA events (no synchronisation inside the epoch).
Peak GPU memory: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``; ours resets the
peak after every step (its ``memory/*`` metrics), so every reset is wrapped to fold the peak first.

    # on the GPU machine (see benchmarks/README.md "On CUDA")
    python3 benchmarks/gpu_real_model.py --ours-pythonpath "$PWD:/tmp/site_common" \\
        --reference-pythonpath /tmp/site_ref:/tmp/site_common
    # a CPU check of the same code path (local venvs, a few tokens)
    .venv/bin/python benchmarks/gpu_real_model.py --device cpu --max-new-tokens 4 --epochs 1 \\
        --ours-python .venv/bin/python --reference-python benchmarks/.venv-peers/bin/python \\
        --output /tmp/gpu_real_model_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any, Callable

from workload import versions

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CONFIG_DIR = ROOT / ".gpu_bench" / "smollm2"
FALLBACK_CONFIG_DIR = ROOT / ".comlrl" / "models" / "smollm2-135m-instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")

RUNS = {  # name: (implementation, precision / dtype)
    "ours-bf16": ("ours", "bf16"),
    "ours-bf16-mixed": ("ours", "bf16-mixed"),
    "reference-bf16": ("reference", "bf16"),
}


# ----- the model --------------------------------------------------------------------------------------
def make_model(config_dir: Path, model_dir: Path) -> dict[str, Any]:
    """SmolLM2-135M-Instruct's architecture with seeded random weights, saved for ``from_pretrained``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(config_dir))
    config.dtype = "float32"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(model_dir))
    for name in TOKENIZER_FILES:
        if (config_dir / name).exists():
            shutil.copy(config_dir / name, model_dir / name)
    return {"parameters": sum(p.numel() for p in model.parameters()), "layers": config.num_hidden_layers,
            "hidden": config.hidden_size, "vocab": config.vocab_size, "tied": bool(config.tie_word_embeddings)}


# ----- one run, in its own process ------------------------------------------------------------------
class Peaks:
    """Peak allocated / reserved device memory, kept across the library's own resets of the peak."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.allocated = self.reserved = 0
        if cuda:
            import torch

            original = torch.cuda.reset_peak_memory_stats

            def reset(device: Any = None) -> None:
                self.fold()
                original(device)

            self._reset = original
            torch.cuda.reset_peak_memory_stats = reset

    def fold(self) -> None:
        if self.cuda:
            import torch

            self.allocated = max(self.allocated, torch.cuda.max_memory_allocated())
            self.reserved = max(self.reserved, torch.cuda.max_memory_reserved())

    def take(self) -> tuple[int, int]:
        """The peaks since the last ``take`` (and resets the device's peak)."""
        self.fold()
        peaks = (self.allocated, self.reserved)
        self.allocated = self.reserved = 0
        if self.cuda:
            self._reset()
        return peaks


class Phases:
    """Generation and update time inside an epoch: CUDA events on the GPU, ``perf_counter`` on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.open: list[str] = []
        self.spans: list[tuple[str, Any, Any]] = []

    def now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def wrap(self, name: str, func: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if name in self.open:
                return func(*args, **kwargs)
            self.open.append(name)
            start = self.now()
            try:
                return func(*args, **kwargs)
            finally:
                self.spans.append((name, start, self.now()))
                self.open.pop()

        timed.__wrapped__ = func
        return timed

    def take(self) -> dict[str, float]:
        """Seconds per phase since the last ``take`` (call after a synchronisation)."""
        totals: dict[str, float] = {}
        for name, start, end in self.spans:
            seconds = start.elapsed_time(end) / 1e3 if self.cuda else end - start
            totals[name] = totals.get(name, 0.0) + seconds
        self.spans = []
        return totals


class EpochClock:
    """Wall time (synchronised at both ends), generated tokens, optimizer steps and peak memory per epoch."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.peaks, self.phases = Peaks(cuda), Phases(cuda)
        self.epochs: list[dict[str, Any]] = []
        self.started: float | None = None
        self.tokens = self.generate_calls = self.optimizer_steps = self.decode_steps = 0

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def begin(self) -> None:
        self.sync()
        self.phases.take()
        self.peaks.take()
        self.tokens = self.generate_calls = self.optimizer_steps = self.decode_steps = 0
        self.started = time.perf_counter()

    def end(self) -> None:
        if self.started is None:
            return
        self.sync()
        wall = time.perf_counter() - self.started
        allocated, reserved = self.peaks.take()
        self.epochs.append({"wall_s": wall, "generated_tokens": self.tokens, "tokens_per_s": self.tokens / wall,
                            "decode_steps": self.decode_steps, "generate_calls": self.generate_calls,
                            "optimizer_steps": self.optimizer_steps, "phases_s": self.phases.take(),
                            "peak_allocated_bytes": allocated, "peak_reserved_bytes": reserved})
        self.started = None

    def count(self, tokens: int, decode_steps: int) -> None:
        self.tokens += tokens
        self.decode_steps += decode_steps
        self.generate_calls += 1

    def watch_optimizers(self, optimizers: list[Any]) -> None:
        def stepped(*_: Any) -> None:
            self.optimizer_steps += 1

        for optimizer in optimizers:
            optimizer.register_step_post_hook(stepped)


def dataset(rows: list[dict[str, Any]]) -> tuple[Any, str]:
    """``datasets.Dataset.from_list(rows)`` where ``datasets`` imports, else the list (both trainers index rows)."""
    try:
        from datasets import Dataset

        return Dataset.from_list(rows), "datasets.Dataset"
    except Exception as error:  # noqa: BLE001 - a broken install counts as missing
        return rows, f"list (datasets not importable: {type(error).__name__}: {error})"


def stub_module(name: str, **attributes: Any) -> types.ModuleType:
    import importlib.machinery

    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec probes must not raise
    module.__comlrl_benchmark_stub__ = True
    return module


def import_reference(notes: list[str]) -> types.ModuleType:
    """``comlrl.trainers.reinforce`` of the original. It imports ``wandb`` and ``datasets`` at module level,
    calls wandb only when given a ``wandb_config`` (here None), and uses ``Dataset`` / ``IterableDataset`` as
    annotations only; where either is missing, a stub stands in while the original's modules import and is
    taken out of ``sys.modules`` again (so that later availability probes of transformers and accelerate
    still find it missing). Noted in the result."""
    import importlib

    import accelerate  # noqa: F401 - their availability probes run before any stub exists
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel  # noqa: F401

    stubs: dict[str, types.ModuleType] = {}
    try:
        import wandb  # noqa: F401

        notes.append("wandb: installed")
    except Exception:  # noqa: BLE001
        def unused(*_: Any, **__: Any) -> None:
            raise RuntimeError("wandb stub: this benchmark runs without wandb_config")

        stubs["wandb"] = stub_module("wandb", run=None, init=unused, log=unused, finish=unused, Html=unused)
        notes.append("wandb: not installed; a stub module while comlrl 1.4.3 imports (never called: wandb_config=None)")
    try:
        import datasets  # noqa: F401
    except Exception as error:  # noqa: BLE001
        for key in [key for key in sys.modules if key == "datasets" or key.startswith("datasets.")]:
            del sys.modules[key]
        stubs["datasets"] = stub_module("datasets", Dataset=type("Dataset", (), {}),
                                        IterableDataset=type("IterableDataset", (), {}))
        notes.append(f"datasets: not importable ({type(error).__name__}: {error}); a stub with its two annotation "
                     "classes while comlrl 1.4.3 imports")
    sys.modules.update(stubs)
    try:
        return importlib.import_module("comlrl.trainers.reinforce")
    finally:
        for name, stub in stubs.items():
            if sys.modules.get(name) is stub:
                del sys.modules[name]


def run_ours(args: argparse.Namespace, clock: EpochClock, result: dict[str, Any]) -> None:
    from real_model import RealWorkload, plain_formatters, writing_task

    import comlrl
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    result["comlrl_file"] = comlrl.__file__
    workload = RealWorkload(model_dir=str(args.model_dir), max_new_tokens=args.max_new_tokens)
    task = writing_task()
    config = MAGRPOConfig(
        num_agents=2, num_generations=workload.num_generations, max_new_tokens=args.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=None, agent_learning_rate=workload.learning_rate,
        num_train_epochs=args.warmup_epochs + args.epochs, shuffle=False, seed=workload.seed, device=args.device,
        precision=args.precision, disable_tqdm=True, logging_steps=10**6,
    )
    data, result["dataset"] = dataset(workload.rows())
    trainer = MAGRPOTrainer(agent_model=str(args.model_dir), num_agents=2, reward_func=task.writing_reward,
                            formatters=plain_formatters(task), train_dataset=data, args=config)
    result["config"] = {name: getattr(config, name) for name in (
        "per_device_train_batch_size", "gradient_accumulation_steps", "max_grad_norm", "precision", "device",
        "generation_backend", "rollout_buffer_size", "train_batch_size", "num_turns", "loss_type",
        "policy_update_epochs", "gradient_checkpointing") if hasattr(config, name)}
    result["config"]["steps_per_epoch"] = trainer.batches_per_epoch()
    describe_models(trainer.agents, result)
    clock.watch_optimizers(trainer.optimizers)
    clock.sync()
    result["memory_after_load"] = memory_now(clock.cuda)

    from run_ours import counted_rollout

    trainer.rollout = clock.phases.wrap("generation", counted_rollout(trainer.rollout, clock))
    trainer.update = clock.phases.wrap("update", trainer.update)
    take_step, end_epoch = trainer.take_step, trainer.end_epoch

    def timed_take_step(*a: Any, **k: Any) -> Any:
        if trainer.state.step_in_epoch == 0:
            clock.begin()
        return take_step(*a, **k)

    def timed_end_epoch(*a: Any, **k: Any) -> Any:
        value = end_epoch(*a, **k)
        clock.end()
        return value

    trainer.take_step, trainer.end_epoch = timed_take_step, timed_end_epoch
    trainer.train()
    clock.end()


def run_reference(args: argparse.Namespace, clock: EpochClock, result: dict[str, Any]) -> None:
    import torch

    reinforce = import_reference(result["notes"])
    from real_model import RealWorkload, plain_formatters, writing_task

    import comlrl

    MAGRPOConfig, MAGRPOTrainer = reinforce.MAGRPOConfig, reinforce.MAGRPOTrainer

    result["comlrl_file"] = comlrl.__file__
    workload = RealWorkload(model_dir=str(args.model_dir), max_new_tokens=args.max_new_tokens)
    task = writing_task()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.precision]
    config = MAGRPOConfig(
        num_train_epochs=args.warmup_epochs + args.epochs, agent_learning_rate=workload.learning_rate,
        logging_steps=10**6, num_agents=2, agent_devices=args.device, num_generations=workload.num_generations,
        max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=None, num_turns=1,
        early_termination_threshold=None, eval_interval=0,
    )
    data, result["dataset"] = dataset(workload.rows())
    trainer = MAGRPOTrainer(agent_model=str(args.model_dir), num_agents=2, model_config={"dtype": dtype},
                            formatters=plain_formatters(task), train_dataset=data, reward_func=task.writing_reward,
                            wandb_config=None, args=config)
    trainer.verbose = False
    result["config"] = {"rollout_buffer_size": config.rollout_buffer_size, "train_batch_size": config.train_batch_size,
                        "model_config": {"dtype": str(dtype)}, "agent_devices": args.device,
                        "parallel_training": config.parallel_training, "steps_per_epoch": len(workload.rows()),
                        "max_grad_norm": "none (1.4.3 does not clip)"}
    describe_models(trainer.agents, result)
    clock.watch_optimizers(trainer.optimizers)
    clock.sync()
    result["memory_after_load"] = memory_now(clock.cuda)

    generate = trainer._generate_completions

    def counted_generate(*a: Any, **k: Any) -> Any:
        produced = generate(*a, **k)
        clock.count(sum(produced["response_lens"]), max(len(ids) for ids in produced["completion_input_ids"][0]))
        return produced

    trainer._generate_completions = clock.phases.wrap("generation", counted_generate)
    trainer._drain_ready_buffers = clock.phases.wrap("update", trainer._drain_ready_buffers)
    get_train_dataloader = trainer.get_train_dataloader

    def timed_dataloader(*a: Any, **k: Any) -> Any:
        clock.end()  # the previous epoch, its last drain included
        clock.begin()
        return get_train_dataloader(*a, **k)

    trainer.get_train_dataloader = timed_dataloader
    trainer.train()
    clock.end()
    result["buffers_left"] = [len(buffer) for buffer in trainer.rollout_buffers]


def describe_models(agents: list[Any], result: dict[str, Any]) -> None:
    result["models"] = [{"class": type(agent).__name__, "dtype": str(next(agent.parameters()).dtype),
                         "device": str(next(agent.parameters()).device),
                         "parameters": sum(p.numel() for p in agent.parameters()),
                         "attn_implementation": getattr(getattr(agent, "config", None), "_attn_implementation", None)}
                        for agent in agents]


def memory_now(cuda: bool) -> dict[str, int] | None:
    if not cuda:
        return None
    import torch

    return {"allocated_bytes": torch.cuda.memory_allocated(), "reserved_bytes": torch.cuda.memory_reserved()}


def run_one(args: argparse.Namespace) -> None:
    import torch

    cuda = args.device.startswith("cuda")
    if not cuda and args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    clock = EpochClock(cuda)
    result: dict[str, Any] = {"implementation": args.implementation, "precision": args.precision,
                              "device": args.device, "notes": []}
    started = time.perf_counter()
    (run_ours if args.implementation == "ours" else run_reference)(args, clock, result)
    result["versions"] = versions("torch", "transformers", "comlrl", "accelerate", "datasets")
    result["run_s"] = time.perf_counter() - started
    result["epochs"] = clock.epochs
    timed = clock.epochs[args.warmup_epochs:]
    if len(clock.epochs) != args.warmup_epochs + args.epochs:
        result["notes"].append(f"expected {args.warmup_epochs + args.epochs} epochs, timed {len(clock.epochs)}")
    walls = [epoch["wall_s"] for epoch in timed]
    result["summary"] = {
        "epoch_wall_s": statistics.median(walls),
        "epoch_wall_s_all": walls,
        "tokens_per_s": statistics.median(epoch["tokens_per_s"] for epoch in timed),
        "generated_tokens_per_epoch": statistics.median(epoch["generated_tokens"] for epoch in timed),
        "generation_s": statistics.median(epoch["phases_s"].get("generation", 0.0) for epoch in timed),
        "update_s": statistics.median(epoch["phases_s"].get("update", 0.0) for epoch in timed),
        "optimizer_steps_per_epoch": statistics.median(epoch["optimizer_steps"] for epoch in timed),
        "generate_calls_per_epoch": statistics.median(epoch["generate_calls"] for epoch in timed),
        "decode_steps_per_epoch": statistics.median(epoch["decode_steps"] for epoch in timed),
        # Peaks over every epoch (warm-up included: AdamW's state appears at the first step).
        "peak_allocated_gib": max(epoch["peak_allocated_bytes"] for epoch in clock.epochs) / 2**30,
        "peak_reserved_gib": max(epoch["peak_reserved_bytes"] for epoch in clock.epochs) / 2**30,
        "peak_allocated_gib_timed": max(epoch["peak_allocated_bytes"] for epoch in timed) / 2**30,
        "peak_reserved_gib_timed": max(epoch["peak_reserved_bytes"] for epoch in timed) / 2**30,
    }
    if cuda:
        result["gpu"] = torch.cuda.get_device_name()
    Path(args.output).write_text(json.dumps(result, indent=1, default=str))


# ----- the driver ------------------------------------------------------------------------------------
def launch(name: str, args: argparse.Namespace) -> dict[str, Any]:
    implementation, precision = RUNS[name]
    python = args.ours_python if implementation == "ours" else args.reference_python
    python = os.path.abspath(python) if os.sep in python else python  # the run's cwd is benchmarks/
    path = args.ours_pythonpath if implementation == "ours" else args.reference_pythonpath
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    if path:
        env["PYTHONPATH"] = path
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    output = Path(args.scratch) / f"{name}.json"
    command = [python, str(Path(__file__).resolve()), "run", implementation, "--precision", precision,
               "--device", args.device, "--model-dir", str(args.model_dir), "--epochs", str(args.epochs),
               "--warmup-epochs", str(args.warmup_epochs), "--max-new-tokens", str(args.max_new_tokens),
               "--threads", str(args.threads), "--output", str(output)]
    print(f"== {name}: PYTHONPATH={path or '(unset)'} {' '.join(command)}", flush=True)
    started = time.perf_counter()
    completed = subprocess.run(command, cwd=str(HERE), env=env, timeout=args.run_timeout)
    if completed.returncode != 0:
        print(f"!! {name} failed with exit status {completed.returncode} after {time.perf_counter() - started:.0f} s",
              flush=True)
        return {"failed": completed.returncode}
    result = json.loads(output.read_text())
    result["process_s"] = time.perf_counter() - started
    s = result["summary"]
    print(f"   {name}: epoch {s['epoch_wall_s']:.3f} s (all {', '.join(f'{w:.3f}' for w in s['epoch_wall_s_all'])}), "
          f"{s['tokens_per_s']:.0f} tokens/s, {s['generated_tokens_per_epoch']} tokens, peak "
          f"{s['peak_allocated_gib']:.3f} / {s['peak_reserved_gib']:.3f} GiB; config {result['config']}; "
          f"models {result['models'][0]}; {result['notes']}; comlrl from {result['comlrl_file']}", flush=True)
    return result


def machine(device: str) -> dict[str, Any]:
    import torch
    import transformers

    found: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                             "transformers": transformers.__version__, "device": device}
    if device.startswith("cuda"):
        found["gpu"] = torch.cuda.get_device_name()
        found["cuda"] = torch.version.cuda
        found["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        try:
            found["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30).stdout.strip()
        except Exception as error:  # noqa: BLE001
            found["nvidia_smi"] = f"unavailable: {error}"
    return found


def table(results: dict[str, dict[str, Any]]) -> str:
    reference = results.get("reference-bf16", {}).get("summary")
    lines = ["| run | epoch wall (s) | tokens/s | tokens/epoch | generation (s) | update (s) | optimizer steps/epoch "
             "| peak allocated (GiB) | peak reserved (GiB) | epoch / original | peak alloc. / original |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, result in results.items():
        if "summary" not in result:
            lines.append(f"| {name} | failed ({result}) |")
            continue
        s = result["summary"]
        ratio = f"{s['epoch_wall_s'] / reference['epoch_wall_s']:.2f}" if reference else ""
        memory = f"{s['peak_allocated_gib'] / reference['peak_allocated_gib']:.2f}" if reference and reference[
            "peak_allocated_gib"] else ""
        lines.append(f"| {name} | {s['epoch_wall_s']:.3f} | {s['tokens_per_s']:.0f} | {s['generated_tokens_per_epoch']}"
                     f" | {s['generation_s']:.3f} | {s['update_s']:.3f} | {s['optimizer_steps_per_epoch']} | "
                     f"{s['peak_allocated_gib']:.3f} | {s['peak_reserved_gib']:.3f} | {ratio} | {memory} |")
    return "\n".join(lines)


def drive(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    config_dir = args.config_dir if (args.config_dir / "config.json").exists() else FALLBACK_CONFIG_DIR
    info = machine(args.device)
    print(f"machine: {json.dumps(info)}", flush=True)
    model = make_model(config_dir, args.model_dir)
    print(f"model: {model} (random init, seed 0) from {config_dir} -> {args.model_dir} "
          f"({time.perf_counter() - started:.0f} s)", flush=True)
    Path(args.scratch).mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.runs:
        try:
            results[name] = launch(name, args)
        except subprocess.TimeoutExpired:
            print(f"!! {name} timed out after {args.run_timeout} s", flush=True)
            results[name] = {"failed": "timeout"}
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"machine": info, "model": model, "results": results,
                                           "arguments": {k: str(v) for k, v in vars(args).items()}}, indent=1))
    print()
    print(table(results))
    print(f"\nraw: {args.output} ({time.perf_counter() - started:.0f} s in all)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command")
    one = commands.add_parser("run", help="one runner in this process (its library importable here)")
    one.add_argument("implementation", choices=("ours", "reference"))
    one.add_argument("--precision", default="bf16")
    one.add_argument("--output", required=True)
    for sub in (parser, one):
        sub.add_argument("--device", default="cuda")
        sub.add_argument("--model-dir", type=Path, default=Path("/tmp/gpu_bench_smollm2"))
        sub.add_argument("--epochs", type=int, default=3, help="timed epochs (median)")
        sub.add_argument("--warmup-epochs", type=int, default=1)
        sub.add_argument("--max-new-tokens", type=int, default=32)
        sub.add_argument("--threads", type=int, default=4, help="torch threads on the CPU only (0 = torch's default)")
    parser.add_argument("--config-dir", type=Path, default=CONFIG_DIR)
    parser.add_argument("--runs", nargs="+", choices=sorted(RUNS), default=["ours-bf16", "reference-bf16", "ours-bf16-mixed"])
    parser.add_argument("--ours-python", default=sys.executable)
    parser.add_argument("--reference-python", default=sys.executable)
    parser.add_argument("--ours-pythonpath", default=str(ROOT), help="PYTHONPATH of ours' process")
    parser.add_argument("--reference-pythonpath", default="", help="PYTHONPATH of the original's process")
    parser.add_argument("--run-timeout", type=float, default=240, help="seconds per run before it is abandoned")
    parser.add_argument("--scratch", default="/tmp/gpu_real_model_runs")
    parser.add_argument("--output", type=Path, default=HERE / "runs" / "gpu_real_model.json")
    args = parser.parse_args()
    if args.command == "run":
        run_one(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
