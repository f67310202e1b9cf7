"""The algorithm-family benchmark's shared workload: settings, rows, reward, adapter, evaluation.

Both family runners import this module: ours (the project's .venv) and the reference comlrl 1.4.3
(benchmarks/.venv-peers). Like ``workload.py`` it imports neither library, so the rows, the
letters reward, the centralized prompt/parse format and the evaluation are the same code on both
sides, and only the trainer under test differs.
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

from workload import FORMS, SUBJECTS, Workload, letter_share

ALGORITHMS = ("mareinforce", "maremax", "marloo", "madpo", "magrpo_centralized")
ADVANTAGE_MODES = {"mareinforce": "raw", "maremax": "max", "marloo": "rloo"}
SEPARATOR = "x"  # the tiny tokenizer spells only a-z: the centralized format splits the roles at the first "x"
PROMPTS = [form.format(subject) for subject in SUBJECTS for form in FORMS]


def train_rows(count: int) -> list[dict[str, str]]:
    """The letters task's rows (``comlrl.tasks.letters.rows``'s layout): one prompt per step."""
    return [{"prompt": PROMPTS[i % len(PROMPTS)], "letter_0": "e", "letter_1": "o"} for i in range(count)]


def eval_rows(count: int) -> list[dict[str, str]]:
    """Held-out rows: the last ``count`` prompts, never among the first training steps'."""
    return [{"prompt": prompt, "letter_0": "e", "letter_1": "o"} for prompt in PROMPTS[-count:]]


def letters_reward(completions_0: Sequence[str], completions_1: Sequence[str],
                   batch_items: Sequence[dict[str, Any]] | None = None) -> list[float]:
    """The letters task's joint reward (the logic of ``comlrl.tasks.letters.letters_reward``, for the reference side)."""
    rewards = []
    for index, (first, second) in enumerate(zip(completions_0, completions_1)):
        row = batch_items[index] if batch_items else {}
        rewards.append(0.5 * letter_share(first, row.get("letter_0", "e")) + 0.5 * letter_share(second, row.get("letter_1", "o")))
    return rewards


class SeparatedAdapter:
    """Centralized format in comlrl 1.4.3's adapter interface; both libraries accept it as is.

    The joint prompt joins the roles' prompts; a completion's text before the first
    :data:`SEPARATOR` is role 0's response and the rest role 1's. It never raises, so the two
    libraries' different handling of parse errors plays no part.
    """

    def build_prompt(self, batch_item: dict[str, Any], agent_prompts: Sequence[str]) -> str:
        return " then ".join(agent_prompts)

    def parse_completion(self, completion: str, batch_item: Any = None, num_agents: int = 2) -> list[str]:
        first, _, rest = completion.partition(SEPARATOR)
        return [first.strip(), rest.strip()][:num_agents]


def evaluate(models: Sequence[Any], tokenizers: Sequence[Any], rows: list[dict[str, str]], samples: int,
             max_new_tokens: int, seed: int, centralized: bool = False) -> float:
    """Mean letters reward over ``rows`` x ``samples`` sampled joint responses (temperature 1, seeded).

    The same function scores both libraries' models (plain ``model.generate``), so the eval
    reward does not depend on either library's evaluation code; the RNG is forked, so it does
    not change the training's samples.
    """
    import torch

    rewards: list[float] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for row in rows:
            if centralized:
                adapter = SeparatedAdapter()
                joint = sample(models[0], tokenizers[0], adapter.build_prompt(row, [row["prompt"]] * 2), samples, max_new_tokens)
                roles = [adapter.parse_completion(text) for text in joint]
                per_agent = [[r[0] for r in roles], [r[1] for r in roles]]
            else:
                per_agent = [sample(model, tokenizer, row["prompt"], samples, max_new_tokens)
                             for model, tokenizer in zip(models, tokenizers)]
            rewards.extend(letters_reward(*per_agent, batch_items=[row] * samples))
    return sum(rewards) / len(rewards)


def sample(model: Any, tokenizer: Any, prompt: str, samples: int, max_new_tokens: int) -> list[str]:
    import torch

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    encoded = tokenizer(prompt, return_tensors="pt").to(device)
    with torch.no_grad():
        output = model.generate(**encoded, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                max_new_tokens=max_new_tokens, num_return_sequences=samples,
                                pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    model.train(was_training)
    return tokenizer.batch_decode(output[:, encoded["input_ids"].shape[1]:], skip_special_tokens=True)


def family_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    Workload.add_arguments(parser)
    parser.add_argument("--algorithm", required=True, choices=ALGORITHMS)
    parser.add_argument("--pairs-per-prompt", type=int, default=2, help="MADPO: preference pairs kept per prompt")
    parser.add_argument("--dpo-beta", type=float, default=0.1)
    parser.add_argument("--eval-prompts", type=int, default=4, help="held-out prompts for the eval reward")
    parser.add_argument("--eval-samples", type=int, default=4, help="samples per held-out prompt")
    parser.add_argument("--output", help="write the JSON result here (default: print it)")
    return parser


def finish(result: Any, workload: Workload, before: float, after: float) -> Any:
    """Close a family run's result with the held-out reward before and after training and its step count."""
    result.finish(workload)
    result.notes.append(f"eval_reward_before={before}")
    result.notes.append(f"eval_reward_after={after}")
    result.notes.append(f"steps_run={workload.total_steps}")
    return result


def main(run: Any, description: str) -> None:
    """A family runner's command line: ``run(algorithm, workload, ...)`` and its result to ``--output``."""
    args = family_parser(description).parse_args()
    run(args.algorithm, Workload.from_arguments(args), args.eval_prompts, args.eval_samples,
        args.pairs_per_prompt, args.dpo_beta).emit(args.output)
