"""Samples of one prompt share its pass: the prefill in decoding, the prompt forward in the update's log-probs
(there, where it saves enough work: comlrl.training.logprobs.MIN_SHARED_PROMPT_FLOPS)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.rollout.generation import generate_completions
from comlrl.rollout.sampling import SamplingParams
from comlrl.training import logprobs
from comlrl.training.logprobs import completion_logprobs, distinct_prompts

PROMPTS = ["the agent", "write a long story about the moon and the sun"]


def rows_seen(model: torch.nn.Module) -> tuple[list[tuple[int, int]], torch.utils.hooks.RemovableHandle]:
    """The ``(rows, tokens)`` of every input the model embeds."""
    shapes: list[tuple[int, int]] = []
    handle = model.get_input_embeddings().register_forward_hook(lambda module, args, out: shapes.append(tuple(args[0].shape)))
    return shapes, handle


@pytest.fixture(params=["tiny_llama", "tiny_gpt2"])
def sampled(request):
    directory = request.getfixturevalue(request.param)
    model = AutoModelForCausalLM.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    torch.manual_seed(0)
    generation = generate_completions(model, tokenizer, PROMPTS, 3, SamplingParams(max_new_tokens=10))
    assert (generation.prompt_mask == 0).any() and (generation.completion_mask == 0).any()  # padding on both sides
    return model, generation


def test_distinct_prompts_maps_rows_to_their_first_occurrence():
    ids = torch.tensor([[0, 5], [0, 5], [7, 8], [0, 5]])
    mask = torch.tensor([[0, 1], [0, 1], [1, 1], [1, 1]])  # the last row: same IDs, other mask
    first_rows, inverse = distinct_prompts(ids, mask)
    assert first_rows.tolist() == [0, 2, 3]  # in the order the prompts first appear
    assert inverse.tolist() == [0, 0, 1, 2]
    assert distinct_prompts(ids[1:3], mask[1:3]) is None


def test_shared_prompt_pass_gives_the_full_pass_log_probs_and_gradients(sampled, monkeypatch):
    model, g = sampled
    monkeypatch.setattr(logprobs, "MIN_SHARED_PROMPT_FLOPS", 0)  # tiny models save too little to share by default
    inputs = (g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask)
    results = {}
    for path in ("shared", "full"):
        if path == "full":
            monkeypatch.setattr(logprobs, "distinct_prompts", lambda ids, mask: None)
        model.zero_grad()
        shapes, handle = rows_seen(model)
        values = completion_logprobs(model, *inputs, temperature=0.7)
        (values * g.completion_mask).sum().backward()
        handle.remove()
        results[path] = values.detach(), [p.grad.clone() for p in model.parameters()], shapes
    rows, prompt, completion = g.prompt_ids.shape[0], g.prompt_ids.shape[1], g.completion_ids.shape[1]
    assert results["shared"][2] == [(2, prompt), (rows, completion - 1)]  # each prompt once, then the completions
    assert results["full"][2] == [(rows, prompt + completion)]
    kept = g.completion_mask.bool()
    assert torch.allclose(results["shared"][0][kept], results["full"][0][kept], atol=1e-5)
    for shared, full in zip(results["shared"][1], results["full"][1]):
        assert torch.allclose(shared, full, rtol=1e-4, atol=1e-6)


def test_a_pass_that_saves_little_stays_single(sampled):
    model, g = sampled
    saved = 2 * sum(p.numel() for p in model.parameters()) * (6 - 2) * g.prompt_ids.shape[1]
    assert saved < logprobs.MIN_SHARED_PROMPT_FLOPS
    shapes, handle = rows_seen(model)
    with torch.no_grad():
        completion_logprobs(model, g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask)
    handle.remove()
    assert shapes == [(6, g.prompt_ids.shape[1] + g.completion_ids.shape[1])]


def test_gradient_checkpointing_runs_one_pass_per_row(tiny_llama, monkeypatch):
    monkeypatch.setattr(logprobs, "MIN_SHARED_PROMPT_FLOPS", 0)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    g = generate_completions(model, tokenizer, PROMPTS, 2, SamplingParams(max_new_tokens=6))
    model.gradient_checkpointing_enable()
    model.train()
    shapes, handle = rows_seen(model)
    completion_logprobs(model, g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask).sum().backward()
    handle.remove()
    assert shapes[0] == (4, g.prompt_ids.shape[1] + g.completion_ids.shape[1])


def test_decoding_prefills_each_prompt_once(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    shapes, handle = rows_seen(model)
    generation = generate_completions(model, tokenizer, PROMPTS, 3, SamplingParams(max_new_tokens=4, do_sample=False))
    handle.remove()
    assert shapes[0] == (2, generation.prompt_ids.shape[1])  # the prefill: one row per prompt
    assert all(shape == (6, 1) for shape in shapes[1:])  # then one token per sample per step
    assert torch.equal(generation.completion_ids[0], generation.completion_ids[2])  # greedy: a prompt's samples agree
