"""MADPOConfig and MADPOIterConfig: multi-agent direct preference optimisation, online and iterative."""

from __future__ import annotations

from dataclasses import dataclass

from comlrl.config import not_supported_yet, option
from comlrl.rollout.preferences import PAIR_SELECTIONS
from comlrl.trainers.config import RolloutConfig
from comlrl.trainers.preference.iterative_config import IterativeOptions, iterative_problems, normalise_values

DPO_REFERENCES = ("initial", "none")


@dataclass
class MADPOConfig(RolloutConfig):
    """MADPO: per prompt, sample joint candidates, pair them by task reward, train every agent with the joint
    DPO loss (docs/algorithms.md, "MADPO")."""

    num_generations: int = option(
        8, "Joint candidates sampled per prompt (one batched generate per agent for all of them).", min=2,
        aliases=("preference_num_candidates",))
    max_pairs_per_prompt: int | None = option(
        4, "Keep at most N pairs per prompt, chosen by pair_selection (None = every pair).", min=1, kind=int,
        optional=True, aliases=("preference_pairs_per_sample",))
    pair_selection: str = option(
        "reward_gap", "Which pairs of a prompt are kept: 'reward_gap' (widest reward margin first), 'random' (a "
        "seeded uniform draw), 'all' (every pair; needs max_pairs_per_prompt=None) or 'comparator_reward' (pairs "
        "whose comparator-side candidate scored highest first; without a comparator, the rejected candidate).",
        choices=PAIR_SELECTIONS)
    preference_tie_margin: float = option(0.0, "Pairs whose task rewards differ by no more than this are dropped.",
                                          min=0.0)
    dpo_beta: float = option(0.1, "DPO inverse temperature beta: the loss is -log sigmoid(beta * joint log-ratio "
                             "difference).", min=0.0, min_exclusive=True)
    dpo_reference: str = option(
        "initial", "The DPO ratio's reference: 'initial' (a frozen copy of each agent's initial weights, or with "
        "LoRA the base model with adapters off, or reference_model if given, placed on reference_devices: standard "
        "DPO, which anchors the policy to where it started) or 'none' (raw log-probability differences, as the "
        "original comlrl; no reference in memory).", choices=DPO_REFERENCES)

    # Fields of the original comlrl 1.4.3's MADPOConfig, accepted so its configs construct (docs/migrating.md).
    joint_mode: str = not_supported_yet("aligned", "Joint candidates are aligned (candidate k of every agent forms "
                                        "joint candidate k); 'cross' is not supported.", choices=("aligned", "cross"))
    normalize_advantages: bool = not_supported_yet(
        True, "Original comlrl's field inherited from MAGRPO; DPO has no advantages, only the default is accepted.",
        aliases=("advantage_normalization",))
    advantage_mode: str = not_supported_yet("mean", "Original comlrl's field inherited from MAGRPO; DPO has no "
                                            "advantages, only the default is accepted.")
    collaboration_mode: str = not_supported_yet(
        "decentralized", "Original comlrl's collaboration mode; centralized MADPO is not supported.",
        choices=("decentralized", "centralized"), says="collaboration_mode must be decentralized or centralized")
    use_environment_step: bool = not_supported_yet(True, "Original comlrl's step counting for logging; steps here "
                                                   "are optimizer steps.")
    environment_steps_per_pair: int = not_supported_yet(2, "Original comlrl's step counting for logging; only the "
                                                        "default.", min=1)

    def _adopt_original_batching(self) -> None:
        """Not here: 1.4.3's MADPO ``rollout_buffer_size`` is its preference pairs per optimizer step, not a
        count of prompts, so it is accepted only where it equals the samples of one update (as before)."""

    def validate(self) -> list[str]:
        problems = super().validate()
        name = type(self).__name__
        if self.num_turns != 1:
            problems.append(f"MADPO currently supports num_turns=1 only: {name}.num_turns must be 1 (preference "
                            f"pairs compare single-turn joint responses), got {self.num_turns}")
        if self.reference_kl_enabled:
            problems.append(f"{name}.reference_kl_enabled: DPO's own reference term is its KL control (dpo_beta, "
                            "dpo_reference, reference_model); a second KL penalty is not supported")
        if self.dpo_reference == "none" and (self.reference_model is not None or self.reference_devices is not None):
            problems.append(f"{name}.reference_model/reference_devices need dpo_reference='initial', got 'none'")
        if self.pair_selection == "all" and self.max_pairs_per_prompt is not None:
            problems.append(f"preference_pairs_per_sample must be null when pair_selection='all': "
                            f"{name}.pair_selection='all' keeps every pair: set max_pairs_per_prompt=None, got "
                            f"{self.max_pairs_per_prompt}")
        return problems


@dataclass
class MADPOIterConfig(MADPOConfig, IterativeOptions):
    """Iterative MADPO: ``num_iterations`` rounds of (collect pairs against the comparator -> DPO on a replay
    of the pair shards); see docs/algorithms.md, "Iterative preference training"."""

    num_iterations: int = option(6, "Rounds of collect -> DPO (counts the whole run when resuming).", min=1)
    pair_selection: str = option(
        "comparator_reward", "Which pairs of a prompt are kept (see MADPOConfig.pair_selection); by default those whose "
        "comparator-side candidate scored highest first (comlrl 1.4.3's MADPOIterConfig default).",
        choices=PAIR_SELECTIONS)
    num_train_epochs: int = option(1, "DPO passes over each iteration's training pairs.", min=1)
    dpo_batch_size: int = option(8, "Pairs per DPO micro-batch (the original's train_batch_size).", min=1)
    num_preference_prompts: int | None = option(
        None, "Train rows sampled (seeded per iteration) for collection (None = every train row).", min=1, kind=int,
        optional=True)
    output_dir: str | None = option(
        None, "Where each iteration's pairs (iteration_i/pairs.parquet), reward distribution, history.jsonl and "
        "the history comparator's policy snapshots go (None = in memory and checkpoints only).", kind=str,
        optional=True)

    def __post_init__(self) -> None:
        normalise_values(self)
        super().__post_init__()

    def _samples_per_update(self) -> int | None:
        return self.dpo_batch_size * self.gradient_accumulation_steps  # pairs per optimizer step

    def validate(self) -> list[str]:
        problems = super().validate() + iterative_problems(self)
        if self.lr_scheduler_type not in ("constant", "constant_with_warmup"):
            problems.append(
                f"{type(self).__name__}.lr_scheduler_type={self.lr_scheduler_type!r}: how many DPO steps a run takes "
                "depends on how many pairs each iteration yields, so a decaying schedule has no length to plan "
                "over; use 'constant' or 'constant_with_warmup'")
        return problems
