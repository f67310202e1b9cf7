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

from comlrl.algorithms.advantages import agent_advantages, baseline_advantages, tree_returns
from comlrl.algorithms.kl import kl_shaped_rewards
from comlrl.rollout.episodes import Rollout
from comlrl.parallel.placement import devices_of
from comlrl.algorithms.losses import loss_normaliser
from comlrl.training.policy_update import backpropagate, behaviour_logprobs, completion_counts, policy_losses
from comlrl.training.reference import ReferenceTerms
from comlrl.trainers.base import MultiAgentTrainer
from comlrl.trainers.epochs import Stage
from comlrl.trainers.reinforce.config import MAGRPOConfig, MAREINFORCEConfig, MAReMaxConfig, MARLOOConfig


class MAGRPOTrainer(MultiAgentTrainer):
    config_class = MAGRPOConfig
    algorithm_name = "MAGRPO"
    args: MAGRPOConfig

    # ----- stages (rollout and score: the base trainer's) ------------------------------------------------
    def advantages(self, rewards: list[torch.Tensor], reference: ReferenceTerms | None = None,
                   rollout: Rollout | None = None) -> list[list[torch.Tensor]]:
        """Stage 3: ``[agent][turn]`` advantages aligned with each agent's generation rows.

        Returns over the rollout tree (``rollout`` gives its shape when early termination pruned it), then
        each group's baseline (``advantage_mode``). With the reference KL
        as reward shaping, each agent's rewards are first less its own completion's ``coef x KL``, so the
        agents' advantages differ by their KL terms."""
        args = self.args
        shaping = reference is not None and args.reference_kl_mode == "reward"
        per_agent: list[list[torch.Tensor]] = [[] for _ in range(self.num_agents)]
        parents = rollout.parents() if rollout is not None else None
        shared = None if shaping else tree_returns(rewards, args.discount, parents)
        for agent in range(self.num_agents):
            returns = tree_returns(self.shaped_rewards(rewards, reference, agent), args.discount, parents) if shaping \
                else shared
            for turn_returns in returns:
                joint = baseline_advantages(turn_returns, args.advantage_mode, args.normalize_advantages)
                # dropped joint samples (NaN returns) are left out of each completion's credit
                credited = agent_advantages(joint, self.joint_index, args.num_generations,
                                            kept=~torch.isnan(turn_returns))
                per_agent[agent].append(credited[agent].reshape(-1))
        return per_agent

    def shaped_rewards(self, rewards: list[torch.Tensor], reference: ReferenceTerms, agent: int) -> list[torch.Tensor]:
        """Joint rewards per turn less ``agent``'s KL penalty on the completion it put in each joint sample."""
        shaped = []
        for turn, turn_rewards in enumerate(rewards):
            kl = reference.kl[agent][turn].float().cpu().reshape(turn_rewards.shape[0], -1)  # [nodes, generations]
            joint_kl = kl[:, self.joint_index[:, agent]]  # [nodes, num_joint]
            shaped.append(kl_shaped_rewards(turn_rewards, joint_kl, self.args.reference_kl_coef))
        return shaped

    def update(self, rollout: Rollout, advantages: list[list[torch.Tensor]],
               reference: ReferenceTerms | None = None) -> dict[str, float]:
        """Stage 4: each agent's policy-gradient pass(es); its optimizer-step component steps when its
        accumulation window is full (every pass is one micro-batch)."""
        metrics: dict[str, float] = {}
        counts = self.normaliser_counts(rollout)  # a collective: before any per-agent work

        def backward_agent(agent_index: int) -> dict[str, float]:
            return self.update_agent(agent_index, rollout, advantages[agent_index], reference, counts[agent_index])

        if self.args.policy_update_epochs == 1 and self.agents_run_in_turn():
            # One agent after another: each steps right after its backward pass, so its gradients are
            # freed before the next agent's pass (the same result: an agent's loss reads no other's weights).
            steps = {}
            for index in range(self.num_agents):
                metrics.update(backward_agent(index))
                component = self.model_optimizers[f"agent_{index}"]
                steps[component.name] = component.micro_step()
            metrics.update(self.record_steps(steps))
        elif self.args.policy_update_epochs == 1:
            # Agents on different GPUs backpropagate side by side; the steps (and all-reduces) follow in order.
            for agent_metrics in self.agent_map(backward_agent, devices_of(self.agents)):
                metrics.update(agent_metrics)
            components = self.model_optimizers
            metrics.update(self.record_steps({name: component.micro_step() for name, component in components.items()}))
        else:
            for index in range(self.num_agents):
                metrics.update(backward_agent(index))
        return metrics

    def normaliser_counts(self, rollout: Rollout) -> list[tuple[float, float]]:
        """Per agent, the ``(completions, completion tokens)`` its loss is normalised by: this process's in one
        process, the means over the processes under data parallelism, where the gradients are averaged and the
        counts differ (tokens always; completions when early termination ends episodes)."""
        local = []
        for agent in range(self.num_agents):
            generations = [turn.generations[agent] for turn in rollout.turns]
            local += completion_counts(generations)
        means = self.data_parallel.mean_counts(local)
        return [(means[2 * agent], means[2 * agent + 1]) for agent in range(self.num_agents)]

    def agent_update_passes(self) -> int:
        return self.args.policy_update_epochs

    def update_agent(self, agent_index: int, rollout: Rollout, advantages: list[torch.Tensor],
                     reference: ReferenceTerms | None = None,
                     counts: tuple[float, float] | None = None) -> dict[str, float]:
        """One agent's policy-gradient backward pass(es); with several passes each is a micro-batch of its
        optimizer-step component, and the old log-probabilities come from before the first (the reference
        stage's, when it ran)."""
        args = self.args
        metrics: dict[str, float] = {}
        agent = self.agents[agent_index]
        component = self.model_optimizers[f"agent_{agent_index}"]
        passes = args.policy_update_epochs
        agent.train()
        generations = [turn.generations[agent_index] for turn in rollout.turns]
        counts = counts if counts is not None else completion_counts(generations)
        # The loss is a mean over this many items (loss_type's normaliser); registering them with the component
        # makes an accumulated window's gradient the mean over all its items, as one batch of them would give.
        items = loss_normaliser(args.loss_type, counts[0], counts[1], args.max_new_tokens)
        old = None
        if passes > 1:
            old = reference.behaviour[agent_index] if reference is not None else behaviour_logprobs(
                agent, generations, args.temperature, self.autocast_dtype)
        kl_loss = reference is not None and args.reference_kl_mode == "loss"
        for _ in range(passes):
            losses = policy_losses(
                agent, generations, advantages, args.clip_epsilon, args.temperature, old,
                loss_type=args.loss_type, max_completion_length=args.max_new_tokens,
                reference_logprobs=reference.reference[agent_index] if kl_loss else None,
                kl_coef=args.reference_kl_coef if kl_loss else 0.0, autocast_dtype=self.autocast_dtype,
                counts=counts,
            )
            loss = backpropagate(losses, component.item_loss_scale(items))
            if passes > 1:
                metrics.update(self.record_steps({component.name: component.micro_step()}))
        metrics[f"agent_{agent_index}/loss"] = loss
        return metrics

    # rollout -> score -> reference -> advantages -> update: run by train_step, and one task each by the flows.
    step_stages = (
        Stage("rollout", ("rows",), "rollout", timing="generation_time"),
        Stage("score", ("rollout",), "rewards", timing="reward_time"),
        Stage("reference", ("rollout",), "reference", timing="update_time"),
        Stage("advantages", ("rewards", "reference", "rollout"), "advantages", timing="update_time"),
        Stage("update", ("rollout", "advantages", "reference"), "update_metrics", timing="update_time", updates=True),
    )

    def step_metrics(self, values: dict[str, Any]) -> dict[str, float]:
        step_time = time.perf_counter() - values["step_started"]
        rollout = values["rollout"]
        metrics = dict(values["update_metrics"])
        metrics.update(self.rollout_metrics(rollout, values["rewards"]))
        metrics.update(self.reference_metrics(values.get("reference")))
        metrics.update(
            step_time=step_time,
            **{name: values["timings"].get(name, 0.0) for name in ("generation_time", "reward_time", "update_time")},
            tokens_per_second=rollout.generated_tokens() / max(step_time, 1e-9),
        )
        return metrics


class MAREINFORCETrainer(MAGRPOTrainer):
    """MAGRPO with ``A = R`` (no baseline): :class:`MAREINFORCEConfig`'s ``advantage_mode='raw'``."""

    config_class = MAREINFORCEConfig


class MAReMaxTrainer(MAGRPOTrainer):
    """MAGRPO with ``A = R - max R`` over the group: :class:`MAReMaxConfig`'s ``advantage_mode='max'``."""

    config_class = MAReMaxConfig


class MARLOOTrainer(MAGRPOTrainer):
    """MAGRPO with the leave-one-out baseline ``A_i = R_i - mean_{j != i} R_j``: ``advantage_mode='rloo'``."""

    config_class = MARLOOConfig
