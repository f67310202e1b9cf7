"""MAGRPOTrainer: multi-agent group-relative policy optimisation.

For each prompt every agent samples ``num_generations`` completions; ``reward_func`` scores
the joint samples; group-relative advantages (reward minus the group mean, optionally over
the group std) credit each agent's completions; each agent takes a clipped policy-gradient
step on its own completions. With one agent this is GRPO. A group whose returns are all equal
gives its baseline nothing to compare (``reward/zero_variance_groups``); ``skip_zero_variance_groups``
leaves such groups out of the loss.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from comlrl.algorithms.advantages import agent_advantages, baseline_advantages, tree_returns, zero_variance_groups
from comlrl.algorithms.kl import kl_shaped_rewards
from comlrl.rollout.episodes import Rollout
from comlrl.rollout.generation import Generation
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
    def zero_variance(self, rewards: list[torch.Tensor], rollout: Rollout | None = None) -> list[torch.Tensor]:
        """Stage: per turn, ``[num_nodes]`` flags of the groups whose returns are all equal (the groups the
        advantages' baselines are taken over, :func:`~comlrl.algorithms.advantages.zero_variance_groups`).
        Judged on the task's returns: a reference KL as reward shaping would make nearly every group vary."""
        parents = rollout.parents() if rollout is not None else None
        returns = tree_returns(rewards, self.args.discount, parents)
        return [zero_variance_groups(turn_returns) for turn_returns in returns]

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
               reference: ReferenceTerms | None = None,
               zero_variance: list[torch.Tensor] | None = None) -> dict[str, float]:
        """Stage 4: each agent's policy-gradient pass(es); its optimizer-step component steps when its
        accumulation window is full (every pass is one micro-batch).

        With ``skip_zero_variance_groups`` the completions of the groups ``zero_variance`` flags are masked out
        of every agent's loss and normaliser. When no completion is left on any process, nothing is
        backpropagated and no micro-batch is counted: the optimizers, their windows and schedules stay as
        they were."""
        metrics: dict[str, float] = {}
        kept = None
        if self.args.skip_zero_variance_groups and zero_variance is not None:
            kept = kept_rows(rollout, zero_variance)
        counts = self.normaliser_counts(rollout, kept)  # a collective: before any per-agent work
        if kept is not None and all(completions == 0 for completions, _ in counts):
            return {f"agent_{index}/loss": 0.0 for index in range(self.num_agents)}

        def backward_agent(agent_index: int) -> dict[str, float]:
            return self.update_agent(agent_index, rollout, advantages[agent_index], reference, counts[agent_index],
                                     kept)

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

    def normaliser_counts(self, rollout: Rollout, kept: list[torch.Tensor] | None = None) -> list[tuple[float, float]]:
        """Per agent, the ``(completions, completion tokens)`` its loss is normalised by: this process's in one
        process, the means over the processes under data parallelism, where the gradients are averaged and the
        counts differ (tokens always; completions when early termination ends episodes). ``kept`` (see
        :func:`kept_rows`) counts only the kept completions."""
        local = []
        for agent in range(self.num_agents):
            generations = [turn.generations[agent] for turn in rollout.turns]
            local += loss_counts(generations, kept)
        means = self.data_parallel.mean_counts(local)
        return [(means[2 * agent], means[2 * agent + 1]) for agent in range(self.num_agents)]

    def agent_update_passes(self) -> int:
        return self.args.policy_update_epochs

    def update_agent(self, agent_index: int, rollout: Rollout, advantages: list[torch.Tensor],
                     reference: ReferenceTerms | None = None,
                     counts: tuple[float, float] | None = None,
                     kept: list[torch.Tensor] | None = None) -> dict[str, float]:
        """One agent's policy-gradient backward pass(es); with several passes each is a micro-batch of its
        optimizer-step component, and the old log-probabilities come from before the first (the reference
        stage's, when it ran). ``kept`` (see :func:`kept_rows`) masks the other completions out of the loss."""
        args = self.args
        metrics: dict[str, float] = {}
        agent = self.agents[agent_index]
        component = self.model_optimizers[f"agent_{agent_index}"]
        passes = args.policy_update_epochs
        agent.train()
        generations = [turn.generations[agent_index] for turn in rollout.turns]
        counts = counts if counts is not None else loss_counts(generations, kept)
        if kept is not None:
            generations = [masked_rows(generation, rows) for generation, rows in zip(generations, kept)]
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

    # rollout -> score -> reference -> zero_variance -> advantages -> update: run by train_step, and one task
    # each by the flows.
    step_stages = (
        Stage("rollout", ("rows",), "rollout", timing="generation_time"),
        Stage("score", ("rollout",), "rewards", timing="reward_time"),
        Stage("reference", ("rollout",), "reference", timing="update_time"),
        Stage("zero_variance", ("rewards", "rollout"), "zero_variance", timing="update_time"),
        Stage("advantages", ("rewards", "reference", "rollout"), "advantages", timing="update_time"),
        Stage("update", ("rollout", "advantages", "reference", "zero_variance"), "update_metrics",
              timing="update_time", updates=True),
    )

    def step_metrics(self, values: dict[str, Any]) -> dict[str, float]:
        step_time = time.perf_counter() - values["step_started"]
        rollout = values["rollout"]
        metrics = dict(values["update_metrics"])
        metrics.update(self.rollout_metrics(rollout, values["rewards"], self.data_parallel.all_sum))
        metrics.update(self.reference_metrics(values.get("reference")))
        metrics.update(self.group_metrics(values["zero_variance"]))
        metrics.update(
            step_time=step_time,
            **{name: values["timings"].get(name, 0.0) for name in ("generation_time", "reward_time", "update_time")},
            tokens_per_second=rollout.generated_tokens() / max(step_time, 1e-9),
        )
        return metrics

    def group_metrics(self, zero_variance: list[torch.Tensor]) -> dict[str, float]:
        """``reward/zero_variance_groups``: the share of the step's groups (every turn's) whose returns are all
        equal; with ``skip_zero_variance_groups``, ``reward/skipped_groups``: their number (under data
        parallelism both are the means over the processes)."""
        flags = torch.cat(zero_variance)
        metrics = {"reward/zero_variance_groups": float(flags.float().mean())}
        if self.args.skip_zero_variance_groups:
            metrics["reward/skipped_groups"] = float(flags.sum())
        return metrics


def kept_rows(rollout: Rollout, zero_variance: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per turn, which generation rows are outside the flagged groups (every agent's row ``p * G + g`` is
    sample ``g`` of node ``p``, so one flag per row serves every agent, in either joint mode)."""
    return [(~flags).repeat_interleave(turn.generations[0].num_generations)
            for turn, flags in zip(rollout.turns, zero_variance)]


def masked_rows(generation: Generation, kept: torch.Tensor) -> Generation:
    """``generation`` with the completion mask of every row not ``kept`` zeroed: the row then adds nothing to
    any term of the loss (each is masked token by token), and every process runs the passes it would run
    without skipping (FSDP's collectives stay in step)."""
    mask = generation.completion_mask
    return dataclasses.replace(generation, completion_mask=mask * kept.to(mask.device, mask.dtype).unsqueeze(1))


def loss_counts(generations: list[Generation], kept: list[torch.Tensor] | None) -> tuple[int, int]:
    """``(completions, completion tokens)`` a loss over ``generations`` is normalised by: all of them
    (:func:`completion_counts`), or with ``kept`` only the kept rows'."""
    if kept is None:
        return completion_counts(generations)
    masked = [masked_rows(generation, rows) for generation, rows in zip(generations, kept)]
    return int(sum(int(rows.sum()) for rows in kept)), completion_counts(masked)[1]


class MAREINFORCETrainer(MAGRPOTrainer):
    """MAGRPO with ``A = R`` (no baseline): :class:`MAREINFORCEConfig`'s ``advantage_mode='raw'``."""

    config_class = MAREINFORCEConfig


class MAReMaxTrainer(MAGRPOTrainer):
    """MAGRPO with ``A = R - max R`` over the group: :class:`MAReMaxConfig`'s ``advantage_mode='max'``."""

    config_class = MAReMaxConfig


class MARLOOTrainer(MAGRPOTrainer):
    """MAGRPO with the leave-one-out baseline ``A_i = R_i - mean_{j != i} R_j``: ``advantage_mode='rloo'``."""

    config_class = MARLOOConfig
