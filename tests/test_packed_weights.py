"""Packed decode weights (comlrl.rollout.packed_weights): what runs from the packed copy, that its
products are the usual ones up to rounding, that nothing of it outlives the block, and when it stays off."""

import psutil
import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, AutoTokenizer

import comlrl.rollout.packed_weights as packed_weights
from comlrl.models.lora import add_adapters
from comlrl.rollout.packed_weights import packable_layers, packed_linears, packing_supported
from comlrl.rollout.sampling import SamplingParams, decode

pytestmark = pytest.mark.skipif(not packing_supported(), reason="this torch build has no oneDNN packed linear")

PACKED_OP = "mkldnn::_linear_pointwise"


def linear_layers(model):
    return [module for module in model.modules() if isinstance(module, torch.nn.Linear)]


def ran_packed(function) -> int:
    """How many times the packed product ran while ``function`` ran (torch's own profiler counts it)."""
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        function()
    return sum(event.count for event in profiler.key_averages() if event.key == PACKED_OP)


@pytest.fixture
def model(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama).eval()


def test_every_linear_layer_multiplies_from_its_packed_copy_and_rows_over_the_limit_take_the_usual_path(model):
    layer = linear_layers(model)[0]
    few, many = torch.randn(8, 1, layer.in_features), torch.randn(9, layer.in_features)
    with torch.inference_mode(), packed_linears(model, rows=8, min_bytes=0) as count:
        assert count == len(linear_layers(model)) > 0
        assert all("forward" in vars(module) for module in linear_layers(model))
        assert ran_packed(lambda: layer(few)) == 1
        packed_few = layer(few)
        assert ran_packed(lambda: layer(many)) == 0
        assert torch.equal(layer(many), F.linear(many, layer.weight))  # 9 rows: the usual product, bit for bit
    expected = F.linear(few, layer.weight)
    assert packed_few.shape == expected.shape
    torch.testing.assert_close(packed_few, expected, rtol=1e-5, atol=1e-6)
    assert not any("forward" in vars(module) for module in linear_layers(model))
    assert ran_packed(lambda: layer(few)) == 0


def test_the_model_is_restored_when_the_block_raises(model):
    with pytest.raises(KeyboardInterrupt):
        with torch.inference_mode(), packed_linears(model, rows=4, min_bytes=0) as count:
            assert count > 0
            raise KeyboardInterrupt
    assert not any("forward" in vars(module) for module in model.modules())


def test_logits_of_a_packed_forward_match_the_usual_forward(model, tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    ids = tokenizer(["the cat sat on the hill"] * 4, return_tensors="pt")["input_ids"][:, :1]
    with torch.inference_mode():
        expected = model(input_ids=ids).logits
        with packed_linears(model, rows=4, min_bytes=0):
            packed = model(input_ids=ids).logits
            assert ran_packed(lambda: model(input_ids=ids)) == len(linear_layers(model))
    assert not torch.equal(packed, torch.zeros_like(packed))
    torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-5)


def test_a_small_model_is_left_as_it_is_at_the_default_threshold(model):
    size = sum(layer.weight.numel() * layer.weight.element_size() for layer in linear_layers(model))
    assert size < packed_weights.PACK_MIN_BYTES
    with torch.inference_mode(), packed_linears(model, rows=8) as count:
        assert count == 0
        assert not any("forward" in vars(module) for module in model.modules())
    with torch.inference_mode(), packed_linears(model, rows=8, min_bytes=size) as count:  # exactly at the threshold
        assert count == len(linear_layers(model))


def test_decode_runs_its_steps_from_packed_weights_above_the_threshold_and_draws_what_it_drew_before(
        model, tiny_llama, monkeypatch):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    encoded = tokenizer(["the agent", "a story about the moon"], return_tensors="pt", padding=True, padding_side="left")
    sampling = SamplingParams(max_new_tokens=6)

    def sample():
        generator = torch.Generator().manual_seed(3)
        return decode(model, encoded["input_ids"], encoded["attention_mask"], sampling, [tokenizer.eos_token_id],
                      tokenizer.pad_token_id, generator, num_generations=3)

    usual = sample()
    calls_usual = ran_packed(sample)
    monkeypatch.setattr(packed_weights, "PACK_MIN_BYTES", 0)
    calls_packed = ran_packed(sample)
    packed = sample()
    assert calls_usual == 0
    # every decode step after the prefill (2 prompts x 3 samples = 6 rows) runs every layer packed;
    # the prefill's 2 x prompt-length rows exceed 6 and take the usual product, but for the output
    # head, which sees only the last position of the 2 prompts
    steps = packed.shape[1] - 1
    assert encoded["input_ids"].numel() > 6
    assert steps >= 1 and calls_packed == steps * len(linear_layers(model)) + 1
    assert torch.equal(packed, usual)  # a ~80k-parameter model's draws are far from rounding's reach
    assert not any("forward" in vars(module) for module in model.modules())


def test_layers_with_their_own_forward_are_left_as_they_are(model):
    layers = packable_layers(model)
    hooked = layers[0]
    hooked.forward = lambda inputs: F.linear(inputs, hooked.weight, hooked.bias)  # as accelerate's hooks do
    assert hooked not in packable_layers(model) and len(packable_layers(model)) == len(layers) - 1
    with torch.inference_mode(), packed_linears(model, rows=2, min_bytes=0) as count:
        assert count == len(layers) - 1
        assert ran_packed(lambda: hooked(torch.randn(2, hooked.in_features))) == 0
    assert "forward" in vars(hooked)  # its own forward is left in place


def test_a_lora_model_is_not_packed(model):
    """A LoRA model keeps its peak memory: no packed copy of its frozen weights during a decode."""
    pytest.importorskip("peft")
    wrapped = add_adapters(model, rank=4, alpha=8, dropout=0.0, target_modules=None).eval()
    assert packable_layers(wrapped) == []
    with torch.inference_mode(), packed_linears(wrapped, rows=2, min_bytes=0) as count:
        assert count == 0


def test_bf16_weights_are_packed_too_and_other_dtypes_are_not(model):
    """Where the CPU's oneDNN packs bf16 (torch's own query: AVX-512 BF16 or AMX), every layer is packed;
    elsewhere (this AMD EPYC without AVX-512) none is, and the layers still compute the usual products."""
    layer = linear_layers(model)[0]
    model.to(torch.bfloat16)
    x = torch.randn(3, layer.in_features, dtype=torch.bfloat16)
    bf16_packs = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    with torch.inference_mode():
        expected = F.linear(x, layer.weight)
        with packed_linears(model, rows=3, min_bytes=0) as count:
            assert count == (len(linear_layers(model)) if bf16_packs else 0)
            torch.testing.assert_close(layer(x), expected, rtol=2e-2, atol=2e-2)
    model.to(torch.float64)
    assert packable_layers(model) == []


def test_only_cpu_weights_are_packed(model):
    """A GPU's matrix library has its own kernels: weights on any other device stay as they are
    (the meta device stands in for one here)."""
    layers = packable_layers(model)
    assert layers
    model.to("meta")
    assert packable_layers(model) == []


def test_no_copy_is_made_when_too_little_memory_is_free(model, monkeypatch):
    size = sum(layer.weight.numel() * layer.weight.element_size() for layer in linear_layers(model))
    free = psutil.virtual_memory().available
    monkeypatch.setattr(packed_weights, "MEMORY_HEADROOM", 2 * free / size)  # would need twice what is free
    with torch.inference_mode(), packed_linears(model, rows=4, min_bytes=0) as count:
        assert count == 0
    monkeypatch.setattr(packed_weights, "MEMORY_HEADROOM", free / size / 2)  # needs half of what is free
    with torch.inference_mode(), packed_linears(model, rows=4, min_bytes=0) as count:
        assert count == len(linear_layers(model))


class SubclassedTensor(torch.Tensor):
    """A tensor subclass, as FSDP's sharded DTensor parameters are."""


def test_weights_held_in_a_tensor_subclass_are_not_packed(model):
    layer = linear_layers(model)[0]
    layer.weight = torch.nn.Parameter(torch.Tensor._make_subclass(SubclassedTensor, layer.weight.detach()))
    assert layer not in packable_layers(model)
    assert len(packable_layers(model)) == len(linear_layers(model)) - 1
