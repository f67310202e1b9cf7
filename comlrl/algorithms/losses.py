"""Policy losses, as pure functions over tensors."""

from __future__ import annotations

import torch


def masked_sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over each row's valid tokens (``[batch, tokens]`` -> ``[batch]``); empty rows give 0."""
    mask = mask.to(values.dtype)
    return (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)


LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")


def clipped_token_losses(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, clip_epsilon: float
) -> torch.Tensor:
    """PPO's clipped surrogate per token, negated to a loss: ``-min(rho * A, clip(rho, 1 - eps, 1 + eps) * A)``
    with ``rho = exp(logprobs - old_logprobs)``; ``[batch, tokens]`` (``advantages`` is ``[batch]``)."""
    ratio = torch.exp(logprobs - old_logprobs)
    advantages = advantages.unsqueeze(1).to(logprobs.dtype)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_epsilon, 1.0 + clip_epsilon) * advantages
    return -torch.minimum(unclipped, clipped)


def loss_normaliser(loss_type: str, num_sequences: int, num_tokens: int, max_completion_length: int | None) -> float:
    """What the summed loss is divided by (see :func:`aggregate_token_losses`), over every completion of
    the update: ``grpo`` the number of sequences, ``bnpo``/``dapo`` the number of completion tokens,
    ``dr_grpo`` sequences x ``max_completion_length`` (a constant: no length bias)."""
    if loss_type == "grpo":
        return float(max(num_sequences, 1))
    if loss_type in ("bnpo", "dapo"):
        return float(max(num_tokens, 1))
    if loss_type == "dr_grpo":
        if not max_completion_length:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length (the config's max_new_tokens)")
        return float(max(num_sequences, 1) * max_completion_length)
    raise ValueError(f"loss_type must be one of {list(LOSS_TYPES)}, got {loss_type!r}")


def aggregate_token_losses(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, normaliser: float) -> torch.Tensor:
    """Reduce ``[batch, tokens]`` losses to a scalar, divided by ``normaliser`` (:func:`loss_normaliser`).

    ``grpo``: each sequence's mean over its tokens, summed over sequences (GRPO: every completion
    weighs the same, whatever its length). ``bnpo``/``dapo``: every token's loss summed (token-level:
    every token weighs the same, so long completions weigh more). ``dr_grpo``: the same token sum
    (Dr. GRPO), its normaliser a constant. With one batch and the matching normaliser these are
    ``mean_i mean_t l_it``, ``sum_it l_it / sum_i |o_i|`` and ``sum_it l_it / (N * L_max)``.
    """
    if loss_type == "grpo":
        return masked_sequence_mean(per_token, mask).sum() / normaliser
    return (per_token * mask.to(per_token.dtype)).sum() / normaliser


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_epsilon: float,
) -> torch.Tensor:
    """PPO-style clipped policy-gradient loss, averaged per completion then over completions (``grpo``).

    ``logprobs``/``old_logprobs``/``mask`` are ``[batch, tokens]``; ``advantages`` is ``[batch]``.
    Minimising it raises the log-probability of completions with positive advantage.
    """
    per_token = clipped_token_losses(logprobs, old_logprobs, advantages, clip_epsilon)
    return aggregate_token_losses(per_token, mask, "grpo", float(max(logprobs.shape[0], 1)))


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
