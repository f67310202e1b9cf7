"""Every shell command the README, ``docs/`` and the CLI's hints show works as printed from a fresh shell in the
repository root after ``bash infra/bootstrap.sh demo``: no activated virtual environment, ``PATH=/usr/bin:/bin``.

Commands are the lines of the documents' ```bash blocks and the code spans that call a known executable with
arguments (a span that only names a command, like ``comlrl run``, is prose). Each is run as printed when it is safe
(``--help``, ``status``); otherwise it is skipped for a stated reason (a server, training, an install, a placeholder
to fill in, changes to the registry) and, when it calls the venv's executable, its sub-command's ``--help`` is run
instead, which fails exactly when the executable is not where the line says."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", ROOT / "infra" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
CLEAN_ENV = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root")}
# Installed only into the project's venv: called bare they need an activated venv.
VENV_ONLY = ("comlrl", "mlflow", "prefect", "torchrun", "accelerate", "mutmut", "pytest", "pip", "uvicorn")
KNOWN = (*VENV_ONLY, "bash", "python", "python3", "curl", "git", "docker", "kubectl", "export", "cd")
ASSIGNMENTS = r"(?:[A-Z_][A-Z0-9_]*=\S*\s+)*"
CALL = re.compile(rf"^{ASSIGNMENTS}(?P<exe>(?:\S*/)?(?P<name>[a-z][\w.-]*|\.))(?=\s|$)(?P<args>.*)$", re.S)
# Tools with sub-commands: a span of the tool and sub-command words only names a command.
NAMING = re.compile(r"^(?:\S*/)?(?:comlrl|mlflow|prefect|mutmut|accelerate)(?: [a-z][a-z-]*)*$")
PLACEHOLDER = re.compile(r"…|\.\.\.|<[^>]+>|\b(?:RUN_ID|RUN_DIR|RUN|SPEC|NAME|MODEL|COMMAND|HOST0|N)\b")
ACTIVATION = re.compile(r"\.venv/bin/activate|\bactivated (?:shell|venv)")


@dataclass(frozen=True)
class Command:
    source: str  # file:line
    text: str
    context: str  # the prose (and earlier lines of its block) right before it

    @property
    def call(self) -> re.Match:
        return CALL.match(self.text)


def strip_comment(line: str) -> str:
    """The line without a trailing ``# comment`` (a ``#`` outside quotes, after whitespace)."""
    quote = None
    for index, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index].rstrip()
    return line.rstrip()


def block_commands(path: Path, text: str) -> list[Command]:
    found = []
    for block in re.finditer(r"^```(?:bash|sh|shell)\n(.*?)^```", text, flags=re.S | re.M):
        first_line = text[:block.start(1)].count("\n") + 1
        before = text[max(0, block.start() - 400):block.start()]
        pending, start = "", 0
        for offset, raw in enumerate(block.group(1).splitlines()):
            line = strip_comment(raw)
            if not pending:
                start = first_line + offset
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            command = " ".join((pending + line).split())
            pending = ""
            if command:
                earlier = block.group(1)[:block.group(1).find(raw)]
                found.append(Command(f"{path.relative_to(ROOT)}:{start}", command, before + earlier))
    return found


def span_commands(path: Path, text: str) -> list[Command]:
    prose = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)
    found = []
    for span in re.finditer(r"`([^`]+)`", prose):
        command = " ".join(span.group(1).split())
        call = CALL.match(command)
        if not call or call.group("name") not in KNOWN or NAMING.match(command) or not call.group("args").strip():
            continue
        found.append(Command(f"{path.relative_to(ROOT)}:{prose[:span.start()].count(chr(10)) + 1}", command,
                             prose[max(0, span.start() - 400):span.start()]))
    return found


def documented_commands() -> list[Command]:
    commands = []
    for path in DOCUMENTS:
        text = path.read_text()
        commands += block_commands(path, text) + span_commands(path, text)
    return commands


def printed_commands() -> list[Command]:
    """The commands a finished run prints under "where to look" (embedded default), from a clean shell."""
    script = ("import os; os.environ['MLFLOW_TRACKING_URI'] = 'sqlite:///.comlrl/mlflow/mlflow.db'; "
              "os.environ['PREFECT_HOME'] = '.comlrl/prefect'; "
              "from flows.environment import where_to_look; where_to_look('.comlrl')")
    shown = subprocess.run([".venv/bin/python", "-c", script], cwd=ROOT, env=CLEAN_ENV, capture_output=True,
                           text=True, timeout=60, check=True).stdout
    lines = [line.split(":", 1)[1].strip() for line in shown.splitlines() if line.strip().endswith("127.0.0.1")]
    return [Command("printed by where_to_look", line, "") for line in lines]


def skip_reason(command: Command) -> str | None:
    """Why a command is not run as printed; None when it is safe to run."""
    text, name = command.text, command.call.group("name")
    args = command.call.group("args").split()
    if PLACEHOLDER.search(text):
        return "a placeholder to fill in"
    if "--help" in args or "-h" in args and name != "mlflow" or args[-1:] in (["status"], ["version"], ["--version"]):
        return None
    if name == "bash" and "bootstrap.sh" in text:
        return "the README's set-up command itself (installs, then runs the demo or the suite)"
    if re.search(r"\b(?:ui|server|serve|worker|up)\b|servers\.sh (?:start|db-start)", text):
        return "starts a long-running server"
    if re.search(r"servers\.sh (?:stop|db-stop)|\bpromote\b|\bdeploy\b|work-pool create|worktree|archive", text):
        return "changes state (servers, registry aliases, deployments, the working tree)"
    if re.search(r"\b(?:run|resume|demo|launch|sync)\b", text) or name == "torchrun":
        return "trains or replays a run (minutes)"
    if name == "pip" or "install" in args:
        return "installs packages (minutes, network)"
    if name in ("python", "python3"):
        return "runs a script (a model build, a report, your training script)"
    if name in (".", "source", "export", "cd", "curl", "docker", "kubectl", "git"):
        return "shell state, a client of a running server, or a container runtime"
    return "not known to be safe"


def probe(command: Command) -> list[str] | None:
    """For a skipped call of a venv executable: the same executable and sub-command with ``--help``."""
    call = command.call
    if call.group("name") not in VENV_ONLY or call.group("name") in ("pip", "mutmut"):
        return None
    words = [call.group("exe")]
    for word in call.group("args").split():
        if not re.fullmatch(r"[a-z][a-z-]*", word) or len(words) == 3:
            break
        words.append(word)
    if call.group("name") == "comlrl":
        words = words[:2]  # comlrl has one level of sub-commands
    return [*words, "--help"]


def run_clean(argv: list[str] | str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, env=CLEAN_ENV, shell=isinstance(argv, str), capture_output=True,
                          text=True, timeout=90)


def is_bare(command: Command) -> bool:
    """A venv-only executable called by name, with nothing before it saying to activate the venv."""
    call = command.call
    return (call is not None and call.group("name") in VENV_ONLY and "/" not in call.group("exe")
            and not ACTIVATION.search(command.context))


def test_the_clean_environment_has_no_venv_on_path():
    """What the other tests rely on: a bare venv executable is not found there, whatever the caller activated."""
    assert run_clean("comlrl --help").returncode == 127
    assert is_bare(Command("example", "comlrl run flows/specs/letters.yaml", "prose without the word"))
    assert not is_bare(Command("example", "mutmut results", "first: . .venv/bin/activate\n"))


def test_no_documented_or_printed_command_needs_an_activated_venv():
    commands = documented_commands() + printed_commands()
    assert len(commands) > 20, "the extraction found too few commands: did the documents' format change?"
    bare = [f"{c.source}: {c.text}" for c in commands if is_bare(c)]
    assert not bare, "call .venv/bin/NAME, or say right before to activate the venv:\n" + "\n".join(bare)


def test_printed_hints_in_flows_call_the_venv_executable():
    """The hints flows/ and comlrl/ print (resume, sync, UIs) are built with comlrl.executables.executable, never a bare name."""
    hint = re.compile(r"(?<![\w/.`'])(?:comlrl (?:resume|sync|promote|run|demo)|mlflow (?:ui|server|models serve)"
                      r"|prefect (?:server start|deploy|worker|work-pool|--no-prompt))(?=\s|$)")
    found = []
    for path in sorted([*(ROOT / "flows").glob("*.py"), *(ROOT / "comlrl").rglob("*.py")]):
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if hint.search(node.value):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value[:120]!r}")
    assert not found, "use comlrl.executables.executable(NAME) in printed commands:\n" + "\n".join(found)


def test_model_serving_puts_the_venv_on_path():
    """``mlflow models serve`` starts its scoring server by running ``uvicorn`` from PATH, so the documented
    command must put the venv's bin there (tests/test_pipeline_ux.py serves the champion that way over HTTP)."""
    serving = [c for c in documented_commands() if "models serve -m" in c.text]
    assert serving, "no documented `mlflow models serve -m ...` command found"
    for command in serving:
        assert re.search(r"\bPATH=\.venv/bin:\$PATH\b", command.text), f"{command.source}: {command.text}"
        assert "--env-manager local" in command.text, f"{command.source}: {command.text}"


def test_safe_commands_run_in_a_clean_environment():
    commands = documented_commands() + printed_commands()
    runs: dict[str, list[str] | str] = {}
    report = []
    for command in commands:
        reason = skip_reason(command)
        if reason is None:
            runs.setdefault(command.text, command.text)
            report.append(f"run      {command.source}: {command.text}")
            continue
        argv = probe(command)
        if argv:
            runs.setdefault(" ".join(argv), argv)
        report.append(f"skipped  {command.source}: {command.text}  ({reason}"
                      + (f"; probed with {' '.join(argv)})" if argv else ")"))
    print("\n".join(report))
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = dict(zip(runs, pool.map(run_clean, runs.values())))
    failed = [f"{key}: exit {r.returncode}\n{(r.stderr or r.stdout)[-600:]}" for key, r in results.items()
              if r.returncode != 0]
    assert not failed, "these fail from a fresh shell in the repository root:\n" + "\n\n".join(failed)
    assert len(results) >= 5, sorted(results)


if __name__ == "__main__":  # list what the module finds and how it classifies it
    for found in documented_commands():
        print(f"{skip_reason(found) or 'run'}\t{found.source}\t{found.text}")
    sys.exit(0)
