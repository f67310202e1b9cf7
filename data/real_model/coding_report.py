"""What the coding run did: its levels over training as a PNG, and the figures of docs/coding.md.

    OMP_NUM_THREADS=1 comlrl run flows/specs/coding_smollm2.yaml --run-id coding-smollm2-run1
    .venv/bin/python data/real_model/coding_report.py .comlrl/runs/coding-smollm2-run1

Everything comes from the run's durable record: its MLflow run (named in the run directory's
``result.json``) for the metrics, and the ``samples/sample_answers.json`` artifact for the programs.
It draws the held-out evaluation's levels (``eval/coding/*``, step 0 is the untrained agents) and the
training batches' levels (``coding/*``) to ``docs/img/coding_curve.png`` and prints Markdown: the
levels at each evaluation, the training levels per step, and the share of groups with equal rewards.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CURVE = ROOT / "docs" / "img" / "coding_curve.png"
LEVELS = ("structure", "syntax", "tests", "cooperation", "total")


def history(client, run_id: str, key: str) -> dict[int, float]:
    return {point.step: point.value for point in client.get_metric_history(run_id, key)}


def read_run(run_dir: Path) -> dict:
    from mlflow.tracking import MlflowClient

    result = json.loads((run_dir / "result.json").read_text())
    client = MlflowClient(tracking_uri=result["tracking_uri"])
    run_id = result["mlflow_run_id"]
    keys = [f"{prefix}coding/{level}" for prefix in ("", "eval/") for level in LEVELS]
    keys += ["eval/coding/pass_all", "coding/pass_all", "reward/zero_variance_groups", "reward_mean"]
    return {key: history(client, run_id, key) for key in keys}


def draw(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (held_out, training) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for axes, prefix, title in ((held_out, "eval/", "held-out problems (8 x 4 samples)"),
                                (training, "", "training batches (2 problems x 4 samples)")):
        for level in LEVELS:
            points = sorted(record[f"{prefix}coding/{level}"].items())
            if points:
                axes.plot([s for s, _ in points], [v for _, v in points], marker="o", label=level)
        axes.set_title(title)
        axes.set_xlabel("step")
    held_out.set_ylabel("mean level (total in [0, 4])")
    held_out.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def table(record: dict, prefix: str) -> str:
    steps = sorted(record[f"{prefix}coding/total"])
    columns = [*LEVELS, "pass_all"]
    lines = ["| step | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for step in steps:
        cells = [record[f"{prefix}coding/{column}"].get(step) for column in columns]
        lines.append(f"| {step} | " + " | ".join("" if c is None else f"{c:.3f}" for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args()
    record = read_run(args.run_dir)
    draw(record, CURVE)
    print("## Held-out evaluation\n\n" + table(record, "eval/"))
    print("\n## Training batches\n\n" + table(record, ""))
    zero = record["reward/zero_variance_groups"]
    if zero:
        print(f"\nShare of groups with equal rewards: mean {sum(zero.values()) / len(zero):.3f} over {len(zero)} steps "
              f"({', '.join(f'{v:.2f}' for _, v in sorted(zero.items()))})")
    print(f"\nCurve: {CURVE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
