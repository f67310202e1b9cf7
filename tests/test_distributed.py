"""Data parallelism: a 2-process torchrun (gloo) MAGRPO step equals a 1-process step over the same
global batch, its rank-0 checkpoint resumes in one process, and launch/sharding rules (FSDP: tests/test_fsdp.py).

The rollouts are made identical across the two set-ups by sampling every prompt under its own
seed (tests/distributed_worker.py): then only float summation order separates the gradients.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from comlrl.parallel.distributed import DataParallel, check_launch
from distributed_worker import build

ROOT = Path(__file__).resolve().parents[1]
WORDS = "cat dog sun moon tree river hill road book idea plan team".split()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def equal_length_prompts(model_dir: str, count: int = 4) -> list[str]:
    """Prompts of one token length, so per-prompt samples stack without re-padding."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    by_length: dict[int, list[str]] = {}
    for word in WORDS:
        prompt = f"write a story about the {word}"
        by_length.setdefault(len(tokenizer(prompt, add_special_tokens=False)["input_ids"]), []).append(prompt)
    prompts = max(by_length.values(), key=len)
    assert len(prompts) >= count, by_length
    return prompts[:count]


def checkpoint_weights(path: Path) -> list[dict[str, torch.Tensor]]:
    return [load_file(str(path / "models" / f"agent_{i}.safetensors")) for i in range(2)]


def assert_weights_close(expected, actual, atol):
    for agent_expected, agent_actual in zip(expected, actual):
        # Checkpoints store tied weights once (lm_head), state dicts under both names.
        assert agent_actual.keys() <= agent_expected.keys() and agent_actual
        for name in agent_actual:
            torch.testing.assert_close(agent_actual[name], agent_expected[name], rtol=0, atol=atol, msg=name)


def launch_worker(model_dir: str, out, *arguments: str, env: dict[str, str] | None = None) -> None:
    """tests/distributed_worker.py in 2 gloo processes under torchrun, reading ``out/prompts.json``."""
    environment = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    for attempt in (1, 2):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), str(ROOT / "tests" / "distributed_worker.py"),
            model_dir, str(out / "prompts.json"), str(out), *arguments,
        ]
        result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=240)
        # A worker aborted by the C++ runtime (std::terminate in torch's gloo threads; seen once in about ten
        # runs of the FSDP worker on a loaded 2-core machine, 2026-12-05) is launched once more: every result the
        # tests compare comes from the launch that succeeded. Any other failure fails at once.
        if result.returncode == 0 or attempt == 2 or "terminate called without an active exception" not in result.stderr:
            break
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def launch_worker_function(function: str, *arguments: str, env: dict[str, str] | None = None) -> None:
    """``distributed_worker.<function>(*arguments)`` in 2 gloo processes under torchrun."""
    environment = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    code = f"import sys, distributed_worker; distributed_worker.{function}(*sys.argv[1:])"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), "--no-python", sys.executable, "-c", code, *arguments]
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.fixture(scope="module")
def two_process_run(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    prompts = equal_length_prompts(tiny_llama)
    (out / "prompts.json").write_text(json.dumps(prompts))
    launch_worker(tiny_llama, out)
    return out, prompts


def test_two_processes_take_the_same_step_as_one(two_process_run, tiny_llama, tmp_path):
    out, prompts = two_process_run
    shards = [json.loads((out / f"shard_{rank}.json").read_text()) for rank in range(2)]
    assert sorted(shards[0] + shards[1]) == [0, 1, 2, 3] and len(shards[0]) == len(shards[1]) == 2

    single = build(tiny_llama, prompts, per_device_batch=4, epochs=2)
    single_history = single.train(checkpoint_dir=tmp_path / "single")
    parallel_history = json.loads((out / "history.json").read_text())
    first, parallel = single_history[0], parallel_history[0]
    # The averaged gradient: same norm, loss and rewards as one process over the global batch.
    for key in ("agent_0/grad_norm", "agent_1/grad_norm", "agent_0/loss", "agent_1/loss", "reward_mean"):
        assert parallel[key] == pytest.approx(first[key], rel=1e-5, abs=1e-7), key
    assert first["agent_0/grad_norm"] > 0
    # Rank 0's checkpoint holds the weights every rank reached; they match the 1-process step.
    two_process_weights = checkpoint_weights(out / "checkpoints" / "checkpoint-1")
    assert_weights_close(checkpoint_weights(tmp_path / "single" / "checkpoint-1"), two_process_weights, atol=1e-5)
    final = torch.load(out / "weights.pt", weights_only=True)
    assert_weights_close(final, two_process_weights, atol=0)

    # A 2-process checkpoint resumes in one process and continues like the 1-process run.
    resumed = build(tiny_llama, prompts, per_device_batch=4, epochs=2)
    resumed_history = resumed.train(resume_from_checkpoint=out / "checkpoints" / "checkpoint-1")
    assert resumed.state.global_step == 2 and resumed_history[0] == parallel_history[0]
    assert resumed_history[1]["agent_0/grad_norm"] == pytest.approx(single_history[1]["agent_0/grad_norm"], rel=1e-4)
    assert_weights_close(
        [agent.state_dict() for agent in single.agents], [agent.state_dict() for agent in resumed.agents], atol=1e-5
    )


def test_sharding_is_round_robin_and_every_rank_needs_a_prompt():
    assert DataParallel(rank=1, world_size=3).shard([10, 11, 12, 13, 14, 15, 16]) == [11, 14]
    assert DataParallel().shard([1, 2, 3]) == [1, 2, 3]
    DataParallel(rank=0, world_size=4).check_batches(num_rows=12, batch_size=2)  # last batch: 4 prompts
    with pytest.raises(ValueError, match="train_dataset has 9 rows.*4 processes the last global batch has 1 prompt"):
        DataParallel(rank=0, world_size=4).check_batches(num_rows=9, batch_size=2)


def test_deepspeed_launches_are_refused_clearly(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match="accelerate DeepSpeed config.*fsdp.yaml.*multi_gpu.yaml"):
        check_launch()


LEAVES_GROUP = """
import atexit, pathlib, sys
import torch.distributed as dist
from comlrl.parallel import distributed
out = pathlib.Path(sys.argv[1])
# Registered before the library joins the group, so it runs after the library's own exit handler.
atexit.register(lambda: (out / f"rank{rank}.txt").write_text(str(dist.is_initialized())))
data_parallel = distributed.current()
rank = data_parallel.rank
assert dist.is_initialized() and data_parallel.world_size == 2
# Both have joined before either exits: a rank that left at once could close the mesh while the other, slowed
# by a loaded machine, was still connecting to it ("Connection closed by peer", seen once under load 12).
dist.barrier()
"""


def test_the_process_group_the_library_joined_is_destroyed_at_exit(tmp_path):
    """Left to the interpreter's teardown, gloo can abort a finished process (exit -6)."""
    script = tmp_path / "leaves_group.py"
    script.write_text(LEAVES_GROUP)
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), str(script), str(tmp_path)]
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [(tmp_path / f"rank{rank}.txt").read_text() for rank in range(2)] == ["False", "False"]
