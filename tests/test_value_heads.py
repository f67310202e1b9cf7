"""Value heads: last non-padding token, padding side, head shapes, and staying out of the LM's weights."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.models.value_heads import ValueHead, attach_value_head, distinct_sequence_values, last_token_index, sequence_values

TEXTS = ["the cat", "a long story about the river and the hill", "sun"]


def test_last_token_index_for_left_right_and_mixed_padding():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 0, 0], [0, 1, 1, 0], [1, 1, 1, 1]])
    assert last_token_index(mask).tolist() == [3, 1, 2, 3]


def test_linear_and_mlp_heads_start_at_zero():
    hidden = torch.randn(3, 8)
    linear, mlp = ValueHead(8), ValueHead(8, hidden_dim=5)
    assert [type(m).__name__ for m in linear.layers] == ["Linear"]
    assert [type(m).__name__ for m in mlp.layers] == ["Linear", "GELU", "Linear"] and mlp.layers[0].out_features == 5
    assert torch.equal(linear(hidden), torch.zeros(3)) and torch.equal(mlp(hidden), torch.zeros(3))
    with pytest.raises(ValueError, match="hidden_dim must be a positive integer or None, got 0"):
        ValueHead(8, hidden_dim=0)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_gpt2"])
@pytest.mark.parametrize("hidden_dim", [None, 16])
def test_same_value_under_left_and_right_padding(fixture, hidden_dim, request):
    path = request.getfixturevalue(fixture)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    head = attach_value_head(model, hidden_dim)
    torch.nn.init.normal_(head.layers[-1].weight)  # a non-zero head, so the values say something
    values = {}
    for side in ("left", "right"):
        encoded = tokenizer(TEXTS, return_tensors="pt", padding=True, padding_side=side, add_special_tokens=False)
        assert encoded["attention_mask"].sum() < encoded["attention_mask"].numel()  # there is padding
        values[side] = sequence_values(model, encoded["input_ids"], encoded["attention_mask"])
    alone = torch.cat([
        sequence_values(model, *tokenizer([text], return_tensors="pt", add_special_tokens=False).values()) for text in TEXTS
    ])
    assert values["left"].abs().min() > 1e-3
    assert torch.allclose(values["left"], values["right"], atol=1e-5, rtol=0)
    assert torch.allclose(values["left"], alone, atol=1e-5, rtol=0)


def test_head_is_not_part_of_the_language_model_weights(tiny_llama, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    keys = set(model.state_dict())
    head = attach_value_head(model)
    assert model.value_head is head
    assert set(model.state_dict()) == keys  # save_pretrained / from_pretrained stay the plain LM's
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not hasattr(reloaded, "value_head")


def test_model_without_head_is_refused(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with pytest.raises(ValueError, match="has no value_head; attach one"):
        sequence_values(model, torch.tensor([[5, 6]]), torch.tensor([[1, 1]]))


def test_distinct_rows_are_evaluated_once_and_every_row_gets_its_value(tiny_llama):
    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_llama), AutoTokenizer.from_pretrained(tiny_llama)
    torch.manual_seed(0)
    torch.nn.init.normal_(attach_value_head(model).layers[-1].weight)
    texts = [TEXTS[0], TEXTS[1], TEXTS[0], TEXTS[0], TEXTS[2], TEXTS[1]]
    encoded = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    batch_sizes = []
    hook = model.base_model.register_forward_pre_hook(lambda module, args, kwargs: batch_sizes.append(
        kwargs["input_ids"].shape[0]), with_kwargs=True)
    distinct = distinct_sequence_values(model, encoded["input_ids"], encoded["attention_mask"])
    hook.remove()
    every = sequence_values(model, encoded["input_ids"], encoded["attention_mask"])
    assert batch_sizes == [3]
    assert torch.allclose(distinct, every, atol=1e-6)
    assert distinct[0] == distinct[2] == distinct[3] and distinct[1] == distinct[5] and distinct[0] != distinct[1]
