"""KL divergence to a reference policy, estimated from sampled tokens (pure functions)."""

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
