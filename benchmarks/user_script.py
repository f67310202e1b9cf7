"""A user's MAGRPO training script, the same text under comlrl 1.4.3 and under this library.

It uses only names both libraries have (``comlrl.trainers.reinforce.MAGRPOConfig`` /
``MAGRPOTrainer``) and sets only what the workload names: two agents of one model, the prompts,
``num_generations``, ``max_new_tokens``, one epoch and one turn (1.4.3's default of two turns needs
an external transition). Everything else is each library's own default: batching, sampling
(temperature 0.6, top-p 0.6, top-k 50 in both), learning rate, dtype, device, logging.
``defaults.py`` runs it in each library's venv, one process per run, and reads the one ``RESULT``
line it prints::

    python benchmarks/user_script.py '{"model_dir": "...", "task": "writing", "prompts": 2}'

``config`` in the job adds keyword arguments to ``MAGRPOConfig`` (the equal-work table gives both
libraries ``rollout_buffer_size=1``, a name both accept). Nothing here reaches into either library:
optimizer steps are counted with torch's global optimizer hook and peak memory with ``getrusage``.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(name, "1")
os.environ.setdefault("WANDB_MODE", "disabled")
ROOT = Path(__file__).resolve().parents[1]


def load_file(name: str, path: Path):
    """A module from its file (the task is scored by the same code in both venvs)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def task(job: dict) -> tuple[list[dict], list, object]:
    """Rows, formatters and reward of the job's task: ``writing`` (the real model's) or ``letters`` (the tiny one's)."""
    count = int(job["prompts"])
    if job["task"] == "writing":
        writing = load_file("writing_task", ROOT / "comlrl" / "tasks" / "writing.py")
        lines = (ROOT / "data" / "writing" / "train.jsonl").read_text().splitlines()[:count]
        # Plain-text prompts, as benchmarks/real_model.py explains (1.4.3 ends a prompt at its first pad token).
        formatters = [lambda row, text=text: f"{text}\n\n{row['passage']}\n"
                      for text in (writing.SUMMARY_INSTRUCTION, writing.EXPANSION_INSTRUCTION)]
        return [json.loads(line) for line in lines], formatters, writing.writing_reward
    workload = load_file("bench_workload", ROOT / "benchmarks" / "workload.py")
    prompts = [form.format(subject) for subject in workload.SUBJECTS for form in workload.FORMS]
    rows = [{"prompt": prompts[i % len(prompts)]} for i in range(count)]
    return rows, [lambda row: row["prompt"]] * 2, workload.joint_reward


def main() -> None:
    job = json.loads(sys.argv[1])
    import torch
    from datasets import Dataset

    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    rows, formatters, reward = task(job)
    steps = [0]
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))
    config = MAGRPOConfig(num_turns=1, num_train_epochs=1, num_generations=job.get("num_generations", 4),
                          max_new_tokens=job.get("max_new_tokens", 32), **job.get("config", {}))
    trainer = MAGRPOTrainer(agent_model=job["model_dir"], num_agents=2, reward_func=reward, formatters=formatters,
                            train_dataset=Dataset.from_list(rows), args=config)
    built = time.perf_counter()
    cpu = time.process_time()
    trainer.train()
    done = time.perf_counter()
    batch = getattr(config, "per_device_train_batch_size", None)
    print("RESULT " + json.dumps({
        "train_s": done - built, "train_cpu_s": time.process_time() - cpu, "script_s": done - STARTED,
        "setup_s": built - STARTED, "optimizer_steps": steps[0], "threads": torch.get_num_threads(),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rollout_buffer_size": getattr(config, "rollout_buffer_size", None), "per_device_train_batch_size": batch,
        "torch": torch.__version__,
    }), flush=True)


if __name__ == "__main__":
    main()
