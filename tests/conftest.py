"""Shared fixtures: tiny local models (no network), datasets and reward functions."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tiny test models gain nothing from intra-op threads, and on a busy 2-core machine spinning
# threads make every matmul an order of magnitude slower (measured: a matrix cell 18.7 s -> 1.5 s).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
import transformers
from datasets import Dataset

from comlrl.tiny import save_tiny_model

torch.set_num_threads(1)
transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

WORDS = "cat dog sun moon tree river hill road".split()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A ~80k-parameter Llama with a 96-token BPE tokenizer, saved as a model directory."""
    return str(save_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", "llama", vocab_size=96, seed=0))


@pytest.fixture(scope="session")
def tiny_llama_b(tmp_path_factory) -> str:
    """A second Llama of the same architecture and vocabulary but other weights."""
    return str(save_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama-b", "llama", vocab_size=96, seed=1))


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory) -> str:
    """A GPT-2 of another size with a different (128-token) vocabulary."""
    return str(save_tiny_model(tmp_path_factory.mktemp("models") / "tiny-gpt2", "gpt2", vocab_size=128, seed=2))


@pytest.fixture
def train_dataset() -> Dataset:
    return Dataset.from_dict({"prompt": [f"write a story about the {word}" for word in WORDS]})


def letter_share(text: str, letter: str) -> float:
    return text.count(letter) / max(len(text), 1)


def joint_letter_reward(completions_0, completions_1):
    """High when agent 0 writes many 'e's and agent 1 many 'o's: depends on both agents."""
    return [0.5 * letter_share(a, "e") + 0.5 * letter_share(b, "o") for a, b in zip(completions_0, completions_1)]


@pytest.fixture
def reward_func():
    return joint_letter_reward


def letters_pipeline(tmp_path_factory, spec: dict, num_train: int):
    """:func:`prefect_pipeline` around a project with the letters data (``num_train`` rows, 2 eval rows) and
    ``spec`` as its ``spec.yaml``."""
    import yaml

    from comlrl.tasks.letters import write_dataset

    root = tmp_path_factory.mktemp("project")
    write_dataset(root / "data" / "letters", num_train=num_train, num_eval=2)
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    yield from prefect_pipeline(tmp_path_factory, root)


def prefect_pipeline(tmp_path_factory, root):
    """Prefect's test harness (a temporary API database, result storage in a temp dir) around a module's
    flows; yields the workdir, the project root and an MLflow SQLite store, then puts the environment back."""
    home = tmp_path_factory.mktemp("prefect")
    saved = {k: os.environ.get(k) for k in ("PREFECT_HOME", "PREFECT_LOCAL_STORAGE_PATH")}
    os.environ.update(PREFECT_HOME=str(home), PREFECT_LOCAL_STORAGE_PATH=str(home / "storage"))
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=None):
        yield {"workdir": tmp_path_factory.mktemp("work"), "root": root,
               "tracking_uri": f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"}
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
