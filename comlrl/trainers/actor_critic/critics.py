"""Critic entities and critic inputs: which critic sources a trainer gets, and what each critic reads.

Loading goes through :mod:`comlrl.entities` like the actors; this module adds the critic
rules of the user guide (MAAC: exactly one centralised critic; IAC: one per agent or none
when actors carry their own heads) and the text a centralised critic reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from comlrl import entities


@dataclass
class CriticInput:
    """Token IDs one critic reads for every episode of one turn (padded on either side)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor


def _shown(critics: Any) -> str:
    if isinstance(critics, (list, tuple)):
        return repr([entities.model_name(c) for c in critics])
    return repr(entities.model_name(critics))


def centralized_critic_source(critic_model: Any, critics: Sequence[Any] | None, trainer_name: str) -> Any:
    """The one critic of MAAC, from ``critic_model`` or a one-element ``critics`` list."""
    if critic_model is None and critics is None:
        raise ValueError(
            f"{trainer_name} needs a centralised critic: pass critic_model='<model id or directory>' "
            "or critics=[<one model>] (both are None)"
        )
    if isinstance(critics, (list, tuple)) and len(critics) != 1:
        raise ValueError(
            f"{trainer_name} uses one centralised critic, so critics must have exactly one element; "
            f"got {len(critics)}: {_shown(critics)}"
        )
    return entities.resolve_model_list(critic_model, critics, 1, "critic_model", "critics")[0]


def independent_critic_sources(
    critic_model: Any, critics: Sequence[Any] | None, num_agents: int, use_separate_critic: bool
) -> list[Any]:
    """IAC's critics: one per agent when separate; none when each actor carries its own value head."""
    if not use_separate_critic:
        if critic_model is not None or critics is not None:
            raise ValueError(
                "IACConfig.use_separate_critic=False shares each actor's backbone with its value head, so "
                f"critic_model and critics must stay None; got critic_model={_shown(critic_model)}, "
                f"critics={_shown(critics) if critics is not None else None}. Set use_separate_critic=True "
                "to train separate critics"
            )
        return []
    if critic_model is None and critics is None:
        raise ValueError(
            "IACConfig.use_separate_critic=True needs the critics: pass critic_model='<model id>' (one copy per "
            f"agent) or critics=[...] with {num_agents} entries (both are None)"
        )
    return entities.resolve_model_list(critic_model, critics, num_agents, "critic_model", "critics")


def policy_stage_critic(
    critic_model: Any,
    critics: Sequence[Any] | None,
    critic_model_name: str | None,
    agent_sources: Sequence[Any],
    needs_critic: bool = True,
) -> tuple[Any, Sequence[Any] | None]:
    """``(critic_model, critics)`` for a trainer that runs IAC/MAAC as its policy stage (MARLHF).

    Explicit ``critic_model``/``critics`` win; else ``critic_model_name`` from the config; else the
    first actor's identifier. ``needs_critic=False`` (IAC with shared heads) returns ``(None, None)``.
    """
    if not needs_critic:
        return critic_model, critics
    if critic_model is not None or critics is not None:
        if critic_model_name is not None and critic_model is not None and entities.model_name(critic_model) != critic_model_name:
            raise ValueError(
                f"critic_model={_shown(critic_model)} disagrees with critic_model_name={critic_model_name!r}; give one of them"
            )
        return critic_model, critics
    if critic_model_name is not None:
        return critic_model_name, None
    first = entities.model_name(agent_sources[0]) if agent_sources else None
    if first is None:
        raise ValueError(
            "the critic defaults to the first actor's model identifier, but that actor is a model object without "
            "one; set critic_model_name (or pass critic_model / critics)"
        )
    return first, None


def joint_text(prompts: Sequence[str], completions: Sequence[str] | None = None) -> str:
    """What a centralised critic reads: every agent's prompt, and for Q critics its completion too."""
    parts = []
    for agent, prompt in enumerate(prompts):
        parts.append(f"agent {agent} prompt: {prompt}")
        if completions is not None:
            parts.append(f"agent {agent} response: {completions[agent]}")
    return "\n".join(parts)
