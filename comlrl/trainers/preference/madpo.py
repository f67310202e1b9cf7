"""MADPOTrainer: multi-agent direct preference optimisation, online.

Each step takes a batch of prompts and runs four stages:

1. ``rollout`` — every agent samples ``num_generations`` candidates per prompt (one batched
   generate per agent for all prompts and candidates); candidate ``k`` of every agent forms
   joint candidate ``k``;
2. ``score`` — the task reward scores each joint candidate;
3. ``select_pairs`` — per prompt, the ordered pairs with a reward gap (ties dropped), selected by
   ``pair_selection`` (:mod:`comlrl.rollout.preferences`);
4. ``update`` — :meth:`MADPOTrainer.preference_update`: every agent takes the joint DPO loss
   (:mod:`comlrl.algorithms.dpo`) through its optimizer-step component.

The original comlrl 1.4.3 sampled pairs once, with the initial policy, and then made
``num_train_epochs`` passes over them; here every step's pairs come from the current policy.
The original's offline form is :class:`~comlrl.trainers.preference.iterative.MADPOIterTrainer`
with one iteration.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from comlrl.algorithms import dpo
from comlrl.parallel.placement import devices_of
from comlrl.rollout import preferences
from comlrl.rollout.episodes import Rollout
from comlrl.rollout.generation import Generation
from comlrl.training.logprobs import completion_logprobs
from comlrl.training.policy_update import backpropagate, dropout_disabled
from comlrl.training.reference import ReferencePolicy
from comlrl.trainers.base import MultiAgentTrainer
from comlrl.trainers.epochs import Stage
from comlrl.trainers.preference.madpo_config import MADPOConfig

# DPO scores the policy's own distribution, not the sampling temperature's (the original did the same).
DPO_TEMPERATURE = 1.0


def sequence_logprobs(model: Any, generation: Generation, autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Each row's completion log-probability under ``model`` (dropout off), ``[rows]``; keeps the graph."""
    with dropout_disabled(model):
        tokens = completion_logprobs(model, generation.prompt_ids, generation.prompt_mask, generation.completion_ids,
                                     generation.completion_mask, DPO_TEMPERATURE, autocast_dtype)
    return dpo.sequence_logprobs(tokens, generation.completion_mask)


class MADPOTrainer(MultiAgentTrainer):
    config_class = MADPOConfig
    algorithm_name = "MADPO"
    args: MADPOConfig
    fsdp_refusal = "the DPO reference copies are not sharded yet; launch with DDP instead"

    def build_references(self, sources: list[Any]) -> list[ReferencePolicy] | None:
        """DPO's frozen reference per agent (``dpo_reference='initial'``; None for 'none'): the agent's initial
        weights (with LoRA: its base model, adapters off), or ``reference_model``, on ``reference_devices``.
        Built by the base trainer before any update; never in checkpoints (a resume rebuilds them)."""
        return None if self.args.dpo_reference == "none" else self.frozen_references(sources)

    # ----- stages (rollout and score: the base trainer's) --------------------------------------------
    def select_pairs(self, rewards: list[torch.Tensor]) -> list[list[preferences.CandidatePair]]:
        """Stage 3: per prompt, the kept ``(chosen, rejected)`` joint candidates."""
        generator = None
        if self.args.pair_selection == "random":  # seeded from the run's RNG, so a resume draws the same
            generator = torch.Generator().manual_seed(int(torch.randint(2**62, (1,))))
        kept = []
        for node_rewards in rewards[0].float().cpu():
            candidates = preferences.ordered_pairs(node_rewards, self.args.preference_tie_margin)
            kept.append(preferences.select_pairs(candidates, self.args.pair_selection, self.args.max_pairs_per_prompt,
                                                 generator, rewards=node_rewards.tolist()))
        return kept

    def update(self, rollout: Rollout, pairs: list[list[preferences.CandidatePair]]) -> dict[str, float]:
        """Stage 4: the joint DPO update on the selected pairs (chosen rows first, then rejected)."""
        turn = rollout.turns[0]
        per_node = turn.generations[0].num_generations
        joint = rollout.joint_index
        generations = []
        for agent in range(self.num_agents):
            chosen = [node * per_node + int(joint[p.chosen, agent]) for node, kept in enumerate(pairs) for p in kept]
            rejected = [node * per_node + int(joint[p.rejected, agent])
                        for node, kept in enumerate(pairs) for p in kept]
            generations.append(preferences.generation_rows(turn.generations[agent], chosen + rejected))
        return self.preference_update(generations)

    # ----- the DPO step (also MADPOIterTrainer's) ------------------------------------------------------
    def preference_update(self, generations: Sequence[Generation],
                          references: Sequence[tuple[torch.Tensor, torch.Tensor] | None] | None = None
                          ) -> dict[str, float]:
        """One joint DPO micro-batch: ``generations[a]`` holds agent ``a``'s chosen completions in rows
        ``0..P-1`` and the matching rejected ones in ``P..2P-1``; ``references`` are their reference
        sequence log-probabilities if already known (else computed here).

        The other agents' log-ratio differences enter each agent's loss detached, from a first pass
        without gradients; then each agent backpropagates its own loss (side by side when on different
        devices) and its optimizer-step component counts the micro-batch, pairs or not. The loss is a mean
        over pairs: each component registers the micro-batch's pair count, so an accumulated window's
        gradient is the mean over all of its pairs (``ModelOptimizer.item_loss_scale``).

        Metrics: ``dpo/pairs`` and ``dpo/steps_without_pairs`` (1 when no process had a pair) always; the
        losses and ``dpo/{loss,accuracy,margin}`` only when some process had pairs (every process then reports
        them, zeros where it had none, weighted so that their mean over the processes is the statistic over
        all pairs: ``dpo.dpo_statistics``). Never NaN.
        """
        num_pairs = generations[0].completion_ids.shape[0] // 2
        # The DPO loss is a mean over pairs; the processes hold different numbers of pairs, so each divides its
        # sum by the mean count over the processes (a collective: every process, pairs or not).
        [mean_pairs] = self.data_parallel.mean_counts([num_pairs])
        metrics: dict[str, float] = {"dpo/pairs": float(num_pairs), "dpo/steps_without_pairs": float(mean_pairs == 0)}
        scales = [self.model_optimizers[f"agent_{agent}"].item_loss_scale(mean_pairs)
                  for agent in range(self.num_agents)]
        joint = torch.zeros(0)
        if num_pairs:
            if references is None:
                references = self.reference_logprobs(generations)
            with torch.no_grad():
                before = [self.log_ratio_differences(agent, generations[agent], references[agent]).cpu()
                          for agent in range(self.num_agents)]
            joint = torch.stack(before).sum(dim=0)

            def backward_agent(agent: int) -> dict[str, float]:
                model = self.agents[agent]
                model.train()
                own = self.log_ratio_differences(agent, generations[agent], references[agent])
                loss = dpo.joint_dpo_loss(own, joint - before[agent], self.args.dpo_beta) * (num_pairs / mean_pairs)
                return {f"agent_{agent}/loss": backpropagate([loss], scales[agent])}

            for agent_metrics in self.agent_map(backward_agent, devices_of(self.agents)):
                metrics.update(agent_metrics)
        elif mean_pairs:  # other processes have pairs: this one's share of their mean loss is 0
            metrics.update({f"agent_{agent}/loss": 0.0 for agent in range(self.num_agents)})
        statistics = dpo.dpo_statistics(joint, self.args.dpo_beta, normaliser=mean_pairs)
        metrics.update({f"dpo/{name}": value for name, value in statistics.items()})
        components = self.model_optimizers
        metrics.update(self.record_steps({name: component.micro_step() for name, component in components.items()}))
        return metrics

    def preference_step(self, generations: Sequence[Generation],
                        references: Sequence[tuple[torch.Tensor, torch.Tensor] | None] | None,
                        window: Any, end_of_pass: bool = False) -> None:
        """One counted step of an offline DPO stage (MADPOIterTrainer): :meth:`preference_update`, then at
        ``end_of_pass`` every pending gradient applied; recorded as any step (history, logging, evaluation,
        stop requests)."""
        self.step_guard.begin(self.step_restorer())
        self.step_guard.updating()  # the update starts at once
        metrics = self.preference_update(generations, references)
        if end_of_pass:
            metrics.update(self.record_steps({name: component.flush()
                                              for name, component in self.model_optimizers.items()}))
        self.record_step(metrics, window)

    def log_ratio_differences(self, agent: int, generation: Generation,
                              reference: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """``delta`` per pair of agent ``agent`` (with its graph unless called under no_grad)."""
        values = sequence_logprobs(self.agents[agent], generation, self.autocast_dtype)
        half = values.shape[0] // 2
        if reference is None:
            return dpo.log_ratio_differences(values[:half], values[half:])
        return dpo.log_ratio_differences(values[:half], values[half:], reference[0], reference[1])

    def reference_logprobs(self, generations: Sequence[Generation]) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per agent, the reference's (chosen, rejected) sequence log-probabilities (on the rows' device), or
        None without a reference."""
        if self.references is None:
            return [None] * self.num_agents
        result = []
        for reference, generation in zip(self.references, generations):
            values = dpo.sequence_logprobs(reference.logprobs(generation, DPO_TEMPERATURE, self.autocast_dtype),
                                             generation.completion_mask)
            half = values.shape[0] // 2
            result.append((values[:half], values[half:]))
        return result

    # rollout -> score -> select_pairs -> update: run by train_step, and one task each by the flows.
    step_stages = (
        Stage("rollout", ("rows",), "rollout", timing="generation_time"),
        Stage("score", ("rollout",), "rewards", timing="reward_time"),
        Stage("select_pairs", ("rewards",), "pairs", timing="update_time"),
        Stage("update", ("rollout", "pairs"), "update_metrics", timing="update_time", updates=True),
    )

    def step_metrics(self, values: dict[str, Any]) -> dict[str, float]:
        step_time = time.perf_counter() - values["step_started"]
        rollout = values["rollout"]
        metrics = dict(values["update_metrics"])
        metrics.update(self.rollout_metrics(rollout, values["rewards"], self.data_parallel.all_sum))
        metrics.update(
            step_time=step_time,
            **{name: values["timings"].get(name, 0.0) for name in ("generation_time", "reward_time", "update_time")},
            tokens_per_second=rollout.generated_tokens() / max(step_time, 1e-9),
        )
        return metrics

    def compat_settings(self) -> dict[str, Any]:
        return {**super().compat_settings(), "dpo_reference": self.args.dpo_reference}
