"""The HumanEval coding task end to end: its data, its test plans, its levels on programs run in the real
sandbox, its second-turn feedback, and a tiny-model training run that reports its level metrics.

Every expected number is worked out here by hand from the documented levels (comlrl/tasks/coding/levels.py:
aux defined 0.4, main defined 0.6, syntax 0.5, tests = share passed, calls aux 0.5, not a wrapper 1.0,
result ignored -0.5), never read back from the code under test.
"""

from __future__ import annotations

import ast
import math
import re

import pytest

from comlrl.tasks import coding
from comlrl.tasks.coding import (FORMATTERS, TASK, CodingTask, Executor, aux_prompt, feedback_transition, humaneval,
                                 main_prompt, score)
from comlrl.tasks.coding import test_plan as plan_of  # renamed: pytest would collect test_plan

AUX_DEFINED, MAIN_DEFINED, SYNTAX, CALLS_AUX, NOT_A_WRAPPER, IGNORES_RESULT = 0.4, 0.6, 0.5, 0.5, 1.0, -0.5

# HumanEval/0, has_close_elements: seven asserts, four expecting True and three expecting False.
HE0_TESTS = 7
HE0_TRUE, HE0_FALSE = 4, 3
SOLVE = ("    for i in range(len(numbers)):\n"
         "        for j in range(i + 1, len(numbers)):\n"
         "            if abs(numbers[i] - numbers[j]) < threshold:\n"
         "                return True\n"
         "    return False\n")
AUX = "def aux(numbers, threshold):\n" + SOLVE
HEADER = "def has_close_elements(numbers, threshold):\n"


@pytest.fixture(scope="module")
def splits():
    return {split: humaneval(split) for split in ("train", "eval", "all")}


@pytest.fixture(scope="module")
def he0(splits):
    return splits["all"][0]


def approx(value):
    return pytest.approx(value, abs=1e-9)


# ------------------------------------------------------------------------------------------------- 1. data
def test_splits_sizes_fields_and_order(splits):
    assert [len(splits[s]) for s in ("train", "eval", "all")] == [132, 32, 164]
    for dataset in splits.values():
        assert set(dataset.column_names) == {"task_id", "prompt", "entry_point", "test", "canonical_solution"}
    assert splits["eval"]["task_id"] == [f"HumanEval/{i}" for i in range(32)]
    assert splits["train"]["task_id"] == [f"HumanEval/{i}" for i in range(32, 164)]
    assert splits["all"]["task_id"] == [f"HumanEval/{i}" for i in range(164)]


def test_bad_split_names_the_allowed_ones():
    with pytest.raises(ValueError) as raised:
        humaneval("test")
    message = str(raised.value)
    assert "'test'" in message
    for allowed in ("train", "eval", "all"):
        assert repr(allowed) in message


# ------------------------------------------------------------------------------------------- 2. test plans
HAND_WRITTEN = '''
METADATA = {"author": "me"}


def check(candidate):
    import math
    limit = 3
    assert True
    assert (candidate(1)
            ==
            2), "one"
    for i in range(limit):
        assert candidate(i) == i + 1
    assert math.isclose(candidate(0), 1)
'''


def test_plan_of_a_hand_written_check():
    plan = plan_of(HAND_WRITTEN)
    assert [statement.test for statement in plan.statements] == [False, False, False, True, True, True]
    assert len(plan.tests) == 3
    multi_line, loop, last = (ast.parse(source).body for source in plan.tests)
    # the parenthesised assert over three lines is one statement, kept whole with its message
    assert len(multi_line) == 1 and isinstance(multi_line[0], ast.Assert)
    assert ast.dump(multi_line[0]) == ast.dump(ast.parse("assert candidate(1) == 2, 'one'").body[0])
    assert len(loop) == 1 and isinstance(loop[0], ast.For)
    assert isinstance(loop[0].body[0], ast.Assert)
    assert isinstance(last[0], ast.Assert)
    setup = [s.source for s in plan.statements if not s.test]
    assert setup == ["import math", "limit = 3", "assert True"]
    assert "METADATA" in plan.module and "check" not in plan.module


def test_plan_refuses_a_module_without_check_or_without_tests():
    with pytest.raises(ValueError, match="check"):
        plan_of("def verify(candidate):\n    assert candidate(1) == 2\n")
    with pytest.raises(ValueError, match="assert"):
        plan_of("def check(candidate):\n    x = 1\n    assert True\n")


def test_plan_of_real_problems(splits):
    problems = splits["all"]
    loop_plan = plan_of(problems[32]["test"])
    assert len(loop_plan.tests) == 1
    assert ast.parse(loop_plan.tests[0]).body[0].__class__ is ast.For
    # HumanEval/151: seven `assert candidate(...)` lines (read off its source), two setup assignments
    source = problems[151]["test"]
    by_hand = len(re.findall(r"^\s+assert candidate\(", source, flags=re.MULTILINE))
    assert by_hand == 7
    plan = plan_of(source)
    assert len(plan.tests) == by_hand
    assert [s.source.split(" =")[0] for s in plan.statements if not s.test] == ["lst", "odd_sum"]


# ------------------------------------------------------------------------------- 3. all 164 problems, real tests
@pytest.fixture(scope="module")
def judged_all(splits):
    """One batched call: the canonical solution, a raising one and one returning None, for every problem."""
    problems = [splits["all"][i] for i in range(164)]
    canonical = [p["prompt"] + p["canonical_solution"] for p in problems]
    raising = [f"def {p['entry_point']}(*args):\n    raise ValueError('boom')\n    return 0\n" for p in problems]
    returns_none = [f"def {p['entry_point']}(*args):\n    x = None\n    return x\n" for p in problems]
    judged = TASK.judge_many(problems * 3, [""] * (3 * 164), canonical + raising + returns_none)
    return problems, judged[:164], judged[164:328], judged[328:]


def test_every_canonical_solution_passes_all_its_tests(judged_all):
    problems, canonical, _, _ = judged_all
    failing = [(p["task_id"], j.score.tests_passed, j.score.tests_total, j.execution and j.execution.errors)
               for p, j in zip(problems, canonical)
               if not (j.score.tests_total > 0 and j.score.tests_passed == j.score.tests_total)]
    assert failing == []
    for p, j in zip(problems, canonical):
        assert j.score.tests_total == len(plan_of(p["test"]).tests)
        assert j.score.total == approx(MAIN_DEFINED + SYNTAX + 1.0)  # no aux: structure 0.6, syntax, tests


def test_a_raising_solution_passes_nothing(judged_all):
    problems, _, raising, _ = judged_all
    passed = {p["task_id"]: j.score.tests_passed for p, j in zip(problems, raising) if j.score.tests_passed}
    assert passed == {}
    assert all(j.score.tests_total > 0 for j in raising)
    assert all("boom" in (j.execution.errors[0] or "") for j in raising)


def test_a_solution_returning_none_never_passes_everything(judged_all):
    problems, _, _, returns_none = judged_all
    full = [p["task_id"] for p, j in zip(problems, returns_none)
            if j.score.tests_passed >= j.score.tests_total or j.score.tests_total == 0]
    assert full == []


# ---------------------------------------------------------------------------------------------- 4. levels
def test_no_main_scores_structure_only(he0):
    runs = TASK.executor.runs
    result = score(he0, AUX, "")
    assert (result.structure, result.syntax, result.tests, result.cooperation) == (approx(AUX_DEFINED), 0, 0, 0)
    assert result.total == approx(AUX_DEFINED)
    assert TASK.executor.runs == runs  # nothing ran


@pytest.mark.parametrize("body", ["    pass\n", "    numbers.sort()\n    return\n"])
def test_main_without_a_returned_value_is_not_defined(he0, body):
    result = score(he0, AUX, HEADER + body)
    assert not result.main_defined
    assert result.total == approx(AUX_DEFINED)
    assert score(he0, "", HEADER + body).total == 0.0


def test_main_whose_code_does_not_parse_stops_at_structure(he0):
    broken = "def has_close_elements(numbers, threshold:\n    return True\n"
    result = score(he0, AUX, broken)
    assert (result.syntax, result.tests_passed, result.cooperation) == (0, 0, 0)
    assert result.total == approx(AUX_DEFINED)


def test_a_joint_program_python_cannot_compile_stops_at_structure(he0):
    duplicate = "def has_close_elements(numbers, numbers):\n    return True\n"
    with pytest.raises(SyntaxError):
        compile(duplicate, "main.py", "exec")
    result = score(he0, AUX, duplicate)
    assert result.syntax == 0 and result.syntax_error is not None
    assert result.total == approx(AUX_DEFINED + MAIN_DEFINED)


def test_full_cooperation_scores_four(he0):
    main = HEADER + "    found = aux(sorted(numbers), threshold)\n    return bool(found)\n"
    result = score(he0, AUX, main)
    assert (result.tests_passed, result.tests_total) == (HE0_TESTS, HE0_TESTS)
    assert result.cooperation == approx(CALLS_AUX + NOT_A_WRAPPER)
    assert result.total == approx(AUX_DEFINED + MAIN_DEFINED + SYNTAX + 1.0 + CALLS_AUX + NOT_A_WRAPPER)
    assert result.total == approx(4.0)


@pytest.mark.parametrize("main", [HEADER + "    return aux(numbers, threshold)\n",
                                  HEADER + "    result = aux(numbers, threshold)\n    return result\n"])
def test_a_wrapper_of_aux_loses_the_not_a_wrapper_bonus(he0, main):
    result = score(he0, AUX, main)
    assert result.tests_passed == HE0_TESTS
    assert result.cooperation == approx(CALLS_AUX)
    assert result.total == approx(AUX_DEFINED + MAIN_DEFINED + SYNTAX + 1.0 + CALLS_AUX)


def test_a_main_that_throws_aux_result_away(he0):
    main = HEADER + "    aux(numbers, threshold)\n" + SOLVE
    result = score(he0, AUX, main)
    assert result.tests_passed == HE0_TESTS
    assert result.cooperation == approx(CALLS_AUX + NOT_A_WRAPPER + IGNORES_RESULT)
    assert result.total == approx(AUX_DEFINED + MAIN_DEFINED + SYNTAX + 1.0 + 0.5 + 1.0 - 0.5)


def test_partial_tests_with_cooperation(he0):
    main = HEADER + "    found = aux(numbers, threshold)\n    return False and found\n"  # always False
    result = score(he0, AUX, main)
    assert (result.tests_passed, result.tests_total) == (HE0_FALSE, HE0_TESTS)
    assert result.total == approx(0.4 + 0.6 + 0.5 + 3 / 7 + 0.5 + 1.0)
    always_true = score(he0, AUX, HEADER + "    return True\n")  # passes four, never calls aux
    assert always_true.cooperation == 0
    assert always_true.total == approx(0.4 + 0.6 + 0.5 + HE0_TRUE / 7)


def test_no_test_passed_means_no_cooperation(he0):
    main = HEADER + "    found = aux(numbers, threshold)\n    return [found]\n"
    result = score(he0, AUX, main)
    assert (result.tests_passed, result.cooperation) == (0, 0)
    assert result.total == approx(AUX_DEFINED + MAIN_DEFINED + SYNTAX)


def test_cooperation_needs_aux_defined(he0):
    main = HEADER + "    found = aux(numbers, threshold)\n    return True\n"  # aux undefined: NameError
    result = score(he0, "", main)
    assert result.tests_passed == 0 and result.cooperation == 0
    assert result.total == approx(MAIN_DEFINED + SYNTAX)


def test_aux_in_a_comment_or_a_string_is_no_call(he0):
    main = HEADER + "    # aux(numbers, threshold) would help\n    note = 'aux(numbers, threshold)'\n" + SOLVE
    result = score(he0, AUX, main)
    assert result.tests_passed == HE0_TESTS
    assert result.cooperation == 0
    assert result.total == approx(AUX_DEFINED + MAIN_DEFINED + SYNTAX + 1.0)


SOLO = MAIN_DEFINED + SYNTAX + 1.0  # main alone, every test passed


@pytest.mark.parametrize("completion", [
    "Here is my solution:\n```python\n" + HEADER + SOLVE + "```\nIt compares every pair.",
    HEADER + SOLVE + "\nThis function compares every pair of numbers.\n",
    HEADER + SOLVE + '\nif __name__ == "__main__":\n    print(has_close_elements([1.0], 0.5))\n    raise SystemExit(3)\n',
    HEADER + SOLVE + "\nprint(has_close_elements([1.0, 1.1], 0.5))\nraise SystemExit(3)\n",
], ids=["fenced", "prose-after", "main-block", "top-level-calls"])
def test_extraction_keeps_only_the_code(he0, completion):
    judged, = TASK.judge_many([he0], [""], [completion])
    assert judged.score.tests_passed == HE0_TESTS
    assert judged.score.total == approx(SOLO)
    assert "__main__" not in judged.program and "print" not in judged.program and "It " not in judged.program


def test_main_redefining_aux_has_that_aux_dropped(he0):
    wrong_aux = "def aux(numbers, threshold):\n    return None\n\n"
    main = wrong_aux + HEADER + "    found = aux(numbers, threshold)\n    return bool(found)\n"
    judged, = TASK.judge_many([he0], [AUX], [main])
    assert judged.program.count("def aux") == 1
    assert judged.score.tests_passed == HE0_TESTS
    assert judged.score.total == approx(4.0)
    # and the aux agent may not write the entry function either
    aux_and_main = AUX + "\n" + HEADER + "    return True\n"
    judged, = TASK.judge_many([he0], [aux_and_main], [HEADER + "    found = aux(numbers, threshold)\n    return found\n"])
    assert judged.program.count("def has_close_elements") == 1
    assert judged.score.tests_passed == HE0_TESTS


def test_reward_in_the_trainers_call_shape(he0):
    mains = [HEADER + "    return True\n", ""]
    assert coding.reward([AUX, AUX], mains, batch_items=[he0, he0]) == [
        approx(0.4 + 0.6 + 0.5 + 4 / 7), approx(0.4)]
    with pytest.raises(ValueError, match="batch_items"):
        coding.reward([AUX], [""])


# -------------------------------------------------------------------------------------------- 5. multi-turn
def test_feedback_carries_the_failing_test_and_its_error(he0):
    assert "has_close_elements" in main_prompt(he0) and "aux" in aux_prompt(he0)
    main = HEADER + "    if len(numbers) > 5:\n        raise KeyError('too-long-list')\n    return True\n"
    aux_next, main_next = feedback_transition(he0["prompt"], [AUX, main])
    # by hand: tests 1, 2 and 5 have six numbers (raise); of the four five-number ones, the two expecting True pass
    first_test = "assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True"
    assert first_test in he0["test"]
    for next_prompt in (aux_next, main_next):
        assert first_test in next_prompt and "too-long-list" in next_prompt and "KeyError" in next_prompt
        assert "Tests: 2/7 passed." in next_prompt
    assert main.strip() in main_next and AUX.strip() in aux_next
    assert he0["prompt"].strip() in aux_next


def test_feedback_names_the_syntax_error_line(he0):
    aux_prompt(he0)
    broken = HEADER + "    return True\n\n\ndef helper(values:\n    return values\n"
    with pytest.raises(SyntaxError) as raised:
        compile(broken, "main.py", "exec")
    line = raised.value.lineno
    _, main_next = feedback_transition(he0["prompt"], [AUX, broken])
    assert f"line {line}" in main_next and "Syntax error" in main_next


def test_each_joint_program_runs_once_across_reward_and_transition(he0):
    task = CodingTask(Executor(workers=2))
    try:
        mains = [HEADER + "    return True\n", HEADER + "    return False\n", HEADER + "    return True\n", ""]
        auxes = [AUX, AUX, AUX, AUX]
        task.rewards([he0] * 4, auxes, mains)
        assert task.executor.runs == 2  # two distinct runnable programs; the one without main never runs
        for aux, main in zip(auxes, mains):
            task.transition(he0["prompt"], [aux, main], batch_item=he0)
        assert task.executor.runs == 2
        task.transition(he0["prompt"], [AUX, HEADER + "    return len(numbers) > 99\n"], batch_item=he0)
        assert task.executor.runs == 3
        metrics = task.drain_metrics()
        assert metrics["coding/total"] == approx(((1.5 + 4 / 7) + (1.5 + 3 / 7) + (1.5 + 4 / 7) + 0.4) / 4)
        assert metrics["coding/tests"] == approx((4 / 7 + 3 / 7 + 4 / 7 + 0) / 4)
        assert task.drain_metrics() == {}
    finally:
        task.executor.close()


def test_a_transition_for_an_unseen_prompt_is_refused():
    with pytest.raises(KeyError, match="batch_item"):
        feedback_transition("def never_seen():\n    '''nothing'''\n", ["", ""])


# ---------------------------------------------------------------------------------------- 6. tiny training
LEVEL_RANGES = {"coding/structure": (0.0, 1.0), "coding/syntax": (0.0, 0.5), "coding/tests": (0.0, 1.0),
                "coding/cooperation": (-0.5, 1.5), "coding/total": (0.0, 4.0)}


def train_coding(model_dir, **overrides):
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    settings = dict(num_agents=2, num_generations=2, max_new_tokens=8, num_train_epochs=1,
                    per_device_train_batch_size=2, eval_interval=1, eval_num_samples=2, logging_steps=1,
                    seed=0, disable_tqdm=True)
    settings.update(overrides)
    trainer = MAGRPOTrainer(
        agent_model=model_dir, num_agents=2, reward_func=coding.reward, formatters=list(FORMATTERS),
        train_dataset=humaneval("train").select(range(2)), eval_dataset=humaneval("eval").select(range(2)),
        args=MAGRPOConfig(**settings), **({"external_transition": feedback_transition}
                                          if settings.get("num_turns", 1) > 1 else {}),
    )
    return trainer, trainer.train()


def assert_level_ranges(metrics, prefix=""):
    for name, (low, high) in LEVEL_RANGES.items():
        value = metrics[prefix + name]
        assert math.isfinite(value) and low - 1e-9 <= value <= high + 1e-9, (prefix + name, value)


def test_tiny_training_reports_the_coding_levels(tiny_llama):
    trainer, history = train_coding(tiny_llama)
    assert len(history) == 1
    step = history[0]
    assert_level_ranges(step)
    assert step["reward_mean"] == pytest.approx(step["coding/total"], abs=1e-6)
    assert len(trainer.evaluations) == 1
    evaluated_at, evaluation = trainer.evaluations[0]
    assert evaluated_at == 1
    assert_level_ranges(evaluation, prefix="eval/")
    assert evaluation["eval/reward_mean"] == pytest.approx(evaluation["eval/coding/total"], abs=1e-6)


def two_turn_check(trainer, history):
    assert len(history) == 1
    step = history[0]
    assert_level_ranges(step)
    # coding/total is the mean over every scored answer: turn 1 has 2 rows x 2 samples, turn 2 twice as many
    expected = (4 * step["turn_1/reward_mean"] + 8 * step["turn_2/reward_mean"]) / 12
    assert step["coding/total"] == pytest.approx(expected, abs=1e-6)
    assert len(trainer.evaluations) == 1
    assert_level_ranges(trainer.evaluations[0][1], prefix="eval/")


def test_tiny_two_turn_training_with_feedback_passed_through(tiny_llama):
    two_turn_check(*train_coding(tiny_llama, num_turns=2, external_prompt_passthrough=True))


def test_tiny_two_turn_training_with_feedback_formatted(tiny_llama):
    two_turn_check(*train_coding(tiny_llama, num_turns=2))
