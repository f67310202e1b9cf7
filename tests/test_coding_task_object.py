"""The coding task as an object: built by a factory a run spec configures, its transition given its row (no
formatter keeps state), its sandbox closed when the process ends; and the sandbox under it reporting a death
by signal one way on every path. Programs run in the real sandbox."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from comlrl.rollout.episodes import _next_prompts
from comlrl.sandbox import Sandbox, run_python
from comlrl.tasks import coding
from comlrl.tasks.coding import CodingTask, humaneval, make_reward, prompts
from flows.build import _callables
from flows.spec import SpecError, parse_spec

REPO = Path(__file__).resolve().parents[1]
SEGFAULT = "import ctypes\nctypes.string_at(0)\n"  # SIGSEGV from the kernel: it ends even a namespace's PID 1

# A problem of our own, so nothing can be found by its prompt among the bundled HumanEval problems.
DOUBLE = {
    "task_id": "Custom/double",
    "prompt": "def double(x: int) -> int:\n    \"\"\"Twice x.\"\"\"\n",
    "entry_point": "double",
    "test": "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(3) == 6\n    assert candidate(0) == 0\n",
    "canonical_solution": "    return 2 * x\n",
}
AUX = "def aux(x):\n    return x + x\n"
MAIN_HALF_RIGHT = "def double(x):\n    return x * x if x < 2 else aux(x)\n"  # 1 -> 1 (wrong), 3 -> 6, 0 -> 0


def test_a_transition_finds_its_problem_from_its_row_with_no_formatter_called():
    with make_reward(workers=1) as task:
        aux_next, main_next = task.transition(DOUBLE["prompt"], [AUX, MAIN_HALF_RIGHT], batch_item=DOUBLE)
        assert task.executor.runs == 1
    for text in (aux_next, main_next):
        assert text.startswith(DOUBLE["prompt"]) and "Tests: 2/3 passed." in text
        assert "assert candidate(1) == 2" in text
    with pytest.raises(KeyError, match="batch_item"):  # without its row, a prompt of no bundled problem
        CodingTask().transition(DOUBLE["prompt"], [AUX, MAIN_HALF_RIGHT])


def test_the_rollout_gives_the_module_level_transition_its_row():
    passed_through = _next_prompts(coding.feedback_transition, DOUBLE, [AUX, MAIN_HALF_RIGHT],
                                   [[DOUBLE["prompt"]], [DOUBLE["prompt"]]], [[AUX], [MAIN_HALF_RIGHT]],
                                   coding.FORMATTERS, True, 0, takes_row=True)
    assert all("Tests: 2/3 passed." in text for text in passed_through)
    # Formatting a later turn reads the signature from the problem the feedback text starts with.
    formatted = coding.main_prompt({**DOUBLE, "prompt": passed_through[1]})
    assert "double(x: int) -> int" in formatted


def test_the_formatters_are_the_pure_prompt_functions():
    assert coding.FORMATTERS == prompts.FORMATTERS == (prompts.aux_prompt, prompts.main_prompt)
    assert (coding.aux_prompt, coding.main_prompt) == coding.FORMATTERS


def test_scoring_through_the_module_level_names_leaves_no_warm_folder_behind():
    temporary = tempfile.mkdtemp(prefix="comlrl-warm-leftovers-", dir="/tmp")
    os.chmod(temporary, 0o755)  # reachable by the slots' uids, so the job folders are made here
    script = textwrap.dedent("""
        import glob, os, sys
        from comlrl.tasks import coding
        row = coding.humaneval("eval", limit=1)[0]
        main = "def has_close_elements(numbers, threshold):\\n    return True\\n"
        print(coding.reward(["def aux(x):\\n    return x\\n"], [main], batch_items=[row]))
        print(len(glob.glob(os.path.join(sys.argv[1], "comlrl-sandbox-warm-*"))))
    """)
    environment = {**os.environ, "TMPDIR": temporary, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script, temporary], cwd=REPO, env=environment, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] != "0"  # while it scored, a warm worker's folder was there
    assert not list(Path(temporary).glob("comlrl-sandbox-warm-*"))  # and it went with the process
    os.rmdir(temporary)


def coding_spec(reward):
    return {"name": "coding-object", "algorithm": "magrpo", "models": {"agent_model": {"tiny": {"architecture": "llama"}}},
            "dataset": {"train": {"entry_point": "comlrl.tasks.coding:humaneval", "kwargs": {"split": "train", "limit": 2}}},
            "reward": reward, "formatters": ["comlrl.tasks.coding:aux_prompt", "comlrl.tasks.coding:main_prompt"],
            "config": {"num_agents": 2}}


def test_a_spec_with_reward_kwargs_builds_a_task_with_those_sandbox_settings():
    spec = parse_spec(coding_spec({"entry_point": "comlrl.tasks.coding:make_reward",
                                   "kwargs": {"isolation": "rlimits", "workers": 2, "timeout": 7}}), root=REPO)
    task = _callables(spec.reward, REPO)
    assert isinstance(task, CodingTask) and task is not coding.default_task()
    settings = task.executor.settings
    assert (settings["isolation"], settings["workers"], settings["limits"].timeout) == ("rlimits", 2, 7)
    assert (task.executor.sandbox.isolation, task.executor.sandbox.workers) == ("rlimits", 2)
    task.close()
    with pytest.raises(SpecError) as refused:
        parse_spec(coding_spec({"entry_point": "comlrl.tasks.coding:make_reward", "kwargs": {"workerz": 2}}),
                   root=REPO)
    assert [where for where, _ in refused.value.problems] == ["reward.kwargs"]
    assert "workerz" in refused.value.problems[0][1]


def test_a_death_by_signal_reads_the_same_on_every_path():
    fresh = run_python(SEGFAULT, isolation="full", timeout=5)
    limited = run_python(SEGFAULT, isolation="rlimits", timeout=5)
    with Sandbox(1, warm=True, timeout=5) as pool:
        warm = pool.run(SEGFAULT)
    assert [fresh.exit_code, limited.exit_code, warm.exit_code] == [128 + 11] * 3
