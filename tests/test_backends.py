"""Both generation backends sample what SamplingParams says, whatever the model's generation_config holds;
the update's log-probs are those of that distribution, and LoRA actors keep only the logits they need."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from comlrl.rollout.generation import position_ids_from_mask
from comlrl.training.logprobs import completion_logits, completion_logprobs, token_logprobs
from comlrl.rollout.generation import _generation_config, encode_prompts, generate_completions
from comlrl.rollout.sampling import SamplingParams
from comlrl.tiny import save_tiny_model

PROMPTS = ["the agent", "write a long story about the moon and the sun"]


@pytest.fixture(scope="module")
def opinionated_model(tmp_path_factory) -> str:
    """A tiny model whose generation_config.json, like many hub models', sets its own sampling."""
    directory = save_tiny_model(tmp_path_factory.mktemp("models") / "opinionated", "llama", vocab_size=96, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    word = tokenizer.convert_tokens_to_ids("▁the")
    GenerationConfig(
        do_sample=True, temperature=0.1, top_k=3, top_p=0.5, min_p=0.2, typical_p=0.5, epsilon_cutoff=0.01,
        repetition_penalty=5.0, no_repeat_ngram_size=1, min_new_tokens=4, min_length=8,
        bad_words_ids=[[word]], suppress_tokens=[word + 1], begin_suppress_tokens=[word + 2],
        forced_eos_token_id=tokenizer.eos_token_id, exponential_decay_length_penalty=(1, 1.5),
        sequence_bias=[[[word + 3], 4.0]], renormalize_logits=True, max_length=7,
        output_scores=True, return_dict_in_generate=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    ).save_pretrained(directory)
    return str(directory)


def load(directory):
    return AutoModelForCausalLM.from_pretrained(directory).eval(), AutoTokenizer.from_pretrained(directory)


SETTINGS = [
    SamplingParams(max_new_tokens=16),
    SamplingParams(max_new_tokens=16, temperature=0.7, top_k=5, top_p=0.9),
    SamplingParams(max_new_tokens=8, do_sample=False),
]


@pytest.mark.parametrize("sampling", SETTINGS, ids=["plain", "warped", "greedy"])
def test_backends_ignore_the_models_generation_config(opinionated_model, sampling):
    model, tokenizer = load(opinionated_model)
    assert model.generation_config.repetition_penalty == 5.0  # the hub-style settings were loaded
    num_generations = 3 if sampling.do_sample else 1
    draws = {}
    for model_config in ("own", "neutral"):
        if model_config == "neutral":
            model.generation_config = GenerationConfig()
        for backend in ("comlrl", "transformers"):
            torch.manual_seed(0)
            draws[model_config, backend] = generate_completions(
                model, tokenizer, PROMPTS, num_generations, SamplingParams(**{**vars(sampling), "backend": backend}))
    reference = draws["neutral", "comlrl"]
    for generated in draws.values():
        assert torch.equal(generated.completion_ids, reference.completion_ids)
        assert torch.equal(generated.completion_mask, reference.completion_mask)
    if sampling.do_sample:  # an EOS was drawn, so min_new_tokens-style rules would have shown
        assert (reference.completion_mask == 0).any()


def test_update_logprobs_are_those_generate_samples_from(opinionated_model):
    """Per-token log-probs of the update equal generate's (warped) scores at the drawn tokens."""
    model, tokenizer = load(opinionated_model)
    sampling = SamplingParams(max_new_tokens=12, temperature=0.7, backend="transformers")
    ids, mask = encode_prompts(tokenizer, PROMPTS, torch.device("cpu"))
    config = _generation_config(tokenizer, sampling, 2)
    config.output_scores, config.return_dict_in_generate = True, True
    torch.manual_seed(0)
    with torch.no_grad():
        output = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        completion_ids = output.sequences[:, ids.shape[1]:]
        completion_mask = (completion_ids != tokenizer.pad_token_id).long()
        sampled = token_logprobs(torch.stack(output.scores, dim=1).log_softmax(dim=-1), completion_ids)
        ours = completion_logprobs(model, ids.repeat_interleave(2, dim=0), mask.repeat_interleave(2, dim=0),
                                   completion_ids, completion_mask, temperature=sampling.temperature)
    kept = completion_mask.bool()
    assert torch.isfinite(sampled[kept]).all()
    assert torch.allclose(ours[kept], sampled[kept], atol=1e-5)


def test_lora_actors_compute_only_the_completion_logits(tiny_llama):
    from comlrl.models.lora import add_adapters

    model, tokenizer = load(tiny_llama)
    model = add_adapters(model, rank=4, alpha=8.0, dropout=0.0, target_modules=None)
    with torch.no_grad():
        for name, parameter in model.named_parameters():  # non-zero adapters, so LoRA changes the logits
            if "lora_B" in name:
                parameter.normal_(std=0.1)
    prompt_ids, prompt_mask = encode_prompts(tokenizer, PROMPTS, torch.device("cpu"))
    completion_ids = torch.randint(5, len(tokenizer), (len(PROMPTS), 6))
    completion_mask = torch.ones_like(completion_ids)
    positions = []
    hook = model.get_base_model().lm_head.register_forward_hook(lambda module, args, out: positions.append(out.shape[1]))
    with torch.no_grad():
        ours = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature=0.8)
    hook.remove()
    assert positions == [completion_ids.shape[1] + 1]
    assert completion_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask).shape[1] == 6

    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention = torch.cat([prompt_mask, completion_mask], dim=1)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=attention, position_ids=position_ids_from_mask(attention)).logits
    expected = token_logprobs(full[:, prompt_ids.shape[1] - 1:-1].float() / 0.8, completion_ids)
    assert torch.allclose(ours, expected, atol=1e-6)
