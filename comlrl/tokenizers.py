"""The tokenizer protocol: what the library calls on a tokenizer, and the one check of it.

A tokenizer is accepted by what it does, not by its class: any object that provides the
members below trains, a ``transformers`` tokenizer or not (as the original comlrl 1.4.3 allowed).

Required (:data:`REQUIRED`). Building a trainer reads only the attributes (:data:`AT_CONSTRUCTION`), as the
original comlrl 1.4.3 does, so a light stand-in (``pad_token``, ``eos_token``, ``pad_token_id``, ``eos_token_id``)
builds a trainer that is inspected but not run; ``train()`` refuses one that lacks a method before its first
step, and any other call (``evaluate()``, a registry example) when it needs the method, by name:

- ``tokenizer(texts, add_special_tokens=False)`` returns a mapping whose ``"input_ids"`` holds one
  list of ids per text; with ``return_tensors="pt", padding=True, padding_side="left"`` it holds
  ``"input_ids"`` and ``"attention_mask"`` as left-padded ``[rows, length]`` tensors (prompts, critic inputs);
- ``decode(ids, skip_special_tokens=True)`` returns the text of one row of ids (completions);
- ``pad_token_id`` and ``eos_token_id`` (attributes; either may be ``None``). Without a pad id the
  EOS token becomes the pad token (``tokenizer.pad_token = tokenizer.eos_token``), which must then
  give a ``pad_token_id``.

Optional (used where present):

- ``vocab_size``, ``bos_token_id``, ``added_tokens_decoder``, ``chat_template``: the check that every
  id the trainer feeds a model has an embedding row (:func:`comlrl.models.entities.check_tokenizer_fits`);
  the pad/EOS/BOS ids are checked always, the base vocabulary only with ``vocab_size``;
- ``convert_ids_to_tokens``: the token's text in error messages;
- ``get_vocab``: whether a comparator's sampled ids are the agent's tokens (without it they go as text);
- ``__len__`` (else ``len(get_vocab())``): the vocabulary size a checkpoint records;
- ``save_pretrained(directory)``: ``save_model`` (an export without it is refused, naming it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

REQUIRED = ("__call__", "decode", "pad_token_id", "eos_token_id")
AT_CONSTRUCTION = ("pad_token_id", "eos_token_id")


def missing_members(tokenizer: Any, members: Sequence[str] = REQUIRED) -> list[str]:
    """The ``members`` (default: all of :data:`REQUIRED`) that ``tokenizer`` lacks (empty: it has them all)."""
    return [name for name in members
            if not (callable(tokenizer) if name == "__call__" else hasattr(tokenizer, name))]


def refusal(tokenizer: Any, role: str, missing: Sequence[str], purpose: str) -> ValueError:
    """The one message for a tokenizer that lacks members: what, for whom, what for, and what to pass."""
    return ValueError(
        f"the tokenizer given for {role} ({type(tokenizer).__name__}) lacks {', '.join(missing)}, which {purpose} "
        f"needs: a tokenizer must provide {', '.join(REQUIRED)} (see comlrl.tokenizers); pass a transformers "
        "tokenizer (AutoTokenizer.from_pretrained(...)) or an object with those members"
    )


def check_tokenizer(tokenizer: Any, role: str, members: Sequence[str] = AT_CONSTRUCTION,
                    purpose: str = "building the trainer") -> Any:
    """``tokenizer`` if it has ``members`` (by default what building a trainer reads), else the
    :func:`refusal` naming what it lacks."""
    missing = missing_members(tokenizer, members)
    if missing:
        raise refusal(tokenizer, role, missing, purpose)
    return tokenizer


def check_can_tokenize(tokenizers: Sequence[Any], role: str = "agent") -> None:
    """Every tokenizer of a run has the whole protocol: ``train()`` checks this before its first step."""
    for index, tokenizer in enumerate(tokenizers):
        check_tokenizer(tokenizer, f"{role}_{index}", REQUIRED, "training")


def encode(tokenizer: Any, texts: Any, **kwargs: Any) -> Any:
    """``tokenizer(texts, **kwargs)``, or the :func:`refusal` when the tokenizer cannot be called."""
    if not callable(tokenizer):
        raise refusal(tokenizer, "this model", ["__call__"], "encoding text")
    return tokenizer(texts, **kwargs)


def decode_ids(tokenizer: Any, ids: Any, **kwargs: Any) -> str:
    """``tokenizer.decode(ids, **kwargs)``, or the :func:`refusal` when the tokenizer has no ``decode``."""
    if not callable(getattr(tokenizer, "decode", None)):
        raise refusal(tokenizer, "this model", ["decode"], "decoding completions")
    return tokenizer.decode(ids, **kwargs)


def decode_rows(tokenizer: Any, ids: Any) -> list[str]:
    """Each row of ``ids`` (a ``[rows, length]`` tensor or lists) as text, special tokens skipped.
    Row by row with ``decode``, which is what ``batch_decode`` does in transformers."""
    rows = ids.tolist() if hasattr(ids, "tolist") else ids
    return [decode_ids(tokenizer, row, skip_special_tokens=True) for row in rows]


def vocabulary(tokenizer: Any) -> dict[str, int] | None:
    """The token -> id mapping (``get_vocab()``), or ``None`` when the tokenizer does not tell."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    return get_vocab() if callable(get_vocab) else None


def tokenizer_size(tokenizer: Any) -> int | None:
    """The number of tokens: ``len(tokenizer)``, else the vocabulary's size, else ``None``."""
    try:
        return len(tokenizer)
    except TypeError:
        vocab = vocabulary(tokenizer)
        return None if vocab is None else len(vocab)


def save_tokenizer(tokenizer: Any, directory: Path) -> None:
    """Write ``tokenizer`` next to an exported model (``save_pretrained``)."""
    if not callable(getattr(tokenizer, "save_pretrained", None)):
        raise ValueError(
            f"cannot export the tokenizer ({type(tokenizer).__name__}) to {directory}: it lacks save_pretrained; "
            "give it a save_pretrained(directory) method, or save the tokenizer yourself after exporting the model"
        )
    tokenizer.save_pretrained(directory)


def check_tokenizers(tokenizers: Sequence[Any], role: str) -> list[Any]:
    """Every tokenizer of a list checked, each named by its position."""
    return [check_tokenizer(tokenizer, f"{role}[{index}]") for index, tokenizer in enumerate(tokenizers)]


__all__ = ["AT_CONSTRUCTION", "REQUIRED", "check_can_tokenize", "check_tokenizer", "check_tokenizers",
           "decode_ids", "decode_rows", "encode", "missing_members", "refusal", "save_tokenizer", "tokenizer_size", "vocabulary"]
