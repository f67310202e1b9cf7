"""Decode-time packed weights on CPU: each linear layer's weight reordered once per decode call into
oneDNN's blocked layout for the decode's row count, and multiplied from that copy at every step.

Why: a CPU decode step multiplies a few rows (prompts x samples) by every weight of the model, so
it is bound by how fast the matrix library streams the weights from memory. On a 2-core AMD EPYC,
torch's default GEMM (MKL) reads float32 weights at 6-7 GB/s at 8 rows; oneDNN's GEMM on the
packed copy reads them at 10-11 GB/s (SmolLM2-135M: a 32-token decode of 8 rows takes 2.4 s
instead of 3.9 s, packing included; ``benchmarks/README.md``, "packed decode weights"). The copy
costs one read and one write of the weights per decode call and holds one more copy of one
model's linear weights while that call runs; it is dropped when the call returns.

Where it applies: CPU, float32 or bfloat16 weights held as plain tensors, torch built with oneDNN,
``nn.Linear`` layers not already wrapped by another forward (accelerate's hooks), and models whose
linear weights reach :data:`PACK_MIN_BYTES`: on smaller models the weights stay in cache and
packing pays nothing. Not models sharded by FSDP, whose weights are gathered layer by layer inside
the forward. Not LoRA (peft) models: their resident memory is one copy of the frozen weights, and
the packed copy would add as much again while a decode runs (full fine-tuning's update holds
gradients and AdamW state, more than the copy, so its peak does not move). Nor when less than twice
the copy's size is free (:data:`MEMORY_HEADROOM`): generating from a large model with nothing else
beside it would otherwise need twice its weights' memory.

Layers run from the packed copy only for inputs of at most the decode's row count (the prefill's
longer input takes the usual path). The products equal the usual ones up to float rounding in the
last bits.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import psutil
import torch
import torch.nn.functional as F

from comlrl.parallel import sharding

logger = logging.getLogger(__name__)

# Linear weights below this size stay in a CPU's caches between decode steps: no gain from packing.
PACK_MIN_BYTES = 64 * 2**20
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# The copy is made only when this many times its size is free: it must not push a machine that is
# near its memory limit (inference of a large model, no optimizer state beside it) into swap.
MEMORY_HEADROOM = 2.0


def packing_supported() -> bool:
    """Whether this torch build has oneDNN and the packed-linear operators."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def packable_layers(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The CPU linear layers of ``model`` whose weights can be packed (see the module docstring)."""
    if hasattr(model, "peft_config") or sharding.holds_shards(model):  # peft (LoRA): comlrl.models is a layer up
        return []
    return [layer for layer in model.modules()
            if isinstance(layer, torch.nn.Linear) and "forward" not in vars(layer)
            and type(layer.weight) in (torch.nn.Parameter, torch.Tensor)  # not a tensor subclass (a DTensor shard)
            and layer.weight.device.type == "cpu" and layer.weight.dtype in PACKABLE_DTYPES]


def _forward_from(layer: torch.nn.Linear, packed: torch.Tensor, rows: int):
    weight, bias = layer.weight, layer.bias

    def forward(inputs: torch.Tensor) -> torch.Tensor:
        if inputs.numel() <= rows * inputs.shape[-1] and inputs.dtype == weight.dtype:
            return torch.ops.mkldnn._linear_pointwise(inputs, packed, bias, "none", [], "")
        return F.linear(inputs, weight, bias)

    return forward


def packed_weights(model: torch.nn.Module, rows: int, min_bytes: int | None = None
                   ) -> list[tuple[torch.nn.Linear, torch.Tensor]]:
    """Each packable layer with its weight packed for ``rows`` rows; none when the build lacks the
    operators, the weights are under ``min_bytes`` (default :data:`PACK_MIN_BYTES`), less than
    :data:`MEMORY_HEADROOM` times their size is free, or a weight cannot be packed."""
    min_bytes = PACK_MIN_BYTES if min_bytes is None else min_bytes
    layers = packable_layers(model) if packing_supported() else []
    size = sum(layer.weight.numel() * layer.weight.element_size() for layer in layers)
    if size < min_bytes:
        return []
    if psutil.virtual_memory().available < MEMORY_HEADROOM * size:
        logger.debug("decode weights not packed: %d MiB would leave too little memory free", size >> 20)
        return []
    try:
        return [(layer, torch.ops.mkldnn._reorder_linear_weight(layer.weight, rows)) for layer in layers]
    except (RuntimeError, NotImplementedError) as error:  # a weight this build's oneDNN does not pack: the usual path
        logger.debug("decode weights not packed (%s); decoding with the usual matrix products", error)
        return []


@contextlib.contextmanager
def packed_linears(model: torch.nn.Module, rows: int, min_bytes: int | None = None) -> Iterator[int]:
    """Within the block, ``model``'s packable linear layers multiply inputs of up to ``rows`` rows from
    packed copies of their weights; yields how many layers were packed (0: the model runs as it is).
    Only for blocks in which the weights do not change (a decode under ``inference_mode``)."""
    packed = packed_weights(model, rows, min_bytes)
    for layer, weight in packed:
        layer.forward = _forward_from(layer, weight, rows)
    try:
        yield len(packed)
    finally:
        for layer, _ in packed:
            del layer.forward
