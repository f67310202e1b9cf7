"""IACTrainer: independent actor-critic, one critic per agent.

With ``use_separate_critic=True`` each agent has its own critic model reading the agent's
own token IDs; with ``False`` each actor's backbone also carries the value head
(``trainer.agents[i].value_head``) and the critic loss trains that backbone too.
"""

from __future__ import annotations

from typing import Any

import torch

from comlrl.rollout.episodes import Rollout
from comlrl.trainers.actor_critic.base import ActorCriticTrainer
from comlrl.trainers.actor_critic.config import IACConfig
from comlrl.trainers.actor_critic.critics import CriticInput, independent_critic_sources


class IACTrainer(ActorCriticTrainer):
    config_class = IACConfig
    algorithm_name = "IAC"
    args: IACConfig

    def resolve_critic_sources(self, critic_model: Any, critics: Any, config: IACConfig, num_agents: int) -> list[Any]:
        return independent_critic_sources(critic_model, critics, num_agents, config.use_separate_critic)

    def critic_names(self) -> list[str]:
        return [f"critic_{i}" for i in range(self.num_agents)]

    @property
    def critic_models(self) -> list[Any]:
        """One entry per agent, as earlier releases of the original comlrl named them: its separate critic, or
        None where the actor carries its own value head (``use_separate_critic=False``)."""
        return list(self.critics) if self.critics else [None] * self.num_agents

    def critic_tokenizer_index(self, critic: int) -> int:
        return critic

    def value_model_for_agent(self, agent: int) -> int:
        return agent

    def value_head_hidden_dim(self) -> int | None:
        if self.args.use_separate_critic:
            return self.args.critic_value_head_hidden_dim
        return self.args.value_head_hidden_dim

    def critic_inputs(self, rollout: Rollout) -> list[list[CriticInput]]:
        """Each agent's critic reads that agent's prompt (V) or prompt plus completion (Q), as the actor saw them.

        A Q value is never the baseline of its own completion: see ``ActorCriticTrainer.advantages``.
        """
        inputs = []
        for agent in range(self.num_agents):
            agent_inputs = []
            for turn in rollout.turns:
                g = turn.generations[agent]
                if self.args.critic_type == "q":
                    ids = torch.cat([g.prompt_ids, g.completion_ids], dim=1)
                    mask = torch.cat([g.prompt_mask, g.completion_mask.to(g.prompt_mask.dtype)], dim=1)
                else:
                    ids, mask = g.prompt_ids, g.prompt_mask
                agent_inputs.append(CriticInput(ids, mask))
            inputs.append(agent_inputs)
        return inputs

    def compat_settings(self) -> dict[str, Any]:
        return {"use_separate_critic": self.args.use_separate_critic, **super().compat_settings()}
