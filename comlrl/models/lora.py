"""LoRA adapters for the actors through ``peft`` (the optional ``lora`` extra).

With ``lora_rank`` set, each actor becomes a ``peft`` model whose base weights are frozen;
only the adapters train (and are all the optimizer sees gradients for). ``save_model`` then
writes, per ``lora_save``: ``"merged"`` a plain Hugging Face model directory with the adapters
folded into the weights (loads with ``AutoModelForCausalLM``), or ``"adapter"`` peft's
``adapter_config.json`` + ``adapter_model.safetensors`` (load with ``PeftModel.from_pretrained``
on top of the base model).
"""

from __future__ import annotations

import copy
from typing import Any

from transformers import PreTrainedModel

INSTALL_HINT = "install the optional extra: pip install 'comlrl[lora]' (or pip install peft)"


def require_peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ImportError(f"LoRA (lora_rank is set) needs the peft package; {INSTALL_HINT}") from None
    return peft


def is_peft_model(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def add_adapters(model: PreTrainedModel, rank: int, alpha: float, dropout: float, target_modules: list | None) -> Any:
    """Wrap ``model`` with fresh LoRA adapters (``target_modules=None``: every linear layer but the output head)."""
    peft = require_peft()
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=target_modules if target_modules is not None else "all-linear",
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(model, config)


def exportable(model: Any, mode: str) -> Any:
    """What ``save_pretrained`` should write: the model itself, or a merged copy of a LoRA model."""
    if not is_peft_model(model) or mode == "adapter":
        return model
    return copy.deepcopy(model).merge_and_unload()
