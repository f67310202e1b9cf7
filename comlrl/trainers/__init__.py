"""Trainers: the MAGRPO/REINFORCE family and centralized MAGRPO (reinforce), IAC/MAAC (actor_critic), MARLHF and MADPO (preference).

The names are re-exported lazily, so importing one trainer does not import the others.
"""

from __future__ import annotations

import importlib
from typing import Any

from comlrl.trainers.algorithms import ALGORITHMS

# Every trainer and config class of the registry, and the bases and parts users reach for.
_HOMES = {
    **{name: home for algorithm in ALGORITHMS.values() for name, home in algorithm.homes.items()},
    "ActorCriticTrainerBase": "comlrl.trainers.actor_critic",
    "JointRewardModel": "comlrl.trainers.preference",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'comlrl.trainers' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


def __dir__() -> list[str]:
    return __all__
