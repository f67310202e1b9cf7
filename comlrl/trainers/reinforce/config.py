"""MAGRPOConfig: the knobs of multi-agent group-relative policy optimisation."""

from __future__ import annotations

from dataclasses import dataclass

from comlrl.algorithms.advantages import ADVANTAGE_MODES
from comlrl.algorithms.losses import LOSS_TYPES
from comlrl.config import option
from comlrl.trainers.config import RolloutConfig


NORMALIZE_HELP = ("Divide each group's advantages by the group's reward std (scaling only: advantages are never "
                  "re-centred, so every advantage_mode stays its own estimator).")
ADVANTAGE_MODE_SAYS = "advantage_mode must be one of: mean, raw, max, rloo"  # comlrl 1.4.3's words
ADVANTAGE_MODE_HELP = ("Baseline of each sample's advantage within its group: 'mean' (MAGRPO), 'raw' (none: "
                       "MAREINFORCE), 'max' (the group's best: MAReMax) or 'rloo' (the other samples' mean: MARLOO).")


@dataclass
class MAGRPOConfig(RolloutConfig):
    """Multi-agent GRPO: group-relative advantages from a joint reward, clipped policy loss per agent."""

    per_device_train_batch_size: int = option(
        2, "Prompts per rollout batch, decoded together and used by one update. Default 2: one update per two "
        "prompts' rollouts, as comlrl 1.4.3's default rollout_buffer_size=2 (docs/migrating.md).", min=1)
    joint_mode: str = option("aligned", "How joint samples are formed: 'aligned' (index by index) or 'cross' (product).",
                             choices=("aligned", "cross"))
    normalize_advantages: bool = option(True, NORMALIZE_HELP, aliases=("advantage_normalization",))
    advantage_mode: str = option("mean", ADVANTAGE_MODE_HELP, choices=ADVANTAGE_MODES, says=ADVANTAGE_MODE_SAYS)
    loss_type: str = option(
        "grpo", "How token losses are averaged: 'grpo' (per completion, then over completions), 'bnpo'/'dapo' (over "
        "all completion tokens) or 'dr_grpo' (token sum over completions x max_new_tokens).", choices=LOSS_TYPES)
    collaboration_mode: str = option(
        "decentralized", "comlrl 1.4.3's switch: 'decentralized' (one model per agent) here; for one model writing "
        "every role use CentralizedMAGRPOConfig/CentralizedMAGRPOTrainer.", choices=("decentralized", "centralized"))
    clip_epsilon: float = option(0.2, "PPO clip range of the probability ratio.", min=0.0, min_exclusive=True, max=1.0)
    policy_update_epochs: int = option(
        1, "Gradient passes over each rollout batch (>1 reuses samples off-policy); each pass is one micro-batch "
        "of gradient_accumulation_steps.", min=1)
    skip_zero_variance_groups: bool = option(
        False, "Leave out of the policy loss every group (the joint samples of one prompt, or of one node of a "
        "later turn, that share a baseline) whose returns are all exactly equal (reward/zero_variance_groups, "
        "logged always): its completions add no gradient and are not counted by the loss normaliser. A rollout "
        "batch with no other group takes no backward pass and no optimizer step; its training step is still "
        "counted, with metrics.")

    # Whether one model writes every role (CentralizedMAGRPOConfig), the only kind 'centralized' is for.
    writes_every_role = False

    def _group_size_reason(self) -> str:
        return f"for the {self.advantage_mode!r} group baseline"

    def validate(self) -> list[str]:
        problems = super().validate()
        if self.collaboration_mode == "centralized" and not self.writes_every_role:
            problems.append(f"{type(self).__name__}.collaboration_mode='centralized': one model writing every role is "
                            "CentralizedMAGRPOConfig with CentralizedMAGRPOTrainer (run specs: algorithm: "
                            "magrpo_centralized)")
        if self.skip_zero_variance_groups and self.num_generations < 2:
            problems.append(f"{type(self).__name__}.skip_zero_variance_groups=True needs num_generations >= 2, got "
                            f"num_generations={self.num_generations} (a group of one sample is always constant, so "
                            "every sample would be skipped): raise num_generations or leave the option False")
        if self.num_generations < 2 and self.advantage_mode != "raw":
            problems.append(f"{type(self).__name__}.num_generations must be >= 2 {self._group_size_reason()}, "
                            f"got {self.num_generations}")
        joint = self.num_generations ** self.num_agents if self.joint_mode == "cross" else self.num_generations
        if joint ** self.num_turns > 4096:
            problems.append(
                f"{type(self).__name__}: {self.joint_mode!r} joints with num_generations={self.num_generations}, "
                f"num_agents={self.num_agents}, num_turns={self.num_turns} make {joint ** self.num_turns} "
                "leaf samples per prompt (limit 4096); lower one of them"
            )
        return problems


@dataclass
class MAREINFORCEConfig(MAGRPOConfig):
    """Multi-agent REINFORCE: the advantage is the return itself (no baseline); MAGRPO otherwise."""

    advantage_mode: str = option("raw", ADVANTAGE_MODE_HELP, choices=ADVANTAGE_MODES, says=ADVANTAGE_MODE_SAYS)
    normalize_advantages: bool = option(False, NORMALIZE_HELP, aliases=("advantage_normalization",))


@dataclass
class MAReMaxConfig(MAGRPOConfig):
    """Multi-agent ReMax: the baseline is the group's best return (``A = R - max R``); MAGRPO otherwise."""

    advantage_mode: str = option("max", ADVANTAGE_MODE_HELP, choices=ADVANTAGE_MODES, says=ADVANTAGE_MODE_SAYS)
    normalize_advantages: bool = option(False, NORMALIZE_HELP, aliases=("advantage_normalization",))


@dataclass
class MARLOOConfig(MAGRPOConfig):
    """Multi-agent RLOO: the baseline is the mean return of the group's other samples; MAGRPO otherwise."""

    advantage_mode: str = option("rloo", ADVANTAGE_MODE_HELP, choices=ADVANTAGE_MODES, says=ADVANTAGE_MODE_SAYS)
    normalize_advantages: bool = option(False, NORMALIZE_HELP, aliases=("advantage_normalization",))
