"""The decode loop draws exactly what transformers' generate draws, and agents can sample side by side."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from comlrl.rollout.episodes import RolloutSpec, rollout_episodes
from comlrl.rollout.generation import encode_prompts, generate_completions
from comlrl.rollout.sampling import (SamplingParams, decode, prompt_positions, sample_one, top_k_filter, top_p_filter,
                                     warp_logits)

PROMPTS = ["the agent", "write a long story about the moon and the sun"]


def test_top_k_and_top_p_by_hand():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    assert top_k_filter(logits, 2).tolist() == [[3.0, float("-inf"), 2.0, float("-inf")]]
    # probabilities ~[0.64, 0.09, 0.24, 0.03]: 0.8 of the mass needs the two likeliest tokens
    kept = top_p_filter(logits, 0.8)
    assert torch.isfinite(kept).tolist() == [[True, False, True, False]]
    # the likeliest token always survives, however small top_p is
    assert torch.isfinite(top_p_filter(logits, 0.01)).tolist() == [[True, False, False, False]]


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValueError, match=r"backend must be one of \('comlrl', 'transformers'\), got 'vllm'"):
        SamplingParams(backend="vllm")


def test_prompt_positions_start_at_each_rows_first_token():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert prompt_positions(mask).tolist() == [[1, 1, 0, 1], [0, 1, 2, 3]]


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, 1.0), (0.7, 5, 1.0), (1.3, None, 0.8), (0.5, 10, 0.9)])
def test_warpers_match_transformers(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    expected = logits.clone()
    if temperature != 1.0:
        expected = TemperatureLogitsWarper(temperature)(None, expected)
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1.0:
        expected = TopPLogitsWarper(top_p)(None, expected)
    actual = warp_logits(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    assert torch.equal(torch.isinf(actual), torch.isinf(expected))
    assert torch.allclose(actual[torch.isfinite(actual)], expected[torch.isfinite(expected)])


SETTINGS = [
    SamplingParams(max_new_tokens=24),
    SamplingParams(max_new_tokens=24, temperature=0.7, top_k=20, top_p=0.9),
    SamplingParams(max_new_tokens=12, do_sample=False),
]


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_gpt2"])
@pytest.mark.parametrize("sampling", SETTINGS, ids=["plain", "warped", "greedy"])
@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[1:]], ids=["left-padded", "unpadded"])
def test_decode_draws_the_tokens_generate_draws(fixture, sampling, prompts, request):
    """Same RNG state, same tokens, with and without left padding, EOS included."""
    directory = request.getfixturevalue(fixture)
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    num_generations = 3 if sampling.do_sample else 1  # generate refuses several greedy sequences
    ours, theirs = [], []
    for backend, out in (("comlrl", ours), ("transformers", theirs)):
        for seed in range(3):
            torch.manual_seed(seed)
            generated = generate_completions(model, tokenizer, prompts, num_generations,
                                             SamplingParams(**{**vars(sampling), "backend": backend}))
            out.append(generated)
    for a, b in zip(ours, theirs):
        assert torch.equal(a.completion_ids, b.completion_ids)
        assert torch.equal(a.completion_mask, b.completion_mask)
        assert a.texts == b.texts
    if sampling.do_sample:  # the comparison saw EOS and padding, not only full-length rows
        assert any((g.completion_mask == 0).any() for g in ours)


def test_sample_one_draws_what_multinomial_draws_and_flags_nan_rows():
    """Same generator state, same token as torch.multinomial (with zero-probability tokens too); NaN rows flagged."""
    logits = torch.randn(200, 40, generator=torch.Generator().manual_seed(0)) * 3
    probabilities = warp_logits(logits, SamplingParams(top_k=7, top_p=0.9)).softmax(dim=-1)
    expected = torch.multinomial(probabilities, 1, generator=torch.Generator().manual_seed(1)).squeeze(1)
    tokens, scores = sample_one(probabilities, torch.Generator().manual_seed(1))
    assert torch.equal(tokens, expected) and not scores.isnan().any()
    probabilities[3, 5] = float("nan")
    _, scores = sample_one(probabilities, torch.Generator().manual_seed(1))
    assert scores.isnan().tolist() == [row == 3 for row in range(200)]


def test_decode_raises_when_the_model_gives_nan_logits(tiny_llama):
    """torch.multinomial's check, made once per call: non-finite logits are an error, not a token."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    with torch.no_grad():
        model.get_output_embeddings().weight.fill_(float("nan"))
    ids, mask = encode_prompts(tokenizer, ["the agent"], torch.device("cpu"))
    with pytest.raises(RuntimeError, match="next-token probabilities of a row hold NaN"):
        decode(model, ids, mask, SamplingParams(max_new_tokens=3), [], tokenizer.pad_token_id)


def test_decode_stops_when_every_row_has_ended(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    ids, mask = encode_prompts(tokenizer, ["the agent"] * 3, torch.device("cpu"))
    greedy = SamplingParams(max_new_tokens=10, do_sample=False)
    first = int(decode(model, ids, mask, greedy, [], tokenizer.pad_token_id)[0, 0])
    ended = decode(model, ids, mask, greedy, [first], tokenizer.pad_token_id)
    assert ended.shape == (3, 1) and (ended == first).all()


def test_a_generator_makes_sampling_independent_of_the_global_rng(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    sampling = SamplingParams(max_new_tokens=16)
    draws = []
    for global_seed in (0, 1):
        torch.manual_seed(global_seed)
        draws.append(generate_completions(model, tokenizer, PROMPTS, 2, sampling,
                                          generator=torch.Generator().manual_seed(7)).completion_ids)
    assert torch.equal(draws[0], draws[1])
    other = generate_completions(model, tokenizer, PROMPTS, 2, sampling, generator=torch.Generator().manual_seed(8))
    assert not torch.equal(draws[0], other.completion_ids)


def threaded_map(function, devices):
    """Every agent at once, finishing in reverse order of submission when it can."""
    with ThreadPoolExecutor(max_workers=len(devices)) as pool:
        futures = [pool.submit(function, index) for index in reversed(range(len(devices)))]
        return [future.result() for future in reversed(futures)]


@pytest.mark.parametrize("backend", ["comlrl", "transformers"])
def test_agents_sampling_side_by_side_give_the_sequential_rollout(backend, tiny_llama, tiny_llama_b):
    agents = [AutoModelForCausalLM.from_pretrained(path).eval() for path in (tiny_llama, tiny_llama_b)]
    tokenizers = [AutoTokenizer.from_pretrained(path) for path in (tiny_llama, tiny_llama_b)]
    rows = [{"prompt": prompt} for prompt in PROMPTS]
    formatters = [lambda row: row["prompt"]] * 2
    rollouts = []
    for agent_map in (None, threaded_map):
        torch.manual_seed(3)
        options = {"agent_map": agent_map} if agent_map else {}
        spec = RolloutSpec(formatters=tuple(formatters), sampling=SamplingParams(max_new_tokens=16, backend=backend),
                           num_generations=4)
        rollouts.append(rollout_episodes(agents, tokenizers, spec, rows, **options))
    for sequential, threaded in zip(rollouts[0].turns[0].generations, rollouts[1].turns[0].generations):
        assert torch.equal(sequential.completion_ids, threaded.completion_ids)
    # the two agents drew from different streams
    first, second = rollouts[0].turns[0].generations
    assert not torch.equal(first.completion_ids[:, :4], second.completion_ids[:, :4])
