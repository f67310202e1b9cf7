"""Critic entities and critic inputs: which critic sources a trainer gets, and what each critic reads.

Loading goes through :mod:`comlrl.models.entities` like the actors; this module adds the critic
rules of the user guide (MAAC: exactly one centralised critic; IAC: one per agent or none
when actors carry their own heads) and the text a centralised critic reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from comlrl.models import entities


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
            f"Either critic_model or critics must be provided for MAAC: {trainer_name} needs a centralised "
            "critic; pass critic_model='<model id or directory>' or critics=[<one model>] (both are None)"
        )
    if isinstance(critics, (list, tuple)) and len(critics) != 1:
        raise ValueError(
            f"critics length ({len(critics)}) must match 1 critic: {trainer_name} uses one centralised critic, "
            f"so critics must have exactly one element; got {len(critics)}: {_shown(critics)}"
        )
    return entities.resolve_model_list(critic_model, critics, 1, "critic_model", "critics", "1 critic")[0]


def independent_critic_sources(
    critic_model: Any, critics: Sequence[Any] | None, num_agents: int, use_separate_critic: bool
) -> list[Any]:
    """IAC's critics: one per agent when separate; none when each actor carries its own value head."""
    if not use_separate_critic:
        if critic_model is not None or critics is not None:
            raise ValueError(
                "critics can only be provided when use_separate_critic=True: "
                "IACConfig.use_separate_critic=False shares each actor's backbone with its value head, so "
                f"critic_model and critics must stay None; got critic_model={_shown(critic_model)}, "
                f"critics={_shown(critics) if critics is not None else None}. Set use_separate_critic=True "
                "to train separate critics"
            )
        return []
    if critic_model is None and critics is None:
        raise ValueError(
            "Either critic_model or critics must be provided when use_separate_critic=True: "
            "IACConfig.use_separate_critic=True needs the critics: pass critic_model='<model id>' (one copy per "
            f"agent) or critics=[...] with {num_agents} entries (both are None)"
        )
    return entities.resolve_model_list(critic_model, critics, num_agents, "critic_model", "critics")


def joint_text(prompts: Sequence[str], completions: Sequence[str] | None = None) -> str:
    """What a centralised critic reads: every agent's prompt, and for Q critics its completion too."""
    parts = []
    for agent, prompt in enumerate(prompts):
        parts.append(f"agent {agent} prompt: {prompt}")
        if completions is not None:
            parts.append(f"agent {agent} response: {completions[agent]}")
    return "\n".join(parts)
