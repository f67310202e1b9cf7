"""Tokenizer helpers of the original comlrl API, built on :mod:`comlrl.models.entities`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from comlrl.models import entities


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Give ``tokenizer`` its EOS token as pad token if it has none, and return it.

    Raises ``ValueError`` if it still has no ``pad_token_id`` (no EOS token either).
    """
    try:
        entities.prepare_tokenizer(tokenizer, "this model")
    except ValueError:
        raise ValueError("Tokenizer must expose pad_token_id.") from None
    if tokenizer.pad_token_id is None:
        raise ValueError("Tokenizer must expose pad_token_id.")
    return tokenizer


def ensure_tokenizer(
    model: str | PreTrainedModel | None,
    tokenizer: PreTrainedTokenizerBase | None,
) -> PreTrainedTokenizerBase:
    """``tokenizer``, or the one loaded from the identifier/directory ``model``, with a pad token.

    Without a tokenizer, ``model`` must be a string (a loaded model or ``None`` raises
    ``ValueError``, as does a source no tokenizer loads from).
    """
    if tokenizer is None:
        if model is None or isinstance(model, PreTrainedModel):
            raise ValueError("Tokenizer must be provided when model is a PreTrainedModel instance.")
        tokenizer = entities.load_tokenizer(model)
    return ensure_pad_token(tokenizer)


def _is_tokenizer_list(tokenizer: Any) -> bool:
    return isinstance(tokenizer, Sequence) and not isinstance(tokenizer, (str, bytes, PreTrainedTokenizerBase))


def resolve_tokenizers(
    model: str | PreTrainedModel | None,
    tokenizer: PreTrainedTokenizerBase | Sequence[PreTrainedTokenizerBase] | None,
    agents: Sequence[Any] | None,
) -> PreTrainedTokenizerBase | list[PreTrainedTokenizerBase]:
    """The tokenizer(s) for a trainer's ``model``/``agents``, each with a pad token.

    Without ``agents``: the given single tokenizer, else the one loaded from ``model``.
    With ``agents``: a given single tokenizer is returned as it is (shared); a given list must
    have one per agent; none given loads one per agent, which requires every agent to be an
    identifier string. Violations raise ``ValueError``.
    """
    if agents is None:
        if tokenizer is not None and not _is_tokenizer_list(tokenizer):
            return ensure_pad_token(tokenizer)
        return ensure_tokenizer(model, None)
    if tokenizer is None:
        if isinstance(agents, (str, bytes)) or not isinstance(agents, Sequence) or not all(
            isinstance(source, str) for source in agents
        ):
            raise ValueError("Tokenizer(s) must be provided when agents are model objects.")
        loaded = entities.resolve_tokenizers(list(agents), None, explicit_for_lists=False, agents_given=True,
                                             trainer_name="resolve_tokenizers")
        return [ensure_pad_token(tok) for tok in loaded]
    if _is_tokenizer_list(tokenizer):
        if len(tokenizer) != len(agents):
            raise ValueError("tokenizers length must match agents.")
        return [ensure_pad_token(tok) for tok in tokenizer]
    return ensure_pad_token(tokenizer)


def apply_tokenizer_specials(tokenizer: PreTrainedTokenizerBase, models: Sequence[Any]) -> None:
    """Write the tokenizer's pad and EOS ids into each model's config (``None`` entries skipped).

    The tokenizer gets a pad token first if it lacks one; a missing (or 0) EOS id falls back to
    the pad id. A model with an inner ``.model`` that has a config gets the ids written there.
    """
    tokenizer = ensure_pad_token(tokenizer)
    pad_id = tokenizer.pad_token_id
    eos_id = tokenizer.eos_token_id or pad_id
    for model in models:
        if model is None:
            continue
        inner = getattr(model, "model", None)
        config = inner.config if inner is not None and hasattr(inner, "config") else getattr(model, "config", None)
        if config is None:
            continue
        config.pad_token_id = pad_id
        config.eos_token_id = eos_id


__all__ = ["apply_tokenizer_specials", "ensure_pad_token", "ensure_tokenizer", "resolve_tokenizers"]
