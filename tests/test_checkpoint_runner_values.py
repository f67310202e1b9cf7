"""What the trainer hook (comlrl/checkpointing/runner.py) records of a model, how it words a checkpoint that
does not fit or a state that does not load, what a resume takes from the checkpoint's record of tracker runs,
and where a stopped run says it can resume: checked on real modules and real runs."""

from __future__ import annotations

import errno
import json
import os
import resource
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from comlrl.checkpointing import list_checkpoints
from comlrl.checkpointing.manifest import seal
from comlrl.checkpointing.runner import _describe_shape_difference, model_fingerprint, same_model
from comlrl.errors import CheckpointError, CheckpointWriteError, TrainingInterrupted
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from test_checkpoint_lineage import StopAfter
from file_limits import file_size_limit


class Head(torch.nn.Module):
    def __init__(self, width: int = 3, dtype: torch.dtype = torch.float32, scale: torch.dtype = torch.float16):
        super().__init__()
        self.proj = torch.nn.Linear(width, 2, dtype=dtype)
        self.register_buffer("scale", torch.ones(2, dtype=scale))


def test_a_fingerprint_is_the_class_and_every_tensors_shape_and_dtype():
    assert model_fingerprint(Head()) == {
        "class": "Head", "num_tensors": 3,
        "shapes": {"proj.weight": [2, 3], "proj.bias": [2], "scale": [2]},
        "dtypes": {"proj.weight": "float32", "proj.bias": "float32", "scale": "float16"},
    }


def test_the_same_model_fits_and_an_older_fingerprint_without_dtypes_is_compared_without_them():
    saved = model_fingerprint(Head())
    assert same_model(saved, model_fingerprint(Head()))
    assert not same_model(saved, model_fingerprint(Head(width=4)))
    assert not same_model(saved, model_fingerprint(Head(dtype=torch.bfloat16)))
    older = {key: value for key, value in saved.items() if key != "dtypes"}
    assert same_model(older, model_fingerprint(Head(dtype=torch.bfloat16)))
    assert not same_model(older, model_fingerprint(Head(width=4)))


def test_a_model_that_does_not_fit_is_described_by_its_first_difference():
    saved = model_fingerprint(Head())
    other = dict(model_fingerprint(torch.nn.Linear(3, 2)), shapes={})
    assert _describe_shape_difference(saved, other) == "architecture Linear here but Head in the checkpoint"
    assert _describe_shape_difference(saved, model_fingerprint(Head(width=4))) == (
        "tensor 'proj.weight' has shape [2, 4] here but [2, 3] in the checkpoint")
    fewer = dict(saved, shapes={"proj.bias": [2], "scale": [2]})  # a tensor only the checkpoint has
    assert _describe_shape_difference(saved, fewer) == (
        "tensor 'proj.weight' has shape None here but [2, 3] in the checkpoint")
    assert _describe_shape_difference(fewer, saved) == (
        "tensor 'proj.weight' has shape [2, 3] here but None in the checkpoint")
    assert _describe_shape_difference(saved, model_fingerprint(Head(dtype=torch.bfloat16))) == (
        "tensor 'proj.bias' is bfloat16 here but float32 in the checkpoint (load the models in the dtype the run "
        "was trained in)")
    assert _describe_shape_difference(saved, model_fingerprint(Head(scale=torch.float32))) == (
        "tensor 'scale' is float32 here but float16 in the checkpoint (load the models in the dtype the run was "
        "trained in)")  # the first tensor whose dtype differs, not the first tensor
    assert _describe_shape_difference(saved, model_fingerprint(Head())) == "weights differ"
    undtyped = {key: value for key, value in saved.items() if key != "dtypes"}
    assert _describe_shape_difference(saved, undtyped) == (
        "tensor 'proj.bias' is None here but float32 in the checkpoint (load the models in the dtype the run was "
        "trained in)")
    assert _describe_shape_difference(undtyped, model_fingerprint(Head())) == "weights differ"


# ----- where a stopped run can resume -------------------------------------------------------------------
def build(model_dir: str, callbacks=()) -> MAGRPOTrainer:
    dataset = Dataset.from_dict({"prompt": ["a b", "c d"]})
    return MAGRPOTrainer(agent_model=model_dir, num_agents=2, train_dataset=dataset,
                         reward_func=lambda a, b: [float(len(x)) for x in a], callbacks=list(callbacks),
                         args=MAGRPOConfig(num_agents=2, num_generations=2, max_new_tokens=4, num_train_epochs=3,
                                           per_device_train_batch_size=1, seed=5, disable_tqdm=True))


def test_a_stop_between_boundaries_names_the_checkpoint_it_wrote(tiny_llama, tmp_path):
    with pytest.raises(TrainingInterrupted) as stopped:
        build(tiny_llama, [StopAfter(3)]).train(checkpoint_dir=tmp_path)
    assert stopped.value.checkpoint == str(tmp_path / "checkpoint-1-step3")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-1-step3"]
    with pytest.raises(TrainingInterrupted) as stopped:  # without a checkpoint directory: nowhere to resume
        build(tiny_llama, [StopAfter(3)]).train()
    assert stopped.value.checkpoint is None


def test_a_state_that_load_state_dict_refuses_is_named_with_its_file_and_cause(tiny_llama, tmp_path):
    """An RNG state of the right kind but the wrong size passes the structural checks; torch refuses it, and the
    refusal names the checkpoint, state.pt and torch's words."""
    first = build(tiny_llama)
    first.args.num_train_epochs = 1
    first.train(checkpoint_dir=tmp_path)
    checkpoint = tmp_path / "checkpoint-1"
    state = torch.load(checkpoint / "state.pt", weights_only=True)
    state["rng"]["torch"] = state["rng"]["torch"][:10]
    torch.save(state, checkpoint / "state.pt")
    seal(checkpoint)
    with pytest.raises(CheckpointError) as error:
        build(tiny_llama).train(checkpoint_dir=tmp_path, resume_from_checkpoint=checkpoint)
    assert (error.value.checkpoint, error.value.file) == (str(checkpoint), "state.pt")
    assert error.value.problem.startswith("MAGRPOTrainer.load_state_dict refused it: RuntimeError: Expected a "
                                          "CPUGeneratorImplState of size "), error.value.problem
    assert error.value.problem.endswith("but found the input RNG state size to be 10"), error.value.problem


@pytest.mark.parametrize("recorded, absent", [("wandb", "mlflow"), ("mlflow", "wandb")])
def test_a_resume_takes_the_tracking_runs_the_checkpoint_records(tiny_llama, tmp_path, recorded, absent):
    """The checkpoint's record of each tracker run, absent or not, replaces what this process had."""
    first = build(tiny_llama)
    first.args.num_train_epochs = 1
    first.run_identity[recorded] = {"id": "abc123", "project": "demo"}
    first.train(checkpoint_dir=tmp_path)

    resumed = build(tiny_llama)
    resumed.run_identity.update(wandb={"id": "zzz999", "project": "demo"}, mlflow={"run_id": "r1"})
    resumed.train(checkpoint_dir=tmp_path, resume_from_checkpoint="latest")
    assert resumed.run_identity[recorded] == {"id": "abc123", "project": "demo"}
    assert resumed.run_identity[absent] is None


def test_a_checkpoint_of_other_models_cannot_be_resumed_here(tiny_llama, tmp_path):
    first = build(tiny_llama)
    first.args.num_train_epochs = 1
    first.train(checkpoint_dir=tmp_path)
    checkpoint = tmp_path / "checkpoint-1"
    metadata = json.loads((checkpoint / "metadata.json").read_text())
    metadata["models"]["critic"] = metadata["models"]["agent_0"]  # and its weights: a whole third model
    weights = (checkpoint / "models" / "agent_0.safetensors").read_bytes()
    (checkpoint / "models" / "critic.safetensors").write_bytes(weights)
    (checkpoint / "metadata.json").write_text(json.dumps(metadata, indent=2, sort_keys=True))
    seal(checkpoint)
    with pytest.raises(CheckpointError) as error:
        build(tiny_llama).train(checkpoint_dir=tmp_path, resume_from_checkpoint=checkpoint)
    assert (error.value.checkpoint, error.value.file) == (str(checkpoint), None)
    assert error.value.problem == ("cannot be resumed here: models ['agent_0', 'agent_1'] here but ['agent_0', "
                                   "'agent_1', 'critic'] in the checkpoint")



def test_an_optimizer_state_that_does_not_load_is_named_with_the_checkpoint_and_optimizer(tiny_llama, tmp_path):
    """A pending gradient for a tensor the model lacks passes the structural checks; the optimizer's refusal
    names the checkpoint it read (the runner passes its path down) and the optimizer."""
    first = build(tiny_llama)
    first.args.num_train_epochs = 1
    first.train(checkpoint_dir=tmp_path)
    checkpoint = tmp_path / "checkpoint-1"
    state = torch.load(checkpoint / "state.pt", weights_only=True)
    state["optimizers"]["agent_1"]["pending_grads"]["no.such.weight"] = torch.zeros(2)
    torch.save(state, checkpoint / "state.pt")
    seal(checkpoint)
    with pytest.raises(CheckpointError) as error:
        build(tiny_llama).train(checkpoint_dir=tmp_path, resume_from_checkpoint=checkpoint)
    assert (error.value.checkpoint, error.value.file) == (str(checkpoint), "state.pt")
    assert error.value.problem == (f"MAGRPOTrainer.load_state_dict refused it: ValueError: checkpoint "
                                   f"{str(checkpoint)!r}, optimizer 'agent_1': saved pending gradient for "
                                   f"'no.such.weight', which the model lacks")


def failing_reward(fails_from_call: int):
    """The test's reward (each completion's length) until its ``fails_from_call``-th call, which and every later
    one raise ConnectionError."""
    calls = []

    def reward(a, b):
        calls.append(len(a))
        if len(calls) >= fails_from_call:
            raise ConnectionError("reward service is down")
        return [float(len(x)) for x in a]

    return reward


def build_with_reward(model_dir: str, reward) -> MAGRPOTrainer:
    return MAGRPOTrainer(agent_model=model_dir, num_agents=2, train_dataset=Dataset.from_dict({"prompt": ["a b", "c d"]}),
                         reward_func=reward,
                         args=MAGRPOConfig(num_agents=2, num_generations=2, max_new_tokens=4, num_train_epochs=3,
                                           per_device_train_batch_size=1, seed=5, disable_tqdm=True, reward_retries=0))


def test_a_failure_right_after_a_boundary_names_that_checkpoint_and_writes_no_other(tiny_llama, tmp_path, caplog):
    """Two rows of batch 1: the reward fails at its third call, the first step of epoch 2. That step is put back,
    so the state is epoch 1's end, which checkpoint-1 already holds: the run names it and writes nothing new."""
    with caplog.at_level("ERROR", logger="comlrl.training.run"), pytest.raises(Exception, match="reward service is down"):
        build_with_reward(tiny_llama, failing_reward(3)).train(checkpoint_dir=tmp_path)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1"]
    assert f"ended the run after step 2; resume from {tmp_path / 'checkpoint-1'}" in caplog.text, caplog.text


def test_a_failure_right_after_a_resume_names_the_checkpoint_resumed_and_writes_no_other(tiny_llama, tmp_path, caplog):
    first = build(tiny_llama)
    first.args.num_train_epochs = 1
    first.train(checkpoint_dir=tmp_path)
    with caplog.at_level("ERROR", logger="comlrl.training.run"), pytest.raises(Exception, match="reward service is down"):
        build_with_reward(tiny_llama, failing_reward(1)).train(checkpoint_dir=tmp_path, resume_from_checkpoint="latest")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1"]
    assert f"ended the run after step 2; resume from {tmp_path / 'checkpoint-1'}" in caplog.text, caplog.text


def record_replacements(monkeypatch) -> list[str]:
    """The names ``os.replace`` moves something to from now on (a recording wrapper around the real one)."""
    names = []
    replace = os.replace

    def recording_replace(source, target):
        names.append(Path(target).name)
        return replace(source, target)

    monkeypatch.setattr(os, "replace", recording_replace)
    return names


def test_resuming_a_finished_run_writes_no_checkpoint(tiny_llama, tmp_path, monkeypatch):
    build(tiny_llama).train(checkpoint_dir=tmp_path)
    installed = record_replacements(monkeypatch)
    resumed = build(tiny_llama)
    resumed.train(checkpoint_dir=tmp_path, resume_from_checkpoint="latest")
    assert installed == [] and resumed.state.global_step == 6
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


def test_a_final_save_the_cadence_left_to_the_end_fails_the_run_when_it_fails(tiny_llama, tmp_path):
    """checkpoint_interval=2 over three epochs: checkpoint-2 at its boundary, the final checkpoint-3 at the run's
    end. Files limited from step 5 (epoch 3): the end's save fails, and so does the run, naming checkpoint-2."""
    limit = FilesLimitedFrom(5)
    trainer = build(tiny_llama, [limit])
    with file_size_limit():
        with pytest.raises(CheckpointWriteError) as error:
            trainer.train(checkpoint_dir=tmp_path, checkpoint_interval=2)
    assert (error.value.checkpoint, error.value.file) == (str(tmp_path / "checkpoint-3"), "models/agent_0.safetensors")
    assert error.value.last_good == str(tmp_path / "checkpoint-2")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2"]


class FilesLimitedFrom(StopAfter):
    """From after step ``step`` on, the process's files may hold only ``size`` bytes (``ulimit -f``; by default
    64 KiB: the history file's rows fit, an agent's weights do not), as on a disk that fills up."""

    def __init__(self, step: int, size: int = 64 * 1024):
        super().__init__(step)
        self.size = size

    def on_log(self, trainer, metrics, step):
        if step == self.step and not hasattr(self, "previous"):
            self.previous = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.size, self.previous[1]))


class StopWithFullDisk(FilesLimitedFrom):
    """A SIGTERM after the step, with the process's files limited to 4 KiB from then on: the stop's checkpoint
    cannot be written, as on a full disk."""

    def __init__(self, step: int):
        super().__init__(step, size=4096)

    def on_log(self, trainer, metrics, step):
        super().on_log(trainer, metrics, step)
        StopAfter.on_log(self, trainer, metrics, step)


def test_a_stop_whose_checkpoint_cannot_be_written_names_no_checkpoint(tiny_llama, tmp_path):
    stop = StopWithFullDisk(3)
    with file_size_limit():
        with pytest.raises(TrainingInterrupted) as stopped:
            build(tiny_llama, [stop]).train(checkpoint_dir=tmp_path)
    assert stopped.value.checkpoint is None
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1"]  # the boundary's, written before


def test_a_checkpoint_past_the_planned_stages_is_refused_with_both_counts(tiny_llama, tmp_path):
    """An iterative run's checkpoint one stage into its second iteration (iteration 1 of 2 begun) resumed by a
    run that plans one iteration: the iteration count fits (1 <= 1), the stages do not."""
    from test_iterative import build as build_iterative

    first = build_iterative(tiny_llama, num_iterations=2, num_train_epochs=1)
    stages = len(first.STAGES)
    first.train(checkpoint_dir=tmp_path, checkpoint_interval=1)
    checkpoint = tmp_path / f"checkpoint-{stages + 1}"
    with pytest.raises(CheckpointError) as error:
        build_iterative(tiny_llama, num_iterations=1, num_train_epochs=1).train(
            checkpoint_dir=tmp_path / "other", resume_from_checkpoint=checkpoint)
    assert (error.value.checkpoint, error.value.file) == (str(checkpoint), None)
    assert error.value.problem == (f"cannot be resumed here: it has completed {stages + 1} boundaries (pbrl_stage) "
                                   f"but this run plans {stages}; the run's length counts the whole run, so raise it")


@pytest.mark.parametrize("full_from_step, last_good", [(3, "checkpoint-1"), (1, None)])
def test_a_final_save_that_fails_names_the_last_good_checkpoint(tiny_llama, tmp_path, full_from_step, last_good,
                                                               caplog):
    """Two epochs of two steps. Full from step 3: checkpoint-1 was written, the final checkpoint-2 fails and the
    run fails naming checkpoint-1. Full from step 1: both fail and the last good checkpoint is "none"."""
    limit = FilesLimitedFrom(full_from_step)
    trainer = build(tiny_llama, [limit])
    trainer.args.num_train_epochs = 2
    with file_size_limit():
        with caplog.at_level("ERROR", logger="comlrl.checkpointing.runner"), \
                pytest.raises(CheckpointWriteError) as error:
            trainer.train(checkpoint_dir=tmp_path)
    logged = [r.getMessage() for r in caplog.records if r.name == "comlrl.checkpointing.runner"]
    assert logged[-1] == f"the final checkpoint was not saved: {error.value}"
    if last_good is None:  # checkpoint-1 failed first, and the run went on
        first = logged[0]
        assert first.startswith(f"checkpoint save failed: writing models/agent_0.safetensors of checkpoint "
                                f"{str(tmp_path / 'checkpoint-1')!r} failed: "), first
        assert first.endswith("; the last good checkpoint is none. Training goes on; the run fails at its end "
                              "unless a later checkpoint is saved"), first
        assert len(logged) == 2
    else:
        assert len(logged) == 1
    expected = str(tmp_path / last_good) if last_good else "none"
    assert (error.value.checkpoint, error.value.file) == (str(tmp_path / "checkpoint-2"), "models/agent_0.safetensors")
    assert error.value.last_good == expected
    assert str(error.value).endswith(f"; the last good checkpoint is {expected}")
    assert [p.name for p in list_checkpoints(tmp_path)] == ([last_good] if last_good else [])


def test_a_checkpoint_whose_manifest_was_removed_is_refused_as_metadata_says_it_had_one(tiny_llama, tmp_path):
    first = build(tiny_llama)
    first.args.num_train_epochs = 1
    first.train(checkpoint_dir=tmp_path)
    checkpoint = tmp_path / "checkpoint-1"
    (checkpoint / "manifest.json").unlink()
    with pytest.raises(CheckpointError) as error:
        build(tiny_llama).train(checkpoint_dir=tmp_path, resume_from_checkpoint=checkpoint)
    assert (error.value.checkpoint, error.value.file) == (str(checkpoint), "manifest.json")
    assert error.value.problem == "is missing (metadata.json says the checkpoint was saved with one)"


def test_a_history_file_that_cannot_grow_is_named_relative_to_the_checkpoint(tiny_llama, tmp_path):
    """Files limited to 100 bytes from step 1: the history rows, appended before the weights, fail first."""
    limit = FilesLimitedFrom(1, size=100)
    trainer = build(tiny_llama, [limit])
    trainer.args.num_train_epochs = 1
    with file_size_limit():
        with pytest.raises(CheckpointWriteError) as error:
            trainer.train(checkpoint_dir=tmp_path)
    assert error.value.checkpoint == str(tmp_path / "checkpoint-1")
    history = sorted((tmp_path / "history").iterdir())
    assert [p.suffix for p in history] == [".jsonl"] and error.value.file == f"../history/{history[0].name}"
    assert error.value.errno == errno.EFBIG
    assert error.value.cause.startswith("file too large: the process's file-size limit (ulimit -f) is 0.1 KB, this "
                                        "checkpoint's files need up to ~"), error.value.cause


def test_each_boundary_is_written_once_and_the_end_writes_no_other(tiny_llama, tmp_path, monkeypatch):
    """Three epochs with a checkpoint at each: three checkpoints installed, in order (an older one set aside
    as ``.NAME.old-PID`` is not an install); the run's end finds the last one already written."""
    replaced = record_replacements(monkeypatch)
    build(tiny_llama).train(checkpoint_dir=tmp_path)
    assert [name for name in replaced if not name.startswith(".")] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


def test_a_history_folder_that_cannot_be_made_is_named_with_the_cause(tiny_llama, tmp_path):
    """A file where the run's history folder goes: the first save cannot make the folder (EEXIST), and says so."""
    (tmp_path / "history").write_text("not a folder")
    trainer = build(tiny_llama)
    trainer.args.num_train_epochs = 1
    with pytest.raises(CheckpointWriteError) as error:
        trainer.train(checkpoint_dir=tmp_path)
    assert (error.value.checkpoint, error.value.file) == (str(tmp_path / "checkpoint-1"), "../history/")
    assert (error.value.cause, error.value.errno) == ("File exists (EEXIST)", errno.EEXIST)


def test_a_resume_from_a_folder_of_another_name_archives_what_came_after_its_state(tiny_llama, tmp_path):
    """A copy of checkpoint-1 named "picked" (its name gives no position): the position is the copy's state,
    boundary 1 at step 2, so checkpoint-2 and checkpoint-3 of the first run are archived, checkpoint-1 kept."""
    import shutil

    build(tiny_llama).train(checkpoint_dir=tmp_path)
    shutil.copytree(tmp_path / "checkpoint-1", tmp_path / "picked")
    build(tiny_llama).train(checkpoint_dir=tmp_path, resume_from_checkpoint=tmp_path / "picked")
    archived = sorted(p.name for p in (tmp_path / "abandoned").rglob("checkpoint-*") if p.is_dir())
    assert archived == ["checkpoint-2", "checkpoint-3"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


@pytest.mark.parametrize("interval", [0, -1, True, 1.5, "2", None])
def test_a_checkpoint_interval_that_is_not_a_positive_integer_is_refused_in_these_words(tiny_llama, tmp_path,
                                                                                       interval):
    trainer = build(tiny_llama)
    with pytest.raises(ValueError) as error:
        trainer.train(checkpoint_dir=tmp_path, checkpoint_interval=interval)
    assert str(error.value) == f"checkpoint_interval must be a positive integer, got {interval!r}"
    assert trainer.state.global_step == 0 and list_checkpoints(tmp_path) == []


@pytest.mark.parametrize("limit", [0, -2, True, 1.5, "2"])
def test_a_save_total_limit_that_is_not_a_positive_integer_is_refused_in_these_words(tiny_llama, tmp_path, limit):
    trainer = build(tiny_llama)
    with pytest.raises(ValueError) as error:
        trainer.train(checkpoint_dir=tmp_path, save_total_limit=limit)
    assert str(error.value) == f"save_total_limit must be a positive integer or None, got {limit!r}"
    assert trainer.state.global_step == 0


def test_a_checkpoint_directory_another_holder_locks_is_refused_naming_it(tiny_llama, tmp_path):
    """The test holds the directory's lock (an flock on its own open file): the run is refused before any step,
    the refusal naming the checkpoint directory."""
    from comlrl.checkpointing.lock import DirectoryLock, DirectoryLockedError

    held = DirectoryLock(tmp_path, shared=False)
    held.acquire()
    try:
        trainer = build(tiny_llama)
        with pytest.raises(DirectoryLockedError) as error:
            trainer.train(checkpoint_dir=tmp_path)
    finally:
        held.release()
    assert str(error.value).startswith(f"checkpoint directory {tmp_path} is in use by another process ("), str(error.value)
    assert trainer.state.global_step == 0 and list_checkpoints(tmp_path) == []


def test_the_history_file_is_named_after_the_runs_attempt(tiny_llama, tmp_path):
    trainer = build(tiny_llama)
    trainer.args.num_train_epochs = 1
    trainer.train(checkpoint_dir=tmp_path)
    metadata = json.loads((tmp_path / "checkpoint-1" / "metadata.json").read_text())
    assert [p.name for p in (tmp_path / "history").iterdir()] == [f"{metadata['lineage']['attempt']}.jsonl"]


def test_resume_true_is_latest_and_false_starts_afresh(tiny_llama, tmp_path):
    first = build(tiny_llama)
    first.args.num_train_epochs = 1
    first.train(checkpoint_dir=tmp_path)
    resumed = build(tiny_llama)
    resumed.args.num_train_epochs = 2
    resumed.train(checkpoint_dir=tmp_path, resume_from_checkpoint=True)
    lineage = json.loads((tmp_path / "checkpoint-2" / "metadata.json").read_text())["lineage"]
    assert lineage["resumed_from"] == "checkpoint-1" and len(lineage["ancestors"]) == 1
    afresh = build(tiny_llama)
    afresh.args.num_train_epochs = 1
    afresh.train(checkpoint_dir=tmp_path / "other", resume_from_checkpoint=False)
    assert json.loads((tmp_path / "other" / "checkpoint-1" / "metadata.json").read_text())["lineage"]["resumed_from"] is None
    with pytest.raises(ValueError) as error:
        build(tiny_llama).train(resume_from_checkpoint="latest")
    assert str(error.value) == "resume_from_checkpoint='latest' needs checkpoint_dir"
