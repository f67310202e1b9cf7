"""Issue 27, defect 3 and suspicion b: a DPO step without pairs logs no NaN, is counted
(``dpo/steps_without_pairs``), and leaves the loss metrics out rather than averaging NaN into the logging
window; under data parallelism a process without pairs reports values whose mean over the processes is the
statistic over every process's pairs (checked by hand, and in two real gloo processes)."""

from __future__ import annotations

import math
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from datasets import Dataset

from comlrl.algorithms import dpo
from comlrl.callbacks import TrainerCallback
from comlrl.rollout import preferences
from comlrl.tasks.letters import letters_reward
from comlrl.trainers.preference import MADPOConfig, MADPOTrainer
from comlrl.training.metrics import MetricWindow

PROMPTS = ["write about the cat", "write about the sun", "write about the tree", "write about the road"]
TINY = dict(num_agents=2, num_generations=4, max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=None,
            per_device_train_batch_size=2, num_train_epochs=1, device="cpu", disable_tqdm=True, seed=3)


def constant_reward(completions_0, completions_1):
    return [0.5] * len(completions_0)  # every candidate ties: no pairs


def all_finite(metrics: dict) -> bool:
    return all(math.isfinite(float(value)) for value in metrics.values())


class Logged(TrainerCallback):
    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, trainer, metrics, step):
        self.logs.append(dict(metrics))


def test_metric_window_leaves_out_missing_values_and_totals_counters_by_hand():
    window = MetricWindow()
    window.add({"dpo/loss": 0.5, "dpo/pairs": 4.0, "dpo/steps_without_pairs": 0.0})
    window.add({"dpo/pairs": 0.0, "dpo/steps_without_pairs": 1.0})  # no pairs: no loss
    window.add({"dpo/loss": float("nan"), "dpo/pairs": 0.0, "dpo/steps_without_pairs": 1.0})  # NaN: no value either
    window.add({"dpo/loss": 0.25, "dpo/pairs": 2.0, "dpo/steps_without_pairs": 0.0})
    assert window.flush() == {"dpo/loss": 0.375, "dpo/pairs": 1.5, "dpo/steps_without_pairs": 2.0}
    window.add({"reward_mean": float("nan")})
    assert window.flush() == {}  # nothing but NaN: absent, never NaN


def test_a_madpo_run_without_pairs_logs_no_nan(tiny_llama):
    logged = Logged()
    trainer = MADPOTrainer(agent_model=tiny_llama, reward_func=constant_reward, callbacks=[logged],
                           train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                           args=MADPOConfig(**TINY, logging_steps=2))
    trainer.train()
    history = trainer.state.history
    assert len(history) == 2 and all(all_finite(row) for row in history)
    assert all(row["dpo/pairs"] == 0.0 and row["dpo/steps_without_pairs"] == 1.0 for row in history)
    assert not any("dpo/loss" in row or "agent_0/loss" in row for row in history)
    [window] = [log for log in logged.logs if "dpo/pairs" in log]
    assert all_finite(window) and window["dpo/steps_without_pairs"] == 2.0  # two steps of the window, counted


def pair_sides(trainer: MADPOTrainer, pairs: list[tuple[int, int]]):
    turn = trainer.rollout([{"prompt": p} for p in PROMPTS[:2]]).turns[0]
    return [preferences.generation_rows(g, [c for c, _ in pairs] + [r for _, r in pairs]) for g in turn.generations]


PAIRS = [(0, 1), (2, 3), (4, 5), (6, 7), (0, 2)]


def build(model: str) -> MADPOTrainer:
    return MADPOTrainer(agent_model=model, reward_func=letters_reward, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                        args=MADPOConfig(**{**TINY, "dpo_reference": "none", "max_grad_norm": None}))


def test_dpo_statistics_of_processes_average_to_the_statistic_of_all_pairs_by_hand():
    joint = torch.tensor([2.0, 0.0, -1.0])
    every = dpo.dpo_statistics(joint, beta=1.0)
    # process 0 holds the three pairs, process 1 none: mean pair count 1.5; each divides its sums by it
    first = dpo.dpo_statistics(joint, beta=1.0, normaliser=1.5)
    second = dpo.dpo_statistics(torch.zeros(0), beta=1.0, normaliser=1.5)
    assert second == {"loss": 0.0, "accuracy": 0.0, "margin": 0.0}
    assert {k: (first[k] + second[k]) / 2 for k in every} == pytest.approx(every)
    assert dpo.dpo_statistics(torch.zeros(0), beta=1.0, normaliser=0.0) == {}


# ----- two real processes (gloo): rank 1 has no pairs ------------------------------------------------
def ddp_worker(rank: int, model: str, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    trainer = build(model)
    assert trainer.data_parallel.world_size == 2
    torch.manual_seed(0)  # the same candidates on both ranks; rank 0 takes every pair
    sides = pair_sides(trainer, PAIRS if rank == 0 else [])
    metrics = trainer.data_parallel.average_metrics(trainer.preference_update(sides))
    if rank == 0:
        torch.save({"metrics": metrics, "weights": trainer.agents[0].state_dict()}, out)
    torch.distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow  # two spawned processes import torch and transformers: about 13 s here
def test_a_process_without_pairs_under_data_parallelism_reports_the_global_statistics(tiny_llama, tmp_path):
    out = str(tmp_path / "rank0.pt")
    mp.start_processes(ddp_worker, args=(tiny_llama, free_port(), out), nprocs=2, start_method="spawn")
    averaged = torch.load(out, weights_only=True)
    single = build(tiny_llama)
    torch.manual_seed(0)
    expected = single.preference_update(pair_sides(single, PAIRS))
    metrics = averaged["metrics"]
    assert all_finite(metrics) and metrics.keys() == expected.keys()
    for name in ("dpo/loss", "dpo/accuracy", "dpo/margin", "agent_0/loss", "agent_1/loss"):
        assert metrics[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-6), name
    assert metrics["dpo/pairs"] == len(PAIRS) / 2 and metrics["dpo/steps_without_pairs"] == 0.0
    for name, value in single.agents[0].state_dict().items():  # the same step: gradients averaged as in one process
        torch.testing.assert_close(averaged["weights"][name], value, rtol=0, atol=1e-6)
