"""Each speed lever of the real-model step, before and after: CPU time per phase, and peak RSS.

The workload is ``real_model.py``'s (2 SmolLM2-135M agents, 2 prompts, 4 generations, 32 new
tokens, one MAGRPO epoch per step) on this library. A variant is a set of patches, open while
its step runs: some restore the code path this library had before a change ("before"), some
switch on what a config option switches on (the ``bf16-mixed*`` variants set the trainer's
``autocast_dtype``, which ``precision="bf16-mixed"`` sets, so one trainer serves every variant),
and the "tried" ones are changes that did not pay, kept to document them. CPU time: all
variants in one process, one step each in turn for ``--rounds`` rounds, so that they are compared
under the same load on the same weights (1 torch thread; median per variant). Peak RSS
(``--memory``): each variant in its own process, after a warm-up step and ``--steps`` more.

    .venv/bin/python benchmarks/real_levers.py                          # CPU time of every variant
    .venv/bin/python benchmarks/real_levers.py --memory --variants before shared steps-after-all-backwards
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import resource
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

from real_model import MODEL_DIR, OURS_PYTHON, RealWorkload, plain_formatters, writing_task
from workload import swapped

HERE = Path(__file__).resolve().parent


# ----- patches: each swaps attributes while its context is open (workload.swapped) ---------------------------


def unshared_prefill(trainer: Any) -> contextlib.AbstractContextManager:
    """Before: every sample's prompt prefilled (the prompts repeated num_generations times first)."""
    import comlrl.rollout.generation as generation
    from comlrl.rollout.sampling import decode

    def repeated(model, prompt_ids, prompt_mask, sampling, eos, pad, generator=None, num_generations=1):
        return decode(model, prompt_ids.repeat_interleave(num_generations, dim=0),
                      prompt_mask.repeat_interleave(num_generations, dim=0), sampling, eos, pad, generator)

    return swapped((generation, "decode", repeated))


def unshared_update(trainer: Any) -> contextlib.AbstractContextManager:
    """Before: one pass over prompt + completion per row in the update."""
    import comlrl.training.logprobs as logprobs

    return swapped((logprobs, "distinct_prompts", lambda prompt_ids, prompt_mask: None))


def under_autocast(owner: Any, name: str) -> contextlib.AbstractContextManager:
    import torch

    plain = getattr(owner, name)

    @functools.wraps(plain)
    def autocast(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return plain(*args, **kwargs)

    return swapped((owner, name, autocast))


def autocast_generation(trainer: Any) -> contextlib.AbstractContextManager:
    """Tried: the decode loop under CPU bf16 autocast (float32 weights cast at every forward)."""
    import comlrl.rollout.sampling as sampling

    return under_autocast(sampling, "_decode_loop")


def bf16_mixed(trainer: Any) -> contextlib.AbstractContextManager:
    """The library's ``precision="bf16-mixed"``: bf16 sampling copies made at each rollout, bf16 autocast of
    every log-prob forward (the trainer's ``autocast_dtype``, which that config sets)."""
    import torch

    return swapped((trainer, "autocast_dtype", torch.bfloat16))


def fp32_sampling(trainer: Any) -> contextlib.AbstractContextManager:
    """Sampling from the float32 agents themselves (with ``bf16_mixed``: only its autocast half)."""
    return swapped((trainer, "sampling_agents", lambda: list(trainer.agents)))


def bf16_sampling(trainer: Any) -> contextlib.AbstractContextManager:
    """Only the sampling half of ``precision="bf16-mixed"``: bf16 copies made at each rollout, the update in fp32."""
    import torch

    from comlrl.training.mixed_precision import sampling_models

    return swapped((trainer, "sampling_agents", lambda: sampling_models(trainer.agents, torch.bfloat16)))


def steps_after_all_backwards(trainer: Any) -> contextlib.AbstractContextManager:
    """Before: every agent's backward pass first, then every optimizer step (the path MAGRPOTrainer.update
    takes for agents on several GPUs); the library now steps each agent right after its backward on one
    device, so its gradients are freed before the next agent's pass (same weights)."""
    return swapped((trainer, "agents_run_in_turn", lambda: False))


def unpacked_decode(trainer: Any) -> contextlib.AbstractContextManager:
    """Before packed decode weights: every decode step multiplies by the plain weights (torch's default
    GEMM, MKL) instead of copies packed for the decode's rows by oneDNN (``comlrl.rollout.packed_weights``)."""
    import comlrl.rollout.packed_weights as packed_weights

    return swapped((packed_weights, "PACK_MIN_BYTES", 2**62))


def chunked_logprobs(trainer: Any, chunk: int = 8) -> contextlib.AbstractContextManager:
    """Tried: log-probs from the final hidden states, the output head and log-softmax applied to
    ``chunk`` positions at a time and recomputed in the backward pass (no full-vocabulary logits kept).
    Against ``unshared-update`` (the same single pass per row, full logits)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    import comlrl.training.policy_update as policy_update
    from comlrl.rollout.generation import position_ids_from_mask

    def head_logprobs(head, hidden, ids, temperature):
        logits = head(hidden).float() / temperature
        return logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)

    def completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature=1.0):
        ids = torch.cat([prompt_ids, completion_ids], dim=1)
        mask = torch.cat([prompt_mask, completion_mask.to(prompt_mask.dtype)], dim=1)
        hidden = model.model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).last_hidden_state
        hidden = hidden[:, prompt_ids.shape[1] - 1:-1]
        parts = [checkpoint(head_logprobs, model.lm_head, hidden[:, start:start + chunk],
                            completion_ids[:, start:start + chunk], temperature, use_reentrant=False)
                 for start in range(0, completion_ids.shape[1], chunk)]
        return torch.cat(parts, dim=1)

    return swapped((policy_update, "completion_logprobs", completion_logprobs))


VARIANTS: dict[str, tuple[str, list[Callable[[Any], contextlib.AbstractContextManager]]]] = {
    "before": ("no prompt sharing (the code before this change)", [unshared_prefill, unshared_update]),
    "shared-prefill": ("each prompt prefilled once per agent", [unshared_update]),
    "steps-after-all-backwards": ("shared, every agent's backward before any optimizer step (before the per-agent "
                                  "step)", [steps_after_all_backwards]),
    "unpacked-decode": ("shared, decode products from the plain weights (before packed decode weights)",
                        [unpacked_decode]),
    "shared": ("+ each prompt run once in the update, each agent stepped after its backward, decode weights packed "
               "(the library now, fp32)", []),
    "chunked-logprobs": ("tried: full update pass per row, head + log-softmax in chunks of 8 positions",
                         [unshared_update, chunked_logprobs]),
    "bf16-mixed-update": ("library precision='bf16-mixed', its autocast half only (sampling from fp32 weights)",
                          [bf16_mixed, fp32_sampling]),
    "autocast-generation": ("tried: shared, decode loop under bf16 autocast", [autocast_generation]),
    "bf16-mixed-sampling": ("library precision='bf16-mixed', its sampling half only (bf16 copies, fp32 update)",
                            [bf16_sampling]),
    "bf16-mixed-unpacked": ("library precision='bf16-mixed', decode products from the plain bf16 copies",
                            [bf16_mixed, unpacked_decode]),
    "bf16-mixed": ("library precision='bf16-mixed' (both halves)", [bf16_mixed]),
}


def build_trainer(threads: int) -> tuple[Any, list[dict[str, str]]]:
    """This library's trainer on the real workload (``real_model.py``'s settings) and its rows."""
    import torch
    from datasets import Dataset

    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    workload = RealWorkload()
    task = writing_task()
    config = MAGRPOConfig(num_agents=2, num_generations=workload.num_generations, max_new_tokens=workload.max_new_tokens,
                          temperature=1.0, top_p=1.0, top_k=None, agent_learning_rate=workload.learning_rate,
                          per_device_train_batch_size=workload.num_prompts, shuffle=False, seed=0, device="cpu",
                          disable_tqdm=True, logging_steps=10**6)
    rows = workload.rows()
    trainer = MAGRPOTrainer(agent_model=str(MODEL_DIR), num_agents=2, reward_func=task.writing_reward,
                            formatters=plain_formatters(task), train_dataset=Dataset.from_list(rows), args=config)
    return trainer, rows


def timed_step(trainer: Any, rows: list[dict[str, str]], variant: str) -> dict[str, float]:
    """One training step with ``variant``'s patches: CPU seconds of the step and of its phases."""
    import comlrl.training.policy_update as policy_update

    phases: dict[str, float] = {}

    def timed(phase: str, function: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                phases[phase] = phases.get(phase, 0.0) + time.process_time() - start
        return call

    with contextlib.ExitStack() as patches:
        for patch in VARIANTS[variant][1]:
            patches.enter_context(patch(trainer))
        # The timers wrap whatever the variant installed.
        patches.enter_context(swapped(
            (policy_update, "completion_logprobs", timed("forward", policy_update.completion_logprobs)),
            (trainer, "rollout", timed("generation", type(trainer).rollout.__get__(trainer))),
            (trainer, "update", timed("update", type(trainer).update.__get__(trainer))),
        ))
        start = time.process_time()
        trainer.train_step(rows)
        phases["step"] = time.process_time() - start
    phases["backward_optimizer"] = phases.get("update", 0.0) - phases.get("forward", 0.0)
    return phases


def time_variants(variants: list[str], rounds: int, threads: int) -> list[dict[str, Any]]:
    """Every variant's CPU time in one process: one warm-up step, then ``rounds`` rounds of one step per
    variant in turn (paired under the same load); the median of each variant's steps."""
    trainer, rows = build_trainer(threads)
    timed_step(trainer, rows, "shared")
    records: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for round_index in range(rounds):
        for name in variants[round_index % len(variants):] + variants[:round_index % len(variants)]:
            records[name].append(timed_step(trainer, rows, name))
            print(f"round {round_index} {name}: " + json.dumps({k: round(v, 2) for k, v in records[name][-1].items()}),
                  flush=True)
    return [{"variant": name, "cpu": {key: statistics.median(r[key] for r in steps) for key in steps[0]}}
            for name, steps in records.items()]


def peak_memory(variant: str, steps: int, threads: int) -> dict[str, Any]:
    """The variant alone in this process: peak RSS after a warm-up step and ``steps`` more."""
    trainer, rows = build_trainer(threads)
    cpu = [timed_step(trainer, rows, variant) for _ in range(1 + steps)][1:]
    return {"variant": variant, "cpu": {key: statistics.median(r[key] for r in cpu) for key in cpu[0]},
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| variant | what | step CPU (s) | generation | log-prob forward | backward + optimizer | peak RSS (MiB) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for result in results:
        cpu, rss = result["cpu"], result.get("peak_rss_mb")
        lines.append(f"| {result['variant']} | {VARIANTS[result['variant']][0]} | {cpu['step']:.2f} | "
                     f"{cpu['generation']:.2f} | {cpu['forward']:.2f} | {cpu['backward_optimizer']:.2f} | "
                     f"{f'{rss:.0f}' if rss else '-'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--memory", action="store_true",
                        help="peak RSS instead: each variant in its own process (a warm-up step and --steps more)")
    parser.add_argument("--rounds", type=int, default=2, help="steps per variant in the CPU-time comparison")
    parser.add_argument("--steps", type=int, default=1, help="steps after the warm-up in a --memory process")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(peak_memory(args.child, args.steps, args.threads)))
        return
    if not args.memory:
        results = time_variants(args.variants, args.rounds, args.threads)
    else:
        results = []
        for name in args.variants:
            command = [str(OURS_PYTHON), str(HERE / "real_levers.py"), "--child", name, "--steps", str(args.steps),
                       "--threads", str(args.threads)]
            completed = subprocess.run(command, cwd=HERE, capture_output=True, text=True)
            if completed.returncode != 0:
                raise RuntimeError(f"variant {name} failed:\n{completed.stderr[-3000:]}")
            line = next(line for line in completed.stdout.splitlines() if line.startswith("RESULT "))
            results.append(json.loads(line[len("RESULT "):]))
            print(f"{name}: peak RSS {results[-1]['peak_rss_mb']:.0f} MiB", flush=True)
    print()
    print(table(results))
    output = args.output or HERE / "runs" / ("real_levers_memory.json" if args.memory else "real_levers.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
