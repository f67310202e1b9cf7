"""Coding collaboration on HumanEval: agent 0 writes a helper ``aux(...)``, agent 1 the problem's entry
function (which may call ``aux``); the joint reward comes from running the problem's own tests in the
sandbox (docs/coding.md).

* :func:`humaneval` — the 164 problems, offline (splits ``train``, ``eval``: the first 32, ``all``).
* :func:`aux_prompt`, :func:`main_prompt` (:data:`FORMATTERS`) — the two roles' prompts.
* :func:`score` — one joint answer's levels (:class:`CodeScore`: structure, syntax, tests, cooperation, total).
* :func:`reward` — the joint reward in the trainers' call shape, built on the same scoring; its level
  means reach the run's metrics as ``coding/<level>`` (``reward.drain_metrics``).
* :func:`feedback_transition` — the second turn's prompts, from the first turn's stored execution.

Every program runs through :mod:`comlrl.sandbox` under full isolation, once per (problem, program).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from comlrl.tasks.coding import prompts
from comlrl.tasks.coding.execution import Execution, Executor
from comlrl.tasks.coding.levels import CodeScore
from comlrl.tasks.coding.problems import EVAL_PROBLEMS, SPLITS, humaneval, test_plan
from comlrl.tasks.coding.task import REWARD_RANGE, CodingTask

__all__ = ["CodeScore", "CodingTask", "EVAL_PROBLEMS", "Execution", "Executor", "FORMATTERS", "SPLITS", "TASK",
           "aux_prompt", "feedback_transition", "humaneval", "main_prompt", "reward", "score", "test_plan"]

TASK = CodingTask()  # the task the module-level functions use (one sandbox pool, one execution cache)


def score(problem: Mapping[str, Any], aux: str, main: str) -> CodeScore:
    """The levels of one joint answer: ``aux`` and ``main`` are the two agents' completions."""
    return TASK.judge_many([problem], [aux], [main])[0].score


def reward(completions_0: Sequence[str], completions_1: Sequence[str],
           batch_items: Sequence[Mapping[str, Any]] | None = None) -> list[float]:
    """The joint reward, in [0, 4], of each (aux, main) pair for its row's problem (``batch_items``)."""
    if batch_items is None:
        raise ValueError("comlrl.tasks.coding.reward needs batch_items (the HumanEval rows) to know each problem")
    return TASK.rewards(batch_items, completions_0, completions_1)


reward.reward_range = REWARD_RANGE  # type: ignore[attr-defined]
reward.drain_metrics = TASK.drain_metrics  # type: ignore[attr-defined]
reward.sample_rows = TASK.sample_rows  # type: ignore[attr-defined]


def aux_prompt(row: Mapping[str, Any]) -> str:
    """Agent 0's prompt (see :mod:`comlrl.tasks.coding.prompts`)."""
    TASK.remember(row)
    return prompts.aux_prompt(row)


def main_prompt(row: Mapping[str, Any]) -> str:
    """Agent 1's prompt (see :mod:`comlrl.tasks.coding.prompts`)."""
    return prompts.main_prompt(row, TASK.remember(row))


FORMATTERS = (aux_prompt, main_prompt)


def feedback_transition(prompt: str, agent_completions: Sequence[str], **_: Any) -> list[str]:
    """``external_transition`` for two turns: each agent's next problem text carries its first answer and the
    feedback from that answer's stored execution (the failing tests, the syntax error with its line)."""
    return TASK.next_prompts(prompt, agent_completions)
