"""Task rewards: calling user reward functions and checking what they return.

A reward function takes one list of completions per agent, positionally
(``reward_func(completions_0, completions_1, ...)``), plus ``batch_items=`` (the dataset rows)
if it accepts that keyword, and returns one float per joint sample. Several functions can
be combined with weights; an optional ``reward_processor`` maps each reward.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Sequence

import torch

RewardFunc = Callable[..., Sequence[float]]


def accepts_batch_items(func: Callable) -> bool:
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "batch_items" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def function_name(func: Callable) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def _as_float(value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:
        return math.inf


class JointReward:
    """Weighted sum of one or more reward functions, then the optional per-reward processor."""

    def __init__(
        self,
        reward_func: RewardFunc | Sequence[RewardFunc],
        weights: Sequence[float] | None = None,
        reward_processor: Callable[[float], float] | None = None,
        monitors: dict[str, RewardFunc] | None = None,
        on_invalid: str = "raise",
    ) -> None:
        funcs = list(reward_func) if isinstance(reward_func, (list, tuple)) else [reward_func]
        if not funcs:
            raise ValueError("reward_func must be a callable or a non-empty list of callables")
        for index, func in enumerate(funcs):
            if not callable(func):
                raise ValueError(f"reward_func[{index}] must be callable, got {type(func).__name__}")
        if weights is None:
            weights = [1.0] * len(funcs)
        if len(weights) != len(funcs):
            raise ValueError(f"reward_weights has {len(weights)} entries but there are {len(funcs)} reward functions")
        if reward_processor is not None and not callable(reward_processor):
            raise ValueError(f"reward_processor must be callable, got {type(reward_processor).__name__}")
        self.funcs = funcs
        self.weights = [float(w) for w in weights]
        if on_invalid not in ("raise", "drop"):
            raise ValueError(f"on_invalid must be 'raise' or 'drop', got {on_invalid!r}")
        self.processor = reward_processor
        self.on_invalid = on_invalid
        self.dropped = 0  # samples whose reward was a non-number, NaN or inf and were dropped
        # Monitors score the same joint samples without entering the reward (e.g. the task
        # reward while training on a learned one); their means are reported as metrics.
        self.monitors = dict(monitors or {})
        self._monitor_values: dict[str, list[float]] = {name: [] for name in self.monitors}

    def _call_one(self, func: RewardFunc, completions: list[list[str]], batch_items: list[Any]) -> list[float]:
        name = function_name(func)
        kwargs = {"batch_items": batch_items} if accepts_batch_items(func) else {}
        try:
            values = func(*completions, **kwargs)
        except Exception as error:
            raise RuntimeError(f"reward function {name} raised {type(error).__name__}: {error}") from error
        if isinstance(values, torch.Tensor):
            values = values.tolist()
        try:
            values = list(values)
        except TypeError:
            raise ValueError(f"reward function {name} must return a list of floats, got {type(values).__name__}") from None
        expected = len(completions[0])
        if len(values) != expected:
            raise ValueError(f"reward function {name} returned {len(values)} rewards for {expected} joint samples")
        checked = []
        for index, value in enumerate(values):
            problem = None
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                problem = f"reward function {name} returned a non-number at index {index}: {value!r}"
            elif not math.isfinite(value := _as_float(value)):
                problem = f"reward function {name} returned {value} at index {index}; rewards must be finite"
            if problem is None:
                checked.append(float(value))
            elif self.on_invalid == "drop":
                checked.append(math.nan)  # NaN = dropped: left out of group statistics, advantage 0
            else:
                raise ValueError(problem + " (set invalid_reward='drop' to drop such samples and count them)")
        return checked

    def __call__(self, completions: list[list[str]], batch_items: list[Any]) -> torch.Tensor:
        """Rewards of the joint samples, ``completions[agent][sample]``, as a float tensor."""
        total = torch.zeros(len(completions[0]), dtype=torch.float64)
        for func, weight in zip(self.funcs, self.weights):
            total += weight * torch.tensor(self._call_one(func, completions, batch_items), dtype=torch.float64)
        if self.processor is not None:
            processed = [float(self.processor(float(value))) if math.isfinite(value) else math.nan for value in total]
            bad = [i for i, value in enumerate(processed) if not math.isfinite(value) and math.isfinite(total[i])]
            if bad:
                raise ValueError(f"reward_processor returned a non-finite value at index {bad[0]}")
            total = torch.tensor(processed, dtype=torch.float64)
        result = total.float()
        overflow = torch.isinf(result) & torch.isfinite(total)
        if overflow.any():
            index = int(overflow.nonzero()[0])
            if self.on_invalid == "raise":
                raise ValueError(
                    f"reward function(s) {[function_name(f) for f in self.funcs]} gave {float(total[index])} at index "
                    f"{index}, beyond float32 range (set invalid_reward='drop' to drop such samples and count them)"
                )
            result[overflow] = math.nan
        self.dropped += int(torch.isnan(result).sum())
        for name, monitor in self.monitors.items():
            self._monitor_values[name].extend(self._call_one(monitor, completions, batch_items))
        return result

    def state_dict(self) -> dict[str, Any]:
        return {"dropped": self.dropped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dropped = int(state["dropped"])

    def drain_monitor_metrics(self) -> dict[str, float]:
        """Means of the monitors since the last drain, as ``monitor/<name>`` metrics."""
        metrics = {f"monitor/{name}": sum(v) / len(v) for name, v in self._monitor_values.items() if v}
        for values in self._monitor_values.values():
            values.clear()
        return metrics
