"""From two completions to one program, read only by parsing (``ast``): nothing here runs what a model wrote.

:func:`extract_code` takes the code out of a completion (the first fenced block if there is one; else
the longest run of leading lines that parses), keeps its imports and top-level function definitions
and drops everything else (calls, prints, ``if __name__ == "__main__"`` blocks, prose). :func:`joint_program`
puts the problem's preamble, the aux agent's code and the main agent's code together;
:func:`function`, :func:`returns_something`, :func:`aux_calls`, :func:`ignores_aux_result` and
:func:`is_wrapper` answer the questions the reward's levels ask about it.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

AUX = "aux"
FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
KEPT = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Import, ast.ImportFrom)


@dataclass(frozen=True)
class Extracted:
    """The code kept from one completion; ``error`` (``line N: message``) when the completion's code did not
    parse whole (then ``code`` holds what its longest parsing prefix defines, possibly nothing)."""

    code: str
    error: str | None = None


def _parse(text: str) -> ast.Module | SyntaxError:
    try:
        return ast.parse(text)
    except SyntaxError as error:
        return error
    except (ValueError, RecursionError, MemoryError) as error:  # null bytes; absurd nesting
        return SyntaxError(str(error) or type(error).__name__)


def extract_code(completion: str) -> Extracted:
    """The imports and function definitions of a completion (see the module's docstring)."""
    fenced = FENCE.search(completion)
    text = fenced.group(1) if fenced else completion
    tree = _parse(text)
    problem = None
    if isinstance(tree, SyntaxError):
        problem = described(tree)
        lines = text.splitlines()
        for end in range(len(lines) - 1, 0, -1):  # the longest prefix that parses: code, then prose
            prefix = _parse("\n".join(lines[:end]))
            if not isinstance(prefix, SyntaxError) and any(isinstance(node, KEPT) for node in prefix.body):
                tree = prefix
                break
        else:
            return Extracted("", problem)
    kept = [node for node in tree.body if isinstance(node, KEPT)]
    return Extracted("\n\n".join(ast.unparse(node) for node in kept), problem)


def described(error: SyntaxError) -> str:
    return f"line {error.lineno}: {error.msg}" if error.lineno else str(error.msg)


def syntax_error(code: str) -> str | None:
    """Why ``code`` does not compile (``line N: message``), or None. Compiling runs nothing, and it finds what
    parsing alone lets through: a repeated argument, ``nonlocal`` with nothing to bind, a late ``__future__``."""
    tree = _parse(code)
    if isinstance(tree, SyntaxError):
        return described(tree)
    try:
        compile(tree, "program.py", "exec", dont_inherit=True)
    except SyntaxError as error:
        return described(error)
    except (ValueError, RecursionError, MemoryError) as error:
        return str(error) or type(error).__name__
    return None


def without(code: str, name: str) -> str:
    """``code`` less its top-level definitions of ``name`` (an agent may not write the other's function)."""
    tree = _parse(code)
    if isinstance(tree, SyntaxError):
        return code
    kept = [node for node in tree.body if not (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                                               and node.name == name)]
    return "\n\n".join(ast.unparse(node) for node in kept)


def joint_program(preamble: str, aux_code: str, main_code: str) -> str:
    """The program the tests run: the problem's preamble, then aux's code, then main's."""
    return "\n\n".join(part for part in (preamble, aux_code, main_code) if part.strip()) + "\n"


def function(code: str, name: str) -> ast.FunctionDef | None:
    """The last top-level definition of ``name`` in ``code`` (the one Python keeps), if any."""
    tree = _parse(code)
    if isinstance(tree, SyntaxError):
        return None
    found = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name]
    return found[-1] if found else None


def returns_something(node: ast.FunctionDef | None) -> bool:
    """A definition whose body returns a value somewhere (``return x``; a bare ``return`` does not count)."""
    return node is not None and any(isinstance(child, ast.Return) and child.value is not None for child in ast.walk(node))


def aux_calls(node: ast.FunctionDef) -> list[ast.Call]:
    return [child for child in ast.walk(node)
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and child.func.id == AUX]


def ignores_aux_result(node: ast.FunctionDef) -> bool:
    """Every call of ``aux`` in ``node`` is a statement of its own: its result is thrown away."""
    calls = aux_calls(node)
    bare = {id(child.value) for child in ast.walk(node) if isinstance(child, ast.Expr)}
    return bool(calls) and all(id(call) in bare for call in calls)


def is_wrapper(node: ast.FunctionDef) -> bool:
    """Main only hands its work to aux: ``return aux(...)``, or ``x = aux(...)`` then ``return x``."""
    body = [statement for statement in node.body
            if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant))]  # docstrings
    if len(body) == 1 and isinstance(body[0], ast.Return):
        value = body[0].value
        return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == AUX
    if len(body) == 2 and isinstance(body[0], ast.Assign) and isinstance(body[1], ast.Return):
        value, returned = body[0].value, body[1].value
        targets = body[0].targets
        return (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == AUX
                and len(targets) == 1 and isinstance(targets[0], ast.Name) and isinstance(returned, ast.Name)
                and returned.id == targets[0].id)
    return False
