"""The ``comlrl`` command line: run, resume, serve, promote and the bundled demo.

Prefect and MLflow settings come from the environment (``PREFECT_API_URL``,
``MLFLOW_TRACKING_URI``); without them the embedded default is used: Prefect's ephemeral
mode and an MLflow SQLite store under the working directory (``--workdir``, default .comlrl).

Exit statuses of ``run``/``resume`` (0 done, 1 failed after the start, 2 bad input, 69 Prefect unreachable, 75
MLflow unreachable, 130/143 stopped) and what each prints: docs/pipeline.md, "Exit statuses" and "Errors after the
start". ``sync``: see :func:`sync` (65 for an unreadable spool). MLflow calls of ``promote`` and ``sync`` give up
after ``COMLRL_MLFLOW_DEADLINE`` seconds.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from flows.environment import configure, where_to_look
from comlrl.executables import executable


EXIT_TRACKING_UNREACHABLE = 75  # sysexits' EX_TEMPFAIL: try again once the MLflow server answers
# Path options checked against the filesystem's limits before a command starts, with the bytes comlrl adds
# below each (under --workdir: runs/<run id>/checkpoints/..., mlflow/artifacts/..., a few hundred at most).
VERBOSE_HELP = ("print tracebacks on the console (by default they go to WORKDIR/logs/RUN_ID.log, which the closing "
                "comlrl: line names)")
PATH_OPTIONS = {"workdir": ("--workdir", 512), "root": ("--root", 0), "path": ("PATH", 0)}


def _load_spec(spec: str, root: str):
    """The validated run spec, or None once every problem has been printed."""
    from flows.spec import SpecError, load_spec

    try:
        return load_spec(spec, root)
    except SpecError as error:
        print(f"comlrl: {error}", file=sys.stderr)
        return None


def _bad_path_option(args: argparse.Namespace) -> bool:
    """Print why a path option cannot be used here (too long for the filesystem, a link loop, ...); whether one
    could not."""
    from flows.path_limits import checked_path

    for name, (flag, reserve) in PATH_OPTIONS.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        try:
            checked_path(value, reserve=reserve, what=flag)
        except ValueError as error:
            print(f"comlrl: {flag}: {error}", file=sys.stderr)
            return True
    return False


def _bad_run_id(run_id: str | None) -> bool:
    """Print why ``run_id`` is refused (before anything starts); whether it was."""
    from flows.spec import check_run_id  # light: a bad run id is refused before torch is imported

    try:
        if run_id is not None:
            check_run_id(run_id)
    except ValueError as error:
        print(f"comlrl: {error}", file=sys.stderr)
        return True
    return False


def _refused_by_preflight(spec, args: argparse.Namespace, root: str) -> bool:
    """Print every problem of the data files, --workdir, the run and the servers (flows/preflight.py), one line
    each; whether there was one. With ``resume --new-mlflow-run`` and none, the run's request for a new MLflow run is
    recorded (flows/new_mlflow_run.py), or why it cannot be is the problem."""
    from flows.preflight import preflight
    from flows.runs import RunPaths, default_run_id

    # With --init-from and no --run-id the flow derives the run id from the pinned spec: its run is checked there.
    run_id = args.run_id or (None if spec is None or args.init_from else default_run_id(spec))
    replace_mlflow_run = getattr(args, "new_mlflow_run", False)
    problems = preflight(spec, args.workdir, root, run_id, new_mlflow_run=replace_mlflow_run)
    if not problems and spec is not None and replace_mlflow_run:
        from flows import new_mlflow_run

        try:
            new_mlflow_run.request(RunPaths(run_id, Path(args.workdir).resolve()))
        except (ValueError, OSError) as error:
            problems.append(str(error) if isinstance(error, ValueError) else
                            f"run {run_id!r}: the request for a new MLflow run could not be written ({error})")
    for problem in problems:
        print(f"comlrl: {problem}", file=sys.stderr)
    return bool(problems)


def _configured(workdir: str, orchestrate: bool = True) -> bool:
    """:func:`flows.environment.configure`; False once a store that could not be made (a full disk: nothing is
    left behind, the same command works once there is room) has been named on one line."""
    try:
        configure(workdir, orchestrate)
    except OSError as error:
        print(f"comlrl: {error}", file=sys.stderr)
        return False
    return True


class StoppedOutsideTraining(KeyboardInterrupt):
    """A SIGTERM or SIGINT while ``comlrl run``/``resume`` starts (spec, stores, servers) or ends, outside the
    handlers with which training and the end of a run finish what is under way: the command stops at once and
    says so (exit 128 + the signal's number), as it does for a stop inside training."""

    def __init__(self, number: int) -> None:
        super().__init__(signal.Signals(number).name)
        self.number = number


def _stop_now(number: int, frame: object) -> None:
    raise StoppedOutsideTraining(number)


def run(args: argparse.Namespace) -> int:
    """``comlrl run`` (and ``resume``): a stop signal before training or after it ends the command with one
    line, the run's state as a stop inside training leaves it (see :class:`StoppedOutsideTraining`)."""
    main = threading.current_thread() is threading.main_thread()  # only there can handlers be installed
    previous = {number: signal.signal(number, _stop_now) for number in (signal.SIGTERM, signal.SIGINT) if main}
    try:
        return _run(args)
    except StoppedOutsideTraining as stop:
        for number in previous:  # a second signal while this is written ends the process as the signal does
            signal.signal(number, signal.SIG_DFL)
        run_id = getattr(args, "resolved_run_id", None) or args.run_id
        print(f"\ncomlrl: {stop} received: stopped; {advice(run_id, args.workdir)}", file=sys.stderr)
        return 128 + stop.number
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _run(args: argparse.Namespace) -> int:
    root = str(Path(args.root).resolve())
    if _bad_run_id(args.run_id):
        return 2
    from flows.runs import apply_offline_defaults

    apply_offline_defaults()  # the run's hub setting judges the spec too (a hub id absent offline: exit 2 here)
    spec = _load_spec(args.spec, root)
    if _refused_by_preflight(spec, args, root) or spec is None:  # before any server, MLflow run or model
        return 2
    if not _configured(args.workdir):
        return 2
    from flows.console import attach_bar, tracebacks_to
    from flows.orchestrator import exit_if_unreachable
    from flows.runs import default_run_id
    from flows.training import training_flow

    # For messages only: with --init-from the flow derives the default run id from the pinned spec.
    run_id = args.run_id or (None if args.init_from else default_run_id(spec))
    args.resolved_run_id = run_id
    log = Path(args.workdir).resolve() / "logs" / f"{args.run_id or (spec.name if args.init_from else run_id)}.log"
    if not args.verbose:
        tracebacks_to(log)
    attach_bar()  # a terminal gets a progress bar (steps, reward, elapsed, time left); logs get none
    try:
        state = training_flow(spec)(spec_path=str(Path(args.spec).resolve()), run_id=args.run_id,
                                    workdir=args.workdir, root=root, init_from_alias=args.init_from,
                                    return_state=True)
    except StoppedOutsideTraining:
        raise
    except KeyboardInterrupt:  # a second stop signal: the step in progress is lost, earlier checkpoints are not
        print(f"\ncomlrl: interrupted twice; continue from the newest checkpoint with:  "
              f"{executable('comlrl')} resume {run_id or 'RUN_ID'} --workdir {args.workdir}", file=sys.stderr)
        return 130
    except Exception as error:
        exit_if_unreachable(run_id, args.workdir, error)  # ends the process (69) when Prefect is down
        if args.verbose:
            raise
        logging.getLogger("comlrl.cli").error("the flow could not run", exc_info=error)
        print(f"\ncomlrl: {failure_line(run_id, args.workdir, error, log)}", file=sys.stderr)
        return 1
    exit_if_unreachable(run_id, args.workdir)
    return report(state, run_id, args.workdir, None if args.verbose else log)


def first_line(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0] if lines else ""


def summary(error: BaseException) -> str:
    """``Type: the first line of its message``, and the exception at the bottom of its chain (``raise … from``,
    or raised while handling it) when that one says something else: a full disk reported by the database
    under MLflow's wrapper reads ``MlflowException: … (first: OperationalError: database or disk is full)``.
    One line, whatever the messages hold (SQL, parameters, newlines)."""
    text = f"{type(error).__name__}: {first_line(error)}"
    seen, bottom = {id(error)}, error
    while (below := bottom.__cause__ or bottom.__context__) is not None and id(below) not in seen:
        seen.add(id(below))
        bottom = below
    if bottom is not error and first_line(bottom) not in text:
        text += f" (first: {type(bottom).__name__}: {first_line(bottom)})"
    return text


def failure_line(run_id: str | None, workdir: str, error: BaseException | str, log: Path | None) -> str:
    """What failed, where its traceback is, and what to do: ``comlrl resume`` only when the run has a checkpoint
    to continue from and the error is not one a resume meets again (the run refused, a checkpoint refused). A full
    disk under the run (the error says so, or one of its disks has less than ``full_disk.FULL_BELOW`` free,
    whatever failed first) is named with its free space; a log file that lost the traceback says so."""
    from comlrl.errors import CheckpointError
    from flows import full_disk
    from flows.console import log_file_trouble
    from flows.runs import RunRefused

    name = run_id or "RUN_ID"  # --init-from without --run-id: the flow derived it; the user reads it there
    cause = summary(error) if isinstance(error, BaseException) else first_line(error)
    trouble = log_file_trouble(log) if log is not None else None
    where = f" ({trouble})" if trouble else f" (traceback: {log})" if log is not None else ""
    if isinstance(error, (RunRefused, CheckpointError)):
        return f"run {name} was refused: {error}{where}"
    places = [Path(workdir).resolve(), *([log.parent] if log is not None else []),
              *filter(None, [full_disk.store_directory(os.environ.get("MLFLOW_TRACKING_URI"))])]
    disk = full_disk.described(error, places)
    if disk is not None:
        return (f"run {name} failed: {cause}; the disk is full: {disk.describe()}{where}; "
                f"{advice(run_id, workdir, f'after freeing space on {disk.mount}, ')}")
    return f"run {name} failed: {cause}{where}; {advice(run_id, workdir, 'after fixing the cause, ')}"


def advice(run_id: str | None, workdir: str, first: str = "") -> str:
    """What to do next: ``comlrl resume`` from the run's newest complete checkpoint, or the same command again."""
    from flows.runs import RunPaths
    from flows.training import latest_checkpoint

    checkpoint = latest_checkpoint(RunPaths(run_id, Path(workdir).resolve())) if run_id is not None else None
    if checkpoint is None:
        return f"nothing was checkpointed; {first}run the same command again"
    return (f"completed work is in {Path(checkpoint).name}; {first}continue with:  "
            f"{executable('comlrl')} resume {run_id} --workdir {workdir}")


def report(state, run_id: str | None, workdir: str, log: Path | None = None) -> int:
    """Print how the flow run ended (one line unless it completed) and return the exit status: 2 for a run this
    command cannot train (:class:`flows.runs.RunRefused`), 1 for any other failure."""
    from comlrl.tracking import TrackingUnavailable
    from flows.runs import RunRefused

    if state.is_completed():
        print(json.dumps(state.result(), indent=2))
        where_to_look(workdir)
        return 0
    outcome = state.result(raise_on_failure=False)
    if isinstance(outcome, TrackingUnavailable):
        print(f"\ncomlrl: {outcome}\nThen register the agents with:  "
              f"{executable('comlrl')} resume {run_id or 'RUN_ID'} --workdir {workdir}", file=sys.stderr)
        return EXIT_TRACKING_UNREACHABLE
    if isinstance(outcome, dict) and "exit_status" in outcome:  # a stop: a signal, or the non-finite guard
        print(f"\ncomlrl: {state.message}", file=sys.stderr)
        return outcome["exit_status"] or 1
    print(f"\ncomlrl: {failure_line(run_id, workdir, outcome if isinstance(outcome, BaseException) else state.message, log)}",
          file=sys.stderr)
    return 2 if isinstance(outcome, RunRefused) else 1


def resume(args: argparse.Namespace) -> int:
    if _bad_run_id(args.run_id):
        return 2
    directory = Path(args.workdir) / "runs" / args.run_id
    if not (directory / "spec.yaml").is_file():
        known = sorted(p.name for p in (Path(args.workdir) / "runs").glob("*") if p.is_dir())
        print(f"comlrl: no run {args.run_id!r} under {directory.parent}; known runs: {known or 'none'}", file=sys.stderr)
        return 2
    args.spec = str(directory / "spec.yaml")
    args.root = (directory / "root.txt").read_text().strip()
    args.init_from = None
    return run(args)


def serve(args: argparse.Namespace) -> int:
    root = str(Path(args.root).resolve())
    if _load_spec(args.spec, root) is None:
        return 2
    if not _configured(args.workdir, orchestrate=False):
        return 2
    if not os.environ.get("PREFECT_API_URL"):
        print("comlrl serve needs a Prefect server: start one (bash infra/servers.sh start) and set PREFECT_API_URL",
              file=sys.stderr)
        return 2
    from flows.deployments import serve as serve_deployment

    serve_deployment(str(Path(args.spec).resolve()), args.cron, str(Path(args.workdir).resolve()), root,
                     os.environ.get("MLFLOW_TRACKING_URI"), args.name)
    return 0


def promote(args: argparse.Namespace) -> int:
    """Exit status 2 when a model or alias is missing or the gate kept the candidate out; 75 when MLflow
    does not answer within COMLRL_MLFLOW_DEADLINE seconds (default 60), each call bounded as well
    (comlrl.tracking.HTTP_BOUNDS unless the environment sets MLflow's MLFLOW_HTTP_REQUEST_* itself); 128 + its
    number for SIGINT/SIGTERM. Each ends with one line that says where the alias stands.

    The reads come first (flows.gate.plan_promotion): a stop there ends the command at once, nothing moved. The
    writes (flows.gate.carry_out) are a critical section (flows.critical): a stop during it lets them finish, a
    second stop ends the command at once; NAME-team@ALIAS then names one whole team, and running this again (or
    the next gate) completes the agents' aliases, as after a SIGKILL (flows.registry.repair_team_alias)."""
    from flows.critical import StopSignals, Stopped

    stops, plan = StopSignals(), None
    try:
        with stops:
            if not _configured(args.workdir, orchestrate=False):
                return 2
            from comlrl import tracking
            from flows import gate

            uri = os.environ["MLFLOW_TRACKING_URI"]
            tracking.bound_http_retries()
            plan = tracking.call_with_deadline(lambda: gate.plan_promotion(
                uri, args.model, args.from_alias, args.to_alias, force=args.force), f"MLflow at {uri}")
            with stops.critical():
                moved = tracking.call_with_deadline(lambda: gate.carry_out(uri, plan), f"MLflow at {uri}")
            if plan.half_moved is not None:
                print(f"comlrl promote: {plan.half_moved.describe()}; completed: every {args.to_alias} alias now "
                      f"names {plan.describe()}", file=sys.stderr)
            if plan.refusal is not None:
                print(f"comlrl promote: {plan.refusal}", file=sys.stderr)
                return 2
            for entry in moved:
                print(f"{entry['name']}: {args.to_alias} -> version {entry['version']} (was {entry['previous']})")
            return 0
    except Stopped as stopped:
        from flows.gate import promotion_state  # imported already, unless the stop came while it was

        second = " (a second signal)" if stopped.moment == "during" else ""
        print(f"comlrl promote: stopped by {stopped}{second} {promotion_state(plan, stopped.moment)}", file=sys.stderr)
        return stopped.exit_status
    except ValueError as error:
        print(f"comlrl promote: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        from comlrl.tracking import unreachable
        from flows.gate import promotion_state

        if not unreachable(error):
            raise
        print(f"comlrl promote: MLflow unreachable ({str(error)[:300]}) {promotion_state(plan, stops.moment)}",
              file=sys.stderr)
        return EXIT_TRACKING_UNREACHABLE


def demo(args: argparse.Namespace) -> int:
    """The bundled tiny demo as a flow run on the embedded default, gated, sampled (flows/demo.py)."""
    from flows.demo import run_demo

    run_demo(args.workdir, args.run_id, args.verbose)
    return 0


def sync(args: argparse.Namespace) -> int:
    """Replay tracking spools left by an MLflow outage into their runs.

    Exit status, the worst over the spools (comlrl.tracking.sync): 0 all delivered; 2 bad input (no
    spool, another run's, one in use); 65 a spool is unreadable, or damaged bytes in it were skipped
    while everything readable was delivered (running again cannot bring them back); 75 MLflow did not
    acknowledge anything for COMLRL_MLFLOW_DEADLINE seconds (default 60): nothing lost, run this again.
    """
    from comlrl import tracking, tracking_spool

    try:
        results = tracking.sync(args.path, args.tracking_uri)
    except (tracking_spool.SpoolError, ValueError) as error:
        print(f"comlrl sync: {error}", file=sys.stderr)
        return 2
    if not results:
        print(f"comlrl sync: no tracking spool (spool.jsonl) under {args.path}", file=sys.stderr)
        return 2
    for result in results:
        print(result.message, file=sys.stdout if result.exit_status == 0 else sys.stderr)
    return max(result.exit_status for result in results)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="comlrl",
        description="Train cooperating LLM agents with multi-agent RL, as resumable Prefect flows tracked in MLflow. "
                    "Set PREFECT_API_URL / MLFLOW_TRACKING_URI to use servers (bash infra/servers.sh start); "
                    "otherwise everything runs embedded under --workdir.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, handler, help_text: str, description: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=description)
        sub.add_argument("--workdir", default=".comlrl", help="runs, checkpoints, embedded Prefect/MLflow stores (default .comlrl)")
        sub.set_defaults(handler=handler)
        return sub

    p = add("run", run, "train the run a YAML spec describes",
            "Validate SPEC (every problem is listed, nothing loads if any), then run the training flow: one "
            "subflow per boundary (epoch / PbRL stage) ending in its checkpoint, MLflow metrics and artifacts, "
            "and the agents registered as <name>-agent-<i> with alias 'candidate'. Running the same spec again "
            "(same --run-id) resumes after the last completed boundary. The spec's execution section picks the "
            "Prefect task runner (execution: {task_runner: dask} runs one task per agent on Dask).")
    p.add_argument("spec", help="the run spec (YAML); see flows/specs/letters.yaml")
    p.add_argument("--run-id", help="run name (default <name>-<spec hash>); reuse it to resume")
    p.add_argument("--root", default=".", help="directory the spec's relative paths start from; datasets must lie in ROOT/data")
    p.add_argument("--init-from", metavar="ALIAS", help="start from the registry's ALIAS agents (e.g. champion) if they exist")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)

    p = add("resume", resume, "continue a failed or cancelled run after its last completed boundary",
            "Re-run RUN_ID with the spec it was started with: the run's newest checkpoint (a boundary's, or the "
            "checkpoint-N-stepS a stop signal or failure left) is restored, finished boundaries are not run again, "
            "metrics go to the same MLflow run (with --new-mlflow-run, to a new one of the same experiment), and the "
            "final models equal an uninterrupted run's.")
    p.add_argument("run_id", help="the run id (a directory under WORKDIR/runs)")
    p.add_argument("--new-mlflow-run", action="store_true",
                   help="log to a new MLflow run of the same experiment instead of the one the run's checkpoints name "
                        "(for a run whose MLflow run was deleted or whose store is gone): it gets the metrics logged "
                        "up to the checkpoint from the run's records and the tag comlrl.previous_mlflow_run_id")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)

    p = add("serve", serve, "serve scheduled retraining from the champion (needs a Prefect server)",
            "Serve the 'comlrl-retrain' deployment: on CRON, train SPEC starting from the registry's 'champion' "
            "agents (the spec's models before the first promotion); each schedule slot is its own resumable run. "
            "Requires PREFECT_API_URL (bash infra/servers.sh start). Runs until interrupted.")
    p.add_argument("spec", help="the run spec (YAML)")
    p.add_argument("--cron", default="0 3 * * *", help="cron schedule (default '0 3 * * *': daily at 03:00)")
    p.add_argument("--name", default="scheduled-retrain", help="deployment name (default scheduled-retrain)")
    p.add_argument("--root", default=".", help="directory the spec's relative paths start from")

    p = add("promote", promote, "move the 'champion' alias to the current 'candidate' versions",
            "For the team model MODEL-team and every agent model MODEL-agent-<i>, point --to (default champion) at "
            "the version --from (default candidate) names; the previous champion is kept as tag previous_champion. "
            "Nothing moves unless every model has a --from version, nor (without --force) when the run's "
            "champion/challenger gate found the candidate worse than the champion.")
    p.add_argument("model", help="registered model base name (the spec's registry.model_name, default its name)")
    p.add_argument("--from", dest="from_alias", default="candidate", help="alias to promote (default candidate)")
    p.add_argument("--to", dest="to_alias", default="champion", help="alias to move (default champion)")
    p.add_argument("--force", action="store_true", help="promote even a candidate the gate kept out")

    p = add("sync", sync, "replay the tracking records a run could not send to MLflow",
            "Deliver the records a run spooled while its MLflow server was unreachable into the same MLflow run: "
            "metrics with their original steps and timestamps, params, tags, artifacts, the final status. PATH is "
            "a run directory (WORKDIR/runs/RUN_ID) or one spool directory (the one the warning names). Records "
            "already delivered are never sent again. Exit status 0 when all were delivered, 75 when the server "
            "still does not answer.")
    p.add_argument("path", help="a run directory or a spool directory")
    p.add_argument("--tracking-uri", help="the MLflow server to deliver to (default: the one the spool recorded)")

    p = add("demo", demo, "run the bundled tiny demo end to end (embedded default, a few minutes on 2 CPUs)",
            "Train two tiny Llama agents (built locally, no hub) with MAGRPO on the letters task as a Prefect flow "
            "run, track it in MLflow, register the team and its agents, let the champion/challenger gate decide, "
            "load the champion team back with mlflow.pyfunc and ask it a prompt, then print where to look. The "
            "console shows one progress bar, a line per epoch and a summary.")
    p.add_argument("--run-id", help="run name (default letters-demo-<time>)")
    p.add_argument("--verbose", action="store_true", help="show every library's logs, warnings and progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if _bad_path_option(args):
        return 2
    return args.handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
