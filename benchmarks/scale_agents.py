"""Per-step time of two MAGRPO agents on one GPU vs one GPU each (placement + threaded agents).

    python benchmarks/scale_agents.py [--hidden-size 1024] [--steps 6] [--max-new-tokens 64]

Builds a local Llama of the given width (no hub), trains a few steps with
``device=["cuda:0", "cuda:0"]`` and then ``["cuda:0", "cuda:1"]``, and prints the median step,
generation and update times and the per-device peak memory. Without two CUDA devices it says
so and exits 0 (with one GPU it measures only the one-GPU case).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch


def measure(model_dir: Path, devices: list[str], steps: int, max_new_tokens: int) -> dict[str, float]:
    from datasets import Dataset

    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    prompts = [f"write a story about the {w}" for w in "cat dog sun moon tree river hill road".split()]
    trainer = MAGRPOTrainer(
        agent_model=str(model_dir), num_agents=2,
        reward_func=lambda a, b: [(x.count("e") + y.count("o")) / max(len(x) + len(y), 1) for x, y in zip(a, b)],
        train_dataset=Dataset.from_dict({"prompt": prompts * steps}),
        args=MAGRPOConfig(num_agents=2, num_generations=8, max_new_tokens=max_new_tokens, per_device_train_batch_size=8,
                          num_train_epochs=1, device=devices, disable_tqdm=True),
    )
    history = trainer.train()[1:]  # the first step includes CUDA warm-up
    summary = {name: statistics.median(step[name] for step in history)
               for name in ("step_time", "generation_time", "update_time")}
    summary.update({k: max(step[k] for step in history) for k in history[0] if k.startswith("memory/")})
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        print("scale_agents: no CUDA device here; this benchmark compares 1 vs 2 GPUs and measures nothing on CPU.")
        return 0
    from comlrl.tiny import save_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_model(Path(tmp) / "model", "llama", vocab_size=96, hidden_size=args.hidden_size)
        results = {"1 GPU": measure(model_dir, ["cuda:0", "cuda:0"], args.steps, args.max_new_tokens)}
        if count >= 2:
            results["2 GPUs"] = measure(model_dir, ["cuda:0", "cuda:1"], args.steps, args.max_new_tokens)
        else:
            print("scale_agents: only one CUDA device; the 2-GPU case is skipped.")
    print(json.dumps(results, indent=2))
    if "2 GPUs" in results:
        print(f"speed-up of the step: {results['1 GPU']['step_time'] / results['2 GPUs']['step_time']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
