"""What a DPO step and the reward model read from stored preference pairs (comlrl/rollout/preferences.py),
checked against values written out by hand in each test: the rows a step selects, the tokens a stored pair
becomes, the joint text the reward model reads, and the Parquet file a run keeps."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from comlrl.rollout.generation import Generation
from comlrl.rollout.preferences import (PAIR_COLUMNS, CandidatePair, generation_rows, joint_input_sections,
                                        joint_input_text, load_pairs, ordered_pairs, pair_generation, pairs_dataset,
                                        pool, save_pairs, select_pairs, split_heldout)


def test_generation_rows_takes_the_rows_in_the_order_given():
    generation = Generation(
        prompt_ids=torch.tensor([[0, 5], [6, 7], [8, 9]]), prompt_mask=torch.tensor([[0, 1], [1, 1], [1, 1]]),
        completion_ids=torch.tensor([[1, 2, 3], [4, 5, 0], [6, 0, 0]]),
        completion_mask=torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]]),
        texts=["first", "second", "third"], num_generations=3)
    picked = generation_rows(generation, [2, 0, 2])
    assert picked.prompt_ids.tolist() == [[8, 9], [0, 5], [8, 9]]
    assert picked.prompt_mask.tolist() == [[1, 1], [0, 1], [1, 1]]
    assert picked.completion_ids.tolist() == [[6, 0, 0], [1, 2, 3], [6, 0, 0]]
    assert picked.completion_mask.tolist() == [[1, 0, 0], [1, 1, 1], [1, 0, 0]]
    assert picked.texts == ["third", "first", "third"]
    assert picked.num_generations == 1  # every selected row stands alone (a pair side), not a group


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def test_a_stored_pair_becomes_its_prompt_then_exactly_its_stored_tokens(tokenizer):
    prompts = ["the cat", "a dog and the sun"]
    chosen, rejected = [[5, 6, 7], [8]], [[9, 10], [11, 12, 13, 14]]
    pad = tokenizer.pad_token_id
    generation = pair_generation(tokenizer, prompts, chosen, rejected, torch.device("cpu"))
    # Rows 0..1 the chosen sides, 2..3 the rejected ones, right-padded to the longest (4) with the pad id.
    assert generation.completion_ids.tolist() == [[5, 6, 7, pad], [8, pad, pad, pad], [9, 10, pad, pad],
                                                  [11, 12, 13, 14]]
    assert generation.completion_mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert generation.completion_ids.dtype == generation.completion_mask.dtype == torch.long  # as sampling's
    assert generation.texts == [tokenizer.decode(ids, skip_special_tokens=True) for ids in chosen + rejected]
    assert generation.num_generations == 1
    # Each row's prompt as sampling encodes it: left-padded, no special tokens added, the prompts repeated.
    encoded = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts * 2]
    width = max(len(ids) for ids in encoded)
    assert generation.prompt_ids.tolist() == [[pad] * (width - len(ids)) + ids for ids in encoded]
    assert generation.prompt_mask.tolist() == [[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded]


def test_a_pair_of_empty_completions_is_one_masked_pad_column_and_prompts_keep_their_bound(tokenizer):
    generation = pair_generation(tokenizer, ["the cat sat on the hill"], [[]], [[]], torch.device("cpu"),
                                 max_prompt_length=2)
    assert generation.completion_ids.tolist() == [[tokenizer.pad_token_id]] * 2
    assert generation.completion_mask.tolist() == [[0], [0]]
    last_two = tokenizer("the cat sat on the hill", add_special_tokens=False)["input_ids"][-2:]
    assert generation.prompt_ids.tolist() == [last_two, last_two]  # the last tokens, as sampling keeps them
    with pytest.raises(ValueError, match="only 2 fit"):  # and the overflow setting reaches the encoder
        pair_generation(tokenizer, ["the cat sat on the hill"], [[]], [[]], torch.device("cpu"),
                        max_prompt_length=2, prompt_overflow="error")


@pytest.mark.parametrize("pad_id, padded_with", [(None, 0), (3, 3)])
def test_stored_completions_are_padded_with_the_pad_id_or_zero_without_one(tokenizer, pad_id, padded_with):
    class WithPad:
        """The tokenizer as a stored pair sees it, with another pad id (or none)."""
        pad_token_id = pad_id

        def __call__(self, *args, **kwargs):
            return tokenizer(*args, **kwargs)

        def decode(self, *args, **kwargs):
            return tokenizer.decode(*args, **kwargs)

    generation = pair_generation(WithPad(), ["the cat"], [[5, 6]], [[7]], torch.device("cpu"))
    assert generation.completion_ids.tolist() == [[5, 6], [7, padded_with]]
    assert generation.completion_mask.tolist() == [[1, 1], [1, 0]]


def test_the_joint_text_the_reward_model_reads():
    sections = joint_input_sections("Task: add", ["def f(): pass", "x = 1"])
    assert sections == ["Task: add", "\n[agent 0]", " def f(): pass", "\n[agent 1]", " x = 1"]
    assert joint_input_text("Task: add", ["def f(): pass", "x = 1"]) == (
        "Task: add\n[agent 0] def f(): pass\n[agent 1] x = 1")
    assert joint_input_text("P", []) == "P"


def test_pairs_are_kept_in_a_parquet_file_below_folders_it_creates(tmp_path):
    records = [{"iteration": 1, "row_index": 3, "prompt": "p", "agent_prompts": ["a", "b"], "chosen": ["x", "y"],
                "rejected": ["u", "v"], "chosen_ids": [[1], [2, 3]], "rejected_ids": [[4], [5]],
                "chosen_reward": 1.5, "rejected_reward": -0.5, "chosen_source": "policy",
                "rejected_source": "comparator"}]
    target = tmp_path / "run" / "iteration-1" / "pairs.parquet"  # neither folder exists yet
    assert save_pairs(pairs_dataset(records), target) == target
    assert target.read_bytes()[:4] == b"PAR1"
    assert load_pairs(str(target)).to_list() == records
    missing = tmp_path / "nowhere" / "pairs.parquet"
    with pytest.raises(FileNotFoundError, match=r"no preference pairs at '.*nowhere/pairs\.parquet'"):
        load_pairs(missing)
    with pytest.raises(FileNotFoundError, match="no preference pairs"):
        load_pairs(tmp_path)  # a folder is not a pairs file


def test_the_heldout_split_holds_out_whole_prompts_and_leaves_one_to_train_on():
    groups = ["a", "a", "b", "b", "b", "c"]  # each pair's row_index: prompt b has three pairs
    train, heldout = split_heldout(len(groups), 0.5, seed=3, groups=groups)
    held = {groups[i] for i in heldout}
    assert len(held) == 2  # round(3 prompts x 0.5) = 2 prompts, whole
    assert sorted(train + heldout) == list(range(6))
    assert heldout == [i for i, group in enumerate(groups) if group in held]
    assert not held & {groups[i] for i in train}
    pairs_train, pairs_heldout = split_heldout(6, 0.5, seed=3)  # without groups: pairs, 3 of 6
    assert len(pairs_heldout) == 3 and sorted(pairs_train + pairs_heldout) == list(range(6))
    # However large the fraction, one prompt (or pair) is left to train on; a single one is never held out.
    assert [len(part) for part in split_heldout(4, 1.0, seed=0)] == [1, 3]
    assert [len({groups[i] for i in part}) for part in split_heldout(6, 1.0, seed=0, groups=groups)] == [1, 2]
    assert split_heldout(1, 1.0, seed=0) == ([0], [])
    assert split_heldout(0, 0.5, seed=0) == ([], [])


def test_pair_selection_orders_and_refusals():
    pairs = ordered_pairs([0.0, 3.0, 1.0, 2.5], sides=[0, 1, 0, 1])  # the policy's 0 and 2 against comparator 1, 3
    assert [(p.chosen, p.rejected) for p in pairs] == [(1, 0), (1, 2), (3, 0), (3, 2)]  # across sides only
    # reward_gap (the default): widest margin first
    assert [(p.chosen, p.rejected) for p in select_pairs(pairs)] == [(1, 0), (3, 0), (1, 2), (3, 2)]
    # comparator_reward: the pairs of the best comparator candidate first (1 scored 3.0, then 3 scored 2.5),
    # each comparator's pairs by margin
    assert [(p.chosen, p.rejected) for p in select_pairs(pairs, "comparator_reward", rewards=[0.0, 3.0, 1.0, 2.5],
                                                         sides=[0, 1, 0, 1])] == [(1, 0), (1, 2), (3, 0), (3, 2)]
    assert select_pairs(pairs, max_pairs=1) == [CandidatePair(1, 0, 3.0)]
    with pytest.raises(ValueError, match=r"pair selection must be one of \['reward_gap', 'random', 'all', "
                                         r"'comparator_reward'\], got 'widest'"):
        select_pairs(pairs, "widest")
    with pytest.raises(ValueError, match="^pair selection 'comparator_reward' needs the candidates' rewards$"):
        select_pairs(pairs, "comparator_reward")
    with pytest.raises(ValueError, match="3 side labels for 4 candidates"):
        ordered_pairs([0.0, 1.0, 2.0, 3.0], sides=[0, 1, 0])


def test_no_pairs_are_an_empty_dataset_with_the_pair_columns():
    empty = pairs_dataset([])
    assert len(empty) == 0 and tuple(empty.column_names) == PAIR_COLUMNS
    pooled = pool([empty, pairs_dataset([])])
    assert len(pooled) == 0 and tuple(pooled.column_names) == PAIR_COLUMNS
    record = {column: None for column in PAIR_COLUMNS} | {"iteration": 2, "row_index": 1, "prompt": "p"}
    first, second = pairs_dataset([record]), pairs_dataset([record | {"iteration": 3}])
    assert pool([first, empty, second])["iteration"] == [2, 3]  # the non-empty ones, in order
