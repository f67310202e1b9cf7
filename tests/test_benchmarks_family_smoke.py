"""The algorithm-family benchmark runs our side end to end (one algorithm, one step) and prints its table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import compare_family  # noqa: E402
import run_ours_family  # noqa: E402
from family import family_parser  # noqa: E402
from workload import Workload  # noqa: E402


def in_process(side: str, options: list[str]) -> dict:
    """Our runner in this process (the script's own subprocess only adds ~10 s of imports)."""
    assert side == "ours"
    args = family_parser("").parse_args(options)
    result = run_ours_family.run(args.algorithm, Workload.from_arguments(args), args.eval_prompts, args.eval_samples,
                                 args.pairs_per_prompt, args.dpo_beta)
    return json.loads(json.dumps(result, default=vars))


def test_family_script_runs_ours_only_for_one_step(tiny_llama, tmp_path, capsys):
    output = tmp_path / "family.json"
    missing_peers = tmp_path / "no-venv-peers" / "python"  # ours alone never needs the reference's venv
    results = compare_family.main([
        "--algorithms", "mareinforce", "--sides", "ours", "--steps", "1", "--warmup-steps", "0",
        "--max-new-tokens", "8", "--num-generations", "2", "--eval-prompts", "1", "--eval-samples", "2",
        "--model-dir", tiny_llama, "--peers-python", str(missing_peers), "--output", str(output),
    ], run_one=in_process)
    (run,) = results["mareinforce"]["ours"]
    assert set(results["mareinforce"]) == {"ours"}
    (step,) = run["steps"]
    assert step["step_time"] > 0 and step["samples"] == 2
    summary = compare_family.summarise([run])
    assert 0.0 <= summary["eval_before"] <= 1.0 and 0.0 <= summary["eval_after"] <= 1.0
    assert summary["steps_run"] == 1 and summary["peak_rss_mb"] > 0
    assert json.loads(output.read_text()) == results
    table = capsys.readouterr().out
    assert "| MAREINFORCE | ours |" in table and "comlrl 1.4.3" not in table


def test_family_script_refuses_the_reference_side_without_its_venv(tmp_path):
    with pytest.raises(SystemExit, match="setup_peers.sh"):
        compare_family.main(["--algorithms", "madpo", "--peers-python", str(tmp_path / "missing" / "python")])
