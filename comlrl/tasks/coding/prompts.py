"""The two roles' prompts and the second turn's feedback, as text (SmolLM2's chat format).

Agent 0 writes a helper ``aux(...)``; agent 1 writes the problem's entry function and may call ``aux``.
Both see the problem (its prompt: signature and docstring); neither sees the other's code in the first
turn. The second turn's problem text carries each agent's own first answer and the feedback built
from the first turn's recorded execution (:func:`feedback`): what was defined, the syntax error with its
line, how many tests passed and the first failing ones with their errors, and (for main) how it used aux.
"""

from __future__ import annotations

import ast
from typing import Any, Mapping

from comlrl.tasks.chat import chat_prompt
from comlrl.tasks.coding.execution import Execution, plan_for
from comlrl.tasks.coding.levels import CodeScore, Shape

AUX_INSTRUCTION = ("Write a Python helper function named aux that would help solve this problem. Output only the "
                   "function's code: no explanation, no examples, no tests.")
MAIN_INSTRUCTION = ("Write the Python function {entry_point}{signature} that solves this problem. You may call a "
                    "helper function aux(...) that another programmer writes; do not define aux yourself. Output "
                    "only the function's code: no explanation, no examples, no tests.")
SHOWN_FAILURES = 2


PREVIOUS_ANSWER = "\n\nYour previous answer:\n"  # where a second turn's text leaves the problem's prompt


def signature(problem: Mapping[str, Any]) -> str:
    """``(a: int, b: int) -> int``: the entry function's parameters and return annotation, from the prompt (in a
    second turn's feedback text, from the problem's prompt it starts with); ``(...)`` when it is not code."""
    try:
        body = ast.parse(problem["prompt"].split(PREVIOUS_ANSWER, 1)[0]).body
    except SyntaxError:
        return "(...)"
    for node in body:
        if isinstance(node, ast.FunctionDef) and node.name == problem["entry_point"]:
            returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
            return f"({ast.unparse(node.args)}){returns}"
    return "(...)"


def aux_prompt(row: Mapping[str, Any]) -> str:
    """Agent 0's prompt: a helper ``aux`` for the row's problem."""
    return chat_prompt(AUX_INSTRUCTION, row["prompt"])


def main_prompt(row: Mapping[str, Any], problem: Mapping[str, Any] | None = None) -> str:
    """Agent 1's prompt: the problem's entry function, which may call ``aux``; ``problem`` (the original row),
    when given, is where the signature is read instead of ``row``."""
    shown = signature(problem or row)
    return chat_prompt(MAIN_INSTRUCTION.format(entry_point=row["entry_point"], signature=shown), row["prompt"])


FORMATTERS = (aux_prompt, main_prompt)


def failures(problem: Mapping[str, Any], execution: Execution | None) -> list[str]:
    """The first failing tests, each as its source and the error the harness recorded."""
    if execution is None:
        return []
    tests = plan_for(problem["test"]).tests
    shown = []
    for source, passed, error in zip(tests, execution.passed, execution.errors):
        if not passed:
            first = source.strip().splitlines()
            text = first[0] + (" ..." if len(first) > 1 else "")
            shown.append(f"- {text[:200]}\n  -> {error or 'failed'}")
        if len(shown) == SHOWN_FAILURES:
            break
    return shown


def feedback(problem: Mapping[str, Any], facts: Shape, score: CodeScore, execution: Execution | None, role: int,
             code: str, extraction_error: str | None) -> str:
    """The second turn's problem text for ``role`` (0 aux, 1 main): the problem, its first answer, the feedback."""
    lines = []
    if role == 0:
        lines.append("aux: " + ("defined." if score.aux_defined else "not defined (write def aux(...) returning a value)."))
    else:
        lines.append(f"{problem['entry_point']}: " + ("defined." if score.main_defined
                                                     else "not defined (write the function, returning a value)."))
    if extraction_error:
        lines.append(f"Syntax error in your code at {extraction_error}.")
    elif score.syntax_error:
        lines.append(f"Syntax error in the combined program at {score.syntax_error}.")
    if execution is not None:
        lines.append(f"Tests: {execution.tests_passed}/{execution.tests_total} passed.")
        lines += failures(problem, execution)
    if role == 1 and score.main_defined:
        lines.append("It does not call aux." if not facts.calls_aux else
                     "It calls aux but throws its result away." if facts.ignores_result else "It uses aux.")
    previous = code.strip() or "(nothing)"
    return (f"{problem['prompt']}{PREVIOUS_ANSWER}{previous}\n\nFeedback:\n" + "\n".join(lines)
            + "\n\nWrite the corrected function.")
