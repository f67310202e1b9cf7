"""REINFORCE-family trainers: MAGRPO and its advantage-mode variants MAREINFORCE, MAReMax, MARLOO."""

from comlrl.trainers.reinforce.config import MAGRPOConfig, MAREINFORCEConfig, MAReMaxConfig, MARLOOConfig
from comlrl.trainers.reinforce.magrpo import MAGRPOTrainer, MAREINFORCETrainer, MAReMaxTrainer, MARLOOTrainer
from comlrl.trainers.reinforce.centralized import CentralizedMAGRPOTrainer
from comlrl.trainers.reinforce.centralized_config import CentralizedMAGRPOConfig

__all__ = ["MAGRPOConfig", "MAGRPOTrainer", "MAREINFORCEConfig", "MAREINFORCETrainer", "MAReMaxConfig",
           "MAReMaxTrainer", "MARLOOConfig", "MARLOOTrainer", "CentralizedMAGRPOConfig", "CentralizedMAGRPOTrainer"]
