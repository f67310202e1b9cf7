"""The ``comlrl`` command line: run, resume, serve, promote and the bundled demo.

Prefect and MLflow settings come from the environment (``PREFECT_API_URL``,
``MLFLOW_TRACKING_URI``); without them the embedded default is used: Prefect's ephemeral
mode and an MLflow SQLite store under the working directory (``--workdir``, default .comlrl).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEMO_SPEC = PROJECT_ROOT / "flows" / "specs" / "letters.yaml"


def _configure(workdir: str) -> None:
    from flows.runs import configure_embedded_default

    configure_embedded_default(workdir)


def _load_spec(spec: str, root: str):
    """The validated run spec, or None once every problem has been printed."""
    from flows.spec import SpecError, load_spec

    try:
        return load_spec(spec, root)
    except SpecError as error:
        print(error, file=sys.stderr)
        return None


def _where_to_look(workdir: str) -> None:
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    print("\nwhere to look:")
    if uri.startswith("sqlite:"):
        artifacts = Path(workdir).resolve() / "mlflow" / "artifacts"
        print(f"  MLflow UI:   mlflow ui --backend-store-uri {uri} --default-artifact-root {artifacts} --host 127.0.0.1")
    else:
        print(f"  MLflow:      {uri}")
    if os.environ.get("PREFECT_API_URL"):
        print(f"  Prefect:     {os.environ['PREFECT_API_URL'].removesuffix('/api')}")
    else:
        print(f"  Prefect UI:  PREFECT_HOME={os.environ.get('PREFECT_HOME')} prefect server start --host 127.0.0.1")
        print("               (the embedded default keeps its flow-run history there)")


def run(args: argparse.Namespace) -> int:
    root = str(Path(args.root).resolve())
    if (spec := _load_spec(args.spec, root)) is None:
        return 2
    _configure(args.workdir)
    from flows.training import training_flow

    result = training_flow(spec)(spec_path=str(Path(args.spec).resolve()), run_id=args.run_id, workdir=args.workdir,
                                 root=root, init_from_alias=args.init_from)
    print(json.dumps(result, indent=2))
    _where_to_look(args.workdir)
    return 0


def resume(args: argparse.Namespace) -> int:
    directory = Path(args.workdir) / "runs" / args.run_id
    if not (directory / "spec.yaml").is_file():
        known = sorted(p.name for p in (Path(args.workdir) / "runs").glob("*") if p.is_dir())
        print(f"no run {args.run_id!r} under {directory.parent}; known runs: {known or 'none'}", file=sys.stderr)
        return 2
    args.spec = str(directory / "spec.yaml")
    args.root = (directory / "root.txt").read_text().strip()
    args.init_from = None
    return run(args)


def serve(args: argparse.Namespace) -> int:
    root = str(Path(args.root).resolve())
    if _load_spec(args.spec, root) is None:
        return 2
    _configure(args.workdir)
    if not os.environ.get("PREFECT_API_URL"):
        print("comlrl serve needs a Prefect server: start one (bash infra/servers.sh start) and set PREFECT_API_URL",
              file=sys.stderr)
        return 2
    from flows.deployments import serve as serve_deployment

    serve_deployment(str(Path(args.spec).resolve()), args.cron, str(Path(args.workdir).resolve()), root,
                     os.environ.get("MLFLOW_TRACKING_URI"), args.name)
    return 0


def promote(args: argparse.Namespace) -> int:
    _configure(args.workdir)
    from mlflow.tracking import MlflowClient

    from comlrl import tracking

    uri = os.environ["MLFLOW_TRACKING_URI"]
    found = MlflowClient(uri).search_registered_models(filter_string=f"name LIKE '{args.model}-agent-%'")
    names = sorted(m.name for m in found)
    if not names:
        print(f"no registered models named {args.model}-agent-<i> in {uri}", file=sys.stderr)
        return 2
    try:
        moved = tracking.promote(uri, names, args.from_alias, args.to_alias)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    for entry in moved:
        print(f"{entry['name']}: {args.to_alias} -> version {entry['version']} (was {entry['previous']})")
    return 0


def demo(args: argparse.Namespace) -> int:
    """The bundled tiny demo as a flow run on the embedded default, then promotion and a sample."""
    started = time.perf_counter()
    _configure(args.workdir)
    from flows.spec import load_spec
    from flows.training import training_flow

    run_id = args.run_id or f"letters-demo-{time.strftime('%Y%m%d-%H%M%S')}"
    result = training_flow(load_spec(DEMO_SPEC, PROJECT_ROOT))(spec_path=str(DEMO_SPEC), run_id=run_id,
                                                               workdir=args.workdir, root=str(PROJECT_ROOT))
    from comlrl import tracking

    names = [entry["name"] for entry in result["registered"]]
    tracking.promote(result["tracking_uri"], names, "candidate", "champion")
    import mlflow

    mlflow.set_tracking_uri(result["tracking_uri"])
    generator = mlflow.transformers.load_model(f"models:/{names[0]}@champion")
    sample = generator("tell me about the cat", max_new_tokens=12, do_sample=False)[0]["generated_text"]
    history_path = Path(args.workdir) / "runs" / run_id / "reward_curve.png"
    print(f"\nrun {run_id}: eval reward {result['evaluation'].get('eval/reward_mean', float('nan')):.3f}, "
          f"checkpoint {result['checkpoint']}")
    print(f"registered: {', '.join(e['name'] + ' v' + e['version'] for e in result['registered'])} "
          "(alias candidate, promoted to champion)")
    print(f"models:/{names[0]}@champion says: {sample!r}")
    print(f"reward curve: {history_path}")
    print(f"resume or repeat: comlrl resume {run_id} --workdir {args.workdir}")
    print(f"finished in {time.perf_counter() - started:.0f} s")
    _where_to_look(args.workdir)
    return 0


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
            "transaction per boundary (epoch / PbRL stage) holding its checkpoint, MLflow metrics and artifacts, "
            "and the agents registered as <name>-agent-<i> with alias 'candidate'. Running the same spec again "
            "(same --run-id) resumes after the last completed boundary. The spec's execution section picks the "
            "Prefect task runner (execution: {task_runner: dask} runs one task per agent on Dask).")
    p.add_argument("spec", help="the run spec (YAML); see flows/specs/letters.yaml")
    p.add_argument("--run-id", help="run name (default <name>-<spec hash>); reuse it to resume")
    p.add_argument("--root", default=".", help="directory the spec's relative paths start from; datasets must lie in ROOT/data")
    p.add_argument("--init-from", metavar="ALIAS", help="start from the registry's ALIAS agents (e.g. champion) if they exist")

    p = add("resume", resume, "continue a failed or cancelled run after its last completed boundary",
            "Re-run RUN_ID with the spec it was started with: completed boundaries are skipped (their Prefect "
            "transaction records are committed), the last checkpoint is restored, metrics go to the same MLflow "
            "run, and the final models equal an uninterrupted run's.")
    p.add_argument("run_id", help="the run id (a directory under WORKDIR/runs)")

    p = add("serve", serve, "serve scheduled retraining from the champion (needs a Prefect server)",
            "Serve the 'comlrl-retrain' deployment: on CRON, train SPEC starting from the registry's 'champion' "
            "agents (the spec's models before the first promotion); each schedule slot is its own resumable run. "
            "Requires PREFECT_API_URL (bash infra/servers.sh start). Runs until interrupted.")
    p.add_argument("spec", help="the run spec (YAML)")
    p.add_argument("--cron", default="0 3 * * *", help="cron schedule (default '0 3 * * *': daily at 03:00)")
    p.add_argument("--name", default="scheduled-retrain", help="deployment name (default scheduled-retrain)")
    p.add_argument("--root", default=".", help="directory the spec's relative paths start from")

    p = add("promote", promote, "move the 'champion' alias to the current 'candidate' versions",
            "For every registered model MODEL-agent-<i>, point --to (default champion) at the version --from "
            "(default candidate) names; the previous champion is kept as tag previous_champion. Nothing moves "
            "unless every agent has a --from version.")
    p.add_argument("model", help="registered model base name (the spec's registry.model_name, default its name)")
    p.add_argument("--from", dest="from_alias", default="candidate", help="alias to promote (default candidate)")
    p.add_argument("--to", dest="to_alias", default="champion", help="alias to move (default champion)")

    p = add("demo", demo, "run the bundled tiny demo end to end (embedded default, a few minutes on 2 CPUs)",
            "Train two tiny Llama agents (built locally, no hub) with MAGRPO on the letters task as a Prefect flow "
            "run, track it in MLflow, register the agents, promote them to champion, load one back with "
            "mlflow.transformers and generate, then print where to look.")
    p.add_argument("--run-id", help="run name (default letters-demo-<time>)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
