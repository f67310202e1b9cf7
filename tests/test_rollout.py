"""Generation and log-probabilities agree with what generate itself computed."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.training.logprobs import completion_logprobs
from comlrl.rollout.generation import SamplingParams, completion_mask, encode_prompts, generate_completions

PROMPTS = ["the agent", "write a long story about the moon and the sun"]


def test_completion_mask_stops_after_first_eos():
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8]])
    assert completion_mask(ids, 2).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_gpt2"])
def test_logprobs_match_generation_scores_with_left_padding(fixture, request):
    directory = request.getfixturevalue(fixture)
    model = AutoModelForCausalLM.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    prompt_ids, prompt_mask = encode_prompts(tokenizer, PROMPTS, torch.device("cpu"))
    assert (prompt_mask[0] == 0).any(), "the short prompt must be left-padded for this test to mean anything"
    torch.manual_seed(0)
    out = model.generate(
        input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True, top_k=0, max_new_tokens=8,
        output_scores=True, return_dict_in_generate=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    completion = out.sequences[:, prompt_ids.shape[1]:]
    expected = torch.stack(out.scores, 1).log_softmax(-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    mask = completion_mask(completion, tokenizer.eos_token_id)
    actual = completion_logprobs(model, prompt_ids, prompt_mask, completion, mask)
    assert ((actual - expected).abs() * mask).max() < 1e-4


def test_generate_completions_layout(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    torch.manual_seed(0)
    generation = generate_completions(model, tokenizer, PROMPTS, 3, SamplingParams(max_new_tokens=6, top_k=20))
    assert generation.completion_ids.shape[0] == 6 and generation.completion_ids.shape[1] <= 6
    assert len(generation.texts) == 6
    # rows p*3..p*3+2 share prompt p
    assert torch.equal(generation.prompt_ids[0], generation.prompt_ids[2])
    assert not torch.equal(generation.prompt_ids[2], generation.prompt_ids[3])
    # tokens after EOS are padding
    padded = generation.completion_ids[generation.completion_mask == 0]
    assert (padded == tokenizer.pad_token_id).all()


def test_prompt_truncation_keeps_the_end(tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    ids, _ = encode_prompts(tokenizer, ["the agents write a short story"], torch.device("cpu"), max_prompt_length=3)
    full, _ = encode_prompts(tokenizer, ["the agents write a short story"], torch.device("cpu"))
    assert ids.tolist()[0] == full.tolist()[0][-3:]
