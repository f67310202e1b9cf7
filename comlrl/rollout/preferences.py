"""Preference pairs: labelling joint samples by task reward, and storing them as Parquet.

A pair compares two joint responses (one completion per agent) to the same prompt; the one
with the higher task reward is ``chosen``. Pairs whose rewards differ by no more than the
tie margin are dropped. Pairs live in a ``datasets.Dataset`` with the columns of
:data:`PAIR_COLUMNS`, written to ``pairs.parquet`` so a run is inspectable and resumable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from datasets import Dataset, concatenate_datasets

PAIR_COLUMNS = ("iteration", "row_index", "prompt", "chosen", "rejected", "chosen_reward", "rejected_reward")


def ranked_pairs(rewards: torch.Tensor, tie_margin: float = 0.0, max_pairs: int | None = None) -> list[tuple[int, int]]:
    """``(chosen, rejected)`` index pairs among one group's rewards, widest margin first.

    Every pair with ``r_chosen - r_rejected > tie_margin`` qualifies; ``max_pairs`` keeps the
    widest ones (ties in margin broken by index, so the result is deterministic).
    """
    values = rewards.tolist()
    candidates = []
    for i in range(len(values)):
        for j in range(len(values)):
            margin = values[i] - values[j]
            if margin > tie_margin:
                candidates.append((-margin, i, j))
    candidates.sort()
    if max_pairs is not None:
        candidates = candidates[:max_pairs]
    return [(i, j) for _, i, j in candidates]


def agent_tag(index: int) -> str:
    """The marker that opens agent ``index``'s part of a joint response."""
    return f"\n[agent {index}]"


def joint_input_sections(prompt: str, completions: Sequence[str]) -> list[str]:
    """A joint response as sections: ``[prompt, tag_0, completion_0, tag_1, completion_1, ...]``.

    Each completion section carries its leading space; the sections joined are
    :func:`joint_input_text`. The reward model tokenizes and truncates them section by section.
    """
    sections = [prompt]
    for index, completion in enumerate(completions):
        sections += [agent_tag(index), f" {completion}"]
    return sections


def joint_input_text(prompt: str, completions: Sequence[str]) -> str:
    """How the joint reward model reads a joint response, as one text (for display and logs)."""
    return "".join(joint_input_sections(prompt, completions))


def label_pairs(
    prompts: Sequence[str],
    row_indices: Sequence[int],
    joint_completions: Sequence[Sequence[str]],
    rewards: torch.Tensor,
    iteration: int,
    tie_margin: float = 0.0,
    max_pairs_per_prompt: int | None = None,
) -> list[dict[str, Any]]:
    """Pairs from scored joint samples.

    ``joint_completions[agent][node * num_joint + j]`` (as from ``Rollout.joint_completions``)
    and ``rewards`` of shape ``[num_nodes, num_joint]``; one node per prompt.
    """
    num_nodes, num_joint = rewards.shape
    num_agents = len(joint_completions)
    records = []
    for node in range(num_nodes):
        for chosen, rejected in ranked_pairs(rewards[node], tie_margin, max_pairs_per_prompt):
            flat_chosen, flat_rejected = node * num_joint + chosen, node * num_joint + rejected
            records.append(
                {
                    "iteration": iteration,
                    "row_index": int(row_indices[node]),
                    "prompt": prompts[node],
                    "chosen": [joint_completions[a][flat_chosen] for a in range(num_agents)],
                    "rejected": [joint_completions[a][flat_rejected] for a in range(num_agents)],
                    "chosen_reward": float(rewards[node, chosen]),
                    "rejected_reward": float(rewards[node, rejected]),
                }
            )
    return records


def pairs_dataset(records: list[dict[str, Any]]) -> Dataset:
    if not records:
        return Dataset.from_dict({column: [] for column in PAIR_COLUMNS})
    return Dataset.from_list(records)


def pool(datasets: Sequence[Dataset]) -> Dataset:
    non_empty = [d for d in datasets if len(d)]
    return concatenate_datasets(non_empty) if non_empty else pairs_dataset([])


def save_pairs(pairs: Dataset, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pairs.to_parquet(str(path))
    return path


def load_pairs(path: str | Path) -> Dataset:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no preference pairs at {str(path)!r}")
    return Dataset.from_parquet(str(path))


def split_heldout(num_pairs: int, heldout_fraction: float, seed: int,
                  groups: Sequence[Any] | None = None) -> tuple[list[int], list[int]]:
    """Seeded split of pair indices into (train, held-out); at least one train pair when any exist.

    With ``groups`` (each pair's ``row_index``) whole prompts are held out: the pairs of one prompt
    are built from the same few joint completions, so a pair-level split would score held-out pairs
    on completions the model was trained on and report memorisation as accuracy.
    """
    keys = list(dict.fromkeys(groups)) if groups is not None else list(range(num_pairs))
    order = torch.randperm(len(keys), generator=torch.Generator().manual_seed(seed)).tolist()
    count = min(int(round(len(keys) * heldout_fraction)), max(len(keys) - 1, 0))
    held = {keys[i] for i in order[:count]}
    members = groups if groups is not None else range(num_pairs)
    return ([i for i, key in enumerate(members) if key not in held],
            [i for i, key in enumerate(members) if key in held])
