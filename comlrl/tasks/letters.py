"""The bundled toy cooperative task: two agents paid jointly for their letters.

Each row names a letter per agent (``letter_0``, ``letter_1``); the joint reward is the mean
share of each agent's assigned letter in its completion, so neither agent can earn the
team's reward alone. Tiny randomly initialised models learn it within a minute on a CPU,
which makes it a visible end-to-end check of the whole training path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

SUBJECTS = "cat dog sun moon tree river hill road book letter idea team".split()
FORMS = ["write a story about the {}", "tell me about the {}", "describe the {} to a friend", "a short note on the {}"]


def letter_share(text: str, letter: str) -> float:
    """Fraction of the characters of ``text`` that are ``letter`` (0 for empty text)."""
    return text.count(letter) / len(text) if text else 0.0


def letters_reward(
    completions_0: Sequence[str],
    completions_1: Sequence[str],
    batch_items: Sequence[dict[str, Any]] | None = None,
) -> list[float]:
    """Joint reward: mean of agent 0's share of ``letter_0`` and agent 1's share of ``letter_1``."""
    rewards = []
    for index, (first, second) in enumerate(zip(completions_0, completions_1)):
        row = batch_items[index] if batch_items else {}
        rewards.append(0.5 * letter_share(first, row.get("letter_0", "e")) + 0.5 * letter_share(second, row.get("letter_1", "o")))
    return rewards


def rows(num_rows: int) -> list[dict[str, str]]:
    prompts = [form.format(subject) for subject in SUBJECTS for form in FORMS]
    return [{"prompt": prompts[i % len(prompts)], "letter_0": "e", "letter_1": "o"} for i in range(num_rows)]


def write_dataset(directory: str | Path, num_train: int = 32, num_eval: int = 8, demo_passes: int = 8) -> dict[str, Path]:
    """Write ``train.parquet`` and ``eval.parquet`` under ``directory``, and ``demo_train.parquet``: the
    training rows ``demo_passes`` times over (the demo's epoch, so that an epoch trains for seconds, not
    the under-a-second of 16 steps that per-epoch orchestration would dominate; docs/pipeline.md)."""
    from datasets import Dataset

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    all_rows = rows(num_train + num_eval)
    paths = {"train": directory / "train.parquet", "eval": directory / "eval.parquet",
             "demo_train": directory / "demo_train.parquet"}
    Dataset.from_list(all_rows[:num_train]).to_parquet(str(paths["train"]))
    Dataset.from_list(all_rows[num_train:]).to_parquet(str(paths["eval"]))
    Dataset.from_list(all_rows[:num_train] * demo_passes).to_parquet(str(paths["demo_train"]))
    return paths
