"""KL divergence to a reference policy, estimated from sampled tokens (pure functions).

The estimates read log-probabilities at the sampling temperature, under the policy and the reference,
and are unbiased when the tokens were drawn from that tempered policy. Top-p/top-k sampling draws them
from a truncated distribution instead (:func:`truncated_sampling_warning`; docs/algorithms.md).
"""

from __future__ import annotations

import torch


def k3_token_kl(logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of ``KL(policy || reference)`` per sampled token:
    ``exp(d) - d - 1`` with ``d = log p_ref(token) - log p_policy(token)``.

    Non-negative for every token, 0 exactly where the two log-probabilities agree, and unbiased
    for the KL when tokens are sampled from the policy. Gradients flow through ``logprobs``.
    """
    delta = reference_logprobs - logprobs
    return torch.exp(delta) - delta - 1.0


def sequence_kl(token_kl: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A completion's KL: the sum of its tokens' estimates over the mask, ``[batch, tokens]`` -> ``[batch]``."""
    return (token_kl * mask.to(token_kl.dtype)).sum(dim=1)


def kl_shaped_rewards(rewards: torch.Tensor, kl: torch.Tensor, coef: float) -> torch.Tensor:
    """Rewards less the KL penalty, ``r - coef * KL`` (NaN rewards stay NaN: dropped samples)."""
    return rewards - coef * kl.to(rewards.dtype)


class TruncatedSamplingKLWarning(UserWarning):
    """A KL term is estimated from tokens sampled with top-p/top-k: the estimate is not the KL."""


def truncation_settings(top_p: float, top_k: int | None) -> list[str]:
    """The sampling settings that truncate the policy's distribution (``top_p < 1``, ``top_k`` set)."""
    return ([f"top_p={top_p}"] if top_p < 1.0 else []) + ([f"top_k={top_k}"] if top_k else [])


def truncated_sampling_warning(owner: str, kl_coef: float, top_p: float, top_k: int | None) -> str | None:
    """What to tell a user whose KL term (``kl_coef > 0``) is estimated from truncated sampling; None if it is not."""
    settings = truncation_settings(top_p, top_k)
    if kl_coef <= 0 or not settings:
        return None
    return (f"{owner}: the reference KL (k3 estimate) is computed from completions sampled with truncated sampling "
            f"(truncated by {', '.join(settings)}): the tokens come from the policy's distribution cut to its top "
            "tokens and renormalised, not from the policy whose log-probabilities the estimate reads, so it is not "
            "an unbiased estimate of KL(policy || reference) (it reads the head of the distribution, re-weighted, "
            "and never the tail, where the policy may drift unseen); it still is >= 0 and 0 where the two agree on the sampled "
            "tokens. For an unbiased KL sample with top_p=1.0, top_k=None (docs/algorithms.md, 'Reference-model KL')")
