"""MADPOIterTrainer: iterative multi-agent DPO, an iteration loop holding MADPO's parts.

A run is ``num_iterations`` iterations of three stages, each a checkpoint boundary:

1. ``collect_preferences`` — the current policy samples candidates for this iteration's prompts;
   the comparator (``comparator_policy``: the policy itself, its snapshot from ``k`` iterations
   ago, another local model, or an HTTP endpoint) answers the same prompts; the task reward
   labels the pairs (:class:`~comlrl.trainers.preference.collect.PreferenceCollection`), which
   become this iteration's shard; the reward distribution of the candidates is logged;
2. ``prepare_pairs`` — the pairs to train on, a replay of the shards (``preference_replay_mode``),
   and, with a DPO reference, their reference log-probabilities, computed once for all epochs
   (kept in the checkpoint, so a resumed DPO stage uses the same numbers);
3. ``learn_policy`` — ``num_train_epochs`` DPO passes over them in micro-batches of
   ``dpo_batch_size`` pairs, each a :meth:`MADPOTrainer.preference_update` of the policy trainer.
   A stop mid-stage checkpoints and resumes at the next micro-batch.

The parts are the MADPO policy trainer (agents, optimizers, the frozen DPO references,
evaluation, export) and the preference collection with its comparator; this class only runs the
iterations. One iteration with the 'current' comparator is the original comlrl's (offline) MADPO.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

import torch

from comlrl.rollout import preferences
from comlrl.rollout.generation import prompt_token_limit
from comlrl.training.metrics import MetricWindow
from comlrl.seeding import capture_rng_state, restore_rng_state
from comlrl.trainers.preference import replay
from comlrl.trainers.preference.collect import PreferenceCollection, distribution_metrics
from comlrl.trainers.preference.comparators import build_comparator
from comlrl.trainers.inputs import TrainerInputs, Unpack
from comlrl.trainers.preference.madpo import MADPOTrainer
from comlrl.trainers.preference.madpo_config import MADPOIterConfig
from comlrl.trainers.preference.reward_histogram import RewardHistogramNames
from comlrl.trainers.preference.rounds import PbRLState, PreferenceRounds

logger = logging.getLogger(__name__)


class MADPOIterTrainer(RewardHistogramNames, PreferenceRounds):
    config_class = MADPOIterConfig
    args: MADPOIterConfig
    STAGES = ("collect_preferences", "prepare_pairs", "learn_policy")

    def __init__(self, agent_model: Any = None, *, args: MADPOIterConfig | None = None,
                 centralized_comparator_adapter: Any = None, **inputs: Unpack[TrainerInputs]) -> None:
        """``inputs`` are the MADPO policy trainer's (:class:`~comlrl.trainers.inputs.TrainerInputs`);
        ``centralized_comparator_adapter`` (comlrl 1.4.3's keyword) is the collaboration adapter of the comparator
        with ``comparator_generation_mode='centralized'`` (None: the tagged format)."""
        self.args = args if args is not None else self.config_class()
        if not isinstance(self.args, self.config_class):
            raise ValueError(f"args must be a {self.config_class.__name__}, got {type(self.args).__name__}")
        self.policy_trainer = MADPOTrainer(agent_model=agent_model, args=self.args, **inputs)
        policy = self.policy_trainer  # loads the agents; refuses FSDP launches (MADPOTrainer.fsdp_refusal)
        self.task_reward = policy.reward
        self.comparator = build_comparator(self.args, policy, centralized_comparator_adapter)
        self.collection = PreferenceCollection(self.args, self.args, policy.data_parallel, self.comparator,
                                               self.args.num_generations, self.args.preference_replay_mode)
        self.state = PbRLState(history=policy.history)  # one list: the steps are the policy's
        self.output_path = None
        self.window = MetricWindow()
        self.reference: torch.Tensor | None = None  # [agents, chosen/rejected, pairs] of the prepared pairs

    @classmethod
    def iterations_of(cls, args: Any) -> int:
        return args.num_iterations

    pairs_by_iteration = property(lambda self: self.collection.pairs_by_iteration)

    @property
    def preference_pairs(self) -> Any:
        """Every pair collected so far (all iterations)."""
        return preferences.pool(self.pairs_by_iteration)

    # ----- the stages ---------------------------------------------------------------------------
    def collect_preferences(self) -> dict[str, float]:
        """Stage 1: candidates of the policy and the comparator, paired by the task reward: this iteration's shard."""
        return self.collection.collect(self.policy_trainer, self.task_reward, self.state.iteration,
                                       self._iteration_output())

    def prepare_pairs(self) -> dict[str, float]:
        """Stage 2: the replayed pairs this iteration trains on, and their reference log-probabilities."""
        pairs = self.collection.training_pairs(self.state.iteration)
        metrics = {"replay/pairs": float(len(pairs)),
                   "replay/iterations": float(len(set(pairs["iteration"])) if len(pairs) else 0)}
        if self.args.log_reward_distribution and len(pairs):
            metrics.update(distribution_metrics("train_chosen", list(pairs["chosen_reward"])))
            metrics.update(distribution_metrics("train_rejected", list(pairs["rejected_reward"])))
        self.reference = None
        if len(pairs) and self.policy_trainer.references is not None:
            parts: list[list[torch.Tensor]] = [[] for _ in range(self.num_agents)]
            for start in range(0, len(pairs), self.args.dpo_batch_size):
                batch = pairs.select(range(start, min(start + self.args.dpo_batch_size, len(pairs))))
                for agent, (chosen, rejected) in enumerate(
                        self.policy_trainer.reference_logprobs(self.pair_generations(batch))):
                    parts[agent].append(torch.stack([chosen.float().cpu(), rejected.float().cpu()]))
            self.reference = torch.stack([torch.cat(agent_parts, dim=1) for agent_parts in parts])
            metrics["reference/chosen_logprob_mean"] = float(self.reference[:, 0].mean())
            metrics["reference/rejected_logprob_mean"] = float(self.reference[:, 1].mean())
        return metrics

    def learn_policy(self) -> dict[str, float]:
        """Stage 3: DPO passes over the prepared pairs, micro-batch by micro-batch (resumes mid-stage)."""
        policy = self.policy_trainer
        pairs = self.collection.training_pairs(self.state.iteration)  # the same selection as stage 2 (seeded)
        if self.reference is not None and self.reference.shape[-1] != len(pairs):
            raise RuntimeError(f"iteration {self.state.iteration}: {self.reference.shape[-1]} prepared reference "
                               f"log-probabilities for {len(pairs)} pairs")
        if len(pairs) == 0:
            logger.warning("iteration %d: no preference pairs to train on (every candidate tied); the policy is "
                           "unchanged", self.state.iteration)
            return {"policy/steps": 0.0}
        batches = replay.pair_batches(len(pairs), self.args.dpo_batch_size, self.args.num_train_epochs,
                                      self.args.seed, self.state.iteration)
        per_epoch = -(-len(pairs) // self.args.dpo_batch_size)
        policy.tag_steps(iteration=self.state.iteration)
        while self.state.stage_step < len(batches):
            step = self.state.stage_step
            mine = self.data_parallel.shard(batches[step])
            references = None
            if self.reference is not None:
                references = [(self.reference[a, 0, mine].to(device), self.reference[a, 1, mine].to(device))
                              for a, device in enumerate(policy.agent_devices)]
            generations = self.pair_generations(pairs.select(mine))
            self.state.stage_step += 1  # counted with the step: a stop after it resumes at the next one
            # An epoch of DPO ends: no gradient left pending. History, callbacks, evaluation, stop requests.
            policy.preference_step(generations, references, self.window, end_of_pass=(step + 1) % per_epoch == 0)
            self.state.global_step = policy.state.global_step
        policy.log_window(self.window)  # the stage's last window, partial or not, ends with it
        self.reference = None
        # This iteration's steps, those before a mid-stage resume included.
        steps = [row for row in self.state.history if row.get("iteration") == self.state.iteration]
        losses = [row["dpo/loss"] for row in steps if isinstance(row.get("dpo/loss"), float) and row["dpo/loss"] == row["dpo/loss"]]
        return {"policy/steps": float(len(steps)),
                "policy/dpo_loss_mean": sum(losses) / len(losses) if losses else float("nan")}

    def pair_generations(self, batch: Any) -> list[Any]:
        """Each agent's side of a batch of stored pairs (chosen rows, then rejected), on its device."""
        policy = self.policy_trainer
        generations = []
        for agent, (model, tokenizer) in enumerate(zip(policy.agents, policy.tokenizers)):
            limit = prompt_token_limit(model, self.args.max_new_tokens, self.args.max_prompt_length)
            generations.append(preferences.pair_generation(
                tokenizer, [prompts[agent] for prompts in batch["agent_prompts"]],
                [ids[agent] for ids in batch["chosen_ids"]], [ids[agent] for ids in batch["rejected_ids"]],
                policy.agent_devices[agent], limit, self.args.prompt_overflow))
        return generations

    # ----- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Progress, every shard (and the comparator's snapshot paths), the prepared reference log-probabilities,
        the policy trainer's state, the RNGs."""
        policy = self.policy_trainer.state_dict(include_rng=False)
        policy["progress"]["history"] = []  # one home: this run's history (the same list)
        return {"progress": asdict(self.state), "collection": self.collection.state_dict(), "policy": policy,
                "reference": self.reference, "rng": capture_rng_state()}

    def load_state_dict(self, state: dict[str, Any], where: str = "the checkpoint") -> None:
        self.collection.load_state_dict(state["collection"])
        policy = state["policy"]
        policy["progress"]["history"] = state["progress"]["history"]  # the steps are the policy's
        self.policy_trainer.load_state_dict(policy, where)
        self.state = PbRLState(**{**state["progress"], "history": self.policy_trainer.history})
        self.reference = state["reference"]
        restore_rng_state(state["rng"])

    def compat_settings(self) -> dict[str, Any]:
        return {**self.policy_trainer.compat_settings(),
                "comparator": self.comparator.kind if self.comparator is not None else "current"}

    # ----- evaluation ---------------------------------------------------------------------------
    def evaluate(self, dataset: Any = None, num_samples: int | None = None, *,
                 num_eval_samples: int | None = None) -> dict[str, float]:
        """The policy's evaluation with the task reward (see MultiAgentTrainer.evaluate)."""
        return self.policy_trainer.evaluate(dataset, num_samples, num_eval_samples=num_eval_samples)
