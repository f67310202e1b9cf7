"""The run spec the pipeline tests train: the letters task (comlrl.tasks.letters) with MAGRPO on a tiny
Llama built locally, its data written by ``comlrl.tasks.letters.write_dataset`` under ``data/letters``."""

from __future__ import annotations

from typing import Any


def letters_spec(name: str, **config: Any) -> dict[str, Any]:
    """The spec named ``name``: 2 agents, seed 0, no progress bars, and ``config``'s settings."""
    return {
        "name": name,
        "algorithm": "magrpo",
        "models": {"agent_model": {"tiny": {"architecture": "llama", "vocab_size": 96, "seed": 0}}},
        "dataset": {"train": "data/letters/train.parquet", "eval": "data/letters/eval.parquet"},
        "reward": "comlrl.tasks.letters:letters_reward",
        "config": {"num_agents": 2, **config, "seed": 0, "disable_tqdm": True},
    }
