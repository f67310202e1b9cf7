"""Roofline-style figures: FLOPs and bytes per training step, the measured matmul rate, the fraction achieved.

FLOPs count the matrix multiplies (2 per multiply-add) of the dense layers and attention;
bytes count weight traffic (each decode step reads every weight once per agent; the update
reads weights forward and backward, writes gradients, and AdamW reads/writes 7 float32
tensors per parameter). Both are lower bounds of the real traffic. The step figures come
from a compare.py or run_ours.py result.

    .venv/bin/python benchmarks/roofline.py --results benchmarks/runs/compare.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from report import summarise_run

HERE = Path(__file__).resolve().parent


def measured_matmul_rate(size: int, rows: int | None = None, device: str = "cpu", threads: int = 1, seconds: float = 1.0) -> float:
    """Best FLOP/s of ``[rows, size] @ [size, size]`` (square when ``rows`` is None)."""
    import torch

    torch.set_num_threads(threads)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    a = torch.randn(rows or size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    flops = 2 * (rows or size) * size * size
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            a @ b
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = max(best, 10 * flops / (time.perf_counter() - start))
    return best


def model_shapes(model_dir: Path) -> dict[str, int]:
    config = json.loads((model_dir / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * config["intermediate_size"]
    body, head = layers * per_layer, config["vocab_size"] * hidden  # the decoder's matmul weights; the output head's
    return {
        "hidden": hidden,
        "layers": layers,
        "body": body,
        "head": head,
        # every parameter: the matmul weights, the head (unless tied to the embeddings), 2 norms a layer + the last
        "params": body + head * (1 if config.get("tie_word_embeddings") else 2) + layers * 2 * hidden + hidden,
        "matmul_params": layers * per_layer + config["vocab_size"] * hidden,  # + the (tied) output head
        "all_params": layers * per_layer + config["vocab_size"] * hidden * (1 if config.get("tie_word_embeddings") else 2),
    }


def step_work(shapes: dict[str, int], agents: int, generations: int, prompt: int, new_tokens: float, max_new: int) -> dict[str, float]:
    """FLOPs and weight bytes of one step (float32 weights on CPU)."""
    dense = 2 * shapes["matmul_params"]
    attention = 4 * shapes["layers"] * shapes["hidden"]  # per token per context position (QK^T and AV)
    sequences = agents * generations
    mean_length = prompt + new_tokens
    generation = sequences * (dense * mean_length + attention * mean_length**2 / 2)
    padded = prompt + max_new  # the update runs the padded batch
    forward = sequences * (dense * padded + attention * padded**2 / 2)
    weight_bytes = 4 * shapes["matmul_params"]
    return {
        "generation_flops": generation,
        "update_flops": 3 * forward,  # forward + backward (2x)
        "generation_bytes": agents * max_new * weight_bytes,
        "update_bytes": agents * (3 * weight_bytes + 7 * 4 * shapes["all_params"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=HERE / "runs" / "compare.json")
    parser.add_argument("--prompt-tokens", type=int, default=8, help="typical prompt length of the workload")
    parser.add_argument("--seconds", type=float, default=1.0, help="time spent measuring each matmul rate")
    args = parser.parse_args()
    loaded = json.loads(args.results.read_text())
    runs = loaded["reference"]["ours"] if "reference" in loaded else [loaded]
    workload = runs[0]["workload"]
    summaries = [summarise_run(run) for run in runs]
    median = {key: statistics.median(s[key] for s in summaries) for key in summaries[0]}
    shapes = model_shapes(Path(workload["model_dir"]) if Path(workload["model_dir"]).is_absolute() else HERE / workload["model_dir"])
    per_sequence_tokens = median["generated_tokens"] / (workload["num_agents"] * workload["num_generations"])
    work = step_work(shapes, workload["num_agents"], workload["num_generations"], args.prompt_tokens,
                     per_sequence_tokens, workload["max_new_tokens"])
    device, threads = workload["device"], workload["threads"] or 1
    square = measured_matmul_rate(1024, device=device, threads=threads, seconds=args.seconds)
    decode_shape = measured_matmul_rate(shapes["hidden"], rows=workload["num_generations"], device=device,
                                        threads=threads, seconds=args.seconds)
    update_time = median["forward"] + median["backward_optimizer"]
    flops = work["generation_flops"] + work["update_flops"]
    print(f"model: {shapes['all_params'] / 1e6:.2f} M parameters ({shapes['matmul_params'] / 1e6:.2f} M in matmuls), "
          f"{workload['num_agents']} agents x {workload['num_generations']} generations, "
          f"{per_sequence_tokens:.1f} of {workload['max_new_tokens']} new tokens per completion; {device}, {threads} thread(s)")
    print(f"measured matmul rate: {square / 1e9:.1f} GFLOP/s (1024^3), "
          f"{decode_shape / 1e9:.2f} GFLOP/s ([{workload['num_generations']},{shapes['hidden']}]x[{shapes['hidden']},{shapes['hidden']}], a decode-step shape)")
    print("| part | GFLOP | MB of weight traffic | time (s) | achieved GFLOP/s | fraction of 1024^3 rate |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, part_flops, part_bytes, seconds in [
        ("generation", work["generation_flops"], work["generation_bytes"], median["generation"]),
        ("update (forward+backward+AdamW)", work["update_flops"], work["update_bytes"], update_time),
        ("whole step", flops, work["generation_bytes"] + work["update_bytes"], median["step_time"]),
    ]:
        rate = part_flops / seconds
        print(f"| {name} | {part_flops / 1e9:.3f} | {part_bytes / 1e6:.1f} | {seconds:.3f} | {rate / 1e9:.2f} | {rate / square:.1%} |")


if __name__ == "__main__":
    main()
