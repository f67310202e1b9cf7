"""Generation: batched sampling of completions from one agent.

All ``num_generations`` samples of every prompt are decoded together, with left padding and
the KV cache, each prompt prefilled once, by :func:`comlrl.rollout.sampling.decode` (or, with
``backend="transformers"``, one ``model.generate`` call); completions are returned as padded tensors plus a mask that keeps
tokens up to and including the first EOS.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from comlrl.tokenizers import decode_ids, decode_rows, encode
from comlrl.rollout.sampling import SamplingParams, decode

logger = logging.getLogger(__name__)

# model.generate samples from the process-wide RNG: agents generating concurrently take turns.
_GLOBAL_RNG = threading.Lock()


@dataclass
class Generation:
    """Completions of one agent; row ``p * num_generations + g`` is sample g of prompt p."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    texts: list[str]
    num_generations: int

    @property
    def num_tokens(self) -> int:
        return int(self.completion_mask.sum())

    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(dim=1)


def completion_mask(completion_ids: torch.Tensor, eos_token_id: int | list[int] | None) -> torch.Tensor:
    """1 for tokens up to and including the first EOS, 0 after it."""
    if eos_token_id is None:
        return torch.ones_like(completion_ids, dtype=torch.long)
    eos_ids = torch.tensor(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id], device=completion_ids.device)
    is_eos = torch.isin(completion_ids, eos_ids).long()
    eos_before = torch.cumsum(is_eos, dim=1) - is_eos
    return (eos_before == 0).long()


def context_length(model: PreTrainedModel) -> int | None:
    """The longest sequence the model's positions cover, if its config says."""
    config = model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def prompt_token_limit(model: PreTrainedModel, max_new_tokens: int, max_prompt_length: int | None) -> int | None:
    """Prompt tokens that fit: the user's limit and the context minus room for the completion."""
    context = context_length(model)
    room = context - max_new_tokens if context is not None else None
    limits = [limit for limit in (room, max_prompt_length) if limit is not None]
    return min(limits) if limits else None


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    device: torch.device,
    max_prompt_length: int | None = None,
    overflow: str = "truncate",
    num_embeddings: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt IDs and mask; over-long prompts keep their last ``max_prompt_length`` tokens
    (with a warning), or raise when ``overflow="error"``. With ``num_embeddings``, an ID the model cannot
    embed raises a ValueError naming the prompt row."""
    encoded = encode(
        tokenizer,
        prompts,
        return_tensors="pt",
        padding=True,
        padding_side="left",
        add_special_tokens=False,
    )
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    empty = (mask.sum(dim=1) == 0).nonzero().flatten().tolist()
    if empty:  # nothing to generate from (all empty: a reshape error deep in the model)
        raise ValueError(f"prompts {empty} of this batch (of {len(prompts)}) encode to no tokens; every prompt needs "
                         "at least one token")
    ids, mask = truncate_prompts(ids, mask, max_prompt_length, overflow)
    if num_embeddings is not None:
        check_ids_in_range(ids, num_embeddings, "prompt", tokenizer)
    return ids.to(device), mask.to(device)


def truncate_prompts(ids: torch.Tensor, mask: torch.Tensor, max_prompt_length: int | None,
                     overflow: str = "truncate") -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt bound: left-padded rows over ``max_prompt_length`` tokens keep their last ``max_prompt_length``
    (with a warning), or raise when ``overflow="error"``; unchanged when every row fits or there is no bound."""
    if max_prompt_length is None or ids.shape[1] <= max_prompt_length:
        return ids, mask
    lengths = mask.sum(dim=1)
    too_long = (lengths > max_prompt_length).nonzero().flatten().tolist()
    if overflow == "error":
        raise ValueError(
            f"prompt {too_long[0]} has {int(lengths[too_long[0]])} tokens but only {max_prompt_length} fit "
            "(context minus max_new_tokens, or max_prompt_length); shorten it or set prompt_overflow='truncate'"
        )
    logger.warning("truncating %d prompt(s) to their last %d tokens", len(too_long), max_prompt_length)
    # Left padding puts every prompt's last tokens in the rightmost columns.
    return ids[:, -max_prompt_length:], mask[:, -max_prompt_length:]


def bounded_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, max_prompt_length: int | None) -> str:
    """``prompt`` as generation feeds it with ``max_prompt_length`` tokens (:func:`prompt_token_limit`): the prompt
    itself when it fits, else the text of the last tokens :func:`encode_prompts` keeps. For text that stands in for
    a prompt outside a rollout, such as a registered model's input example."""
    ids = torch.tensor([encode(tokenizer, [prompt], add_special_tokens=False)["input_ids"][0]], dtype=torch.long)
    kept, _ = truncate_prompts(ids, torch.ones_like(ids), max_prompt_length)
    if kept.shape[1] == ids.shape[1]:
        return prompt
    return decode_ids(tokenizer, kept[0].tolist(), skip_special_tokens=False)


class _UnmergedGenerationConfig(GenerationConfig):
    """A generation config that ``generate`` uses as it is.

    ``generate`` fills each field still ``None`` from the model's own ``generation_config`` (a hub
    model's repetition penalty, n-gram ban, forced or suppressed tokens, min-p, top-k, ...), then
    from library defaults, through ``update(defaults_only=True)``. This config ignores those
    fill-ins; it is built complete, with every logits processor off.
    """

    def update(self, defaults_only=False, allow_custom_entries=False, **kwargs):
        if defaults_only:
            return dict(kwargs)
        return super().update(allow_custom_entries=allow_custom_entries, **kwargs)


def _generation_config(tokenizer: PreTrainedTokenizerBase, sampling: SamplingParams, num_generations: int) -> GenerationConfig:
    """Library defaults (no penalty, ban, forced token or extra warper) plus ``sampling``, unmerged with
    the model's ``generation_config``: ``generate`` samples what :class:`SamplingParams` says, as ``decode`` does."""
    settings = GenerationConfig._get_default_generation_params()
    settings.pop("max_length")  # max_new_tokens decides the length
    settings.update(
        max_new_tokens=sampling.max_new_tokens,
        num_return_sequences=num_generations,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        use_cache=True,
        do_sample=sampling.do_sample,
    )
    if sampling.do_sample:  # top_k 0 is off (the library default would be 50)
        settings.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or 0)
    return _UnmergedGenerationConfig(**settings)


def eos_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    eos = tokenizer.eos_token_id
    return [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]


def _generate_with_transformers(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt_ids: torch.Tensor,
                                prompt_mask: torch.Tensor, num_generations: int, sampling: SamplingParams,
                                generator: torch.Generator | None) -> torch.Tensor:
    """``model.generate``; with a generator, its global-RNG draws come from a seed taken from it, under
    a lock, so agents on concurrent threads stay reproducible (they generate one at a time)."""
    config = _generation_config(tokenizer, sampling, num_generations)
    if generator is None:
        output = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config)
    else:
        seed = int(torch.randint(2**62, (1,), generator=generator, device=generator.device))
        devices = [prompt_ids.device] if prompt_ids.device.type == "cuda" else []
        with _GLOBAL_RNG, torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            output = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config)
    return output[:, prompt_ids.shape[1]:]


@torch.no_grad()  # not inference_mode: the IDs are reused in the autograd forward of the update
def generate_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    num_generations: int,
    sampling: SamplingParams,
    max_prompt_length: int | None = None,
    prompt_overflow: str = "truncate",
    generator: torch.Generator | None = None,
) -> Generation:
    """Sample ``num_generations`` completions for each prompt, all rows decoded together.

    ``generator`` (on the model's device) makes the draws independent of the global RNG, so
    agents can sample concurrently and still reproducibly.
    """
    device = next(model.parameters()).device
    limit = prompt_token_limit(model, sampling.max_new_tokens, max_prompt_length)
    prompt_ids, prompt_mask = encode_prompts(
        tokenizer, prompts, device, limit, prompt_overflow, model.get_input_embeddings().num_embeddings)
    if sampling.backend == "transformers":
        completion_ids = _generate_with_transformers(
            model, tokenizer, prompt_ids, prompt_mask, num_generations, sampling, generator)
    else:
        completion_ids = decode(model, prompt_ids, prompt_mask, sampling, eos_ids(tokenizer), tokenizer.pad_token_id,
                                generator, num_generations)
    mask = completion_mask(completion_ids, tokenizer.eos_token_id)
    completion_ids = torch.where(mask.bool(), completion_ids, torch.full_like(completion_ids, tokenizer.pad_token_id))
    texts = decode_rows(tokenizer, completion_ids)
    return Generation(
        prompt_ids=prompt_ids.repeat_interleave(num_generations, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(num_generations, dim=0),
        completion_ids=completion_ids.clone(),
        completion_mask=mask,
        texts=texts,
        num_generations=num_generations,
    )


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, matching what ``generate`` uses."""
    positions = attention_mask.long().cumsum(dim=1) - 1
    return positions.clamp(min=0)


def check_ids_in_range(
    ids: torch.Tensor, num_embeddings: int, where: str = "prompt", tokenizer: PreTrainedTokenizerBase | None = None
) -> None:
    """Refuse token ids without an embedding row here, by row and id, rather than as an IndexError
    deep inside torch. ``ids`` is ``[rows, length]`` (or one row); ``tokenizer`` adds the token text."""
    if ids.numel() == 0:
        return
    rows = ids.reshape(-1, ids.shape[-1]) if ids.dim() > 1 else ids.reshape(1, -1)
    bad = (rows < 0) | (rows >= num_embeddings)
    if not bool(bad.any()):
        return
    row, column = (int(x) for x in bad.nonzero()[0])
    token_id = int(rows[row, column])
    text = f" {token_text(tokenizer, token_id)!r}" if tokenizer is not None else ""
    raise ValueError(
        f"{where} row {row} contains token id {token_id}{text} ({int(bad.sum())} out-of-range id(s) in all), "
        f"but the model embeds only {num_embeddings} tokens (ids 0..{num_embeddings - 1}); remove that "
        "token from the input, or resize the model's embeddings (model.resize_token_embeddings(len(tokenizer)))"
    )


def token_text(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str | None:
    """The token ``token_id`` as the tokenizer writes it (None when it has no such id)."""
    try:
        return tokenizer.convert_ids_to_tokens(int(token_id))
    except (AttributeError, IndexError, KeyError, OverflowError, TypeError, ValueError):  # AttributeError: no such method
        return None
