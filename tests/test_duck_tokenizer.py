"""Tokenizers by behaviour (comlrl.tokenizers): an object that is no transformers tokenizer but
provides the protocol trains; one that lacks a member is refused, naming it; the embedding check still
reads the ids the object has."""

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from comlrl.tokenizers import REQUIRED, missing_members, tokenizer_size
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

ARGS = dict(num_agents=2, num_turns=1, num_generations=2, max_new_tokens=6, num_train_epochs=1,
            per_device_train_batch_size=1, temperature=0.7, top_p=0.9, top_k=None, disable_tqdm=True, seed=3)


class DuckTokenizer:
    """Only the protocol, each member handed to a real tokenizer (no transformers base class)."""

    def __init__(self, inner, **overrides):
        self._inner = inner
        self._overrides = overrides

    def __call__(self, texts, **kwargs):
        return self._inner(texts, **kwargs)

    def decode(self, ids, skip_special_tokens=False):
        return self._inner.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def pad_token_id(self):
        return self._overrides.get("pad_token_id", self._inner.pad_token_id)

    @property
    def eos_token_id(self):
        return self._overrides.get("eos_token_id", self._inner.eos_token_id)


class DecodelessTokenizer:
    def __init__(self, inner):
        self._inner = inner
        self.pad_token_id, self.eos_token_id = inner.pad_token_id, inner.eos_token_id

    def __call__(self, texts, **kwargs):
        return self._inner(texts, **kwargs)


def joint_length(completions_0, completions_1):
    return [float(len(a) + len(b)) for a, b in zip(completions_0, completions_1)]


def one_prompt():
    return Dataset.from_dict({"prompt": ["the cat and the dog"]})


def trainer_with(model_dir, tokenizer):
    return MAGRPOTrainer(agents=[model_dir, model_dir], tokenizer=tokenizer, reward_func=joint_length,
                         train_dataset=one_prompt(), args=MAGRPOConfig(**ARGS))


def test_the_duck_is_no_transformers_tokenizer_and_has_only_the_protocol(tiny_llama):
    duck = DuckTokenizer(AutoTokenizer.from_pretrained(tiny_llama))
    assert not isinstance(duck, PreTrainedTokenizerBase)
    assert missing_members(duck) == []
    for absent in ("vocab_size", "batch_decode", "get_vocab", "save_pretrained", "added_tokens_decoder"):
        assert not hasattr(duck, absent)
    assert tokenizer_size(duck) is None  # no __len__, no get_vocab: a checkpoint records None


def test_a_duck_tokenizer_trains_a_step_as_its_real_tokenizer_does(tiny_llama):
    real = AutoTokenizer.from_pretrained(tiny_llama)
    runs = []
    for tokenizer in (real, DuckTokenizer(AutoTokenizer.from_pretrained(tiny_llama))):
        trainer = trainer_with(tiny_llama, tokenizer)
        before = [p.detach().clone() for p in trainer.agents[0].parameters()]
        history = trainer.train()
        after = [p.detach().clone() for p in trainer.agents[0].parameters()]
        runs.append((history, after))
        assert len(history) == 1
        assert any(not torch.equal(b, a) for b, a in zip(before, after)), "the step did not update agent 0"
    (real_history, real_weights), (duck_history, duck_weights) = runs
    assert duck_history[0]["reward_mean"] == real_history[0]["reward_mean"]
    assert all(torch.equal(r, d) for r, d in zip(real_weights, duck_weights))


def test_an_object_without_decode_builds_a_trainer_but_train_refuses_it_before_the_first_step(tiny_llama, tmp_path):
    """As in comlrl 1.4.3, building a trainer reads only the tokenizer's attributes; ``train()`` needs the whole
    protocol and refuses before any work, naming the member, the agent and what a tokenizer must provide."""
    trainer = trainer_with(tiny_llama, DecodelessTokenizer(AutoTokenizer.from_pretrained(tiny_llama)))
    before = [p.detach().clone() for p in trainer.agents[0].parameters()]
    with pytest.raises(ValueError, match=r"agent_0 \(DecodelessTokenizer\) lacks decode, which training needs") as error:
        trainer.train(checkpoint_dir=tmp_path / "checkpoints")
    assert ", ".join(REQUIRED) in str(error.value)
    assert trainer.state.global_step == 0 and not (tmp_path / "checkpoints").exists()
    assert all(torch.equal(b, a) for b, a in zip(before, trainer.agents[0].parameters()))


def test_a_list_names_the_entry_that_lacks_a_member(tiny_llama):
    real = AutoTokenizer.from_pretrained(tiny_llama)
    with pytest.raises(ValueError, match=r"tokenizer\[1\] \(str\) lacks pad_token_id, eos_token_id, which building "
                                         r"the trainer needs"):
        trainer_with(tiny_llama, [real, "not a tokenizer"])


def test_the_ids_in_use_are_still_checked_against_the_embeddings(tiny_llama):
    inner = AutoTokenizer.from_pretrained(tiny_llama)
    with pytest.raises(ValueError, match=r"eos token None \(id 500\) .*embeds only 96 tokens"):
        trainer_with(tiny_llama, DuckTokenizer(inner, eos_token_id=500))


def test_a_vocab_size_is_checked_when_the_object_tells_it(tiny_llama):
    class DuckWithVocabulary(DuckTokenizer):
        vocab_size = 200

    with pytest.raises(ValueError, match=r"has 200 tokens but the model .* embeds only 96"):
        trainer_with(tiny_llama, DuckWithVocabulary(AutoTokenizer.from_pretrained(tiny_llama)))


def test_save_model_names_save_pretrained_when_the_object_lacks_it(tiny_llama, tmp_path):
    trainer = trainer_with(tiny_llama, DuckTokenizer(AutoTokenizer.from_pretrained(tiny_llama)))
    with pytest.raises(ValueError, match="lacks save_pretrained"):
        trainer.save_model(tmp_path / "export")
    assert (tmp_path / "export" / "agent_0" / "config.json").exists()  # the model itself was written
