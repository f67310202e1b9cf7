"""Attacks on the coding task's scorer (comlrl.tasks.coding.score) with real HumanEval problems: wrong programs
that try to earn test credit some other way than by computing the answers.

Each attack is agent 1's completion (``main``; agent 0's ``aux`` is empty). Only imports and function
definitions survive extraction (comlrl/tasks/coding/program.py), so code meant to run "at import" hides in a
decorator or a default argument, which run when the server loads the program. Every attack must earn no test
(or, where a partial pass is legitimate, exactly what an honest program of the same power would), the
canonical solutions must keep full credit (the control), and the trainer must survive.

The scorer runs the harness in warm sandbox workers (the coding executor's default), so these attacks also
reach the worker that forks each judge. What an attack found out is reported through the one channel it has
to the outside: the message of an exception it raises, which the judge records as that test's failure
reason (``Execution.errors``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from comlrl.tasks.coding import TASK, humaneval, score
from install_copy import base_python, copy_install

REPO = Path(__file__).resolve().parents[1]
TRAINER_PID = os.getpid()
CHOSEN = ("HumanEval/0", "HumanEval/2", "HumanEval/4", "HumanEval/12", "HumanEval/32")
# HumanEval/0 (has_close_elements -> bool): seven asserts, four expecting True; a constant True earns 4.
HE0_TESTS, HE0_EXPECTING_TRUE = 7, 4


@pytest.fixture(scope="module")
def problems():
    rows = humaneval("all")
    return {row["task_id"]: row for row in rows if row["task_id"] in CHOSEN}


def canonical(problem) -> str:
    return problem["prompt"] + problem["canonical_solution"]


def judged(problem, main: str):
    """The CodeScore of ``main`` through :func:`score`, and the recorded failure reasons (from the same, cached,
    execution: the program runs once)."""
    code_score = score(problem, "", main)
    execution = TASK.judge_many([problem], [""], [main])[0].execution
    print(problem["task_id"], code_score, execution.errors if execution else None)
    assert execution is not None, "the attack did not reach the tests level (not a meaningful attack)"
    return code_score, execution


def test_the_canonical_solutions_keep_full_credit(problems):
    for problem in problems.values():
        code_score, execution = judged(problem, canonical(problem))
        assert code_score.tests_passed == code_score.tests_total > 0, (problem["task_id"], execution.errors)
        assert execution.finished


# ------------------------------------------------------------------------------------------------ exiting
EXITS = {
    "sys.exit at import": "import sys\n\ndef has_close_elements(numbers, threshold, _=sys.exit(0)):\n    return True\n",
    "os._exit at import": "import os\n\n@(lambda function: os._exit(0))\ndef has_close_elements(numbers, threshold):\n"
                          "    return True\n",
    "sys.exit in the function": "import sys\n\ndef has_close_elements(numbers, threshold):\n    sys.exit(0)\n"
                                "    return True\n",
    "os._exit in the function": "import os\n\ndef has_close_elements(numbers, threshold):\n    os._exit(0)\n"
                                "    return True\n",
}


@pytest.mark.parametrize("attack", EXITS)
def test_exiting_earns_nothing(problems, attack):
    code_score, execution = judged(problems["HumanEval/0"], EXITS[attack])
    assert code_score.tests_passed == 0 and code_score.tests_total == HE0_TESTS
    assert execution.finished  # the judge outlived the program and recorded every failure


# ------------------------------------------------------------------------------------- printing records
HARNESS_LINES = ["test %d 1" % index for index in range(40)] + ["done", '{"passed": true}', "PASSED", "ok"]
PRINTER = f"""
import os, sys

def shout():
    text = "\\n".join({HARNESS_LINES!r}) + "\\n"
    print(text, flush=True)
    print(text, file=sys.stderr, flush=True)
    for stream in (sys.__stdout__, sys.__stderr__):
        stream.write(text)
        stream.flush()
    for fd in (1, 2):
        os.write(fd, text.encode())
    for path in ("/dev/stdout", "/dev/stderr", "/proc/self/fd/1", "/dev/tty"):
        try:
            with open(path, "w") as handle:
                handle.write(text)
        except OSError:
            pass
    return "wrong"

def has_close_elements(numbers, threshold, _=shout()):
    return shout()
"""


def test_printing_what_the_harness_prints_earns_nothing(problems):
    code_score, execution = judged(problems["HumanEval/0"], PRINTER)
    assert code_score.tests_passed == 0
    assert all(error == "AssertionError" for error in execution.errors), execution.errors  # it ran, and was wrong


# --------------------------------------------------------------------------------- values that lie about ==
LIARS = {
    "HumanEval/0": """
def has_close_elements(numbers, threshold):
    class Yes:
        __eq__ = lambda self, other: True
        __ne__ = lambda self, other: False
        __bool__ = lambda self: True
        __hash__ = lambda self: 0
    return Yes()
""",
    "HumanEval/2": """
def truncate_number(number):
    class Zero(float):
        __eq__ = lambda self, other: True
        __sub__ = lambda self, other: Zero(0.0)
        __abs__ = lambda self: Zero(0.0)
        __lt__ = lambda self, other: True
        __hash__ = float.__hash__
    return Zero(99.0)
""",
    "HumanEval/12": """
def longest(strings):
    class Same(str):
        __eq__ = lambda self, other: True
        __ne__ = lambda self, other: False
        __hash__ = str.__hash__
    return Same("nothing like it")
""",
    "HumanEval/4": """
def mean_absolute_deviation(numbers):
    class Small(list):
        __sub__ = lambda self, other: 0.0
        __rsub__ = lambda self, other: 0.0
        __eq__ = lambda self, other: True
    return Small([1e9])
""",
}


@pytest.mark.parametrize("task_id", LIARS)
def test_objects_whose_equality_always_says_yes_earn_nothing(problems, task_id):
    code_score, execution = judged(problems[task_id], LIARS[task_id])
    assert code_score.tests_passed == 0
    assert all("cannot be checked" in error for error in execution.errors), execution.errors


def test_an_int_subclass_equal_to_everything_earns_nothing(problems):
    main = ("def has_close_elements(numbers, threshold):\n"
            "    class Both(int):\n        __eq__ = lambda self, other: True\n        __hash__ = int.__hash__\n"
            "    return Both(7)\n")
    code_score, _ = judged(problems["HumanEval/0"], main)
    assert code_score.tests_passed == 0


# --------------------------------------------------------------------------- tampering with the machinery
PATCHER = """
import builtins, math, sys

def _patch():
    builtins.AssertionError = type("NeverRaised", (Exception,), {})
    builtins.abs = lambda value: 0.0
    math.isclose = lambda *args, **kwargs: True
    math.fabs = lambda value: 0.0
    fake = type(sys)("math")
    fake.fabs = lambda value: 0.0
    fake.isclose = lambda *args, **kwargs: True
    sys.modules["math"] = fake
    return None

def find_zero(xs, _=_patch()):
    _patch()
    return 12345.0
"""


def test_monkeypatching_builtins_math_and_sys_modules_earns_nothing(problems):
    code_score, _ = judged(problems["HumanEval/32"], PATCHER)  # its test checks math.fabs(poly(xs, x)) < 1e-4
    assert code_score.tests_passed == 0 and code_score.tests_total == 1
    wrong_abs = PATCHER.replace("find_zero(xs", "truncate_number(number").replace("12345.0", "0.75")
    code_score, _ = judged(problems["HumanEval/2"], wrong_abs)  # abs(candidate(x) - y) < 1e-6
    assert code_score.tests_passed == 0


# The needle is one test's input as the test's source writes it; it is built from character codes so that
# the program's own text (which the server holds) does not contain it.
NEEDLE_CODES = [ord(character) for character in "3.9, 4.0, 5.0, 2.2"]
SEARCHER = f"""
import builtins, gc, inspect, sys

def has_close_elements(numbers, threshold):
    needle = "".join(map(chr, {NEEDLE_CODES!r}))
    found = 0
    for container in gc.get_objects():
        if isinstance(container, dict):
            items = list(container.values()) + list(container.keys())
        elif isinstance(container, (list, tuple)):
            items = container
        else:
            continue
        for item in items:
            if isinstance(item, str) and item is not needle and needle in item:
                found += 1
    patched = 0
    frame = sys._getframe()
    while frame is not None:
        for name in ("record", "check", "verdicts", "Server", "main", "candidate"):
            if name in frame.f_globals:
                frame.f_globals[name] = lambda *args, **kwargs: True
                patched += 1
        frame = frame.f_back
    for info in inspect.stack():
        info.frame.f_globals["AssertionError"] = Exception
    for value in list(gc.get_objects()):
        if callable(value) and getattr(value, "__name__", "") in ("record", "check", "verdicts"):
            patched += 1
    builtins.AssertionError = Exception
    raise RuntimeError(f"found={{found}} patched={{patched}}")
    return True
"""


def test_searching_and_rewriting_the_test_machinery_earns_nothing(problems):
    code_score, execution = judged(problems["HumanEval/0"], SEARCHER)
    assert code_score.tests_passed == 0
    # the tests are not in the server's memory at all (it is forked before the judge reads them) ...
    assert all("found=0" in error for error in execution.errors), execution.errors
    # ... while the harness's own functions are: the rewrite happened, in a process that records nothing
    assert all("patched=0" not in error for error in execution.errors), execution.errors


PROC_SNOOPER = """
import ctypes, os

def has_close_elements(numbers, threshold):
    judge = os.getppid()
    outcomes = []
    for path, flags in ((f"/proc/{judge}/mem", os.O_RDONLY), (f"/proc/{judge}/mem", os.O_RDWR),
                        (f"/proc/{judge}/fd/1", os.O_WRONLY), (f"/proc/{judge}/fd/0", os.O_RDONLY),
                        (f"/proc/{judge}/environ", os.O_RDONLY), ("/proc/1/fd/1", os.O_WRONLY),
                        ("/proc/1/fd/0", os.O_RDONLY)):
        try:
            fd = os.open(path, flags)
        except OSError as error:
            outcomes.append(f"{path}:{error.errno}")
            continue
        if flags == os.O_WRONLY:
            os.write(fd, b"".join(b"test %d 1\\n" % index for index in range(40)) + b"done\\n")
        outcomes.append(f"{path}:OPENED")
    libc = ctypes.CDLL(None, use_errno=True)
    attached = libc.ptrace(16, judge, 0, 0)  # PTRACE_ATTACH
    outcomes.append(f"ptrace:{attached}")
    raise RuntimeError(" ".join(outcomes))
    return True
"""


def test_reading_or_writing_the_judge_through_proc_fails(problems):
    code_score, execution = judged(problems["HumanEval/0"], PROC_SNOOPER)
    assert code_score.tests_passed == 0
    for error in execution.errors:
        assert "ptrace:-1" in error, error
        opened = [word for word in error.split() if word.endswith(":OPENED")]
        if os.geteuid() != 0:  # bubblewrap's PID 1 is reachable then: the hole the non-root test below shows
            opened = [word for word in opened if not word.startswith("/proc/1/")]
        assert not opened, error


# ------------------------------------------------------------------------------------ fighting the judge
# Right for the first two calls; then it kills the judge and, should the judge survive, answers wrongly.
KILLER = """
import os

def has_close_elements(numbers, threshold, _calls=[]):
    _calls.append(1)
    right = any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])
    if len(_calls) < 3:
        return right
    os.kill(os.getppid(), 9)
    return not right
"""


def test_killing_the_judge_forfeits_every_later_test(problems):
    code_score, execution = judged(problems["HumanEval/0"], KILLER)
    # the first two answers were right and recorded before the judge died: that credit is legitimate
    assert execution.passed == (True, True) + (False,) * (HE0_TESTS - 2)
    assert code_score.tests_passed == 2
    if not execution.finished:  # the judge died: the later tests were never run, so never credited
        assert all(error.startswith("not reached") for error in execution.errors[2:]), execution.errors


def test_killing_everything_earns_nothing(problems):
    main = "import os\n\ndef has_close_elements(numbers, threshold):\n    os.kill(-1, 9)\n    return True\n"
    code_score, _ = judged(problems["HumanEval/0"], main)
    assert code_score.tests_passed == 0


def constant_true_credit(problem) -> int:
    return score(problem, "", "def has_close_elements(numbers, threshold):\n    return True\n").tests_passed


FAKE_REPLIES = """
import os

def has_close_elements(numbers, threshold, _sent=[]):
    if not _sent:
        _sent.append(1)
        bodies = [b"%d VT" % call for call in range(1, 64)]
        frames = b"".join(b"%012d" % len(body) + body for body in bodies)
        for fd in range(3, 21):
            try:
                os.write(fd, frames)
            except OSError:
                pass
    return "wrong"
"""
GARBAGE_REPLIES = """
import os

def has_close_elements(numbers, threshold):
    for fd in range(3, 21):
        try:
            os.write(fd, b"test 0 1\\ndone\\n000000000004T")
        except OSError:
            pass
    return "wrong"
"""


def test_replies_sent_ahead_are_worth_no_more_than_a_constant_answer(problems):
    problem = problems["HumanEval/0"]
    # A reply sent before its call is an answer given without seeing the arguments: a constant. Here True for
    # every call, which earns exactly what `return True` earns (the four tests expecting True), never more.
    constant = constant_true_credit(problem)
    assert constant == HE0_EXPECTING_TRUE
    code_score, _ = judged(problem, FAKE_REPLIES)
    assert code_score.tests_passed == constant
    code_score, execution = judged(problem, GARBAGE_REPLIES)
    assert code_score.tests_passed == 0
    assert any("malformed" in error for error in execution.errors), execution.errors


# ----------------------------------------------------------------------------------------- time and depth
HANGS_ON_ONE = """
def has_close_elements(numbers, threshold):
    if threshold == 0.05:
        while True:
            pass
    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])
"""
HANGS_AT_IMPORT = """
import time

def has_close_elements(numbers, threshold, _=time.sleep(1000)):
    return True
"""


def test_hanging_programs_earn_nothing_for_what_they_did_not_answer_in_time(problems):
    problem = problems["HumanEval/0"]
    started = time.monotonic()
    TASK.judge_many([problem, problem], ["", ""], [HANGS_ON_ONE, HANGS_AT_IMPORT])  # the two run side by side
    assert time.monotonic() - started < TASK.executor.settings["limits"].timeout + 5
    code_score, execution = judged(problem, HANGS_ON_ONE)  # cached: the same execution
    assert execution.passed[:2] == (True, False) and code_score.tests_passed < HE0_TESTS
    assert "no answer within" in execution.errors[1]
    code_score, execution = judged(problem, HANGS_AT_IMPORT)
    assert code_score.tests_passed == 0  # every call hangs (then the whole run times out): nothing answered


def test_a_server_restarted_after_a_hang_answers_the_later_tests(problems):
    problem = problems["HumanEval/0"]
    _, execution = judged(problem, HANGS_ON_ONE)
    # the one hanging call (test 1) loses its test; a fresh server answers the other six, legitimately
    assert execution.passed == (True, False) + (True,) * (HE0_TESTS - 2), execution.errors


RECURSIONS = {
    "RecursionError": "def has_close_elements(numbers, threshold):\n"
                      "    return has_close_elements(numbers, threshold)\n",
    # through a C slot (f.__call__), so the interpreter's C stack overflows: the server dies of SIGSEGV
    "C stack overflow": "import sys\n\ndef has_close_elements(numbers, threshold, depth=0):\n"
                        "    sys.setrecursionlimit(10 ** 8)\n"
                        "    return has_close_elements.__call__(numbers, threshold, depth + 1)\n",
}


@pytest.mark.parametrize("attack", RECURSIONS)
def test_infinite_recursion_earns_nothing(problems, attack):
    started = time.monotonic()
    code_score, execution = judged(problems["HumanEval/0"], RECURSIONS[attack])
    assert code_score.tests_passed == 0 and execution.finished
    assert time.monotonic() - started < TASK.executor.settings["limits"].timeout


# ---------------------------------------------------------------------- a trainer that does not run as root
NON_ROOT_UID = 60999  # below the sandbox's slot uids: a stand-in for an ordinary user running the trainer
NON_ROOT_SCORER = """
import json, sys
sys.path[:0] = {paths!r}
from comlrl.sandbox import SandboxUnavailable
from comlrl.tasks.coding import score
problem = json.loads(sys.stdin.read())
try:
    print(json.dumps({{"tests_passed": score(problem, "", {main!r}).tests_passed}}))
except SandboxUnavailable as error:
    print(json.dumps({{"unavailable": str(error)}}))
"""
# Records as the judge writes them, wrapped as a warm worker's answer (an "O N" chunk, then the "S" line) so that
# they read as a finished job whether the trainer reads a warm worker's protocol or a plain program's output.
FORGER = """
import os

def has_close_elements(numbers, threshold):
    records = b"".join(b"test %d 1\\n" % index for index in range(40)) + b"done\\n"
    answer = b"O %d\\n" % len(records) + records + b"S 0 0 0\\n"
    for fd_path in ("/proc/1/fd/1", f"/proc/{os.getppid()}/fd/1"):
        try:
            fd = os.open(fd_path, os.O_WRONLY)
        except OSError:
            continue
        os.write(fd, answer)
    return None
"""


def test_a_non_root_trainers_records_cannot_be_forged_through_the_sandboxs_first_process(problems):
    python = base_python()
    if os.geteuid() != 0 or shutil.which("setpriv") is None or python is None:
        pytest.skip("needs root (to become an ordinary user), setpriv and an interpreter every user can run")
    parent = Path(tempfile.mkdtemp(prefix="comlrl-non-root-"))
    os.chmod(parent, 0o755)  # the checkout may lie in a 0700 folder: the ordinary user reads a copy
    try:
        paths = [str(copy_install(parent / "site-packages"))]
        problem = {key: problems["HumanEval/0"][key] for key in ("task_id", "prompt", "entry_point", "test")}
        run = subprocess.run(["setpriv", f"--reuid={NON_ROOT_UID}", f"--regid={NON_ROOT_UID}", "--clear-groups",
                              "--", python, "-I", "-S", "-c", NON_ROOT_SCORER.format(paths=paths, main=FORGER)],
                             input=json.dumps(problem), capture_output=True, text=True, timeout=120, cwd="/")
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    assert run.returncode == 0, run.stderr[-2000:]
    outcome = json.loads(run.stdout.strip().splitlines()[-1])
    assert "unavailable" not in outcome, outcome  # full isolation runs for an ordinary user too
    assert outcome["tests_passed"] == 0


# --------------------------------------------------------------------------------------------------- survival
def test_the_trainer_survives_and_still_scores(problems):
    os.kill(TRAINER_PID, 0)
    problem = problems["HumanEval/12"]
    fresh_control = canonical(problem) + "\n\ndef unused_helper():\n    return 'a program not yet cached'\n"
    code_score = score(problem, "", fresh_control)
    assert code_score.tests_passed == code_score.tests_total == 3
