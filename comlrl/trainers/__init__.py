"""Trainers: the MAGRPO/REINFORCE family and centralized MAGRPO (reinforce), IAC/MAAC (actor_critic), MARLHF and MADPO (preference).

The names are re-exported lazily, so importing one trainer does not import the others.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "ActorCriticTrainerBase": "comlrl.trainers.actor_critic",
    "CentralizedMAGRPOConfig": "comlrl.trainers.reinforce",
    "CentralizedMAGRPOTrainer": "comlrl.trainers.reinforce",
    "JointRewardModel": "comlrl.trainers.preference",
    "IACConfig": "comlrl.trainers.actor_critic",
    "IACTrainer": "comlrl.trainers.actor_critic",
    "MAACConfig": "comlrl.trainers.actor_critic",
    "MAACTrainer": "comlrl.trainers.actor_critic",
    "MAGRPOConfig": "comlrl.trainers.reinforce",
    "MAGRPOTrainer": "comlrl.trainers.reinforce",
    "MAREINFORCEConfig": "comlrl.trainers.reinforce",
    "MAREINFORCETrainer": "comlrl.trainers.reinforce",
    "MAReMaxConfig": "comlrl.trainers.reinforce",
    "MAReMaxTrainer": "comlrl.trainers.reinforce",
    "MARLOOConfig": "comlrl.trainers.reinforce",
    "MARLOOTrainer": "comlrl.trainers.reinforce",
    "MADPOConfig": "comlrl.trainers.preference",
    "MADPOIterConfig": "comlrl.trainers.preference",
    "MADPOIterTrainer": "comlrl.trainers.preference",
    "MADPOTrainer": "comlrl.trainers.preference",
    "MARLHFConfig": "comlrl.trainers.preference",
    "MARLHFIterConfig": "comlrl.trainers.preference",
    "MARLHFIterTrainer": "comlrl.trainers.preference",
    "MARLHFTrainer": "comlrl.trainers.preference",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'comlrl.trainers' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


def __dir__() -> list[str]:
    return __all__
