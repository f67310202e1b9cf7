"""Bad inputs, numerical faults, signals and failed saves: each guard, shown to work."""

import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from comlrl.callbacks import TrainerCallback
from comlrl.checkpointing import latest_checkpoint, list_checkpoints
from comlrl.errors import NonFiniteTrainingError, TrainingInterrupted
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

ROOT = Path(__file__).resolve().parent.parent


def build(model_dir, dataset, reward_func, **config):
    settings = dict(num_agents=2, num_generations=2, max_new_tokens=6, agent_learning_rate=1e-3, num_train_epochs=2,
                    per_device_train_batch_size=2, seed=11, disable_tqdm=True)
    settings.update(config)
    return MAGRPOTrainer(agent_model=model_dir, num_agents=2, reward_func=reward_func, train_dataset=dataset,
                         args=MAGRPOConfig(**settings))


class SignalAt(TrainerCallback):
    """Sends this process a real signal after the given step."""

    def __init__(self, step, number=signal.SIGTERM):
        self.step, self.number = step, number

    def on_log(self, trainer, metrics, step):
        if step == self.step:
            os.kill(os.getpid(), self.number)


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGINT])
def test_signal_finishes_the_step_checkpoints_and_resumes_exactly(tiny_llama, train_dataset, reward_func, tmp_path, number):
    straight = build(tiny_llama, train_dataset, reward_func)
    straight.train()

    interrupted = build(tiny_llama, train_dataset, reward_func)
    interrupted.callbacks.append(SignalAt(step=6, number=number))
    found = signal.getsignal(number)  # SIG_IGN for SIGINT when pytest runs as a background job of a script
    with pytest.raises(TrainingInterrupted, match=f"{signal.Signals(number).name} received: stopped after step 6") as info:
        interrupted.train(checkpoint_dir=tmp_path, checkpoint_interval=1)
    assert info.value.checkpoint.endswith("checkpoint-1-step6")  # mid-epoch 2 (4 steps per epoch)
    assert signal.getsignal(number) == found  # the handler train() found is back

    resumed = build(tiny_llama, train_dataset, reward_func)
    resumed.train(resume_from_checkpoint=info.value.checkpoint, checkpoint_dir=tmp_path)
    for a, b in zip(straight.agents, resumed.agents):
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert [s["reward_mean"] for s in straight.state.history] == [s["reward_mean"] for s in resumed.state.history]
    assert latest_checkpoint(tmp_path).name == "checkpoint-2"


def test_nonfinite_gradients_are_skipped_then_stop_the_run(tiny_llama, train_dataset, reward_func, tmp_path):
    trainer = build(tiny_llama, train_dataset, reward_func, max_nonfinite_updates=3)
    before = [{k: v.clone() for k, v in agent.state_dict().items()} for agent in trainer.agents]
    for agent in trainer.agents:  # a real autograd hook that poisons every gradient
        next(agent.parameters()).register_hook(lambda grad: grad * float("nan"))
    with pytest.raises(NonFiniteTrainingError, match="3 consecutive optimizer steps had a NaN/inf") as info:
        trainer.train(checkpoint_dir=tmp_path)
    assert trainer.state.nonfinite_updates == 6  # 2 agents x 3 steps
    assert trainer.state.history[-1]["nonfinite_updates"] == 4.0  # counted in the metrics as it happened
    for saved, agent in zip(before, trainer.agents):  # no poisoned update reached the weights
        assert all(torch.equal(saved[k], v) for k, v in agent.state_dict().items())
    assert info.value.checkpoint and Path(info.value.checkpoint).is_dir()


def test_bad_inputs_fail_before_loading(tiny_llama, train_dataset, reward_func):
    with pytest.raises(ValueError, match="train_dataset has 8 rows, fewer than one batch"):
        build(tiny_llama, train_dataset, reward_func, per_device_train_batch_size=9)
    # A trainer whose max_new_tokens leaves no room is built (comlrl 1.4.3 builds one, to inspect it), and refused
    # before training's or an evaluation's first rollout.
    trainer = build(tiny_llama, train_dataset, reward_func, max_new_tokens=300)
    for call in (trainer.train, lambda: trainer.evaluate(train_dataset)):
        with pytest.raises(ValueError, match="max_new_tokens=300 leaves no room for a prompt in the 256-token context"):
            call()
    assert trainer.state.global_step == 0 and trainer.state.history == []


def test_prompt_longer_than_context(tiny_llama, reward_func, caplog):
    from datasets import Dataset

    long = Dataset.from_dict({"prompt": [" ".join(["the agents write a story"] * 80)] * 2})
    strict = build(tiny_llama, long, reward_func, prompt_overflow="error", max_new_tokens=16, num_train_epochs=1)
    with pytest.raises(ValueError, match=r"prompt 0 has \d+ tokens but only 240 fit"):
        strict.train()
    lenient = build(tiny_llama, long, reward_func, max_new_tokens=16, num_train_epochs=1)
    with caplog.at_level(logging.WARNING):
        lenient.train()
    assert "truncating 2 prompt(s) to their last 240 tokens" in caplog.text


def test_wrong_transition_output_is_named(tiny_llama, train_dataset, reward_func):
    def bad_transition(prompt, agent_completions, num_agents, **histories):
        return ["only one"]

    trainer = MAGRPOTrainer(agent_model=tiny_llama, num_agents=2, reward_func=reward_func, train_dataset=train_dataset,
                            external_transition=bad_transition,
                            args=MAGRPOConfig(num_agents=2, num_turns=2, num_generations=2, max_new_tokens=4,
                                              disable_tqdm=True))
    with pytest.raises(ValueError, match="external_transition .*bad_transition must return a list of 2 prompts"):
        trainer.train()


def test_dropped_rewards_are_counted_and_training_goes_on(tiny_llama, train_dataset):
    calls = []

    def flaky(c0, c1):
        calls.append(1)
        return [float("nan") if i == 0 else 1.0 + i for i in range(len(c0))]

    trainer = build(tiny_llama, train_dataset, flaky, invalid_reward="drop", num_train_epochs=1)
    history = trainer.train()
    assert history[-1]["reward/dropped"] == float(len(calls))  # the first joint sample of every call
    assert all(torch.isfinite(p).all() for agent in trainer.agents for p in agent.parameters())


FULL_DISK_SCRIPT = textwrap.dedent(
    """
    import resource, signal, sys, logging
    import transformers
    transformers.utils.logging.disable_progress_bar()
    from datasets import Dataset
    from comlrl.callbacks import TrainerCallback
    from comlrl.errors import CheckpointWriteError
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
    logging.basicConfig(level=logging.ERROR)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # exceeding the limit then fails the write with EFBIG
    limit, lift_at = int(sys.argv[3]), int(sys.argv[4])

    class FillDisk(TrainerCallback):
        def on_epoch_end(self, trainer, epoch):
            if epoch == 2:  # before checkpoint-2 is written, files may hold only `limit` bytes
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
            if epoch == lift_at:  # space is back before that epoch's checkpoint
                resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

    dataset = Dataset.from_dict({"prompt": ["a b", "c d", "e f", "g h"]})
    trainer = MAGRPOTrainer(agent_model=sys.argv[1], num_agents=2, train_dataset=dataset, callbacks=[FillDisk()],
        reward_func=lambda a, b: [float(len(x)) for x in a],
        args=MAGRPOConfig(num_agents=2, num_generations=2, max_new_tokens=4, num_train_epochs=3,
                          per_device_train_batch_size=2, disable_tqdm=True))
    try:
        trainer.train(checkpoint_dir=sys.argv[2])
    except CheckpointWriteError as error:
        print("CheckpointWriteError:", error.file, "|", error.last_good)
        raise
    print("finished epochs", trainer.state.epoch)
    """
)


def run_full_disk(model: str, directory: Path, limit: int, lift_at: int = 0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", FULL_DISK_SCRIPT, model, str(directory), str(limit), str(lift_at)],
                          capture_output=True, text=True, cwd=ROOT)


def weights_and_state_sizes(model: str, directory: Path) -> tuple[int, int]:
    """Sizes of an agent's weights file and of state.pt in a checkpoint of this script's run (no limit)."""
    result = run_full_disk(model, directory, limit=2**40)
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = directory / "checkpoint-1"
    return (checkpoint / "models" / "agent_0.safetensors").stat().st_size, (checkpoint / "state.pt").stat().st_size


# A file-size limit far above the run's history file (a few KB: one line a step) and far below an agent's
# weights (~320 KB): the weights are what fails.
FULL_DISK_LIMIT = 65536


def test_a_full_disk_names_the_file_and_cause_and_the_final_save_failing_fails_the_run(tiny_llama, tmp_path):
    result = run_full_disk(tiny_llama, tmp_path, limit=FULL_DISK_LIMIT)
    assert result.returncode != 0, "train() returned as if the final model had been saved"
    last_good = tmp_path / "checkpoint-1"
    assert f"CheckpointWriteError: models/agent_0.safetensors | {last_good}" in result.stdout, result.stdout
    assert result.stderr.count("checkpoint save failed") == 1, result.stderr[-3000:]  # checkpoint-2: logged, goes on
    assert "file too large" in result.stderr and "the final checkpoint was not saved" in result.stderr
    assert "Traceback" in result.stderr and "could not checkpoint" not in result.stderr
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".") and p.is_dir()]  # no staging left
    from comlrl.utils import read_checkpoint_metadata

    assert read_checkpoint_metadata(tmp_path / "checkpoint-1")["state"]["epoch"] == 1


def test_space_back_before_the_final_save_ends_the_run_normally(tiny_llama, tmp_path):
    result = run_full_disk(tiny_llama, tmp_path, limit=FULL_DISK_LIMIT, lift_at=3)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "finished epochs 3" in result.stdout
    assert result.stderr.count("checkpoint save failed") == 1  # checkpoint-2 only
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-3"]


def test_torch_save_failing_mid_file_is_named_as_such_not_as_a_serializer_error(tiny_llama, tmp_path):
    weights, state = weights_and_state_sizes(tiny_llama, tmp_path / "sizes")
    assert weights < state, (weights, state)  # the limit lets the weights through and stops state.pt
    result = run_full_disk(tiny_llama, tmp_path / "run", limit=(weights + state) // 2)
    assert result.returncode != 0
    assert "CheckpointWriteError: state.pt |" in result.stdout, result.stdout + result.stderr[-3000:]
    assert "file too large" in result.stderr and "inline_container" not in result.stderr.split("Traceback")[0]
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith(".") and p.is_dir()]


def test_a_write_failure_is_described_by_its_cause(tmp_path):
    import errno

    from comlrl.checkpointing.write_errors import describe

    cause, code = describe(OSError(errno.ENOSPC, "No space left on device"), tmp_path, needed=48 * 2**20)
    assert code == errno.ENOSPC and cause.startswith("no space left on device: ") and "needs ~48.0 MB" in cause
    assert re.search(rf"[0-9.]+ [MK]B free in {re.escape(str(tmp_path))},", cause), cause
    # torch.save's RuntimeError carries no errno: judged from the free space
    serializer = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4096 vs 4032")
    cause, code = describe(serializer, tmp_path, needed=2**62)
    assert code == errno.ENOSPC and cause.startswith("no space left on device")
    cause, code = describe(OSError(errno.EACCES, "Permission denied"), tmp_path, needed=1)
    assert cause == "Permission denied (EACCES)" and code == errno.EACCES


def test_every_torch_load_is_weights_only():
    offenders = []
    for path in list((ROOT / "comlrl").rglob("*.py")) + list((ROOT / "flows").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"torch\.load\(", line) and "weights_only=True" not in line:
                offenders.append(f"{path.relative_to(ROOT)}:{number}")
    assert not offenders, offenders


def test_remote_code_is_off_by_default():
    assert MAGRPOConfig().trust_remote_code is False


SLOW_TRAINER = textwrap.dedent(
    """
    import sys, time
    from datasets import Dataset
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    def slow(a, b):
        print("training", flush=True)
        time.sleep(0.5)
        return [1.0] * len(a)

    trainer = MAGRPOTrainer(agent_model=sys.argv[1], num_agents=2, reward_func=slow,
        train_dataset=Dataset.from_dict({"prompt": ["a b", "c d"] * 50}),
        args=MAGRPOConfig(num_agents=2, num_generations=2, max_new_tokens=2, disable_tqdm=True))
    trainer.train(checkpoint_dir=sys.argv[2])
    """
)


def test_a_second_process_cannot_write_a_checkpoint_directory_in_use(tiny_llama, train_dataset, reward_func, tmp_path):
    from comlrl.checkpointing.lock import DirectoryLockedError

    other = subprocess.Popen([sys.executable, "-c", SLOW_TRAINER, tiny_llama, str(tmp_path)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert other.stdout.readline().strip() == "training"  # it holds the directory now
        trainer = build(tiny_llama, train_dataset, reward_func, num_train_epochs=1)
        with pytest.raises(DirectoryLockedError, match=f"in use by another process \\(pid {other.pid} on "):
            trainer.train(checkpoint_dir=tmp_path)
        assert trainer.state.global_step == 0  # refused before any work
    finally:
        other.kill()
        other.wait()
    trainer = build(tiny_llama, train_dataset, reward_func, num_train_epochs=1)
    trainer.train(checkpoint_dir=tmp_path)  # the killed holder's lock went with it
    assert latest_checkpoint(tmp_path).name == "checkpoint-1"
