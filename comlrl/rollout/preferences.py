"""Preference pairs: building them from scored joint candidates, selecting them, storing them as Parquet.

A pair compares two joint responses (one completion per agent) to the same prompt; the one
with the higher task reward is ``chosen``. Pairs whose rewards differ by no more than the
tie margin are dropped. Candidates come from one side (the policy's own samples, compared
among themselves) or two (the policy against a comparator: only pairs across the sides).
Pairs live in a ``datasets.Dataset`` with the columns of :data:`PAIR_COLUMNS`, written to
``pairs.parquet`` so a run is inspectable and resumable; each agent's prompt and token IDs
travel with the texts, so a DPO step trains on exactly the tokens that were sampled.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from datasets import Dataset, concatenate_datasets

from comlrl.tokenizers import decode_rows
from comlrl.rollout.generation import Generation, encode_prompts

PAIR_COLUMNS = ("iteration", "row_index", "prompt", "agent_prompts", "chosen", "rejected", "chosen_ids",
                "rejected_ids", "chosen_reward", "rejected_reward", "chosen_source", "rejected_source")
SIDES = ("policy", "comparator")
PAIR_SELECTIONS = ("reward_gap", "random", "all", "comparator_reward")


@dataclass(frozen=True)
class CandidatePair:
    """Candidate ``chosen`` beats candidate ``rejected`` by ``margin`` (> the tie margin)."""

    chosen: int
    rejected: int
    margin: float


def ordered_pairs(rewards: Sequence[float] | torch.Tensor, tie_margin: float = 0.0,
                  sides: Sequence[int] | None = None) -> list[CandidatePair]:
    """Every ordered pair ``(i, j)`` with ``r_i - r_j > tie_margin``, in index order.

    With ``sides`` (one label per candidate) only pairs across two sides qualify: the policy's
    candidates against a comparator's, never two of the same side.
    """
    values = rewards.tolist() if isinstance(rewards, torch.Tensor) else [float(r) for r in rewards]
    if sides is not None and len(sides) != len(values):
        raise ValueError(f"{len(sides)} side labels for {len(values)} candidates")
    return [CandidatePair(i, j, values[i] - values[j])
            for i in range(len(values)) for j in range(len(values))
            if values[i] - values[j] > tie_margin and (sides is None or sides[i] != sides[j])]


def select_pairs(pairs: Sequence[CandidatePair], mode: str = "reward_gap", max_pairs: int | None = None,
                 generator: torch.Generator | None = None, rewards: Sequence[float] | None = None,
                 sides: Sequence[int] | None = None) -> list[CandidatePair]:
    """The pairs of one prompt that are kept, at most ``max_pairs``.

    ``reward_gap``: widest margin first (ties in margin by index); ``random``: a uniform draw from
    ``generator``; ``all``: every pair in index order (``max_pairs`` must be None);
    ``comparator_reward``: pairs whose comparator-side candidate (side 1, or the rejected one
    without sides) scored highest first, then widest margin, which needs ``rewards``.
    """
    if mode not in PAIR_SELECTIONS:
        raise ValueError(f"pair selection must be one of {list(PAIR_SELECTIONS)}, got {mode!r}")
    if mode == "all":
        if max_pairs is not None:
            raise ValueError(f"pair selection 'all' keeps every pair; got max_pairs={max_pairs} (give None)")
        return list(pairs)
    if mode == "random":
        order = torch.randperm(len(pairs), generator=generator).tolist() if pairs else []
        chosen = [pairs[i] for i in order]
    elif mode == "comparator_reward":
        if rewards is None:
            raise ValueError("pair selection 'comparator_reward' needs the candidates' rewards")

        def comparator_side(pair: CandidatePair) -> int:
            if sides is not None and sides[pair.chosen] == 1:
                return pair.chosen
            return pair.rejected

        chosen = sorted(pairs, key=lambda p: (-float(rewards[comparator_side(p)]), -p.margin, p.chosen, p.rejected))
    else:
        chosen = sorted(pairs, key=lambda p: (-p.margin, p.chosen, p.rejected))
    return chosen if max_pairs is None else chosen[:max_pairs]


def ranked_pairs(rewards: torch.Tensor, tie_margin: float = 0.0, max_pairs: int | None = None) -> list[tuple[int, int]]:
    """``(chosen, rejected)`` index pairs among one group's rewards, widest margin first (``reward_gap``)."""
    kept = select_pairs(ordered_pairs(rewards, tie_margin), "reward_gap", max_pairs)
    return [(pair.chosen, pair.rejected) for pair in kept]


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


@dataclass
class Candidates:
    """The joint candidates of one prompt: per candidate, every agent's completion (text and token IDs),
    the joint reward and the side it came from (0 the policy, 1 a comparator)."""

    texts: list[list[str]]
    token_ids: list[list[list[int]]]
    rewards: list[float]
    sides: list[int]

    def extend(self, other: "Candidates") -> "Candidates":
        return Candidates(self.texts + other.texts, self.token_ids + other.token_ids,
                          self.rewards + other.rewards, self.sides + other.sides)


def pair_records(candidates: Candidates, pairs: Sequence[CandidatePair], *, iteration: int, row_index: int,
                 prompt: str, agent_prompts: Sequence[str]) -> list[dict[str, Any]]:
    """One record (a row of :data:`PAIR_COLUMNS`) per pair of one prompt's candidates."""
    return [
        {
            "iteration": iteration,
            "row_index": int(row_index),
            "prompt": prompt,
            "agent_prompts": list(agent_prompts),
            "chosen": list(candidates.texts[pair.chosen]),
            "rejected": list(candidates.texts[pair.rejected]),
            "chosen_ids": [list(ids) for ids in candidates.token_ids[pair.chosen]],
            "rejected_ids": [list(ids) for ids in candidates.token_ids[pair.rejected]],
            "chosen_reward": float(candidates.rewards[pair.chosen]),
            "rejected_reward": float(candidates.rewards[pair.rejected]),
            "chosen_source": SIDES[candidates.sides[pair.chosen]],
            "rejected_source": SIDES[candidates.sides[pair.rejected]],
        }
        for pair in pairs
    ]


def generation_rows(generation: Generation, rows: Sequence[int]) -> Generation:
    """The given rows of a generation (for a DPO step: the chosen rows, then the rejected ones)."""
    index = torch.tensor(list(rows), dtype=torch.long, device=generation.completion_ids.device)
    return Generation(
        prompt_ids=generation.prompt_ids.index_select(0, index.to(generation.prompt_ids.device)),
        prompt_mask=generation.prompt_mask.index_select(0, index.to(generation.prompt_mask.device)),
        completion_ids=generation.completion_ids.index_select(0, index),
        completion_mask=generation.completion_mask.index_select(0, index.to(generation.completion_mask.device)),
        texts=[generation.texts[i] for i in rows],
        num_generations=1,
    )


def pair_generation(tokenizer: Any, prompts: Sequence[str], chosen_ids: Sequence[Sequence[int]],
                    rejected_ids: Sequence[Sequence[int]], device: torch.device, max_prompt_length: int | None = None,
                    prompt_overflow: str = "truncate") -> Generation:
    """One agent's side of a batch of stored pairs as a :class:`Generation`: rows ``0..P-1`` the chosen
    completions, ``P..2P-1`` the rejected ones, each after its prompt (encoded as sampling encodes it)."""
    prompt_ids, prompt_mask = encode_prompts(tokenizer, list(prompts) * 2, device, max_prompt_length, prompt_overflow)
    completions = [list(ids) for ids in chosen_ids] + [list(ids) for ids in rejected_ids]
    width = max([len(ids) for ids in completions] + [1])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    completion_ids = torch.full((len(completions), width), pad, dtype=torch.long)
    mask = torch.zeros((len(completions), width), dtype=torch.long)
    for row, ids in enumerate(completions):
        completion_ids[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask[row, :len(ids)] = 1
    texts = decode_rows(tokenizer, completion_ids)
    return Generation(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids.to(device),
                      completion_mask=mask.to(device), texts=texts, num_generations=1)


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
