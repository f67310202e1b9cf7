"""Configs of the actor-critic trainers: the shared critic knobs, then MAAC and IAC."""

from __future__ import annotations

from dataclasses import dataclass

from comlrl.config import option
from comlrl.parallel.placement import check_placement_format
from comlrl.trainers.config import RolloutConfig


@dataclass
class ActorCriticConfig(RolloutConfig):
    """Fields every actor-critic trainer shares: critic target, learning rates, advantage and loss settings."""

    num_generations: int | None = option(
        None, "Completions sampled per prompt and agent (None = 4 with one turn, 1 with several: multi-turn "
        "actor-critic follows one chain per prompt). Several samples of a prompt give the actor a within-prompt "
        "comparison (measured on letters: eval 0.15-0.24 with 1, 0.42-0.63 with 4).", min=1, kind=int, optional=True)
    top_k: int | None = option(None, "Top-k sampling cut-off (None = off).", min=1, kind=int, optional=True)
    num_train_epochs: int = option(40, "Passes over train_dataset (counts the whole run when resuming).", min=1)
    critic_type: str = option(
        "v", "Critic target: 'v' values the context V(h), 'q' the context plus the completion Q(h, a); a Q critic's "
        "baseline for a completion is the mean Q of the other completions of its prompt (needs num_generations >= 2).",
        choices=("v", "q"))
    critic_learning_rate: float | None = option(
        5e-6, "AdamW learning rate of the separate critics' backbones (None = agent_learning_rate, as in the "
        "original comlrl).", min=0.0, min_exclusive=True, kind=(int, float), optional=True)
    value_loss_coef: float = option(0.6, "Weight of the critic's MSE loss.", min=0.0, min_exclusive=True)
    value_clip_range: float | None = option(
        0.2, "Clip each value to within this distance of its rollout-time value in the critic loss (None = off).",
        min=0.0, min_exclusive=True, kind=(int, float), optional=True,
    )
    critic_update_epochs: int = option(
        1, "Gradient passes of each separate critic over a rollout batch; each pass is one micro-batch of "
        "gradient_accumulation_steps.", min=1)
    gae_lambda: float = option(
        0.0, "GAE lambda over turns: 0 = one-step TD error r + discount*V' - V, 1 = discounted return minus V.",
        min=0.0, max=1.0,
    )
    value_head_learning_rate: float | None = option(
        1e-3, "AdamW learning rate of every value head, which starts untrained (None = critic_learning_rate); at a "
        "backbone's rate a fresh head stays near 0 for hundreds of steps and gives no baseline.", min=0.0,
        min_exclusive=True, kind=(int, float), optional=True)
    normalize_advantages: bool = option(
        True, "Standardise each agent's advantages over the batch (needs >= 2 samples): a critic that has not fitted "
        "yet leaves every advantage positive, which rewards the shortest completions.",
        aliases=("advantage_normalization",))
    entropy_coef: float = option(0.0, "Weight of the policy-entropy bonus in the actor loss (0 = off).", min=0.0)
    critic_device: str | list | None = option(
        None, "Placement of the separate critics: None (each next to the actor whose tokens it reads), 'auto', one "
        "device for all, or a list with one device per critic.", kind=(str, list), optional=True,
        aliases=("critic_devices",))

    algorithm_name = "actor-critic"  # as the original's messages name the trainer
    _critic_devices_when = ""  # the condition the original's message adds to "requires explicit critic_devices"

    def _critic_count(self) -> int:
        """Separate critic models that ``critic_device`` places."""
        return self.num_agents

    def __post_init__(self) -> None:
        if self.num_generations is None and isinstance(self.num_turns, int):
            self.num_generations = 1 if self.num_turns > 1 else 4
        if self.critic_learning_rate is None:
            self.critic_learning_rate = self.agent_learning_rate
        super().__post_init__()

    def _samples_per_prompt(self) -> int:
        return self.num_generations  # the original buffers each completion of a prompt as its own sample

    def validate(self) -> list[str]:
        problems = super().validate()
        name = type(self).__name__
        if self.num_turns > 1 and self.num_generations != 1:
            problems.append(
                f"Multi-turn {self.algorithm_name} currently supports num_generations == 1: "
                f"{name}.num_generations must be 1 when num_turns > 1 (got num_generations={self.num_generations}, "
                f"num_turns={self.num_turns}): multi-turn actor-critic follows one chain per prompt"
            )
        if self.critic_device is not None and self._critic_count():
            placement = check_placement_format(self.critic_device, self._critic_count(), f"{name}.critic_device")
            if placement:
                problems.append(placement)
        if self.parallel_training == "mp" and self._critic_count() and self.critic_device is None:
            problems.append(f"parallel_training='mp' requires explicit critic_devices{self._critic_devices_when}: "
                            f"{name}.critic_device (alias critic_devices) is None")
        if self.critic_type == "q" and self.num_generations < 2:
            problems.append(
                f"{name}.critic_type='q' needs num_generations >= 2 (got num_generations={self.num_generations}, "
                f"num_turns={self.num_turns}): the baseline of a completion's advantage is the mean Q(h, a) of the "
                "other completions sampled for the same prompt (a baseline that depends on the completion itself "
                "would cancel its advantage as Q fits); multi-turn episodes are single chains, so use critic_type='v' "
                "there"
            )
        return problems


@dataclass
class MAACConfig(ActorCriticConfig):
    """Multi-agent actor-critic: one centralised critic over the joint input serves every agent.

    A custom value-head width is given as ``model_config={"critic_value_head_hidden_dim": ...}``
    to the trainer, not here.
    """

    algorithm_name = "MAAC"

    def _critic_count(self) -> int:
        return 1


@dataclass
class IACConfig(ActorCriticConfig):
    """Independent actor-critic: each agent has its own critic (separate, or sharing the actor's backbone)."""

    algorithm_name = "IAC"
    _critic_devices_when = " when use_separate_critic=True"

    def _critic_count(self) -> int:
        return self.num_agents if self.use_separate_critic else 0

    use_separate_critic: bool = option(
        True, "True: one separate critic model per agent; False: each actor's backbone also carries its value head."
    )
    value_head_hidden_dim: int | None = option(
        None, "Hidden width of the shared (actor) value head's MLP (None = linear head); use_separate_critic=False only.",
        min=1, kind=int, optional=True,
    )
    critic_value_head_hidden_dim: int | None = option(
        None, "Hidden width of each separate critic's value-head MLP (None = linear head); use_separate_critic=True only.",
        min=1, kind=int, optional=True,
    )

    def validate(self) -> list[str]:
        problems = super().validate()
        if self.use_separate_critic and self.value_head_hidden_dim is not None:
            problems.append(
                f"IACConfig.value_head_hidden_dim={self.value_head_hidden_dim} sizes the shared actor head, but "
                "use_separate_critic=True; set critic_value_head_hidden_dim for separate critics instead"
            )
        if not self.use_separate_critic and self.critic_value_head_hidden_dim is not None:
            problems.append(
                f"IACConfig.critic_value_head_hidden_dim={self.critic_value_head_hidden_dim} sizes separate critics, but "
                "use_separate_critic=False; set value_head_hidden_dim for the shared head instead"
            )
        if not self.use_separate_critic and self.critic_update_epochs > 1:
            problems.append(
                f"IACConfig.critic_update_epochs={self.critic_update_epochs} needs use_separate_critic=True: a shared "
                "value head's extra passes would also step the actor"
            )
        return problems
