"""Task rewards: calling user reward functions and checking what they return.

A reward function takes one list of completions per agent, positionally
(``reward_func(completions_0, completions_1, ...)``), plus ``batch_items=`` (the dataset rows)
if it accepts that keyword, and returns one float per joint sample. Several functions can
be combined with weights; an optional ``reward_processor`` maps each reward.

The call shapes that code written for the original comlrl uses are decided once per function
from its signature (:func:`plan_reward_call`): ``f(*completions)``; ``f(completions_0, ...)``;
``f(prompts, completions_0, ...)`` (N+1 positional parameters, or a first one named
``prompts``); ``f(agent_completions)`` (one parameter, a list of per-agent lists, with several
agents); ``prompts=`` and ``batch_items=`` as keywords where declared or ``**kwargs`` takes
them. ``prompts`` are the rows' ``prompt`` fields. A function that answers a whole batch with a
single number (or a one-element list), as functions written for the original's one-sample
calls do, is from then on called once per joint sample.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy
import torch

from comlrl.rollout.reward_calls import BoundedCaller, RewardCallPolicy
from comlrl.rollout.reward_function import Closable, DeclaresRange, KeepsSampleRows, ReportsMetrics

RewardFunc = Callable[..., Sequence[float]]


@dataclass(frozen=True)
class RewardCallPlan:
    """How a reward function is called: what goes positionally, which keywords it gets."""

    prompts_first: bool = False  # f(prompts, completions_0, ...)
    nested: bool = False  # f(agent_completions): one list of per-agent lists
    batch_items: bool = False
    prompts_keyword: bool = False

    def arguments(self, prompts: list[str], completions: list[list[str]],
                  batch_items: list[Any]) -> tuple[list[Any], dict[str, Any]]:
        args: list[Any] = [completions] if self.nested else list(completions)
        if self.prompts_first:
            args = [prompts] + args
        kwargs: dict[str, Any] = {}
        if self.batch_items:
            kwargs["batch_items"] = batch_items
        if self.prompts_keyword:
            kwargs["prompts"] = prompts
        return args, kwargs


def plan_reward_call(func: Callable, num_agents: int) -> RewardCallPlan:
    """Decide from ``func``'s signature how to call it with ``num_agents`` lists of completions."""
    try:
        parameters = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return RewardCallPlan()  # no signature to read: completions positionally
    names = {p.name for p in parameters}
    var_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    # The parameters that must be filled: optional ones (batch_items=None, prompts=None) come as keywords.
    positional = [p for p in parameters if p.name != "batch_items" and p.default is inspect.Parameter.empty
                  and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters)
    prompts_first = not varargs and bool(positional) and (
        positional[0].name == "prompts" or len(positional) == num_agents + 1)
    nested = not varargs and not prompts_first and num_agents > 1 and len(positional) == 1
    return RewardCallPlan(
        prompts_first=prompts_first,
        nested=nested,
        batch_items="batch_items" in names or var_keyword,
        prompts_keyword=not prompts_first and ("prompts" in names or var_keyword),
    )


def function_name(func: Callable) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def is_number(value: Any) -> bool:
    """A real number: Python's int/float and numpy's scalars (``numpy.float32``, ``numpy.int64``), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, numpy.bool_))


def _as_float(value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:
        return math.inf


_RANGE_SHAPE_ERROR = "reward_func.reward_range must be a two-item sequence: (minimum, maximum)."


def resolve_reward_range(reward_func: Callable[..., Any]) -> tuple[float, float] | None:
    """The ``(minimum, maximum)`` a reward callable declares in ``reward_range``, or ``None``.

    Raises ``ValueError`` if the declaration is not two finite numbers with minimum < maximum.
    """
    if not isinstance(reward_func, DeclaresRange) or reward_func.reward_range is None:
        return None
    declared = reward_func.reward_range
    if isinstance(declared, (str, bytes)) or not isinstance(declared, Sequence) or len(declared) != 2:
        raise ValueError(_RANGE_SHAPE_ERROR)
    low, high = float(declared[0]), float(declared[1])
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError("reward_func.reward_range values must be finite.")
    if not low < high:
        raise ValueError("reward_func.reward_range minimum must be less than maximum.")
    return low, high


class JointReward:
    """Weighted sum of one or more reward functions, then the optional per-reward processor."""

    def __init__(
        self,
        reward_func: RewardFunc | Sequence[RewardFunc],
        weights: Sequence[float] | None = None,
        reward_processor: Callable[[float], float] | None = None,
        monitors: dict[str, RewardFunc] | None = None,
        on_invalid: str = "raise",
        num_agents: int | None = None,
        call_policy: RewardCallPolicy | None = None,
    ) -> None:
        funcs = list(reward_func) if isinstance(reward_func, (list, tuple)) else [reward_func]
        if not funcs:
            raise ValueError("reward_func must be a callable or a non-empty list of callables")
        for index, func in enumerate(funcs):
            if not callable(func):
                where = f"reward_func[{index}]" if isinstance(reward_func, (list, tuple)) else "reward_func"
                raise ValueError(f"reward_func must be a callable: {where} is a {type(func).__name__}")
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
        # The part of ``dropped`` every process has counted together (the trainer's total at its last recorded
        # step, under data parallelism); the rest is this process's own since then.
        self.dropped_counted = 0
        # Monitors score the same joint samples without entering the reward (e.g. the task
        # reward while training on a learned one); their means are reported as metrics.
        self.monitors = dict(monitors or {})
        # How each function (by its place in _all_functions()) is called, decided once from its signature:
        # now if the number of agents is known, else at the first call.
        self._plans: list[RewardCallPlan | None] = [
            plan_reward_call(func, num_agents) if num_agents is not None else None for func in self._all_functions()]
        self._per_sample: set[int] = set()  # functions that answer one joint sample per call
        self._monitor_values: dict[str, list[float]] = {name: [] for name in self.monitors}
        self.caller = BoundedCaller(call_policy)  # retries, timeout, stop requests (comlrl.rollout.reward_calls)

    def watch_stop(self, request: Any) -> None:
        """Where a wait for a reward call looks for a stop request (SIGTERM/SIGINT)."""
        self.caller.watch_stop(request)

    def _call_one(self, place: int, completions: list[list[str]], batch_items: list[Any]) -> list[float]:
        func = self._all_functions()[place]
        name = function_name(func)
        plan = self._plans[place]
        if plan is None:
            plan = self._plans[place] = plan_reward_call(func, len(completions))
        prompts = [str(row.get("prompt", "")) if isinstance(row, dict) else "" for row in batch_items]
        expected = len(completions[0])
        if place in self._per_sample:
            values = [self._values(func, name, plan, prompts[i:i + 1], [c[i:i + 1] for c in completions],
                                   batch_items[i:i + 1])[0] for i in range(expected)]
        else:
            values = self._values(func, name, plan, prompts, completions, batch_items)
            if len(values) == 1 and expected > 1:  # written for one joint sample per call (the original's calls)
                self._per_sample.add(place)
                return self._call_one(place, completions, batch_items)
        if len(values) != expected:
            raise ValueError(f"reward function {name} returned {len(values)} rewards for {expected} joint samples")
        checked = []
        for index, value in enumerate(values):
            problem = None
            if not is_number(value):
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

    def _values(self, func: RewardFunc, name: str, plan: RewardCallPlan, prompts: list[str],
                completions: list[list[str]], batch_items: list[Any]) -> list[Any]:
        """What ``func`` returned for these samples, as a list (a bare number is a list of one)."""
        args, kwargs = plan.arguments(prompts, completions, batch_items)
        values = self.caller.call(func, name, args, kwargs)  # RewardCallError once its retries are spent
        if isinstance(values, (torch.Tensor, numpy.ndarray)):
            values = values.reshape(-1).tolist()
        if is_number(values):
            return [values]
        if isinstance(values, (str, bytes, dict)) or not isinstance(values, (list, tuple)):
            kind = type(values).__name__  # a str is refused whole, never read as a list of characters
            raise ValueError(f"reward function {name} returned a {kind} ({values!r:.80}): it must return a number "
                             f"or a list of numbers, got {kind}")
        return list(values)

    def __call__(self, completions: list[list[str]], batch_items: list[Any]) -> torch.Tensor:
        """Rewards of the joint samples, ``completions[agent][sample]``, as a float tensor."""
        total = torch.zeros(len(completions[0]), dtype=torch.float64)
        for place, weight in enumerate(self.weights):
            total += weight * torch.tensor(self._call_one(place, completions, batch_items), dtype=torch.float64)
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
        for offset, name in enumerate(self.monitors):
            self._monitor_values[name].extend(self._call_one(len(self.funcs) + offset, completions, batch_items))
        return result

    def _all_functions(self) -> list[RewardFunc]:
        return self.funcs + list(self.monitors.values())

    @contextlib.contextmanager
    def drops_counted_apart(self) -> Iterator[Callable[[], int]]:
        """Samples dropped inside the block (an evaluation's) are left out of ``dropped``, training's count;
        yields a function that says how many were dropped inside the block so far."""
        before = self.dropped
        try:
            yield lambda: self.dropped - before
        finally:
            self.dropped = before

    def state_dict(self) -> dict[str, Any]:
        return {"dropped": self.dropped, "per_sample": sorted(self._per_sample)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dropped = self.dropped_counted = int(state["dropped"])
        self._per_sample = set(state.get("per_sample", []))

    def sample_rows(self) -> list[dict[str, Any]]:
        """Rows a reward function keeps about the answers it judged last (its ``sample_rows()``, e.g. the coding
        task's programs with their verdicts), for a table a run logs; empty for plain functions."""
        rows: list[dict[str, Any]] = []
        for func in self.funcs:
            if isinstance(func, KeepsSampleRows):
                rows += [dict(row) for row in func.sample_rows()]
        return rows

    def drain_monitor_metrics(self) -> dict[str, float]:
        """Means of the monitors since the last drain, as ``monitor/<name>`` metrics, and whatever a reward
        function that reports more than its numbers gives back from its ``drain_metrics()`` (e.g. the coding
        task's levels, ``coding/<level>``): called here, once per step and once per evaluation."""
        metrics = {f"monitor/{name}": sum(v) / len(v) for name, v in self._monitor_values.items() if v}
        for func in self.funcs:
            if isinstance(func, ReportsMetrics):
                metrics.update({str(key): float(value) for key, value in func.drain_metrics().items()})
        for values in self._monitor_values.values():
            values.clear()
        return metrics

    def close(self) -> None:
        """End what the reward functions and monitors hold (:class:`~comlrl.rollout.reward_function.Closable`,
        e.g. the coding task's sandbox), each once; plain functions hold nothing."""
        closed: list[Any] = []
        for func in self._all_functions():
            if isinstance(func, Closable) and not any(func is seen for seen in closed):
                closed.append(func)
                func.close()
