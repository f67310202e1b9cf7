"""Writing collaboration in miniature: agent 0 summarises a passage, agent 1 expands it.

The task of the MAGRPO paper's summarisation experiment (Liu et al., "LLM Collaboration With
Multi-Agent Reinforcement Learning", AAAI 2026), written for this project from its description:
the two agents see the same source passage (``data/writing/*.jsonl``, short passages written for
this project), one writes a concise summary and the other a longer expansion with more detail and
vocabulary, and they are paid jointly for how well the two texts fit together.

The joint reward is the mean of four level terms, each in [0, 1] (so is the reward):

1. **structure** — each text's length in words sits inside its agent's limits
   (:attr:`WritingTargets.summary_words`, :attr:`WritingTargets.expansion_words`): the mean of
   the two :func:`band` scores.
2. **coordination** — the expansion is longer than the summary by a ratio inside
   :attr:`WritingTargets.length_ratio`: :func:`band` of ``expansion words / summary words``
   (0 when the summary is empty).
3. **vocabulary** — each text's diversity, its unique-word ratio (distinct words / words; 0 for
   an empty text): the mean over the two texts. Repetition loops score low.
4. **style** — the mean of the expansion's transition-word coverage (distinct entries of
   :data:`TRANSITIONS` it uses, over :attr:`WritingTargets.transitions`, capped at 1) and the
   :func:`band` score of the Jaccard overlap of the two texts' word sets inside
   :attr:`WritingTargets.overlap` (the expansion should build on the summary, not copy it nor
   drift off topic).

Words are the lower-cased runs of letters, digits and apostrophes (:func:`words`), so the reward
does not depend on a tokenizer. :func:`band` is the level shape every range uses: full credit
inside ``[low, high]``, proportional credit below (``value / low``), and credit falling linearly
to 0 at ``2 * high`` above. The formatters :func:`summary_prompt` and :func:`expansion_prompt` write
the two roles' prompts in the ChatML format of SmolLM2's chat template.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from comlrl.tasks.chat import chat_prompt

WORD = re.compile(r"[a-z0-9']+")
# Connectives that make an expansion read as connected prose; multi-word entries match as phrases.
TRANSITIONS = (
    "however", "moreover", "furthermore", "additionally", "also", "meanwhile", "therefore", "thus",
    "because", "although", "while", "then", "finally", "first", "instead", "similarly", "later",
    "for example", "for instance", "in addition", "as a result", "in fact", "as well", "so that",
)


@dataclass(frozen=True)
class WritingTargets:
    """The ranges the reward's terms aim at (defaults sized for completions of about 48 tokens)."""

    summary_words: tuple[float, float] = (5, 20)
    expansion_words: tuple[float, float] = (25, 80)
    length_ratio: tuple[float, float] = (1.5, 4.0)
    overlap: tuple[float, float] = (0.1, 0.4)
    transitions: int = 2

    def __post_init__(self) -> None:
        for name in ("summary_words", "expansion_words", "length_ratio", "overlap"):
            low, high = getattr(self, name)
            if not 0 < low <= high:
                raise ValueError(f"WritingTargets.{name} must be (low, high) with 0 < low <= high, got {(low, high)}")
        if self.transitions < 1:
            raise ValueError(f"WritingTargets.transitions must be at least 1, got {self.transitions}")


DEFAULT_TARGETS = WritingTargets()


def words(text: str) -> list[str]:
    """The text's words: lower-cased runs of letters, digits and apostrophes."""
    return WORD.findall(text.lower())


def band(value: float, low: float, high: float) -> float:
    """Level score in [0, 1]: 1 inside ``[low, high]``, ``value / low`` below, ``2 - value / high`` above (floored at 0)."""
    if value < low:
        return max(value, 0.0) / low
    if value <= high:
        return 1.0
    return max(0.0, 2.0 - value / high)


def unique_ratio(tokens: Sequence[str]) -> float:
    """Distinct words over words, in [0, 1]; 0 for no words."""
    return len(set(tokens)) / len(tokens) if tokens else 0.0


def jaccard(first: Sequence[str], second: Sequence[str]) -> float:
    """Jaccard overlap of two word sets, in [0, 1]; 0 when both are empty."""
    a, b = set(first), set(second)
    return len(a & b) / len(a | b) if a | b else 0.0


def transitions_used(tokens: Sequence[str]) -> set[str]:
    """The entries of :data:`TRANSITIONS` that occur in ``tokens`` (phrases as consecutive words)."""
    padded = " " + " ".join(tokens) + " "
    return {phrase for phrase in TRANSITIONS if f" {phrase} " in padded}


def structure_term(summary: Sequence[str], expansion: Sequence[str], targets: WritingTargets = DEFAULT_TARGETS) -> float:
    """Level 1: each agent's length inside its limits (mean of two band scores), in [0, 1]."""
    return 0.5 * band(len(summary), *targets.summary_words) + 0.5 * band(len(expansion), *targets.expansion_words)


def coordination_term(summary: Sequence[str], expansion: Sequence[str], targets: WritingTargets = DEFAULT_TARGETS) -> float:
    """Level 2: the expansion/summary length ratio inside ``length_ratio``, in [0, 1]; 0 for an empty summary."""
    if not summary:
        return 0.0
    return band(len(expansion) / len(summary), *targets.length_ratio)


def vocabulary_term(summary: Sequence[str], expansion: Sequence[str]) -> float:
    """Level 3: mean unique-word ratio of the two texts, in [0, 1]."""
    return 0.5 * unique_ratio(summary) + 0.5 * unique_ratio(expansion)


def style_term(summary: Sequence[str], expansion: Sequence[str], targets: WritingTargets = DEFAULT_TARGETS) -> float:
    """Level 4: mean of the expansion's transition coverage and the overlap band score, in [0, 1]."""
    coverage = min(1.0, len(transitions_used(expansion)) / targets.transitions)
    overlap = band(jaccard(summary, expansion), *targets.overlap) if summary and expansion else 0.0
    return 0.5 * coverage + 0.5 * overlap


def writing_terms(summary: str, expansion: str, targets: WritingTargets = DEFAULT_TARGETS) -> dict[str, float]:
    """The four level terms of one joint sample and their mean, the ``reward``."""
    first, second = words(summary), words(expansion)
    terms = {
        "structure": structure_term(first, second, targets),
        "coordination": coordination_term(first, second, targets),
        "vocabulary": vocabulary_term(first, second),
        "style": style_term(first, second, targets),
    }
    terms["reward"] = sum(terms.values()) / 4
    return terms


def writing_reward(
    completions_0: Sequence[str],
    completions_1: Sequence[str],
    batch_items: Sequence[Mapping[str, Any]] | None = None,
) -> list[float]:
    """Joint reward of summaries (agent 0) and expansions (agent 1), one number in [0, 1] per pair."""
    return [writing_terms(summary, expansion)["reward"] for summary, expansion in zip(completions_0, completions_1)]


SUMMARY_INSTRUCTION = "Summarise this passage in one short sentence."
EXPANSION_INSTRUCTION = "Retell this passage at greater length, adding vivid detail and varied vocabulary."


def summary_prompt(item: Mapping[str, Any]) -> str:
    """Agent 0's prompt: a one-sentence summary of the row's ``passage``."""
    return chat_prompt(SUMMARY_INSTRUCTION, item["passage"])


def expansion_prompt(item: Mapping[str, Any]) -> str:
    """Agent 1's prompt: a longer retelling of the row's ``passage`` with more detail and vocabulary."""
    return chat_prompt(EXPANSION_INSTRUCTION, item["passage"])


FORMATTERS = (summary_prompt, expansion_prompt)
