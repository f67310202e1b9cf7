"""The lock, ``infra/constraints.txt``: exact pins within pyproject.toml's ranges that cover everything the test job
installs; ``infra/bootstrap.sh`` installs with it, and ``test --latest`` without it into a venv of its own, moving it
only after a green run; docs/getting-started.md names its main versions.

``bash infra/bootstrap.sh test --latest`` points ``COMLRL_LOCK`` at the lock it would write, so that run checks the
new lock before it replaces the committed one."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
BOOTSTRAP = ROOT / "infra" / "bootstrap.sh"
COMMITTED_LOCK = ROOT / "infra" / "constraints.txt"
LOCK = Path(os.environ.get("COMLRL_LOCK", COMMITTED_LOCK))
GETTING_STARTED = ROOT / "docs" / "getting-started.md"
MAIN_PACKAGES = ["torch", "transformers", "accelerate", "datasets", "peft", "prefect", "mlflow", "pyarrow"]
PIN = re.compile(r"(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>\S+)")


def pins(lock: Path) -> dict[str, Version]:
    """The lock's pins by canonical name; every line not a comment must be one exact ``name==version``."""
    found: dict[str, Version] = {}
    for number, line in enumerate(lock.read_text().splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        match = PIN.fullmatch(line)
        assert match, f"{lock}:{number}: {line!r} is not an exact name==version pin"
        version = Version(match["version"])
        assert version.local is None, f"{lock}:{number}: {line!r} has a local label, which PyPI's wheels lack"
        name = canonicalize_name(match["name"])
        assert name not in found, f"{lock}:{number}: {name} is pinned twice"
        found[name] = version
    return found


def extras_of_the_test_job() -> list[str]:
    """The extras the test job installs, read from bootstrap.sh (EXTRAS="..." and each EXTRAS+=",...")."""
    parts = re.findall(r'\bEXTRAS\+?="([^"]+)"', BOOTSTRAP.read_text())
    return [extra for part in parts for extra in part.split(",") if extra]


def requirements_of_the_test_job() -> list[Requirement]:
    """pyproject.toml's requirements, core and the test job's extras, that apply on this platform."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    texts = project["dependencies"] + [text for extra in extras_of_the_test_job()
                                       for text in project["optional-dependencies"][extra]]
    requirements = [Requirement(text) for text in texts]
    return [r for r in requirements if r.marker is None or r.marker.evaluate(default_environment())]


def test_the_test_job_installs_every_extra_the_lock_must_cover():
    assert sorted(extras_of_the_test_job()) == sorted(["pipeline", "lora", "test", "docs", "postgres", "browser"])


def test_every_line_of_the_lock_is_an_exact_pin_under_a_header_saying_how_it_was_made():
    lock = pins(LOCK)
    assert len(lock) > 100  # a freeze of the whole venv, not a hand-kept list
    assert "torch" in lock
    header = "".join(line for line in LOCK.read_text().splitlines(keepends=True) if line.startswith("#"))
    assert "pip freeze --all --exclude-editable --exclude pip" in header and "bash infra/bootstrap.sh test" in header


def test_every_requirement_of_the_test_job_is_pinned_within_its_range():
    lock = pins(LOCK)
    problems = []
    for requirement in requirements_of_the_test_job():
        pinned = lock.get(canonicalize_name(requirement.name))
        if pinned is None:
            problems.append(f"{requirement}: not pinned")
        elif not requirement.specifier.contains(pinned, prereleases=True):
            problems.append(f"{requirement}: pinned at {pinned}, outside pyproject.toml's range")
    assert not problems, ("the lock does not fit pyproject.toml (move it: bash infra/bootstrap.sh test --latest):\n"
                          + "\n".join(problems))


def installed_closure() -> set[str]:
    """Every distribution the project needs with the test job's extras, walked through what is installed here."""
    needed, todo = set(), [("comlrl", tuple(extras_of_the_test_job()))]
    while todo:
        name, extras = todo.pop()
        try:
            requires = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue  # an extra this venv was installed without (COMLRL_BROWSER=0, COMLRL_POSTGRES=0)
        for requirement in map(Requirement, requires):
            environments = [{**default_environment(), "extra": extra} for extra in extras or ("",)]
            if requirement.marker and not any(requirement.marker.evaluate(env) for env in environments):
                continue
            key = canonicalize_name(requirement.name)
            if key not in needed:
                needed.add(key)
                todo.append((requirement.name, tuple(requirement.extras)))
    return needed


def test_the_lock_pins_everything_the_project_installs():
    try:
        importlib.metadata.distribution("comlrl")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("comlrl is not installed in this venv")
    missing = sorted(installed_closure() - set(pins(LOCK)) - {"pip"})
    assert not missing, f"installed for the project but not pinned in {LOCK}: {missing}"


def test_the_venv_bootstrap_installed_from_the_lock_holds_its_versions():
    stamp = Path(sys.prefix) / ".comlrl-installed"
    if hashlib.sha256(LOCK.read_bytes()).hexdigest() not in (stamp.read_text().split() if stamp.exists() else []):
        pytest.skip(f"this venv was not installed from {LOCK} by infra/bootstrap.sh")
    installed = {canonicalize_name(d.metadata["Name"]): Version(d.version) for d in importlib.metadata.distributions()}
    differ = {name: (str(pinned), str(installed[name])) for name, pinned in pins(LOCK).items()
              if name in installed and Version(installed[name].public) != pinned}
    assert not differ, f"pinned, installed: {differ}"


def test_the_getting_started_table_names_the_lock_versions():
    text = GETTING_STARTED.read_text()
    section = text[text.index("## The lock"):]
    section = section[:section.index("\n## ")]
    rows = dict(re.findall(r"^\| ([\w.-]+) \| ([^ |]+) \|$", section, flags=re.M))
    rows.pop("package")
    rows.pop("---")
    lock = pins(COMMITTED_LOCK)
    assert list(rows) == MAIN_PACKAGES
    assert {name: Version(version) for name, version in rows.items()} == {name: lock[name] for name in rows}


# A stand-in for python3, a venv's python and its pip: each call logged ("<program>\t<arguments>"), `-m venv DIR`
# makes DIR/bin/{python,pip} of itself, `pip freeze` answers FAKE_FREEZE, pytest exits FAKE_PYTEST_STATUS.
FAKE_PYTHON = r"""#!/usr/bin/env bash
args=("$@")
[[ "$(basename "$0")" != pip ]] || args=(-m pip "$@")
printf '%s\t%s\n' "$0" "${args[*]}" >> "$FAKE_LOG"
case "${args[0]} ${args[1]:-}" in
    "-m venv")
        dir="${args[-1]}"
        rm -rf "$dir" && mkdir -p "$dir/bin" && cp "$0" "$dir/bin/python" && cp "$0" "$dir/bin/pip" ;;
    "-m pip")
        [[ "${args[2]}" != freeze ]] || cat "$FAKE_FREEZE" ;;
    "-m pytest")
        printf 'COMLRL_LOCK=%s\n' "${COMLRL_LOCK:-}" >> "$FAKE_LOG"
        exit "$FAKE_PYTEST_STATUS" ;;
    "-c "*)
        echo 3.11.0 ;;
esac
"""
NEWER = "accelerate==1.99.0\nmlflow==3.99.0\ntorch==2.99.0+cpu\n"


@pytest.fixture
def checkout(tmp_path):
    """A git repository with the files bootstrap.sh reads and writes, and the stand-in python3 beside it."""
    repo = tmp_path / "repo"
    for name in ("infra/bootstrap.sh", "infra/constraints.txt", "pyproject.toml", "docs/getting-started.md"):
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, repo / name)
    for command in (["init", "-q"], ["add", "."], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"]):
        subprocess.run(["git", *command], cwd=repo, check=True, capture_output=True)
    (tmp_path / "python3").write_text(FAKE_PYTHON)
    (tmp_path / "python3").chmod(0o755)
    (tmp_path / "freeze.txt").write_text(NEWER)
    return repo


def bootstrap(repo: Path, *args: str, pytest_status: int = 0) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``bash infra/bootstrap.sh ARGS`` in ``repo`` on the stand-in python3: the process and the calls it made."""
    log = repo.parent / "calls.log"
    log.write_text("")
    env = {key: value for key, value in os.environ.items() if key not in ("COMLRL_VENV", "COMLRL_LOCK")}
    env.update(PYTHON=str(repo.parent / "python3"), COMLRL_POSTGRES="0", COMLRL_BROWSER="0", FAKE_LOG=str(log),
               FAKE_FREEZE=str(repo.parent / "freeze.txt"), FAKE_PYTEST_STATUS=str(pytest_status))
    process = subprocess.run(["bash", "infra/bootstrap.sh", *args], cwd=repo, env=env, capture_output=True,
                             text=True, timeout=60)
    return process, log.read_text().splitlines()


def pip_installs(calls: list[str]) -> list[str]:
    return [call for call in calls if "\t-m pip install " in call]


def test_every_install_uses_the_lock_and_only_a_change_reinstalls(checkout):
    process, calls = bootstrap(checkout, "test", "-q")
    assert process.returncode == 0, process.stderr
    assert calls[0].endswith("python3\t-m venv .venv")
    installs = pip_installs(calls)
    assert installs and all(call.startswith(".venv/bin/") and " -c infra/constraints.txt " in call
                            for call in installs), installs
    assert any(' -e .[pipeline,lora,test,docs]' in call for call in installs), installs
    assert any(call.startswith(".venv/bin/python\t-m pytest -m not e2e") and call.endswith(" -q") for call in calls)

    assert pip_installs(bootstrap(checkout, "test", "-q")[1]) == []  # installed: no pip at all
    with (checkout / "infra" / "constraints.txt").open("a") as lock:
        lock.write("# moved\n")
    assert pip_installs(bootstrap(checkout, "test", "-q")[1]) == installs  # a changed lock reinstalls


@pytest.mark.parametrize("status", [1, 5])
def test_a_red_latest_run_leaves_the_lock_as_it_was(checkout, status):
    before = {name: (checkout / name).read_bytes() for name in ("infra/constraints.txt", "docs/getting-started.md")}
    process, calls = bootstrap(checkout, "test", "--latest", "-q", pytest_status=status)
    assert process.returncode == status
    assert "infra/constraints.txt is unchanged" in process.stderr
    assert {name: (checkout / name).read_bytes() for name in before} == before
    assert calls[0].endswith("python3\t-m venv --clear .venv-latest")
    installs = pip_installs(calls)
    assert installs and all(call.startswith(".venv-latest/bin/") and " -c " not in call for call in installs)
    assert not [call for call in calls if call.startswith(".venv/")]  # the locked venv is never touched
    candidate = checkout / ".venv-latest" / "comlrl-lock-candidate.txt"
    assert f"COMLRL_LOCK={candidate}" in calls  # the suite checks the lock it would write


def test_a_green_latest_run_writes_its_freeze_as_the_lock_and_the_docs_table(checkout):
    process, _ = bootstrap(checkout, "test", "--latest", "-q")
    assert process.returncode == 0, process.stderr
    assert pins(checkout / "infra" / "constraints.txt") == {"accelerate": Version("1.99.0"),
                                                           "mlflow": Version("3.99.0"), "torch": Version("2.99.0")}
    header = (checkout / "infra" / "constraints.txt").read_text().split("\naccelerate==")[0]
    assert "`bash infra/bootstrap.sh test --latest`" in header and "--exclude-editable" in header
    table = (checkout / "docs" / "getting-started.md").read_text()
    assert "| torch | 2.99.0 |\n" in table and "| mlflow | 3.99.0 |\n" in table and "| accelerate | 1.99.0 |\n" in table
    assert f"| transformers | {pins(COMMITTED_LOCK)['transformers']} |\n" in table  # not in this freeze: as it was
    assert re.search(r"infra/constraints.txt +\| +\d+ [+-]+", process.stdout), process.stdout  # git diff --stat
    assert "review the change" in process.stdout


def test_the_latest_venv_is_not_committed():
    assert ".venv-latest/" in (ROOT / ".gitignore").read_text().splitlines()
