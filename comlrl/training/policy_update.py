"""Policy-gradient updates of one agent over its completions (shared by every trainer)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator, Sequence

import torch
from transformers import PreTrainedModel

from comlrl.algorithms.kl import k3_token_kl
from comlrl.algorithms.losses import (aggregate_token_losses, clipped_token_losses, loss_normaliser,
                                     masked_sequence_mean, token_entropy)
from comlrl.training.logprobs import completion_logits, completion_logprobs, token_logprobs
from comlrl.rollout.generation import Generation


@contextmanager
def dropout_disabled(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Forward passes inside run without dropout, as the completions were sampled (rollouts run in eval mode).

    Every submodule is put in eval mode except those that checkpoint activations (a
    ``gradient_checkpointing`` flag that is set): Transformers recomputes a layer in the backward
    pass only while it is in training mode, so those layers keep their mode; their dropout sits
    in their submodules (attention, MLP, ``nn.Dropout``), which are in eval mode. (A checkpointing
    module that applied dropout itself, rather than through a submodule, would keep it.) Each
    module's own mode is restored on exit. This is how RL fine-tuning of LLMs usually runs (TRL
    turns dropout off in its GRPO and PPO trainers): with dropout on, the behaviour log-probs and
    the update's log-probs would be different random functions of the same tokens, and the
    probability ratio would clip on dropout noise.
    """
    modes = [(module, module.training) for module in model.modules()]
    try:
        for module, _ in modes:
            if not getattr(module, "gradient_checkpointing", False):
                module.training = False
        yield model
    finally:
        for module, mode in modes:
            module.training = mode


@torch.inference_mode()
def behaviour_logprobs(model: PreTrainedModel, generations: Sequence[Generation], temperature: float,
                       autocast_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Log-probabilities under the policy that sampled, before any update (no graph kept).

    Computed with dropout off (:func:`dropout_disabled`), whatever mode ``model`` is in, so two
    calls give the same numbers and they match the update's forward passes; the mode is restored.
    """
    with dropout_disabled(model):
        return [
            completion_logprobs(model, g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask, temperature,
                                autocast_dtype)
            for g in generations
        ]


def completion_counts(generations: Sequence[Generation]) -> tuple[int, int]:
    """``(completions, completion tokens)`` of an agent's generations: what its loss is normalised by."""
    return (sum(g.completion_ids.shape[0] for g in generations), sum(int(g.completion_mask.sum()) for g in generations))


def policy_losses(
    model: PreTrainedModel,
    generations: Sequence[Generation],
    advantages: Sequence[torch.Tensor],
    clip_epsilon: float,
    temperature: float,
    old_logprobs: Sequence[torch.Tensor] | None = None,
    entropy_coef: float = 0.0,
    loss_type: str = "grpo",
    max_completion_length: int | None = None,
    reference_logprobs: Sequence[torch.Tensor] | None = None,
    kl_coef: float = 0.0,
    autocast_dtype: torch.dtype | None = None,
    counts: tuple[float, float] | None = None,
) -> Iterator[torch.Tensor]:
    """Each turn's clipped policy loss over its completions, normalised over all turns' completions as
    ``loss_type`` says (:func:`comlrl.algorithms.losses.aggregate_token_losses`: their sum is the agent's
    loss), yielded one at a time so the caller's backward frees a turn's graph before the next turn's
    forward pass (prompt lengths differ, so each turn is its own pass).

    When ``old_logprobs`` is None the policy has not changed since sampling, so the detached current
    log-probabilities serve (ratio 1, same gradient) and a second forward pass is saved.
    ``reference_logprobs`` with ``kl_coef > 0`` adds ``kl_coef`` times the k3 estimate of the KL to the
    reference on every token (the KL as a loss term, as TRL's GRPO ``beta``).
    ``entropy_coef > 0`` subtracts that multiple of the mean per-token entropy (an exploration
    bonus). ``counts`` = ``(sequences, tokens)`` replaces these completions' counts in the normaliser
    (under data parallelism: the mean counts over the processes). ``autocast_dtype`` runs the forward
    passes under autocast (``precision="bf16-mixed"``). The passes run with dropout off
    (:func:`dropout_disabled`), as the behaviour
    log-probabilities do, and stay so while the caller backpropagates (a checkpointed layer
    recomputes in the backward pass), so the first pass's probability ratio is exactly 1.
    """
    total_rows, total_tokens = counts if counts is not None else completion_counts(generations)
    normaliser = loss_normaliser(loss_type, total_rows, total_tokens, max_completion_length)
    with dropout_disabled(model):
        for turn, (generation, turn_advantages) in enumerate(zip(generations, advantages)):
            inputs = (generation.prompt_ids, generation.prompt_mask,
                      generation.completion_ids, generation.completion_mask)
            if entropy_coef > 0:
                logits = completion_logits(model, *inputs, temperature, autocast_dtype)
                logprobs = token_logprobs(logits, generation.completion_ids)
                entropy = masked_sequence_mean(token_entropy(logits), generation.completion_mask).mean()
            else:
                logprobs = completion_logprobs(model, *inputs, temperature, autocast_dtype)
            old = old_logprobs[turn] if old_logprobs is not None else logprobs.detach()
            per_token = clipped_token_losses(logprobs, old.to(logprobs.device),
                                             turn_advantages.to(logprobs.device), clip_epsilon)
            if reference_logprobs is not None and kl_coef > 0:
                per_token = per_token + kl_coef * k3_token_kl(logprobs, reference_logprobs[turn].to(logprobs.device))
            loss = aggregate_token_losses(per_token, generation.completion_mask, loss_type, normaliser)
            if entropy_coef > 0:
                loss = loss - entropy_coef * entropy * (generation.completion_ids.shape[0] / total_rows)
            yield loss


def backpropagate(losses: Iterable[torch.Tensor], scale: float = 1.0) -> float:
    """Where the trainers' losses are backpropagated: each in turn (its graph freed before the next is
    built), times ``scale`` (the accumulation share); returns their unscaled sum."""
    total = 0.0
    for loss in losses:
        (loss * scale).backward()
        total += float(loss.detach())
    return total
