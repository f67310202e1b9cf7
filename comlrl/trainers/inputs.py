"""What a trainer that owns its agents is built from: the constructor arguments, declared once.

:class:`~comlrl.trainers.base.MultiAgentTrainer` takes them by name; the trainers that hold one
(preference runs, centralized MAGRPO) forward them as ``**inputs`` typed by :class:`TrainerInputs`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, TypedDict, Unpack

__all__ = ["TrainerInputs", "Unpack", "input_names"]


class TrainerInputs(TypedDict, total=False):
    agent_model: Any  # a model name/path or object: num_agents copies of it
    agents: Sequence[Any]  # or one model per agent
    num_agents: int
    tokenizer: Any
    reward_func: Callable | Sequence[Callable]
    reward_processor: Callable[[float], float]
    formatters: Callable | Sequence[Callable]
    external_transition: Callable
    train_dataset: Any
    eval_dataset: Any
    callbacks: Sequence[Any]
    model_config: dict[str, Any]
    wandb_config: dict[str, Any]
    metrics_callback: Callable[..., Any]
    eval_logger: Callable[..., Any]
    eval_aggregator: Callable[..., Any]
    model: Any  # agent_model's name before comlrl 1.4


def input_names() -> set[str]:
    """Every argument name of :class:`TrainerInputs`."""
    return set(TrainerInputs.__annotations__)
