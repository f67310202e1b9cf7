"""Corrupted checkpoints are refused before any training step, naming the checkpoint and the file.

One real checkpoint is saved per module; every case copies it (with its run's history folder),
damages one file, and resumes a trainer from the copy. Byte-level damage is applied twice: as found
(the manifest, or for the shared history file the size and sha256 its record holds, catches it) and
re-sealed (manifest and COMPLETE, or the record, rewritten to match, as if the damage had happened
before the save), so that the parser's own check is what must name the file. Semantic damage is
always re-sealed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from datasets import Dataset
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from comlrl.callbacks import TrainerCallback
from comlrl.checkpointing.history import HISTORY_DIR, encode_rows
from comlrl.checkpointing.manifest import seal
from comlrl.errors import CheckpointError
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from comlrl.utils import read_checkpoint_metadata

MARKER = Path("/tmp") / f"comlrl-corruption-marker-{os.getpid()}"


class Evil:
    """A pickle payload that would create MARKER if it were ever unpickled."""

    def __reduce__(self):
        return os.system, (f"touch {MARKER}",)


class Recorder(TrainerCallback):
    def __init__(self):
        self.events = []

    def on_train_begin(self, trainer):
        self.events.append("train_begin")

    def on_log(self, trainer, metrics, step):
        self.events.append(f"log {step}")


def build(model_dir: str, epochs: int, callbacks=()) -> MAGRPOTrainer:
    dataset = Dataset.from_dict({"prompt": ["a b", "c d"]})
    return MAGRPOTrainer(agent_model=model_dir, num_agents=2, train_dataset=dataset,
                         reward_func=lambda a, b: [float(len(x)) for x in a], callbacks=list(callbacks),
                         args=MAGRPOConfig(num_agents=2, num_generations=2, max_new_tokens=4, num_train_epochs=epochs,
                                           per_device_train_batch_size=2, seed=3, disable_tqdm=True))


@pytest.fixture(scope="module")
def saved(tiny_llama, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("saved")
    build(tiny_llama, 1).train(checkpoint_dir=root)
    return root / "checkpoint-1"


def untouched(resumer) -> bool:
    trainer, recorder, weights = resumer
    return (recorder.events == [] and trainer.state.global_step == 0 and trainer.state.history == []
            and all(torch.equal(weights[k], v) for k, v in trainer.agents[0].state_dict().items()))


@pytest.fixture
def resumer(tiny_llama, request):
    """A trainer to resume: one for every case, since a refused resume leaves it untouched (checked
    after each case); a new one after a case that touched it, so that one failure does not spread."""
    cached = getattr(request.module, "_resumer", None)
    if cached is None or not untouched(cached):
        recorder = Recorder()
        trainer = build(tiny_llama, 2, [recorder])
        cached = trainer, recorder, {k: v.clone() for k, v in trainer.agents[0].state_dict().items()}
        request.module._resumer = cached
    return cached


@pytest.fixture
def copy(saved, tmp_path) -> Path:
    target = tmp_path / "checkpoint-1"
    shutil.copytree(saved, target)
    shutil.copytree(saved.parent / HISTORY_DIR, tmp_path / HISTORY_DIR)  # the rows the checkpoint names
    return target


def refused(resumer, path: Path) -> CheckpointError:
    """Resume from ``path``: a CheckpointError naming it, raised before any step or load."""
    trainer = resumer[0]
    with pytest.raises(CheckpointError) as info:
        trainer.train(resume_from_checkpoint=path)
    assert str(path) in str(info.value), info.value
    assert untouched(resumer), "the refused resume loaded something or trained"
    assert not MARKER.exists()
    return info.value


# ----- byte-level damage, every kind x every file ---------------------------------------------------
def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def empty(file: Path) -> None:
    file.write_bytes(b"")


def zeroed(file: Path) -> None:
    file.write_bytes(b"\0" * max(file.stat().st_size, 16))


def garbage(file: Path) -> None:
    file.write_bytes(random.Random(file.name).randbytes(max(file.stat().st_size, 16)))


def pickled(file: Path) -> None:
    if file.suffix == ".pt":
        torch.save({"progress": Evil()}, file)
    else:
        file.write_bytes(pickle.dumps(Evil()))


def missing(file: Path) -> None:
    file.unlink()


KINDS: dict[str, Callable[[Path], None]] = {f.__name__: f for f in (truncate, empty, zeroed, garbage, pickled, missing)}
FILES = ["metadata.json", "state.pt", "models/agent_0.safetensors", "manifest.json", "COMPLETE"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("file", FILES)
def test_damaged_file_is_named(resumer, copy, file, kind):
    KINDS[kind](copy / file)
    error = refused(resumer, copy)
    if file == "COMPLETE" and kind != "missing":  # COMPLETE holds the manifest's checksum
        assert error.file == "manifest.json" and "COMPLETE" in error.problem
    elif file == "COMPLETE":
        assert error.file is None and "incomplete (no COMPLETE marker" in error.problem
    else:
        assert error.file == file, error
        assert f", {file}: " in str(error)
    if file not in ("manifest.json", "COMPLETE") and kind != "missing":  # the manifest finds it, before any parser
        assert "were saved (truncated or overwritten)" in error.problem or "sha256 differs" in error.problem, error


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("file", ["metadata.json", "state.pt", "models/agent_0.safetensors"])
def test_damaged_file_is_named_by_its_parser(resumer, copy, file, kind):
    KINDS[kind](copy / file)
    seal(copy)
    error = refused(resumer, copy)
    assert error.file == file, error
    expected = {"metadata.json": "not valid JSON|not UTF-8|is missing",
                "state.pt": "not a readable torch file|pickled Python objects|is missing",
                "models/agent_0.safetensors": "not a readable safetensors file|is missing"}[file]
    assert any(part in error.problem for part in expected.split("|")), error
    if file == "state.pt" and kind == "pickled":
        assert "never loaded" in error.problem and "GLOBAL posix.system" in error.problem


# ----- the run's history file (comlrl.checkpointing.history) -----------------------------------------
def history_record(path: Path) -> dict:
    return json.loads((path / "metadata.json").read_text())["history"]


def history_file(path: Path) -> Path:
    return path.parent / HISTORY_DIR / history_record(path)["file"]


def history_label(path: Path) -> str:
    """The history file as errors name it: relative to the checkpoint."""
    return f"../{HISTORY_DIR}/{history_record(path)['file']}"


def rewrite_history(path: Path, data: bytes) -> None:
    """The history file holds ``data`` and the checkpoint's record counts all of it (re-recorded, then re-sealed)."""
    history_file(path).write_bytes(data)
    record = {"file": history_record(path)["file"], "rows": data.count(b"\n"), "bytes": len(data),
              "sha256": hashlib.sha256(data).hexdigest()}
    edit_metadata(path, lambda m: m.__setitem__("history", record))


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_history_file_is_named(resumer, copy, kind):
    label = history_label(copy)
    KINDS[kind](history_file(copy))
    error = refused(resumer, copy)
    assert error.file == label, error
    expected = {"missing": "is missing: the checkpoint's 1 history rows are kept in the history/ folder",
                "truncate": "fewer than the", "empty": "fewer than the", "pickled": "fewer than the",
                "zeroed": "changed since the checkpoint was saved", "garbage": "changed since the checkpoint was saved"}
    assert expected[kind] in error.problem, error


@pytest.mark.parametrize("data, words", [(b"{not json\n", "line 1 is not valid JSON"), (b"\xff\xfe\n", "line 1 is not UTF-8"),
                                         (b'{"step": 1}', "hold 0 whole lines, not the 1 rows")])
def test_a_damaged_history_file_is_named_by_its_parser(resumer, copy, data, words):
    rewrite_history(copy, data)
    if not data.endswith(b"\n"):
        edit_metadata(copy, lambda m: m["history"].__setitem__("rows", 1))
    seal(copy)
    error = refused(resumer, copy)
    assert error.file == history_label(copy) and words in error.problem, error


def test_a_history_file_that_is_a_link_is_refused(resumer, copy, tmp_path):
    other = tmp_path / "other-run.jsonl"
    shutil.copyfile(history_file(copy), other)
    history_file(copy).unlink()
    history_file(copy).symlink_to(other)
    error = refused(resumer, copy)
    assert error.file == history_label(copy) and "symbolic link" in error.problem and str(other) in error.problem


# ----- semantic damage (re-sealed) -------------------------------------------------------------------
def edit_metadata(path: Path, change: Callable[[dict], None]) -> None:
    metadata = json.loads((path / "metadata.json").read_text())
    change(metadata)
    (path / "metadata.json").write_text(json.dumps(metadata))


def edit_state(path: Path, change: Callable[[dict], None]) -> None:
    state = torch.load(path / "state.pt", weights_only=True)
    change(state)
    torch.save(state, path / "state.pt")


def both_progress(field: str, value) -> Callable[[Path], None]:
    """The same progress field changed in metadata.json and state.pt (so only the value is wrong)."""
    def change(path: Path) -> None:
        edit_metadata(path, lambda m: m["state"].__setitem__(field, value))
        edit_state(path, lambda s: s["progress"].__setitem__(field, value))
    return change


def nan_weight(path: Path) -> None:
    file = str(path / "models" / "agent_0.safetensors")
    with safe_open(file, framework="pt") as handle:
        aliases = handle.metadata()
    tensors = load_file(file)
    tensors["model.norm.weight"][0] = float("nan")
    save_file(tensors, file, metadata=aliases)


def extra_model_file(path: Path) -> None:
    shutil.copy(path / "models" / "agent_0.safetensors", path / "models" / "agent_2.safetensors")


def rows_renumbered(path: Path) -> None:
    history = [json.loads(line) for line in history_file(path).read_text().splitlines()]
    history[0]["step"] = 7
    rewrite_history(path, encode_rows(history))


def listed_model_missing(path: Path) -> None:
    edit_metadata(path, lambda m: m["models"].__setitem__("agent_2", m["models"]["agent_0"]))


def shape_changed(path: Path) -> None:
    edit_metadata(path, lambda m: m["models"]["agent_0"]["shapes"].__setitem__("model.norm.weight", [3]))


def set_in(keys: list, value) -> Callable[[dict], None]:
    def change(tree: dict) -> None:
        for key in keys[:-1]:
            tree = tree[key]
        tree[keys[-1]] = value
    return change


HISTORY = "the run's history file"  # (its name holds the run's attempt id)

SEMANTIC: dict[str, tuple[Callable[[Path], None], str, str]] = {
    # name: (damage, file named, words of the problem)
    "boundary is 'five'": (lambda p: edit_metadata(p, set_in(["boundary"], "five")), "metadata.json",
                           'boundary is "five", expected an integer'),
    "no models key": (lambda p: edit_metadata(p, lambda m: m.pop("models")), "metadata.json", "missing key 'models'"),
    "unknown metadata key": (lambda p: edit_metadata(p, set_in(["surprise"], 1)), "metadata.json",
                             "unknown key 'surprise'"),
    "format version 1": (lambda p: edit_metadata(p, set_in(["format_version"], 1)), "metadata.json",
                         "format_version is 1, not this library's format 3 (or the earlier 2)"),
    "format 2 with a history record": (lambda p: edit_metadata(p, set_in(["format_version"], 2)), "metadata.json",
                                       "unknown key 'history'"),
    "no history record": (lambda p: edit_metadata(p, lambda m: m.pop("history")), "metadata.json",
                          "missing key 'history'"),
    "history record outside history/": (lambda p: edit_metadata(p, set_in(["history", "file"], "../x.jsonl")),
                                        "metadata.json", "history.file is '../x.jsonl', expected a file name"),
    "history record of more rows": (lambda p: edit_metadata(p, set_in(["history", "rows"], 2)), HISTORY,
                                    "hold 1 whole lines, not the 2 rows"),
    "another trainer": (lambda p: edit_metadata(p, set_in(["trainer"], "IACTrainer")), "metadata.json",
                        "written by IACTrainer, not MAGRPOTrainer"),
    "compat not an object": (lambda p: edit_metadata(p, set_in(["compat"], [1])), "metadata.json",
                             "compat is list, expected an object"),
    "global_step -7": (both_progress("global_step", -7), "metadata.json",
                       "state.global_step is -7, expected a non-negative integer"),
    "global_step huge": (both_progress("global_step", 10 ** 9), HISTORY,
                         "has 1 rows but metadata.json's state.global_step is 1000000000"),
    "global_step 'abc'": (both_progress("global_step", "abc"), "metadata.json",
                          'state.global_step is "abc", expected a non-negative integer'),
    "boundaries 999": (both_progress("boundaries", 999), "metadata.json", "boundary is 1 but state.boundaries is 999"),
    "boundary and boundaries 999": (lambda p: (both_progress("boundaries", 999)(p),
                                               edit_metadata(p, set_in(["boundary"], 999))),
                                    "metadata.json", "named for boundary 1 but the checkpoint is at boundary 999"),
    "unknown progress field": (lambda p: edit_metadata(p, set_in(["state", "speed"], 3)), "metadata.json",
                               "state has an unknown field 'speed'"),
    "progress field missing": (lambda p: edit_metadata(p, lambda m: m["state"].pop("epoch")), "metadata.json",
                               "state is missing the field 'epoch'"),
    "progress disagrees": (lambda p: edit_state(p, set_in(["progress", "nonfinite_updates"], 2)), "state.pt",
                           "differs from metadata.json's state in ['nonfinite_updates']"),
    "bad lineage id": (lambda p: edit_metadata(p, set_in(["lineage", "attempt"], "../../elsewhere")), "metadata.json",
                       "invalid attempt id '../../elsewhere'"),
    "history is a string": (lambda p: rewrite_history(p, b'"abc"\n'), HISTORY, "expected a list of metric rows"),
    "history renumbered": (rows_renumbered, HISTORY, "row 0 has step 7, expected 1"),
    "NaN weight": (nan_weight, "models/agent_0.safetensors", "holds NaN or infinite values"),
    "listed model missing": (listed_model_missing, "models/agent_2.safetensors", "is missing"),
    "model file not listed": (extra_model_file, "models/agent_2.safetensors", "is not part of a checkpoint"),
    "shape differs from fingerprint": (shape_changed, "models/agent_0.safetensors",
                                       "tensor 'model.norm.weight' has shape [64] but metadata.json records [3]"),
    "inf optimizer state": (lambda p: edit_state(p, lambda s: s["optimizers"]["agent_0"]["optimizer"]["state"][0]
                                                 ["exp_avg"].fill_(float("inf"))), "state.pt",
                            "optimizers.agent_0.optimizer.state.0.exp_avg holds NaN or infinite values"),
    "no optimizers": (lambda p: edit_state(p, lambda s: s.pop("optimizers")), "state.pt", "optimizers is missing"),
    "pending is a string": (lambda p: edit_state(p, set_in(["optimizers", "agent_1", "pending"], "x")), "state.pt",
                            'optimizers.agent_1.pending is "x", expected an integer'),
    "rng of another dtype": (lambda p: edit_state(p, set_in(["rng", "torch"], torch.zeros(3))), "state.pt",
                             "rng.torch is a torch.float32 tensor, expected torch.uint8"),
    "unknown state progress field": (lambda p: edit_state(p, set_in(["progress", "speed"], 3)), "state.pt",
                                     "progress has an unknown field 'speed'"),
    "state is a list": (lambda p: torch.save([1, 2], p / "state.pt"), "state.pt", "holds list, expected a dict"),
    "pickled state": (lambda p: pickled(p / "state.pt"), "state.pt", "holds pickled Python objects"),
}


@pytest.mark.parametrize("case", SEMANTIC)
def test_wrong_contents_are_named(resumer, copy, case):
    damage, file, words = SEMANTIC[case]
    file = history_label(copy) if file == HISTORY else file
    damage(copy)
    seal(copy)
    error = refused(resumer, copy)
    assert error.file == file and words in error.problem, error


def test_progress_beyond_the_planned_epochs(resumer, copy):
    beyond = copy.rename(copy.parent / "checkpoint-5")
    for field in ("epoch", "boundaries"):
        both_progress(field, 5)(beyond)
    edit_metadata(beyond, set_in(["boundary"], 5))
    seal(beyond)
    error = refused(resumer, beyond)
    assert error.file == "metadata.json"
    assert "state.epoch is 5, beyond the run's planned num_train_epochs=1" in error.problem


@pytest.mark.parametrize("where", ["unsealed", "sealed"])
def test_unexpected_file_is_refused(resumer, copy, where):
    (copy / "notes.txt").write_text("hello")
    if where == "sealed":
        seal(copy)
    error = refused(resumer, copy)
    assert error.file == "notes.txt"
    assert ("not listed in manifest.json" if where == "unsealed" else "is not part of a checkpoint") in error.problem


def test_latest_that_is_damaged_is_refused_not_skipped(resumer, copy):
    truncate(copy / "state.pt")
    trainer, _, _ = resumer
    with pytest.raises(CheckpointError, match=r"checkpoint-1', state.pt: has \d+ bytes but \d+ were saved"):
        trainer.train(resume_from_checkpoint="latest", checkpoint_dir=copy.parent)
    assert trainer.state.global_step == 0


def test_metadata_reader_names_the_file(copy):
    (copy / "metadata.json").write_text("{not json")
    seal(copy)
    with pytest.raises(CheckpointError, match=r"checkpoint-1', metadata.json: is not valid JSON"):
        read_checkpoint_metadata(copy)


def test_checkpoint_without_manifest_is_accepted_with_a_warning(tiny_llama, copy, caplog):
    """Saved before checkpoints carried a manifest: no manifest.json, no lineage or manifest key."""
    (copy / "manifest.json").unlink()
    edit_metadata(copy, lambda m: (m.pop("lineage"), m.pop("manifest")))
    (copy / "COMPLETE").write_text("ok\n")
    trainer = build(tiny_llama, 2)
    with caplog.at_level(logging.WARNING):
        trainer.train(resume_from_checkpoint=copy)
    assert trainer.state.global_step == 2
    assert "has no manifest.json (saved before checkpoints carried one)" in caplog.text


def test_a_checkpoint_that_says_it_had_a_manifest_needs_it(resumer, copy):
    (copy / "manifest.json").unlink()
    error = refused(resumer, copy)
    assert error.file == "manifest.json" and "is missing (metadata.json says" in error.problem


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finiteness_check_finds_nan_and_inf_and_never_overflows(dtype):
    from comlrl.checkpointing.validate import all_finite

    largest = torch.full((4096,), torch.finfo(dtype).max, dtype=dtype)
    assert all_finite(largest) and all_finite(-largest)  # a float64 sum of finite values stays finite
    for bad in (float("nan"), float("inf"), -float("inf")):
        tensor = torch.randn(64).to(dtype)
        tensor[7] = bad
        assert not all_finite(tensor)


def test_the_error_crosses_processes(resumer, copy):
    """Dask and Prefect workers send errors back pickled: the checkpoint, file and problem survive."""
    (copy / "state.pt").write_text("[]")
    error = pickle.loads(pickle.dumps(refused(resumer, copy)))
    assert isinstance(error, CheckpointError) and (error.checkpoint, error.file) == (str(copy), "state.pt")
    assert "has 2 bytes but" in str(error)


# ----- confinement: a checkpoint's files are its own (issue 26, case 6) --------------------------------
def test_a_weights_file_linked_to_another_runs_is_refused(resumer, copy, saved, tmp_path):
    other = tmp_path / "other-run.safetensors"
    shutil.copyfile(saved / "models" / "agent_0.safetensors", other)
    (copy / "models" / "agent_0.safetensors").unlink()
    (copy / "models" / "agent_0.safetensors").symlink_to(other)
    seal(copy)  # even resealed, as an attacker or a careless script would
    error = refused(resumer, copy)
    assert error.file == "models/agent_0.safetensors" and "symbolic link" in error.problem and str(other) in error.problem


def test_a_checkpoint_that_is_a_link_is_refused(resumer, saved, tmp_path):
    link = tmp_path / "checkpoint-1"
    link.symlink_to(saved)
    error = refused(resumer, link)
    assert error.file is None and "symbolic link" in error.problem


def test_weights_in_another_dtype_are_refused(resumer, copy):
    file = copy / "models" / "agent_0.safetensors"
    weights = load_file(str(file))
    save_file({name: tensor.half() for name, tensor in weights.items()}, str(file))
    seal(copy)
    error = refused(resumer, copy)
    assert error.file == "models/agent_0.safetensors" and "is float16 but metadata.json records float32" in error.problem


def test_a_run_loaded_in_another_dtype_is_refused(tiny_llama, saved):
    trainer = MAGRPOTrainer(agent_model=tiny_llama, num_agents=2, train_dataset=Dataset.from_dict({"prompt": ["a b", "c d"]}),
                            reward_func=lambda a, b: [1.0] * len(a), model_config={"dtype": "bfloat16"},
                            args=MAGRPOConfig(num_agents=2, num_generations=2, max_new_tokens=4, num_train_epochs=2,
                                              per_device_train_batch_size=2, seed=3, disable_tqdm=True))
    with pytest.raises(CheckpointError, match="is bfloat16 here but float32 in the checkpoint"):
        trainer.train(resume_from_checkpoint=saved)
    assert trainer.state.global_step == 0


def test_state_without_its_rng_entry_is_refused(resumer, copy):
    state = torch.load(copy / "state.pt", weights_only=True)
    del state["rng"]
    torch.save(state, copy / "state.pt")
    seal(copy)
    error = refused(resumer, copy)
    assert error.file == "state.pt" and "has no 'rng'" in error.problem


def test_an_archive_folder_that_is_a_link_is_refused(tiny_llama, tmp_path):
    run = tmp_path / "run"
    build(tiny_llama, 2).train(checkpoint_dir=run)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "abandoned").symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match="abandoned.*symbolic link"):
        build(tiny_llama, 2).train(checkpoint_dir=run, resume_from_checkpoint=run / "checkpoint-1")
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert not list(elsewhere.iterdir())
