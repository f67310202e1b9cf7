"""MARLHFConfig: preference collection, joint reward-model fitting, and the policy stage."""

from __future__ import annotations

from dataclasses import dataclass

from comlrl.config import option
from comlrl.trainers.reinforce.config import MAGRPOConfig

RL_ALGORITHMS = ("magrpo", "maac", "iac")


@dataclass
class MARLHFConfig(MAGRPOConfig):
    """PbRL: collect preference pairs, fit a joint reward model, learn the policy on it.

    The MAGRPO fields configure sampling and the policy stage; ``policy_overrides`` passes
    further fields to the policy trainer's config (e.g. ``critic_learning_rate`` for MAAC).
    """

    rl_algorithm: str = option("magrpo", "Policy-stage algorithm: 'magrpo', 'maac' or 'iac'.", choices=RL_ALGORITHMS)
    policy_overrides: dict = option({}, "Extra fields for the policy trainer's config (MAACConfig/IACConfig/MAGRPOConfig).",
                                    kind=dict)
    critic_model_name: str | None = option(None, "Critic backbone for rl_algorithm 'maac'/'iac' (default: first actor).",
                                           kind=str, optional=True)
    reward_model_name: str | None = option(None, "Reward-model backbone: identifier or local directory (default: first actor).",
                                           kind=str, optional=True)
    reward_model_device: str | None = option("cuda:0", "Device of the reward model; None = the trainer's device.",
                                             kind=str, optional=True)
    reward_model_device_fallback: bool = option(
        False, "If reward_model_device is missing (e.g. no CUDA), use the trainer's device with a warning instead of failing.")
    reward_freeze_backbone: bool = option(False, "Train only the reward model's scalar head.")
    reward_learning_rate: float = option(1e-4, "AdamW learning rate of the reward model.", min=0.0, min_exclusive=True)
    reward_train_epochs: int = option(3, "Epochs over the preference pairs per reward fit.", min=1)
    reward_batch_size: int = option(8, "Preference pairs per reward-model step.", min=1)
    reward_max_length: int | None = option(None, "Truncate reward-model inputs to N tokens (None = no truncation).",
                                           min=1, kind=int, optional=True)
    reward_early_stopping_patience: int | None = option(
        2, "Judge the reward-model fit on held-out accuracy after every epoch: stop after N epochs without improvement "
        "and keep the best epoch's weights (None = train every epoch, keep the last).", min=1, kind=int, optional=True)
    reward_heldout_fraction: float = option(0.2, "Share of pairs held out to measure preference accuracy.", min=0.0, max=0.9)
    num_preference_prompts: int | None = option(
        None, "Prompts sampled for preference collection per iteration (None = every train row).", min=1, kind=int, optional=True)
    preference_num_generations: int | None = option(
        None, "Joint samples per prompt during collection (None = num_generations).", min=2, kind=int, optional=True)
    preference_tie_margin: float = option(0.0, "Pairs whose task rewards differ by no more than this are dropped.", min=0.0)
    max_pairs_per_prompt: int | None = option(None, "Keep at most N pairs per prompt, widest reward margin first.",
                                              min=1, kind=int, optional=True)
    policy_guard: bool = option(
        True, "Score the task reward on the eval rows (else the first train rows) before and after each policy stage; "
        "if the stage lowered it by more than policy_guard_tolerance, restore the trainable weights and optimizer "
        "moments from before the stage.")
    policy_guard_tolerance: float = option(0.0, "How far the guard lets the task reward fall in a policy stage.", min=0.0)
    output_dir: str | None = option(None, "Where pairs, reward models and history are written (None = in memory only).",
                                    kind=str, optional=True)
    num_iterations: int = option(1, "MARLHFIterTrainer: rounds of collect -> fit -> policy (counts the whole run).", min=1)
    pool_preference_pairs: bool = option(False, "MARLHFIterTrainer: fit on the pairs of every iteration so far, not just the latest.")
