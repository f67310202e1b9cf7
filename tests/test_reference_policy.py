"""The frozen reference of the KL penalty and DPO (comlrl/training/reference.py) against log-probabilities
computed in the test from the models' logits: which model each kind of reference is, that a LoRA agent's
reference is its base with the adapters off, load options, and the KL terms and their means."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from comlrl.models import lora
from comlrl.rollout.generation import Generation
from comlrl.training.reference import ReferencePolicy, ReferenceTerms, reference_terms


def generation_of(ids: list[list[int]], prompt_length: int) -> Generation:
    ids = torch.tensor(ids)
    return Generation(prompt_ids=ids[:, :prompt_length], prompt_mask=torch.ones_like(ids[:, :prompt_length]),
                      completion_ids=ids[:, prompt_length:], completion_mask=torch.ones_like(ids[:, prompt_length:]),
                      texts=["", ""], num_generations=1)


def logprobs_by_hand(model, generation: Generation, temperature: float) -> torch.Tensor:
    """Each completion token's log-probability: the logits before it, divided by the temperature."""
    ids = torch.cat([generation.prompt_ids, generation.completion_ids], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float() / temperature
    start = generation.prompt_ids.shape[1]
    predicted = logits[:, start - 1:-1].log_softmax(-1)
    return predicted.gather(-1, generation.completion_ids.unsqueeze(-1)).squeeze(-1)


GENERATION = generation_of([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]], prompt_length=2)


def test_a_copy_is_the_agents_weights_now_frozen(tiny_llama):
    agent = AutoModelForCausalLM.from_pretrained(tiny_llama)
    reference = ReferencePolicy.for_agent(agent)
    assert reference.kind == "copy" and not reference.shares_agent and reference.model is not agent
    assert ReferencePolicy(agent).kind == "copy"  # built directly: a model of its own, not sharing the agent
    assert not reference.model.training and not any(p.requires_grad for p in reference.model.parameters())
    with torch.no_grad():
        for parameter in agent.parameters():
            parameter.add_(0.5)  # the agent trains on; the reference keeps the weights it was built from
    expected = logprobs_by_hand(AutoModelForCausalLM.from_pretrained(tiny_llama), GENERATION, 0.7)
    torch.testing.assert_close(reference.logprobs(GENERATION, 0.7), expected, rtol=1e-5, atol=1e-5)


def test_a_source_is_loaded_with_the_load_options_or_taken_as_given(tiny_llama, tiny_llama_b):
    agent = AutoModelForCausalLM.from_pretrained(tiny_llama)
    loaded = ReferencePolicy.for_agent(agent, tiny_llama_b, load_kwargs={"dtype": torch.float64})
    assert loaded.kind == "source" and not loaded.shares_agent
    assert next(loaded.model.parameters()).dtype == torch.float64
    expected = logprobs_by_hand(AutoModelForCausalLM.from_pretrained(tiny_llama_b, dtype=torch.float64), GENERATION,
                                1.0)
    torch.testing.assert_close(loaded.logprobs(GENERATION), expected.float(), rtol=1e-5, atol=1e-5)
    given = AutoModelForCausalLM.from_pretrained(tiny_llama_b)
    taken = ReferencePolicy.for_agent(agent, given)
    assert taken.kind == "source" and taken.model is given and not any(p.requires_grad for p in given.parameters())


def test_a_lora_agents_reference_is_its_base_with_the_adapters_off(tiny_llama):
    base = AutoModelForCausalLM.from_pretrained(tiny_llama)
    expected = logprobs_by_hand(copy.deepcopy(base), GENERATION, 1.0)
    agent = lora.add_adapters(base, rank=4, alpha=8.0, dropout=0.5, target_modules=None)
    with torch.no_grad():  # trained adapters: the agent's policy is no longer the base's
        for name, parameter in agent.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.5)
    agent.train()  # the agent trains with dropout; the reference's forward is without it
    reference = ReferencePolicy.for_agent(agent)
    assert reference.kind == "adapters_off" and reference.shares_agent and reference.model is agent
    torch.testing.assert_close(reference.logprobs(GENERATION), expected, rtol=1e-5, atol=1e-5)
    adapted = logprobs_by_hand(agent.eval(), GENERATION, 1.0)
    assert not torch.allclose(adapted, expected, atol=1e-3)  # so the adapters were really switched off


def test_the_kl_terms_and_their_means(tiny_llama, tiny_llama_b):
    agents = [AutoModelForCausalLM.from_pretrained(tiny_llama), AutoModelForCausalLM.from_pretrained(tiny_llama)]
    references = [ReferencePolicy.for_agent(agents[0]),  # itself: KL 0
                  ReferencePolicy.for_agent(agents[1], tiny_llama_b)]
    generations = [[GENERATION], [GENERATION]]
    for autocast in (None, torch.bfloat16):  # the reference is read at the agent's precision
        terms = reference_terms(agents, references, generations, 1.0, autocast)
        assert terms.kl[0][0].tolist() == [0.0, 0.0]
    terms = reference_terms(agents, references, generations, 1.0)
    policy = logprobs_by_hand(agents[1], GENERATION, 1.0)
    other = logprobs_by_hand(references[1].model, GENERATION, 1.0)
    k3 = (torch.exp(other - policy) - (other - policy) - 1).sum(dim=1)  # per completion, over its tokens
    torch.testing.assert_close(terms.kl[1][0], k3, rtol=1e-4, atol=1e-6)
    assert terms.mean_kl(0) == 0.0
    assert terms.mean_kl(1) == pytest.approx(float(k3.mean()), rel=1e-4)
    assert terms.mean_kl() == pytest.approx(float(k3.sum() / 4), rel=1e-4)  # all four completions


def test_mean_kl_by_hand():
    terms = ReferenceTerms(behaviour=[], reference=[],
                           kl=[[torch.tensor([1.0, 3.0]), torch.tensor([5.0])], [torch.tensor([10.0])], []])
    assert terms.mean_kl(0) == 3.0 and terms.mean_kl(1) == 10.0 and terms.mean_kl() == 4.75
    assert terms.mean_kl(2) == 0.0  # an agent with no completions
