"""The coding task as the trainers call it: :class:`CodingTask` scores joint answers, reports level metrics
and writes the second turn's prompts from the first turn's stored execution; :func:`make_reward` builds one
with the sandbox settings a run spec gives."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from comlrl.tasks.coding import program as shape
from comlrl.tasks.coding.execution import Execution, Executor
from comlrl.tasks.coding.levels import MAX_TOTAL, CodeScore, Shape, needs_tests, read_shape, score_levels
from comlrl.tasks.coding.problems import bundled_problem, preamble
from comlrl.tasks.coding.prompts import FORMATTERS, feedback

METRIC_PREFIX = "coding/"
LEVELS = ("structure", "syntax", "tests", "cooperation", "total")
SAMPLES_KEPT = 256


@dataclass(frozen=True)
class Judged:
    """One joint answer, judged: the code kept from each completion, the program, its shape, verdicts and score."""

    aux_code: str
    main_code: str
    aux_error: str | None
    main_error: str | None
    program: str
    facts: Shape
    execution: Execution | None
    score: CodeScore


class CodingTask:
    """The coding task as one object: scores (problem, aux completion, main completion) triples in the trainers'
    call shape (it is a :class:`~comlrl.rollout.reward_function.RewardFunction`), reports level metrics and
    sample rows, and writes the second turn's prompts (:meth:`transition`) from the row it is given. Each joint
    program runs once (:class:`Executor`); :meth:`close` ends the sandbox's workers (at interpreter exit at the
    latest)."""

    reward_range = (0.0, MAX_TOTAL)

    def __init__(self, executor: Executor | None = None) -> None:
        self.executor = executor or Executor()
        self._levels: dict[str, list[float]] = {level: [] for level in LEVELS}
        self._all_passed: list[float] = []
        self._samples: list[dict[str, Any]] = []  # answers judged since the last drain
        self._last_samples: list[dict[str, Any]] = []  # those of the last step or evaluation that judged any
        self._lock = threading.Lock()
        self.__name__ = self.__qualname__ = "CodingTask"  # how a reward is named in errors and records

    def __call__(self, completions_0: Sequence[str], completions_1: Sequence[str],
                 batch_items: Sequence[Mapping[str, Any]] | None = None) -> list[float]:
        """The joint reward, in [0, 4], of each (aux, main) pair for its row's problem (``batch_items``)."""
        if batch_items is None:
            raise ValueError("the coding reward needs batch_items (the HumanEval rows) to know each problem")
        return self.rewards(batch_items, completions_0, completions_1)

    @property
    def formatters(self) -> tuple[Any, Any]:
        """The two roles' prompts (:func:`comlrl.tasks.coding.prompts.aux_prompt`, ``main_prompt``): pure."""
        return FORMATTERS

    def close(self) -> None:
        """End the sandbox's warm workers and remove their folders (a later call starts them anew)."""
        self.executor.close()

    def __enter__(self) -> "CodingTask":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def judge_many(self, problems: Sequence[Mapping[str, Any]], aux: Sequence[str], main: Sequence[str]) -> list[Judged]:
        """Judge joint answers; the programs that reach the tests level run in the sandbox together."""
        pending = []
        for problem, aux_completion, main_completion in zip(problems, aux, main):
            aux_kept, main_kept = shape.extract_code(aux_completion), shape.extract_code(main_completion)
            aux_code = shape.without(aux_kept.code, problem["entry_point"])
            main_code = shape.without(main_kept.code, shape.AUX)
            program = shape.joint_program(preamble(problem), aux_code, main_code)
            facts = read_shape(aux_code, main_code, problem["entry_point"], program, None)
            pending.append((problem, aux_code, main_code, aux_kept.error, main_kept.error, program, facts))
        runs = [(problem, program) for problem, *_, program, facts in pending if needs_tests(facts)]
        executions = iter(self.executor.run(runs)) if runs else iter(())
        judged = []
        for problem, aux_code, main_code, aux_error, main_error, program, facts in pending:
            execution = next(executions) if needs_tests(facts) else None
            passed, total = (execution.tests_passed, execution.tests_total) if execution else (0, 0)
            judged.append(Judged(aux_code, main_code, aux_error, main_error, program, facts, execution,
                                 score_levels(facts, passed, total)))
        return judged

    def rewards(self, problems: Sequence[Mapping[str, Any]], aux: Sequence[str], main: Sequence[str]) -> list[float]:
        """The joint reward (the levels' total, in [0, 4]) of each answer; records level metrics and samples."""
        judged = self.judge_many(problems, aux, main)
        with self._lock:
            for problem, item in zip(problems, judged):
                values = item.score.as_dict()
                for level in LEVELS:
                    self._levels[level].append(float(values[level]))
                self._all_passed.append(float(item.score.tests_total > 0
                                              and item.score.tests_passed == item.score.tests_total))
                self._samples.append({"task_id": problem["task_id"], "aux": item.aux_code, "main": item.main_code,
                                     **{level: values[level] for level in LEVELS},
                                     "tests_passed": item.score.tests_passed, "tests_total": item.score.tests_total,
                                     "verdicts": "".join("." if ok else "F" for ok in item.execution.passed)
                                     if item.execution else "", "syntax_error": item.score.syntax_error or ""})
            del self._samples[:-SAMPLES_KEPT]
        return [item.score.total for item in judged]

    def sample_rows(self) -> list[dict[str, Any]]:
        """The answers judged in the last step or evaluation (at most :data:`SAMPLES_KEPT`; the windows are the
        drains of :meth:`drain_metrics`, once a step and once an evaluation): task, both agents' code, levels,
        per-test verdicts. At the end of a pipeline run, the gate's evaluation of the held-out problems."""
        with self._lock:
            return [dict(row) for row in (self._samples or self._last_samples)]

    def drain_metrics(self) -> dict[str, float]:
        """Means of each level since the last drain (``coding/<level>``) and the share of answers passing all tests."""
        with self._lock:
            metrics = {f"{METRIC_PREFIX}{level}": sum(values) / len(values)
                       for level, values in self._levels.items() if values}
            if self._all_passed:
                metrics[f"{METRIC_PREFIX}pass_all"] = sum(self._all_passed) / len(self._all_passed)
            for values in self._levels.values():
                values.clear()
            self._all_passed.clear()
            if self._samples:
                self._last_samples, self._samples = self._samples, []
        return metrics

    def transition(self, prompt: str, agent_completions: Sequence[str], *, batch_item: Mapping[str, Any] | None = None,
                   **_: Any) -> list[str]:
        """``external_transition`` for two turns: each agent's next problem text carries its first answer and the
        feedback from that answer's stored execution. The problem is ``batch_item`` (the episode's row, which the
        rollout passes); without one, the bundled HumanEval problem whose prompt is ``prompt``."""
        problem = batch_item if batch_item is not None else bundled_problem(prompt)
        if problem is None:
            raise KeyError("the coding transition got a prompt that is no bundled HumanEval problem and no row: call "
                           "it as the rollout does, with batch_item= (the row the formatters were given)")
        item, = self.judge_many([problem], [agent_completions[0]], [agent_completions[1]])
        return [feedback(problem, item.facts, item.score, item.execution, role, code, error)
                for role, (code, error) in enumerate(((item.aux_code, item.aux_error),
                                                      (item.main_code, item.main_error)))]


REWARD_RANGE = CodingTask.reward_range


def make_reward(*, isolation: str = "full", workers: int | None = None, timeout: float = 10.0,
                call_timeout: float = 3.0, memory_mb: int = 512, warm: bool | None = None) -> CodingTask:
    """A coding task with its own sandbox (:class:`Executor`'s settings), e.g. from a run spec:
    ``reward: {entry_point: comlrl.tasks.coding:make_reward, kwargs: {isolation: full, workers: 2, timeout: 10}}``."""
    return CodingTask(Executor(isolation=isolation, workers=workers, timeout=timeout, call_timeout=call_timeout,
                               memory_mb=memory_mb, warm=warm))
