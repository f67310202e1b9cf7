"""Issue 27, defect 4: a ``reward_max_length`` whose agent tags leave no room for one token of every agent's
completion is an error naming the budget, the tags' token counts and the fix, raised when the reward model is
built (before its backbone loads) and when a joint response is encoded, never a silent identical encoding."""

from __future__ import annotations

import pytest
import torch

from comlrl.models.reward_model import JointRewardModel, joint_token_budget
from comlrl.models.entities import load_tokenizer
from comlrl.rollout import preferences

PROMPT = "tell me about the cat and the dog"


def test_budget_without_room_for_every_agent_is_an_error_by_hand():
    # tags 3 + 3 fill 6 tokens: the prompt and both completions would keep 0 tokens
    with pytest.raises(ValueError, match=r"reward_max_length=6 .*agent tags take 6 tokens \(3, 3\).*at least 8"):
        joint_token_budget(5, [3, 3], [4, 4], 6)
    # one token of room for two agents: agent 1's completion would keep nothing
    with pytest.raises(ValueError, match=r"reward_max_length=7 .*at least 8"):
        joint_token_budget(5, [3, 3], [4, 4], 7)
    # one token per agent is the least that works: room 2, prompt floor 2 // 3 = 0, completions [1, 1]
    assert joint_token_budget(5, [3, 3], [4, 4], 8) == (0, [1, 1])
    # a joint response that fits needs no room at all
    assert joint_token_budget(0, [3, 3], [0, 0], 6) == (0, [0, 0])


def tag_lengths(tokenizer) -> list[int]:
    return [len(tokenizer(preferences.agent_tag(i), add_special_tokens=False)["input_ids"]) for i in range(2)]


def test_encoding_refuses_a_budget_the_tags_fill(tiny_llama):
    """Before the fix: prompt and completions kept 0 tokens, chosen and rejected encoded identically, no error."""
    model = JointRewardModel.load(tiny_llama, torch.device("cpu"), torch.float32)
    budget = sum(tag_lengths(model.tokenizer))
    model.max_length = budget
    joint = [["the cat", "one two"], ["the dog", "three four"]]
    with pytest.raises(ValueError, match=rf"reward_max_length={budget} "):
        model.encode_joint([PROMPT, PROMPT], joint)
    model.max_length = budget + 2  # one token of each completion: the pair differs
    ids, _ = model.encode_joint([PROMPT, PROMPT], joint)
    assert not torch.equal(ids[0], ids[1])


def test_reward_model_load_checks_the_budget_before_the_backbone(tiny_llama):
    from comlrl.models.reward_model import joint_tag_lengths

    tokenizer = load_tokenizer(tiny_llama)
    tags = joint_tag_lengths(tokenizer, 2)
    assert tags == tag_lengths(tokenizer)
    budget = sum(tags)
    with pytest.raises(ValueError, match=rf"reward_max_length={budget} .*\({tags[0]}, {tags[1]}\).*at least "
                                         rf"{budget + 2}"):
        JointRewardModel.load(tiny_llama, torch.device("cpu"), torch.float32, max_length=budget, num_agents=2)
    model = JointRewardModel.load(tiny_llama, torch.device("cpu"), torch.float32, max_length=budget + 2, num_agents=2)
    assert model.max_length == budget + 2
