"""The tokenizer protocol: what the library calls on a tokenizer, and the one check of it.

A tokenizer is accepted by what it does, not by its class: any object that provides the
members below trains, a ``transformers`` tokenizer or not (as the original comlrl 1.4.3 allowed).

Required (:data:`REQUIRED`; a missing one is refused at construction, by name):

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


def missing_members(tokenizer: Any) -> list[str]:
    """The members of :data:`REQUIRED` that ``tokenizer`` lacks (empty: it is a tokenizer)."""
    missing = [] if callable(tokenizer) else ["__call__"]
    missing += [name for name in REQUIRED[1:] if not hasattr(tokenizer, name)]
    return missing


def check_tokenizer(tokenizer: Any, role: str) -> Any:
    """``tokenizer`` if it provides the protocol, else a ``ValueError`` naming what it lacks."""
    missing = missing_members(tokenizer)
    if missing:
        raise ValueError(
            f"the tokenizer given for {role} ({type(tokenizer).__name__}) lacks {', '.join(missing)}: a tokenizer "
            f"must provide {', '.join(REQUIRED)} (see comlrl.tokenizers); pass a transformers tokenizer "
            "(AutoTokenizer.from_pretrained(...)) or an object with those members"
        )
    return tokenizer


def decode_rows(tokenizer: Any, ids: Any) -> list[str]:
    """Each row of ``ids`` (a ``[rows, length]`` tensor or lists) as text, special tokens skipped.
    Row by row with ``decode``, which is what ``batch_decode`` does in transformers."""
    rows = ids.tolist() if hasattr(ids, "tolist") else ids
    return [tokenizer.decode(row, skip_special_tokens=True) for row in rows]


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


__all__ = ["REQUIRED", "check_tokenizer", "check_tokenizers", "decode_rows", "missing_members", "save_tokenizer",
           "tokenizer_size", "vocabulary"]
