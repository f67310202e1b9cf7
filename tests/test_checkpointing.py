"""Training checkpoints: exact resume, durability under SIGKILL, incompatibility errors."""

import json
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from comlrl.checkpointing import latest_checkpoint, list_checkpoints
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from comlrl.utils import read_checkpoint_metadata


def build(model_dir, dataset, reward_func, epochs, **config):
    settings = dict(num_agents=2, num_generations=2, max_new_tokens=6, agent_learning_rate=1e-3,
                    num_train_epochs=epochs, per_device_train_batch_size=2, seed=7, disable_tqdm=True)
    settings.update(config)
    return MAGRPOTrainer(agent_model=model_dir, num_agents=2, reward_func=reward_func, train_dataset=dataset,
                         args=MAGRPOConfig(**settings))


def weights(trainer):
    return [{k: v.clone() for k, v in agent.state_dict().items()} for agent in trainer.agents]


def test_no_options_writes_nothing(tiny_llama, train_dataset, reward_func, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    build(tiny_llama, train_dataset, reward_func, 1).train()
    assert list(tmp_path.iterdir()) == []


def test_bit_exact_resume(tiny_llama, train_dataset, reward_func, tmp_path):
    straight = build(tiny_llama, train_dataset, reward_func, 2)
    history_a = straight.train()

    first_half = build(tiny_llama, train_dataset, reward_func, 1)
    first_half.train(checkpoint_dir=tmp_path / "ckpt", checkpoint_interval=1)
    assert [p.name for p in list_checkpoints(tmp_path / "ckpt")] == ["checkpoint-1"]
    del first_half

    resumed = build(tiny_llama, train_dataset, reward_func, 2)
    history_b = resumed.train(
        resume_from_checkpoint=tmp_path / "ckpt" / "checkpoint-1", checkpoint_dir=tmp_path / "ckpt", checkpoint_interval=1,
    )
    for agent_a, agent_b in zip(weights(straight), weights(resumed)):
        for name in agent_a:
            assert torch.equal(agent_a[name], agent_b[name]), name
    assert [s["reward_mean"] for s in history_a] == [s["reward_mean"] for s in history_b]
    assert resumed.state.global_step == straight.state.global_step
    assert [p.name for p in list_checkpoints(tmp_path / "ckpt")] == ["checkpoint-1", "checkpoint-2"]


def test_metadata_and_wandb_snippet(tiny_llama, train_dataset, reward_func, tmp_path):
    trainer = build(tiny_llama, train_dataset, reward_func, 1)
    trainer.train(checkpoint_dir=tmp_path / "checkpoints", checkpoint_interval=1)
    checkpoint = str(tmp_path / "checkpoints" / "checkpoint-1")
    metadata = read_checkpoint_metadata(checkpoint)
    assert metadata["wandb"] is None and metadata["boundary"] == 1 and metadata["boundary_kind"] == "epoch"
    assert metadata["state"]["epoch"] == 1 and metadata["config"]["seed"] == 7

    # The guide's snippet, as written.
    wandb_config = {"project": "demo"}
    identity = read_checkpoint_metadata(checkpoint)["wandb"]
    if identity and "id" not in wandb_config and "resume" not in wandb_config:
        wandb_config = {**wandb_config, **identity, "resume": "allow"}
    assert wandb_config == {"project": "demo"}

    # With an identity recorded, the merge applies.
    trainer.run_identity["wandb"] = {"id": "abc123", "project": "demo", "entity": "team"}
    trainer.train(checkpoint_dir=tmp_path / "with-id")
    identity = read_checkpoint_metadata(tmp_path / "with-id" / "checkpoint-1")["wandb"]
    assert identity == {"id": "abc123", "project": "demo", "entity": "team"}


def test_raising_epochs_trains_only_the_extra(tiny_llama, train_dataset, reward_func, tmp_path):
    build(tiny_llama, train_dataset, reward_func, 1).train(checkpoint_dir=tmp_path)
    resumed = build(tiny_llama, train_dataset, reward_func, 3)
    history = resumed.train(resume_from_checkpoint=tmp_path / "checkpoint-1", checkpoint_dir=tmp_path)
    steps_per_epoch = len(train_dataset) // 2
    new_steps = [s for s in history if s["epoch"] >= 1]
    assert len(new_steps) == 2 * steps_per_epoch and len(history) == 3 * steps_per_epoch
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


def test_interval_limit_and_latest(tiny_llama, train_dataset, reward_func, tmp_path):
    trainer = build(tiny_llama, train_dataset, reward_func, 3)
    trainer.train(checkpoint_dir=tmp_path, checkpoint_interval=2, save_total_limit=1)
    # saves at 2 and (final) 3; the limit keeps only the newest
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-3"]
    assert latest_checkpoint(tmp_path).name == "checkpoint-3"


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(per_device_train_batch_size=4), "train_batch_size is 4 here but 2 in the checkpoint"),
        (dict(seed=8), "seed is 8 here but 7 in the checkpoint"),
        (dict(num_train_epochs=0), None),
    ],
)
def test_incompatible_settings(tiny_llama, train_dataset, reward_func, tmp_path, change, message):
    build(tiny_llama, train_dataset, reward_func, 2).train(checkpoint_dir=tmp_path)
    if message is None:
        with pytest.raises(ValueError, match="must be >= 1"):
            build(tiny_llama, train_dataset, reward_func, **{"epochs": 1, **change})
        with pytest.raises(ValueError, match="completed 2 epochs but num_train_epochs is 1; .* raise it"):
            build(tiny_llama, train_dataset, reward_func, 1).train(resume_from_checkpoint=tmp_path / "checkpoint-2")
        return
    with pytest.raises(ValueError, match=message):
        build(tiny_llama, train_dataset, reward_func, 3, **change).train(resume_from_checkpoint=tmp_path / "checkpoint-2")


def test_incompatible_models(tiny_llama, tiny_gpt2, train_dataset, reward_func, tmp_path):
    build(tiny_llama, train_dataset, reward_func, 1).train(checkpoint_dir=tmp_path)
    other = MAGRPOTrainer(agents=[tiny_llama, tiny_gpt2], reward_func=reward_func, train_dataset=train_dataset,
                          args=MAGRPOConfig(max_new_tokens=32, num_agents=2, num_generations=2, per_device_train_batch_size=2, seed=7,
                                            num_train_epochs=2, disable_tqdm=True))
    with pytest.raises(ValueError, match=r"tokenizer_sizes is \[96, 128\] here but \[96, 96\] in the checkpoint"):
        other.train(resume_from_checkpoint=tmp_path / "checkpoint-1")
    three = MAGRPOTrainer(agent_model=tiny_llama, num_agents=3, reward_func=lambda a, b, c: [0.0] * len(a),
                          train_dataset=train_dataset,
                          args=MAGRPOConfig(max_new_tokens=32, num_agents=3, num_generations=2, per_device_train_batch_size=2, seed=7,
                                            num_train_epochs=2, disable_tqdm=True))
    with pytest.raises(ValueError, match="num_agents is 3 here but 2 in the checkpoint"):
        three.train(resume_from_checkpoint=tmp_path / "checkpoint-1")


def test_missing_and_partial_checkpoints_are_refused(tmp_path, tiny_llama, train_dataset, reward_func):
    trainer = build(tiny_llama, train_dataset, reward_func, 1)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        trainer.train(resume_from_checkpoint=tmp_path / "checkpoint-9")
    partial = tmp_path / "checkpoint-1"
    partial.mkdir()
    (partial / "metadata.json").write_text(json.dumps({}))
    with pytest.raises(ValueError, match="incomplete"):
        trainer.train(resume_from_checkpoint=partial)
    assert latest_checkpoint(tmp_path) is None


KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import transformers
    transformers.utils.logging.disable_progress_bar()
    from datasets import Dataset
    import comlrl.checkpointing.io as io
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    model_dir, checkpoint_dir = sys.argv[1], sys.argv[2]
    real_save = io.save_model
    def save_then_die(module, path):
        real_save(module, path)
        if "checkpoint-2" in path:  # half-way through writing the second checkpoint
            os.kill(os.getpid(), signal.SIGKILL)
    io.save_model = save_then_die
    dataset = Dataset.from_dict({"prompt": ["a b", "c d", "e f", "g h"]})
    trainer = MAGRPOTrainer(agent_model=model_dir, num_agents=2, train_dataset=dataset,
        reward_func=lambda a, b: [float(len(x)) for x in a],
        args=MAGRPOConfig(num_agents=2, num_generations=2, max_new_tokens=4, num_train_epochs=3,
                          per_device_train_batch_size=2, disable_tqdm=True))
    trainer.train(checkpoint_dir=checkpoint_dir, checkpoint_interval=1)
    """
)


def test_sigkill_during_save_keeps_previous_checkpoint(tiny_llama, tmp_path):
    checkpoint_dir = tmp_path / "ckpt"
    result = subprocess.run([sys.executable, "-c", KILL_SCRIPT, tiny_llama, str(checkpoint_dir)], capture_output=True)
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()[-2000:]
    leftovers = [p.name for p in checkpoint_dir.iterdir()]
    assert "checkpoint-1" in leftovers and "checkpoint-2" not in leftovers
    assert any(name.startswith(".checkpoint-2.tmp-") for name in leftovers)  # the partial one, never picked up
    assert latest_checkpoint(checkpoint_dir).name == "checkpoint-1"

    from datasets import Dataset

    dataset = Dataset.from_dict({"prompt": ["a b", "c d", "e f", "g h"]})
    resumed = MAGRPOTrainer(agent_model=tiny_llama, num_agents=2, train_dataset=dataset,
                            reward_func=lambda a, b: [float(len(x)) for x in a],
                            args=MAGRPOConfig(num_agents=2, num_generations=2, max_new_tokens=4, num_train_epochs=3,
                                              per_device_train_batch_size=2, disable_tqdm=True))
    resumed.train(resume_from_checkpoint="latest", checkpoint_dir=checkpoint_dir)
    assert resumed.state.epoch == 3
    assert latest_checkpoint(checkpoint_dir).name == "checkpoint-3"


def test_pt_files_load_weights_only(tiny_llama, train_dataset, reward_func, tmp_path):
    build(tiny_llama, train_dataset, reward_func, 1).train(checkpoint_dir=tmp_path)
    for file in (tmp_path / "checkpoint-1").rglob("*.pt"):
        torch.load(file, weights_only=True)
    assert list((tmp_path / "checkpoint-1" / "models").glob("*.safetensors"))


def test_lr_schedule_resumes_exactly(tiny_llama, train_dataset, reward_func, tmp_path):
    # Warm-up of 6 steps crosses the epoch boundary at step 4. (A decaying schedule depends on
    # the planned total, which the shorter first run plans differently, so it is not used here.)
    schedule = dict(lr_scheduler_type="constant_with_warmup", warmup_steps=6)
    straight = build(tiny_llama, train_dataset, reward_func, 2, **schedule)
    straight.train()
    build(tiny_llama, train_dataset, reward_func, 1, **schedule).train(checkpoint_dir=tmp_path)
    saved = torch.load(tmp_path / "checkpoint-1" / "state.pt", weights_only=True)
    assert saved["optimizers"]["agent_0"]["scheduler"]["last_epoch"] == 4
    resumed = build(tiny_llama, train_dataset, reward_func, 2, **schedule)
    resumed.train(resume_from_checkpoint=tmp_path / "checkpoint-1")
    lr = [o.param_groups[0]["lr"] for o in resumed.optimizers]
    assert lr == [o.param_groups[0]["lr"] for o in straight.optimizers] == [1e-3, 1e-3]
    for a, b in zip(weights(straight), weights(resumed)):
        assert all(torch.equal(a[k], b[k]) for k in a)
