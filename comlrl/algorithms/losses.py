"""Policy losses, as pure functions over tensors."""

from __future__ import annotations

import torch


def masked_sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over each row's valid tokens (``[batch, tokens]`` -> ``[batch]``); empty rows give 0."""
    mask = mask.to(values.dtype)
    return (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_epsilon: float,
) -> torch.Tensor:
    """PPO-style clipped policy-gradient loss, averaged per completion then over completions.

    ``logprobs``/``old_logprobs``/``mask`` are ``[batch, tokens]``; ``advantages`` is ``[batch]``.
    Minimising it raises the log-probability of completions with positive advantage.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    advantages = advantages.unsqueeze(1).to(logprobs.dtype)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_epsilon, 1.0 + clip_epsilon) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    return masked_sequence_mean(per_token, mask).mean()


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood that each chosen response beats its rejected one:
    ``mean(-log sigmoid(r_chosen - r_rejected))``."""
    return -torch.nn.functional.logsigmoid(chosen - rejected).mean()
