"""Preference-based trainers: MARLHF and its iterative form (and the joint reward model they fit)."""

from comlrl.models.reward_model import JointRewardModel
from comlrl.trainers.preference.config import MARLHFConfig, MARLHFIterConfig
from comlrl.trainers.preference.marlhf import MARLHFIterTrainer, MARLHFTrainer

__all__ = ["JointRewardModel", "MARLHFConfig", "MARLHFIterConfig", "MARLHFIterTrainer", "MARLHFTrainer"]
