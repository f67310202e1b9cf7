"""The benchmark workload every runner shares: config, prompts, reward, timers, result records.

This module imports neither this library nor a peer: the reference implementation also
imports as ``comlrl``, so each runner lives in its own process and virtual environment and
only this file (and the JSON it prints) is common to them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

PROCESS_START = time.perf_counter()  # imported first by every runner, before torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")

PHASES = ("generation", "reward", "forward", "backward_optimizer", "other")
LETTERS = "eoai"
SUBJECTS = "cat dog sun moon tree river hill road book letter idea team".split()
FORMS = ["write a story about the {}", "tell me about the {}", "describe the {} to a friend", "a short note on the {}"]


@dataclass
class Workload:
    model_dir: str
    num_agents: int = 2
    num_generations: int = 4
    max_new_tokens: int = 48
    steps: int = 6
    warmup_steps: int = 1
    temperature: float = 1.0
    learning_rate: float = 1e-4
    seed: int = 0
    device: str = "cpu"
    threads: int = 1  # 1 by default: on a shared CPU, several threads per process oversubscribe the cores

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model-dir", required=True, help="tiny local model directory (see make_model.py)")
        parser.add_argument("--num-agents", type=int, default=cls.num_agents)
        parser.add_argument("--num-generations", type=int, default=cls.num_generations)
        parser.add_argument("--max-new-tokens", type=int, default=cls.max_new_tokens)
        parser.add_argument("--steps", type=int, default=cls.steps, help="timed steps")
        parser.add_argument("--warmup-steps", type=int, default=cls.warmup_steps, help="untimed steps first")
        parser.add_argument("--temperature", type=float, default=cls.temperature)
        parser.add_argument("--learning-rate", type=float, default=cls.learning_rate)
        parser.add_argument("--seed", type=int, default=cls.seed)
        parser.add_argument("--device", default=cls.device, help="'cpu' or 'cuda' (bf16 on CUDA)")
        parser.add_argument("--threads", type=int, default=cls.threads, help="torch intra-op threads (0 = default)")

    @classmethod
    def from_arguments(cls, args: argparse.Namespace) -> "Workload":
        return cls(**{name: getattr(args, name) for name in cls.__dataclass_fields__})

    def ours_config(self) -> dict[str, Any]:
        """What every runner of this library sets alike: the workload's sampling (no top-k/top-p), one epoch
        over the rows in order, one prompt per step, no gradient clipping (the reference never clips), quiet."""
        return dict(num_generations=self.num_generations, max_new_tokens=self.max_new_tokens,
                    temperature=self.temperature, top_p=1.0, top_k=None, agent_learning_rate=self.learning_rate,
                    max_grad_norm=None, num_train_epochs=1, per_device_train_batch_size=1, shuffle=False,
                    seed=self.seed, device=self.device, disable_tqdm=True, logging_steps=10**6)

    def reference_config(self) -> dict[str, Any]:
        """What every runner of the reference sets alike: the workload's sampling, one epoch, one turn, no
        early termination or periodic evaluation, quiet."""
        return dict(num_train_epochs=1, agent_learning_rate=self.learning_rate, logging_steps=10**6,
                    agent_devices=self.device, max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                    top_p=1.0, top_k=None, num_turns=1, early_termination_threshold=None, eval_interval=0)

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.steps

    def samples_per_step(self, prompts: int = 1) -> int:
        return self.num_agents * self.num_generations * prompts

    def rows(self) -> list[dict[str, str]]:
        """One prompt per training step (every runner trains on batches of one prompt)."""
        prompts = [form.format(subject) for subject in SUBJECTS for form in FORMS]
        return [{"prompt": prompts[i % len(prompts)]} for i in range(self.total_steps)]

    def setup_torch(self) -> None:
        import torch

        if self.threads:
            torch.set_num_threads(self.threads)
        torch.manual_seed(self.seed)


def letter_share(text: str, letter: str) -> float:
    return text.count(letter) / len(text) if text else 0.0


def joint_reward(*completions: list[str], batch_items: Any = None) -> list[float]:
    """Agent i is paid for its share of ``LETTERS[i % 4]``; the joint reward is the agents' mean."""
    return [
        sum(letter_share(text, LETTERS[agent % len(LETTERS)]) for agent, text in enumerate(joint)) / len(joint)
        for joint in zip(*completions)
    ]


class PhaseTimer:
    """Wall time per phase; on CUDA each boundary synchronises so kernels land in their phase."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.totals: dict[str, float] = {}
        self._open: list[str] = []

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.sync()
        start = time.perf_counter()
        self._open.append(name)
        try:
            yield
        finally:
            self.sync()
            self._open.pop()
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - start

    def wrap(self, name: str, func: Callable) -> Callable:
        """``func`` timed as ``name``; nested calls of an already-open phase are not counted twice."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            if name in self._open:
                return func(*args, **kwargs)
            with self.phase(name):
                return func(*args, **kwargs)

        timed.__wrapped__ = func  # keeps inspect.signature (reward functions are introspected)
        return timed

    def wrap_inside(self, parent: str, name: str, func: Callable, outside: str | None = None) -> Callable:
        """``func`` timed as ``name`` while phase ``parent`` is open; as ``outside`` (or untimed) elsewhere.

        The same function (a forward pass, say) can run inside the update and at rollout time,
        and each call belongs to the phase it runs in.
        """
        inside_timed = self.wrap(name, func)
        outside_timed = self.wrap(outside, func) if outside else func

        def call(*args: Any, **kwargs: Any) -> Any:
            return (inside_timed if parent in self._open else outside_timed)(*args, **kwargs)

        call.__wrapped__ = func
        return call

    def take(self) -> dict[str, float]:
        totals, self.totals = self.totals, {}
        return totals


@dataclass
class StepRecord:
    step_time: float
    phases: dict[str, float]
    samples: int
    generated_tokens: int
    cpu_time: float = 0.0  # the process's CPU time over the step: with one torch thread, busy time whatever the load
    # Decode steps summed over the step's generate calls (each call runs until its last row ends):
    # the generation work, which sampling luck changes from run to run and library to library.
    decode_steps: int = 0


@dataclass
class RunResult:
    implementation: str
    workload: dict[str, Any]
    versions: dict[str, str]
    startup_time: float = 0.0  # process start -> first training step begins
    first_step_end: float = 0.0  # process start -> first training step done
    steps: list[StepRecord] = field(default_factory=list)
    peak_rss_mb: float = 0.0
    peak_cuda_mb: float | None = None
    notes: list[str] = field(default_factory=list)

    def finish(self, workload: "Workload") -> None:
        """Drop the warm-up steps; record peak memory."""
        self.steps = self.steps[workload.warmup_steps:]
        self.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        if workload.device.startswith("cuda"):
            import torch

            self.peak_cuda_mb = torch.cuda.max_memory_allocated() / 2**20

    def emit(self, path: str | None) -> None:
        text = json.dumps(asdict(self))
        if path:
            with open(path, "w") as handle:
                handle.write(text)
        else:
            print("RESULT " + text)


class StepClock:
    """Records a run's training steps: wall and CPU time, phases, generated tokens, decode steps, start-up.

    Runners call :meth:`begin` and :meth:`end` around each step (or wrap the library's step
    function with :meth:`timed`), and :meth:`count` from their wrapped generation function.
    """

    def __init__(self, result: RunResult, timer: PhaseTimer) -> None:
        self.result, self.timer = result, timer
        self.tokens = self.decode_steps = 0
        self._start = self._cpu_start = 0.0

    def count(self, tokens: int, decode_steps: int) -> None:
        self.tokens += tokens
        self.decode_steps += decode_steps

    def begin(self) -> None:
        self.timer.sync()
        self.timer.take()
        self.tokens = self.decode_steps = 0
        self._start, self._cpu_start = time.perf_counter(), time.process_time()
        if not self.result.startup_time:
            self.result.startup_time = self._start - PROCESS_START

    def end(self, samples: int) -> StepRecord:
        self.timer.sync()
        end = time.perf_counter()
        if not self.result.first_step_end:
            self.result.first_step_end = end - PROCESS_START
        record = StepRecord(end - self._start, self.timer.take(), samples, self.tokens,
                            time.process_time() - self._cpu_start, self.decode_steps)
        self.result.steps.append(record)
        return record

    def timed(self, step: Callable, samples: Callable[..., int]) -> Callable:
        """``step`` recorded as one training step; ``samples(*args)`` counts its samples."""

        def call(*args: Any, **kwargs: Any) -> Any:
            self.begin()
            value = step(*args, **kwargs)
            self.end(samples(*args, **kwargs))
            return value

        return call


def versions(*names: str) -> dict[str, str]:
    import importlib.metadata as metadata

    found = {"python": sys.version.split()[0]}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "local"
    return found


def split_step(step_time: float, phases: dict[str, float]) -> dict[str, float]:
    """The four reported phases plus ``other`` (the step's time outside them).

    Runners time the whole update as ``update`` and its log-prob forward passes as
    ``forward``; backward and optimizer are the difference.
    """
    known = {name: phases.get(name, 0.0) for name in ("generation", "reward", "forward")}
    known["backward_optimizer"] = max(phases.get("update", 0.0) - known["forward"], 0.0)
    known["other"] = max(step_time - sum(known.values()), 0.0)
    return known


def runner_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    Workload.add_arguments(parser)
    parser.add_argument("--output", help="write the JSON result here (default: print it)")
    return parser


def model_dtype(device: str):
    import torch

    return torch.bfloat16 if device.startswith("cuda") else torch.float32


@contextmanager
def swapped(*swaps: tuple[Any, str, Any]) -> Iterator[None]:
    """``setattr(owner, name, value)`` for each ``(owner, name, value)``, undone on exit (in reverse order)."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in swaps]
    for owner, name, value in swaps:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
