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


def value_loss(
    values: torch.Tensor,
    targets: torch.Tensor,
    old_values: torch.Tensor | None = None,
    clip_range: float | None = None,
) -> torch.Tensor:
    """Critic loss: mean squared error to the targets, optionally value-clipped (PPO style).

    With ``clip_range`` the loss per sample is ``max((V - G)^2, (V_clip - G)^2)`` where
    ``V_clip = V_old + clamp(V - V_old, -clip_range, clip_range)``: the critic gains nothing
    from moving further than ``clip_range`` from the values it had at rollout time.
    """
    squared = (values - targets) ** 2
    if clip_range is None:
        return squared.mean()
    if old_values is None:
        raise ValueError("value_loss with clip_range needs old_values (the values at rollout time)")
    clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    return torch.maximum(squared, (clipped - targets) ** 2).mean()


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each position's next-token distribution (``[..., vocab]`` -> ``[...]``)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return -(log_probs.exp() * log_probs).sum(dim=-1)
