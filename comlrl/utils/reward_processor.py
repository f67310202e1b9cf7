"""Ready-made reward processors (``reward_processor=`` maps each joint reward to a new one)."""

from __future__ import annotations

from typing import Callable

RewardProcessor = Callable[[float], float]


class RewardProcessors:
    """Factories of simple reward processors, e.g. ``reward_processor=RewardProcessors.scale(0.5)``."""

    @staticmethod
    def scale(factor: float = 1.0) -> RewardProcessor:
        """A processor that multiplies a reward by ``factor``."""

        def scaled(reward):
            return reward * factor

        return scaled

    @staticmethod
    def shift(value: float = 0.0) -> RewardProcessor:
        """A processor that adds ``value`` to a reward."""

        def shifted(reward):
            return reward + value

        return shifted


__all__ = ["RewardProcessors"]
