"""The CI-sized mutation run (docs/mutation.md, "The CI sample"): mutmut over a fixed sample of the maths, in a
copy of the repository, with the tests that check those functions. Every mutant of the sample must be killed: a
change to the advantages, the losses, the KL or the pooled metrics that no test notices fails CI here, not in a
later full run. End-to-end tier (a few minutes)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]

# Functions whose every mutant the selection below kills (the full run's figures: 326 mutants).
SAMPLE = {
    "comlrl/algorithms/advantages.py": ["gae", "td_targets", "group_relative_advantages", "normalize"],
    "comlrl/algorithms/losses.py": ["loss_normaliser", "clipped_policy_loss", "clipped_token_losses", "value_loss",
                                    "token_entropy", "bradley_terry_loss"],
    "comlrl/algorithms/kl.py": ["k3_token_kl"],
    "comlrl/training/metrics.py": ["pooled_means", "pooled_std"],
}
SELECTION = ["tests/test_advantages.py", "tests/test_ac_maths.py", "tests/test_algorithm_checks.py",
             "tests/test_defects_kl.py", "tests/test_pooled_metrics.py", "tests/test_defects_metrics.py"]


def mutmut_table(only_mutate: list[str], selection: list[str]) -> str:
    """The copy's ``[tool.mutmut]``: the sample's files and the selection (the project's other settings kept)."""
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    quoted = lambda values: "[" + ", ".join(f'"{value}"' for value in values) + "]"  # noqa: E731
    return "\n".join([
        "[tool.mutmut]",
        f"source_paths = {quoted(settings['source_paths'])}",
        f"only_mutate = {quoted(only_mutate)}",
        f"also_copy = {quoted(settings['also_copy'])}",
        f"pytest_add_cli_args = {quoted(settings['pytest_add_cli_args'])}",
        f"pytest_add_cli_args_test_selection = {quoted(selection)}",
    ]) + "\n"


def copy_of_repository(target: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "mutants")
    for folder in ("comlrl", "tests", "flows", "data"):
        shutil.copytree(ROOT / folder, target / folder, ignore=ignore)
    text = (ROOT / "pyproject.toml").read_text()
    start = text.index("\n[tool.mutmut]\n") + 1
    end = text.find("\n[", start)
    rest = text[end + 1:] if end != -1 else ""
    (target / "pyproject.toml").write_text(text[:start] + mutmut_table(list(SAMPLE), SELECTION) + "\n" + rest)


def sample_functions() -> dict[str, re.Pattern]:
    """mutmut's name for each function of the sample, and the pattern of its mutants' names."""
    names = [f"{path[:-3].replace('/', '.')}.x_{function}" for path, functions in SAMPLE.items() for function in functions]
    return {name: re.compile(re.escape(name) + r"__mutmut_\d+") for name in names}


def test_every_mutant_of_the_sample_is_killed(tmp_path):
    import mutmut  # noqa: F401  (the test extra installs it)

    copy_of_repository(tmp_path)
    functions = sample_functions()
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    run = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", "2",
                          *(f"{name}__mutmut_*" for name in functions)],
                         cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    listed = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=tmp_path,
                            env=environment, capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stderr[-3000:]
    statuses = dict(re.findall(r"^\s*(\S+__mutmut_\d+): (.+?)\s*$", listed.stdout, re.MULTILINE))
    in_sample = {function: {name: status for name, status in statuses.items() if pattern.fullmatch(name)}
                 for function, pattern in functions.items()}
    assert all(in_sample.values()), [function for function, mutants in in_sample.items() if not mutants]
    assert sum(map(len, in_sample.values())) >= 300, {function: len(m) for function, m in in_sample.items()}
    alive = sorted(name for mutants in in_sample.values() for name, status in mutants.items()
                   if status not in ("killed", "timeout"))
    assert alive == [], f"{len(alive)} mutants of the sample not killed: {', '.join(alive[:20])}"
