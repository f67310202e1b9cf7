"""The reward's levels: pure functions of a joint program's shape and of its recorded test verdicts.

The levels, kept from the original coding reward (its ranges and its order; each level is reached only
when the one before it holds), with a total in [0, 4]:

1. **structure**, up to 1.0: aux's code defines ``aux`` returning a value (+0.4, optional) and main's
   code defines the problem's entry function returning a value (+0.6). Without the entry function the
   score stops here.
2. **syntax**, 0 or 0.5: the joint program (the problem's imports and helpers, aux's code, main's code)
   parses. Without it the score stops here.
3. **tests**, 0 to 1.0: the share of the problem's tests passed (:attr:`CodeScore.tests_passed` of
   :attr:`CodeScore.tests_total`), as the sandboxed harness recorded them.
4. **cooperation**, from -0.5 to 1.5, only when aux is defined and at least one test passed: +0.5 when
   main's entry function calls ``aux``; +1.0 more when it is not a bare wrapper of aux
   (``return aux(...)``, or ``x = aux(...)`` then ``return x``); -0.5 when every call of ``aux`` throws
   its result away. Unlike the original, calls are found in the syntax tree (a call in a comment or a
   string is no call, and ``aux(x)`` as a statement is caught whatever its spacing).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from comlrl.tasks.coding import program as shape

AUX_DEFINED = 0.4
MAIN_DEFINED = 0.6
SYNTAX = 0.5
CALLS_AUX = 0.5
NOT_A_WRAPPER = 1.0
IGNORES_RESULT = -0.5
MAX_TOTAL = AUX_DEFINED + MAIN_DEFINED + SYNTAX + 1.0 + CALLS_AUX + NOT_A_WRAPPER  # 4.0


@dataclass(frozen=True)
class CodeScore:
    """One joint answer's levels (see the module's docstring) and their sum, ``total`` in [0, 4]."""

    structure: float
    syntax: float
    tests_passed: int
    tests_total: int
    cooperation: float
    total: float
    aux_defined: bool = False
    main_defined: bool = False
    syntax_error: str | None = None

    @property
    def tests(self) -> float:
        """The tests level: the share passed, 0 when none were run."""
        return self.tests_passed / self.tests_total if self.tests_total else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "tests": self.tests}


@dataclass(frozen=True)
class Shape:
    """What the levels need to know about the two agents' code, read from its syntax tree."""

    aux_defined: bool
    main_defined: bool
    syntax_error: str | None
    calls_aux: bool = False
    wrapper: bool = False
    ignores_result: bool = False


def read_shape(aux_code: str, main_code: str, entry_point: str, program: str, syntax_error: str | None) -> Shape:
    """The structure and cooperation facts of a joint answer (nothing is run)."""
    aux = shape.function(aux_code, shape.AUX)
    main = shape.function(main_code, entry_point)
    main_defined = shape.returns_something(main)
    if syntax_error is None:
        syntax_error = shape.syntax_error(program)
    if main is None:
        return Shape(shape.returns_something(aux), False, syntax_error)
    return Shape(shape.returns_something(aux), main_defined, syntax_error, calls_aux=bool(shape.aux_calls(main)),
                 wrapper=shape.is_wrapper(main), ignores_result=shape.ignores_aux_result(main))


def needs_tests(facts: Shape) -> bool:
    """Whether the tests level is reached: the entry function is defined and the program parses."""
    return facts.main_defined and facts.syntax_error is None


def score_levels(facts: Shape, tests_passed: int = 0, tests_total: int = 0) -> CodeScore:
    """The levels of a joint answer from its shape and its recorded verdicts (pure; see the module's docstring)."""
    structure = AUX_DEFINED * facts.aux_defined + MAIN_DEFINED * facts.main_defined
    if not facts.main_defined:
        return CodeScore(structure, 0.0, 0, tests_total, 0.0, structure, facts.aux_defined, False, facts.syntax_error)
    if facts.syntax_error is not None:
        return CodeScore(structure, 0.0, 0, tests_total, 0.0, structure, facts.aux_defined, True, facts.syntax_error)
    share = tests_passed / tests_total if tests_total else 0.0
    cooperation = 0.0
    if facts.aux_defined and tests_passed > 0:
        if facts.calls_aux:
            cooperation += CALLS_AUX + (NOT_A_WRAPPER if not facts.wrapper else 0.0)
        if facts.ignores_result:
            cooperation += IGNORES_RESULT
    total = max(0.0, structure + SYNTAX + share + cooperation)
    return CodeScore(structure, SYNTAX, tests_passed, tests_total, cooperation, total, facts.aux_defined, True, None)
