"""Token sampling: logit warpers as pure functions and the decode loop built on them.

The loop is the one ``transformers`` ``generate`` runs for plain sampling (prefill, then one
token per step through the KV cache, finished rows padded, stop when every row has ended),
without its per-token machinery (logits-processor lists, stopping-criteria objects, input
preparation): on small models that machinery is a large share of each decode step. Given the
same RNG state it draws exactly the tokens ``generate`` draws (tests/test_sampling.py), and it
takes an explicit ``torch.Generator``, so agents sampling side by side stay reproducible. One
difference: it prefills each prompt once for all its samples, where ``generate`` prefills every
sample; on larger models the matrix library can then round the prefill's logits differently in
the last bits (SmolLM2-135M: up to 5e-5), so a draw that falls on a probability boundary can differ.
The same holds on models large enough for packed decode weights (:mod:`comlrl.rollout.packed_weights`),
whose products round differently from the usual ones in the last bits.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import lru_cache

import torch
from transformers import DynamicCache, PreTrainedModel

from comlrl.rollout.packed_weights import packed_linears


BACKENDS = ("comlrl", "transformers")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_new_tokens: int = 32
    do_sample: bool = True
    backend: str = "comlrl"  # "comlrl": decode() below; "transformers": model.generate

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"SamplingParams.backend must be one of {BACKENDS}, got {self.backend!r}")


def temperature_scale(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits if temperature == 1.0 else logits / temperature


def top_k_filter(logits: torch.Tensor, top_k: int | None) -> torch.Tensor:
    """Logits outside the ``top_k`` largest of each row set to -inf (ties at the cut-off kept)."""
    if not top_k or top_k >= logits.shape[-1]:
        return logits
    kth_largest = torch.topk(logits, top_k).values[..., -1:]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of tokens whose probability reaches ``top_p``.

    Works in ascending order as transformers does: a token is dropped when the mass of the
    tokens below it (itself included) is at most ``1 - top_p``; the likeliest token always stays.
    """
    if top_p >= 1.0:
        return logits
    ascending, order = torch.sort(logits, descending=False)
    mass_below = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = mass_below <= 1 - top_p
    drop_sorted[..., -1:] = False
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def warp_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (the order transformers applies them in)."""
    return top_p_filter(top_k_filter(temperature_scale(logits, sampling.temperature), sampling.top_k), sampling.top_p)


def sample_one(probabilities: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One draw per row of ``probabilities`` ``[rows, vocab]`` and its score: the token is the one
    ``torch.multinomial(probabilities, 1)`` draws from the same RNG state (its one-sample path: the argmax of
    ``probabilities`` over Exp(1) noise), without that call's checks of the distribution (about ten
    small operators per decode step). A row whose probabilities hold a NaN (what non-finite logits give)
    scores NaN, so a caller can check many draws at once (:func:`check_scores`)."""
    noise = torch.empty_like(probabilities).exponential_(1, generator=generator)
    scores, tokens = torch.div(probabilities, noise, out=noise).max(dim=-1)
    return tokens, scores


def check_scores(scores: list[torch.Tensor]) -> None:
    """Raise if a draw of :func:`sample_one` came from NaN probabilities (``torch.multinomial`` would have raised)."""
    if scores and bool(torch.stack(scores).isnan().any()):
        raise RuntimeError("sampling: the next-token probabilities of a row hold NaN (the model's logits are not finite; "
                           "check the weights and the learning rate)")


def next_tokens(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None,
                scores: list[torch.Tensor] | None = None) -> torch.Tensor:
    """One token per row from last-position logits ``[rows, vocab]``: sampled, or greedy. A sampled draw's
    scores are appended to ``scores`` when given (checked there by the caller), else checked at once."""
    if not sampling.do_sample:
        return logits.argmax(dim=-1)
    tokens, drawn = sample_one(warp_logits(logits, sampling).softmax(dim=-1), generator)
    if scores is None:
        check_scores([drawn])
    else:
        scores.append(drawn)
    return tokens


def prompt_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position IDs of left-padded prompts: 0 at each row's first real token (padding gets 1, as in generate)."""
    positions = attention_mask.long().cumsum(dim=-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


@lru_cache(maxsize=None)
def _forward_parameters(model_class: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_class.forward).parameters)


def forward_parameters(model: PreTrainedModel) -> frozenset[str]:
    """Names ``model.forward`` accepts; a peft wrapper forwards ``**kwargs``, so its base model's are asked."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _forward_parameters(type(base))


def cache_argument(model: PreTrainedModel) -> str:
    """The name ``forward`` takes a KV cache under (``past_key_values`` was renamed ``cache`` in transformers 5.x)."""
    return "cache" if "cache" in forward_parameters(model) else "past_key_values"


def _step_forward(model: PreTrainedModel, cache: DynamicCache):
    """``forward(ids, mask, positions)`` -> last-position float32 logits ``[rows, vocab]`` through ``cache``;
    what the model's signature takes is looked up once per decode call, not at every step."""
    fixed = {"use_cache": True, "logits_to_keep": 1, cache_argument(model): cache}
    takes_positions = "position_ids" in forward_parameters(model)

    def forward(ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        if takes_positions:
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, **fixed).logits[:, -1, :]
        else:
            logits = model(input_ids=ids, attention_mask=mask, **fixed).logits[:, -1, :]
        return logits if logits.dtype == torch.float32 else logits.float()

    return forward


def decode(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    sampling: SamplingParams,
    eos_token_ids: list[int],
    pad_token_id: int,
    generator: torch.Generator | None = None,
    num_generations: int = 1,
) -> torch.Tensor:
    """Completion IDs ``[rows * num_generations, steps]`` for left-padded prompts; rows that ended are padded.

    Row ``p * num_generations + g`` is sample ``g`` of prompt ``p``. Each prompt is prefilled once
    and its KV cache copied for its ``num_generations`` samples: the prefill is most of a short
    completion's arithmetic, and ``generate`` repeats it per sample. ``steps`` is ``max_new_tokens``
    unless every row emitted an EOS earlier. The loop runs in ``inference_mode`` (less per-operator
    bookkeeping than ``no_grad``); the IDs are copied out of it, because the update's autograd
    forward takes them as input. On CPU, a large model's linear layers run from weights packed for
    the decode's row count (:func:`comlrl.rollout.packed_weights.packed_linears`).
    """
    with torch.inference_mode(), packed_linears(model, prompt_ids.shape[0] * num_generations):
        tokens = _decode_loop(model, prompt_ids, prompt_mask, sampling, eos_token_ids, pad_token_id, generator,
                              num_generations)
    return tokens.clone()


def _decode_loop(model: PreTrainedModel, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: SamplingParams,
                 eos_token_ids: list[int], pad_token_id: int, generator: torch.Generator | None,
                 num_generations: int = 1) -> torch.Tensor:
    prompt_length = prompt_ids.shape[1]
    rows = prompt_ids.shape[0] * num_generations
    device = prompt_ids.device
    # Without padding the causal mask is all the attention needs, and building a padding mask
    # every step is a tenth of a small model's decode step: pass none, as generate ends up doing.
    padded = not bool(prompt_mask.all())
    cache = DynamicCache(config=model.config)
    forward = _step_forward(model, cache)
    positions = prompt_positions(prompt_mask)
    logits = forward(prompt_ids, prompt_mask if padded else None, positions)
    if num_generations > 1:  # every sample of a prompt continues from the same prefill
        cache.batch_repeat_interleave(num_generations)
        logits = logits.repeat_interleave(num_generations, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(num_generations, dim=0)
        positions = positions.repeat_interleave(num_generations, dim=0)
    mask = torch.cat([prompt_mask, prompt_mask.new_ones(rows, sampling.max_new_tokens)], dim=1) if padded else None
    position = positions[:, -1:]
    eos = torch.tensor(eos_token_ids, device=device)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    tokens, scores = [], []
    for step in range(sampling.max_new_tokens):
        token = next_tokens(logits, sampling, generator, scores)
        token = token.masked_fill(finished, pad_token_id)
        tokens.append(token)
        finished |= torch.isin(token, eos)
        if step == sampling.max_new_tokens - 1 or bool(finished.all()):
            break
        position = position + 1
        step_mask = mask[:, :prompt_length + step + 1] if padded else None
        logits = forward(token[:, None], step_mask, position)
    check_scores(scores)  # once per call, not per step
    return torch.stack(tokens, dim=1)
