"""The original comlrl's ``comlrl.utils`` helper names, importable and behaving as documented there."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaForCausalLM

import comlrl.utils as utils
from comlrl.rollout.rewards import JointReward
from comlrl.tiny import build_tiny_tokenizer, tiny_llama_config

ORIGINAL_IMPORTS = {
    "comlrl.utils.reward_processor": ["RewardProcessors"],
    "comlrl.utils.reward_utils": ["set_reward_range", "resolve_reward_range", "call_reward_function",
                                  "normalize_reward_lengths"],
    "comlrl.utils.formatters": ["build_formatters"],
    "comlrl.utils.tokenizer_utils": ["ensure_pad_token", "ensure_tokenizer", "apply_tokenizer_specials",
                                     "resolve_tokenizers"],
    "comlrl.utils.model_loading": ["infer_model_name", "resolve_model_sources"],
    "comlrl.utils.distributed": ["DistributedContext", "local_context", "unwrap_model"],
    "comlrl.utils.reference_kl": ["reference_kl_enabled", "reference_kl_coef", "validate_reference_kl_config",
                                  "resolve_reference_devices", "clone_reference_models",
                                  "load_reference_models_from_sources", "reference_kl_for_sequence"],
}


@pytest.mark.parametrize("module_name", sorted(ORIGINAL_IMPORTS))
def test_names_importable_where_the_original_has_them(module_name):
    module = importlib.import_module(module_name)
    for name in ORIGINAL_IMPORTS[module_name]:
        obj = getattr(module, name)
        assert getattr(utils, name) is obj  # re-exported from comlrl.utils too
        assert name in utils.__all__
        assert (obj.__doc__ or "").strip(), f"{name} has no docstring"
    assert callable(utils.read_checkpoint_metadata) and "read_checkpoint_metadata" in utils.__all__


# ----- RewardProcessors -----------------------------------------------------------------------

def test_reward_processors_scale_and_shift():
    from comlrl.utils.reward_processor import RewardProcessors

    assert RewardProcessors.scale(2.5)(4.0) == 10.0
    assert RewardProcessors.scale(factor=-1.0)(3.0) == -3.0
    assert RewardProcessors.scale()(7.0) == 7.0  # default factor 1
    assert RewardProcessors.shift(1.5)(1.0) == 2.5
    assert RewardProcessors.shift(value=-2.0)(0.5) == -1.5
    assert RewardProcessors.shift()(7.0) == 7.0  # default shift 0
    assert inspect.signature(RewardProcessors.scale).parameters["factor"].default == 1.0
    assert inspect.signature(RewardProcessors.shift).parameters["value"].default == 0.0


def test_reward_processor_plugs_into_the_reward():
    from comlrl.utils.reward_processor import RewardProcessors

    reward = JointReward(lambda a, b: [1.0, 2.0], reward_processor=RewardProcessors.scale(3.0), num_agents=2)
    assert reward([["x", "y"], ["u", "v"]], [{}, {}]).tolist() == [3.0, 6.0]


# ----- reward ranges ------------------------------------------------------------------------------

def test_set_reward_range_declares_and_returns_the_function():
    def reward(completions):
        return [0.0] * len(completions)

    assert utils.resolve_reward_range(reward) is None
    returned = utils.set_reward_range(reward, 0, 5)
    assert returned is reward
    assert reward.reward_range == (0.0, 5.0) and all(isinstance(v, float) for v in reward.reward_range)
    assert utils.resolve_reward_range(reward) == (0.0, 5.0)


@pytest.mark.parametrize("declared, message", [
    ((1.0, 1.0), "minimum must be less than maximum"),
    ((2.0, 1.0), "minimum must be less than maximum"),
    ((0.0, math.inf), "must be finite"),
    ((math.nan, 1.0), "must be finite"),
    ((0.0, 1.0, 2.0), "two-item sequence"),
    ("01", "two-item sequence"),
    (3.0, "two-item sequence"),
])
def test_resolve_reward_range_rejects_bad_declarations(declared, message):
    func = SimpleNamespace(reward_range=declared)
    with pytest.raises(ValueError, match=message):
        utils.resolve_reward_range(func)


def test_set_reward_range_validates():
    def reward(completions):
        return [0.0]

    with pytest.raises(ValueError, match="minimum must be less than maximum"):
        utils.set_reward_range(reward, 1.0, -1.0)
    assert utils.resolve_reward_range(SimpleNamespace(reward_range=[-1, 1])) == (-1.0, 1.0)


# ----- call_reward_function ------------------------------------------------------------------------

PROMPTS = ["p0", "p1"]
A = ["a0", "a1"]
B = ["b00", "b111"]


def test_call_single_agent_completions_only():
    seen = {}

    def reward(completions):
        seen["args"] = completions
        return [len(c) for c in completions]

    assert utils.call_reward_function(reward, PROMPTS, [B], num_agents=1) == [3.0, 4.0]
    assert seen["args"] == B


def test_call_single_agent_with_prompts_first_and_bare_number():
    def reward(prompts, completions):
        assert prompts == PROMPTS and completions == A
        return 7  # a bare number

    result = utils.call_reward_function(reward, PROMPTS, [A], num_agents=1)
    assert result == [7.0] and isinstance(result[0], float)


def test_call_multi_agent_positional_and_prompts_first():
    def positional(c0, c1):
        return [float(x == "a0") + len(y) for x, y in zip(c0, c1)]

    def with_prompts(prompts, c0, c1):
        return [len(p) * 10 + len(y) for p, y in zip(prompts, c1)]

    assert utils.call_reward_function(positional, PROMPTS, [A, B], num_agents=2) == [4.0, 4.0]
    assert utils.call_reward_function(with_prompts, PROMPTS, [A, B], num_agents=2) == [23.0, 24.0]


def test_call_multi_agent_nested_varargs_and_tensor():
    def nested(agent_completions):
        assert agent_completions == [A, B]
        return (1, 2)

    def varargs(*completions):
        assert list(completions) == [A, B]
        return torch.tensor([0.5, 1.5])

    assert utils.call_reward_function(nested, PROMPTS, [A, B], num_agents=2) == [1.0, 2.0]
    result = utils.call_reward_function(varargs, PROMPTS, [A, B], num_agents=2)
    assert result == [0.5, 1.5] and all(type(v) is float for v in result)
    assert utils.call_reward_function(lambda *c: torch.tensor(2.0), PROMPTS, [A, B], num_agents=2) == [2.0]


def test_call_passes_keywords_only_when_declared_and_given():
    calls = []

    def with_items(c0, c1, batch_items=None, prompts=None):
        calls.append((batch_items, prompts))
        return [0.0, 0.0]

    def with_kwargs(c0, c1, **kwargs):
        calls.append(kwargs)
        return [1.0, 1.0]

    items = [{"prompt": "p0"}, {"prompt": "p1"}]
    utils.call_reward_function(with_items, PROMPTS, [A, B], num_agents=2, batch_items=items)
    utils.call_reward_function(with_items, PROMPTS, [A, B], num_agents=2)
    utils.call_reward_function(with_kwargs, PROMPTS, [A, B], num_agents=2, batch_items=items)
    utils.call_reward_function(with_kwargs, PROMPTS, [A, B], num_agents=2)
    assert calls == [(items, PROMPTS), (None, PROMPTS), {"batch_items": items, "prompts": PROMPTS},
                     {"prompts": PROMPTS}]


def test_call_uses_a_given_signature():
    def flexible(*args):
        return [float(len(args))]

    # Planned as f(prompts, c0, c1) although the function itself takes *args.
    signature = inspect.signature(lambda prompts, c0, c1: None)
    assert utils.call_reward_function(flexible, PROMPTS, [A, B], num_agents=2, signature=signature) == [3.0]
    assert utils.call_reward_function(flexible, PROMPTS, [A, B], num_agents=2) == [2.0]


def test_call_falls_back_to_completions_on_type_error_then_reraises_the_first():
    attempts = []

    def picky(*args, **kwargs):
        attempts.append((len(args), sorted(kwargs)))
        if kwargs:
            raise TypeError("no keywords please")
        return [1.0, 2.0]

    assert utils.call_reward_function(picky, PROMPTS, [A, B], num_agents=2, batch_items=[{}, {}]) == [1.0, 2.0]
    assert attempts == [(2, ["batch_items", "prompts"]), (2, [])]

    def always(*args, **kwargs):
        raise TypeError(f"call with {len(kwargs)} keywords")

    with pytest.raises(TypeError, match="call with 2 keywords"):  # the first error, not the fallback's
        utils.call_reward_function(always, PROMPTS, [A, B], num_agents=2, batch_items=[{}, {}])

    def broken(c0, c1):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):  # other errors propagate as they are
        utils.call_reward_function(broken, PROMPTS, [A, B], num_agents=2)


# ----- normalize_reward_lengths ----------------------------------------------------------------------

def test_normalize_reward_lengths():
    norm = utils.normalize_reward_lengths
    assert norm([1, 2, 3], num_agents=1, num_generations=0, algorithm="MAAC") == [1.0, 2.0, 3.0]
    assert norm([2], num_agents=3, num_generations=4, algorithm="MAAC") == [2.0, 2.0, 2.0]
    assert norm([1, 2, 3], num_agents=3, num_generations=4, algorithm="MAAC") == [1.0, 2.0, 3.0]
    assert norm([1, 2, 3, 4], num_agents=3, num_generations=4, algorithm="MAAC") == [1.0, 2.0, 3.0, 4.0]
    result = norm((5,), num_agents=2, num_generations=1, algorithm="IAC")
    assert result == [5.0, 5.0] and all(type(v) is float for v in result)
    with pytest.raises(ValueError, match=r"either 1 or 3 values per prompt for multi-agent IAC"):
        norm([1, 2], num_agents=3, num_generations=4, algorithm="IAC")
    with pytest.raises(ValueError, match="num_generations must be >= 1"):
        norm([1], num_agents=2, num_generations=0, algorithm="IAC")


# ----- build_formatters --------------------------------------------------------------------------------

def test_build_formatters_defaults():
    formatters = utils.build_formatters(None, 3)
    assert len(formatters) == 3
    assert formatters[0]({"prompt": "hello"}) == "hello"
    assert formatters[1]({"question": "q"}) == ""  # no prompt field: empty string
    assert formatters[2]({"prompt": "hello"}, external_prompts="outside") == "outside"


def test_build_formatters_wraps_user_callables():
    def plain(item):
        return "plain:" + item["prompt"]

    def external(item, external_prompts="unset"):
        return f"{item['prompt']}|{external_prompts}"

    shared = utils.build_formatters(plain, 2)
    assert len(shared) == 2
    assert shared[0]({"prompt": "x"}, external_prompts="ignored") == "plain:x"
    assert shared[1]._comlrl_checkpoint_source is plain

    passing = utils.build_formatters([external, plain], 2)
    assert passing[0]({"prompt": "x"}) == "x|None"  # None is passed on by default
    assert passing[0]({"prompt": "x"}, external_prompts="e") == "x|e"
    assert passing[1]({"prompt": "x"}) == "plain:x"

    holding = utils.build_formatters([external, external], 2, pass_none_external_prompts=False)
    assert holding[0]({"prompt": "x"}) == "x|unset"  # called without the keyword
    assert holding[1]({"prompt": "x"}, external_prompts="e") == "x|e"


@pytest.mark.parametrize("formatters", [[lambda item: ""], 5, "prompt"])
def test_build_formatters_rejects_bad_input(formatters):
    with pytest.raises(ValueError):
        utils.build_formatters(formatters, 2)


# ----- tokenizers ------------------------------------------------------------------------------------------

@pytest.fixture
def tokenizer():
    return build_tiny_tokenizer()


def test_ensure_pad_token_sets_pad_from_eos(tokenizer):
    tokenizer.pad_token = None
    assert tokenizer.pad_token_id is None
    assert utils.ensure_pad_token(tokenizer) is tokenizer
    assert tokenizer.pad_token == tokenizer.eos_token == "</s>"
    assert tokenizer.pad_token_id == tokenizer.eos_token_id


def test_ensure_pad_token_keeps_an_existing_pad_and_needs_one(tokenizer):
    pad_id = tokenizer.pad_token_id
    assert pad_id != tokenizer.eos_token_id
    utils.ensure_pad_token(tokenizer)
    assert tokenizer.pad_token_id == pad_id
    tokenizer.pad_token = None
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="pad_token_id"):
        utils.ensure_pad_token(tokenizer)


def test_ensure_tokenizer(tokenizer, tmp_path):
    model = LlamaForCausalLM(tiny_llama_config(tokenizer))
    with pytest.raises(ValueError, match="Tokenizer must be provided"):
        utils.ensure_tokenizer(model, None)
    with pytest.raises(ValueError, match="Tokenizer must be provided"):
        utils.ensure_tokenizer(None, None)
    assert utils.ensure_tokenizer(model, tokenizer) is tokenizer
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    loaded = utils.ensure_tokenizer(str(tmp_path), None)
    assert loaded is not tokenizer and loaded.pad_token == "</s>"


def test_resolve_tokenizers(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    path = str(tmp_path)
    other = build_tiny_tokenizer()
    assert utils.resolve_tokenizers("ignored", tokenizer, None) is tokenizer  # single, as given
    from_model = utils.resolve_tokenizers(path, [tokenizer], None)  # a list without agents: loaded from model
    assert from_model is not tokenizer and from_model.pad_token == "<pad>"
    assert utils.resolve_tokenizers(None, tokenizer, [path, path]) is tokenizer  # shared, not a list
    assert utils.resolve_tokenizers(None, (tokenizer, other), ["a", "b"]) == [tokenizer, other]
    loaded = utils.resolve_tokenizers(None, None, [path, path])
    assert isinstance(loaded, list) and len(loaded) == 2 and loaded[0] is not loaded[1]
    with pytest.raises(ValueError, match="tokenizers length must match agents"):
        utils.resolve_tokenizers(None, [tokenizer], ["a", "b"])
    with pytest.raises(ValueError, match="must be provided when agents are model objects"):
        utils.resolve_tokenizers(None, None, [path, object()])
    other.pad_token = None
    utils.resolve_tokenizers(None, [tokenizer, other], ["a", "b"])
    assert other.pad_token == "</s>"  # every listed tokenizer gets a pad token


def test_apply_tokenizer_specials(tokenizer):
    tokenizer.pad_token = None
    model = LlamaForCausalLM(tiny_llama_config(build_tiny_tokenizer()))
    model.config.pad_token_id = model.config.eos_token_id = 1
    plain = SimpleNamespace(config=SimpleNamespace(pad_token_id=None, eos_token_id=None))
    wrapped = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace()), config=SimpleNamespace())
    utils.apply_tokenizer_specials(tokenizer, [model, None, plain, wrapped])
    eos = tokenizer.eos_token_id
    assert tokenizer.pad_token_id == eos  # the tokenizer got its pad token first
    assert (model.model.config.pad_token_id, model.model.config.eos_token_id) == (eos, eos)
    assert (plain.config.pad_token_id, plain.config.eos_token_id) == (eos, eos)
    assert (wrapped.model.config.pad_token_id, wrapped.model.config.eos_token_id) == (eos, eos)
    assert vars(wrapped.config) == {}  # the inner model's config is the one written

    no_eos = SimpleNamespace(pad_token="<pad>", pad_token_id=5, eos_token=None, eos_token_id=None)
    target = SimpleNamespace(config=SimpleNamespace())
    utils.apply_tokenizer_specials(no_eos, [target])
    assert (target.config.pad_token_id, target.config.eos_token_id) == (5, 5)  # EOS falls back to pad


# ----- model names and sources -------------------------------------------------------------------------------

def test_infer_model_name():
    assert utils.infer_model_name(None) is None
    assert utils.infer_model_name("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    model = LlamaForCausalLM(tiny_llama_config(build_tiny_tokenizer()))
    assert utils.infer_model_name(model) == "llama"  # a transformers model: its base model's model_type
    model.config._name_or_path = "org/tiny-llama"
    assert utils.infer_model_name(model) == "llama"  # model_type wins over the path for such models
    named = SimpleNamespace(config=SimpleNamespace(_name_or_path="org/name", model_type="gpt2"))
    assert utils.infer_model_name(named) == "org/name"  # no base_model: the config's name first
    assert utils.infer_model_name(SimpleNamespace(model=named)) == "org/name"
    assert utils.infer_model_name(SimpleNamespace(config=SimpleNamespace(model_type="gpt2"))) == "gpt2"

    class Bare:
        pass

    assert utils.infer_model_name(Bare()) == "Bare"
    assert utils.infer_model_name(SimpleNamespace(model=Bare())) == "Bare"


def test_resolve_model_sources():
    resolve = utils.resolve_model_sources
    assert resolve(kind="agents", model="m", models=None, expected_count=3) == (["m", "m", "m"], "m")
    assert resolve(kind="agents", model=None, models=("a", "b"), expected_count=2) == (["a", "b"], "a")
    assert resolve(kind="agents", model="m", models=["m", "m"], expected_count=2) == (["m", "m"], "m")
    with pytest.raises(ValueError, match=r"model and agents conflict: m != \['m', 'x'\]"):
        resolve(kind="agents", model="m", models=["m", "x"], expected_count=2)
    with pytest.raises(ValueError, match="Cannot provide both agent_model and agents unless"):
        resolve(kind="agents", model="m", models="m", expected_count=1, model_label="agent_model")
    with pytest.raises(ValueError, match=r"critics length \(1\) must match num_critics"):
        resolve(kind="critics", model=None, models=["c"], expected_count=2, expected_label="num_critics")
    with pytest.raises(ValueError, match=r"agents length \(3\) must match num_agents \(2\)"):
        resolve(kind="agents", model="m", models=["m"] * 3, expected_count=2)
    with pytest.raises(ValueError, match="Either model or agents must be provided"):
        resolve(kind="agents", model=None, models=None, expected_count=2)
    with pytest.raises(ValueError, match="expected_count must be >= 1"):
        resolve(kind="agents", model="m", models=None, expected_count=0)
    with pytest.raises(ValueError, match="agents entries must be non-null"):
        resolve(kind="agents", model=None, models=["a", None], expected_count=2)
    with pytest.raises(ValueError, match="agents must be a non-empty sequence"):
        resolve(kind="agents", model=None, models="ab", expected_count=2)
    obj = SimpleNamespace(config=SimpleNamespace(_name_or_path="org/x"))
    assert resolve(kind="agents", model=obj, models=None, expected_count=2) == ([obj, obj], "org/x")


# ----- distributed ------------------------------------------------------------------------------------------

def test_local_context_and_unwrap_model():
    context = utils.local_context()
    expected = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert context == utils.DistributedContext(is_main=True, device=expected)
    assert utils.local_context(torch.device("meta")).device == torch.device("meta")
    with pytest.raises(dataclasses.FrozenInstanceError):
        context.is_main = False

    module = torch.nn.Linear(2, 2)
    assert utils.unwrap_model(module) is module
    assert utils.unwrap_model(torch.nn.DataParallel(module)) is module
    assert utils.unwrap_model(SimpleNamespace(module="inner")) == "inner"


# ----- reference KL helpers -------------------------------------------------------------------
def test_reference_kl_settings_helpers():
    assert utils.reference_kl_enabled(SimpleNamespace()) is False and utils.reference_kl_coef(SimpleNamespace()) == 0.1
    args = SimpleNamespace(reference_kl_enabled=True, reference_kl_coef=0.3, reference_devices=["cpu", "cpu"])
    assert utils.reference_kl_enabled(args) and utils.reference_kl_coef(args) == 0.3
    utils.validate_reference_kl_config(args, 2)
    with pytest.raises(ValueError, match=r"reference_devices length \(2\) must be 1 or 3"):
        utils.validate_reference_kl_config(args, 3)
    with pytest.raises(ValueError, match="reference_kl_coef must be >= 0"):
        utils.validate_reference_kl_config(SimpleNamespace(reference_kl_coef=-1.0), 2)
    assert utils.resolve_reference_devices(args, [torch.device("meta")] * 2, 2) == [torch.device("cpu")] * 2
    assert utils.resolve_reference_devices(SimpleNamespace(), [torch.device("cpu")], 1) == [torch.device("cpu")]
    assert utils.resolve_reference_devices(SimpleNamespace(reference_devices="cpu"), [], 3) == [torch.device("cpu")] * 3


def test_reference_kl_for_sequence_is_zero_for_a_clone_and_k3_otherwise(tmp_path):
    from comlrl.algorithms.kl import k3_token_kl
    from comlrl.utils import reference_kl

    torch.manual_seed(0)
    policy = LlamaForCausalLM(tiny_llama_config(build_tiny_tokenizer()))
    policy.train()
    reference = utils.clone_reference_models([policy], devices=[torch.device("cpu")])[0]
    assert reference is not policy and not any(p.requires_grad for p in reference.parameters())
    sequences = torch.randint(3, 96, (2, 9))
    mask = torch.ones_like(sequences)
    assert utils.reference_kl_for_sequence(policy, reference, sequences, mask, 5, 4).tolist() == [0.0, 0.0]
    assert policy.training  # its mode is restored
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    kl = utils.reference_kl_for_sequence(policy, reference, sequences, mask, 5, 4)
    policy_lp = reference_kl.response_token_logprobs(policy.eval(), sequences, mask, 5, 4)
    reference_lp = reference_kl.response_token_logprobs(reference, sequences, mask, 5, 4)
    assert policy_lp.shape == (2, 4)
    assert torch.allclose(kl, k3_token_kl(policy_lp, reference_lp).sum(dim=-1).detach(), atol=1e-6)
    assert (kl > 0).all()
    policy.save_pretrained(tmp_path / "saved")
    loaded = utils.load_reference_models_from_sources([str(tmp_path / "saved")], devices=[torch.device("cpu")])[0]
    assert utils.reference_kl_for_sequence(policy, loaded, sequences, mask, 5, 4).abs().max() < 1e-5
