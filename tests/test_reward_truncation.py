"""Truncation of joint responses for the joint reward model: every agent keeps a share."""

import logging

import pytest
import torch

from comlrl.rollout import preferences
from comlrl.models.reward_model import (
    JointRewardModel,
    fair_shares,
    joint_token_budget,
    pad_rows,
    truncate_joint_ids,
)
from comlrl.tiny import save_tiny_model
from comlrl.training.reward_fit import fit_reward_model

PROMPT = "tell me about the cat and the dog and the sun and the moon"
LONG = "the sun one two three four five red green blue tree river hill road book"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("rm") / "tiny-llama", "llama", vocab_size=96, seed=0))


def load(model_dir: str, max_length: int | None) -> JointRewardModel:
    torch.manual_seed(0)
    return JointRewardModel.load(model_dir, torch.device("cpu"), torch.float32, max_length=max_length)


def tag_length(model: JointRewardModel) -> int:
    return len(model.tokenizer(preferences.agent_tag(0), add_special_tokens=False)["input_ids"])


def test_fair_shares_by_hand():
    assert fair_shares([3, 8, 20], 14) == [3, 6, 5]  # 3 fits its share of 4; 11 left -> 5 + 5, remainder to agent 1
    assert fair_shares([10, 10], 11) == [6, 5]
    assert fair_shares([2, 3], 10) == [2, 3]
    assert fair_shares([5, 5, 5], 0) == [0, 0, 0]
    assert fair_shares([], 7) == []


def test_joint_token_budget_by_hand():
    # Fits: nothing is cut; no limit: nothing is cut.
    assert joint_token_budget(4, [2, 2], [3, 3], 14) == (4, [3, 3])
    assert joint_token_budget(400, [2, 2], [300, 300], None) == (400, [300, 300])
    # room = 24 - 6 = 18; prompt floor 18 // 4 = 4; completions share 14 -> [3, 6, 5].
    assert joint_token_budget(10, [2, 2, 2], [3, 8, 20], 24) == (4, [3, 6, 5])
    # A prompt under its floor is kept whole; the completions share the rest (13 - 2 = 11).
    assert joint_token_budget(2, [1, 1], [10, 10], 15) == (2, [6, 5])
    # Short completions are kept whole; the prompt takes what they leave (18 - 7 = 11).
    assert joint_token_budget(50, [1, 1], [3, 4], 20) == (11, [3, 4])
    with pytest.raises(ValueError, match="agent tags"):
        joint_token_budget(1, [3, 3], [1, 1], 5)


def test_truncate_keeps_prompt_end_and_completion_starts():
    sections = [[1, 2, 3, 4, 5], [90], [10, 11, 12, 13], [91], [20, 21, 22, 23]]
    # room = 9 - 2 = 7; floor 7 // 3 = 2 -> prompt keeps [4, 5]; completions share 5 -> [3, 2].
    assert truncate_joint_ids(sections, 9) == [4, 5, 90, 10, 11, 12, 91, 20, 21]
    assert truncate_joint_ids(sections, None) == [t for s in sections for t in s]


def test_pad_rows_sides():
    ids, mask = pad_rows([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    ids, mask = pad_rows([[5, 6, 7], [8]], pad_id=0, side="left")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_last_agent_difference_survives_truncation(model_dir):
    model = load(model_dir, None)
    model.max_length = 3 * tag_length(model) + 12
    first = [LONG, LONG, "the cat"]
    second = [LONG, LONG, "the dog"]
    ids, mask = model.encode_joint([PROMPT, PROMPT], [first, second])
    assert ids.shape[1] <= model.max_length
    assert not torch.equal(ids[0], ids[1])
    assert mask[0].tolist() == sorted(mask[0].tolist(), reverse=True)  # right-padded, as the tokenizer says


def test_every_agent_section_present(model_dir):
    model = load(model_dir, None)
    tags = 3 * tag_length(model)
    model.max_length = tags + 9
    ids, _ = model.encode_joint([PROMPT], [[LONG, LONG, LONG]])
    tokenize = lambda text: model.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    completion = tokenize(f" {LONG}")
    # room 9: the prompt gives way down to its floor 9 // 4 = 2; the completions share 7 -> [3, 2, 2].
    prompt_kept, kept = joint_token_budget(len(tokenize(PROMPT)), [tags // 3] * 3, [len(completion)] * 3, model.max_length)
    assert (prompt_kept, kept) == (2, [3, 2, 2])
    expected = tokenize(PROMPT)[-2:]
    for index, length in enumerate(kept):
        expected += tokenize(preferences.agent_tag(index)) + completion[:length]
    assert ids[0].tolist() == expected


def test_identical_pairs_warned_and_counted(model_dir, caplog):
    model = load(model_dir, None)
    model.max_length = 2 * tag_length(model) + 8
    records = [
        {"iteration": 0, "row_index": 0, "prompt": PROMPT, "chosen": [LONG + " cat", "one"],
         "rejected": [LONG + " dog", "one"], "chosen_reward": 1.0, "rejected_reward": 0.0},  # differ past the budget
        {"iteration": 0, "row_index": 1, "prompt": PROMPT, "chosen": ["one", "the cat"],
         "rejected": ["one", "the dog"], "chosen_reward": 1.0, "rejected_reward": 0.0},
    ]
    pairs = preferences.pairs_dataset(records)
    with caplog.at_level(logging.WARNING, logger="comlrl.models.reward_model"):
        result = fit_reward_model(model, pairs, [0, 1], [], epochs=1, batch_size=2, learning_rate=1e-3, seed=0)
    assert result.identical_pairs == 1
    assert result.metrics()["reward_model/identical_pairs"] == 1.0
    assert any("1 of 2 preference pairs" in record.getMessage() for record in caplog.records)


def test_load_with_max_length_scores_a_batch(model_dir):
    model = load(model_dir, None)
    max_length = 2 * tag_length(model) + 6
    model = JointRewardModel.load(model_dir, torch.device("cpu"), torch.float32, max_length=max_length)
    scores = model.score([PROMPT, "the cat"], [[LONG, "a"], ["b", LONG]])
    assert scores.shape == (2,) and torch.isfinite(scores).all()
    ids, mask = model.encode_joint([PROMPT, "the cat"], [[LONG, "a"], ["b", LONG]])
    assert ids.shape[1] <= max_length and mask.sum(dim=1).max() <= max_length
