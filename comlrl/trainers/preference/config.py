"""MARLHFConfig: preference collection, joint reward-model fitting, and the policy stage."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from comlrl.config import not_supported_yet, option
from comlrl.rollout.preferences import PAIR_SELECTIONS
from comlrl.trainers.preference.iterative_config import IterativeOptions, iterative_problems, normalise_values
from comlrl.trainers.reinforce.config import MAGRPOConfig

RL_ALGORITHMS = ("magrpo", "maac", "iac")


@dataclass
class MARLHFConfig(MAGRPOConfig):
    """PbRL: collect preference pairs, fit a joint reward model, learn the policy on it.

    The MAGRPO fields configure sampling and the policy stage; ``policy_overrides`` passes
    further fields to the policy trainer's config (e.g. ``critic_learning_rate`` for MAAC).
    """

    rl_algorithm: str = option(
        "magrpo", "Policy-stage algorithm: 'magrpo', 'maac' or 'iac'.", choices=RL_ALGORITHMS,
        says="rl_algorithm must be one of: magrpo, mareinforce, maremax, marloo, maac, iac in comlrl 1.4.3, "
             "here one of magrpo, maac, iac")
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
    reward_learning_rate: float = option(1e-5, "AdamW learning rate of the reward model.", min=0.0, min_exclusive=True)
    reward_train_epochs: int = option(3, "Epochs over the preference pairs per reward fit.", min=1,
                                      aliases=("reward_num_train_epochs",))
    reward_batch_size: int = option(8, "Preference pairs per reward-model step.", min=1,
                                    aliases=("reward_train_batch_size",))
    reward_max_length: int | None = option(None, "Truncate reward-model inputs to N tokens (None = no truncation).",
                                           min=1, kind=int, optional=True)
    reward_early_stopping_patience: int | None = option(
        2, "Judge the reward-model fit on held-out accuracy after every epoch: stop after N epochs without improvement "
        "and keep the best epoch's weights (None = train every epoch, keep the last).", min=1, kind=int, optional=True)
    reward_heldout_fraction: float = option(0.2, "Share of pairs held out to measure preference accuracy.", min=0.0, max=0.9)
    num_preference_prompts: int | None = option(
        None, "Prompts sampled for preference collection per iteration (None = every train row).", min=1, kind=int, optional=True)
    preference_num_generations: int | None = option(
        None, "Joint samples per prompt during collection (None = num_generations).", min=2, kind=int, optional=True,
        aliases=("preference_num_candidates",))
    preference_tie_margin: float = option(0.0, "Pairs whose task rewards differ by no more than this are dropped.", min=0.0)
    max_pairs_per_prompt: int | None = option(None, "Keep at most N pairs per prompt, widest reward margin first.",
                                              min=1, kind=int, optional=True, aliases=("preference_pairs_per_sample",))
    policy_guard: bool = option(
        True, "Score the task reward on policy_guard_rows training rows before and after each policy stage; if the "
        "stage lowered it by more than policy_guard_tolerance, restore the trainable weights and optimizer moments "
        "from before the stage (logged as policy/guard_reverted, with a warning). The eval set is never used, so "
        "the eval reward stays held out.")
    policy_guard_rows: int = option(8, "Training rows the policy guard scores (a fixed seeded draw; all rows when the "
                                    "set is smaller).", min=1)
    policy_guard_tolerance: float = option(0.0, "How far the guard lets the task reward fall in a policy stage.", min=0.0)
    output_dir: str | None = option(None, "Where pairs, reward models and history are written (None = in memory only).",
                                    kind=str, optional=True)
    num_iterations: int = option(1, "MARLHFIterTrainer: rounds of collect -> fit -> policy (counts the whole run).", min=1)
    pool_preference_pairs: bool = option(False, "MARLHFIterTrainer: fit on the pairs of every iteration so far, not just the latest.")

    # Fields of the original comlrl 1.4.3, accepted so its configs construct (docs/migrating.md).
    pair_selection: str = option(
        "reward_gap", "Which pairs of a prompt are kept: 'reward_gap' (widest margin first, at most "
        "max_pairs_per_prompt), 'random' (a seeded uniform draw), 'all' (needs max_pairs_per_prompt=None) or "
        "'comparator_reward' (pairs whose comparator-side candidate scored highest first; without a comparator, "
        "the rejected candidate).", choices=PAIR_SELECTIONS)
    collaboration_mode: str = not_supported_yet(
        "decentralized", "Original comlrl's collaboration mode; 'centralized' (one actor for all) is not supported yet.",
        choices=("decentralized", "centralized"))
    dpo_beta: float = not_supported_yet(0.1, "Original comlrl's MADPO loss temperature (not used by MARLHF); only "
                                        "the original's default is accepted.", min=0.0, min_exclusive=True)
    use_environment_step: bool = not_supported_yet(True, "Original comlrl's MADPO step counting; only the default.")
    environment_steps_per_pair: int = not_supported_yet(2, "Original comlrl's MADPO step counting; only the default.",
                                                        min=1)
    # Critic fields of the policy stage (rl_algorithm 'maac'/'iac'): copied into MAACConfig/IACConfig by name;
    # defaults are those configs' defaults, so leaving them unset changes nothing.
    critic_type: str = option("v", "Policy-stage critic target, 'v' or 'q' (see ActorCriticConfig).", choices=("v", "q"),
                              says="critic_type must be one of: v, q")
    critic_learning_rate: float | None = option(
        None, "Policy-stage critic learning rate (None = agent_learning_rate, as in the original comlrl).", min=0.0,
        min_exclusive=True, kind=(int, float), optional=True)
    critic_device: str | list | None = option(
        None, "Placement of the policy stage's critics (see ActorCriticConfig.critic_device).", kind=(str, list),
        optional=True, aliases=("critic_devices",))
    use_separate_critic: bool = option(True, "IAC policy stage: separate critic models (see IACConfig).")
    value_loss_coef: float = option(0.6, "Policy-stage weight of the critic loss (see ActorCriticConfig).", min=0.0,
                                    min_exclusive=True)
    value_clip_range: float | None = option(
        0.2, "Policy-stage value clipping (see ActorCriticConfig; None = off).", min=0.0, min_exclusive=True,
        kind=(int, float), optional=True)
    critic_value_head_hidden_dim: int | None = option(
        None, "IAC policy stage: separate critics' value-head width (see IACConfig).", min=1, kind=int, optional=True)
    value_head_hidden_dim: int | None = option(
        None, "IAC policy stage: shared value-head width (see IACConfig).", min=1, kind=int, optional=True)

    def __post_init__(self) -> None:
        if self.critic_learning_rate is None:
            self.critic_learning_rate = self.agent_learning_rate
        super().__post_init__()

    def _group_size_reason(self) -> str:
        return f"for MAGRPO-family MARLHF backends (the policy stage's {self.advantage_mode!r} group baseline)"

    def _samples_per_prompt(self) -> int:
        """As the policy stage's config counts them: one group for MAGRPO; for MAAC/IAC each of the policy
        stage's completions of a prompt (``policy_overrides`` may change ``num_generations``), so a
        ``rollout_buffer_size`` given alone maps to buffer / num_generations prompts as it does for IACConfig."""
        if self.rl_algorithm == "magrpo":
            return super()._samples_per_prompt()
        overrides = self.policy_overrides if isinstance(self.policy_overrides, dict) else {}
        generations = overrides.get("num_generations")
        return generations if isinstance(generations, int) and generations >= 1 else self.num_generations

    def validate(self) -> list[str]:
        problems = super().validate()
        name = type(self).__name__
        if self.pair_selection == "all" and self.max_pairs_per_prompt is not None:
            problems.append(f"preference_pairs_per_sample must be null when pair_selection='all': "
                            f"{name}.pair_selection='all' needs max_pairs_per_prompt=None, "
                            f"got {self.max_pairs_per_prompt}")
        fields = {f.name: f for f in dataclasses.fields(self)}
        for key, value in self.policy_overrides.items():
            field = fields.get(key)
            if field is None or key in ("policy_overrides",):
                continue
            default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
            mine = getattr(self, key)
            if mine != default and mine != value:
                problems.append(f"{name}.{key}={mine!r} and policy_overrides[{key!r}]={value!r} disagree; give one")
        return problems


@dataclass
class MARLHFIterConfig(MARLHFConfig, IterativeOptions):
    """MARLHF over several rounds (for MARLHFIterTrainer): ``num_iterations`` rounds of collect -> fit -> policy,
    each comparing the policy against ``comparator_policy`` and fitting the reward model on a replay of the pair
    shards (``preference_replay_mode``; ``pool_preference_pairs=True`` is replay mode 'all'); see
    docs/algorithms.md, "Iterative preference training"."""

    preference_scoring_reward: str = not_supported_yet(
        "task", "Which reward labels the pairs: only 'task' (the original's 'reward_model' is not supported).",
        choices=("task", "reward_model"), says="preference_scoring_reward must be one of: task, reward_model")
    # comlrl 1.4.3's MARLHFIterConfig defaults (per iteration: 2 policy epochs).
    num_iterations: int = option(6, "Rounds of collect -> fit -> policy (counts the whole run).", min=1)
    num_train_epochs: int = option(2, "Policy-stage passes over train_dataset per iteration.", min=1)
    pair_selection: str = option(
        "comparator_reward", "Which pairs of a prompt are kept (see MARLHFConfig.pair_selection); by default those "
        "whose comparator-side candidate scored highest first.", choices=PAIR_SELECTIONS)

    def __post_init__(self) -> None:
        normalise_values(self)
        super().__post_init__()

    def validate(self) -> list[str]:
        problems = super().validate() + iterative_problems(self)
        if self.pool_preference_pairs and self.preference_replay_mode not in ("none", "all"):
            problems.append(f"{type(self).__name__}.pool_preference_pairs=True is replay mode 'all' but "
                            f"preference_replay_mode={self.preference_replay_mode!r}; give one of them")
        return problems
