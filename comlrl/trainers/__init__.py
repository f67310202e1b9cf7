"""Trainers: MAGRPO (reinforce), IAC/MAAC (actor_critic), MARLHF (preference)."""

from comlrl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from comlrl.trainers.preference import MARLHFConfig, MARLHFIterTrainer, MARLHFTrainer
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

__all__ = [
    "IACConfig", "IACTrainer", "MAACConfig", "MAACTrainer",
    "MAGRPOConfig", "MAGRPOTrainer", "MARLHFConfig", "MARLHFIterTrainer", "MARLHFTrainer",
]
