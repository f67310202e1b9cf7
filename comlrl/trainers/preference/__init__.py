"""Preference-based trainers: MARLHF and its iterative form."""

from comlrl.trainers.preference.config import MARLHFConfig
from comlrl.trainers.preference.marlhf import MARLHFIterTrainer, MARLHFTrainer

__all__ = ["MARLHFConfig", "MARLHFIterTrainer", "MARLHFTrainer"]
