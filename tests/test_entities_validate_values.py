"""What the entity rules, a checkpoint's checks and one agent's generation give, against values written out here.

Entities: every refusal of ``comlrl.models.entities`` word for word (the field, the values seen), the names a model
source goes by, the tokenizers and models a trainer is given. Checkpoints: one real checkpoint, damaged one way per
case (re-sealed, so that the check itself must find it), and each part of ``comlrl.checkpointing.validate`` on
values written here, each refusal naming the checkpoint, the file and the problem in its words. Generation: the
prompts' left padding, the completions of both backends against a greedy decode written out here, the mask and the
padding after an EOS, the draws a generator makes.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from comlrl.checkpointing import validate
from comlrl.checkpointing.history import HISTORY_DIR
from comlrl.checkpointing.manifest import seal
from comlrl.errors import CheckpointError
from comlrl.models import entities
from comlrl.progress import TrainerState
from comlrl.rollout import generation
from comlrl.rollout.generation import SamplingParams, generate_completions
from comlrl.tiny import build_tiny_qwen2_tokenizer, save_tiny_model
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

CPU = torch.device("cpu")


# ===== entities ====================================================================================
@pytest.fixture(scope="module")
def llama(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama), AutoTokenizer.from_pretrained(tiny_llama)


def test_model_name_of_each_kind_of_source(tiny_llama, llama):
    model = llama[0]
    assert entities.model_name("some/id") == "some/id"
    assert entities.model_name(model) == tiny_llama
    assert entities.model_name(object()) is None
    assert entities.model_name(SimpleNamespace(name_or_path="")) is None


def test_infer_model_name_as_comlrl_1_4_3_did(tiny_llama, llama):
    model = llama[0]
    assert entities.infer_model_name(None) is None
    assert entities.infer_model_name("org/model") == "org/model"
    assert entities.infer_model_name(model) == "llama"  # the base model's model_type
    # A base model whose config has no model_type: its _name_or_path.
    unnamed = PretrainedConfig(name_or_path="from-path")
    assert entities.infer_model_name(SimpleNamespace(base_model=SimpleNamespace(config=unnamed))) == "from-path"
    # No base model config: the config of .model (its _name_or_path first), else of .base_model, else its own.
    assert entities.infer_model_name(SimpleNamespace(model=model)) == tiny_llama
    assert entities.infer_model_name(SimpleNamespace(model=SimpleNamespace(config=PretrainedConfig()))) == (
        "SimpleNamespace")
    typed = PretrainedConfig()
    typed.model_type = "typed"
    assert entities.infer_model_name(SimpleNamespace(model=SimpleNamespace(config=typed))) == "typed"
    assert entities.infer_model_name(SimpleNamespace(base_model=SimpleNamespace(config=None))) == "SimpleNamespace"
    # The base model's config comes first, and a config object need not have both names.
    inner = SimpleNamespace(config=PretrainedConfig(name_or_path="inner"))
    assert entities.infer_model_name(SimpleNamespace(base_model=SimpleNamespace(config=unnamed), model=inner)) == (
        "from-path")
    assert entities.infer_model_name(SimpleNamespace(base_model=SimpleNamespace(config=SimpleNamespace(
        _name_or_path="only-path")))) == "only-path"
    assert entities.infer_model_name(SimpleNamespace(base_model=SimpleNamespace(config=SimpleNamespace(model_type="")),
                                                     model=inner)) == "inner"
    assert entities.infer_model_name(SimpleNamespace(config=PretrainedConfig(name_or_path="own"))) == "own"

    class Bare:
        pass

    assert entities.infer_model_name(Bare()) == "Bare"
    assert entities.infer_model_name(SimpleNamespace(model=Bare())) == "Bare"
    assert entities.infer_model_name(SimpleNamespace(base_model=Bare())) == "Bare"
    assert entities.infer_model_name(SimpleNamespace(model=SimpleNamespace(config=Bare()))) == "SimpleNamespace"


def test_agent_model_and_its_older_name(tiny_llama, llama):
    model = llama[0]
    assert entities.agent_model_argument("a", None) == "a"
    assert entities.agent_model_argument(None, "b") == "b"
    assert entities.agent_model_argument("a", "a") == "a"
    assert entities.agent_model_argument(Path("/x/y"), "/x/y") == "/x/y"
    assert entities.agent_model_argument(model, model) is model
    with pytest.raises(ValueError) as error:
        entities.agent_model_argument("a", "b")
    assert str(error.value) == ("agent_model='a' and model='b' disagree: model is the older name of agent_model "
                                "(comlrl before 1.4); give one of them")
    with pytest.raises(ValueError) as error:
        entities.agent_model_argument(model, "b")
    assert str(error.value).startswith(f"agent_model=<LlamaForCausalLM {tiny_llama!r}> and model='b' disagree")


def test_num_agents_from_the_constructor_and_the_config():
    assert entities.resolve_num_agents(None, 3, "MAGRPOConfig") == 3
    assert entities.resolve_num_agents(2, 2, "MAGRPOConfig") == 2
    assert entities.resolve_num_agents(1, 1, "MAGRPOConfig") == 1
    for bad in (True, 0, -1, "2", 2.0):
        with pytest.raises(ValueError) as error:
            entities.resolve_num_agents(bad, 2, "MAGRPOConfig")
        assert str(error.value) == f"num_agents must be a positive integer, got {bad!r}"
    with pytest.raises(ValueError) as error:
        entities.resolve_num_agents(3, 2, "IACConfig")
    assert str(error.value) == (
        "num_agents must match args.num_agents: num_agents=3 (constructor) disagrees with IACConfig.num_agents=2; "
        "set both to the same value (the config alone never overrides the constructor argument)")


def test_num_agents_and_agents_cannot_be_replaced():
    entities.keep_num_agents("MAGRPOTrainer", 2, 2)
    for bad in (3, True, "2"):
        with pytest.raises(ValueError) as error:
            entities.keep_num_agents("MAGRPOTrainer", 1 if bad is True else 2, bad)
        current = 1 if bad is True else 2
        assert str(error.value) == (
            f"MAGRPOTrainer.num_agents is {current}, fixed at construction with its {current} agents; it cannot "
            f"become {bad!r}: construct a new trainer with num_agents={bad!r} (and args.num_agents={bad!r})")
    a, b = object(), object()
    entities.keep_agents("IACTrainer", [a, b], [a, b])
    entities.keep_agents("IACTrainer", [a, b], (a, b))
    for bad in ([a], [b, a], [a, copy.copy(b)], {0: a, 1: b}, "ab"):
        with pytest.raises(ValueError) as error:
            entities.keep_agents("IACTrainer", [a, b], bad)
        assert str(error.value) == (
            f"IACTrainer.agents are the 2 models loaded at construction, which its optimizers and checkpoints hold; "
            f"they cannot be replaced by {type(bad).__name__} {repr(bad)[:120]}: construct a new trainer with "
            "agents=[...] instead")
    long = ["x" * 200]
    with pytest.raises(ValueError) as error:
        entities.keep_agents("IACTrainer", [a], long)
    assert f"list {repr(long)[:120]}: construct" in str(error.value)


def test_some_model_is_required():
    entities.require_sources("a", None)
    entities.require_sources(None, ["a"])
    with pytest.raises(ValueError) as error:
        entities.require_sources(None, None)
    assert str(error.value) == "Either agent_model or agents must be provided (both are None)"
    with pytest.raises(ValueError) as error:
        entities.require_sources(None, None, "critic_model", "critics")
    assert str(error.value) == "Either critic_model or critics must be provided (both are None)"
    with pytest.raises(ValueError) as error:
        entities.resolve_model_list(None, None, 2, "critic_model", "critics")
    assert str(error.value) == "Either critic_model or critics must be provided (both are None)"


def test_the_model_list_from_the_shortcut_or_the_list(tiny_llama, llama):
    model = llama[0]
    assert entities.resolve_model_list("m", None, 3) == ["m", "m", "m"]
    assert entities.resolve_model_list(Path("/m"), None, 2) == ["/m", "/m"]
    assert entities.resolve_model_list(None, ("a", Path("/b")), 2) == ["a", "/b"]
    assert entities.resolve_model_list(Path("/m"), [Path("/m"), "/m"], 2) == ["/m", "/m"]
    assert entities.resolve_model_list(tiny_llama, [model, tiny_llama], 2) == [model, tiny_llama]
    listed = ["a", "b"]
    result = entities.resolve_model_list(None, listed, 2)
    assert result == listed and result is not listed


def test_the_model_list_refusals_word_for_word(tiny_gpt2):
    def words(*args, **kwargs) -> str:
        with pytest.raises(ValueError) as error:
            entities.resolve_model_list(*args, **kwargs)
        return str(error.value)

    assert words(None, "a", 2) == "agents must be a non-empty sequence: a list of models, got str: 'a'"
    assert words(None, {"a": 1}, 1) == "agents must be a non-empty sequence: a list of models, got dict: {'a': 1}"
    assert words(None, ["a", 5], 2) == ("agents[1] must be a model identifier, a local directory or a loaded "
                                        "transformers PreTrainedModel, got int: 5")
    assert words(5, None, 2) == ("agent_model must be a model identifier, a local directory or a loaded "
                                 "transformers PreTrainedModel, got int: 5")
    assert words(5, ["a"], 1) == ("agent_model must be a model identifier, a local directory or a loaded "
                                  "transformers PreTrainedModel, got int: 5")
    assert words(None, ["a"] * 3, 2) == ("agents length (3) must match num_agents (2): agents has 3 entries but "
                                         "the number of agents is 2; give exactly 2")
    assert words("a", ["a"], 2) == (
        "agents length (1) must match num_agents (2) (both model and agents were given: agent_model='a'): agents "
        "has 1 entries but the number of agents is 2; give exactly 2")
    assert words(None, ["c"], 2, "critic_model", "critics", "the critics (2)") == (
        "critics length (1) must match the critics (2): critics has 1 entries but the number of models expected "
        "is 2; give exactly 2")
    assert words("a", ["a", "b", "a", "c"], 4) == (
        "agent_model and agents conflict: a != ['a', 'b', 'a', 'c']; agent_model='a' does not match agents names "
        "['a', 'b', 'a', 'c'] (entries [1, 3] differ); give only one of them, or make the names match")


def test_loading_a_tokenizer_and_a_model(tiny_llama, tmp_path, llama):
    tokenizer = entities.load_tokenizer(tiny_llama)
    assert tokenizer.get_vocab() == llama[1].get_vocab()
    missing = str(tmp_path / "absent")
    with pytest.raises(ValueError) as error:
        entities.load_tokenizer(missing)
    assert str(error.value).startswith(f"could not load a tokenizer from {missing!r}: ")
    with pytest.raises(ValueError) as error:
        entities.load_causal_lm(missing, CPU, torch.float32)
    assert str(error.value).startswith(f"could not load a causal language model from {missing!r}: ")
    loaded = entities.load_causal_lm(tiny_llama, CPU, torch.float64)
    assert {p.dtype for p in loaded.parameters()} == {torch.float64}
    for (name, p), q in zip(loaded.named_parameters(), llama[0].parameters()):
        torch.testing.assert_close(p, q.double(), msg=name)
    given = AutoModelForCausalLM.from_pretrained(tiny_llama)
    moved = entities.load_causal_lm(given, CPU, torch.float64)
    assert moved is given and {p.dtype for p in moved.parameters()} == {torch.float64}


def test_a_tokenizer_without_pad_token_gets_its_eos(tiny_llama, caplog):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.pad_token = None
    eos = tokenizer.eos_token_id
    with caplog.at_level(logging.WARNING, logger="comlrl.models.entities"):
        assert entities.prepare_tokenizer(tokenizer, "agent_1") is tokenizer
    assert tokenizer.pad_token_id == eos and tokenizer.pad_token == "</s>"
    assert [r.getMessage() for r in caplog.records] == [
        "the tokenizer of agent_1 has no pad token; using its EOS token '</s>'"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="comlrl.models.entities"):
        entities.prepare_tokenizer(tokenizer, "agent_1")
    assert caplog.records == []
    tokenizer.pad_token = None
    tokenizer.eos_token = None
    with pytest.raises(ValueError) as error:
        entities.prepare_tokenizer(tokenizer, "critic_0")
    assert str(error.value) == "the tokenizer of critic_0 has neither a pad token nor an EOS token; set one"


class FixedPad:
    """A tokenizer object whose pad token cannot be set, and one whose setting gives no id."""

    eos_token_id = 7
    eos_token = "</s>"
    pad_token_id = None

    def __init__(self, settable: bool):
        self.settable = settable

    @property
    def pad_token(self):
        return None

    @pad_token.setter
    def pad_token(self, value):
        if not self.settable:
            raise AttributeError("read-only")


@pytest.mark.parametrize("settable", [False, True])
def test_a_tokenizer_whose_pad_cannot_be_set_is_refused(settable):
    with pytest.raises(ValueError) as error:
        entities.prepare_tokenizer(FixedPad(settable), "agent_0")
    assert str(error.value) == (
        "the tokenizer of agent_0 (FixedPad) has no pad_token_id, and setting its pad_token to the EOS token "
        "'</s>' did not give it one; set its pad_token_id")


def test_the_chat_template_tokens():
    tokenizer = build_tiny_qwen2_tokenizer()
    vocab = tokenizer.get_vocab()
    start, end, text_end = vocab["<|im_start|>"], vocab["<|im_end|>"], vocab["<|endoftext|>"]
    assert entities.chat_template_tokens(tokenizer) == {start: "<|im_start|>", end: "<|im_end|>"}
    tokenizer.chat_template = {"default": "<|im_start|> x", "tool": "y <|endoftext|>"}
    assert entities.chat_template_tokens(tokenizer) == {start: "<|im_start|>", text_end: "<|endoftext|>"}
    tokenizer.chat_template = [{"name": "a", "template": "<|im_end|>"}, "<|endoftext|>", {"name": "b"}]
    assert entities.chat_template_tokens(tokenizer) == {end: "<|im_end|>", text_end: "<|endoftext|>"}
    tokenizer.chat_template = ("<|im_start|>",)
    assert entities.chat_template_tokens(tokenizer) == {start: "<|im_start|>"}
    tokenizer.chat_template = None
    assert entities.chat_template_tokens(tokenizer) == {}
    tokenizer.chat_template = 5
    assert entities.chat_template_tokens(tokenizer) == {}
    assert entities.chat_template_tokens(SimpleNamespace(chat_template="<a>")) == {}
    assert entities._template_text({"a": "x", "b": ["y", {"template": "z"}]}) == "x\ny\nz"


def test_the_special_tokens_in_use():
    tokenizer = build_tiny_qwen2_tokenizer()
    vocab = tokenizer.get_vocab()
    assert entities.used_special_tokens(tokenizer) == {
        vocab["<|endoftext|>"]: "pad token", vocab["<|im_end|>"]: "eos token", vocab["<|im_start|>"]: "chat template token"}
    listed = SimpleNamespace(pad_token_id=3, eos_token_id=[3, 9], bos_token_id=(4,), chat_template=None)
    assert entities.used_special_tokens(listed) == {3: "pad token", 9: "eos token", 4: "bos token"}
    assert entities.used_special_tokens(SimpleNamespace(pad_token_id=None, eos_token_id=None)) == {}


def test_a_tokenizer_must_fit_the_embeddings(tiny_llama, tiny_gpt2, llama, caplog):
    model = llama[0]
    gpt2_tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2)
    remedy = ("pass that model's own tokenizer, or resize the model's embeddings "
              "(model.resize_token_embeddings(len(tokenizer))) before training")
    with pytest.raises(ValueError) as error:
        entities.check_tokenizer_fits(model, gpt2_tokenizer, "agent_1")
    assert str(error.value) == (
        f"the tokenizer given for agent_1 has 128 tokens but the model {tiny_llama!r} embeds only 96: its "
        f"base-vocabulary ids 96..127 (the first is {gpt2_tokenizer.convert_ids_to_tokens(96)!r}) have no "
        f"embedding row; {remedy}")
    # A base vocabulary exactly the embeddings' size fits; a special token beyond it does not.
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    entities.check_tokenizer_fits(model, tokenizer, "agent_0")
    tokenizer.add_special_tokens({"eos_token": "<end>"})
    assert tokenizer.eos_token_id == 96
    with pytest.raises(ValueError) as error:
        entities.check_tokenizer_fits(model, tokenizer, "agent_0")
    assert str(error.value) == (
        f"the eos token '<end>' (id 96) of the tokenizer given for agent_0 has no embedding row: the model "
        f"{tiny_llama!r} embeds only 96 tokens (ids 0..95); set a token the model embeds instead, or {remedy}")
    # Added tokens never fed warn, in id order.
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.add_tokens(["<b>", "<a>"])
    with caplog.at_level(logging.WARNING, logger="comlrl.models.entities"):
        entities.check_tokenizer_fits(model, tokenizer, "agent_0")
    assert [r.getMessage() for r in caplog.records] == [
        f"the tokenizer given for agent_0 has added tokens beyond the 96 embedding rows of the model {tiny_llama!r}, "
        "which training never feeds it: '<b>' (id 96), '<a>' (id 97); a prompt that contains one is refused when "
        "it is encoded"]
    negative = SimpleNamespace(vocab_size=10, pad_token_id=-1, eos_token_id=None, bos_token_id=None,
                               convert_ids_to_tokens=lambda i: None)
    with pytest.raises(ValueError) as error:
        entities.check_tokenizer_fits(model, negative, "agent_0")
    assert str(error.value).startswith("the pad token None (id -1) of the tokenizer given for agent_0")


def test_the_tokenizers_given_or_loaded(tiny_llama, tiny_gpt2, llama):
    model, tokenizer = llama
    loaded = entities.resolve_tokenizers([tiny_llama, tiny_gpt2], None, False, True, "MAGRPOTrainer")
    assert [t.get_vocab() for t in loaded] == [tokenizer.get_vocab(), AutoTokenizer.from_pretrained(tiny_gpt2).get_vocab()]
    assert entities.resolve_tokenizers([tiny_llama], None, True, False, "IACTrainer")[0].get_vocab() == tokenizer.get_vocab()
    shared = entities.resolve_tokenizers([model, model, tiny_llama], tokenizer, True, True, "MAACTrainer")
    assert len(shared) == 3 and all(t is tokenizer for t in shared)
    other = AutoTokenizer.from_pretrained(tiny_llama)
    assert entities.resolve_tokenizers(["a", "b"], (tokenizer, other), True, True, "IACTrainer") == [tokenizer, other]

    def words(*args) -> str:
        with pytest.raises(ValueError) as error:
            entities.resolve_tokenizers(*args)
        return str(error.value)

    assert words(["a", "b"], None, True, True, "IACTrainer") == (
        "Tokenizer must be provided when using agents: IACTrainer requires an explicit tokenizer when agents is "
        "supplied (even as strings); pass tokenizer=AutoTokenizer.from_pretrained(...) or a list of 2")
    assert words([tiny_llama, model], None, False, True, "MAGRPOTrainer") == (
        "Tokenizer(s) must be provided when agents are model objects: agents[1] is a loaded model object "
        f"(<LlamaForCausalLM {tiny_llama!r}>), so its tokenizer cannot be loaded automatically; pass tokenizer= "
        "(one shared tokenizer or a list of 2)")
    assert words(["a", "b", "c"], [tokenizer], False, False, "MAGRPOTrainer") == (
        "tokenizers length must match agents: tokenizer is a list of 1 but there are 3 agents; give 3")
    # A tokenizer without the protocol is named by the argument it came in (and its place in a list).
    assert words(["a", "b"], [tokenizer, object()], False, False, "MAGRPOTrainer").startswith(
        "the tokenizer given for tokenizer[1] (object) lacks ")
    assert words(["a"], object(), False, False, "MAGRPOTrainer").startswith(
        "the tokenizer given for tokenizer (object) lacks ")


def test_repeated_sources_load_as_independent_copies(tiny_llama, tiny_llama_b, llama):
    tokenizer = llama[1]
    result = entities.load_models([tiny_llama, tiny_llama_b, tiny_llama], [tokenizer] * 3, CPU, torch.float32)
    first, second, third = result.models
    assert result.sources == [tiny_llama, tiny_llama_b, tiny_llama] and result.tokenizers == [tokenizer] * 3
    for p, q, r, s in zip(first.parameters(), third.parameters(), second.parameters(), llama[0].parameters()):
        assert p.data_ptr() != q.data_ptr() and torch.equal(p, q) and torch.equal(p, s)
    assert not all(torch.equal(p, r) for p, r in zip(first.parameters(), second.parameters()))
    given = AutoModelForCausalLM.from_pretrained(tiny_llama)
    objects = entities.load_models([given, given], [tokenizer, tokenizer], [CPU, CPU], torch.float64, role="critic")
    assert objects.models[0] is given and objects.models[1] is not given
    for p, q in zip(objects.models[0].parameters(), objects.models[1].parameters()):
        assert p.dtype == torch.float64 and p.data_ptr() != q.data_ptr() and torch.equal(p, q)
    assert objects.sources == [tiny_llama, tiny_llama]


def test_each_model_is_checked_with_its_own_label(tiny_llama, tiny_gpt2, llama, caplog):
    llama_tokenizer = llama[1]
    gpt2_tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2)
    with pytest.raises(ValueError) as error:
        entities.load_models([tiny_gpt2, tiny_llama], [gpt2_tokenizer, gpt2_tokenizer], CPU, torch.float32,
                             role="critic")
    assert str(error.value).startswith("the tokenizer given for critic_1 has 128 tokens but the model")
    padless = AutoTokenizer.from_pretrained(tiny_llama)
    padless.pad_token = None
    with caplog.at_level(logging.WARNING, logger="comlrl.models.entities"):
        entities.load_models([tiny_llama, tiny_llama], [llama_tokenizer, padless], CPU, torch.float32)
    assert [r.getMessage() for r in caplog.records] == [
        "the tokenizer of agent_1 has no pad token; using its EOS token '</s>'"]


def test_a_tokenizer_object_without_an_eos_text_is_refused_by_its_words(caplog):
    """A tokenizer object (not a transformers one) with an EOS id but no ``eos_token`` attribute: the EOS text is
    None, and the refusal says so."""
    with caplog.at_level(logging.WARNING, logger="comlrl.models.entities"):
        with pytest.raises(ValueError) as error:
            entities.prepare_tokenizer(SimpleNamespace(pad_token_id=None, eos_token_id=7), "agent_0")
    assert str(error.value) == (
        "the tokenizer of agent_0 (SimpleNamespace) has no pad_token_id, and setting its pad_token to the EOS token "
        "None did not give it one; set its pad_token_id")
    assert [r.getMessage() for r in caplog.records] == [
        "the tokenizer of agent_0 has no pad token; using its EOS token None"]


def test_only_template_text_is_searched_for_added_tokens():
    """A template's name is not rendered, and no text is made up for a template that is absent, not a string, or a
    list entry without one: a one-letter added token is found only where a template writes it."""
    tokenizer = build_tiny_qwen2_tokenizer()
    tokenizer.add_tokens(["X"])
    vocab = tokenizer.get_vocab()
    start, end, x = vocab["<|im_start|>"], vocab["<|im_end|>"], vocab["X"]
    tokenizer.chat_template = [{"name": "<|im_start|>", "template": "<|im_end|>"}]
    assert entities.chat_template_tokens(tokenizer) == {end: "<|im_end|>"}
    for template in (None, 5, [{"name": "b"}], [{"name": "b"}, "<|im_start|>"], {"a": None}):
        tokenizer.chat_template = template
        expected = {start: "<|im_start|>"} if template == [{"name": "b"}, "<|im_start|>"] else {}
        assert entities.chat_template_tokens(tokenizer) == expected, template
    tokenizer.chat_template = "say X"
    assert entities.chat_template_tokens(tokenizer) == {x: "X"}


def test_a_tokenizer_object_that_tells_only_its_special_ids(llama):
    """No ``vocab_size`` and no ``added_tokens_decoder``: checked on the special ids it has."""
    model = llama[0]
    entities.check_tokenizer_fits(model, SimpleNamespace(pad_token_id=0, eos_token_id=95, bos_token_id=None), "agent_0")
    with pytest.raises(ValueError) as error:
        entities.check_tokenizer_fits(model, SimpleNamespace(pad_token_id=0, eos_token_id=96, bos_token_id=None),
                                      "agent_0")
    assert str(error.value).startswith("the eos token None (id 96) of the tokenizer given for agent_0 has no embedding "
                                       "row: the model")


@pytest.fixture
def remote_code(tmp_path) -> str:
    """A model directory whose config and tokenizer name code of their own, which raises if it is ever run."""
    directory = tmp_path / "remote"
    directory.mkdir()
    auto_map = {"AutoConfig": "custom.CustomConfig", "AutoModelForCausalLM": "custom.CustomModel",
                "AutoTokenizer": ["custom.CustomTokenizer", None]}
    (directory / "config.json").write_text(json.dumps({"model_type": "comlrl_remote", "auto_map": auto_map}))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "CustomTokenizer",
                                                                 "auto_map": auto_map}))
    (directory / "custom.py").write_text('raise RuntimeError("the directory\'s own code ran")\n')
    return str(directory)


def test_a_directory_with_its_own_code_is_refused_without_running_it_or_asking(remote_code, llama, capsys):
    """By default nothing a model directory ships is run, and nobody is asked on the terminal (transformers asks
    when ``trust_remote_code`` is left unset): each loader refuses with its words and the directory named."""
    tokenizer_words = f"could not load a tokenizer from {remote_code!r}: "
    model_words = f"could not load a causal language model from {remote_code!r}: "
    attempts = [
        (lambda: entities.load_tokenizer(remote_code), tokenizer_words),
        (lambda: entities.load_causal_lm(remote_code, CPU, torch.float32), model_words),
        (lambda: entities.resolve_tokenizers([remote_code], None, False, True, "MAGRPOTrainer"), tokenizer_words),
        (lambda: entities.load_models([remote_code], [llama[1]], CPU, torch.float32), model_words),
    ]
    for attempt, words in attempts:
        with pytest.raises(ValueError) as error:
            attempt()
        assert str(error.value).startswith(words) and "trust_remote_code=True" in str(error.value)
        assert capsys.readouterr().out == "", "nothing is asked on the terminal"


# ===== checkpoints =================================================================================
@pytest.fixture(scope="module")
def run(tiny_llama, tmp_path_factory):
    """One epoch of a real run saved as ``checkpoint-1``, and its trainer."""
    root = tmp_path_factory.mktemp("run")
    trainer = MAGRPOTrainer(
        agent_model=tiny_llama, num_agents=2, train_dataset=Dataset.from_dict({"prompt": ["a b", "c d"]}),
        reward_func=lambda a, b: [float(len(x)) for x in a],
        args=MAGRPOConfig(num_agents=2, num_generations=2, max_new_tokens=4, num_train_epochs=1,
                          per_device_train_batch_size=2, seed=3, disable_tqdm=True))
    trainer.train(checkpoint_dir=root)
    return root / "checkpoint-1", trainer


@pytest.fixture
def checkpoint(run, tmp_path) -> Path:
    saved = run[0]
    target = tmp_path / "checkpoint-1"
    shutil.copytree(saved, target)
    shutil.copytree(saved.parent / HISTORY_DIR, tmp_path / HISTORY_DIR)
    return target


def metadata_of(path: Path) -> dict:
    return json.loads((path / "metadata.json").read_text())


def rewrite(path: Path, edit) -> None:
    """Edit metadata.json with ``edit`` and seal the checkpoint again."""
    metadata = metadata_of(path)
    edit(metadata)
    (path / "metadata.json").write_text(json.dumps(metadata))
    seal(path)


def refusal(path: Path, trainer=None) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        validate.read_checkpoint(path, trainer)
    assert info.value.checkpoint == str(path)
    return info.value


def metadata_refusal(path: Path, edit, trainer=None) -> str:
    """The refusal of metadata.json edited by ``edit`` (then put back as it was)."""
    original = (path / "metadata.json").read_text()
    rewrite(path, edit)
    error = refusal(path, trainer)
    (path / "metadata.json").write_text(original)
    seal(path)
    assert error.file == "metadata.json", error
    return error.problem


def test_a_whole_checkpoint_is_read(checkpoint, run):
    contents = validate.read_checkpoint(checkpoint, run[1])
    assert contents.path == checkpoint and contents.metadata == metadata_of(checkpoint)
    assert [row["step"] for row in contents.history] == [1]
    assert contents.state["progress"] == {**metadata_of(checkpoint)["state"], "history": contents.history} or (
        {k: v for k, v in contents.state["progress"].items() if k != "history"} == metadata_of(checkpoint)["state"])
    validate.check_state_structure(contents, run[1])


def test_the_format_version(checkpoint):
    def edit(value):
        return lambda m: m.update(format_version=value)

    assert metadata_refusal(checkpoint, edit(7)) == (
        "format_version is 7, not this library's format 3 (or the earlier 2); start a new run from the exported "
        "models instead")
    assert metadata_refusal(checkpoint, edit("3")).startswith('format_version is "3", not')
    assert metadata_refusal(checkpoint, edit("x" * 70)).startswith(f'format_version is "{"x" * 56}..., not')
    assert metadata_refusal(checkpoint, lambda m: m.pop("format_version")).startswith("format_version is null, not")


def test_a_checkpoint_that_claims_a_manifest_needs_it(checkpoint, caplog):
    (checkpoint / "manifest.json").unlink()
    error = refusal(checkpoint)
    assert (error.file, error.problem) == (
        "manifest.json", "is missing (metadata.json says the checkpoint was saved with one)")


def test_a_checkpoint_from_before_manifests(checkpoint, run, caplog):
    metadata = metadata_of(checkpoint)
    del metadata["manifest"], metadata["lineage"]
    (checkpoint / "metadata.json").write_text(json.dumps(metadata))
    (checkpoint / "manifest.json").unlink()
    with caplog.at_level(logging.WARNING, logger="comlrl.checkpointing.validate"):
        contents = validate.read_checkpoint(checkpoint, run[1])
    assert contents.metadata == metadata
    assert [r.getMessage() for r in caplog.records] == [
        f"checkpoint {str(checkpoint)!r} has no manifest.json (saved before checkpoints carried one): its files' "
        "sizes and checksums cannot be verified; every other check still applies"]
    metadata["manifest"] = False
    metadata["lineage"] = []
    (checkpoint / "metadata.json").write_text(json.dumps(metadata))
    assert refusal(checkpoint).problem == "lineage is list, expected an object"


def test_sealed_checks_need_their_keys(checkpoint):
    assert metadata_refusal(checkpoint, lambda m: m.pop("lineage")) == "missing key 'lineage'"


def test_unknown_and_missing_keys(checkpoint):
    known = ("boundary, boundary_kind, compat, config, format_version, history, library_version, lineage, "
             "manifest, mlflow, models, state, trainer, wandb")
    assert metadata_refusal(checkpoint, lambda m: m.update(zz=1, extra=2)) == f"unknown key 'extra' (known: {known})"
    assert metadata_refusal(checkpoint, lambda m: (m.pop("models"), m.pop("trainer"))) == "missing key 'trainer'"
    assert metadata_refusal(checkpoint, lambda m: m.pop("history")) == "missing key 'history'"


@pytest.mark.parametrize("key, value, words", [
    ("boundary", "1", 'boundary is "1", expected an integer'),
    ("boundary", True, "boundary is true, expected an integer"),
    ("boundary", 1.0, "boundary is 1.0, expected an integer"),
    ("wandb", 5, "wandb is 5, expected an object or null"),
    ("manifest", 1, "manifest is 1, expected true/false"),
    ("config", [], "config is list, expected an object"),
    ("trainer", None, "trainer is null, expected a string"),
    ("trainer", False, "trainer is false, expected a string"),
    ("boundary", -1, "boundary is -1, expected a non-negative integer"),
])
def test_each_field_has_its_kind(checkpoint, key, value, words):
    assert metadata_refusal(checkpoint, lambda m: m.update({key: value})) == words


def test_the_nullable_fields_accept_null_and_objects(checkpoint):
    rewrite(checkpoint, lambda m: m.update(wandb={"run": "x"}, mlflow=None))
    validate.read_checkpoint(checkpoint)


def test_the_trainer_that_wrote_it(checkpoint, run):
    class IACTrainer:
        state = run[1].state

    assert refusal(checkpoint, IACTrainer()).problem == "it was written by MAGRPOTrainer, not IACTrainer"


def test_the_lineage_and_history_records_are_checked(checkpoint):
    assert metadata_refusal(checkpoint, lambda m: m.update(lineage={"attempt": "x"})) == (
        "lineage must be an object with exactly attempt, ancestors and resumed_from, got {'attempt': 'x'}")
    assert metadata_refusal(checkpoint, lambda m: m["history"].update(rows=-1)) == (
        "history.rows is -1, expected a non-negative integer")


@pytest.mark.parametrize("models, words", [
    ({}, "models is empty: a checkpoint holds at least one model"),
    ({"": None}, "models has an invalid model name ''"),
    ({"a/b": None}, "models has an invalid model name 'a/b'"),
    ({".a": None}, "models has an invalid model name '.a'"),
    ({"a": 5}, "models.a is not a fingerprint {class, num_tensors, shapes} with num_tensors = the number of shapes: 5"),
    ({"a": {"class": 1, "num_tensors": 0, "shapes": {}}}, "models.a is not a fingerprint {class, num_tensors, shapes} "
     "with num_tensors = the number of shapes: dict"),
    ({"a": {"class": "C", "num_tensors": 0, "shapes": []}}, "models.a is not a fingerprint {class, num_tensors, "
     "shapes} with num_tensors = the number of shapes: dict"),
    ({"a": {"class": "C", "num_tensors": 2, "shapes": {"w": [1]}}}, "models.a is not a fingerprint {class, "
     "num_tensors, shapes} with num_tensors = the number of shapes: dict"),
    ({"a": {"class": "C", "num_tensors": 1, "shapes": {"w": "x"}}}, "models.a.shapes['w'] is \"x\", expected a list "
     "of sizes"),
    ({"a": {"class": "C", "num_tensors": 1, "shapes": {"w": [2, -1]}}}, "models.a.shapes['w'] is list, expected a "
     "list of sizes"),
    ({"a": {"class": "C", "num_tensors": 1, "shapes": {"w": [True]}}}, "models.a.shapes['w'] is list, expected a "
     "list of sizes"),
    ({"a": {"class": "C", "num_tensors": 1, "shapes": {"w": [1], "v": [1]}}}, "models.a is not a fingerprint "
     "{class, num_tensors, shapes} with num_tensors = the number of shapes: dict"),
    ({"a": {"class": "C", "num_tensors": 1, "shapes": {"w": [1]}, "dtypes": ["float32"]}}, "models.a.dtypes is "
     "list, expected a torch dtype name for every tensor of shapes"),
    ({"a": {"class": "C", "num_tensors": 1, "shapes": {"w": [1]}, "dtypes": {"v": "float32"}}}, "models.a.dtypes is "
     "dict, expected a torch dtype name for every tensor of shapes"),
    ({"a": {"class": "C", "num_tensors": 1, "shapes": {"w": [1]}, "dtypes": {"w": "Tensor"}}}, "models.a.dtypes is "
     "dict, expected a torch dtype name for every tensor of shapes"),
    ({"a": {"class": "C", "num_tensors": 1, "shapes": {"w": [1]}, "dtypes": {"w": 5}}}, "models.a.dtypes is "
     "dict, expected a torch dtype name for every tensor of shapes"),
])
def test_the_models_record(models, words):
    problems = []

    def fail(problem):
        problems.append(problem)
        raise CheckpointError("c", "metadata.json", problem)

    with pytest.raises(CheckpointError):
        validate.check_models_record(models, fail)
    assert problems == [words]


def test_a_models_record_that_fits():
    good = {"a": {"class": "C", "num_tensors": 2, "shapes": {"w": [0, 3], "b": []}, "dtypes": {"w": "bfloat16",
                                                                                               "b": "int64"}},
            "b_1": {"class": "C", "num_tensors": 0, "shapes": {}}}
    validate.check_models_record(good, lambda problem: pytest.fail(problem))


def failing(problems: list):
    def fail(problem):
        problems.append(problem)
        raise CheckpointError("c", "f", problem)

    return fail


def problem_of(function, *args, **kwargs) -> str:
    problems: list[str] = []
    with pytest.raises(CheckpointError):
        function(*args, failing(problems), **kwargs)
    return problems[0]


FIELDS = "epoch, step_in_epoch, global_step, boundaries, nonfinite_updates, consecutive_nonfinite, pending_evaluation"
PROGRESS = {"epoch": 1, "step_in_epoch": 0, "global_step": 1, "boundaries": 1, "nonfinite_updates": 0,
            "consecutive_nonfinite": 0, "pending_evaluation": 0}


@dataclass
class RoundsState:
    epoch: int = 0
    rounds: list[dict[str, int]] = field(default_factory=list)
    history: list[dict[str, float]] = field(default_factory=list)


def test_the_progress_record():
    fields = validate.progress_fields()
    assert fields == {name: int for name in FIELDS.split(", ")}
    assert validate.progress_fields(SimpleNamespace(state=RoundsState())) == {"epoch": int, "rounds": list}
    assert validate.progress_fields(SimpleNamespace(state={"not": "a dataclass"})) == fields
    ok = lambda problem: pytest.fail(problem)  # noqa: E731
    validate.check_progress(dict(PROGRESS), fields, ok, "state")
    validate.check_progress({k: v for k, v in PROGRESS.items() if k != "pending_evaluation"}, fields, ok, "state")
    validate.check_progress({**PROGRESS, "later": 3, "more": []}, fields, ok, "state", exact=False)
    assert problem_of(lambda fail: validate.check_progress(5, fields, fail, "state")) == (
        "state is 5, expected an object")
    assert problem_of(lambda fail: validate.check_progress({**PROGRESS, "later": 3}, fields, fail, "progress")) == (
        f"progress has an unknown field 'later' (fields: {FIELDS})")
    assert problem_of(lambda fail: validate.check_progress({**PROGRESS, "later": "x"}, fields, fail, "state",
                                                           exact=False)) == (
        f"state has an unknown field 'later' (fields: {FIELDS})")
    assert problem_of(lambda fail: validate.check_progress({**PROGRESS, "later": True}, fields, fail, "state",
                                                           exact=False)) == (
        f"state has an unknown field 'later' (fields: {FIELDS})")
    assert problem_of(lambda fail: validate.check_progress(
        {k: v for k, v in PROGRESS.items() if k != "epoch"}, fields, fail, "state")) == (
        "state is missing the field 'epoch'")
    for bad, shown in ((-1, "-1"), (True, "true"), ("1", '"1"'), (1.0, "1.0")):
        assert problem_of(lambda fail: validate.check_progress({**PROGRESS, "global_step": bad}, fields, fail,
                                                               "state")) == (
            f"state.global_step is {shown}, expected a non-negative integer")
    # A later field absent is skipped, and the fields after it are still checked.
    assert problem_of(lambda fail: validate.check_progress({"epoch": -1}, {"pending_evaluation": int, "epoch": int},
                                                           fail, "state")) == (
        "state.epoch is -1, expected a non-negative integer")
    rounds = {"epoch": int, "rounds": list}
    validate.check_progress({"epoch": 0, "rounds": [{"a": 1}]}, rounds, ok, "state")
    for bad, shown in (([1], "list"), ({"a": 1}, "dict"), (None, "null")):
        assert problem_of(lambda fail: validate.check_progress({"epoch": 0, "rounds": bad}, rounds, fail,
                                                               "state")) == (
            f"state.rounds is {shown}, expected a list of objects")


def consistency(state: dict, name: str = "checkpoint-1", kind: str = "epoch", config=None, boundary=None,
                trainer=None) -> str | None:
    metadata = {"state": {**PROGRESS, **state}, "boundary_kind": kind, "config": config or {},
                "boundary": state.get("boundaries", 1) if boundary is None else boundary}
    problems: list[str] = []
    try:
        validate.check_progress_consistency(Path("/runs") / name, metadata, failing(problems), trainer)
    except CheckpointError:
        return problems[0]
    return None


def test_the_progress_agrees_with_the_boundary_and_the_name():
    assert consistency({}) is None
    assert consistency({}, boundary=2) == "boundary is 2 but state.boundaries is 1"
    assert consistency({}, name="checkpoint-5") == "the directory is named for boundary 5 but the checkpoint is at boundary 1"
    assert consistency({}, name="checkpoint-1-step7") == "the directory is named for step 7 but state.global_step is 1"
    assert consistency({}, name="checkpoint-1-step1") is None
    assert consistency({"global_step": 0}, name="checkpoint-1-step0") is None
    assert consistency({}, name="checkpoint-1-step0") == "the directory is named for step 0 but state.global_step is 1"
    assert consistency({}, name="saved-here") is None
    assert consistency({"nonfinite_updates": 1, "consecutive_nonfinite": 1}) is None
    assert consistency({"nonfinite_updates": 1, "consecutive_nonfinite": 2}) == (
        "state.consecutive_nonfinite (2) exceeds state.nonfinite_updates (1)")
    assert consistency({"epoch": 2}) == "state.boundaries is 1 but an epoch checkpoint has boundaries = epoch (2)"
    assert consistency({}, config={"num_train_epochs": 0}) == (
        "state.epoch is 1, beyond the run's planned num_train_epochs=0")
    assert consistency({}, config={"num_train_epochs": 1}) is None
    assert consistency({}, config={"num_train_epochs": "0"}) is None
    assert consistency({"step_in_epoch": 2}) == "state.step_in_epoch (2) exceeds state.global_step (1)"
    assert consistency({"step_in_epoch": 1}) is None
    assert consistency({"epoch": 0, "step_in_epoch": 5}, kind="pbrl_stage") is None


def test_a_preference_runs_boundaries_count_its_stages():
    trainer = SimpleNamespace(STAGES=("collect", "fit", "policy"))
    stage = lambda **s: consistency({"epoch": 0, **s}, "saved", "pbrl_stage", trainer=trainer)  # noqa: E731
    assert stage(boundaries=5, iteration=1, stage=2) is None
    assert stage(boundaries=3, iteration=0, stage=3) is None
    assert stage(boundaries=6, iteration=1, stage=3) is None
    assert stage(boundaries=4, iteration=1, stage=2) == (
        "state.boundaries (4) is not iteration x 3 + stage (iteration 1, stage 2)")
    assert stage(boundaries=4, iteration=0, stage=4) == (
        "state.boundaries (4) is not iteration x 3 + stage (iteration 0, stage 4)")
    assert stage(boundaries=1, iteration=True, stage=True) == (
        "state.boundaries (1) is not iteration x 3 + stage (iteration true, stage true)")
    assert stage(boundaries=1, stage=1) == "state.boundaries (1) is not iteration x 3 + stage (iteration null, stage 1)"
    assert stage(boundaries=1, iteration=0) == "state.boundaries (1) is not iteration x 3 + stage (iteration 0, stage null)"
    assert consistency({"epoch": 0, "boundaries": 4}, "saved", "pbrl_stage", trainer=SimpleNamespace(STAGES=())) is None


def history_problem(history, steps: int = 2, kind: str = "epoch", file: str | None = None) -> tuple[str, str] | None:
    metadata = {"state": {"global_step": steps}, "boundary_kind": kind}
    try:
        if file is None:
            validate.check_history(Path("/runs/checkpoint-1"), history, metadata)
        else:
            validate.check_history(Path("/runs/checkpoint-1"), history, metadata, file)
    except CheckpointError as error:
        return error.file, error.problem
    return None


def test_the_history_rows():
    assert history_problem([{"step": 1}, {"step": 2}]) is None
    assert history_problem([{}, {"loss": 1.0}]) is None
    assert history_problem("x") == ("history.json", 'holds "x", expected a list of metric rows (objects)')
    assert history_problem([{"step": 1}, 5], file="history/a.jsonl") == (
        "history/a.jsonl", "holds list, expected a list of metric rows (objects)")
    assert history_problem([{"step": 1}, {"step": 3}]) == ("history.json", "row 1 has step 3, expected 2")
    assert history_problem([{"step": 0}, {"step": 2}]) == ("history.json", "row 0 has step 0, expected 1")
    assert history_problem([{"step": 1}]) == (
        "history.json", "has 1 rows but metadata.json's state.global_step is 2 (one row per step)")
    assert history_problem([{"step": 1}, {"step": 2}, {"step": 3}]) == (
        "history.json", "has 3 rows but metadata.json's state.global_step is 2 (one row per step)")
    assert history_problem([{"step": 1}, {"step": 2}, {"step": 3}], kind="pbrl_stage") is None
    assert history_problem([{"step": 1}, {"step": 2}], kind="pbrl_stage") is None
    assert history_problem([{"step": 1}], kind="pbrl_stage") == (
        "history.json", "has 1 rows, fewer than metadata.json's state.global_step (2)")
    assert history_problem([{"step": 1}], kind="other") is None


def test_links_are_refused(checkpoint, tmp_path):
    link = tmp_path / "checkpoint-2"
    link.symlink_to(checkpoint)
    with pytest.raises(CheckpointError) as info:
        validate.check_no_links(link)
    assert (info.value.file, info.value.problem) == (
        None, f"is a symbolic link (to {str(checkpoint)!r}); a checkpoint must be a directory of its own")
    weights = checkpoint / "models" / "agent_1.safetensors"
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(weights, outside)
    weights.symlink_to(outside)
    error = refusal(checkpoint)
    assert (error.file, error.problem) == (
        "models/agent_1.safetensors",
        f"is a symbolic link (to {str(outside)!r}); a checkpoint's files must be its own")


def test_the_files_present_are_the_layouts(checkpoint):
    (checkpoint / "notes.txt").write_text("x")
    seal(checkpoint)
    error = refusal(checkpoint)
    assert (error.file, error.problem) == (
        "notes.txt", "is not part of a checkpoint (metadata.json lists models ['agent_0', 'agent_1']; a checkpoint "
        "holds only metadata.json, models/agent_0.safetensors, models/agent_1.safetensors, state.pt)")
    (checkpoint / "notes.txt").unlink()
    (checkpoint / "models" / "agent_1.safetensors").unlink()
    seal(checkpoint)
    error = refusal(checkpoint)
    assert (error.file, error.problem) == (
        "models/agent_1.safetensors", "is missing (metadata.json lists models ['agent_0', 'agent_1'])")
    metadata = metadata_of(checkpoint)
    assert validate.check_layout(checkpoint, {**metadata, "models": {"agent_0": {}}}) is None
    with pytest.raises(CheckpointError) as info:
        validate.check_layout(checkpoint, {**metadata, "format_version": 2, "models": {"agent_0": {}}})
    assert (info.value.file, info.value.problem) == ("history.json", "is missing")
    (checkpoint / "history.json").write_text("[]")
    assert validate.check_layout(checkpoint, {**metadata, "format_version": 2, "models": {"agent_0": {}}}) is None
    (checkpoint / "state.pt").unlink()
    with pytest.raises(CheckpointError) as info:
        validate.check_layout(checkpoint, {**metadata, "format_version": 2, "models": {"agent_0": {}}})
    assert (info.value.file, info.value.problem) == ("state.pt", "is missing")


def test_a_legacy_checkpoint_with_its_own_history(checkpoint, run):
    rows = [{"step": 1, "loss": 0.5}]
    metadata = metadata_of(checkpoint)
    del metadata["history"]
    metadata["format_version"] = 2
    (checkpoint / "metadata.json").write_text(json.dumps(metadata))
    (checkpoint / "history.json").write_text(json.dumps(rows))
    seal(checkpoint)
    contents = validate.read_checkpoint(checkpoint, run[1])
    assert contents.history == rows


def weights(tmp_path, tensors: dict, metadata: dict | None = None) -> str:
    (tmp_path / "models").mkdir(exist_ok=True)
    save_file(tensors, str(tmp_path / "models" / "m.safetensors"), metadata=metadata)
    return "models/m.safetensors"


def weights_problem(tmp_path, relative, fingerprint) -> str | None:
    try:
        validate.check_weights(tmp_path, relative, fingerprint)
    except CheckpointError as error:
        assert error.file == relative
        return error.problem
    return None


def test_the_weights_against_their_fingerprint(tmp_path):
    two = {"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.int64)}
    relative = weights(tmp_path, two)
    shapes = {"a": [2, 3], "b": [4]}
    assert weights_problem(tmp_path, relative, {"shapes": shapes}) is None
    assert weights_problem(tmp_path, relative, {"shapes": shapes, "dtypes": {"a": "float32", "b": "int64"}}) is None
    assert weights_problem(tmp_path, relative, {"shapes": {"b": [4]}}) == (
        "holds tensor 'a', which metadata.json's models fingerprint does not list")
    assert weights_problem(tmp_path, relative, {"shapes": {"a": [3, 2], "b": [4]}}) == (
        "tensor 'a' has shape [2, 3] but metadata.json records [3, 2]")
    assert weights_problem(tmp_path, relative, {"shapes": shapes, "dtypes": {"a": "bfloat16", "b": "int64"}}) == (
        "tensor 'a' is float32 but metadata.json records bfloat16")
    assert weights_problem(tmp_path, relative, {"shapes": {**shapes, "c": [1]}}) == (
        "has no tensor 'c' (listed in metadata.json's models fingerprint)")
    relative = weights(tmp_path, {"a": torch.tensor([1.0, float("nan")]), "b": torch.zeros(1)})
    assert weights_problem(tmp_path, relative, {"shapes": {"a": [2], "b": [1]}}) == (
        "tensor 'a' holds NaN or infinite values")
    # A tied tensor saved once: its name is an alias of the one kept.
    relative = weights(tmp_path, {"kept": torch.zeros(2)}, metadata={"tied": "kept", "format": "pt"})
    assert weights_problem(tmp_path, relative, {"shapes": {"kept": [2], "tied": [2]}}) is None
    relative = weights(tmp_path, {"kept": torch.zeros(2)}, metadata={"tied": "gone"})
    assert weights_problem(tmp_path, relative, {"shapes": {"kept": [2], "tied": [2]}}) == (
        "has no tensor 'tied' (listed in metadata.json's models fingerprint)")
    (tmp_path / relative).write_bytes(b"\x08" + b"\0" * 15)
    assert weights_problem(tmp_path, relative, {"shapes": {"kept": [2]}}).startswith(
        "is not a readable safetensors file (")
    assert weights_problem(tmp_path, "models/absent.safetensors", {"shapes": {}}).startswith(
        "is not a readable safetensors file (")


def test_finite_values_of_every_kind():
    assert validate.all_finite(torch.tensor([1, 2], dtype=torch.int64))
    assert validate.all_finite(torch.tensor([1.0, -3.0]))
    assert not validate.all_finite(torch.tensor([1.0, float("inf")], dtype=torch.bfloat16))
    assert not validate.all_finite(torch.tensor([float("nan")], dtype=torch.float16))


def state_problem(path: Path, state, metadata) -> str | None:
    try:
        validate.check_state(path, state, metadata)
    except CheckpointError as error:
        assert error.file == "state.pt"
        return error.problem
    return None


def test_the_saved_state(checkpoint):
    metadata = metadata_of(checkpoint)
    progress = dict(metadata["state"])
    assert state_problem(checkpoint, {"progress": progress, "a": {"b": [torch.zeros(1)]}}, metadata) is None
    assert state_problem(checkpoint, [progress], metadata) == "holds list, expected a dict of named states"
    assert state_problem(checkpoint, {1: progress}, metadata) == "holds dict, expected a dict of named states"
    assert state_problem(checkpoint, {"other": 1}, metadata) == "has no 'progress'"
    assert state_problem(checkpoint, {"progress": {**progress, "epoch": 2, "global_step": 3}}, metadata) == (
        "its progress differs from metadata.json's state in ['epoch', 'global_step']: epoch 2 here, 1 there, "
        "global_step 3 here, 1 there")
    lacking = {k: v for k, v in progress.items() if k != "pending_evaluation"}
    assert state_problem(checkpoint, {"progress": lacking}, metadata) == (
        "its progress differs from metadata.json's state in ['pending_evaluation']: pending_evaluation null here, "
        "0 there")
    assert state_problem(checkpoint, {"progress": {**progress, "later": 1}}, metadata) == (
        "its progress differs from metadata.json's state in ['later']: later 1 here, null there")
    assert state_problem(checkpoint, {"progress": {**progress, "epoch": -1}}, metadata) == (
        "progress.epoch is -1, expected a non-negative integer")
    nan = torch.tensor([0.0, float("nan")])
    assert state_problem(checkpoint, {"progress": progress, "a": {"b": [torch.zeros(1), nan]}}, metadata) == (
        "a.b[1] holds NaN or infinite values")
    assert state_problem(checkpoint, {"progress": progress, "t": (nan,)}, metadata) == "t[0] holds NaN or infinite values"
    assert state_problem(checkpoint, {"progress": progress, "o": {"pending_grads": {"w": nan}}}, metadata) is None
    assert state_problem(checkpoint, {"progress": progress, "pending_grads": nan}, metadata) is None
    assert state_problem(checkpoint, {"progress": progress, "o": {"pending_grads": {"w": nan}}, "z": nan}, metadata) == (
        "z holds NaN or infinite values")
    assert state_problem(checkpoint, {"progress": progress, "o": {"pending": {"w": nan}}}, metadata) == (
        "o.pending.w holds NaN or infinite values")


def test_the_saved_state_through_a_resume(checkpoint, run):
    state = torch.load(checkpoint / "state.pt", weights_only=False)
    state["progress"]["global_step"] = 2
    torch.save(state, checkpoint / "state.pt")
    seal(checkpoint)
    error = refusal(checkpoint, run[1])
    assert (error.file, error.problem) == (
        "state.pt", "its progress differs from metadata.json's state in ['global_step']: global_step 2 here, 1 there")


def test_the_weights_through_a_resume(checkpoint):
    rewrite(checkpoint, lambda m: m["models"]["agent_1"]["shapes"].update({"lm_head.weight": [95, 64]}))
    error = refusal(checkpoint)
    assert (error.file, error.problem) == (
        "models/agent_1.safetensors", "has no tensor 'lm_head.weight' (listed in metadata.json's models fingerprint)"
    ) or error.problem == "tensor 'lm_head.weight' has shape [96, 64] but metadata.json records [95, 64]"


def match_problem(saved, template) -> str | None:
    problems: list[str] = []
    try:
        validate._match(saved, template, "", failing(problems))
    except CheckpointError:
        return problems[0]
    return None


def test_state_against_the_trainers_own():
    assert match_problem({"x": 1}, None) is None
    assert match_problem(5, {"a": 1}) == "the top level is 5, expected a table"
    assert match_problem({"a": None}, {"a": {"b": 1}}) is None
    assert match_problem({}, {"a": 1}) == "a is missing"
    assert match_problem({"a": {}}, {"a": {"b": 1}}) == "a.b is missing"
    assert match_problem({"a": {"b": "x"}}, {"a": {"b": 1}}) == 'a.b is "x", expected an integer'
    for key in ("per_sample", "scheduler", "rng"):
        assert match_problem({}, {key: {"x": 1}}) is None
    assert match_problem({"scheduler": {"x": "y"}}, {"scheduler": {"x": 1}}) is None
    assert match_problem({"stateful": {"x": "y"}}, {"stateful": {"x": 1}}) is None
    assert match_problem({"a": {"stateful": {"x": "y"}}}, {"a": {"stateful": {"x": 1}}}) is None
    assert match_problem({"a": {"b": {"scheduler": {"x": "y"}}}}, {"a": {"b": {"scheduler": {"x": 1}}}}) is None
    assert match_problem({"a": {"b": {"progress": {"x": 1, "y": 3}}}}, {"a": {"b": {"progress": {"x": 1}}}}) == (
        "a.b.progress has unknown fields ['y']")
    assert match_problem({"a": {"x": "y"}}, {"a": {}}) is None
    assert match_problem({"a": {0: "y"}}, {"a": {0: 1}}) is None
    assert match_problem({"a": {"x": "y"}}, {"a": {"x": 1, 0: 1}}) is None
    assert match_problem({"progress": {"x": 1, "z": 2, "y": 3}}, {"progress": {"x": 1}}) == (
        "progress has unknown fields ['y', 'z']")
    assert match_problem({"a": {"progress": {"x": 1, "y": 3}}}, {"a": {"progress": {"x": 1}}}) == (
        "a.progress has unknown fields ['y']")
    assert match_problem({"other": {"x": 1, "y": 3}}, {"other": {"x": 1}}) is None
    assert match_problem({"a": 5}, {"a": [1]}) == "a is 5, expected a list"
    assert match_problem({"a": (1, "x")}, {"a": [1]}) is None
    assert match_problem({"a": [{"b": 1}, {}]}, {"a": [{"b": 1}]}) == "a[1].b is missing"
    assert match_problem({"a": [{"b": 1}, 3]}, {"a": [{"b": 1}, 2]}) is None
    assert match_problem({"a": [1]}, {"a": []}) is None
    assert match_problem({"a": 3}, {"a": torch.zeros(1)}) == "a is 3, expected a tensor"
    assert match_problem({"a": torch.zeros(1, dtype=torch.int64)}, {"a": torch.zeros(1)}) == (
        "a is a torch.int64 tensor, expected torch.float32")
    assert match_problem({"a": torch.zeros(1)}, {"a": torch.zeros(1, dtype=torch.int64)}) == (
        "a is a torch.float32 tensor, expected torch.int64")
    assert match_problem({"a": torch.zeros(1, dtype=torch.int32)}, {"a": torch.zeros(1, dtype=torch.int64)}) == (
        "a is a torch.int32 tensor, expected torch.int64")
    assert match_problem({"a": torch.zeros(1, dtype=torch.float16)}, {"a": torch.zeros(1)}) is None
    assert match_problem({"a": torch.zeros(1, dtype=torch.int64)}, {"a": torch.zeros(1, dtype=torch.int64)}) is None


@pytest.mark.parametrize("template, saved, words", [
    (True, False, None), (True, 1, "a is 1, expected true/false"),
    (3, 4, None), (3, True, "a is true, expected an integer"), (3, 4.0, "a is 4.0, expected an integer"),
    (0.5, 1, None), (0.5, 2.5, None), (0.5, None, None), (0.5, "x", 'a is "x", expected a number or null'),
    (0.5, True, "a is true, expected a number or null"),
    ("s", "t", None), ("s", False, "a is false, expected a string"), ("s", 1, "a is 1, expected a string"),
    (b"s", b"t", None), (b"s", "t", 'a is "t", expected bytes'),
])
def test_plain_values_against_the_trainers_own(template, saved, words):
    assert match_problem({"a": saved}, {"a": template}) == words


def test_an_optimizer_state_against_the_trainers_own():
    template = {"optimizer": {"state": {}, "param_groups": [{"params": [0, 1]}, {"params": [2]}]}}
    same = {"optimizer": {"state": {0: {}}, "param_groups": [{"params": [5, 6], "lr": 1}, {"params": [7]}]}}
    assert match_problem(same, template) is None
    assert match_problem({"optimizer": {"param_groups": []}}, template) == (
        "optimizer is not a torch optimizer state (a table with 'state' and 'param_groups')")
    assert match_problem({"optimizer": {"state": [], "param_groups": []}}, template) == (
        "optimizer is not a torch optimizer state (a table with 'state' and 'param_groups')")
    assert match_problem({"optimizer": {"state": {}, "param_groups": {}}}, template) == (
        "optimizer is not a torch optimizer state (a table with 'state' and 'param_groups')")
    assert match_problem({"optimizer": {"state": {}, "param_groups": [{"params": [1]}, 3]}}, template) == (
        "optimizer has parameter groups of sizes [1, None], but this run's optimizer has [2, 1]")
    assert match_problem({"optimizer": {"state": {}, "param_groups": [{"params": "ab"}, {"params": [1]}]}},
                         template) == (
        "optimizer has parameter groups of sizes [None, 1], but this run's optimizer has [2, 1]")
    assert match_problem({"optimizer": {"state": {}, "param_groups": []}},
                         {"optimizer": {"state": {}, "param_groups": []}}) is None
    assert match_problem({"optimizer": {"state": {}, "param_groups": [{"params": [1]}]}},
                         {"optimizer": {"state": {}}}) is None
    assert match_problem({"a": {"optimizer": {"state": {}, "param_groups": [{"params": [1]}]}}},
                         {"a": {"optimizer": {"state": {}, "param_groups": [{"params": [1, 2]}]}}}) == (
        "a.optimizer has parameter groups of sizes [1], but this run's optimizer has [2]")
    # Named by the last part of a deeper path too.
    assert match_problem({"a": {"b": {"optimizer": {"state": {}, "param_groups": [{"params": [1]}]}}}},
                         {"a": {"b": {"optimizer": {"state": {}, "param_groups": [{"params": [1, 2]}]}}}}) == (
        "a.b.optimizer has parameter groups of sizes [1], but this run's optimizer has [2]")


def test_the_rng_states_are_required_when_the_trainer_has_them(checkpoint, run):
    trainer = run[1]
    contents = validate.read_checkpoint(checkpoint, trainer)
    assert "rng" in trainer.state_dict()
    del contents.state["rng"]
    with pytest.raises(CheckpointError) as info:
        validate.check_state_structure(contents, trainer)
    assert (info.value.file, info.value.problem) == (
        "state.pt", "has no 'rng' (the RNG states): resumed without them the run would not continue as it would have")
    contents = validate.read_checkpoint(checkpoint, trainer)
    contents.state["progress"] = 5  # the progress is checked on its own: the structure leaves it
    validate.check_state_structure(contents, trainer)
    key = next(k for k, v in trainer.state_dict().items() if k not in ("progress", "rng") and isinstance(v, dict) and v)
    contents.state[key] = 7
    with pytest.raises(CheckpointError) as info:
        validate.check_state_structure(contents, trainer)
    assert info.value.problem == f"{key} is 7, expected a table"


def test_shown_values_are_cut_at_60_characters():
    assert validate._shown("x" * 58) == json.dumps("x" * 58)
    assert validate._shown("x" * 59) == '"' + "x" * 56 + "..."
    assert validate._shown([1]) == "list"
    assert validate._kind_names((None, int, float, str, dict, bool, list, bytes)) == (
        "null or an integer or a number or a string or an object or true/false or a list or bytes")


# ===== generation ==================================================================================
def hand_greedy(model, tokenizer, prompt: str, steps: int, eos: int | None) -> list[int]:
    """Greedy decoding written out: the prompt alone (no padding), one argmax per step, stop after an EOS."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    out: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids + out])).logits[0, -1]
            out.append(int(logits.argmax()))
            if out[-1] == eos:
                break
    return out


PROMPTS = ["the agent", "write a long story about the moon and the sun"]


def padded_left(tokenizer, prompts):
    rows = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    width = max(map(len, rows))
    ids = [[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows]
    mask = [[0] * (width - len(r)) + [1] * len(r) for r in rows]
    return torch.tensor(ids), torch.tensor(mask)


@pytest.mark.parametrize("backend, num_generations", [("comlrl", 2), ("transformers", 1)])
def test_greedy_completions_against_a_decode_by_hand(llama, backend, num_generations):
    """(``generate`` refuses several greedy samples of one prompt.)"""
    model, tokenizer = llama
    steps = 5
    hand = [hand_greedy(model, tokenizer, p, steps, None) for p in PROMPTS]
    # The EOS: the second prompt's first greedy token, which the first prompt's path never makes.
    eos = hand[1][0]
    assert eos not in hand[0] and len(set(hand[0])) == 1, "pick another EOS for this test to mean anything"
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    model = copy.deepcopy(model)
    model.generation_config.repetition_penalty = 5.0  # a model's own settings are not used
    model.generation_config.no_repeat_ngram_size = 1
    g = num_generations
    gen = generate_completions(model, tokenizer, PROMPTS, g, SamplingParams(max_new_tokens=steps, do_sample=False,
                                                                           backend=backend))
    ids, mask = padded_left(tokenizer, PROMPTS)
    assert torch.equal(gen.prompt_ids, torch.tensor([row for row in ids.tolist() for _ in range(g)]))
    assert torch.equal(gen.prompt_mask, torch.tensor([row for row in mask.tolist() for _ in range(g)]))
    pad = tokenizer.pad_token_id
    rows = [hand[0], [eos, pad, pad, pad, pad]]
    masks = [[1] * 5, [1, 0, 0, 0, 0]]
    assert gen.completion_ids.tolist() == [rows[0]] * g + [rows[1]] * g
    assert gen.completion_mask.tolist() == [masks[0]] * g + [masks[1]] * g
    assert gen.completion_mask.dtype == torch.long
    assert gen.texts == [tokenizer.decode(r, skip_special_tokens=True) for r in [rows[0]] * g + [rows[1]] * g]
    assert gen.num_generations == g and gen.num_tokens == 6 * g and gen.lengths().tolist() == [5] * g + [1] * g


def test_sampling_settings_and_the_generators_draws(llama):
    model, tokenizer = llama
    sampling = SamplingParams(max_new_tokens=6, temperature=0.7, top_p=0.9, backend="transformers")
    generator = torch.Generator().manual_seed(11)
    seed = int(torch.randint(2**62, (1,), generator=torch.Generator().manual_seed(11)))
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    gen = generate_completions(model, tokenizer, PROMPTS, 3, sampling, generator=generator)
    assert torch.equal(torch.random.get_rng_state(), before), "the global RNG is left as it was"
    ids, mask = padded_left(tokenizer, PROMPTS)
    torch.manual_seed(seed)
    expected = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=0.7, top_p=0.9,
                              top_k=0, max_new_tokens=6, num_return_sequences=3, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id)[:, ids.shape[1]:]
    expected_mask = generation.completion_mask(expected, tokenizer.eos_token_id)
    expected = torch.where(expected_mask.bool(), expected, torch.full_like(expected, tokenizer.pad_token_id))
    assert torch.equal(gen.completion_ids, expected) and torch.equal(gen.completion_mask, expected_mask)
    # Without a generator, generate draws from the global RNG.
    torch.manual_seed(5)
    plain = generate_completions(model, tokenizer, PROMPTS, 3, SamplingParams(max_new_tokens=6, top_k=4,
                                                                              backend="transformers"))
    torch.manual_seed(5)
    expected = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=4, top_p=1.0,
                              temperature=1.0, max_new_tokens=6, num_return_sequences=3,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    expected = expected[:, ids.shape[1]:]
    expected_mask = generation.completion_mask(expected, tokenizer.eos_token_id)
    assert torch.equal(plain.completion_mask, expected_mask)
    assert torch.equal(plain.completion_ids, torch.where(expected_mask.bool(), expected,
                                                         torch.full_like(expected, tokenizer.pad_token_id)))


def test_the_generation_config_is_built_complete(llama):
    tokenizer = llama[1]
    config = generation._generation_config(tokenizer, SamplingParams(max_new_tokens=7, temperature=0.5, top_p=0.8),
                                           4)
    assert (config.max_new_tokens, config.num_return_sequences, config.pad_token_id, config.eos_token_id) == (
        7, 4, tokenizer.pad_token_id, tokenizer.eos_token_id)
    assert (config.do_sample, config.temperature, config.top_p, config.top_k, config.use_cache) == (
        True, 0.5, 0.8, 0, True)
    assert config.repetition_penalty == 1.0 and config.max_length is None
    assert config.update(defaults_only=True, top_k=9) == {"top_k": 9} and config.top_k == 0
    assert config.update(top_k=9) == {} and config.top_k == 9
    greedy = generation._generation_config(tokenizer, SamplingParams(max_new_tokens=3, do_sample=False,
                                                                     temperature=0.5, top_k=3), 1)
    assert greedy.do_sample is False and greedy.temperature == 1.0 and greedy.top_k == 50


def test_the_mask_keeps_tokens_up_to_the_first_eos():
    ids = torch.tensor([[5, 2, 7, 3], [3, 6, 2, 8], [5, 6, 7, 8]])
    assert generation.completion_mask(ids, 2).tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert generation.completion_mask(ids, [2, 3]).tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    none = generation.completion_mask(ids, None)
    assert none.tolist() == [[1] * 4] * 3 and none.dtype == torch.long
    assert generation.completion_mask(ids, 2).dtype == torch.long
    assert generation.eos_ids(SimpleNamespace(eos_token_id=None)) == []
    assert generation.eos_ids(SimpleNamespace(eos_token_id=4)) == [4]
    assert generation.eos_ids(SimpleNamespace(eos_token_id=(4, 5))) == [4, 5]


def test_the_context_and_the_prompt_limit(tiny_gpt2, llama):
    model = copy.deepcopy(llama[0])
    gpt2 = AutoModelForCausalLM.from_pretrained(tiny_gpt2)
    assert generation.context_length(model) == 256 and generation.context_length(gpt2) == 256
    assert generation.prompt_token_limit(model, 6, None) == 250
    assert generation.prompt_token_limit(model, 6, 10) == 10
    assert generation.prompt_token_limit(model, 6, 300) == 250
    model.config.max_position_embeddings = 0
    model.config.max_sequence_length = 40
    assert generation.context_length(model) == 40
    model.config.max_sequence_length = 40.0
    assert generation.context_length(model) is None
    assert generation.prompt_token_limit(model, 6, None) is None
    assert generation.prompt_token_limit(model, 6, 7) == 7
    assert generation.context_length(SimpleNamespace(config=SimpleNamespace(n_positions=12))) == 12


def test_prompts_left_padded_bounded_and_refused(llama, caplog):
    tokenizer = llama[1]
    ids, mask = generation.encode_prompts(tokenizer, PROMPTS, CPU)
    expected_ids, expected_mask = padded_left(tokenizer, PROMPTS)
    assert torch.equal(ids, expected_ids) and torch.equal(mask, expected_mask)
    long = tokenizer(PROMPTS[1], add_special_tokens=False)["input_ids"]
    short = tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"]
    assert len(short) < 4 < len(long)
    with caplog.at_level(logging.WARNING, logger="comlrl.rollout.generation"):
        ids, mask = generation.encode_prompts(tokenizer, PROMPTS, CPU, max_prompt_length=4)
    assert ids.tolist() == [[tokenizer.pad_token_id] * (4 - len(short)) + short, long[-4:]]
    assert mask.tolist() == [[0] * (4 - len(short)) + [1] * len(short), [1] * 4]
    assert [r.getMessage() for r in caplog.records] == ["truncating 1 prompt(s) to their last 4 tokens"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="comlrl.rollout.generation"):
        ids, _ = generation.encode_prompts(tokenizer, PROMPTS, CPU, max_prompt_length=len(long))
    assert ids.tolist()[1] == long and caplog.records == []
    with pytest.raises(ValueError) as error:
        generation.encode_prompts(tokenizer, [PROMPTS[0], PROMPTS[1], PROMPTS[1]], CPU, max_prompt_length=4,
                                  overflow="error")
    assert str(error.value) == (
        f"prompt 1 has {len(long)} tokens but only 4 fit (context minus max_new_tokens, or max_prompt_length); "
        "shorten it or set prompt_overflow='truncate'")
    with pytest.raises(ValueError) as error:
        generation.encode_prompts(tokenizer, ["a", "", "b", ""], CPU)
    assert str(error.value) == ("prompts [1, 3] of this batch (of 4) encode to no tokens; every prompt needs at least "
                                "one token")
    # The first id (row by row) without an embedding row, with a bound just below the largest id.
    padded = expected_ids.tolist()
    bound = max(long + short)
    row, token = next((r, t) for r, ids_ in enumerate(padded) for t in ids_ if t >= bound)
    count = sum(t >= bound for ids_ in padded for t in ids_)
    with pytest.raises(ValueError) as error:
        generation.encode_prompts(tokenizer, PROMPTS, CPU, num_embeddings=bound)
    assert str(error.value).startswith(f"prompt row {row} contains token id {token} "
                                       f"{tokenizer.convert_ids_to_tokens(token)!r} ({count} out-of-range id(s) in all)")
    generation.encode_prompts(tokenizer, PROMPTS, CPU, num_embeddings=max(long + short) + 1)


def test_truncation_alone_and_a_bounded_prompt(llama):
    tokenizer = llama[1]
    ids, mask = torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert generation.truncate_prompts(ids, mask, None)[0] is ids
    assert generation.truncate_prompts(ids, mask, 3)[0] is ids
    kept, kept_mask = generation.truncate_prompts(ids, mask, 2)
    assert kept.tolist() == [[5, 6], [8, 9]] and kept_mask.tolist() == [[1, 1], [1, 1]]
    with pytest.raises(ValueError) as error:
        generation.truncate_prompts(ids, mask, 2, "error")
    assert str(error.value).startswith("prompt 1 has 3 tokens but only 2 fit")
    prompt = PROMPTS[1]
    assert generation.bounded_prompt(tokenizer, prompt, None) is prompt
    assert generation.bounded_prompt(tokenizer, prompt, 100) is prompt
    last = tokenizer(prompt, add_special_tokens=False)["input_ids"][-3:]
    assert generation.bounded_prompt(tokenizer, prompt, 3) == tokenizer.decode(last, skip_special_tokens=False)


def test_positions_skip_left_padding():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 0, 1]])
    assert generation.position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1], [0, 1, 2, 3], [0, 0, 0, 1]]


def test_ids_without_an_embedding_row(llama):
    tokenizer = llama[1]
    generation.check_ids_in_range(torch.zeros(0, dtype=torch.long), 5)
    generation.check_ids_in_range(torch.tensor([[0, 4], [4, 0]]), 5)
    with pytest.raises(ValueError) as error:
        generation.check_ids_in_range(torch.tensor([[0, 4], [5, -1]]), 5, "completion")
    assert str(error.value) == (
        "completion row 1 contains token id 5 (2 out-of-range id(s) in all), but the model embeds only 5 tokens "
        "(ids 0..4); remove that token from the input, or resize the model's embeddings "
        "(model.resize_token_embeddings(len(tokenizer)))")
    with pytest.raises(ValueError) as error:
        generation.check_ids_in_range(torch.tensor([1, -2]), 5, tokenizer=tokenizer)
    assert str(error.value).startswith("prompt row 0 contains token id -2 None (1 out-of-range id(s) in all)")
    with pytest.raises(ValueError) as error:
        generation.check_ids_in_range(torch.tensor([[[1, 9]]]), 5, tokenizer=tokenizer)
    assert str(error.value).startswith(f"prompt row 0 contains token id 9 {tokenizer.convert_ids_to_tokens(9)!r} (1 ")
    assert generation.token_text(tokenizer, 3) == tokenizer.convert_ids_to_tokens(3)
    assert generation.token_text(object(), 3) is None


def test_a_bounded_prompt_counts_the_tokens_generation_feeds(tiny_llama):
    """A tokenizer that adds a BOS when asked: generation feeds prompts without it, and so does the bound; the kept
    tokens are written back with their special tokens."""
    from tokenizers import processors

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    bos = tokenizer.bos_token_id
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    prompt = "the cat </s> dog"
    plain = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert tokenizer(prompt)["input_ids"] == [bos] + plain, "the tokenizer must add its BOS for this test"
    assert generation.bounded_prompt(tokenizer, prompt, len(plain)) is prompt
    eos_at = plain.index(tokenizer.eos_token_id)
    kept = plain[eos_at - 1:]
    text = generation.bounded_prompt(tokenizer, prompt, len(kept))
    assert "</s>" in text and text == tokenizer.decode(kept, skip_special_tokens=False)


@pytest.fixture(scope="module")
def sharp(tiny_llama):
    """The tiny Llama with its weights (but not its norms) scaled by 6: greedy paths that depend on the whole prompt,
    which the random initial weights' do not."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.mul_(6)
    return model, AutoTokenizer.from_pretrained(tiny_llama)


@pytest.mark.parametrize("backend, seeded", [("transformers", False), ("transformers", True), ("comlrl", True)])
def test_a_pad_token_inside_a_prompt_is_attended(sharp, backend, seeded):
    """The prompt's mask is what generation attends, not one inferred from the pad id: a prompt that writes the pad
    token as text is decoded as a whole, as by hand."""
    model, tokenizer = sharp
    prompts = ["the <pad> agent <pad> writes", "a dog"]
    assert tokenizer.pad_token_id in tokenizer(prompts[0], add_special_tokens=False)["input_ids"]
    hand = [hand_greedy(model, tokenizer, p, 6, tokenizer.eos_token_id) for p in prompts]
    generator = torch.Generator().manual_seed(0) if seeded else None
    gen = generate_completions(model, tokenizer, prompts, 1, SamplingParams(max_new_tokens=6, do_sample=False,
                                                                           backend=backend), generator=generator)
    pad = tokenizer.pad_token_id
    assert gen.completion_ids.tolist() == [row + [pad] * (gen.completion_ids.shape[1] - len(row)) for row in hand]


def test_state_checks_on_values_of_every_form(checkpoint):
    """Optional keys skipped without ending the check, an integer enum's template, progress lists compared whatever
    their dicts' key order, values JSON cannot write, and a trainer whose state holds no progress."""
    import enum

    class Level(enum.IntEnum):
        LOW = 1

    assert match_problem({}, {"rng": {"x": 1}, "z": 1}) == "z is missing"
    assert match_problem({"a": 3}, {"a": Level.LOW}) is None
    assert match_problem({"a": "3"}, {"a": Level.LOW}) == 'a is "3", expected an integer'
    trainer = SimpleNamespace(state=RoundsState())
    metadata = {"state": {"epoch": 0, "rounds": [{"a": 1, "b": 2}]}}
    validate.check_state(checkpoint, {"progress": {"epoch": 0, "rounds": [{"b": 2, "a": 1}]}}, metadata, trainer)
    with pytest.raises(CheckpointError) as info:
        validate.check_state(checkpoint, {"progress": {"epoch": 0, "rounds": [{"a": 1, "b": 3}]}}, metadata, trainer)
    assert info.value.problem == ("its progress differs from metadata.json's state in ['rounds']: rounds list here, "
                                  "list there")
    odd = {"progress": {**PROGRESS, "later": [torch.tensor(1)]}}
    assert state_problem(checkpoint, odd, {"state": dict(PROGRESS)}) == (
        "its progress differs from metadata.json's state in ['later']: later list here, null there")
    contents = validate.CheckpointContents(checkpoint, {}, [], {"a": 2})
    validate.check_state_structure(contents, SimpleNamespace(state_dict=lambda: {"a": 1}))


def test_a_checkpoint_at_boundary_zero_and_a_models_record_read_from_disk(checkpoint):
    metadata = metadata_of(checkpoint)
    metadata["boundary"] = 0
    metadata["state"].update(boundaries=0, epoch=0, global_step=0)
    validate.check_metadata(checkpoint.parent / "saved", metadata, True)
    assert metadata_refusal(checkpoint, lambda m: m.update(models={})) == (
        "models is empty: a checkpoint holds at least one model")


@dataclass
class StagedProgress(TrainerState):
    iteration: int = 0
    stage: int = 0


def test_the_metadata_is_checked_against_the_resuming_trainers_progress(checkpoint):
    """Without a trainer, extra counts are let through; with one, its own progress class and its stages decide."""

    class MAGRPOTrainer:  # a trainer of the same name whose progress has two more fields and two stages per iteration
        STAGES = ("collect", "policy")
        state = StagedProgress()

    metadata = metadata_of(checkpoint)
    validate.check_metadata(checkpoint, {**metadata, "state": {**metadata["state"], "later": 1}}, True)
    staged = {**metadata, "boundary_kind": "pbrl_stage", "state": {**metadata["state"], "iteration": 0, "stage": 1}}
    validate.check_metadata(checkpoint, staged, True, MAGRPOTrainer())
    staged["state"]["stage"] = 2
    with pytest.raises(CheckpointError) as info:
        validate.check_metadata(checkpoint, staged, True, MAGRPOTrainer())
    assert info.value.problem == "state.boundaries (1) is not iteration x 2 + stage (iteration 0, stage 2)"


def test_the_mask_is_long_whatever_the_ids_dtype():
    ids = torch.tensor([[5, 2, 7]], dtype=torch.int32)
    for eos in (None, 2):
        mask = generation.completion_mask(ids, eos)
        assert mask.dtype == torch.long and mask.tolist() == ([[1, 1, 1]] if eos is None else [[1, 1, 0]])


def test_a_context_of_one_position_counts():
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=1, n_positions=64))
    assert generation.context_length(model) == 1
    assert generation.context_length(SimpleNamespace(config=SimpleNamespace(max_position_embeddings=0,
                                                                            n_positions=64))) == 64


def test_prompts_are_encoded_without_the_tokenizers_own_special_tokens(tiny_llama):
    """A tokenizer that adds a BOS when asked: the prompt IDs are the text's tokens alone, as a decode by hand feeds
    them."""
    from tokenizers import processors

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    bos = tokenizer.bos_token_id
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    assert tokenizer(PROMPTS[0])["input_ids"][0] == bos, "the tokenizer must add its BOS for this test"
    ids, mask = generation.encode_prompts(tokenizer, PROMPTS, CPU)
    expected_ids, expected_mask = padded_left(tokenizer, PROMPTS)
    assert torch.equal(ids, expected_ids) and torch.equal(mask, expected_mask)


def test_a_single_id_is_one_row():
    with pytest.raises(ValueError) as error:
        generation.check_ids_in_range(torch.tensor(7), 5, "completion")
    assert str(error.value).startswith("completion row 0 contains token id 7 (1 out-of-range id(s) in all), but the "
                                       "model embeds only 5 tokens (ids 0..4)")
    generation.check_ids_in_range(torch.tensor(4), 5)
