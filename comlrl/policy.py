"""Policy-gradient updates of one agent over its completions (shared by every trainer)."""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import PreTrainedModel

from comlrl.algorithms.losses import clipped_policy_loss, masked_sequence_mean, token_entropy
from comlrl.logprobs import completion_logits, completion_logprobs, token_logprobs
from comlrl.rollout import Generation


@torch.inference_mode()
def behaviour_logprobs(model: PreTrainedModel, generations: Sequence[Generation], temperature: float) -> list[torch.Tensor]:
    """Log-probabilities under the policy that sampled, before any update (no graph kept)."""
    return [
        completion_logprobs(model, g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask, temperature)
        for g in generations
    ]


def policy_gradient_backward(
    model: PreTrainedModel,
    generations: Sequence[Generation],
    advantages: Sequence[torch.Tensor],
    clip_epsilon: float,
    temperature: float,
    old_logprobs: Sequence[torch.Tensor] | None = None,
    scale: float = 1.0,
    entropy_coef: float = 0.0,
) -> float:
    """Backpropagate the clipped policy loss over every turn's completions; returns the loss.

    Each turn is its own forward pass (prompt lengths differ); the turns' losses are
    averaged by completion count. When ``old_logprobs`` is None the policy has not changed
    since sampling, so the detached current log-probabilities serve (ratio 1, same gradient)
    and a second forward pass is saved. ``entropy_coef > 0`` subtracts that multiple of the
    mean per-token entropy of the policy (an exploration bonus).
    """
    total_rows = sum(g.completion_ids.shape[0] for g in generations)
    loss_value = 0.0
    for turn, (generation, turn_advantages) in enumerate(zip(generations, advantages)):
        inputs = (generation.prompt_ids, generation.prompt_mask, generation.completion_ids, generation.completion_mask)
        if entropy_coef > 0:
            logits = completion_logits(model, *inputs, temperature)
            logprobs = token_logprobs(logits, generation.completion_ids)
            entropy = masked_sequence_mean(token_entropy(logits), generation.completion_mask).mean()
        else:
            logprobs = completion_logprobs(model, *inputs, temperature)
        old = old_logprobs[turn] if old_logprobs is not None else logprobs.detach()
        weight = generation.completion_ids.shape[0] / total_rows
        loss = clipped_policy_loss(
            logprobs, old, turn_advantages.to(logprobs.device), generation.completion_mask, clip_epsilon
        )
        if entropy_coef > 0:
            loss = loss - entropy_coef * entropy
        (loss * weight * scale).backward()
        loss_value += float(loss.detach()) * weight
    return loss_value
