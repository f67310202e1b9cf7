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

from comlrl.algorithms.advantages import agent_advantages, group_relative_advantages, tree_returns
from comlrl.rollout.episodes import Rollout
from comlrl.parallel.placement import devices_of
from comlrl.training.policy_update import backpropagate, behaviour_logprobs, policy_losses
from comlrl.trainers.base import MultiAgentTrainer, Stage
from comlrl.trainers.reinforce.config import MAGRPOConfig


class MAGRPOTrainer(MultiAgentTrainer):
    config_class = MAGRPOConfig
    args: MAGRPOConfig

    # ----- stages (rollout and score: the base trainer's) ------------------------------------------------
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
        """Stage 4: each agent's policy-gradient pass(es); its optimizer-step component steps when its
        accumulation window is full (every pass is one micro-batch)."""
        metrics: dict[str, float] = {}

        def backward_agent(agent_index: int) -> dict[str, float]:
            return self.update_agent(agent_index, rollout, advantages[agent_index])

        if self.args.policy_update_epochs == 1:
            # Agents on different GPUs backpropagate side by side; the steps (and all-reduces) follow in order.
            for agent_metrics in self.agent_map(backward_agent, devices_of(self.agents)):
                metrics.update(agent_metrics)
            components = self.model_optimizers
            metrics.update(self.record_steps({name: component.micro_step() for name, component in components.items()}))
        else:
            for index in range(self.num_agents):
                metrics.update(backward_agent(index))
        return metrics

    def agent_update_passes(self) -> int:
        return self.args.policy_update_epochs

    def update_agent(self, agent_index: int, rollout: Rollout, advantages: list[torch.Tensor]) -> dict[str, float]:
        """One agent's policy-gradient backward pass(es); with several passes each is a micro-batch of its
        optimizer-step component, and the old log-probabilities come from before the first."""
        metrics: dict[str, float] = {}
        agent = self.agents[agent_index]
        component = self.model_optimizers[f"agent_{agent_index}"]
        passes = self.args.policy_update_epochs
        agent.train()
        generations = [turn.generations[agent_index] for turn in rollout.turns]
        old = behaviour_logprobs(agent, generations, self.args.temperature) if passes > 1 else None
        for _ in range(passes):
            losses = policy_losses(agent, generations, advantages, self.args.clip_epsilon, self.args.temperature, old)
            loss = backpropagate(losses, component.loss_scale)
            if passes > 1:
                metrics.update(self.record_steps({component.name: component.micro_step()}))
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
