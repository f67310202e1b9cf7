"""comlrl 1.4.3's reference-KL helpers and its iterative trainers' reward-distribution helpers: the values
they return for the inputs its code passes (hand-computed from its documented behaviour; the original is
not imported)."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from comlrl.tiny import build_tiny_tokenizer, tiny_llama_config
from comlrl.trainers.preference import MADPOIterTrainer, MARLHFIterTrainer
from comlrl.trainers.preference import reward_histogram as rh
from comlrl.utils import reference_kl as rk

NAN, INF = float("nan"), float("inf")
CPU = torch.device("cpu")


# ----- reference-KL helpers -------------------------------------------------------------------

@pytest.mark.parametrize("args, enabled, coef", [
    (SimpleNamespace(), False, 0.1),                                    # no fields: off, default 0.1
    (SimpleNamespace(reference_kl_enabled=1, reference_kl_coef=2), True, 2.0),
    (SimpleNamespace(reference_kl_enabled=None, reference_kl_coef="0.5"), False, 0.5),
    (SimpleNamespace(reference_kl_enabled=True, reference_kl_coef=0), True, 0.0),
])
def test_enabled_and_coefficient(args, enabled, coef):
    assert rk.reference_kl_enabled(args) is enabled
    assert rk.reference_kl_coef(args) == coef


@pytest.mark.parametrize("devices, count, expected", [
    (None, 2, ["meta", "meta"]),           # unset: the fallbacks, as given
    ("cpu", 3, ["cpu"] * 3),
    (["cpu"], 2, ["cpu", "cpu"]),          # a one-entry list places every model there
    (("cpu", "cpu"), 2, ["cpu", "cpu"]),
    ([CPU, CPU], 2, ["cpu", "cpu"]),       # torch.device entries
    ("auto", 2, ["cpu", "cpu"]),           # no GPU here: CPU for all
    ("AUTO", 1, ["cpu"]),
])
def test_resolve_reference_devices(devices, count, expected):
    if devices in ("auto", "AUTO") and torch.cuda.is_available():
        pytest.skip("'auto' places on GPUs where there are some")
    args = SimpleNamespace(reference_devices=devices)
    resolved = rk.resolve_reference_devices(args, [torch.device("meta")] * count, count)
    assert [d.type for d in resolved] == expected


@pytest.mark.parametrize("devices, count", [
    ([], 2),                    # an empty list
    (["cpu"] * 3, 2),           # neither 1 nor one per model
    ("cpu", 0),                 # nothing to place
    (7, 2),                     # not a device
    ("gpu", 1),                 # not a torch device string
])
def test_resolve_and_validate_refuse(devices, count):
    args = SimpleNamespace(reference_kl_enabled=True, reference_devices=devices)
    with pytest.raises(ValueError):
        rk.resolve_reference_devices(args, [CPU] * count, count)
    with pytest.raises(ValueError):
        rk.validate_reference_kl_config(args, count)


@pytest.mark.parametrize("args", [
    SimpleNamespace(reference_kl_enabled=False, reference_devices=["cpu"] * 3),  # off: devices not looked at
    SimpleNamespace(reference_kl_enabled=True, reference_devices=None),
    SimpleNamespace(reference_kl_coef=NAN),                                       # NaN is not < 0
    SimpleNamespace(reference_kl_enabled=True, reference_devices="auto"),
])
def test_validate_accepts(args):
    rk.validate_reference_kl_config(args, 2)


def test_validate_refuses_a_negative_coefficient():
    with pytest.raises(ValueError, match="reference_kl_coef must be >= 0"):
        rk.validate_reference_kl_config(SimpleNamespace(reference_kl_coef=-0.01), 2)


def tiny_model(seed):
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(build_tiny_tokenizer()))


class Wrapper(torch.nn.Module):
    """A model kept as ``.module`` (as DDP keeps it)."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def test_clone_copies_each_model_as_given_frozen_and_needs_a_device_each():
    plain, wrapped = tiny_model(0), Wrapper(tiny_model(1))
    plain.train()
    clones = rk.clone_reference_models([plain, wrapped], devices=[CPU, CPU, CPU])  # an extra device is unused
    assert len(clones) == 2 and isinstance(clones[1], Wrapper)  # the wrapper itself is copied
    assert clones[0] is not plain and not clones[0].training and plain.training
    assert not any(p.requires_grad for c in clones for p in c.parameters())
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), clones[0].parameters()))
    with pytest.raises(IndexError, match="2 policy models but only 1 devices"):
        rk.clone_reference_models([plain, wrapped], devices=[CPU])


def test_response_logprobs_and_sequence_kl_by_hand():
    policy, reference = tiny_model(0), tiny_model(1)
    sequences = torch.tensor([[5, 9, 14, 20, 33], [7, 7, 8, 40, 2]])
    mask = torch.ones_like(sequences)
    # log p(token t | tokens < t) for the response tokens at positions 2..3 (prompt 2, response 2)
    log_probs = torch.log_softmax(policy(input_ids=sequences, attention_mask=mask).logits, dim=-1)
    by_hand = torch.stack([log_probs[:, t - 1].gather(-1, sequences[:, t:t + 1]).squeeze(-1) for t in (2, 3)], dim=1)
    got = rk.response_token_logprobs(policy, sequences, mask, prompt_len=2, response_len=2)
    assert got.shape == (2, 2) and torch.allclose(got, by_hand, atol=1e-6)
    assert rk.response_token_logprobs(policy, sequences, mask, 0, 1).shape == (2, 1)  # prompt 0 starts at 0
    assert rk.response_token_logprobs(policy, sequences, mask, 3, 10).shape == (2, 2)  # cut at the end

    ref = rk.response_token_logprobs(reference, sequences, mask, 2, 2)
    delta = ref - got
    expected = (torch.exp(delta) - delta - 1).sum(dim=-1)  # k3 summed over the response tokens
    policy.train()
    reference.eval()
    kl = rk.reference_kl_for_sequence(policy, reference, sequences, mask, 2, 2)
    assert torch.allclose(kl, expected, atol=1e-6) and (kl >= 0).all() and kl.device.type == "cpu"
    assert policy.training and not reference.training  # modes restored
    assert torch.equal(rk.reference_kl_for_sequence(policy, policy, sequences, mask, 2, 2), torch.zeros(2))


# ----- reward-distribution helpers ------------------------------------------------------------

@pytest.mark.parametrize("values, expected", [
    ([], []),
    ([1, 2.5, NAN, INF, -INF, "3", True], [1.0, 2.5, 3.0, 1.0]),
    ([NAN, NAN], []),
])
def test_finite_floats(values, expected):
    assert rh.finite_floats(values) == expected


def test_finite_floats_refuses_none():
    with pytest.raises(TypeError):
        rh.finite_floats([None])


UNIT = rh.bin_edges((0.0, 1.0))


@pytest.mark.parametrize("rewards, counts", [
    ([], [0] * 16),
    ([-5, 0, 0.5, 1, 7], [2] + [0] * 7 + [1] + [0] * 6 + [2]),  # outside the range: the end bins
    ([0.0625, 0.9999], [0, 1] + [0] * 13 + [1]),                 # an inner edge opens the next bin
    ([NAN, 0.5], [0] * 8 + [1] + [0] * 7),                       # NaN is not counted
    ([INF, 0.5], [0] * 8 + [1] + [0] * 6 + [1]),                 # inf is clipped to the last bin
])
def test_histogram_counts(rewards, counts):
    got, edges = rh.histogram_counts(rewards, UNIT)
    assert got.tolist() == counts and edges is UNIT


def test_bin_edges_and_series():
    edges = rh.bin_edges((-1, 3))
    assert edges.tolist() == [-1 + 0.25 * k for k in range(17)]
    assert rh.histogram_series([-1, 3, 5, NAN, 0.26], edges) == {
        "sample_count": 4, "mean": pytest.approx((-1 + 3 + 5 + 0.26) / 4),
        "counts": [1, 0, 0, 0, 0, 1] + [0] * 9 + [2], "raw_rewards": [-1.0, 3.0, 5.0, 0.26]}
    assert rh.histogram_series([], edges) == {"sample_count": 0, "mean": None, "counts": [0] * 16, "raw_rewards": []}


@pytest.mark.parametrize("target, comparator, pair_count, expected", [
    ([], [], 3, {}),
    ([1.0, 2.0], [], 3, {"ns/current_iteration": 1.0, "ns/pair_count": 3.0, "ns/target_sample_count": 2.0,
                         "ns/comparator_sample_count": 0.0, "ns/target_mean": 1.5}),
    ([1.0], [2.0], None, {"ns/current_iteration": 1.0, "ns/target_sample_count": 1.0,
                          "ns/comparator_sample_count": 1.0, "ns/target_mean": 1.0, "ns/comparator_mean": 2.0}),
])
def test_histogram_metrics(target, comparator, pair_count, expected):
    assert rh.histogram_metrics("ns", 0, target, comparator, pair_count) == expected


def test_selected_pair_rewards_skip_missing_and_filter_each_side():
    pair = SimpleNamespace
    pairs = [pair(target_raw_reward=1.0, comparator_raw_reward=0.0),
             pair(target_raw_reward=None, comparator_raw_reward=2.0),   # skipped: one side missing
             pair(target_raw_reward=NAN, comparator_raw_reward=3.0)]    # NaN dropped on its side only
    assert rh.selected_pair_rewards(pairs) == ([1.0], [0.0, 3.0])
    assert rh.selected_pair_rewards([]) == ([], [])


@pytest.mark.parametrize("value, text", [
    (0, "0"), (1.0, "1"), (-2.0, "-2"), (2.5, "2.5"), (-1.25, "-1.2"), (0.5, "0.50"), (0.125, "0.12"),
    (-0.1, "-0.10"), (0.05, "0.050"), (1e-4, "0.000"), (0.999999999999, "1"),
])
def test_format_axis_tick(value, text):
    assert rh.format_axis_tick(value) == text


@pytest.mark.parametrize("trainer_class", [MADPOIterTrainer, MARLHFIterTrainer])
def test_the_original_names_on_the_iterative_trainers_are_these_functions(trainer_class):
    assert trainer_class._finite_floats is rh.finite_floats
    assert trainer_class._format_axis_tick is rh.format_axis_tick

    def reward(a, b):
        return [0.0] * len(a)

    fake = object.__new__(trainer_class)  # only what the helpers read: args and the policy's reward
    fake.args = SimpleNamespace(log_reward_distribution=True)
    fake.policy_trainer = SimpleNamespace(reward=SimpleNamespace(funcs=[reward]))
    with pytest.raises(ValueError, match="requires reward_func.reward_range"):
        trainer_class._reward_distribution_bin_edges(fake)
    reward.reward_range = (-1, 3)
    edges = trainer_class._reward_distribution_bin_edges(fake)
    assert edges.tolist() == rh.bin_edges((-1, 3)).tolist()
    assert trainer_class._reward_distribution_counts(fake, [3], edges)[0].tolist() == [0] * 15 + [1]
    assert trainer_class._reward_distribution_json_section(fake, [1.0], [], edges)["comparator"]["mean"] is None
    assert trainer_class._log_reward_distribution_enabled(fake) is True
    fake.args = SimpleNamespace()
    assert trainer_class._log_reward_distribution_enabled(fake) is False
    assert math.isclose(float(np.mean(trainer_class._selected_pair_reward_values(
        fake, [SimpleNamespace(target_raw_reward=2.0, comparator_raw_reward=1.0)])[0])), 2.0)
