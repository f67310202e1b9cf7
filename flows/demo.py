"""``comlrl demo``: the bundled tiny run end to end on the embedded default, told on one screen.

Trains the letters spec as a flow run (two tiny Llama agents, MAGRPO), which registers the team
and its agents and lets the champion/challenger gate decide; then loads the team model back from
the registry as a consumer would (``mlflow.pyfunc.load_model("models:/letters-demo-team@champion")``),
asks it one prompt, and prints where to look. The console shows one progress bar, one line per
epoch, the gate's verdict and a summary (:mod:`flows.console`); ``--verbose`` shows everything.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEMO_SPEC = PROJECT_ROOT / "flows" / "specs" / "letters.yaml"
SAMPLE_PROMPT = "tell me about the cat"


def run_demo(workdir: str, run_id: str | None, verbose: bool) -> dict[str, Any]:
    """Train, gate and sample the demo; returns the flow's result (and prints the summary)."""
    from flows import console

    console.install(verbose)
    started = time.perf_counter()
    from flows.environment import configure

    configure(workdir)  # the embedded default (and the Prefect client's bounds), before Prefect is imported
    import torch

    if "OMP_NUM_THREADS" not in os.environ:  # the tiny models gain nothing from intra-op threads; on a
        torch.set_num_threads(1)  # busy small machine those threads only contend
    from flows.spec import load_spec
    from flows.training import training_flow

    run_id = run_id or f"letters-demo-{time.strftime('%Y%m%d-%H%M%S')}"
    result = training_flow(load_spec(DEMO_SPEC, PROJECT_ROOT))(spec_path=str(DEMO_SPEC), run_id=run_id,
                                                               workdir=workdir, root=str(PROJECT_ROOT))
    if not isinstance(result, dict):  # the flow returned a failed state (e.g. MLflow unreachable)
        raise RuntimeError(f"the demo run {run_id} did not finish: {result}")
    sample = sample_team(result)
    print_summary(result, sample, workdir, time.perf_counter() - started)
    return result


def sample_team(result: dict[str, Any]) -> dict[str, Any]:
    """The registry's champion team asked one prompt, as a consumer would load it."""
    import mlflow
    import pandas

    mlflow.set_tracking_uri(result["tracking_uri"])
    uri = f"models:/{result['team']['name']}@champion"
    team = mlflow.pyfunc.load_model(uri)
    answers = team.predict(pandas.DataFrame({"prompt": [SAMPLE_PROMPT]}), params={"seed": 0})
    return {"uri": uri, "answers": answers.iloc[0].to_dict()}


def print_summary(result: dict[str, Any], sample: dict[str, Any], workdir: str, seconds: float) -> None:
    from flows.boundaries import primary_eval
    from flows.environment import where_to_look
    from comlrl.executables import executable

    metric, score = primary_eval(result["evaluation"])
    rows = result["boundaries"]
    steps = rows[-1]["step"] if rows else 0
    print(f"\nrun {result['run_id']}: {steps} steps in {len(rows)} epochs, "
          + (f"eval reward {score:.3f} ({metric})" if score is not None else "no eval set"))
    entries = [result["team"], *result["registered"]]
    print("registered: " + ", ".join(f"{e['name']} v{e['version']}" for e in entries) + f" (alias {entries[0]['alias']})")
    print(f"{sample['uri']} says to {SAMPLE_PROMPT!r}:")
    for agent, text in sample["answers"].items():
        print(f"  {agent}: {text!r}")
    directory = Path(workdir) / "runs" / result["run_id"]
    print(f"checkpoint: {result['checkpoint']}")
    print(f"curves: {directory / 'reward_curve.png'}")
    print(f"resume or repeat: {executable('comlrl')} resume {result['run_id']} --workdir {workdir}")
    print(f"finished in {seconds:.0f} s")
    where_to_look(workdir)
