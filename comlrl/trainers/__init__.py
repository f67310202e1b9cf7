"""Trainers: MAGRPO (reinforce), IAC/MAAC (actor_critic), MARLHF (preference)."""

from comlrl.trainers.preference import MARLHFConfig, MARLHFIterTrainer, MARLHFTrainer
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

__all__ = ["MAGRPOConfig", "MAGRPOTrainer", "MARLHFConfig", "MARLHFIterTrainer", "MARLHFTrainer"]
