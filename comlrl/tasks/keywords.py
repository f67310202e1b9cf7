"""A toy cooperative task with a salient signal: agent 0 should say "yes", agent 1 "tree".

The joint reward is half a point for each agent whose completion contains its keyword.
Both words are among the tiny tokenizer's merges, so randomly initialised tiny models emit
them now and then: dense enough for preference pairs, and a feature a tiny reward model can
learn, which makes it the end-to-end check of preference-based training.
"""

from __future__ import annotations

from typing import Sequence

KEYWORDS = ("yes", "tree")


def keywords_reward(completions_0: Sequence[str], completions_1: Sequence[str]) -> list[float]:
    return [0.5 * (KEYWORDS[0] in first) + 0.5 * (KEYWORDS[1] in second) for first, second in zip(completions_0, completions_1)]
