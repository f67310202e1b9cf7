"""Reward helpers of the original comlrl API, built on :mod:`comlrl.rollout.rewards`.

The call-shape rules (which arguments go positionally, which as keywords) live in
:func:`comlrl.rollout.rewards.plan_reward_call`; :func:`call_reward_function` only runs a
plan once and returns the rewards as a list of floats.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from typing import Any, Callable, TypeVar

import torch

from comlrl.rollout.rewards import RewardCallPlan, plan_reward_call, resolve_reward_range

RewardCallable = TypeVar("RewardCallable", bound=Callable[..., Any])

def set_reward_range(reward_func: RewardCallable, minimum: float, maximum: float) -> RewardCallable:
    """Attach ``reward_range = (minimum, maximum)`` to ``reward_func`` (validated) and return it."""
    reward_func.reward_range = (float(minimum), float(maximum))
    resolve_reward_range(reward_func)  # raises on an invalid range (the attribute stays set)
    return reward_func


def _as_float_list(raw: Any) -> list[float]:
    """Rewards as floats: a tensor, list or tuple element-wise; anything else as one number."""
    if isinstance(raw, torch.Tensor):
        raw = raw.detach().cpu()
        raw = [raw.item()] if raw.dim() == 0 else raw.tolist()
    if isinstance(raw, (list, tuple)):
        return [float(value) for value in raw]
    return [float(raw)]


def _signature_holder(signature: inspect.Signature) -> Callable[..., Any]:
    """A callable whose signature is ``signature``, so that a given signature can be planned for."""

    def holder(*args: Any, **kwargs: Any) -> None:
        return None

    holder.__signature__ = signature  # type: ignore[attr-defined]
    return holder


def call_reward_function(
    reward_func: Callable[..., Any],
    prompts: Sequence[str],
    agent_completions: Sequence[Sequence[str]],
    *,
    num_agents: int,
    batch_items: Sequence[dict[str, Any]] | None = None,
    signature: inspect.Signature | None = None,
) -> list[float]:
    """Call ``reward_func`` in the shape its signature asks for and return its rewards as floats.

    ``agent_completions`` holds one list of completions per agent. The shape is chosen by
    :func:`~comlrl.rollout.rewards.plan_reward_call` (from ``signature`` if given);
    ``batch_items=`` is passed only when given. A bare number comes back as a one-element
    list. If the call raises ``TypeError``, ``reward_func(*agent_completions)`` is tried
    once; should that fail too, the first error propagates.
    """
    planned_for = reward_func if signature is None else _signature_holder(signature)
    plan: RewardCallPlan = plan_reward_call(planned_for, num_agents)
    if batch_items is None and plan.batch_items:
        plan = dataclasses.replace(plan, batch_items=False)
    args, kwargs = plan.arguments(prompts, list(agent_completions), batch_items)  # type: ignore[arg-type]
    try:
        raw = reward_func(*args, **kwargs)
    except TypeError as first_error:
        try:
            raw = reward_func(*agent_completions)
        except TypeError:
            raise first_error from None
    return _as_float_list(raw)


def normalize_reward_lengths(
    rewards: Sequence[float],
    *,
    num_agents: int,
    num_generations: int,
    algorithm: str,
) -> list[float]:
    """Rewards of one prompt as floats, one shared reward broadcast to all agents.

    With one agent the rewards are returned as they are. With several, a single reward is
    repeated ``num_agents`` times, and ``num_agents`` or ``num_generations`` rewards are kept;
    any other count raises ``ValueError`` (naming ``algorithm``), as does ``num_generations < 1``.
    """
    values = [float(value) for value in rewards]
    if num_agents == 1:
        return values
    if num_generations < 1:
        raise ValueError("num_generations must be >= 1.")
    if len(values) == 1:
        return values * num_agents
    if len(values) in (num_agents, num_generations):
        return values
    raise ValueError(
        f"Reward function must return either 1 or {num_agents} values per prompt "
        f"for multi-agent {algorithm}."
    )


__all__ = ["call_reward_function", "normalize_reward_lengths", "resolve_reward_range", "set_reward_range"]
