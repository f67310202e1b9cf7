"""Exporting trained models as loadable Hugging Face directories (``save_model``)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from comlrl.tokenizers import save_tokenizer


def save_pretrained_models(
    models: Sequence[PreTrainedModel],
    tokenizers: Sequence[PreTrainedTokenizerBase],
    directories: Sequence[Path],
) -> None:
    """Write each model's config, safetensors weights and tokenizer to its own directory."""
    for model, tokenizer, directory in zip(models, tokenizers, directories):
        directory.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(directory, safe_serialization=True)
        save_tokenizer(tokenizer, directory)


def save_value_head(head: torch.nn.Module, directory: Path) -> Path:
    """A value head as a plain state dict, loadable with ``torch.load(..., weights_only=True)``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "value_head.pt"
    torch.save({name: tensor.detach().cpu() for name, tensor in head.state_dict().items()}, path)
    return path
