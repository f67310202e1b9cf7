"""Algorithm names of run specs -> trainer and config classes, and how their boundaries run.

``kind`` says what a boundary (a checkpoint, a transaction in the flow) is:
``"epochs"`` — one epoch, its steps run as the trainer's ``step_stages`` (one task each);
``"pbrl"`` — one PbRL stage (collection, reward fit, policy), one task each.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Algorithm:
    name: str
    module: str
    trainer: str
    config: str
    kind: str = "epochs"

    def load(self) -> tuple[type, type]:
        """``(trainer_class, config_class)``; ``ImportError`` says which module is missing."""
        module = importlib.import_module(self.module)
        return getattr(module, self.trainer), getattr(module, self.config)


ALGORITHMS = {
    algorithm.name: algorithm
    for algorithm in (
        Algorithm("magrpo", "comlrl.trainers.reinforce", "MAGRPOTrainer", "MAGRPOConfig"),
        Algorithm("mareinforce", "comlrl.trainers.reinforce", "MAREINFORCETrainer", "MAREINFORCEConfig"),
        Algorithm("maremax", "comlrl.trainers.reinforce", "MAReMaxTrainer", "MAReMaxConfig"),
        Algorithm("marloo", "comlrl.trainers.reinforce", "MARLOOTrainer", "MARLOOConfig"),
        Algorithm("magrpo_centralized", "comlrl.trainers.reinforce", "CentralizedMAGRPOTrainer",
                  "CentralizedMAGRPOConfig"),
        Algorithm("iac", "comlrl.trainers.actor_critic", "IACTrainer", "IACConfig"),
        Algorithm("maac", "comlrl.trainers.actor_critic", "MAACTrainer", "MAACConfig"),
        Algorithm("marlhf", "comlrl.trainers.preference", "MARLHFTrainer", "MARLHFConfig", kind="pbrl"),
        Algorithm("marlhf_iter", "comlrl.trainers.preference", "MARLHFIterTrainer", "MARLHFIterConfig", kind="pbrl"),
        Algorithm("madpo", "comlrl.trainers.preference", "MADPOTrainer", "MADPOConfig"),
        Algorithm("madpo_iter", "comlrl.trainers.preference", "MADPOIterTrainer", "MADPOIterConfig", kind="pbrl"),
    )
}
