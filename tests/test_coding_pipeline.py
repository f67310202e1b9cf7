"""The coding run spec: flows/specs/coding_smollm2.yaml validates as shipped, and the same spec on a tiny model
runs end to end through a real ``comlrl run`` process: the coding levels in MLflow for every step, the
held-out evaluation at step 0 (before training), the table of sample answers with their verdicts, the
registered team."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPOSITORY = Path(__file__).resolve().parent.parent
SPEC = REPOSITORY / "flows" / "specs" / "coding_smollm2.yaml"
COMLRL = str(Path(sys.executable).parent / "comlrl")
LEVELS = ("structure", "syntax", "tests", "cooperation", "total")


def test_the_bundled_coding_spec_validates(tmp_path):
    """As shipped (the SmolLM2 directory need not exist to validate: it is made by make_smollm2.py)."""
    from flows.spec import parse_spec

    raw = yaml.safe_load(SPEC.read_text())
    assert raw["dataset"]["train"]["entry_point"] == raw["dataset"]["eval"]["entry_point"] == \
        "comlrl.tasks.coding:humaneval"
    raw["models"] = {"agent_model": {"tiny": {"architecture": "llama", "vocab_size": 96, "seed": 0}}}
    spec = parse_spec(raw, str(SPEC), str(REPOSITORY))
    assert spec.config["eval_before_training"] is True and spec.config["num_train_epochs"] == 1


def tiny_coding_spec() -> dict:
    raw = yaml.safe_load(SPEC.read_text())
    raw["name"] = "coding-tiny"
    raw["registry"]["model_name"] = "coding-tiny"
    raw["models"] = {"agent_model": {"tiny": {"architecture": "llama", "vocab_size": 96, "seed": 0}}}
    raw["dataset"]["train"]["kwargs"]["limit"] = 4
    raw["dataset"]["eval"]["kwargs"]["limit"] = 2
    raw["config"].update(max_new_tokens=8, eval_num_samples=2, eval_interval=2)
    return raw


@pytest.mark.e2e
def test_a_tiny_coding_run_records_levels_evaluations_and_sample_answers(tmp_path):
    spec = tmp_path / "coding_tiny.yaml"
    spec.write_text(yaml.safe_dump(tiny_coding_spec()))
    workdir = tmp_path / "work"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("PREFECT_API_URL", None)
    done = subprocess.run([COMLRL, "run", str(spec), "--root", str(REPOSITORY), "--workdir", str(workdir),
                           "--run-id", "coding-tiny-1"], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((workdir / "runs" / "coding-tiny-1" / "result.json").read_text())
    assert result["team"]["name"] == "coding-tiny-team" and len(result["registered"]) == 2
    with sqlite3.connect(workdir / "mlflow" / "mlflow.db") as db:
        rows = db.execute("select key, step, value from metrics").fetchall()
    steps: dict[str, set[int]] = {}
    for key, step, value in rows:
        steps.setdefault(key, set()).add(step)
        if key.endswith("coding/total"):
            assert 0.0 <= value <= 4.0
    assert all(steps[f"coding/{level}"] == {1, 2} for level in LEVELS)  # 4 problems, 2 a step
    assert all(steps[f"eval/coding/{level}"] == {0, 2} for level in LEVELS)  # before training, then every 2 steps
    table = next((workdir / "mlflow" / "artifacts").rglob("samples/sample_answers.json"))
    answers = json.loads(table.read_text())
    assert {"task_id", "aux", "main", "total", "verdicts", "tests_passed", "tests_total"} <= set(answers["columns"])
    task_ids = {row[answers["columns"].index("task_id")] for row in answers["data"]}
    assert task_ids <= {"HumanEval/0", "HumanEval/1"}  # the gate's evaluation: the held-out problems
    # The registered team answers a HumanEval row: its signature takes the formatters' entry_point too.
    import mlflow

    from comlrl.tasks.coding import humaneval

    mlflow.set_tracking_uri(f"sqlite:///{workdir / 'mlflow' / 'mlflow.db'}")
    team = mlflow.pyfunc.load_model("models:/coding-tiny-team@candidate")
    assert "entry_point" in team.metadata.get_input_schema().input_names()
    problem = humaneval("eval")[0]
    answers = team.predict([{"prompt": problem["prompt"], "entry_point": problem["entry_point"]}],
                           params={"max_new_tokens": 4})
    assert answers.shape == (1, 2)
