"""Coding collaboration on HumanEval: agent 0 writes a helper ``aux(...)``, agent 1 the problem's entry
function (which may call ``aux``); the joint reward comes from running the problem's own tests in the
sandbox (docs/coding.md).

* :func:`humaneval` — the 164 problems, offline (splits ``train``, ``eval``: the first 32, ``all``).
* :class:`CodingTask` — the task as one object: the reward in the trainers' call shape (a
  :class:`~comlrl.rollout.reward_function.RewardFunction`: ``reward_range``, level means as ``coding/<level>``
  from ``drain_metrics``, ``sample_rows``), its ``transition`` and its sandbox; :func:`make_reward` builds one
  with the sandbox settings a run spec gives.
* :func:`aux_prompt`, :func:`main_prompt` (:data:`FORMATTERS`) — the two roles' prompts, pure functions.
* :data:`reward`, :func:`feedback_transition`, :func:`score` — comlrl 1.4.3-style module-level names over the
  default task (:func:`default_task`: built on first use, closed at interpreter exit).

Every program runs through :mod:`comlrl.sandbox` (full isolation unless a task is built with another), once
per (task, problem, program).
"""

from __future__ import annotations

import atexit
import threading
from typing import Any, Mapping, Sequence

from comlrl.tasks.coding.execution import Execution, Executor
from comlrl.tasks.coding.levels import CodeScore
from comlrl.tasks.coding.problems import EVAL_PROBLEMS, SPLITS, humaneval, test_plan
from comlrl.tasks.coding.prompts import FORMATTERS, aux_prompt, main_prompt
from comlrl.tasks.coding.task import REWARD_RANGE, CodingTask, make_reward

__all__ = ["CodeScore", "CodingTask", "EVAL_PROBLEMS", "Execution", "Executor", "FORMATTERS", "SPLITS", "TASK",
           "aux_prompt", "default_task", "feedback_transition", "humaneval", "main_prompt", "make_reward", "reward",
           "score", "test_plan"]

_default: CodingTask | None = None
_default_lock = threading.Lock()


def default_task() -> CodingTask:
    """The task behind the module-level names (full isolation, one worker per core), built on first use and
    closed at interpreter exit (so its warm workers' folders do not outlive the process)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = CodingTask()
            atexit.register(_default.close)
        return _default


def __getattr__(name: str) -> Any:
    if name == "TASK":  # the default task, by its former module-level name
        return default_task()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def score(problem: Mapping[str, Any], aux: str, main: str) -> CodeScore:
    """The levels of one joint answer: ``aux`` and ``main`` are the two agents' completions."""
    return default_task().judge_many([problem], [aux], [main])[0].score


class DefaultReward:
    """The default task's reward under its module-level name, :data:`reward` (a
    :class:`~comlrl.rollout.reward_function.RewardFunction`); pickled by name, so a copy uses its own process's
    default task."""

    reward_range = REWARD_RANGE

    def __init__(self) -> None:
        self.__name__ = self.__qualname__ = "reward"  # how a reward is named in errors and records

    def __call__(self, completions_0: Sequence[str], completions_1: Sequence[str],
                 batch_items: Sequence[Mapping[str, Any]] | None = None) -> list[float]:
        """The joint reward, in [0, 4], of each (aux, main) pair for its row's problem (``batch_items``)."""
        if batch_items is None:
            raise ValueError("comlrl.tasks.coding.reward needs batch_items (the HumanEval rows) to know each problem")
        return default_task().rewards(batch_items, completions_0, completions_1)

    def drain_metrics(self) -> dict[str, float]:
        return default_task().drain_metrics()

    def sample_rows(self) -> list[dict[str, Any]]:
        return default_task().sample_rows()

    def __reduce__(self) -> str:
        return "reward"


reward = DefaultReward()


def feedback_transition(prompt: str, agent_completions: Sequence[str], *, batch_item: Mapping[str, Any] | None = None,
                        **_: Any) -> list[str]:
    """``external_transition`` for two turns (:meth:`CodingTask.transition` of the default task): each agent's
    next problem text carries its first answer and the feedback from that answer's stored execution."""
    return default_task().transition(prompt, agent_completions, batch_item=batch_item)
