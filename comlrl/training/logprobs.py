"""Token log-probabilities of completions under a causal LM.

Rows whose prompts are the same (the ``num_generations`` samples of a prompt) run that prompt
through the model once: the prompt pass fills a KV cache, which each row's completion pass then
continues from. That is the same computation as one pass over prompt + completion per row (the
gradient reaches the prompt positions through the cache), with the prompt's share of the
arithmetic and activations paid once per distinct prompt instead of once per sample. It is done
only where it saves real work (:data:`MIN_SHARED_PROMPT_FLOPS`): the results agree with the
single pass to float rounding, not bit for bit, and a second forward call is not free.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from comlrl.parallel import sharding
from comlrl.training.mixed_precision import autocast
from comlrl.rollout.sampling import cache_argument, forward_parameters
from comlrl.rollout.generation import position_ids_from_mask


def distinct_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(first_rows, inverse)``: the first row of each distinct prompt (IDs and mask), in the order the
    prompts first appear, and each row's index into them; None when every row's prompt is different."""
    key = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
    distinct, inverse = torch.unique(key, dim=0, return_inverse=True)  # distinct in sorted order
    if distinct.shape[0] == key.shape[0]:
        return None
    rows = torch.arange(key.shape[0], device=key.device)
    first_rows = torch.full((distinct.shape[0],), key.shape[0], dtype=torch.long, device=key.device)
    first_rows = first_rows.scatter_reduce(0, inverse, rows, reduce="amin")
    order = first_rows.argsort()  # sorted -> first-appearance order, so the batch keeps its row order
    position = torch.empty_like(order)
    position[order] = torch.arange(order.shape[0], device=order.device)
    return first_rows[order], position[inverse]


# Prompt work a shared pass must save (2 x parameters x prompt tokens not recomputed) to be taken: a
# second forward call costs a few milliseconds of dispatch (~0.1-0.2 GFLOP of work on a CPU), and on
# tiny models the single pass is as fast (benchmarks/README.md, "Real model").
MIN_SHARED_PROMPT_FLOPS = 1e9


def _saves_enough(model: PreTrainedModel, prompt_mask: torch.Tensor, distinct: int) -> bool:
    saved_tokens = (prompt_mask.shape[0] - distinct) * prompt_mask.shape[1]
    return 2 * sum(p.numel() for p in model.parameters()) * saved_tokens >= MIN_SHARED_PROMPT_FLOPS


def _shared_prompts(model: PreTrainedModel, prompt_ids: torch.Tensor,
                    prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`distinct_prompts` where a shared pass is possible and saves enough, else None. Checked
    cheapest first: a batch whose rows all shared one prompt would save too little (every tiny model)
    skips finding its distinct prompts."""
    if not _saves_enough(model, prompt_mask, 1) or not _can_share_prompts(model):
        return None
    shared = distinct_prompts(prompt_ids, prompt_mask)
    return shared if shared is not None and _saves_enough(model, prompt_mask, shared[0].shape[0]) else None


def _can_share_prompts(model: PreTrainedModel) -> bool:
    """Whether the prompt pass can hand its KV cache to the completion pass. Not for a model whose
    forward takes no cache, positions or ``logits_to_keep``; nor under gradient checkpointing (a
    checkpointed layer drops the cache in training mode, so the completion would not see its
    prompt); nor for FSDP-sharded models (one pass per row keeps FSDP's one forward per backward)."""
    accepted = forward_parameters(model)
    if not {"logits_to_keep", "position_ids", cache_argument(model)} <= accepted or sharding.holds_shards(model):
        return False
    return not any(getattr(module, "gradient_checkpointing", False) for module in model.modules())


def _full_pass_logits(model: PreTrainedModel, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                      completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """One pass over prompt + completion per row; the logits that predict the completion tokens."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask.to(prompt_mask.dtype)], dim=1)
    num_completion = completion_ids.shape[1]
    kwargs = {"logits_to_keep": num_completion + 1} if "logits_to_keep" in forward_parameters(model) else {}
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        **kwargs,
    ).logits
    return logits[:, -(num_completion + 1):-1, :]


def _shared_prompt_logits(model: PreTrainedModel, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                          completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                          first_rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Each distinct prompt once (its cache and last-position logits copied to its rows), then every
    row's completion from that cache: the same logits as :func:`_full_pass_logits`."""
    cache = DynamicCache(config=model.config)
    prompt_rows = prompt_mask[first_rows]
    first = model(
        input_ids=prompt_ids[first_rows],
        attention_mask=prompt_rows,
        position_ids=position_ids_from_mask(prompt_rows),
        use_cache=True,
        logits_to_keep=1,
        **{cache_argument(model): cache},
    ).logits[inverse]
    num_completion = completion_ids.shape[1]
    if num_completion == 1:
        return first
    cache.batch_select_indices(inverse)
    attention_mask = torch.cat([prompt_mask, completion_mask[:, :-1].to(prompt_mask.dtype)], dim=1)
    rest = model(
        input_ids=completion_ids[:, :-1],
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask)[:, prompt_ids.shape[1]:],
        use_cache=True,
        logits_to_keep=num_completion - 1,
        **{cache_argument(model): cache},
    ).logits
    return torch.cat([first, rest], dim=1)


def completion_logits(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    autocast_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Logits that predict each completion token, ``[batch, completion_tokens, vocab]`` (float32).

    Only the logits that predict completion tokens are computed; rows sharing a prompt share its
    pass where that saves enough (module docstring). Dividing by the sampling ``temperature`` makes them the logits of the
    distribution the completions were drawn from. ``autocast_dtype`` runs the model's forward under
    ``torch.autocast`` (mixed precision, :mod:`comlrl.training.mixed_precision`).
    """
    shared = _shared_prompts(model, prompt_ids, prompt_mask)
    with autocast(model, autocast_dtype):
        if shared is None:
            logits = _full_pass_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
        else:
            logits = _shared_prompt_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *shared)
    logits = logits.float()
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
    autocast_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Log-probability of each completion token, ``[batch, completion_tokens]``."""
    logits = completion_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature,
                               autocast_dtype)
    return token_logprobs(logits, completion_ids)
