"""What a reward function is, declared: :class:`RewardFunction` and the optional parts a reward may offer.

A reward is called with one list of completions per agent (and ``batch_items=``, the rows, when it takes
them: :mod:`comlrl.rollout.rewards` decides the call shape) and returns one number per joint sample. Beyond
that, a reward may declare its scale (``reward_range``), report metrics of its own once a step and once an
evaluation (``drain_metrics``), keep rows about the answers it judged last (``sample_rows``) and end what it
holds (``close``). Each optional part is its own protocol, so the trainers and the pipeline ask for it by name
(``isinstance``), whether the reward is an object (the coding task) or a plain function with the attribute set
(:func:`comlrl.utils.set_reward_range`, as in comlrl 1.4.3).
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence, runtime_checkable


@runtime_checkable
class DeclaresRange(Protocol):
    """Anything that declares a reward's scale, ``(minimum, maximum)``, read and checked by
    :func:`comlrl.rollout.rewards.resolve_reward_range` (comlrl 1.4.3 reads the attribute from any object)."""

    reward_range: tuple[float, float]


@runtime_checkable
class RewardFunction(DeclaresRange, Protocol):
    """A reward in the trainers' call shape that declares its scale; a plain function without one is still a
    reward."""

    def __call__(self, *completions: Sequence[str], batch_items: Sequence[Any] | None = None) -> Sequence[float]: ...


@runtime_checkable
class ReportsMetrics(Protocol):
    """A reward whose own metrics (e.g. ``coding/<level>``) join the run's, drained once a step and once an
    evaluation."""

    def drain_metrics(self) -> Mapping[str, float]: ...


@runtime_checkable
class KeepsSampleRows(Protocol):
    """A reward that keeps rows about the answers it judged last, for a table a run logs."""

    def sample_rows(self) -> list[dict[str, Any]]: ...


@runtime_checkable
class Closable(Protocol):
    """A reward that holds something to end when its run ends (the coding task's sandbox)."""

    def close(self) -> None: ...


__all__ = ["Closable", "DeclaresRange", "KeepsSampleRows", "ReportsMetrics", "RewardFunction"]
