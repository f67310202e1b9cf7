"""One training loop, two faces: the same spec through ``trainer.train()`` and through ``comlrl run`` ends
in the same place, for every trainer family.

For each family a small spec is trained twice: by the library (``flows.build.build_trainer`` then
``trainer.train(checkpoint_dir=..., checkpoint_interval=1)``, a ``MetricsRecorder`` among the
callbacks) and by the pipeline (``comlrl run`` in this process, ``flows.cli.main``, under Prefect's
test harness and an MLflow SQLite store). Compared: the final weights bit for bit, the checkpoints
(same names), the metric history in the final checkpoint (step numbers and values), the evaluation
points (steps and values; the library's recorder against the pipeline's MLflow run) and the
logged training metrics. Wall-time and memory metrics differ by nature and are left out.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from comlrl.callbacks import MetricsRecorder
from comlrl.checkpointing import read_history
from comlrl.tasks.letters import write_dataset
from letters_spec import letters_spec

pytestmark = pytest.mark.slow

SMALL = dict(num_generations=2, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=None, agent_learning_rate=3e-3,
             per_device_train_batch_size=2, eval_interval=1, eval_num_samples=2)
PREFERENCE = dict(preference_num_generations=3, reward_model_device=None, reward_train_epochs=1, reward_batch_size=2,
                  policy_guard_rows=2)
FAMILIES = {
    "magrpo": ("magrpo", dict(SMALL, num_train_epochs=2, gradient_accumulation_steps=2), {}),
    "maac": ("maac", dict({k: v for k, v in SMALL.items() if k != "num_generations"}, num_train_epochs=2),
             {"critic_model": "tiny"}),
    "marlhf": ("marlhf", dict(SMALL, **PREFERENCE, num_train_epochs=1), {}),
    "marlhf_iter": ("marlhf_iter", dict(SMALL, **PREFERENCE, num_train_epochs=1, num_iterations=2), {}),
    "madpo": ("madpo", dict(SMALL, num_generations=3, num_train_epochs=2), {}),
    "madpo_iter": ("madpo_iter", dict(SMALL, num_generations=3, num_train_epochs=1, num_iterations=2), {}),
    "centralized": ("magrpo_centralized", dict(SMALL, num_train_epochs=2, collaboration_format="separated",
                                               section_separator="x"), {}),
}
# Metrics that measure the machine, not the training.
VOLATILE = ("time", "tokens_per_second", "memory", "seconds")


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """Prefect's test harness (temporary API database) and an MLflow SQLite store for the pipeline runs."""
    home = tmp_path_factory.mktemp("prefect")
    saved = {k: os.environ.get(k) for k in ("PREFECT_HOME", "PREFECT_LOCAL_STORAGE_PATH", "MLFLOW_TRACKING_URI")}
    tracking_uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    os.environ.update(PREFECT_HOME=str(home), PREFECT_LOCAL_STORAGE_PATH=str(home / "storage"),
                      MLFLOW_TRACKING_URI=tracking_uri)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=None):
        yield tracking_uri
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def family_spec(root: Path, family: str) -> Path:
    algorithm, config, models = FAMILIES[family]
    spec = letters_spec(f"parity-{family.replace('_', '-')}", **config)
    spec["algorithm"] = algorithm
    tiny = spec["models"]["agent_model"]
    spec["models"].update({key: tiny for key in models})
    path = root / f"{family}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def volatile(name: str) -> bool:
    return any(part in name for part in VOLATILE)


def comparable(row: dict) -> dict:
    return {key: value for key, value in row.items() if not volatile(key)}


def same_numbers(a: dict, b: dict) -> bool:
    """Equal dicts, NaN equal to NaN."""
    if a.keys() != b.keys():
        return False
    return all(x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))
               for x, y in ((a[k], b[k]) for k in a))


def final_checkpoint(directory: Path) -> Path:
    from comlrl.checkpointing.io import latest_checkpoint

    return latest_checkpoint(directory)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_train_and_comlrl_run_end_in_the_same_place(family, harness, tmp_path):
    from mlflow.tracking import MlflowClient

    from comlrl.tracking import RUN_KEY_TAG
    from flows.build import build_trainer
    from flows.cli import main
    from flows.spec import load_spec

    root = tmp_path / "project"
    write_dataset(root / "data" / "letters", num_train=4, num_eval=2)
    spec_path = family_spec(root, family)

    # The library's face.
    recorder = MetricsRecorder()
    trainer = build_trainer(load_spec(spec_path, root), root, tmp_path / "library-work", [recorder])
    library_dir = tmp_path / "library-checkpoints"
    trainer.train(checkpoint_dir=library_dir, checkpoint_interval=1)

    # The pipeline's face: `comlrl run`, in this process.
    workdir = tmp_path / "pipeline-work"
    assert main(["run", str(spec_path), "--root", str(root), "--workdir", str(workdir), "--run-id", "parity"]) == 0
    pipeline_dir = workdir / "runs" / "parity" / "checkpoints"

    names = sorted(p.name for p in library_dir.glob("checkpoint-*"))
    assert names and names == sorted(p.name for p in pipeline_dir.glob("checkpoint-*"))
    mine, theirs = final_checkpoint(library_dir), final_checkpoint(pipeline_dir)
    assert mine.name == theirs.name
    for weights in sorted((mine / "models").glob("*.safetensors")):
        a, b = load_file(str(weights)), load_file(str(theirs / "models" / weights.name))
        assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a), f"{family}: {weights.name} differs"
    history, their_history = [comparable(row) for row in read_history(mine)], read_history(theirs)
    assert history and len(history) == len(their_history)
    assert all(same_numbers(x, comparable(y)) for x, y in zip(history, their_history))

    # Evaluation points and logged training metrics: the library's callback records against the MLflow run.
    client = MlflowClient(harness)
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()],
                               filter_string=f"tags.`{RUN_KEY_TAG}` = 'parity' and params.`spec.name` = "
                                             f"'parity-{family.replace('_', '-')}'")
    assert run.info.status == "FINISHED"
    logged = [(r["step"], name, value) for r in recorder.records for name, value in r.items()
              if name != "step" and not volatile(name) and isinstance(value, (int, float))]
    evaluations = sorted({step for step, name, _ in logged if name.startswith("eval/")})
    assert evaluations, f"{family}: no evaluation point (eval_interval=1)"
    for name in sorted({name for _, name, _ in logged}):
        expected = sorted((step, value) for step, n, value in logged if n == name)
        history_of = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
        assert len(history_of) == len(expected), (family, name, history_of, expected)
        for (step, value), (logged_step, logged_value) in zip(expected, history_of):
            assert step == logged_step and (value == logged_value or (math.isnan(value) and math.isnan(logged_value))), (
                family, name, step, value, logged_value)


def test_the_shared_constructor_arguments_are_declared_once():
    """TrainerInputs (what composites forward as **inputs) names exactly MultiAgentTrainer's arguments besides args."""
    import inspect

    from comlrl.trainers.base import MultiAgentTrainer
    from comlrl.trainers.inputs import input_names

    parameters = set(inspect.signature(MultiAgentTrainer.__init__).parameters) - {"self", "args"}
    assert input_names() == parameters
