"""MAACTrainer: multi-agent actor-critic with one centralised critic.

The critic reads the joint input of all agents (every prompt, plus every completion for a
Q critic), encoded with the first actor's tokenizer; its value is the baseline of every
agent's advantage (a Q critic's: the mean Q of the prompt's other joint samples, see
``ActorCriticTrainer.advantages``).
"""

from __future__ import annotations

from typing import Any

from comlrl.rollout.episodes import Rollout
from comlrl.rollout.generation import context_length, encode_prompts
from comlrl.trainers.actor_critic.base import ActorCriticTrainer
from comlrl.trainers.actor_critic.config import MAACConfig
from comlrl.trainers.actor_critic.critics import CriticInput, centralized_critic_source, joint_text

HEAD_KEY = "critic_value_head_hidden_dim"


class MAACTrainer(ActorCriticTrainer):
    config_class = MAACConfig
    algorithm_name = "MAAC"
    args: MAACConfig

    def allowed_model_config_keys(self) -> set[str]:
        return super().allowed_model_config_keys() | {HEAD_KEY}

    def check_model_config_values(self, model_config: dict[str, Any]) -> None:
        width = model_config.get(HEAD_KEY)
        if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width < 1):
            raise ValueError(f"model_config[{HEAD_KEY!r}] must be a positive integer or None, got {width!r}")

    def resolve_critic_sources(self, critic_model: Any, critics: Any, config: MAACConfig, num_agents: int) -> list[Any]:
        return [centralized_critic_source(critic_model, critics, type(self).__name__)]

    def critic_names(self) -> list[str]:
        return ["critic"]

    @property
    def critic_model(self) -> Any:
        """The centralised critic (``critics[0]``), as earlier releases of the original comlrl named it."""
        return self.critics[0]

    @property
    def critic_model_name(self) -> str | None:
        """The critic's model name (its identifier or directory; None for an object without one)."""
        return self.critic_sources[0]

    def critic_tokenizer_index(self, critic: int) -> int:
        return 0

    def value_model_for_agent(self, agent: int) -> int:
        return 0

    def value_head_hidden_dim(self) -> int | None:
        return self.model_config.get(HEAD_KEY)

    def critic_inputs(self, rollout: Rollout) -> list[list[CriticInput]]:
        per_node = self.args.num_generations
        with_actions = self.args.critic_type == "q"
        inputs = []
        for turn in rollout.turns:
            texts = []
            for row in range(turn.num_nodes * per_node):
                prompts = [turn.prompts[a][row // per_node] for a in range(self.num_agents)]
                actions = [turn.generations[a].texts[row] for a in range(self.num_agents)] if with_actions else None
                texts.append(joint_text(prompts, actions))
            # An over-long joint input keeps its last tokens (with a warning) to fit the critic's context.
            ids, mask = encode_prompts(
                self.tokenizers[0], texts, self.critic_devices[0], context_length(self.critics[0])
            )
            inputs.append(CriticInput(ids, mask))
        return [inputs]
