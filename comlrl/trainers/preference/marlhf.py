"""MARLHFTrainer and MARLHFIterTrainer: preference-based multi-agent RL with a learned joint reward.

A preference run is a composition of two parts, each with its own state:

- the **policy trainer** (MAGRPO, MAAC or IAC), built from the user's arguments as it would be on
  its own: it loads the agents (placement, LoRA, data parallelism), owns their optimizers and
  schedules, and trains on the learned reward;
- the **preference stage** (:class:`~comlrl.trainers.preference.stage.PreferenceStage`): it
  collects pairs with the policy's agents, labelled by the task reward, and fits the joint
  reward model on them.

Each iteration runs three stages, each a checkpoint boundary:

1. ``collect_preferences`` — the agents sample joint responses; the task reward from
   ``reward_func`` labels pairs (higher task reward = chosen; ties dropped).
2. ``fit_reward_model`` — a joint reward model is loaded fresh from ``reward_model_name`` and
   fitted with the Bradley-Terry loss on the pairs.
3. ``learn_policy`` — ``num_train_epochs`` epochs of the policy trainer with the fitted reward
   model, kept fixed, as its reward; the task reward is reported next to it
   (``monitor/task_reward``) so reward hacking is visible.

``MARLHFTrainer`` runs one iteration; ``MARLHFIterTrainer`` runs ``num_iterations``, and its
policy's learning-rate schedules are planned over all of them.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from datasets import Dataset

from comlrl.parallel import distributed, sharding

from comlrl.models import entities

from comlrl.rollout import preferences
from comlrl.parallel.device import resolve_device
from comlrl.training.metrics import MetricWindow
from comlrl.models.entities import load_tokenizer
from comlrl.models.reward_model import JointRewardModel, check_joint_budget, learned_reward, resolve_reward_device
from comlrl.rollout.rewards import JointReward
from comlrl.seeding import capture_rng_state, restore_rng_state
from comlrl.trainers.base import check_reward_func, resolve_num_samples
from comlrl.trainers.inputs import TrainerInputs, Unpack
from comlrl.trainers.preference.comparators import build_comparator
from comlrl.trainers.preference.config import MARLHFConfig
from comlrl.trainers.preference.guard import PolicySnapshot, guard_rows, pairwise_agreement, revert_warning
from comlrl.trainers.preference.policy import critic_arguments, policy_classes, policy_config
from comlrl.trainers.preference.iterative_config import options_of
from comlrl.trainers.preference.reward_histogram import RewardHistogramNames
from comlrl.trainers.preference.rounds import PbRLState, PreferenceRounds
from comlrl.trainers.preference.stage import PreferenceStage

logger = logging.getLogger(__name__)

STAGES = ("collect_preferences", "fit_reward_model", "learn_policy")


class MARLHFTrainer(PreferenceRounds):
    config_class = MARLHFConfig
    args: MARLHFConfig
    STAGES = STAGES
    fsdp_refusal = ("the joint reward model is not sharded yet; launch with infra/accelerate/multi_gpu.yaml (DDP) "
                    "instead")

    def __init__(self, agent_model: Any = None, *, args: MARLHFConfig | None = None, critic_model: Any = None,
                 critics: Sequence[Any] | None = None, centralized_comparator_adapter: Any = None,
                 **inputs: Unpack[TrainerInputs]) -> None:
        """``inputs`` are the policy trainer's (:class:`~comlrl.trainers.inputs.TrainerInputs`: agents,
        tokenizer, reward_func, datasets, callbacks, ...); the critics are for ``rl_algorithm`` 'maac'/'iac';
        ``centralized_comparator_adapter`` is the centralized comparator's adapter (see MADPOIterTrainer)."""
        self.args = args if args is not None else self.config_class()
        if not isinstance(self.args, self.config_class):
            raise ValueError(f"args must be a {self.config_class.__name__}, got {type(self.args).__name__}")
        if distributed.check_launch() is not None:
            sharding.check_shardable(type(self).__name__, self.fsdp_refusal, self.args.lora_rank, [])
        count = entities.resolve_num_agents(inputs.get("num_agents"), self.args.num_agents, self.config_class.__name__)
        agent_model = entities.agent_model_argument(agent_model, inputs.pop("model", None))
        entities.require_sources(agent_model, inputs.get("agents"))  # the original's first checks, in its order
        check_reward_func(inputs.get("reward_func"), type(self).__name__)
        first_actor = entities.model_name(entities.resolve_model_list(agent_model, inputs.get("agents"), count)[0])
        self.reward_model_source = self._reward_model_source(first_actor)
        self._check_reward_device()
        trainer_class, config_class = policy_classes(self.args.rl_algorithm)
        config = policy_config(self.args, config_class)
        self.policy_trainer = trainer_class(agent_model=agent_model, args=config, **inputs,
                                            **critic_arguments(self.args, config, critic_model, critics, first_actor))
        policy = self.policy_trainer
        policy.replan_schedules(self.num_iterations)  # the policy learns in every iteration
        # The policy trains on the learned reward (the task reward rides along as a monitor); the user's
        # reward, weights and processor applied, labels the pairs and judges the policy.
        self.task_reward: JointReward = policy.use_reward(JointReward(
            self._learned_reward, monitors={"task_reward": self._task_reward_values}, num_agents=policy.num_agents))
        policy.use_evaluator(self.evaluate)  # periodic evaluations report the task reward too
        self.reward_device = resolve_reward_device(
            self.args.reward_model_device, policy.device, self.args.reward_model_device_fallback
        )
        options = options_of(self.args)  # MARLHFIterConfig's comparator and replay options, else their defaults
        self.comparator = build_comparator(options, policy, centralized_comparator_adapter)
        # A reward_max_length that cannot hold the agents' tags and some content fails now, not at the first fit.
        check_joint_budget(load_tokenizer(self.reward_model_source, self.args.trust_remote_code), policy.num_agents,
                           self.args.reward_max_length)
        self.preference = PreferenceStage(self.args, options, self.reward_model_source, self.reward_device,
                                          policy.dtype, policy.data_parallel, self.comparator, policy.num_agents)
        self.state = PbRLState(history=policy.history)  # one list: the steps are the policy's
        self.output_path: Path | None = Path(self.args.output_dir) if self.args.output_dir else None
        self.guard: PolicySnapshot | None = None  # set while a guarded policy stage is in progress

    # ----- construction -----------------------------------------------------------------------
    def watch_stop(self, request: Any, progress: Any = None) -> None:
        super().watch_stop(request, progress)
        self.task_reward.watch_stop(request)  # the user's reward labels pairs and judges the policy

    def _reward_model_source(self, first_actor: str | None) -> str:
        source = self.args.reward_model_name or first_actor
        if not source:
            raise ValueError(
                "MARLHFConfig.reward_model_name is required when the actors are model objects without a model "
                "identifier (agents[0] has no name_or_path); set it to a hub identifier or local directory"
            )
        return source

    def _check_reward_device(self) -> None:
        """A missing reward-model device fails before any model loads (unless the fallback is on)."""
        requested = self.args.reward_model_device
        if requested is None or self.args.reward_model_device_fallback:
            return
        try:
            resolve_device(requested)
        except ValueError as error:
            raise ValueError(
                f"reward_model_device={requested!r} is not available ({error}); set reward_model_device=None "
                "(the trainer's device) or 'cpu', or reward_model_device_fallback=True to fall back to the "
                "trainer's device with a warning"
            ) from None

    reward_model = property(lambda self: self.preference.reward_model)
    pairs_by_iteration = property(lambda self: self.preference.pairs_by_iteration)

    @property
    def preference_pairs(self) -> Dataset:
        """Every pair collected so far (all iterations)."""
        return preferences.pool(self.pairs_by_iteration)

    def _learned_reward(self, *completions: Sequence[str], batch_items: Sequence[dict[str, Any]]) -> list[float]:
        if self.reward_model is None:
            raise RuntimeError("the policy stage ran before a reward model was fitted")
        return learned_reward(self.reward_model)(*completions, batch_items=batch_items)

    def _task_reward_values(self, *completions: Sequence[str], batch_items: Sequence[dict[str, Any]]) -> list[float]:
        return self.task_reward(list(completions), list(batch_items)).tolist()

    # ----- the stages ---------------------------------------------------------------------------
    def collect_preferences(self) -> dict[str, float]:
        """Stage 1: sample joint responses, label pairs with the task reward, keep them for this iteration."""
        return self.preference.collect(self.policy_trainer, self.task_reward, self.state.iteration,
                                       self._iteration_output())

    def fit_reward_model(self) -> dict[str, float]:
        """Stage 2: a fresh joint reward model fitted on this iteration's pairs."""
        return self.preference.fit(self.state.iteration, self._iteration_output())

    def learn_policy(self) -> dict[str, float]:
        """Stage 3: the policy trainer's epochs of this iteration on the learned reward (resumes mid-stage),
        under the policy guard (comlrl/trainers/preference/guard.py)."""
        policy = self.policy_trainer
        if self.args.policy_guard and self.guard is None:
            self.guard = PolicySnapshot.take(policy, self.guard_scores()["task_reward"])
        policy.tag_steps(iteration=self.state.iteration, **self.reward_model_quality())
        # The window as the policy's progress leaves it: a stage resumed mid-epoch logs as one never stopped.
        policy.train_steps(until_epoch=(self.state.iteration + 1) * self.args.num_train_epochs,
                           window=policy.logging_window())
        self.state.global_step = policy.state.global_step
        summary = MetricWindow()
        for step in policy.history:
            if step.get("iteration") == self.state.iteration:
                summary.add({k: v for k, v in step.items() if k in ("reward_mean", "monitor/task_reward")})
        means = summary.flush()
        metrics = {
            "policy/learned_reward_mean": means.get("reward_mean", float("nan")),
            "policy/task_reward_mean": means.get("monitor/task_reward", float("nan")),
            # This iteration's steps, those before a mid-stage resume included.
            "policy/steps": float(sum(step.get("iteration") == self.state.iteration for step in policy.history)),
        }
        if self.guard is not None:
            metrics.update(self.apply_guard())
        return metrics

    def guard_scores(self) -> dict[str, float]:
        """The policy's mean task reward on the guard's training rows and, once a reward model exists, how
        often the learned reward orders two of the same prompt's samples as the task reward does (fixed
        seed, forked RNG: training is unaffected)."""
        policy = self.policy_trainer
        rows = guard_rows(policy.train_dataset, self.args.policy_guard_rows, self.args.seed)
        dataset = policy.train_dataset.select(rows)
        rewards = [self.task_reward] + ([JointReward(self._learned_reward)] if self.reward_model is not None else [])
        scored = policy.sample_rewards(dataset, rewards)
        scores = {"task_reward": float(scored[0].nanmean())}
        if len(scored) > 1:
            scores["reward_model_agreement"] = pairwise_agreement(scored[1], scored[0])
        return scores

    def apply_guard(self) -> dict[str, float]:
        """Keep the stage if the task reward did not fall beyond the tolerance; else restore the snapshot."""
        before, after = self.guard.task_reward, self.guard_scores()
        reverted = after["task_reward"] < before - self.args.policy_guard_tolerance
        agreement = after.get("reward_model_agreement", float("nan"))
        if reverted:
            logger.warning(revert_warning(self.state.iteration, before, after["task_reward"], agreement))
            self.guard.restore(self.policy_trainer)
        self.guard = None
        return {"policy/guard_task_reward_before": before, "policy/guard_task_reward_after": after["task_reward"],
                "policy/guard_reverted": float(reverted), "policy/reward_model_agreement": agreement}

    def reward_model_quality(self) -> dict[str, float]:
        """The fitted reward model's held-out accuracy, carried by every policy step it rewards."""
        fits = [r for r in self.state.stage_records
                if r["stage"] == "fit_reward_model" and r["iteration"] == self.state.iteration]
        accuracy = fits[-1].get("reward_model/heldout_accuracy") if fits else None
        return {"reward_model/heldout_accuracy": accuracy} if accuracy is not None else {}

    # ----- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Progress, the preference stage's pairs and reward model, the policy trainer's state, the RNGs."""
        policy = self.policy_trainer.state_dict(include_rng=False)
        policy["progress"]["history"] = []  # one home: this run's history (the same list)
        return {
            "progress": asdict(self.state),
            "preference": self.preference.state_dict(),
            "policy": policy,
            "task_reward": self.task_reward.state_dict(),
            "guard": self.guard.state_dict() if self.guard is not None else None,
            "rng": capture_rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any], where: str = "the checkpoint") -> None:
        self.preference.load_state_dict(state["preference"])
        policy = state["policy"]
        policy["progress"]["history"] = state["progress"]["history"]  # the steps are the policy's
        self.policy_trainer.load_state_dict(policy, where)
        self.state = PbRLState(**{**state["progress"], "history": self.policy_trainer.history})
        self.task_reward.load_state_dict(state["task_reward"])
        self.guard = PolicySnapshot.from_state_dict(state["guard"])
        restore_rng_state(state["rng"])  # last: loading the reward model draws a head

    def compat_settings(self) -> dict[str, Any]:
        return {**self.policy_trainer.compat_settings(), "rl_algorithm": self.args.rl_algorithm,
                "reward_model_source": self.reward_model_source,
                "comparator": self.comparator.kind if self.comparator is not None else "current"}

    # ----- evaluation and export ----------------------------------------------------------------
    def evaluate(self, dataset: Any = None, num_samples: int | None = None, *,
                 num_eval_samples: int | None = None) -> dict[str, float]:
        """The policy trainer's evaluation scored by the task reward (the learned reward is for
        training), plus the learned reward's mean once a reward model exists."""
        policy = self.policy_trainer
        num_samples = resolve_num_samples(num_samples, num_eval_samples)  # 1.4.3's name, one check
        metrics = policy.evaluate(dataset, num_samples, reward=self.task_reward)
        metrics = {name.replace("eval/reward_mean", "eval/task_reward_mean"): value for name, value in metrics.items()}
        if self.reward_model is not None:
            learned = policy.evaluate(dataset, num_samples, reward=JointReward(self._learned_reward))
            metrics["eval/learned_reward_mean"] = learned["eval/reward_mean"]
        return metrics


class MARLHFIterTrainer(RewardHistogramNames, MARLHFTrainer):
    """``num_iterations`` rounds of collect -> fit -> policy; the reward model is reloaded from
    its source at the start of every fit. Each iteration's pairs are kept apart as its shard; with a
    MARLHFIterConfig the policy is compared against ``comparator_policy`` and the fit replays the
    shards per ``preference_replay_mode`` (``pool_preference_pairs=True``: all of them)."""

    @classmethod
    def iterations_of(cls, args: Any) -> int:
        return args.num_iterations


# JointRewardModel is importable from here, where comlrl 1.4.3 kept it.
__all__ = ["JointRewardModel", "MARLHFIterTrainer", "MARLHFTrainer"]
