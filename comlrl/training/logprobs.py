"""Token log-probabilities of completions under a causal LM, in one forward pass."""

from __future__ import annotations

import inspect
from functools import lru_cache

import torch
from transformers import PreTrainedModel


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, matching what ``generate`` uses."""
    positions = attention_mask.long().cumsum(dim=1) - 1
    return positions.clamp(min=0)


@lru_cache(maxsize=None)
def _class_accepts_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def _accepts_logits_to_keep(model: PreTrainedModel) -> bool:
    """Whether ``forward`` takes ``logits_to_keep``; a peft wrapper forwards ``**kwargs``, so ask its base model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _class_accepts_logits_to_keep(type(base))


def completion_logits(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Logits that predict each completion token, ``[batch, completion_tokens, vocab]`` (float32).

    Runs prompt+completion through the model once and keeps only the logits that predict
    completion tokens. Dividing by the sampling ``temperature`` makes them the logits of the
    distribution the completions were drawn from.
    """
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask.to(prompt_mask.dtype)], dim=1)
    num_completion = completion_ids.shape[1]
    kwargs = {}
    if _accepts_logits_to_keep(model):
        kwargs["logits_to_keep"] = num_completion + 1
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        **kwargs,
    ).logits
    logits = logits[:, -(num_completion + 1):-1, :].float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of ``token_ids`` under ``logits`` (``[batch, tokens, vocab]`` -> ``[batch, tokens]``)."""
    token_logits = logits.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    return token_logits - torch.logsumexp(logits, dim=-1)


def completion_logprobs(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probability of each completion token, ``[batch, completion_tokens]``, in one forward pass."""
    logits = completion_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature)
    return token_logprobs(logits, completion_ids)
