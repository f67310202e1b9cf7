"""Value heads against the maths written out by hand: the head's layers, and a sequence's value as the causal LM's
last hidden state (its own forward, ``output_hidden_states``) at the last real token through the head."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.models.value_heads import ValueHead, attach_value_head, distinct_sequence_values, last_token_index, sequence_values


def head_by_hand(head: ValueHead, hidden: torch.Tensor) -> torch.Tensor:
    x = hidden.float()
    if head.hidden_dim is None:
        return x @ head.layers[0].weight.T.detach() + head.layers[0].bias.detach()
    x = x @ head.layers[0].weight.T.detach() + head.layers[0].bias.detach()
    x = 0.5 * x * (1 + torch.erf(x / math.sqrt(2.0)))  # exact GELU
    return x @ head.layers[2].weight.T.detach() + head.layers[2].bias.detach()


def randomised(head: ValueHead, seed: int) -> ValueHead:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return head


@pytest.mark.parametrize("hidden_dim", [None, 1, 3])
def test_head_layers_by_hand_in_float32(hidden_dim):
    head = randomised(ValueHead(4, hidden_dim), seed=hidden_dim or 0)
    assert (head.input_size, head.hidden_dim) == (4, hidden_dim)
    hidden = torch.tensor([[0.5, -1.0, 2.0, 0.0], [1.5, 0.25, -0.5, 1.0]], dtype=torch.bfloat16)
    values = head(hidden)
    assert values.dtype == torch.float32 and values.shape == (2,)
    torch.testing.assert_close(values, head_by_hand(head, hidden)[:, 0], rtol=1e-6, atol=1e-6)
    assert head(hidden[:1]).shape == (1,)  # one row stays a batch of one


@pytest.mark.parametrize("hidden_dim", [0, -2, True, 2.0, "4"])
def test_head_width_must_be_a_positive_integer(hidden_dim):
    with pytest.raises(ValueError, match=f"hidden_dim must be a positive integer or None, got {hidden_dim!r}"):
        ValueHead(4, hidden_dim)


def test_a_new_head_predicts_zero_whatever_its_width():
    hidden = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    for hidden_dim in (None, 1, 5):
        head = ValueHead(4, hidden_dim)
        assert torch.equal(head(hidden), torch.zeros(3))
        assert head.layers[0].weight.abs().sum() > 0 or hidden_dim is None  # only the output layer starts at 0


def last_real_hidden(model, input_ids, attention_mask) -> torch.Tensor:
    positions = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
    hidden = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                   output_hidden_states=True).hidden_states[-1]
    last = [max(j for j in range(attention_mask.shape[1]) if attention_mask[i, j]) for i in range(hidden.shape[0])]
    return torch.stack([hidden[i, j] for i, j in enumerate(last)])


@pytest.mark.parametrize("hidden_dim", [None, 8])
def test_sequence_values_by_hand(hidden_dim, tiny_llama):
    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_llama), AutoTokenizer.from_pretrained(tiny_llama)
    head = randomised(attach_value_head(model, hidden_dim), seed=1)
    assert head.input_size == model.config.hidden_size and head.hidden_dim == hidden_dim
    assert next(head.parameters()).device == next(model.parameters()).device
    assert "value_head" not in dict(model.named_children())
    encoded = tokenizer(["the cat", "a long story about the river and the hill", "sun"], return_tensors="pt",
                        padding=True, padding_side="left", add_special_tokens=False)
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    values = sequence_values(model, ids, mask)
    with torch.no_grad():
        expected = head_by_hand(head, last_real_hidden(model, ids, mask))[:, 0]
    torch.testing.assert_close(values, expected, rtol=0, atol=1e-5)
    assert values.requires_grad  # a critic's loss backpropagates through it
    # one real token in the middle of padding: its own column, not the last one
    middle = torch.tensor([[0, 1, 0]])
    torch.testing.assert_close(sequence_values(model, ids[:1, -3:], middle),
                               sequence_values(model, ids[:1, -2:-1], torch.tensor([[1]])), rtol=0, atol=1e-5)


def test_last_token_index_of_one_row_and_of_a_single_column():
    assert last_token_index(torch.tensor([[1, 0, 1, 0, 0]])).tolist() == [2]
    assert last_token_index(torch.tensor([[True], [True]])).tolist() == [0, 0]


def test_the_head_and_the_last_token_stay_on_the_models_and_the_masks_device(tiny_llama):
    """A critic on another device than the CPU (``meta`` stands in for it on any machine): its new head is created
    there, and the last token's column is found on the mask's device."""
    from transformers import AutoConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_llama))
    head = attach_value_head(model, 3)
    assert {parameter.device.type for parameter in head.parameters()} == {"meta"}
    index = last_token_index(torch.tensor([[1, 1, 0], [0, 1, 1]], device="meta"))
    assert index.device.type == "meta" and index.shape == (2,)


def test_distinct_values_tell_masks_apart(tiny_llama):
    """Rows with the same ids but other masks are other sequences; repeats take their first copy's value, and
    every row's value is the one it would get alone."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    randomised(attach_value_head(model), seed=2)
    ids = torch.tensor([[5, 6, 7], [5, 6, 7], [8, 9, 10], [5, 6, 7]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])
    values = distinct_sequence_values(model, ids, mask)
    alone = torch.cat([sequence_values(model, ids[i:i + 1], mask[i:i + 1]) for i in range(4)]).detach()
    torch.testing.assert_close(values, alone, rtol=0, atol=1e-5)
    assert values[0] == values[3] and abs(float(values[0] - values[1])) > 1e-4
    assert not values.requires_grad
    same = distinct_sequence_values(model, ids[:3], mask[:3])  # no repeats: every row valued once, in its place
    torch.testing.assert_close(same, alone[:3], rtol=0, atol=1e-5)
    assert not same.requires_grad


def test_distinct_values_take_a_float_or_bool_mask(tiny_llama):
    """A float mask (as some collators give) or a bool one: the ids stay token ids and every repeat still takes
    its first copy's value, the value of the int mask's row."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    randomised(attach_value_head(model), seed=6)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10], [5, 6, 7]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1]])
    alone = torch.cat([sequence_values(model, ids[i:i + 1], mask[i:i + 1]) for i in range(3)]).detach()
    for dtype in (torch.float32, torch.bool):
        values = distinct_sequence_values(model, ids, mask.to(dtype))
        torch.testing.assert_close(values, alone, rtol=0, atol=1e-5)


def test_a_critic_forward_keeps_no_key_value_cache(tiny_llama):
    """Valuing a batch never asks the backbone for a cache of keys and values (memory a critic would hold for
    nothing): the backbone is called with ``use_cache=False``, once per distinct batch."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    attach_value_head(model)
    seen = []
    model.base_model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs.get("use_cache")),
                                               with_kwargs=True)
    ids, mask = torch.tensor([[5, 6, 7], [5, 6, 7]]), torch.tensor([[1, 1, 1], [1, 1, 1]])
    sequence_values(model, ids, mask)
    distinct_sequence_values(model, ids, mask)
    assert seen == [False, False]


def test_a_hole_in_the_mask_is_skipped_like_padding(tiny_llama):
    """Positions count real tokens only and the mask hides the hole: [a, pad, b] is valued as [a, b]."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    randomised(attach_value_head(model), seed=3)
    holed = sequence_values(model, torch.tensor([[5, 0, 9]]), torch.tensor([[1, 0, 1]]))
    plain = sequence_values(model, torch.tensor([[5, 9]]), torch.tensor([[1, 1]]))
    torch.testing.assert_close(holed, plain, rtol=0, atol=1e-5)


def test_a_lora_model_is_valued_through_its_backbone(tiny_llama):
    """A peft (LoRA) model with a value head (an IAC actor that carries its head): its last hidden state, with the
    adapters, at the last real token through the head."""
    from comlrl.models.lora import add_adapters

    model = add_adapters(AutoModelForCausalLM.from_pretrained(tiny_llama), 2, 4.0, 0.0, None)
    with torch.no_grad():  # adapters that change the output (a new adapter's B starts at 0)
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.5 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(4)))
    head = randomised(attach_value_head(model, 4), seed=5)
    ids, mask = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]]), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    with torch.no_grad():
        expected = head_by_hand(head, last_real_hidden(model, ids, mask))[:, 0]
        with model.disable_adapter():
            without = head_by_hand(head, last_real_hidden(model, ids, mask))[:, 0]
    values = sequence_values(model, ids, mask)
    torch.testing.assert_close(values, expected, rtol=0, atol=1e-5)
    assert (values - without).abs().max() > 1e-3  # the adapters are in the value


def test_a_model_without_a_head_is_named(tiny_llama):
    with pytest.raises(ValueError, match=r"^model LlamaForCausalLM has no value_head; attach one with attach_value_head"):
        sequence_values(AutoModelForCausalLM.from_pretrained(tiny_llama), torch.tensor([[5, 6]]), torch.tensor([[1, 1]]))
