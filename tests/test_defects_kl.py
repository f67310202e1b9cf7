"""Issue 27, suspicion d: the k3 estimate of the reference KL is unbiased only for tokens drawn from the
distribution its log-probabilities are computed under; top-p/top-k sampling draws from a truncated one.
The bias is shown on exact expectations over a 4-token vocabulary, and a MAGRPO-family config with a KL term
and truncated sampling warns once, at construction, naming the settings (docs/algorithms.md)."""

from __future__ import annotations

import warnings

import pytest
import torch

from comlrl.algorithms.kl import k3_token_kl
from comlrl.rollout.sampling import SamplingParams, warp_logits
from comlrl.trainers.reinforce import MAGRPOConfig, MARLOOConfig


def expected_k3(sampling_probs: torch.Tensor, policy: torch.Tensor, reference: torch.Tensor) -> float:
    """E_{x ~ sampling}[k3(x)] exactly: sum over the vocabulary."""
    return float((sampling_probs * k3_token_kl(policy.log(), reference.log())).sum())


def test_k3_is_unbiased_only_without_truncation_by_hand():
    policy = torch.tensor([0.5, 0.3, 0.15, 0.05])
    reference = torch.tensor([0.25, 0.25, 0.25, 0.25])
    kl = float((policy * (policy / reference).log()).sum())
    # sampled from the policy itself: E[k3] = sum_x p(x) (r/p - log(r/p) - 1) = 1 - 1 + KL
    assert expected_k3(policy, policy, reference) == pytest.approx(kl, abs=1e-6)
    # top-p 0.6 keeps the tokens of 0.5 and 0.3 (renormalised: 0.625, 0.375); top-k 1 keeps only the first
    for sampling in (SamplingParams(top_p=0.6), SamplingParams(top_k=1)):
        truncated = warp_logits(policy.log(), sampling).softmax(dim=-1)
        assert int((truncated > 0).sum()) < 4
        assert expected_k3(truncated, policy, reference) != pytest.approx(kl, rel=0.05)
    # top-p 0.6 by hand: 0.625 * k3(0.25/0.5) + 0.375 * k3(0.25/0.3), with k3(r) = r - log r - 1
    r1, r2 = 0.5, 0.25 / 0.3
    by_hand = 0.625 * (r1 - torch.tensor(r1).log().item() - 1) + 0.375 * (r2 - torch.tensor(r2).log().item() - 1)
    truncated = warp_logits(policy.log(), SamplingParams(top_p=0.6)).softmax(dim=-1)
    assert expected_k3(truncated, policy, reference) == pytest.approx(by_hand, abs=1e-6)
    assert by_hand == pytest.approx(0.1266, abs=1e-4) and kl == pytest.approx(0.2442, abs=1e-4)  # about half


def construction_warnings(**options) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        MAGRPOConfig(**options)
    return [str(w.message) for w in caught if "KL" in str(w.message)]


def test_a_kl_term_with_truncated_sampling_warns_once_at_construction():
    # the defaults sample with top_p=0.6 and top_k=50
    [message] = construction_warnings(reference_kl_enabled=True)
    assert "top_p=0.6" in message and "top_k=50" in message and "top_p=1.0, top_k=None" in message
    [message] = construction_warnings(reference_kl_enabled=True, reference_kl_mode="loss", top_p=1.0)
    assert "top_k=50" in message and "top_p" not in message.split("truncated by")[1].split(")")[0]
    assert construction_warnings(reference_kl_enabled=True, top_p=1.0, top_k=None) == []  # the policy's own
    assert construction_warnings(top_p=0.6) == []  # no KL term
    assert construction_warnings(reference_kl_enabled=True, reference_kl_coef=0.0) == []  # a term of weight 0
    with warnings.catch_warnings(record=True) as caught:  # the variants inherit it
        warnings.simplefilter("always")
        MARLOOConfig(reference_kl_enabled=True, top_k=None)
    assert ["top_p=0.6" in str(w.message) for w in caught] == [True]
