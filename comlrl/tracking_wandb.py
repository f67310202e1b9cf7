"""Weights & Biases logging for trainers given ``wandb_config`` (the 1.4.3 constructor argument).

``wandb`` is optional: when it cannot be imported, :func:`wandb_callback` logs one warning and
returns ``None``, and training goes on with the other trackers (MLflow through the pipeline,
``trainer.state.history`` locally). When it is importable, the returned :class:`WandbCallback`
opens the run at ``on_train_begin`` (not at construction) and sends every ``on_log`` dict to it.
The run it opened is recorded in ``trainer.run_identity["wandb"]``, so checkpoints name it and a
resumed run continues it.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from comlrl.callbacks import TrainerCallback

logger = logging.getLogger(__name__)

# Keys of a 1.4.3 launcher's wandb_config that are not wandb.init arguments.
_LAUNCHER_KEYS = ("config_sections", "run_name")


def import_wandb() -> Any | None:
    """The ``wandb`` module, or None when it is not installed."""
    try:
        return importlib.import_module("wandb")
    except ImportError:
        return None


def init_arguments(wandb_config: dict[str, Any], identity: dict[str, Any] | None) -> dict[str, Any]:
    """``wandb.init`` keyword arguments from ``wandb_config`` (plus the resumed run, if any)."""
    arguments = {key: value for key, value in wandb_config.items() if key not in _LAUNCHER_KEYS}
    if "run_name" in wandb_config and "name" not in arguments:
        arguments["name"] = wandb_config["run_name"]
    sections = wandb_config.get("config_sections")
    if isinstance(sections, dict):
        arguments["config"] = {**sections, **dict(arguments.get("config") or {})}
    if identity and identity.get("id") and "id" not in arguments:
        arguments.update(id=identity["id"], resume="allow")  # continue the run the checkpoint names
    return arguments


def run_identity(run: Any) -> dict[str, str] | None:
    """What names a W&B run: its ``id``, ``project`` and ``entity`` (those that are set)."""
    identity = {key: value for key in ("id", "project", "entity")
                if isinstance(value := getattr(run, key, None), str) and value}
    return identity if identity.get("id") else None


class WandbCallback(TrainerCallback):
    """Opens a W&B run lazily at train begin and logs every metrics dict to it."""

    def __init__(self, wandb_config: dict[str, Any], module: Any) -> None:
        self.wandb_config = dict(wandb_config)
        self.wandb = module
        self.run: Any = None

    def on_train_begin(self, trainer: Any) -> None:
        if self.run is not None:
            return
        self.run = self.wandb.init(**init_arguments(self.wandb_config, trainer.run_identity.get("wandb")))
        opened = run_identity(self.run)
        if opened is not None:
            trainer.record_tracking_run("wandb", opened)

    def on_log(self, trainer: Any, metrics: dict[str, float], step: int) -> None:
        if self.run is None:
            self.on_train_begin(trainer)  # evaluate() before train()
        self.wandb.log(dict(metrics), step=step)

    def on_train_end(self, trainer: Any) -> None:
        finish = getattr(self.run, "finish", None)
        if callable(finish):
            finish()
        self.run = None


def wandb_callback(wandb_config: dict[str, Any] | None) -> WandbCallback | None:
    """A callback logging to W&B per ``wandb_config``; None (after one warning) without ``wandb``."""
    if wandb_config is None:
        return None
    if not isinstance(wandb_config, dict):
        raise ValueError(f"wandb_config must be a dict of wandb.init arguments, got {type(wandb_config).__name__}")
    module = import_wandb()
    if module is None:
        logger.warning(
            "wandb_config was given but the wandb package is not installed: nothing is sent to Weights & Biases; "
            "MLflow/local tracking (trainer.state.history, callbacks) stays as it is"
        )
        return None
    return WandbCallback(wandb_config, module)
