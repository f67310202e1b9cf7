"""REINFORCE-family trainers: MAGRPO."""

from comlrl.trainers.reinforce.config import MAGRPOConfig
from comlrl.trainers.reinforce.magrpo import MAGRPOTrainer

__all__ = ["MAGRPOConfig", "MAGRPOTrainer"]
