"""Value heads: a scalar read from a causal LM's hidden state at the last non-padding token.

A critic is a causal LM with a :class:`ValueHead` attached as its ``value_head`` attribute.
The same representation serves a separate critic (its own backbone) and an actor that
shares its backbone with its critic (IAC with ``use_separate_critic=False``). The head is
attached as a plain attribute, not a registered submodule, so the model's own state dict,
``save_pretrained`` and ``from_pretrained`` stay exactly those of the causal LM; the head is
saved on its own (``value_head.pt``) and checkpointed as its own module.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from comlrl.rollout.generation import position_ids_from_mask


class ValueHead(nn.Module):
    """``hidden -> value``: linear by default, a one-hidden-layer MLP when ``hidden_dim`` is set.

    The output layer starts at zero, so a new critic predicts 0 everywhere and the first
    advantages are the rewards themselves. The head computes in float32 whatever the backbone's dtype.
    """

    def __init__(self, input_size: int, hidden_dim: int | None = None) -> None:
        super().__init__()
        if hidden_dim is not None and (isinstance(hidden_dim, bool) or not isinstance(hidden_dim, int) or hidden_dim < 1):
            raise ValueError(f"value head hidden_dim must be a positive integer or None, got {hidden_dim!r}")
        self.input_size = input_size
        self.hidden_dim = hidden_dim
        if hidden_dim is None:
            self.layers = nn.Sequential(nn.Linear(input_size, 1))
        else:
            self.layers = nn.Sequential(nn.Linear(input_size, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, 1))
        nn.init.zeros_(self.layers[-1].weight)
        nn.init.zeros_(self.layers[-1].bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[batch, input_size]`` -> ``[batch]``."""
        return self.layers(hidden.float()).squeeze(-1)


def hidden_size_of(model: PreTrainedModel) -> int:
    """Width of the backbone's last hidden state."""
    return model.get_input_embeddings().embedding_dim


def attach_value_head(model: PreTrainedModel, hidden_dim: int | None = None) -> ValueHead:
    """Give ``model`` a new ``value_head`` (on the model's device) and return it."""
    device = next(model.parameters()).device
    head = ValueHead(hidden_size_of(model), hidden_dim).to(device)
    object.__setattr__(model, "value_head", head)  # deliberately not a registered submodule (see module docstring)
    return head


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Column of each row's last non-padding token; works for left, right and mixed padding."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (attention_mask.long() * positions).argmax(dim=1)


def sequence_values(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Value of each sequence, ``[batch]``: ``model.value_head`` on the last real token's hidden state.

    Positions skip padding, so a sequence gets the same value whichever side it is padded on.
    """
    head = getattr(model, "value_head", None)
    if head is None:
        raise ValueError(f"model {type(model).__name__} has no value_head; attach one with attach_value_head(model)")
    device = next(model.parameters()).device  # a critic may sit on another device than its actor
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    # A peft (LoRA) model wraps the transformers model whose backbone we need.
    backbone = model.get_base_model().base_model if hasattr(model, "get_base_model") else model.base_model
    hidden = backbone(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    ).last_hidden_state
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    return head(hidden[rows, last_token_index(attention_mask)])


def distinct_sequence_values(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """:func:`sequence_values`, computing each distinct row once (no autograd graph is kept).

    A V critic reads the same joint prompt for every generation of it, so at rollout time most
    rows repeat; the repeats take the value of their first copy.
    """
    with torch.no_grad():
        rows = torch.cat([input_ids, attention_mask.to(input_ids.dtype)], dim=1)
        distinct, inverse = torch.unique(rows, dim=0, return_inverse=True)
        width = input_ids.shape[1]
        values = sequence_values(model, distinct[:, :width], distinct[:, width:].to(attention_mask.dtype))
        return values[inverse.to(values.device)]
