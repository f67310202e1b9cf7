"""Running a joint program's tests: the harness in the sandbox, and the verdicts it recorded.

Each (problem, program) runs once per :class:`Executor` (a bounded cache keyed by the problem and the
program text), so a reward and the next turn's feedback read the same stored execution. A verdict is
taken only from the records the harness's judge wrote (:mod:`comlrl.tasks.coding.harness`): a test
counts as passed when its own record says so; a missing record (the judge killed or out of time, a
test the run never reached) is a failure, whatever the exit status.
"""

from __future__ import annotations

import functools
import marshal
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from comlrl.sandbox import Sandbox, SandboxLimits, SandboxResult
from comlrl.tasks.coding.problems import TestPlan, preamble, problem_imports, test_plan

HARNESS = Path(__file__).resolve().parent / "harness.py"
HEADER = 12  # the harness's length prefix
# What a warm worker imports once: the harness's own modules and those HumanEval's prompts import.
PRELOAD = ("ctypes", "marshal", "select", "time", "typing", "math", "collections", "itertools", "functools",
           "string", "random", "copy", "re", "hashlib")


@dataclass(frozen=True)
class Execution:
    """What the harness recorded for one program: per test (in the plan's order) passed or not, and why not."""

    passed: tuple[bool, ...]
    errors: tuple[str | None, ...]
    finished: bool  # the judge wrote its last line
    timed_out: bool = False

    @property
    def tests_passed(self) -> int:
        return sum(self.passed)

    @property
    def tests_total(self) -> int:
        return len(self.passed)


@functools.lru_cache(maxsize=1)
def harness_source() -> str:
    return HARNESS.read_text(encoding="utf-8")


@functools.lru_cache(maxsize=512)
def plan_for(test_source: str) -> TestPlan:
    return test_plan(test_source)


def framed(message: Mapping[str, Any]) -> bytes:
    data = marshal.dumps(dict(message))
    return b"%0*d" % (HEADER, len(data)) + data


def harness_input(problem: Mapping[str, Any], program: str, call_timeout: float) -> bytes:
    """The harness's standard input: the program part (read before its server starts), then the tests."""
    plan = plan_for(problem["test"])
    statements = [(statement.source, statement.test) for statement in plan.statements]
    return (framed({"program": program, "entry_point": problem["entry_point"], "call_timeout": float(call_timeout),
                    "imports": problem_imports(problem["prompt"]), "harness": harness_source()})
            + framed({"preamble": preamble(problem), "module": plan.module, "statements": statements}))


def verdicts(plan: TestPlan, result: SandboxResult) -> Execution:
    """Read the judge's records from the harness's output; anything else on it is ignored."""
    test_indices = [index for index, statement in enumerate(plan.statements) if statement.test]
    recorded: dict[int, tuple[bool, str | None]] = {}
    finished = False
    wanted = set(test_indices)
    for line in result.stdout.splitlines():
        if line == "done":
            finished = True
            continue
        fields = line.split(" ")
        if len(fields) not in (3, 4) or fields[0] != "test" or not fields[1].isdigit():
            continue
        index = int(fields[1])
        if index not in wanted or index in recorded:
            continue
        if fields[2] == "1" and len(fields) == 3:
            recorded[index] = (True, None)
        elif fields[2] == "0" and len(fields) == 4:
            try:
                recorded[index] = (False, bytes.fromhex(fields[3]).decode("utf-8", "replace"))
            except ValueError:
                recorded[index] = (False, "unreadable record")
    passed, errors = [], []
    for index in test_indices:
        ok, error = recorded.get(index, (False, "not reached: the run ended first" if not result.timed_out
                                         else "not reached: the run timed out"))
        passed.append(ok)
        errors.append(None if ok else error)
    return Execution(tuple(passed), tuple(errors), finished, result.timed_out)


class Executor:
    """Runs programs' tests in a :class:`~comlrl.sandbox.Sandbox`, each (problem, program) once."""

    def __init__(self, *, workers: int | None = None, isolation: str = "full", timeout: float = 10.0,
                 call_timeout: float = 3.0, memory_mb: int = 512, cache_size: int = 4096, warm: bool | None = None) -> None:
        if not 0 < call_timeout <= timeout:
            raise ValueError(f"call_timeout must be in (0, timeout={timeout}], got {call_timeout}")
        warm = isolation == "full" if warm is None else warm
        self.settings = dict(workers=workers, isolation=isolation, warm=warm, preload=PRELOAD if warm else (),
                             limits=SandboxLimits(timeout=timeout, memory_mb=memory_mb))
        self.call_timeout = call_timeout
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], Execution] = OrderedDict()
        self._lock = threading.Lock()
        self._sandbox: Sandbox | None = None
        self.runs = 0  # programs actually run (cache misses)

    @property
    def sandbox(self) -> Sandbox:
        if self._sandbox is None:
            self._sandbox = Sandbox(**self.settings)  # checks the isolation here, before any program runs
            # Closed by close(), or when this executor is collected or the interpreter exits, whichever is first.
            self._closing = weakref.finalize(self, self._sandbox.close)
        return self._sandbox

    def run(self, jobs: Sequence[tuple[Mapping[str, Any], str]]) -> list[Execution]:
        """Executions of ``(problem, program)`` pairs, running (in parallel) only those not yet run."""
        keys = [(problem["task_id"], program) for problem, program in jobs]
        problems = {key: problem for key, (problem, _) in zip(keys, jobs)}
        with self._lock:
            found = {key: self._cache[key] for key in keys if key in self._cache}
        missing = [key for key in OrderedDict.fromkeys(keys) if key not in found]
        if missing:
            inputs = [harness_input(problems[key], key[1], self.call_timeout) for key in missing]
            results = self.sandbox.map([harness_source()] * len(missing), inputs)
            for key, result in zip(missing, results):
                found[key] = verdicts(plan_for(problems[key]["test"]), result)
            with self._lock:
                self.runs += len(missing)
                for key in missing:
                    self._cache[key] = found[key]
                    self._cache.move_to_end(key)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return [found[key] for key in keys]

    def close(self) -> None:
        """End the sandbox's workers and remove their folders; a later run starts a new sandbox."""
        if self._sandbox is not None:
            self._closing()
            self._sandbox = None
