"""MAGRPOConfig: the knobs of multi-agent group-relative policy optimisation."""

from __future__ import annotations

from dataclasses import dataclass

from comlrl.config import not_supported_yet, option
from comlrl.trainers.config import RolloutConfig


@dataclass
class MAGRPOConfig(RolloutConfig):
    """Multi-agent GRPO: group-relative advantages from a joint reward, clipped policy loss per agent."""

    joint_mode: str = option("aligned", "How joint samples are formed: 'aligned' (index by index) or 'cross' (product).",
                             choices=("aligned", "cross"))
    normalize_advantages: bool = option(True, "Divide group-relative advantages by the group's reward std.",
                                        aliases=("advantage_normalization",))
    advantage_mode: str = not_supported_yet(
        "mean", "Original comlrl's baseline of the group-relative advantage: only 'mean' (reward minus the group mean) "
        "is implemented; 'raw', 'max' and 'rloo' are not supported yet.")
    clip_epsilon: float = option(0.2, "PPO clip range of the probability ratio.", min=0.0, min_exclusive=True, max=1.0)
    policy_update_epochs: int = option(
        1, "Gradient passes over each rollout batch (>1 reuses samples off-policy); each pass is one micro-batch "
        "of gradient_accumulation_steps.", min=1)

    def validate(self) -> list[str]:
        problems = super().validate()
        if self.num_generations < 2:
            problems.append(
                f"MAGRPOConfig.num_generations must be >= 2 for a group baseline, got {self.num_generations}"
            )
        joint = self.num_generations ** self.num_agents if self.joint_mode == "cross" else self.num_generations
        if joint ** self.num_turns > 4096:
            problems.append(
                f"MAGRPOConfig: {self.joint_mode!r} joints with num_generations={self.num_generations}, "
                f"num_agents={self.num_agents}, num_turns={self.num_turns} make {joint ** self.num_turns} "
                "leaf samples per prompt (limit 4096); lower one of them"
            )
        return problems
