"""The benchmark scripts of this library run one step on the tiny model (peers are compared by hand)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import report  # noqa: E402
import roofline  # noqa: E402
import run_ours  # noqa: E402
from workload import Workload, joint_reward  # noqa: E402


@pytest.fixture(scope="module")
def one_step(tiny_llama) -> dict:
    workload = Workload(model_dir=tiny_llama, num_agents=2, num_generations=2, max_new_tokens=8, steps=1, warmup_steps=0)
    return json.loads(json.dumps(run_ours.run(workload), default=vars))


def test_joint_reward_pays_each_agent_for_its_letter():
    assert joint_reward(["ee", "xx"], ["oo", "oo"]) == [1.0, 0.5]
    assert joint_reward(["e"]) == [1.0]


def test_ours_runner_times_every_phase(one_step):
    (step,) = one_step["steps"]
    assert step["samples"] == 4 and 0 < step["generated_tokens"] <= 4 * 8
    assert {"generation", "reward", "forward", "update"} <= set(step["phases"])
    # two agents, one decode call each, each between 1 and max_new_tokens steps
    assert 2 <= step["decode_steps"] <= 2 * 8 and 0 < step["cpu_time"]
    assert 0 < step["phases"]["forward"] < step["phases"]["update"] < step["step_time"]
    assert one_step["peak_rss_mb"] > 0 and one_step["first_step_end"] > one_step["startup_time"] > 0


def test_report_splits_the_step_and_compares(one_step):
    summary = report.summarise_run(one_step)
    parts = ("generation", "reward", "forward", "backward_optimizer", "other")
    assert sum(summary[name] for name in parts) == pytest.approx(summary["step_time"])
    table = report.comparison_table("self", summary, summary, "self")
    assert "| step time (s) |" in table and "| 1.00 |" in table


def test_roofline_reports_the_fraction(one_step, tmp_path, capsys, monkeypatch):
    results = tmp_path / "ours.json"
    results.write_text(json.dumps(one_step))
    monkeypatch.setattr(sys, "argv", ["roofline.py", "--results", str(results), "--seconds", "0.05"])
    roofline.main()
    out = capsys.readouterr().out
    assert "measured matmul rate" in out and "| whole step |" in out


def test_profile_lists_the_top_operators(tiny_llama):
    import profile_step

    workload = Workload(model_dir=tiny_llama, num_agents=2, num_generations=2, max_new_tokens=8, steps=1, warmup_steps=1)
    table = profile_step.profile(workload, row_limit=5)
    assert "Self CPU" in table and "aten::" in table


def test_decode_steps_compares_every_variant(tiny_llama):
    completed = subprocess.run(
        [sys.executable, str(BENCHMARKS / "decode_steps.py"), "--model-dir", tiny_llama, "--max-new-tokens", "4",
         "--calls", "1", "--repeats", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    rows = [line for line in completed.stdout.splitlines() if line.startswith("| generate") or line.startswith("| loop")]
    assert len(rows) == 4 and rows[0].endswith("| 1.00 |")


def test_peer_runners_import_without_the_peers():
    import run_reference  # noqa: F401
    import run_trl  # noqa: F401


@pytest.mark.slow
def test_scaling_script_runs_one_configuration(tiny_llama):
    completed = subprocess.run(
        [sys.executable, str(BENCHMARKS / "scaling.py"), "--model-dir", tiny_llama, "--steps", "1", "--grid", "num_agents=1"],
        capture_output=True, text=True, timeout=120,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "| 1 | 4 | 32 | 2 |" in completed.stdout  # the base: 4 generations, 32 new tokens, 2 prompts per step


@pytest.mark.parametrize("config, batch, updates", [({}, 2, 3), ({"rollout_buffer_size": 1}, 1, 5)])
def test_the_user_script_of_record_runs_here_at_the_defaults(tiny_llama, config, batch, updates):
    """benchmarks/user_script.py (the same text for both libraries, defaults.py) on the tiny model: at the defaults
    two prompts per update, as the original's rollout_buffer_size=2; with rollout_buffer_size=1 one per prompt."""
    job = {"model_dir": tiny_llama, "task": "letters", "prompts": 5, "num_generations": 2, "max_new_tokens": 4,
           "config": config}
    done = subprocess.run([sys.executable, str(BENCHMARKS / "user_script.py"), json.dumps(job)], capture_output=True,
                          text=True, timeout=300)
    [line] = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    assert (result["per_device_train_batch_size"], result["optimizer_steps"]) == (batch, 2 * updates)
    assert 0 < result["train_s"] < result["script_s"] and result["peak_rss_mib"] > 0


def test_step_split_counts_matrix_products_and_the_rest_inside_each_phase_only():
    """``step_split.split`` (the fp32 step's "matrix products alone" figure): products and other operators
    are summed by the phase label they ran under; work outside every label is not counted."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    import step_split

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        with record_function("generation"):
            for _ in range(20):
                a @ b
        with record_function("update"):
            for _ in range(20):
                (a + b).exp()
        for _ in range(50):
            a @ b  # outside both phases
    totals = step_split.split(profiler)
    generation, update = totals["generation"], totals["update"]
    assert generation["matmul"] > 0 and update["matmul"] == 0
    assert update["other"] > 0
    assert generation["other"] < generation["matmul"]  # the label's own bookkeeping is all that is not a product
    mm_seconds = sum(e.self_cpu_time_total for e in profiler.events() if e.name == "aten::mm") / 1e6
    assert generation["matmul"] < mm_seconds  # the 50 products outside the labels are left out

    def descendants(event):
        for child in event.cpu_children:
            yield child
            yield from descendants(child)

    label = next(e for e in profiler.events() if e.name == "generation")
    in_label = sum(e.self_cpu_time_total for e in descendants(label) if e.name in step_split.MATMULS) / 1e6
    assert generation["matmul"] == pytest.approx(in_label, rel=1e-6)  # the profiler's own tree agrees
