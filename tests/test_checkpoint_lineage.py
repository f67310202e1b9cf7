"""Which checkpoint "latest" is after resumes, kills and interrupted saves.

A resume archives the checkpoints beyond its starting point, so "latest" is always the newest
checkpoint of the run being continued; interrupted saves and archives are settled when a run next
starts; and a run killed at random moments (some inside saves and inside a resume's archive) ends
with the weights of an uninterrupted run.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

from comlrl.callbacks import TrainerCallback
from comlrl.checkpointing import latest_checkpoint, list_checkpoints, read_history
from comlrl.checkpointing.history import HISTORY_DIR
from comlrl.checkpointing.lineage import ARCHIVE_DIR, JOURNAL_FILE
from comlrl.checkpointing.recovery import recover
from comlrl.errors import TrainingInterrupted
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


def build(model_dir: str, epochs: int, rows: int = 2, callbacks=()) -> MAGRPOTrainer:
    prompts = ["a b", "c d", "e f", "g h"][:rows]
    return MAGRPOTrainer(agent_model=model_dir, num_agents=2, train_dataset=Dataset.from_dict({"prompt": prompts}),
                         reward_func=lambda a, b: [float(len(x)) for x in a], callbacks=list(callbacks),
                         args=MAGRPOConfig(num_agents=2, num_generations=2, max_new_tokens=4, num_train_epochs=epochs,
                                           per_device_train_batch_size=2, seed=5, disable_tqdm=True))


def lineage_of(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "metadata.json").read_text())["lineage"]


def names(directory: Path) -> list[str]:
    """The entries of ``directory`` but the run's history folder (the rows its checkpoints share)."""
    return sorted(p.name for p in directory.iterdir() if p.name != HISTORY_DIR)


def assert_weights_equal(trainer: MAGRPOTrainer, checkpoint: Path) -> None:
    for index, agent in enumerate(trainer.agents):
        saved = load_file(str(checkpoint / "models" / f"agent_{index}.safetensors"))
        current = agent.state_dict()
        assert saved and all(torch.equal(current[name], tensor) for name, tensor in saved.items()), index


class StopAfter(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_log(self, trainer, metrics, step):
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


# ----- resume from an earlier checkpoint ------------------------------------------------------------
def test_resume_archives_the_abandoned_branch_and_latest_continues_the_resumed_run(tiny_llama, tmp_path):
    straight = build(tiny_llama, 3, rows=4)
    straight.train()

    build(tiny_llama, 3, rows=4).train(checkpoint_dir=tmp_path)  # attempt A: checkpoint-1..3
    first = lineage_of(tmp_path / "checkpoint-3")["attempt"]

    branch = build(tiny_llama, 3, rows=4, callbacks=[StopAfter(5)])  # attempt B, from checkpoint-1
    with pytest.raises(TrainingInterrupted):
        branch.train(resume_from_checkpoint=tmp_path / "checkpoint-1", checkpoint_dir=tmp_path)
    assert names(tmp_path) == [ARCHIVE_DIR, "checkpoint-1", "checkpoint-2", "checkpoint-2-step5"]
    assert names(tmp_path / ARCHIVE_DIR) == [first]
    assert names(tmp_path / ARCHIVE_DIR / first) == ["checkpoint-2", "checkpoint-3"]  # moved, never deleted
    assert lineage_of(tmp_path / ARCHIVE_DIR / first / "checkpoint-3")["attempt"] == first
    second = lineage_of(tmp_path / "checkpoint-2-step5")
    assert second["ancestors"] == [first] and second["resumed_from"] == "checkpoint-1"
    assert latest_checkpoint(tmp_path).name == "checkpoint-2-step5"  # not A's checkpoint-3

    # "latest" continues B, and checkpoint_total_limit prunes only B's line (never the archive or the resumed one)
    resumed = build(tiny_llama, 3, rows=4)
    resumed.train(resume_from_checkpoint="latest", checkpoint_dir=tmp_path, checkpoint_total_limit=1)
    third = lineage_of(tmp_path / "checkpoint-3")
    assert third["resumed_from"] == "checkpoint-2-step5" and third["ancestors"] == [first, second["attempt"]]
    assert names(tmp_path) == [ARCHIVE_DIR, "checkpoint-2-step5", "checkpoint-3"]
    assert names(tmp_path / ARCHIVE_DIR / first) == ["checkpoint-2", "checkpoint-3"]
    assert_weights_equal(straight, tmp_path / "checkpoint-3")
    assert [s["reward_mean"] for s in resumed.state.history] == [s["reward_mean"] for s in straight.state.history]


def test_a_fresh_run_archives_what_it_would_overwrite(tiny_llama, tmp_path):
    build(tiny_llama, 1).train(checkpoint_dir=tmp_path)
    earlier = lineage_of(tmp_path / "checkpoint-1")["attempt"]
    build(tiny_llama, 1).train(checkpoint_dir=tmp_path)
    assert lineage_of(tmp_path / "checkpoint-1")["attempt"] != earlier
    assert names(tmp_path / ARCHIVE_DIR / earlier) == ["checkpoint-1"]


# ----- interrupted saves and archives, settled at the next start -------------------------------------
@pytest.fixture(scope="module")
def two_saves(tiny_llama, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("two")
    build(tiny_llama, 2).train(checkpoint_dir=root)
    return root / "checkpoint-1", root / "checkpoint-2"


@pytest.fixture(scope="module")
def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def place(source: Path, target: Path, state: str = "sealed") -> None:
    shutil.copytree(source, target)
    shutil.copytree(source.parent / HISTORY_DIR, target.parent / HISTORY_DIR, dirs_exist_ok=True)
    if state == "unsealed":  # a save killed before its seal
        (target / "COMPLETE").unlink()
        (target / "manifest.json").unlink()
    elif state == "damaged":  # sealed, then a file changed
        (target / "state.pt").write_bytes(b"[]")
    elif state == "half-deleted":  # the deletion of a replaced copy was cut short
        (target / "COMPLETE").unlink()
        shutil.rmtree(target / "models")


# leftovers of checkpoint-4: {entry: (which save, its state)}, then what must be checkpoint-4 afterwards
# (boundary 1 = the older save "old", boundary 2 = the newer save "new"; None = no checkpoint-4).
SWAPS = {
    "renamed aside, staging sealed": ({".old": ("old", "sealed"), ".tmp": ("new", "sealed")}, 2),
    "renamed aside, staging unsealed": ({".old": ("old", "sealed"), ".tmp": ("new", "unsealed")}, 1),
    "renamed aside, staging damaged": ({".old": ("old", "sealed"), ".tmp": ("new", "damaged")}, 1),
    "renamed aside only": ({".old": ("old", "sealed")}, 1),
    "swapped, old copy half-deleted": ({"": ("new", "sealed"), ".old": ("old", "half-deleted")}, 2),
    "sealed, not yet renamed": ({"": ("old", "sealed"), ".tmp": ("new", "sealed")}, 2),
    "killed save's staging": ({".tmp": ("new", "unsealed")}, None),
    "killed save's staging beside a checkpoint": ({"": ("old", "sealed"), ".tmp": ("new", "unsealed")}, 1),
}


@pytest.mark.parametrize("case", SWAPS)
def test_interrupted_swap_is_settled(two_saves, dead_pid, tmp_path, case):
    leftovers, expected = SWAPS[case]
    sources = {"old": two_saves[0], "new": two_saves[1]}
    entry_names = {"": "checkpoint-4", ".old": f".checkpoint-4.old-{dead_pid}",
                   ".tmp": f".checkpoint-4.tmp-{dead_pid}-x1"}
    for entry, (which, state) in leftovers.items():
        place(sources[which], tmp_path / entry_names[entry], state)
    actions = recover(tmp_path)
    assert actions
    if expected is None:
        assert names(tmp_path) == []
    else:
        assert names(tmp_path) == ["checkpoint-4"]  # no .old or .tmp left
        assert json.loads((tmp_path / "checkpoint-4" / "metadata.json").read_text())["boundary"] == expected


def test_leftovers_of_a_live_writer_are_left_alone(two_saves, tmp_path):
    writer = subprocess.Popen(["sleep", "30"])
    try:
        place(two_saves[1], tmp_path / f".checkpoint-4.tmp-{writer.pid}-x1", "unsealed")
        assert recover(tmp_path) == []
        assert names(tmp_path) == [f".checkpoint-4.tmp-{writer.pid}-x1"]
    finally:
        writer.kill()
        writer.wait()


def test_interrupted_archive_is_completed(two_saves, tmp_path):
    place(two_saves[0], tmp_path / "checkpoint-1")
    place(two_saves[1], tmp_path / "checkpoint-2")
    place(two_saves[1], tmp_path / "checkpoint-3")
    (tmp_path / ARCHIVE_DIR / "A").mkdir(parents=True)
    (tmp_path / "checkpoint-2").rename(tmp_path / ARCHIVE_DIR / "A" / "checkpoint-2")  # the first move was made
    moves = [["checkpoint-2", f"{ARCHIVE_DIR}/A/checkpoint-2"], ["checkpoint-3", f"{ARCHIVE_DIR}/A/checkpoint-3"]]
    (tmp_path / JOURNAL_FILE).write_text(json.dumps({"moves": moves}))
    assert latest_checkpoint(tmp_path).name == "checkpoint-3"  # before: the abandoned branch's
    recover(tmp_path)
    assert latest_checkpoint(tmp_path).name == "checkpoint-1"
    assert names(tmp_path / ARCHIVE_DIR / "A") == ["checkpoint-2", "checkpoint-3"]
    assert not (tmp_path / JOURNAL_FILE).exists()


def test_a_run_start_recovers_before_it_picks_latest(tiny_llama, two_saves, dead_pid, tmp_path):
    place(two_saves[0], tmp_path / "checkpoint-1")
    place(two_saves[1], tmp_path / f".checkpoint-2.tmp-{dead_pid}-x1")  # sealed: only its rename was cut short
    place(two_saves[1], tmp_path / f".checkpoint-3.tmp-{dead_pid}-x2", "unsealed")  # a killed save
    trainer = build(tiny_llama, 2)
    trainer.train(resume_from_checkpoint="latest", checkpoint_dir=tmp_path)
    assert trainer.state.global_step == 2 and len(trainer.state.history) == 2  # continued from checkpoint-2
    assert names(tmp_path) == ["checkpoint-1", "checkpoint-2"]


# ----- random SIGKILLs -------------------------------------------------------------------------------
EPOCHS = 8  # one step per epoch, a checkpoint per step
SAVE_DELAY = 0.15  # a save's staging directory stays unsealed this long (so kills can land inside saves)
ARCHIVE_DELAY = 0.2  # between the moves of a resume's archive


def run_child(model_dir: str, checkpoint_dir: str, resume) -> None:
    """A forked training process: saves and archives slowed down, so that kills can land inside them."""
    from comlrl.checkpointing import lineage, manifest

    real_seal, real_apply = manifest.seal, lineage._apply

    def slow_seal(directory):
        time.sleep(SAVE_DELAY)
        real_seal(directory)

    def slow_apply(root, moves):
        for move in moves:
            time.sleep(ARCHIVE_DELAY)
            real_apply(root, [move])

    manifest.seal, lineage._apply = slow_seal, slow_apply
    build(model_dir, EPOCHS).train(resume_from_checkpoint=resume, checkpoint_dir=checkpoint_dir)


def wait_for(process, condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.is_alive(), f"the training process ended (exit code {process.exitcode}) before the kill"
        assert time.monotonic() < deadline, "timed out waiting for the moment to kill"
        time.sleep(0.002)


def checkpoints_anywhere(root: Path) -> list[Path]:
    return list_checkpoints(root) + [p for folder in (root / ARCHIVE_DIR).glob("*") for p in folder.iterdir()]


def test_random_sigkills_resume_the_newest_checkpoint_of_the_resumed_run(tiny_llama, tmp_path):
    straight = build(tiny_llama, EPOCHS)
    straight.train()
    rng = random.Random(20240519)
    context = multiprocessing.get_context("fork")
    root = tmp_path / "run"
    seen: set[str] = set()
    expected: Path | None = None  # where the next "latest" resume must start
    starts: dict[str, str | None] = {}  # attempt -> the checkpoint it had to resume from

    def staging():
        return any(p.name.startswith(".checkpoint-") and ".tmp-" in p.name for p in root.iterdir())

    rounds = [
        ("latest", lambda p: wait_for(p, lambda: len(list_checkpoints(root)) >= 3), 0.3),  # a random moment
        ("latest", lambda p: wait_for(p, lambda: root.is_dir() and staging()), SAVE_DELAY * 0.8),  # inside a save
        ("earlier", lambda p: wait_for(p, lambda: (root / JOURNAL_FILE).exists()), ARCHIVE_DELAY * 2),  # archiving
        ("latest", lambda p: wait_for(p, lambda: True), 1.0),  # a random moment after the start
    ]
    for how, moment, spread in rounds:
        source = expected
        if how == "earlier":  # resume from an older checkpoint than the newest: its successors are abandoned
            source = rng.choice(list_checkpoints(root)[:-1])
        resume = source if how == "earlier" else "latest"
        process = context.Process(target=run_child, args=(tiny_llama, str(root), resume))
        process.start()
        moment(process)
        time.sleep(rng.uniform(0, spread))
        os.kill(process.pid, signal.SIGKILL)
        process.join()
        assert process.exitcode == -signal.SIGKILL

        recover(root)  # what the next start does first (test_a_run_start_recovers_before_it_picks_latest)
        leftovers = [p.name for p in root.iterdir() if p.name.startswith(".")]
        assert leftovers == [], leftovers  # no staging, no .old, no journal left
        new = [p for p in list_checkpoints(root) if lineage_of(p)["attempt"] not in seen]
        for checkpoint in new:
            starts[lineage_of(checkpoint)["attempt"]] = source.name if source is not None else None
        expected = max(new, key=lambda p: list_checkpoints(root).index(p)) if new else source
        assert latest_checkpoint(root) == expected, (how, latest_checkpoint(root), expected)
        seen |= {lineage_of(p)["attempt"] for p in checkpoints_anywhere(root)}

    final = context.Process(target=run_child, args=(tiny_llama, str(root), "latest"))
    final.start()
    final.join(timeout=120)
    assert final.exitcode == 0
    last = latest_checkpoint(root)
    assert last.name == f"checkpoint-{EPOCHS}"
    starts[lineage_of(last)["attempt"]] = expected.name if expected is not None else None
    for checkpoint in list_checkpoints(root):  # each attempt resumed from the newest checkpoint of the one before
        record = lineage_of(checkpoint)
        assert record["resumed_from"] == starts[record["attempt"]], (checkpoint.name, record)
    assert any((root / ARCHIVE_DIR).iterdir())  # the abandoned branch was kept
    assert_weights_equal(straight, last)
    history = read_history(last)
    assert [row["reward_mean"] for row in history] == [row["reward_mean"] for row in straight.state.history]
