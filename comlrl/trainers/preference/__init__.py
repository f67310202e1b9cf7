"""Preference-based trainers: MADPO and MARLHF, online and iterative (and the joint reward model MARLHF fits,
and comlrl 1.4.3's centralized comparator adapter names)."""

from comlrl.models.reward_model import JointRewardModel
from comlrl.trainers.preference.centralized import (CentralizedComparatorAdapter, CentralizedComparatorParseError,
                                                    TaggedCentralizedComparatorAdapter)
from comlrl.trainers.preference.config import MARLHFConfig, MARLHFIterConfig
from comlrl.trainers.preference.iterative import MADPOIterTrainer
from comlrl.trainers.preference.madpo import MADPOTrainer
from comlrl.trainers.preference.madpo_config import MADPOConfig, MADPOIterConfig
from comlrl.trainers.preference.marlhf import MARLHFIterTrainer, MARLHFTrainer

__all__ = ["CentralizedComparatorAdapter", "CentralizedComparatorParseError", "JointRewardModel", "MADPOConfig",
           "MADPOIterConfig", "MADPOIterTrainer", "MADPOTrainer", "MARLHFConfig", "MARLHFIterConfig",
           "MARLHFIterTrainer", "MARLHFTrainer", "TaggedCentralizedComparatorAdapter"]
