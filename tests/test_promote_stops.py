"""Faults in the field, part 3, case 1: a ``comlrl promote`` stopped half way never leaves a mixed champion.

A real ``comlrl promote`` process (``flows.cli.main``) moves ``champion`` from team A to team B. A launcher written
here wraps MLflow's client so that the process stops itself (SIGSTOP) before its first registry read and before
each registry write, after naming the call in a file; the test reads the store at each pause and then resumes the
process, or sends it SIGKILL, SIGINT or SIGTERM first. A reader thread polls the store the whole time. Every state
seen, in one SQLite read transaction (an instant of the registry), is one whole team: ``NAME-team@champion`` is A
or B, and each agent's ``champion`` alias names that team's version or is missing. Every state a consumer reads
through MLflow (the team's alias, then the versions its ``comlrl.agent_versions`` names) is A or B whole.

Then the command's end: 128 + the signal's number and one ``comlrl promote:`` line saying where the champion
stands, no traceback; a SIGKILL leaves a state the next ``comlrl promote`` completes, with one line saying so.
The store is read with ``sqlite3`` and MlflowClient, not through the code under test. The default tier builds the
two teams' versions with MlflowClient; the end-to-end tier registers them with two real ``comlrl run``s and stops
the promote at every write with every signal."""

from __future__ import annotations

import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

REPOSITORY = Path(__file__).resolve().parent.parent
BASE = "stops"
TEAM, AGENTS = f"{BASE}-team", [f"{BASE}-agent-0", f"{BASE}-agent-1"]
ALIAS = "champion"
# A move from A to B with two agents writes each agent's previous_champion tag, deletes each agent's alias, writes
# the team's tag and alias (the switch: pause 6, pause 0 being the first read), then each agent's alias.
WRITES, SWITCH = 8, 6
PROCESS_SECONDS = 240  # one promote process on a loaded 2-core machine takes 10-30 s, most of it imports
LAUNCHER = '''
"""flows.cli.main, stopping itself (SIGSTOP) before MLflow's first registry read and before each registry write,
after appending {"call", "args"} to the file COMLRL_TEST_CALLS names."""
import json, os, signal, sys, threading

from mlflow import MlflowClient

WRITE_PREFIXES = ("set_", "delete_", "create_", "update_", "rename_", "transition_", "copy_")
FIRST_READ = "search_registered_models"
inside = threading.local()
seen = {"read": False}


def pause(name, args):
    with open(os.environ["COMLRL_TEST_CALLS"], "a") as log:
        log.write(json.dumps({"call": name, "args": [str(a) for a in args]}) + "\\n")
    # To this thread: it stops before it returns from the call, so before the write (sent to the process, another
    # thread may take the signal and the group stop, while this one goes on with the write for a moment).
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def paused(name, method):
    def call(self, *args, **kwargs):
        outer = not getattr(inside, "depth", 0)
        if outer and (name.startswith(WRITE_PREFIXES) or (name == FIRST_READ and not seen["read"])):
            seen["read"] = True
            pause(name, args)
        inside.depth = getattr(inside, "depth", 0) + 1
        try:
            return method(self, *args, **kwargs)
        finally:
            inside.depth -= 1
    return call


for name in dir(MlflowClient):
    if not name.startswith("_") and (name.startswith(WRITE_PREFIXES) or name == FIRST_READ):
        setattr(MlflowClient, name, paused(name, getattr(MlflowClient, name)))

try:  # the command's stop handler, when there is one: each signal it has handled, appended as {"handled"}
    from flows.critical import StopSignals
except ImportError:
    StopSignals = None
if StopSignals is not None:
    handle = StopSignals._handle

    def handled(self, number, frame):
        with open(os.environ["COMLRL_TEST_CALLS"], "a") as log:
            log.write(json.dumps({"handled": signal.Signals(number).name}) + "\\n")
        return handle(self, number, frame)

    StopSignals._handle = handled

from flows.cli import main

sys.exit(main(sys.argv[1:]))
'''
RUN_AGAIN = "import sys; from flows.cli import main; sys.exit(main(sys.argv[1:]))"


# ----- the registry: two teams' versions, the champion on A, the candidate on B -------------------------------------
def store_path(workdir: Path) -> Path:
    return workdir / "mlflow" / "mlflow.db"


def client_for(workdir: Path) -> MlflowClient:
    return MlflowClient(f"sqlite:///{store_path(workdir)}")


def register_team(client: MlflowClient, source: Path) -> dict[str, str]:
    """One run's versions as a run leaves them: each agent, then the team naming them, the gate's decision
    ``promoted``; ``name -> version``."""
    versions = {name: str(client.create_model_version(name, source=str(source / name)).version) for name in AGENTS}
    team = str(client.create_model_version(TEAM, source=str(source / TEAM)).version)
    client.set_model_version_tag(TEAM, team, "comlrl.agent_versions", json.dumps(versions))
    client.set_model_version_tag(TEAM, team, "comlrl.gate.decision", "promoted")
    return {**versions, TEAM: team}


def two_teams(workdir: Path) -> tuple[dict[str, str], dict[str, str]]:
    """The champion A and the candidate B, registered with MlflowClient in the store ``--workdir`` uses."""
    store_path(workdir).parent.mkdir(parents=True)
    client = client_for(workdir)
    for name in [TEAM, *AGENTS]:
        client.create_registered_model(name)
    teams = register_team(client, workdir / "a"), register_team(client, workdir / "b")
    for team, alias in zip(teams, (ALIAS, "candidate")):
        for name, version in team.items():
            client.set_registered_model_alias(name, alias, version)
    return teams


# ----- what a reader sees ---------------------------------------------------------------------------------------
def snapshot(workdir: Path) -> dict[str, dict]:
    """The registry at one instant (one SQLite read transaction): every alias and every registered model's tag."""
    db = sqlite3.connect(f"file:{store_path(workdir)}?mode=ro", uri=True, isolation_level=None, timeout=30)
    try:
        db.execute("BEGIN")
        aliases = {(name, alias): str(version) for name, alias, version in
                   db.execute("SELECT name, alias, version FROM registered_model_aliases")}
        tags = {(name, key): value
                for name, key, value in db.execute("SELECT name, key, value FROM registered_model_tags")}
        db.execute("COMMIT")
    finally:
        db.close()
    return {"aliases": aliases, "tags": tags}


def champion(state: dict[str, dict]) -> dict[str, str | None]:
    return {name: state["aliases"].get((name, ALIAS)) for name in [TEAM, *AGENTS]}


def whole(held: dict[str, str | None], teams: tuple[dict[str, str], ...]) -> bool:
    """The team alias names one of ``teams``, and every agent alias present names that team's version; or no
    champion at all."""
    if all(version is None for version in held.values()):
        return True
    return any(held[TEAM] == team[TEAM] and all(held[name] in (None, team[name]) for name in AGENTS) for team in teams)


def half_moved(held: dict[str, str | None], teams: tuple[dict[str, str], ...]) -> bool:
    return not any(held == team for team in teams)


def consumer_reads(workdir: Path) -> tuple[dict[str, str], dict[str, str | None]]:
    """What a consumer reads through MLflow: the team the docs' way (its alias, then the agent versions its
    ``comlrl.agent_versions`` names), and each agent's own alias (None: MLflow has none)."""
    client = client_for(workdir)
    team = client.get_model_version_by_alias(TEAM, ALIAS)
    members = json.loads(team.tags["comlrl.agent_versions"])
    direct = {name: client.get_registered_model(name).aliases.get(ALIAS) for name in AGENTS}
    return {**members, TEAM: str(team.version)}, {name: None if v is None else str(v) for name, v in direct.items()}


class Reader(threading.Thread):
    """Polls the registry (:func:`snapshot`) until stopped; keeps every distinct champion it saw."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(daemon=True)
        self.workdir, self.seen, self.reads = workdir, [], 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                held = champion(snapshot(self.workdir))
            except sqlite3.OperationalError:  # the writer held the lock past the timeout: read again
                continue
            self.reads += 1
            if not self.seen or self.seen[-1] != held:
                self.seen.append(held)
            time.sleep(0.005)

    def stop(self) -> list[dict[str, str | None]]:
        self.done.set()
        self.join(10)
        return self.seen


# ----- the promote process ----------------------------------------------------------------------------------------
def environment(calls: Path | None = None) -> dict[str, str]:
    clean = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_", "MLFLOW_"))}
    return {**clean, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPOSITORY),
            **({"COMLRL_TEST_CALLS": str(calls)} if calls else {})}


def stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (a group stop)."""
    states = [stat.read_text().rsplit(")", 1)[1].split()[0] for stat in Path(f"/proc/{pid}/task").glob("*/stat")]
    return bool(states) and all(state == "T" for state in states)


def wait_paused(process: subprocess.Popen) -> bool:
    """Whether the process stopped itself (True) or ended (False)."""
    deadline = time.monotonic() + PROCESS_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        try:
            if stopped(process.pid):
                return True
        except (FileNotFoundError, ProcessLookupError):  # it is ending: its threads go
            pass
        time.sleep(0.02)
    process.kill()
    raise AssertionError("the promote process neither paused nor ended")


def promote_stopped(workdir: Path, tmp_path: Path, teams: tuple[dict[str, str], ...],
                    stops: dict[int, signal.Signals], second: signal.Signals | None = None) -> dict:
    """Run ``comlrl promote BASE`` under the launcher, pause by pause; at pause ``index`` send ``stops[index]``
    first (0 is the first read, 1.. the writes); ``second``: sent at the first pause after the command has
    handled the first signal. Asserts, at every pause, a whole team in the store, what a consumer reads through
    MLflow, and at most one change since the previous pause (the pauses bracket each write). Returns the calls,
    the signals the command handled, the states at the pauses, the exit status and the output."""
    log = tmp_path / f"calls-{time.monotonic_ns()}.jsonl"
    reader = Reader(workdir)
    reader.start()
    process = subprocess.Popen([sys.executable, "-c", LAUNCHER, "promote", BASE, "--workdir", str(workdir)],
                               env=environment(log), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    states, pauses = [snapshot(workdir)], 0
    try:
        while wait_paused(process):
            state = snapshot(workdir)
            assert changes(states[-1], state) <= 1, (pauses, states[-1], state, logged(log))
            held = champion(state)
            assert whole(held, teams), held
            team, direct = consumer_reads(workdir)
            assert team in teams and all(direct[name] in (None, team[name]) for name in AGENTS), (team, direct)
            states.append(state)
            if pauses in stops:
                process.send_signal(stops[pauses])
            elif second is not None and any("handled" in entry for entry in logged(log)):
                process.send_signal(second)
                second = None
            elif second is not None:
                time.sleep(0.6)  # the command's main thread waits on its writer at most 0.5 s before a handler runs
            pauses += 1
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
        stdout, stderr = process.communicate(timeout=PROCESS_SECONDS)
    finally:
        if process.poll() is None:
            process.kill()
        seen = reader.stop()
    final = snapshot(workdir)
    assert changes(states[-1], final) <= 1, (states[-1], final, logged(log))
    assert reader.reads > 0 and all(whole(held, teams) for held in seen), seen
    entries = logged(log)
    return {"calls": [entry for entry in entries if "call" in entry],
            "handled": [entry["handled"] for entry in entries if "handled" in entry], "states": [*states, final],
            "seen": seen, "status": process.returncode, "stdout": stdout, "stderr": stderr, "final": champion(final)}


def logged(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def changes(before: dict[str, dict], after: dict[str, dict]) -> int:
    """How many aliases and tags differ between two snapshots."""
    return sum(len({key for key in before[kind].keys() | after[kind].keys()
                    if before[kind].get(key) != after[kind].get(key)}) for kind in ("aliases", "tags"))


def promote_again(workdir: Path, tmp_path: Path) -> tuple[int, str, str]:
    """``comlrl promote BASE`` as a process: its status, standard output and standard error."""
    done = subprocess.run([sys.executable, "-c", RUN_AGAIN, "promote", BASE, "--workdir", str(workdir)],
                          env=environment(), cwd=tmp_path, capture_output=True, text=True, timeout=PROCESS_SECONDS)
    return done.returncode, done.stdout, done.stderr


def promote_in_this_process(workdir: Path, capsys) -> tuple[int, str, str]:
    """:func:`promote_again` through ``flows.cli.main`` here (no second process start: the default tier's time);
    the environment the command sets is put back."""
    from flows import cli

    saved = dict(os.environ)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{store_path(workdir)}"
    capsys.readouterr()
    try:
        status = cli.main(["promote", BASE, "--workdir", str(workdir)])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    out, err = capsys.readouterr()
    return status, out, err


def our_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-4000:]
    return [line for line in stderr.splitlines() if line.startswith("comlrl")]


def describe(team: dict[str, str]) -> str:
    return f"{TEAM} v{team[TEAM]} ({', '.join(f'{name} v{team[name]}' for name in AGENTS)})"


def check_stop(outcome: dict, teams: tuple[dict[str, str], dict[str, str]], kind: signal.Signals, index: int) -> None:
    """The killed command's end: its status, its one line, the champion it leaves."""
    first, second = teams
    if kind == signal.SIGKILL:
        assert outcome["status"] == -signal.SIGKILL and not our_lines(outcome["stderr"]), outcome["stderr"][-2000:]
        assert whole(outcome["final"], teams), outcome["final"]
        return
    assert outcome["status"] == 128 + kind, outcome["stderr"][-4000:]
    assert our_lines(outcome["stderr"]) == [line for line in outcome["stderr"].splitlines() if line.strip()]
    if index == 0:
        assert outcome["stderr"].strip() == (f"comlrl promote: stopped by {kind.name} before any alias moved: "
                                             "nothing in the registry changed")
        assert outcome["states"][-1] == outcome["states"][0] and not outcome["calls"][1:]  # no write began
    else:
        assert outcome["stderr"].strip() == (f"comlrl promote: stopped by {kind.name} once the writes it had begun "
                                             f"were finished: {ALIAS} is {describe(second)}, whole")
        assert outcome["final"] == second
    assert not outcome["stdout"].strip()


def check_again(workdir: Path, again: tuple[int, str, str], left: dict[str, str | None],
                teams: tuple[dict[str, str], dict[str, str]]) -> None:
    """``comlrl promote`` once more (``again``: its status and output): it moves the champion to B, and says it
    completed a half-moved one."""
    status, stdout, stderr = again
    assert status == 0, stderr[-4000:]
    lines = our_lines(stderr)
    if half_moved(left, teams):
        holder = teams[0] if left[TEAM] == teams[0][TEAM] else teams[1]
        found = ", ".join(f"{name} {'without it' if left[name] is None else 'v' + left[name]}"
                          for name in AGENTS if left[name] != holder[name])
        assert lines == [f"comlrl promote: {TEAM}@{ALIAS} was half moved, a move stopped between its alias writes "
                         f"(v{left[TEAM]} beside {found}); completed: every {ALIAS} alias now names "
                         f"{describe(teams[1])}"], stderr[-4000:]
    else:
        assert lines == [], stderr[-4000:]
    assert champion(snapshot(workdir)) == teams[1]
    assert [line.split(":")[0] for line in stdout.splitlines()] == [*AGENTS, TEAM]


# ----- the default tier -------------------------------------------------------------------------------------------
def test_a_promote_killed_at_the_switch_leaves_one_whole_team_and_the_next_completes_it(tmp_path, capsys):
    """SIGKILL just before the team's alias moves (the switch): the agents have lost their champion alias, the
    team still names A. Whole for every reader at every pause; the next promote completes the move and says so."""
    workdir = tmp_path / "work"
    teams = two_teams(workdir)
    outcome = promote_stopped(workdir, tmp_path, teams, {SWITCH: signal.SIGKILL})
    assert outcome["calls"][SWITCH] == {"call": "set_registered_model_alias", "args": [TEAM, ALIAS, teams[1][TEAM]]}
    check_stop(outcome, teams, signal.SIGKILL, SWITCH)
    assert outcome["final"] == {TEAM: teams[0][TEAM], **{name: None for name in AGENTS}}
    check_again(workdir, promote_in_this_process(workdir, capsys), outcome["final"], teams)


def test_every_write_of_a_team_move_keeps_each_instant_whole(tmp_path, monkeypatch):
    """In this process: from each state a move can start from (no champion; A; what a move killed before or after
    its switch leaves), every write of the move to B' (B's team keeping A's agent-1 version) leaves the registry
    whole, read at once after it, and the move ends on B' whole. The writes run as MLflow makes them; a wrapper
    only reads the store after each."""
    from flows import registry

    workdir = tmp_path / "work"
    first, second = two_teams(workdir)
    client = client_for(workdir)
    target = {**second, AGENTS[1]: first[AGENTS[1]]}
    client.set_model_version_tag(TEAM, second[TEAM], "comlrl.agent_versions",
                                 json.dumps({name: target[name] for name in AGENTS}))
    starts = {"no champion": {}, "A": first,
              "killed before the switch": {TEAM: first[TEAM], AGENTS[1]: first[AGENTS[1]]},
              "killed after the switch": {TEAM: target[TEAM], AGENTS[0]: target[AGENTS[0]]}}
    seen: list[dict[str, str | None]] = []
    for method in ("set_registered_model_alias", "delete_registered_model_alias", "set_registered_model_tag"):
        def observed(self, *args, _original=getattr(MlflowClient, method), **kwargs):
            result = _original(self, *args, **kwargs)
            seen.append(champion(snapshot(workdir)))
            return result

        monkeypatch.setattr(MlflowClient, method, observed)
    for label, start in starts.items():
        for name in [TEAM, *AGENTS]:
            if name in start:
                client.set_registered_model_alias(name, ALIAS, start[name])
            elif ALIAS in client.get_registered_model(name).aliases:
                client.delete_registered_model_alias(name, ALIAS)
        seen[:] = [champion(snapshot(workdir))]
        registry.move_team_alias(f"sqlite:///{store_path(workdir)}", TEAM, target[TEAM],
                                 {name: target[name] for name in AGENTS}, ALIAS)
        assert seen[-1] == target, (label, seen)
        assert all(whole(held, (first, target)) for held in seen), (label, seen)
        assert len({held[TEAM] for held in seen}) <= 2, (label, seen)  # the team's alias moves once at most


def test_a_champion_the_old_order_left_mixed_is_completed_onto_its_team(tmp_path):
    """The agents-first order of earlier versions, killed after its first write, left agent 0 on B beside team A
    and agent 1 on A: the repair puts agent 0 back on the team's version and says what it found."""
    from flows import registry

    workdir = tmp_path / "work"
    first, second = two_teams(workdir)
    client_for(workdir).set_registered_model_alias(AGENTS[0], ALIAS, second[AGENTS[0]])
    line = registry.repair_team_alias(f"sqlite:///{store_path(workdir)}", TEAM, ALIAS)
    assert line == (f"{TEAM}@{ALIAS} was half moved, a move stopped between its alias writes (v{first[TEAM]} beside "
                    f"{AGENTS[0]} v{second[AGENTS[0]]}); completed: every {ALIAS} alias now names {describe(first)}")
    assert champion(snapshot(workdir)) == first
    assert registry.repair_team_alias(f"sqlite:///{store_path(workdir)}", TEAM, ALIAS) is None  # whole: nothing to do


def test_the_gate_completes_a_half_moved_champion_and_says_so(tmp_path, caplog):
    """A promote killed after its switch (team B, agents without the alias): a run whose team is that champion
    passes its gate ("already champion", nothing evaluated) and the gate completes the agents' aliases, with one
    warning line."""
    from flows import gate
    from flows.spec import parse_spec
    from letters_spec import letters_spec

    workdir = tmp_path / "work"
    first, second = two_teams(workdir)
    client = client_for(workdir)
    client.set_registered_model_alias(TEAM, ALIAS, second[TEAM])
    for name in AGENTS:
        client.delete_registered_model_alias(name, ALIAS)
    client.delete_model_version_tag(TEAM, second[TEAM], "comlrl.gate.decision")  # no gate has judged it
    spec = parse_spec(letters_spec(BASE), "spec.yaml", ".")
    with caplog.at_level(logging.WARNING, logger="flows.gate"):
        decision = gate.run_gate(spec, {"eval/reward_mean": 0.5}, second, f"sqlite:///{store_path(workdir)}", ".",
                                 str(workdir), "candidate")
    assert decision.promoted and decision.reason == "already champion"
    assert champion(snapshot(workdir)) == second
    assert [record.getMessage() for record in caplog.records if record.name == "flows.gate"] == [
        f"the gate found {TEAM}@{ALIAS} was half moved, a move stopped between its alias writes (v{second[TEAM]} "
        f"beside {AGENTS[0]} without it, {AGENTS[1]} without it); completed: every {ALIAS} alias now names "
        f"{describe(second)}"]


# ----- the end-to-end tier: two real runs, every write, every signal ----------------------------------------------
@pytest.fixture(scope="module")
def real_runs(tmp_path_factory) -> tuple[Path, tuple[dict[str, str], dict[str, str]]]:
    """Two real ``comlrl run``s of the letters spec (run B's gate promotes it: the same score); the champion then
    set back on run A's versions by hand, as a rollback would. Returns the store's file and the two teams."""
    from comlrl.tasks.letters import write_dataset
    from letters_spec import letters_spec

    root = tmp_path_factory.mktemp("runs")
    write_dataset(root / "project" / "data" / "letters", num_train=4, num_eval=2)
    spec = letters_spec(BASE, num_generations=2, max_new_tokens=4, num_train_epochs=1, per_device_train_batch_size=2)
    (root / "project" / "spec.yaml").write_text(yaml.safe_dump(spec))
    for run_id in ("stops-a", "stops-b"):
        result = subprocess.run([str(Path(sys.executable).parent / "comlrl"), "run",
                                 str(root / "project" / "spec.yaml"), "--root", str(root / "project"),
                                 "--workdir", str(root / "work"), "--run-id", run_id],
                                env=environment(), cwd=root, capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, result.stderr[-4000:]
    client = client_for(root / "work")
    teams = []
    for run_id in ("stops-a", "stops-b"):
        [team] = [v for v in client.search_model_versions(f"name = '{TEAM}'") if v.tags["comlrl.run_id"] == run_id]
        teams.append({**json.loads(team.tags["comlrl.agent_versions"]), TEAM: str(team.version)})
        assert team.tags["comlrl.gate.decision"] == "promoted"
    for name, version in teams[0].items():
        client.set_registered_model_alias(name, ALIAS, version)
    return store_path(root / "work"), tuple(teams)


def fresh_copy(real_runs, tmp_path: Path) -> Path:
    store, _ = real_runs
    workdir = tmp_path / "work"
    store_path(workdir).parent.mkdir(parents=True)
    store_path(workdir).write_bytes(store.read_bytes())
    return workdir


# Every registry call a stop can come before (0: the first read), with every signal; a SIGKILL before any write
# leaves a process that did nothing.
CASES = [(index, kind) for index in range(WRITES + 1) for kind in (signal.SIGKILL, signal.SIGINT, signal.SIGTERM)
         if index or kind != signal.SIGKILL]


@pytest.mark.e2e  # two real runs for the module (1-3 min), then one or two promote processes a case (10-30 s each)
@pytest.mark.parametrize("index, kind", CASES,
                         ids=[f"{'first-read' if index == 0 else f'write-{index}'}-{kind.name}" for index, kind in CASES])
def test_a_promote_stopped_at_each_registry_call_by_each_signal(real_runs, tmp_path, index, kind):
    teams = real_runs[1]
    workdir = fresh_copy(real_runs, tmp_path)
    outcome = promote_stopped(workdir, tmp_path, teams, {index: kind})
    ended = index == 0 or kind == signal.SIGKILL  # before any write, or where it was killed; else every write
    assert len(outcome["calls"]) == (index + 1 if ended else WRITES + 1), outcome["calls"]
    check_stop(outcome, teams, kind, index)
    if kind == signal.SIGKILL or index == SWITCH:
        check_again(workdir, promote_again(workdir, tmp_path), outcome["final"], teams)


@pytest.mark.e2e  # two promote processes, 10-30 s each
def test_a_second_signal_during_the_writes_ends_at_once_and_the_next_promote_completes(tmp_path):
    """SIGTERM at the first write, a second once the command has handled the first: it ends at once with its line,
    whatever the writes had reached is whole, and the next promote completes the move."""
    workdir = tmp_path / "work"
    teams = two_teams(workdir)
    outcome = promote_stopped(workdir, tmp_path, teams, {1: signal.SIGTERM}, second=signal.SIGTERM)
    assert outcome["handled"] == ["SIGTERM", "SIGTERM"], outcome["handled"]
    assert outcome["status"] == 128 + signal.SIGTERM
    [line] = our_lines(outcome["stderr"])
    assert line == (f"comlrl promote: stopped by SIGTERM (a second signal) during the alias writes: {TEAM}@{ALIAS} "
                    f"names one whole team (the one before, or {describe(teams[1])}) and an agent's {ALIAS} alias "
                    f"may be missing; run this command again to complete the move"), line
    check_again(workdir, promote_again(workdir, tmp_path), outcome["final"], teams)
