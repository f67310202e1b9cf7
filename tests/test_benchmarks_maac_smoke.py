"""The MAAC benchmark runner of this library runs one step on the tiny model (the reference is compared by hand)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import comlrl.training.policy_update  # noqa: E402
import comlrl.trainers.actor_critic.base as actor_critic_base  # noqa: E402
import report  # noqa: E402
import run_ours_maac  # noqa: E402
from workload import Workload  # noqa: E402


@pytest.fixture(scope="module")
def patched_before() -> tuple:
    return comlrl.training.policy_update.completion_logprobs, actor_critic_base.sequence_values


@pytest.fixture(scope="module")
def one_step(tiny_llama, patched_before) -> dict:
    workload = Workload(model_dir=tiny_llama, num_agents=2, num_generations=2, max_new_tokens=8, steps=1, warmup_steps=0)
    return json.loads(json.dumps(run_ours_maac.run(workload), default=vars))


def test_maac_runner_times_every_phase(one_step):
    (step,) = one_step["steps"]
    assert step["samples"] == 2 * 2 and 0 < step["generated_tokens"] <= 2 * 2 * 8
    assert 2 <= step["decode_steps"] <= 2 * 8  # one generate call per agent, each at most max_new_tokens long
    phases = step["phases"]
    assert {"generation", "reward", "values", "forward", "update"} <= set(phases)
    assert 0 < phases["forward"] < phases["update"]
    assert phases["generation"] + phases["values"] + phases["update"] < step["step_time"]
    assert 0 < step["cpu_time"]
    assert one_step["peak_rss_mb"] > 0 and one_step["first_step_end"] > one_step["startup_time"] > 0


def test_maac_runner_restores_the_wrapped_functions(one_step, patched_before):
    assert (comlrl.training.policy_update.completion_logprobs, actor_critic_base.sequence_values) == patched_before


def test_maac_record_fits_the_report(one_step):
    import compare_maac

    summary = report.summarise_run(one_step)
    parts = ("generation", "reward", "forward", "backward_optimizer", "other")
    assert sum(summary[name] for name in parts) == pytest.approx(summary["step_time"])
    medians = compare_maac.phase_medians([one_step])
    assert medians["old_logprobs"] == 0.0 and medians["values"] > 0
    table = compare_maac.phase_table(medians, medians, "self")
    assert "| critic value forward at rollout (s) |" in table and "| 1.00 |" in table and "| - |" in table


def test_reference_maac_runner_imports_without_the_peers():
    import run_reference_maac  # noqa: F401
