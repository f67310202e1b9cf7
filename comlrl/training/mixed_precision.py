"""Mixed precision, ``precision="bf16-mixed"``: float32 weights, bfloat16 arithmetic where it is cheap.

What it changes, and nothing else:

- **Sampling** draws from a bfloat16 copy of each agent's current weights, made at each rollout
  (:func:`sampling_models`) and dropped after it: a decode step reads half the bytes, and on CPUs
  with bf16 matrix instructions multiplies several times faster than float32.
- **Log-probability forwards** (the update's, the behaviour and reference log-probs, MADPO's)
  run under ``torch.autocast`` in bfloat16 (:func:`autocast`); the backward pass follows the
  forward's dtypes.
- Weights, gradients, AdamW's state, the loss and every reduction stay float32, as do critics,
  value heads and reward models.

The policy that samples is then the float32 policy rounded to bf16, not the float32 policy itself;
the update's ratio and KL use the autocast log-probs throughout, so they are consistent with each
other, not with the bf16 sampler's. Measured on SmolLM2-135M (benchmarks/README.md):
per-token log-probs 0.03 nats from float32 on average, gradient cosine 0.999.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Iterator, Sequence

import torch

from comlrl.parallel.placement import model_device

MIXED_PRECISIONS = {"bf16-mixed": torch.bfloat16}


def compute_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype ``precision`` asks for (None: the weights' own dtype throughout)."""
    return MIXED_PRECISIONS.get(precision)


@contextlib.contextmanager
def autocast(module: torch.nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """``torch.autocast`` to ``dtype`` on ``module``'s device type; nothing when ``dtype`` is None."""
    if dtype is None:
        yield
        return
    with torch.autocast(model_device(module).type, dtype=dtype):
        yield


def sampling_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of ``model`` (adapters included) with every floating-point parameter and buffer cast to
    ``dtype``, in eval mode; ``model`` is untouched."""
    duplicate = copy.deepcopy(model)
    duplicate.to(dtype)
    duplicate.eval()
    duplicate.requires_grad_(False)
    return duplicate


def sampling_models(models: Sequence[torch.nn.Module], dtype: torch.dtype | None) -> list[torch.nn.Module]:
    """What a rollout samples from: bf16 copies under mixed precision, else the models themselves."""
    if dtype is None:
        return list(models)
    return [sampling_copy(model, dtype) for model in models]
