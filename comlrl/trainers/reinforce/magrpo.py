"""MAGRPOTrainer: multi-agent group-relative policy optimisation.

For each prompt every agent samples ``num_generations`` completions; ``reward_func`` scores
the joint samples; group-relative advantages (reward minus the group mean, optionally over
the group std) credit each agent's completions; each agent takes a clipped policy-gradient
step on its own completions. With one agent this is GRPO.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from comlrl.algorithms.advantages import agent_advantages, group_relative_advantages, joint_index, tree_returns
from comlrl.episodes import Rollout, rollout_episodes, score_rollout
from comlrl.placement import devices_of
from comlrl.policy import behaviour_logprobs, policy_gradient_backward
from comlrl.trainers.base import MultiAgentTrainer, Stage
from comlrl.trainers.reinforce.config import MAGRPOConfig


class MAGRPOTrainer(MultiAgentTrainer):
    config_class = MAGRPOConfig
    args: MAGRPOConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.joint_index = joint_index(self.num_agents, self.args.num_generations, self.args.joint_mode)

    # ----- stages -----------------------------------------------------------------------------
    def rollout(self, rows: list[dict[str, Any]], row_labels: list[int] | None = None) -> Rollout:
        """Stage 1: sample every turn of the episodes starting at ``rows``."""
        for agent in self.agents:
            agent.eval()
        return rollout_episodes(
            self.agents,
            self.tokenizers,
            self.formatters,
            rows,
            self.joint_index,
            self.args.num_generations,
            self.args.num_turns,
            self.sampling,
            self.external_transition,
            self.args.external_prompt_passthrough,
            self.args.max_prompt_length,
            row_labels,
            self.args.prompt_overflow,
            self.agent_map,
        )

    def score(self, rollout: Rollout) -> list[torch.Tensor]:
        """Stage 2: joint rewards per turn, ``[num_nodes, num_joint]`` each."""
        return score_rollout(rollout, self.reward)

    def advantages(self, rewards: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Stage 3: ``[agent][turn]`` advantages aligned with each agent's generation rows."""
        returns = tree_returns(rewards, self.args.discount)
        per_agent: list[list[torch.Tensor]] = [[] for _ in range(self.num_agents)]
        for turn_returns in returns:
            joint = group_relative_advantages(turn_returns, normalize=self.args.normalize_advantages)
            credited = agent_advantages(joint, self.joint_index, self.args.num_generations)
            for agent in range(self.num_agents):
                per_agent[agent].append(credited[agent].reshape(-1))
        return per_agent

    def update(self, rollout: Rollout, advantages: list[list[torch.Tensor]]) -> dict[str, float]:
        """Stage 4: backpropagate each agent's loss; step the optimizers at accumulation boundaries."""
        metrics: dict[str, float] = {}
        accumulation = self.args.gradient_accumulation_steps

        def update_agent(agent_index: int) -> dict[str, float]:
            return self.update_agent(agent_index, rollout, advantages[agent_index])

        # Agents on different GPUs backpropagate side by side; extra passes step (and all-reduce) in order.
        if self.args.policy_update_epochs == 1:
            per_agent = self.agent_map(update_agent, devices_of(self.agents))
        else:
            per_agent = [update_agent(index) for index in range(self.num_agents)]
        for agent_metrics in per_agent:
            metrics.update(agent_metrics)
        if (self.state.global_step + 1) % accumulation == 0:
            norms = self.step_optimizers(self.optimizers, self.agents)
            self.state.optimizer_steps += 1
            metrics.update({f"agent_{i}/grad_norm": norm for i, norm in enumerate(norms)})
        return metrics

    def update_agent(self, agent_index: int, rollout: Rollout, advantages: list[torch.Tensor]) -> dict[str, float]:
        """One agent's policy-gradient backward pass(es); with several passes, steps between them."""
        metrics: dict[str, float] = {}
        agent = self.agents[agent_index]
        passes = self.args.policy_update_epochs
        agent.train()
        generations = [turn.generations[agent_index] for turn in rollout.turns]
        old = behaviour_logprobs(agent, generations, self.args.temperature) if passes > 1 else None
        for update_pass in range(passes):
            loss = policy_gradient_backward(
                agent, generations, advantages, self.args.clip_epsilon,
                self.args.temperature, old, scale=1.0 / self.args.gradient_accumulation_steps,
            )
            if passes > 1 and update_pass < passes - 1:
                metrics[f"agent_{agent_index}/grad_norm"] = self.step_optimizers([self.optimizers[agent_index]], [agent])[0]
        metrics[f"agent_{agent_index}/loss"] = loss
        return metrics

    # rollout -> score -> advantages -> update: run by train_step, and one task each by the flows.
    step_stages = (
        Stage("rollout", ("rows",), "rollout", timing="generation_time"),
        Stage("score", ("rollout",), "rewards", timing="reward_time"),
        Stage("advantages", ("rewards",), "advantages", timing="update_time"),
        Stage("update", ("rollout", "advantages"), "update_metrics", timing="update_time"),
    )

    def step_metrics(self, values: dict[str, Any]) -> dict[str, float]:
        step_time = time.perf_counter() - values["step_started"]
        rollout = values["rollout"]
        metrics = dict(values["update_metrics"])
        metrics.update(self.rollout_metrics(rollout, values["rewards"]))
        metrics.update(
            step_time=step_time,
            **{name: values["timings"].get(name, 0.0) for name in ("generation_time", "reward_time", "update_time")},
            tokens_per_second=rollout.generated_tokens() / max(step_time, 1e-9),
        )
        return metrics
