"""Small public helpers, including the helper names of the original comlrl ``comlrl.utils``.

The submodules keep the original's import paths (``comlrl.utils.reward_processor``,
``reward_utils``, ``formatters``, ``tokenizer_utils``, ``model_loading``, ``distributed``, ``reference_kl``);
each is a thin layer over this package's own machinery.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from comlrl.checkpointing.io import read_metadata
from comlrl.utils.distributed import DistributedContext, local_context, unwrap_model
from comlrl.utils.formatters import build_formatters
from comlrl.utils.model_loading import infer_model_name, resolve_model_sources
from comlrl.utils.reference_kl import (
    clone_reference_models,
    load_reference_models_from_sources,
    reference_kl_coef,
    reference_kl_enabled,
    reference_kl_for_sequence,
    resolve_reference_devices,
    validate_reference_kl_config,
)
from comlrl.utils.reward_processor import RewardProcessors
from comlrl.utils.reward_utils import (
    call_reward_function,
    normalize_reward_lengths,
    resolve_reward_range,
    set_reward_range,
)
from comlrl.utils.tokenizer_utils import (
    apply_tokenizer_specials,
    ensure_pad_token,
    ensure_tokenizer,
    resolve_tokenizers,
)


def read_checkpoint_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata of a complete checkpoint as a dict.

    Its ``"wandb"`` entry is the saved W&B run identity (``id``, ``project``, ``entity``, ...)
    or ``None``; ``"mlflow"`` likewise holds the MLflow run identity of a pipeline run.
    """
    return read_metadata(path)


__all__ = [
    "read_checkpoint_metadata",
    "build_formatters",
    "ensure_pad_token",
    "ensure_tokenizer",
    "apply_tokenizer_specials",
    "resolve_tokenizers",
    "infer_model_name",
    "resolve_model_sources",
    "clone_reference_models",
    "load_reference_models_from_sources",
    "reference_kl_coef",
    "reference_kl_enabled",
    "reference_kl_for_sequence",
    "resolve_reference_devices",
    "validate_reference_kl_config",
    "RewardProcessors",
    "call_reward_function",
    "normalize_reward_lengths",
    "resolve_reward_range",
    "set_reward_range",
    "DistributedContext",
    "local_context",
    "unwrap_model",
]
