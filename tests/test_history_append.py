"""The per-step history is appended to a file the run's checkpoints share, never rewritten
(:mod:`comlrl.checkpointing.history`): what a save writes does not grow with the run, and a resume
(from the newest checkpoint, an older one, past a torn line, or from a format-2 checkpoint with its
own ``history.json``) restores exactly its checkpoint's rows."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from comlrl.checkpointing import latest_checkpoint, read_checkpoint, read_history
from comlrl.checkpointing.history import HISTORY_DIR, encode_rows
from comlrl.checkpointing.lineage import ARCHIVE_DIR
from comlrl.checkpointing.manifest import seal
from comlrl.errors import TrainingInterrupted
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from test_checkpoint_lineage import StopAfter

STEPS_PER_EPOCH = 2
VOLATILE = ("_time", "tokens_per_second", "memory/")  # metrics of the machine, not of the run


def build(model_dir: str, epochs: int, callbacks=()) -> MAGRPOTrainer:
    dataset = Dataset.from_dict({"prompt": ["a b", "c d", "e f", "g h"]})
    return MAGRPOTrainer(agent_model=model_dir, num_agents=2, train_dataset=dataset, callbacks=list(callbacks),
                         reward_func=lambda a, b: [float(len(x)) for x in a],
                         args=MAGRPOConfig(num_agents=2, num_generations=2, max_new_tokens=4, num_train_epochs=epochs,
                                           per_device_train_batch_size=2, seed=5, disable_tqdm=True))



def steady(history: list[dict]) -> list[dict]:
    """The rows less the machine's timings and memory, which differ between two runs of the same steps."""
    return [{key: value for key, value in row.items() if not any(part in key for part in VOLATILE)} for row in history]


def history_files(root: Path) -> list[Path]:
    return sorted((root / HISTORY_DIR).iterdir())


def bytes_written() -> int:
    """Bytes this process has passed to write calls so far (Linux task I/O accounting)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("/proc/self/io has no wchar line")


def directory_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def assert_same_weights(a: MAGRPOTrainer, b: MAGRPOTrainer) -> None:
    for agent_a, agent_b in zip(a.agents, b.agents):
        theirs = agent_b.state_dict()
        assert all(torch.equal(tensor, theirs[name]) for name, tensor in agent_a.state_dict().items())


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux task I/O accounting")
def test_what_a_save_writes_does_not_grow_with_the_run(tiny_llama, tmp_path):
    trainer = build(tiny_llama, 5)
    run = trainer.start_run(checkpoint_dir=tmp_path)
    written = []
    while run.next_boundary is not None:
        metrics = run.close_boundary()
        before = bytes_written()
        run.save_boundary(metrics)
        written.append(bytes_written() - before)
    run.finish()

    history = trainer.state.history
    row = len(encode_rows(history[-1:]))
    assert len(history) == 5 * STEPS_PER_EPOCH and row > 400
    # checkpoint-5 holds 5x the rows of checkpoint-1, yet its save wrote as many bytes (files and
    # appended rows alike); a few bytes differ (the counts' digits in metadata.json)
    assert max(written) - min(written) < row // 4, (written, row)
    sizes = [directory_bytes(tmp_path / f"checkpoint-{k}") for k in range(1, 6)]
    assert max(sizes) - min(sizes) < row // 4, (sizes, row)
    assert [file.stat().st_size for file in history_files(tmp_path)] == [len(encode_rows(history))]
    assert read_history(tmp_path / "checkpoint-5") == history
    assert read_history(tmp_path / "checkpoint-2") == history[:2 * STEPS_PER_EPOCH]


def test_a_resume_restores_the_rows_of_an_uninterrupted_run(tiny_llama, tmp_path):
    straight = build(tiny_llama, 3)
    straight.train()
    first = build(tiny_llama, 3, [StopAfter(3)])
    with pytest.raises(TrainingInterrupted):
        first.train(checkpoint_dir=tmp_path)
    assert latest_checkpoint(tmp_path).name == "checkpoint-1-step3"

    resumed = build(tiny_llama, 3)
    resumed.train(resume_from_checkpoint="latest", checkpoint_dir=tmp_path)
    assert resumed.state.history[:3] == first.state.history  # the saved rows, exactly (timings included)
    assert steady(resumed.state.history) == steady(straight.state.history)
    assert read_history(tmp_path / "checkpoint-3") == resumed.state.history
    assert_same_weights(resumed, straight)
    assert len(history_files(tmp_path)) == 1  # the resume appended to the file where its checkpoint's rows ended


def test_a_resume_from_an_older_checkpoint_keeps_its_rows_then_the_branchs(tiny_llama, tmp_path):
    first = build(tiny_llama, 3)
    first.train(checkpoint_dir=tmp_path)
    attempt = json.loads((tmp_path / "checkpoint-3" / "metadata.json").read_text())["lineage"]["attempt"]

    branch = build(tiny_llama, 3)
    branch.train(resume_from_checkpoint=tmp_path / "checkpoint-1", checkpoint_dir=tmp_path)
    kept = STEPS_PER_EPOCH
    assert branch.state.history[:kept] == first.state.history[:kept]
    assert steady(branch.state.history) == steady(first.state.history)  # the same steps, run again
    assert branch.state.history[kept:] != first.state.history[kept:]  # ... by the branch (its own timings)
    assert read_history(tmp_path / "checkpoint-3") == branch.state.history
    # the abandoned checkpoints keep their rows, read through the archive
    archived = tmp_path / ARCHIVE_DIR / attempt / "checkpoint-3"
    assert read_checkpoint(archived).history == first.state.history
    assert len(history_files(tmp_path)) == 2  # the first file ran past checkpoint-1: the branch started its own


def test_a_torn_last_line_is_ignored_with_a_warning(tiny_llama, tmp_path, caplog):
    first = build(tiny_llama, 2)
    first.train(checkpoint_dir=tmp_path)
    [file] = history_files(tmp_path)
    torn = b'{"step": 5, "epoch": 2, "reward_me'  # a row whose write a kill cut short
    with open(file, "ab") as handle:
        handle.write(torn)

    resumed = build(tiny_llama, 3)
    with caplog.at_level(logging.WARNING, logger="comlrl.checkpointing.history"):
        resumed.train(resume_from_checkpoint="latest", checkpoint_dir=tmp_path)
    assert "ends with a partial row" in caplog.text and str(file) in caplog.text
    assert resumed.state.history[:2 * STEPS_PER_EPOCH] == first.state.history
    assert [row["step"] for row in resumed.state.history] == list(range(1, 3 * STEPS_PER_EPOCH + 1))
    assert read_history(tmp_path / "checkpoint-3") == resumed.state.history
    assert file.read_bytes().endswith(torn)  # never written over: the resume started a file of its own


def test_a_format_2_checkpoint_with_its_own_history_json_loads(tiny_llama, tmp_path):
    first = build(tiny_llama, 1)
    first.train(checkpoint_dir=tmp_path)
    checkpoint = tmp_path / "checkpoint-1"
    metadata = json.loads((checkpoint / "metadata.json").read_text())  # as the previous version wrote it:
    del metadata["history"]
    metadata["format_version"] = 2
    (checkpoint / "metadata.json").write_text(json.dumps(metadata, indent=2, sort_keys=True))
    (checkpoint / "history.json").write_text(json.dumps(first.state.history))
    seal(checkpoint)
    shutil.rmtree(tmp_path / HISTORY_DIR)

    assert read_history(checkpoint) == first.state.history
    resumed = build(tiny_llama, 2)
    resumed.train(resume_from_checkpoint=checkpoint, checkpoint_dir=tmp_path)
    assert resumed.state.history[:STEPS_PER_EPOCH] == first.state.history
    saved = tmp_path / "checkpoint-2"  # the next save is of this format: rows appended, none in the checkpoint
    assert json.loads((saved / "metadata.json").read_text())["format_version"] == 3
    assert not (saved / "history.json").exists()
    assert read_history(saved) == resumed.state.history
