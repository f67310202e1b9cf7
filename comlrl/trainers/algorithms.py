"""The one registry of algorithms: a name (as run specs and ``MARLHFConfig.rl_algorithm`` write it) -> its
trainer and config classes, imported only when asked for.

``kind`` says what a boundary (a checkpoint) is: ``"epochs"`` — one epoch of steps; ``"pbrl"`` —
one PbRL stage (collection, reward fit, policy update).
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

    @property
    def homes(self) -> dict[str, str]:
        """Its class names -> the module that defines them (what ``comlrl.trainers`` re-exports)."""
        return {self.trainer: self.module, self.config: self.module}

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


def algorithm(name: str) -> Algorithm:
    """The algorithm called ``name``; a ``ValueError`` listing the known names otherwise."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {sorted(ALGORITHMS)}") from None
