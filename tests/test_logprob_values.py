"""Completion log-probabilities (comlrl/training/logprobs.py) against each row's own unpadded pass, computed in
the test from the model's logits: left-padded prompts, right-padded completions, the shared-prompt pass and the
single pass (values and gradients), a one-token completion, the temperature, the work threshold that picks the
shared pass, a model whose forward keeps every logit, and ``token_logprobs`` on hand numbers."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from comlrl.training import logprobs
from comlrl.training.logprobs import completion_logits, completion_logprobs, distinct_prompts, token_logprobs

PAD = 0
# The prompt that comes first sorts last (torch.unique's order is not the batch's), and the rows interleave.
PROMPT_A = [40, 41, 42, 43, 44]
PROMPT_B = [10, 11, 12]
ROWS = [
    (PROMPT_A, [50, 51, 52]),
    (PROMPT_B, [60, 61, 62, 63, 64]),
    (PROMPT_A, [53]),
    (PROMPT_B, [65, 66, 67, 68]),
    (PROMPT_A, [54, 55, 56, 57, 58]),
    (PROMPT_B, [69, 70]),
]


def batch(rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts padded on the left, completions on the right (as a rollout makes them)."""
    prompt_width = max(len(p) for p, _ in rows)
    completion_width = max(len(c) for _, c in rows)
    prompt_ids = torch.tensor([[PAD] * (prompt_width - len(p)) + p for p, _ in rows])
    prompt_mask = torch.tensor([[0] * (prompt_width - len(p)) + [1] * len(p) for p, _ in rows])
    completion_ids = torch.tensor([c + [PAD] * (completion_width - len(c)) for _, c in rows])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (completion_width - len(c)) for _, c in rows])
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def by_hand(model, rows, temperature: float = 1.0) -> list[torch.Tensor]:
    """Each row alone, without padding: the completion tokens' log-probabilities from the logits before them."""
    values = []
    for prompt, completion in rows:
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float() / temperature
        predicted = logits[len(prompt) - 1:len(prompt) + len(completion) - 1].log_softmax(-1)
        values.append(predicted.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1))
    return values


def rows_seen(model) -> tuple[list[tuple[int, int]], torch.utils.hooks.RemovableHandle]:
    """The ``(rows, tokens)`` of every input the model embeds."""
    shapes: list[tuple[int, int]] = []
    handle = model.get_input_embeddings().register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    return shapes, handle


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_gpt2"])
@pytest.mark.parametrize("path", ["single", "shared"])
def test_log_probs_and_gradients_are_each_rows_own_pass(name, path, request, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(name))
    if path == "shared":
        monkeypatch.setattr(logprobs, "MIN_SHARED_PROMPT_FLOPS", 0)
    inputs = batch(ROWS)
    shapes, handle = rows_seen(model)
    values = completion_logprobs(model, *inputs, temperature=2.0)
    handle.remove()
    assert values.shape == (6, 5) and values.dtype == torch.float32
    # the single pass: one row per sample; the shared one: each prompt once, then the completions from its cache
    assert shapes == ([(6, 10)] if path == "single" else [(2, 5), (6, 4)])
    expected = by_hand(model, ROWS, temperature=2.0)
    for row, want in enumerate(expected):
        torch.testing.assert_close(values[row, :len(want)], want, rtol=1e-5, atol=1e-5)

    (values * inputs[3]).sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch.stack([v.sum() for v in by_hand(model, ROWS, temperature=2.0)]).sum().backward()
    for mine, theirs in zip(got, (p.grad for p in model.parameters())):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)


def test_a_one_token_completion_needs_only_the_prompt_pass(tiny_llama, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    monkeypatch.setattr(logprobs, "MIN_SHARED_PROMPT_FLOPS", 0)
    rows = [(PROMPT_A, [50]), (PROMPT_B, [60]), (PROMPT_A, [51]), (PROMPT_B, [61])]
    shapes, handle = rows_seen(model)
    with torch.no_grad():
        values = completion_logprobs(model, *batch(rows))
    handle.remove()
    with torch.no_grad():
        expected = torch.cat(by_hand(model, rows))
    assert shapes == [(2, 5)]
    torch.testing.assert_close(values[:, 0], expected, rtol=1e-5, atol=1e-5)


def test_the_default_temperature_is_one(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    inputs = batch(ROWS)
    with torch.no_grad():
        values = completion_logprobs(model, *inputs)
        logits = completion_logits(model, *inputs)
        expected = by_hand(model, ROWS)
    torch.testing.assert_close(token_logprobs(logits, inputs[2]), values)
    for row, want in enumerate(expected):
        torch.testing.assert_close(values[row, :len(want)], want, rtol=1e-5, atol=1e-5)


def test_the_shared_pass_is_taken_from_its_work_threshold_on(tiny_llama, monkeypatch):
    """Work saved: 2 x parameters x (rows - distinct prompts) x prompt width, against MIN_SHARED_PROMPT_FLOPS."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    saved = 2 * parameter_count(model) * (6 - 2) * 5
    inputs = batch(ROWS)
    for threshold, shared in [(saved, True), (saved + 1, False)]:
        monkeypatch.setattr(logprobs, "MIN_SHARED_PROMPT_FLOPS", threshold)
        shapes, handle = rows_seen(model)
        with torch.no_grad():
            completion_logprobs(model, *inputs)
        handle.remove()
        assert (shapes[0] == (2, 5)) is shared, (threshold, shapes)
    # every row one prompt: 5 of 6 prompt passes saved
    one_prompt = [(PROMPT_A, completion) for _, completion in ROWS]
    monkeypatch.setattr(logprobs, "MIN_SHARED_PROMPT_FLOPS", 2 * parameter_count(model) * (6 - 1) * 5)
    shapes, handle = rows_seen(model)
    with torch.no_grad():
        values = completion_logprobs(model, *batch(one_prompt))
    handle.remove()
    assert shapes == [(1, 5), (6, 4)]
    for row, want in enumerate(by_hand(model, one_prompt)):
        torch.testing.assert_close(values[row, :len(want)], want, rtol=1e-5, atol=1e-5)


class AllLogitsLlama(LlamaForCausalLM):
    """A causal LM whose forward takes no ``logits_to_keep`` and no cache (an older or custom model's signature)."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, use_cache=None):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=use_cache)


def test_a_model_without_logits_to_keep_runs_one_pass_and_slices_its_logits(tiny_llama, monkeypatch):
    model = AllLogitsLlama.from_pretrained(tiny_llama)
    monkeypatch.setattr(logprobs, "MIN_SHARED_PROMPT_FLOPS", 0)  # sharing would save work, but cannot be done
    shapes, handle = rows_seen(model)
    with torch.no_grad():
        values = completion_logprobs(model, *batch(ROWS), temperature=0.5)
    handle.remove()
    with torch.no_grad():
        expected = by_hand(model, ROWS, temperature=0.5)
    assert shapes == [(6, 10)] and values.shape == (6, 5)
    for row, want in enumerate(expected):
        torch.testing.assert_close(values[row, :len(want)], want, rtol=1e-5, atol=1e-5)


def test_distinct_prompts_of_more_rows_than_key_columns():
    ids = torch.tensor([[3], [4], [3], [4], [5]])
    first_rows, inverse = distinct_prompts(ids, torch.ones_like(ids))
    assert first_rows.tolist() == [0, 1, 4] and inverse.tolist() == [0, 1, 0, 1, 2]
    first_rows, inverse = distinct_prompts(*batch(ROWS)[:2])
    assert first_rows.tolist() == [0, 1] and inverse.tolist() == [0, 1, 0, 1, 0, 1]


def test_token_logprobs_by_hand():
    logits = torch.tensor([[[0.0, math.log(3.0)], [2.0, 2.0]]])  # softmax (1/4, 3/4), then (1/2, 1/2)
    values = token_logprobs(logits, torch.tensor([[0, 1]]))
    torch.testing.assert_close(values, torch.tensor([[math.log(0.25), math.log(0.5)]]))


def outputs_seen(model) -> tuple[list[tuple[tuple[int, ...], bool]], torch.utils.hooks.RemovableHandle]:
    """The shape of the logits every forward returns, and whether it returned a KV cache."""
    seen: list[tuple[tuple[int, ...], bool]] = []
    handle = model.register_forward_hook(
        lambda m, args, out: seen.append((tuple(out.logits.shape), out.past_key_values is not None)))
    return seen, handle


@pytest.mark.parametrize("path", ["single", "shared"])
def test_each_pass_computes_only_the_logits_it_scores(tiny_llama, monkeypatch, path):
    """What a pass costs in memory: the single pass returns the C + 1 positions it slices (not the prompt's) and
    no KV cache; the shared pass the prompt's last position (with the cache the completions read), then C - 1."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    monkeypatch.setattr(logprobs, "MIN_SHARED_PROMPT_FLOPS", 0 if path == "shared" else float("inf"))
    seen, handle = outputs_seen(model)
    with torch.no_grad():
        completion_logprobs(model, *batch(ROWS))
    handle.remove()
    vocab = model.config.vocab_size
    completion_width = 5
    if path == "single":
        assert seen == [((6, completion_width + 1, vocab), False)]
    else:
        assert seen == [((2, 1, vocab), True), ((6, completion_width - 1, vocab), True)]
