"""Preference-based trainers: MADPO and MARLHF, online and iterative (and the joint reward model MARLHF fits)."""

from comlrl.models.reward_model import JointRewardModel
from comlrl.trainers.preference.config import MARLHFConfig, MARLHFIterConfig
from comlrl.trainers.preference.iterative import MADPOIterTrainer
from comlrl.trainers.preference.madpo import MADPOTrainer
from comlrl.trainers.preference.madpo_config import MADPOConfig, MADPOIterConfig
from comlrl.trainers.preference.marlhf import MARLHFIterTrainer, MARLHFTrainer

__all__ = ["JointRewardModel", "MADPOConfig", "MADPOIterConfig", "MADPOIterTrainer", "MADPOTrainer", "MARLHFConfig",
           "MARLHFIterConfig", "MARLHFIterTrainer", "MARLHFTrainer"]
