"""The joint reward model (comlrl/models/reward_model.py) against values computed in the test: a score is the
head on the backbone's hidden state of the joint response's last token, the response tokenized section by
section; ``joint_completions[agent][sample]``; the reward function the trainers call; plain texts cut at their
end; save; the device a reward model asks for; and the token budget's edges by hand."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.models.reward_model import (
    JointRewardModel,
    budget_problem,
    check_joint_budget,
    fair_shares,
    identical_pairs,
    joint_token_budget,
    learned_reward,
    pad_rows,
    resolve_reward_device,
    truncate_joint_ids,
)
from comlrl.models.value_heads import attach_value_head
from comlrl.parallel.device import resolve_device
from comlrl.rollout.preferences import agent_tag

PROMPTS = ["write about the cat", "a long story about the sun and the moon", "the dog"]
# joint_completions[agent][sample], as the trainers pass them
COMPLETIONS = [["one two three", "red", "the river and the hill road"], ["blue green", "tree river hill", "yes"]]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory) -> JointRewardModel:
    from comlrl.tiny import save_tiny_model

    directory = save_tiny_model(tmp_path_factory.mktemp("rm") / "tiny-llama", "llama", vocab_size=96, seed=0)
    torch.manual_seed(0)
    model = JointRewardModel.load(str(directory), torch.device("cpu"), torch.float32)
    with torch.no_grad():  # a fitted head (a new one is 0 everywhere)
        model.value_head.layers[-1].weight.normal_(0.0, 1.0)
        model.value_head.layers[-1].bias.fill_(0.25)
    return model


def tokens(model: JointRewardModel, text: str) -> list[int]:
    return model.tokenizer(text, add_special_tokens=False)["input_ids"]


def joint_ids_by_hand(model: JointRewardModel, prompt: str, completions: list[str]) -> list[int]:
    """The prompt, then each agent's tag and its completion (with its leading space), each tokenized alone."""
    ids = tokens(model, prompt)
    for index, completion in enumerate(completions):
        ids += tokens(model, agent_tag(index)) + tokens(model, f" {completion}")
    return ids


def score_by_hand(model: JointRewardModel, ids: list[int]) -> torch.Tensor:
    """The head on the last token's hidden state of the sequence alone (no padding)."""
    with torch.no_grad():
        hidden = model.backbone.base_model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        return model.value_head(hidden[None])[0]


def test_a_score_is_the_head_on_the_joint_responses_last_token(reward_model):
    reward_model.train()
    scores = reward_model.score(PROMPTS, COMPLETIONS)
    assert not reward_model.training and not scores.requires_grad and scores.device.type == "cpu"
    expected = torch.stack([
        score_by_hand(reward_model, joint_ids_by_hand(reward_model, prompt, [COMPLETIONS[0][i], COMPLETIONS[1][i]]))
        for i, prompt in enumerate(PROMPTS)
    ])
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)
    # score_joint takes responses[sample][agent] and keeps the graph
    joint = reward_model.score_joint(PROMPTS, [[COMPLETIONS[0][i], COMPLETIONS[1][i]] for i in range(3)])
    assert joint.requires_grad
    torch.testing.assert_close(joint.detach(), expected, rtol=1e-5, atol=1e-5)


def test_the_reward_function_scores_each_rows_prompt_field(reward_model):
    rows = [{"question": prompt, "prompt": "ignored"} for prompt in PROMPTS[:2]] + [{"other": 1}]
    reward = learned_reward(reward_model, prompt_field="question")
    values = reward(COMPLETIONS[0], COMPLETIONS[1], batch_items=rows)
    expected = reward_model.score(PROMPTS[:2] + [""], COMPLETIONS).tolist()
    assert isinstance(values, list) and values == pytest.approx(expected, abs=1e-6)
    by_default = learned_reward(reward_model)(COMPLETIONS[0], COMPLETIONS[1], batch_items=rows)  # "prompt"
    assert by_default == pytest.approx(reward_model.score(["ignored", "ignored", ""], COMPLETIONS).tolist(), abs=1e-6)
    assert by_default[0] != pytest.approx(values[0], abs=1e-3)


def test_joint_responses_are_padded_on_the_tokenizers_side(reward_model):
    responses = [[COMPLETIONS[0][i], COMPLETIONS[1][i]] for i in range(3)]
    rows = [joint_ids_by_hand(reward_model, p, r) for p, r in zip(PROMPTS, responses)]
    width = max(len(row) for row in rows)
    pad = reward_model.tokenizer.pad_token_id
    for side in ("right", "left"):
        reward_model.tokenizer.padding_side = side
        ids, mask = reward_model.encode_joint(PROMPTS, responses)
        for row, got, got_mask in zip(rows, ids.tolist(), mask.tolist()):
            padding = [pad] * (width - len(row))
            assert got == (row + padding if side == "right" else padding + row)
            assert sum(got_mask) == len(row)
    reward_model.tokenizer.padding_side = "right"
    assert reward_model.encode_joint([], [])[0].shape == (0, 0)


def test_plain_texts_are_cut_at_their_end(reward_model):
    texts = ["the cat and the dog and the sun", "red"]
    full = [tokens(reward_model, text) for text in texts]
    reward_model.max_length = 4
    try:
        ids, mask = reward_model.encode(texts)
        scores = reward_model.score_texts(texts)
    finally:
        reward_model.max_length = None
    assert ids[0].tolist() == full[0][:4] and mask.tolist() == [[1] * 4, [1] * len(full[1]) + [0] * (4 - len(full[1]))]
    torch.testing.assert_close(scores.detach(), torch.stack([score_by_hand(reward_model, full[0][:4]),
                                                             score_by_hand(reward_model, full[1])]),
                               rtol=1e-5, atol=1e-5)
    ids, _ = reward_model.encode(texts)  # no limit: nothing cut
    assert ids[0].tolist() == full[0]


def test_a_truncated_joint_response_is_scored_as_cut(reward_model):
    prompt, completions = PROMPTS[1], [COMPLETIONS[0][2], COMPLETIONS[1][1]]
    sections = [tokens(reward_model, prompt)]
    for index, completion in enumerate(completions):
        sections += [tokens(reward_model, agent_tag(index)), tokens(reward_model, f" {completion}")]
    tags = len(sections[1]) + len(sections[3])
    reward_model.max_length = tags + 9  # room 9: the prompt keeps 9 // 3 = 3, the completions share 6
    try:
        score = reward_model.score([prompt], [[completions[0]], [completions[1]]])
    finally:
        reward_model.max_length = None
    kept = sections[0][-3:] + sections[1] + sections[2][:3] + sections[3] + sections[4][:3]
    assert len(sections[2]) > 3 and len(sections[4]) > 3
    torch.testing.assert_close(score, score_by_hand(reward_model, kept)[None], rtol=1e-5, atol=1e-5)


def test_save_writes_the_backbone_the_tokenizer_and_the_head(reward_model, tmp_path):
    directory = reward_model.save(tmp_path / "saved" / "rm")
    assert directory == tmp_path / "saved" / "rm" and (directory / "model.safetensors").is_file()
    head = torch.load(directory / "value_head.pt", weights_only=True)
    assert head.keys() == reward_model.value_head.state_dict().keys()
    for name, tensor in reward_model.value_head.state_dict().items():
        assert torch.equal(head[name], tensor)
    backbone = AutoModelForCausalLM.from_pretrained(directory)
    for (name, saved), live in zip(backbone.state_dict().items(), reward_model.backbone.state_dict().values()):
        assert torch.equal(saved, live), name
    assert AutoTokenizer.from_pretrained(directory)("the cat")["input_ids"] == reward_model.tokenizer("the cat")["input_ids"]


def test_a_backbone_keeps_its_head_and_freezing_leaves_the_head_trainable(tiny_llama):
    backbone = AutoModelForCausalLM.from_pretrained(tiny_llama)
    head = attach_value_head(backbone)
    model = JointRewardModel(backbone, AutoTokenizer.from_pretrained(tiny_llama))
    assert model.value_head is head and model.max_length is None
    assert {id(p) for p in head.parameters()} <= {id(p) for p in model.parameters()}  # registered here
    assert model.device == torch.device("cpu")
    model.freeze_backbone()
    assert not any(p.requires_grad for p in backbone.parameters())
    assert all(p.requires_grad for p in head.parameters())
    with pytest.raises(ValueError, match="reward_max_length=3 "):
        JointRewardModel(backbone, AutoTokenizer.from_pretrained(tiny_llama), max_length=3, num_agents=2)


def test_the_reward_models_device(caplog):
    trainer = torch.device("cpu")
    assert resolve_reward_device(None, trainer, fallback=False) is trainer
    assert resolve_reward_device("cpu", torch.device("meta"), fallback=False) == torch.device("cpu")
    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last CUDA device (cuda:0 on a CPU machine)
    with pytest.raises(ValueError) as why:
        resolve_device(missing)
    with pytest.raises(ValueError) as error:
        resolve_reward_device(missing, trainer, fallback=False)
    assert str(error.value) == (
        f"reward_model_device='{missing}' is not available ({why.value}); set reward_model_device=None (the trainer's "
        "device) or 'cpu', or reward_model_device_fallback=True to fall back to the trainer's device with a warning")
    assert error.value.__cause__ is None and error.value.__suppress_context__
    with caplog.at_level(logging.WARNING, logger="comlrl.models.reward_model"):
        assert resolve_reward_device(missing, trainer, fallback=True) is trainer
    assert [r.getMessage() for r in caplog.records] == [
        f"reward_model_device='{missing}' is not available; using the trainer's device cpu"]


def test_fair_shares_edges_by_hand():
    assert fair_shares([20, 8, 3], 14) == [6, 5, 3]  # 3 kept; 11 over two: the remainder to the earliest index
    assert fair_shares([3, 10], 7) == [3, 4]  # a section exactly at its share keeps it, never more
    assert fair_shares([5, 5], 9) == [5, 4]
    assert fair_shares([7], 4) == [4]


def test_budget_edges_by_hand():
    assert budget_problem(8, [3, 3]) is None  # tags 6 + one token per agent
    assert budget_problem(7, [3, 3]) == (
        "reward_max_length=7 leaves no room for content: the 2 agent tags take 6 tokens (3, 3) and every agent's "
        "completion needs at least one more, so the reward model would read prompt-less, completion-less joint "
        "responses (chosen and rejected identical); set reward_max_length to at least 8 (better: room for the prompt "
        "and the completions, e.g. the longest joint response you expect), or None for no truncation")
    assert joint_token_budget(4, [2, 2], [3, 3], 14) == (4, [3, 3])  # exactly full: nothing cut
    assert joint_token_budget(5, [2, 2], [3, 3], 14) == (4, [3, 3])  # one over: the prompt gives way first
    # room 20 - 2 = 18, floor 18 // 3 = 6; completions 3 + 4 leave 11 for the prompt
    assert joint_token_budget(30, [1, 1], [3, 4], 20) == (11, [3, 4])
    # room 10, floor 10 // 3 = 3: the prompt keeps 3 although the completions want all
    assert joint_token_budget(30, [1, 1], [30, 30], 12) == (3, [4, 3])
    check_joint_budget(None, 2, None)  # no limit: nothing to check (the tokenizer is not read)


def test_truncation_keeps_the_prompts_end_or_nothing_of_it():
    sections = [[1, 2, 3], [90], [10, 11], [91], [20, 21, 22]]
    # room 6 - 2 = 4, floor 4 // 3 = 1: the prompt keeps [3], the completions share 3 -> [2, 1]
    assert truncate_joint_ids(sections, 6) == [3, 90, 10, 11, 91, 20]
    # room 2, floor 0: no prompt token, one of each completion
    assert truncate_joint_ids(sections, 4) == [90, 10, 91, 20]
    with pytest.raises(ValueError):  # a tag without its completion is refused, not dropped
        truncate_joint_ids(sections[:4], None)


def test_padding_and_identical_pairs_by_hand():
    ids, mask = pad_rows([[5], [6, 7]], pad_id=9)
    assert ids.tolist() == [[5, 9], [6, 7]] and mask.tolist() == [[1, 0], [1, 1]]
    assert ids.dtype == torch.long and mask.dtype == torch.long
    assert pad_rows([], pad_id=0)[0].shape == (0, 0)
    rows = torch.tensor([[1, 2], [3, 4], [1, 2], [3, 5], [7, 7]])  # 5 rows: the odd last one has no partner
    masks = torch.ones_like(rows)
    assert identical_pairs(rows, masks) == 1
    masks[2, 1] = 0  # same IDs, another mask: not identical
    assert identical_pairs(rows, masks) == 0


def test_a_backbone_without_a_head_gets_a_new_one(tiny_llama):
    backbone = AutoModelForCausalLM.from_pretrained(tiny_llama)
    model = JointRewardModel(backbone, AutoTokenizer.from_pretrained(tiny_llama))
    assert model.value_head is backbone.value_head
    assert model.score(["the cat"], [["one"], ["two"]]).tolist() == [0.0]  # a new head's output layer is 0


def test_prompts_and_responses_must_pair_up(reward_model):
    with pytest.raises(ValueError):
        reward_model.encode_joint(PROMPTS[:2], [["one", "two"]])


def test_no_special_tokens_are_added_to_what_the_reward_model_reads(reward_model):
    """A tokenizer that opens every text with BOS (as Llama's does) adds none to a section or a plain text."""
    from tokenizers.processors import TemplateProcessing

    backend = reward_model.tokenizer.backend_tokenizer
    bos = reward_model.tokenizer.bos_token_id
    plain = tokens(reward_model, "the cat")
    expected = joint_ids_by_hand(reward_model, "the cat", ["one", "two"])
    original = backend.post_processor
    backend.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    try:
        assert reward_model.tokenizer("the cat")["input_ids"] == [bos] + plain  # the tokenizer would add it
        assert reward_model.encode(["the cat"])[0].tolist() == [plain]
        assert reward_model.encode_joint(["the cat"], [["one", "two"]])[0].tolist() == [expected]
    finally:
        backend.post_processor = original


def test_load_in_a_dtype_and_a_tokenizer_without_a_pad_token(tiny_llama, tmp_path, caplog):
    import shutil

    directory = tmp_path / "no-pad"
    shutil.copytree(tiny_llama, directory)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(directory)
    with caplog.at_level(logging.WARNING, logger="comlrl.models.entities"):
        model = JointRewardModel.load(str(directory), torch.device("cpu"), torch.float64)
    assert "the tokenizer of the reward model has no pad token; using its EOS token '</s>'" in caplog.messages
    assert model.tokenizer.pad_token_id == model.tokenizer.eos_token_id
    assert {p.dtype for p in model.backbone.parameters()} == {torch.float64}


def test_load_checks_the_budget_before_reading_the_backbone(tiny_llama, tmp_path):
    directory = tmp_path / "tokenizer-only"
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(directory)  # no weights: the backbone cannot load
    with pytest.raises(ValueError, match="reward_max_length=3 leaves no room"):
        JointRewardModel.load(str(directory), torch.device("cpu"), torch.float32, max_length=3, num_agents=2)
    with pytest.raises(ValueError, match="could not load a causal language model"):
        JointRewardModel.load(str(directory), torch.device("cpu"), torch.float32, max_length=3)
