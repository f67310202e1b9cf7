"""The writing task's reward terms on hand-computed strings, its formatters and its bundled passages."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comlrl.tasks.writing import (
    FORMATTERS, WritingTargets, band, coordination_term, expansion_prompt, jaccard, structure_term, style_term,
    summary_prompt, transitions_used, unique_ratio, vocabulary_term, words, writing_reward, writing_terms,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "writing"
SUMMARY = "The library fixes lamps and bikes every Saturday."  # 8 words, all distinct
# 20 words, 19 distinct ("the" twice); transitions "however" and "also"; 6 words shared with SUMMARY
EXPANSION = ("However the library also fixes old lamps and broken bikes for neighbours who wait with tea "
             "in the quiet hall")


def test_words_are_lowercased_runs_of_letters_digits_and_apostrophes():
    assert words("Don't stop, the 2 CATS!") == ["don't", "stop", "the", "2", "cats"]
    assert words("  ...  ") == []


def test_band_levels():
    assert [band(v, 5, 20) for v in (0, 2.5, 5, 12, 20, 30, 40, 50)] == [0.0, 0.5, 1.0, 1.0, 1.0, 0.5, 0.0, 0.0]


def test_unique_ratio_and_jaccard():
    assert unique_ratio(["a", "b", "a", "c"]) == 0.75
    assert unique_ratio([]) == 0.0
    assert jaccard(["a", "b"], ["b", "c", "c"]) == pytest.approx(1 / 3)
    assert jaccard([], []) == 0.0


def test_transitions_match_whole_words_and_phrases():
    assert transitions_used(words("However, the dog ran; for example, home.")) == {"however", "for example"}
    assert transitions_used(words("an example of thusly alsoing")) == set()
    assert transitions_used(words("as a result it rained")) == {"as a result"}


def test_terms_of_a_good_pair_by_hand():
    first, second = words(SUMMARY), words(EXPANSION)
    assert (len(first), len(second)) == (8, 20)
    assert structure_term(first, second) == pytest.approx(0.5 * 1.0 + 0.5 * 20 / 25)  # expansion below 25 words
    assert coordination_term(first, second) == 1.0  # 20 / 8 = 2.5, inside (1.5, 4)
    assert vocabulary_term(first, second) == pytest.approx(0.5 * 1.0 + 0.5 * 19 / 20)
    assert jaccard(first, second) == pytest.approx(6 / 21)  # inside (0.1, 0.4)
    assert style_term(first, second) == 1.0  # two transitions, overlap in band
    terms = writing_terms(SUMMARY, EXPANSION)
    assert terms["reward"] == pytest.approx((0.9 + 1.0 + 0.975 + 1.0) / 4)
    assert writing_reward([SUMMARY], [EXPANSION]) == [pytest.approx(0.96875)]


def test_terms_of_a_poor_pair_by_hand():
    terms = writing_terms("", "tea tea tea")
    assert terms == pytest.approx({
        "structure": 0.5 * 0.0 + 0.5 * 3 / 25,
        "coordination": 0.0,  # empty summary
        "vocabulary": 0.5 * 0.0 + 0.5 * 1 / 3,
        "style": 0.0,  # no transitions; no overlap with an empty summary
        "reward": (0.06 + 1 / 6) / 4,
    })


def test_roles_are_not_interchangeable_and_copying_costs_overlap():
    assert writing_reward([EXPANSION], [SUMMARY])[0] < writing_reward([SUMMARY], [EXPANSION])[0]
    copied = words(SUMMARY)
    assert style_term(copied, copied) == 0.0  # Jaccard 1 is past 2 x 0.4, and no transitions


def test_one_reward_per_pair():
    assert len(writing_reward([SUMMARY, "", "x"], [EXPANSION, "y", ""], batch_items=[{}, {}, {}])) == 3


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=300), st.text(max_size=300))
def test_every_term_and_the_reward_lie_in_zero_one(summary, expansion):
    for name, value in writing_terms(summary, expansion).items():
        assert 0.0 <= value <= 1.0, name


def test_targets_are_checked():
    with pytest.raises(ValueError, match=r"WritingTargets.length_ratio must be \(low, high\) with 0 < low <= high, got \(4, 2\)"):
        WritingTargets(length_ratio=(4, 2))
    with pytest.raises(ValueError, match="WritingTargets.transitions must be at least 1, got 0"):
        WritingTargets(transitions=0)
    tight = WritingTargets(expansion_words=(10, 20))
    assert structure_term(words(SUMMARY), words(EXPANSION), tight) == 1.0


def test_formatters_write_each_role_in_chatml():
    row = {"passage": "A bridge closes for repairs."}
    for formatter, instruction in zip(FORMATTERS, ("Summarise", "Retell")):
        prompt = formatter(row)
        assert prompt.startswith("<|im_start|>user\n" + instruction)
        assert prompt.endswith("A bridge closes for repairs.<|im_end|>\n<|im_start|>assistant\n")
    assert summary_prompt(row) != expansion_prompt(row)
    with pytest.raises(KeyError):
        summary_prompt({"prompt": "no passage"})


def test_bundled_passages_split_into_train_and_eval():
    splits = {name: [json.loads(line) for line in (DATA / f"{name}.jsonl").read_text().splitlines()]
              for name in ("train", "eval")}
    assert (len(splits["train"]), len(splits["eval"])) == (32, 8)
    ids = [row["id"] for rows in splits.values() for row in rows]
    assert len(set(ids)) == 40  # no passage in both splits
    for rows in splits.values():
        for row in rows:
            assert set(row) == {"id", "passage"}
            assert 30 <= len(words(row["passage"])) <= 60, row["id"]
