"""Each generation optimisation, before and after, in one process: milliseconds per decode step.

Variants, every one drawing the same tokens (an EOS the model never meets keeps every call at
``max_new_tokens`` steps), measured in rotation over ``--repeats`` rounds:

- ``generate``: transformers' ``model.generate`` (``generation_backend="transformers"``);
- ``loop, no_grad, padding mask``: our decode loop under ``no_grad``, prompts given one
  masked padding column so every step builds the attention mask;
- ``loop, no_grad``: the same loop without padding (no mask is passed);
- ``loop, inference_mode``: what ``comlrl.rollout.sampling.decode`` runs.

CPU time (``time.process_time``) is reported beside wall time: with one torch thread it is the
work done, whatever else the machine is running.

    .venv/bin/python benchmarks/decode_steps.py --model-dir benchmarks/runs/model-h256
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

from workload import LETTERS  # noqa: F401  (imported first: sets the offline environment before torch)


def variants(model, tokenizer, prompt: str, rows: int, max_new_tokens: int) -> dict[str, Callable[[], object]]:
    import torch

    from comlrl.rollout.generation import _generation_config, encode_prompts
    from comlrl.rollout.sampling import SamplingParams, _decode_loop, decode

    sampling = SamplingParams(max_new_tokens=max_new_tokens)
    ids, mask = encode_prompts(tokenizer, [prompt], torch.device("cpu"))
    ids, mask = ids.repeat(rows, 1), mask.repeat(rows, 1)
    padded_ids = torch.cat([torch.full((rows, 1), tokenizer.pad_token_id), ids], dim=1)
    padded_mask = torch.cat([torch.zeros(rows, 1, dtype=mask.dtype), mask], dim=1)
    never = [tokenizer.vocab_size + 10]  # an EOS no row can emit: every call runs max_new_tokens steps
    config = _generation_config(tokenizer, sampling, 1)
    config.eos_token_id = never

    def loop_no_grad(prompt_ids, prompt_mask):
        with torch.no_grad():
            return _decode_loop(model, prompt_ids, prompt_mask, sampling, never, tokenizer.pad_token_id, None)

    return {
        "generate": lambda: model.generate(input_ids=ids, attention_mask=mask, generation_config=config),
        "loop, no_grad, padding mask": lambda: loop_no_grad(padded_ids, padded_mask),
        "loop, no_grad": lambda: loop_no_grad(ids, mask),
        "loop, inference_mode": lambda: decode(model, ids, mask, sampling, never, tokenizer.pad_token_id),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--rows", type=int, default=4, help="sequences decoded together (num_generations)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--calls", type=int, default=10, help="calls per variant and round")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    runs = variants(model, tokenizer, "write a story about the cat", args.rows, args.max_new_tokens)
    for run in runs.values():  # warm-up
        run()
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    steps = args.calls * args.max_new_tokens
    names = list(runs)
    for repeat in range(args.repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            start, cpu_start = time.perf_counter(), time.process_time()
            for _ in range(args.calls):
                runs[name]()
            wall[name].append(1000 * (time.perf_counter() - start) / steps)
            cpu[name].append(1000 * (time.process_time() - cpu_start) / steps)
    base = statistics.median(cpu["generate"])
    print(f"### ms per decode step ({args.rows} rows, {args.max_new_tokens} steps per call, {args.calls} calls, "
          f"median of {args.repeats} rounds, {args.threads} thread(s))\n")
    print("| variant | wall ms / step | CPU ms / step | CPU vs generate |")
    print("|---|---:|---:|---:|")
    for name in runs:
        median_cpu = statistics.median(cpu[name])
        print(f"| {name} | {statistics.median(wall[name]):.3f} | {median_cpu:.3f} | {median_cpu / base:.2f} |")


if __name__ == "__main__":
    main()
