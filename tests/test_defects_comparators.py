"""Issue 27, defect 1: every comparator kind stores its completions' token IDs as the policy stores its own
(the sampled IDs up to and including EOS), so a DPO pair's two sides are scored alike.

The comparator models here are EOS-prone (about half their 6-token completions end in EOS), so a side that
loses its EOS shows; the API comparator is a real HTTP endpoint on loopback serving such a model.
"""

from __future__ import annotations

import logging
import zlib

import pytest
from loopback_http import JSONEndpoint, Reply
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.data import format_prompt
from comlrl.rollout.episodes import rollout_episodes
from comlrl.rollout.generation import generate_completions
from comlrl.rollout.sampling import SamplingParams
from comlrl.tasks.letters import letters_reward
from comlrl.tiny import save_tiny_model
from comlrl.trainers.preference import MADPOIterConfig, MADPOIterTrainer
from comlrl.trainers.preference.comparators import sampled_ids

PROMPTS = ["write about the cat", "write about the sun", "write about the tree", "write about the road"]
ROWS = [{"prompt": p} for p in PROMPTS]
TINY = dict(num_agents=2, num_generations=3, max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=None,
            num_iterations=1, pair_selection="reward_gap", dpo_batch_size=4, disable_tqdm=True, seed=3)


def eos_prone(directory, architecture: str, vocab_size: int) -> str:
    """A tiny model whose EOS logit is raised: every embedding gets a constant first coordinate (a shift of all
    logits alike, through the tied output head) and EOS a slightly larger one (measured: about half the six-token
    completions end in EOS). Built with seed 0, the tokenizer is the agents' (tiny_llama's, for "llama"); the
    weights are redrawn with seed 1."""
    path = save_tiny_model(directory, architecture, vocab_size=vocab_size, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(1)
    model.apply(model._init_weights)
    with torch.no_grad():
        embeddings = model.get_input_embeddings().weight
        embeddings[:, 0] = 1.0
        embeddings[tokenizer.eos_token_id, 0] = 1.4
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def eos_llama(tmp_path_factory) -> str:
    """The agents' (tiny_llama's) vocabulary, other weights."""
    return eos_prone(tmp_path_factory.mktemp("eos") / "llama", "llama", 96)


@pytest.fixture(scope="module")
def eos_gpt2(tmp_path_factory) -> str:
    """Another vocabulary (128 tokens): its IDs mean other tokens to the agents."""
    return eos_prone(tmp_path_factory.mktemp("eos") / "gpt2", "gpt2", 128)


def build(model: str, **options) -> MADPOIterTrainer:
    return MADPOIterTrainer(agent_model=model, reward_func=letters_reward, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                            args=MADPOIterConfig(**{**TINY, **options}))


def comparator_rollout(trainer: MADPOIterTrainer, seed: int):
    """What the comparator samples, and the same draw made again by hand (the rollout seeds its agents'
    generators from the global RNG)."""
    policy = trainer.policy_trainer
    spec = policy.rollout_spec.replace(num_turns=1, joint_mode="aligned")
    comparator = trainer.comparator
    torch.manual_seed(seed)
    samples = comparator.sample(policy, spec, ROWS, list(range(len(ROWS))))
    torch.manual_seed(seed)
    rollout = rollout_episodes(comparator.models, comparator.tokenizers, spec, ROWS, list(range(len(ROWS))),
                               policy.agent_map)
    return samples, rollout.turns[0].generations


def ends_in_eos(ids: list[list[list[int]]], eos: int) -> list[bool]:
    return [bool(row) and row[-1] == eos for agent in ids for row in agent]


def test_model_comparator_with_the_agents_vocabulary_stores_the_sampled_ids(tiny_llama, eos_llama):
    trainer = build(tiny_llama, comparator_policy="model", comparator_model_name=eos_llama)
    assert trainer.comparator.tokenizers[0].get_vocab() == trainer.policy_trainer.tokenizers[0].get_vocab()
    samples, generations = comparator_rollout(trainer, seed=11)
    policy_would_store = [sampled_ids(generation) for generation in generations]
    assert samples.token_ids == policy_would_store
    ended = ends_in_eos(samples.token_ids, trainer.policy_trainer.tokenizers[0].eos_token_id)
    assert 3 <= sum(ended) <= len(ended) - 3  # the check sees both kinds of rows


def test_model_comparator_with_another_vocabulary_retokenizes_and_keeps_eos(tiny_llama, eos_gpt2):
    trainer = build(tiny_llama, comparator_policy="model", comparator_model_name=eos_gpt2)
    samples, generations = comparator_rollout(trainer, seed=11)
    agent_tokenizer = trainer.policy_trainer.tokenizers[0]
    own_eos = trainer.comparator.tokenizers[0].eos_token_id
    expected = []
    for generation in generations:
        rows = []
        for text, ids in zip(generation.texts, sampled_ids(generation)):
            finished = ids[-1] == own_eos
            rows.append(agent_tokenizer(text, add_special_tokens=False)["input_ids"]
                        + ([agent_tokenizer.eos_token_id] if finished else []))
        expected.append(rows)
    assert samples.token_ids == expected
    ended = ends_in_eos(samples.token_ids, agent_tokenizer.eos_token_id)
    assert ended == ends_in_eos([sampled_ids(g) for g in generations], own_eos)
    assert 3 <= sum(ended) <= len(ended) - 3


def test_history_comparator_stores_the_sampled_ids(eos_llama, tmp_path):
    trainer = build(eos_llama, comparator_policy="history", comparator_history_k=1, output_dir=str(tmp_path))
    trainer.comparator.directory = tmp_path / "policies"  # what a run sets once its output directory is known
    trainer.comparator.begin(0, trainer.policy_trainer)
    try:
        samples, generations = comparator_rollout(trainer, seed=11)
    finally:
        trainer.comparator.end()
    assert samples.token_ids == [sampled_ids(generation) for generation in generations]
    ended = ends_in_eos(samples.token_ids, trainer.policy_trainer.tokenizers[0].eos_token_id)
    assert 3 <= sum(ended) <= len(ended) - 3


# ----- the API comparator against a real local endpoint --------------------------------------------
class EndpointServer(JSONEndpoint):
    """An OpenAI-compatible chat endpoint on 127.0.0.1 serving a tiny model, seeded by the prompt; it reports
    ``finish_reason`` ("stop" when the completion ended in EOS, "length" when it ran out of max_tokens) unless
    ``report_finish`` is off."""

    def __init__(self, model_dir: str) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.report_finish = True
        self.served: dict[str, list[tuple[str, bool]]] = {}
        self.start()

    def answer(self, path: str, headers: dict[str, str], body: dict) -> Reply:
        prompt = body["messages"][0]["content"]
        sampling = SamplingParams(temperature=body["temperature"], top_p=body["top_p"],
                                  max_new_tokens=body["max_tokens"])
        generator = torch.Generator().manual_seed(zlib.crc32(prompt.encode()))
        with torch.no_grad():
            generation = generate_completions(self.model, self.tokenizer, [prompt], body["n"], sampling,
                                              generator=generator)
        finished = [ids[-1] == self.tokenizer.eos_token_id for ids in sampled_ids(generation)]
        self.served[prompt] = list(zip(generation.texts, finished))
        choices = []
        for index, (text, stop) in enumerate(zip(generation.texts, finished)):
            choice = {"index": index, "message": {"role": "assistant", "content": text}}
            if self.report_finish:
                choice["finish_reason"] = "stop" if stop else "length"
            choices.append(choice)
        return Reply.json({"object": "chat.completion", "choices": choices})


@pytest.fixture(scope="module")
def endpoint(eos_llama):
    server = EndpointServer(eos_llama)
    yield server
    server.close()


def api_samples(trainer: MADPOIterTrainer):
    policy = trainer.policy_trainer
    spec = policy.rollout_spec.replace(num_turns=1, joint_mode="aligned")
    return trainer.comparator.sample(policy, spec, ROWS, list(range(len(ROWS))))


def test_api_comparator_appends_eos_when_the_endpoint_says_the_completion_stopped(tiny_llama, endpoint):
    endpoint.report_finish = True
    trainer = build(tiny_llama, comparator_policy="api", comparator_api_url=endpoint.url, comparator_api_retries=0)
    samples = api_samples(trainer)
    policy = trainer.policy_trainer
    for agent, tokenizer in enumerate(policy.tokenizers):
        expected = []
        for label, row in enumerate(ROWS):  # the endpoint's answers to this agent's prompt, in order
            prompt = format_prompt(policy.rollout_spec.formatters[agent], row, agent, label)
            expected += [tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if stop else [])
                         for text, stop in endpoint.served[prompt]]
        assert samples.token_ids[agent] == expected
    ended = ends_in_eos(samples.token_ids, policy.tokenizers[0].eos_token_id)
    assert 3 <= sum(ended) <= len(ended) - 3


def test_api_comparator_without_finish_reason_stores_no_eos_and_warns_once(tiny_llama, endpoint, caplog):
    endpoint.report_finish = False
    try:
        trainer = build(tiny_llama, comparator_policy="api", comparator_api_url=endpoint.url, comparator_api_retries=0)
        with caplog.at_level(logging.WARNING, logger="comlrl.trainers.preference.comparators"):
            samples = api_samples(trainer)
            api_samples(trainer)
    finally:
        endpoint.report_finish = True
    tokenizer = trainer.policy_trainer.tokenizers[0]
    assert samples.token_ids[0] == [tokenizer(t, add_special_tokens=False)["input_ids"] for t in samples.texts[0]]
    warnings = [r.getMessage() for r in caplog.records if "finish_reason" in r.getMessage()]
    assert len(warnings) == 1 and endpoint.url in warnings[0]
