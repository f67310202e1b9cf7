"""Checkpoint directories on disk (comlrl/checkpointing/io.py), checked on real files: which directories
are checkpoints and in what order, what a save writes and what it leaves when a write fails, what a load
refuses (in these words), and which checkpoints a limit keeps."""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from comlrl.checkpointing import io
from comlrl.checkpointing.manifest import COMPLETE_MARKER, MANIFEST_FILE, seal, verify
from comlrl.errors import CheckpointError, CheckpointNotFoundError, CheckpointWriteError
from file_limits import file_size_limit


def finished(path: Path, metadata: dict | None = None) -> Path:
    """A directory that holds what a finished save leaves: metadata.json and COMPLETE (sealed)."""
    path.mkdir(parents=True)
    (path / io.METADATA_FILE).write_text(json.dumps(metadata if metadata is not None else {"boundary": path.name}))
    seal(path)
    return path


def refusal(call, *args) -> CheckpointError:
    with pytest.raises(CheckpointError) as error:
        call(*args)
    return error.value


def linear(seed: int, shape=(8, 8)) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(*shape)


def entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


# ----- names, order, latest --------------------------------------------------------------------------
def test_checkpoints_are_ordered_by_boundary_then_step_and_only_finished_ones_count(tmp_path):
    for name in ["checkpoint-10", "checkpoint-9", "checkpoint-2-step5", "checkpoint-2", "checkpoint-3",
                 "checkpoint-2-step11"]:
        finished(tmp_path / name)
    for name in ["checkpoint-x", "checkpoint-4-stepx", "checkpoint-4-step3-b", "xcheckpoint-4", "checkpoint-",
                 ".checkpoint-12.tmp-1-x", ".checkpoint-12.old-1"]:
        finished(tmp_path / name)  # finished, but not named as a checkpoint
    (tmp_path / "checkpoint-11").mkdir()
    (tmp_path / "checkpoint-11" / COMPLETE_MARKER).write_text("0" * 64)  # no metadata.json
    (tmp_path / "checkpoint-12").mkdir()
    (tmp_path / "checkpoint-12" / io.METADATA_FILE).write_text("{}")  # no COMPLETE: its save was cut short
    (tmp_path / "checkpoint-13").write_text("a file, not a directory")

    expected = ["checkpoint-2", "checkpoint-2-step5", "checkpoint-2-step11", "checkpoint-3", "checkpoint-9",
                "checkpoint-10"]  # 10 after 9 (numbers, not text); a stop after boundary 2 before boundary 3
    assert [p.name for p in io.list_checkpoints(tmp_path)] == expected
    assert [p.name for p in io.list_checkpoints(str(tmp_path))] == expected
    assert io.latest_checkpoint(tmp_path) == tmp_path / "checkpoint-10"
    assert io.latest_checkpoint(str(tmp_path)) == tmp_path / "checkpoint-10"

    assert io.checkpoint_order(Path("checkpoint-2")) == (2, -1)
    assert io.checkpoint_order(Path("/runs/x/checkpoint-2-step11")) == (2, 11)
    assert io.checkpoint_order(Path("checkpoint-0-step0")) == (0, 0)
    for name in ["checkpoint-x", "checkpoint-4-stepx", "checkpoint-4-step3-b", "xcheckpoint-4", "checkpoint-",
                 ".checkpoint-12.tmp-1-x", "checkpoint-4-step"]:
        assert io.checkpoint_order(Path(name)) is None, name
        assert io.checkpoint_number(Path(name)) is None, name
    assert io.checkpoint_number(Path("checkpoint-7-step40")) == 7
    assert io.checkpoint_number(Path("checkpoint-7")) == 7


def test_no_directory_or_no_checkpoint_is_no_latest(tmp_path):
    assert io.list_checkpoints(tmp_path / "missing") == []
    assert io.latest_checkpoint(tmp_path / "missing") is None
    (tmp_path / "a-file").write_text("x")
    assert io.list_checkpoints(tmp_path / "a-file") == []
    (tmp_path / "checkpoint-1").mkdir()  # a save killed before its metadata
    assert io.list_checkpoints(tmp_path) == [] and io.latest_checkpoint(tmp_path) is None


def test_a_checkpoint_is_complete_with_both_its_marker_and_its_metadata(tmp_path):
    path = finished(tmp_path / "checkpoint-1")
    assert io.is_complete(path)
    (path / COMPLETE_MARKER).unlink()
    (path / COMPLETE_MARKER).mkdir()  # a directory named COMPLETE is no marker
    assert not io.is_complete(path)
    other = finished(tmp_path / "checkpoint-2")
    (other / io.METADATA_FILE).unlink()
    assert not io.is_complete(other)
    assert io.weights_file("agent_0") == "models/agent_0.safetensors"


# ----- reading -----------------------------------------------------------------------------------------
def test_a_checkpoint_that_is_missing_unfinished_or_without_metadata_is_refused_in_words(tmp_path):
    error = refusal(io.require_present, tmp_path / "checkpoint-1")
    assert isinstance(error, CheckpointNotFoundError)
    assert (error.checkpoint, error.file, error.problem) == (str(tmp_path / "checkpoint-1"), None, "does not exist")
    (tmp_path / "checkpoint-1").mkdir()
    (tmp_path / "checkpoint-1" / io.METADATA_FILE).write_text("{}")
    error = refusal(io.require_present, tmp_path / "checkpoint-1")
    assert not isinstance(error, CheckpointNotFoundError) and error.file is None
    assert error.problem == ("is incomplete (no COMPLETE marker: its save was interrupted); it cannot be loaded")
    (tmp_path / "checkpoint-1" / io.METADATA_FILE).unlink()
    (tmp_path / "checkpoint-1" / COMPLETE_MARKER).write_text("x")
    error = refusal(io.require_present, tmp_path / "checkpoint-1")
    assert (error.file, error.problem) == (io.METADATA_FILE, "is missing")
    io.require_present(finished(tmp_path / "checkpoint-2"))  # a finished one passes


def test_metadata_is_read_back_and_each_way_it_is_wrong_is_named(tmp_path):
    saved = {"boundary": 3, "state": {"global_step": 12}, "note": "é"}
    path = finished(tmp_path / "checkpoint-3", saved)
    assert io.read_metadata(path) == saved
    assert io.read_metadata(str(path)) == saved

    (path / io.METADATA_FILE).write_text(json.dumps({"boundary": 4, "state": {"global_step": 12}, "note": "é"}))
    error = refusal(io.read_metadata, path)  # changed after the seal: the manifest names it
    assert (error.checkpoint, error.file) == (str(path), io.METADATA_FILE)
    assert error.problem.startswith("its contents changed since the save"), error.problem

    for name, data, problem in [
        ("list", b"[1, 2]", "holds a JSON list, not an object"),
        ("text", b'"boundary"', "holds a JSON str, not an object"),
    ]:
        other = tmp_path / name
        other.mkdir()
        (other / io.METADATA_FILE).write_bytes(data)
        (other / COMPLETE_MARKER).write_text("x")  # unsealed (an older save): read without a manifest
        error = refusal(io.read_metadata, other)
        assert (error.file, error.problem) == (io.METADATA_FILE, problem)

    unsealed = tmp_path / "unsealed"
    unsealed.mkdir()
    (unsealed / COMPLETE_MARKER).write_text("x")
    (unsealed / io.METADATA_FILE).write_bytes(b"\xff\xfe{}")
    error = refusal(io.read_metadata, unsealed)
    assert error.file == io.METADATA_FILE
    assert error.problem.startswith("is not UTF-8 text (") and "0xff" in error.problem, error.problem
    (unsealed / io.METADATA_FILE).write_text('{"boundary": 3,')
    error = refusal(io.read_metadata, unsealed)
    assert error.problem.startswith("is not valid JSON (Expecting property name"), error.problem
    error = refusal(io.read_json, unsealed, "other.json")
    assert (error.checkpoint, error.file, error.problem) == (str(unsealed), "other.json", "is missing")


class Payload:
    """A pickled object that would create ``marker`` if it were ever unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_pt_file_gives_back_tensors_and_plain_values_and_never_runs_a_pickled_object(tmp_path):
    state = {"step": 3, "rates": [0.5, 0.25], "name": "adamw", "moments": torch.arange(6.0).reshape(2, 3),
             "rng": torch.tensor([1, 2], dtype=torch.uint8), "nested": {"flag": True, "none": None}}
    torch.save(state, tmp_path / "state.pt")
    loaded = io.load_pt(tmp_path / "state.pt")
    torch.testing.assert_close(loaded.pop("moments"), state["moments"], rtol=0, atol=0)
    torch.testing.assert_close(loaded.pop("rng"), state["rng"], rtol=0, atol=0)
    assert loaded == {key: value for key, value in state.items() if key not in ("moments", "rng")}

    marker = tmp_path / "ran"
    torch.save({"step": 3, "payload": Payload(marker)}, tmp_path / "evil.pt")
    error = refusal(io.load_pt, tmp_path / "evil.pt")
    assert not marker.exists()
    assert (error.checkpoint, error.file) == (str(tmp_path), "evil.pt")
    assert error.problem == ("holds pickled Python objects, which are never loaded (only tensors and plain values "
                             "are): UnpicklingError: Trying to load unsupported GLOBAL posix.system whose module "
                             "posix is blocked.")

    (tmp_path / "junk.pt").write_bytes(b"not a torch file at all")
    error = refusal(io.load_pt, str(tmp_path / "junk.pt"))
    assert (error.file, error.problem) == ("junk.pt", "is not a readable torch file (UnpicklingError: Unsupported "
                                                      "operand 110)")
    (tmp_path / "empty.pt").write_bytes(b"")  # torch's error has no words: its type alone
    assert refusal(io.load_pt, tmp_path / "empty.pt").problem == "is not a readable torch file (EOFError: )"
    error = refusal(io.load_pt, tmp_path / "gone.pt")
    assert (error.checkpoint, error.file, error.problem) == (str(tmp_path), "gone.pt", "is missing")


def test_state_saved_on_a_gpu_loads_on_the_cpu(tmp_path, monkeypatch):
    """A checkpoint written by a GPU run resumes on a machine without one: the file below records its tensors as
    CUDA storages (as torch.save writes them on a GPU) and is loaded onto the CPU."""
    import torch.serialization

    with monkeypatch.context() as patch:
        patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save({"exp_avg": torch.arange(3.0)}, tmp_path / "state.pt")
    loaded = io.load_pt(tmp_path / "state.pt")
    assert loaded["exp_avg"].device.type == "cpu"
    torch.testing.assert_close(loaded["exp_avg"], torch.arange(3.0), rtol=0, atol=0)


def test_a_pickled_object_is_refused_even_where_the_environment_turns_torchs_default_off(tmp_path, monkeypatch):
    """``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` makes torch.load unpickle anything when ``weights_only`` is not passed;
    the library passes it, so the payload never runs."""
    marker = tmp_path / "ran"
    torch.save({"payload": Payload(marker)}, tmp_path / "evil.pt")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    error = refusal(io.load_pt, tmp_path / "evil.pt")
    assert not marker.exists() and error.problem.startswith("holds pickled Python objects"), error.problem


def test_a_pickled_object_of_an_importable_module_is_named_without_torchs_advice_to_trust_it(tmp_path, monkeypatch):
    """torch's message for a class it could import numbers two options, the first "Re-running torch.load with
    weights_only set to False will likely succeed": the refusal gives the line that names the object instead
    (its first 200 characters)."""
    torch.save({"args": argparse.Namespace(lr=0.1)}, tmp_path / "namespace.pt")
    error = refusal(io.load_pt, tmp_path / "namespace.pt")
    line = ("WeightsUnpickler error: Unsupported global: GLOBAL argparse.Namespace was not an allowed global by "
            "default. Please use `torch.serialization.add_safe_globals([argparse.Namespace])` or the "
            "`torch.serialization.safe_globals([argparse.Namespace])` context manager to allowlist this global if "
            "you trust this class/function.")
    assert error.problem == ("holds pickled Python objects, which are never loaded (only tensors and plain values "
                             f"are): UnpicklingError: {line[:200]}")
    assert "weights_only" not in error.problem

    module_name = "a_module_with_a_name_long_enough_to_need_cutting_" * 5  # 250 characters
    module = types.ModuleType(module_name)

    def run(command):  # never called: only its name is pickled
        raise AssertionError(command)

    run.__module__, run.__qualname__ = module_name, "run"
    module.run = run
    monkeypatch.setitem(sys.modules, module_name, module)

    class Call:
        def __reduce__(self):
            return run, ("x",)

    torch.save([Call()], tmp_path / "long.pt")
    error = refusal(io.load_pt, tmp_path / "long.pt")
    line = f"WeightsUnpickler error: Unsupported global: GLOBAL {module_name}.run was not an allowed global"
    assert error.problem == ("holds pickled Python objects, which are never loaded (only tensors and plain values "
                             f"are): UnpicklingError: {line[:200]}")


# ----- what a save writes ------------------------------------------------------------------------------
def save(root: Path, name: str, modules: dict, state: dict | None = None, metadata: dict | None = None) -> Path:
    return io.write_checkpoint(root, name, modules, state if state is not None else {"progress": {"step": 1}},
                               metadata if metadata is not None else {"boundary": 1, "manifest": True})


def test_a_save_writes_the_layout_sealed_and_its_weights_and_state_load_back(tmp_path):
    agent, gathered = linear(0), {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2)}
    state = {"progress": {"step": 4, "history": None}, "optimizer": {"exp_avg": torch.full((3,), 0.5)}}
    metadata = {"boundary": 2, "trainer": "MAGRPOTrainer", "models": {"agent": {}, "head": {}}}
    path = io.write_checkpoint(tmp_path / "run", "checkpoint-2", {"agent": agent, "head": gathered}, state, metadata)

    assert path == tmp_path / "run" / "checkpoint-2"
    assert entries(tmp_path / "run") == ["checkpoint-2"]  # no staging directory left beside it
    assert entries(path) == [COMPLETE_MARKER, MANIFEST_FILE, io.METADATA_FILE, io.MODELS_DIR, io.STATE_FILE]
    assert entries(path / io.MODELS_DIR) == ["agent.safetensors", "head.safetensors"]
    verify(path)
    assert io.read_metadata(path) == metadata
    assert (path / io.METADATA_FILE).read_text() == json.dumps(metadata, indent=2, sort_keys=True)
    loaded = io.load_pt(path / io.STATE_FILE)
    assert loaded["progress"] == state["progress"]
    torch.testing.assert_close(loaded["optimizer"]["exp_avg"], state["optimizer"]["exp_avg"], rtol=0, atol=0)

    fresh = linear(1)
    assert not torch.equal(fresh.weight, agent.weight)
    head = torch.nn.Module()
    head.w, head.b = torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(2))
    io.load_modules(path, {"agent": fresh, "head": head})
    torch.testing.assert_close(fresh.weight, agent.weight, rtol=0, atol=0)
    torch.testing.assert_close(fresh.bias, agent.bias, rtol=0, atol=0)
    torch.testing.assert_close(head.w.detach(), gathered["w"], rtol=0, atol=0)
    torch.testing.assert_close(head.b.detach(), gathered["b"], rtol=0, atol=0)


def test_gathered_weights_store_a_tied_tensor_once_and_any_layout(tmp_path):
    shared = torch.arange(12.0).reshape(3, 4)
    transposed = torch.arange(6.0).reshape(2, 3).t()  # not contiguous
    gathered = {"wte.weight": shared, "lm_head.weight": shared, "proj.weight": transposed}
    path = save(tmp_path, "checkpoint-1", {"model": gathered})
    with safe_open(str(path / io.weights_file("model")), framework="pt") as handle:
        assert sorted(handle.keys()) == ["lm_head.weight", "proj.weight"]  # the first of the tied names, sorted
        assert handle.metadata() == {"wte.weight": "lm_head.weight"}
        torch.testing.assert_close(handle.get_tensor("lm_head.weight"), shared, rtol=0, atol=0)
        torch.testing.assert_close(handle.get_tensor("proj.weight"), transposed, rtol=0, atol=0)

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.lm_head, self.proj = torch.nn.Linear(4, 3, bias=False), torch.nn.Linear(4, 3, bias=False), \
                torch.nn.Linear(2, 3, bias=False)
            self.lm_head.weight = self.wte.weight

    model = Tied()
    io.load_modules(path, {"model": model})
    torch.testing.assert_close(model.wte.weight.detach(), shared, rtol=0, atol=0)
    torch.testing.assert_close(model.lm_head.weight.detach(), shared, rtol=0, atol=0)
    torch.testing.assert_close(model.proj.weight.detach(), transposed, rtol=0, atol=0)

    untied = save(tmp_path, "checkpoint-2", {"model": {"a": torch.ones(2), "b": torch.ones(2)}})
    with safe_open(str(untied / io.weights_file("model")), framework="pt") as handle:
        assert sorted(handle.keys()) == ["a", "b"] and handle.metadata() is None


def test_weights_that_are_missing_or_do_not_fit_are_named(tmp_path):
    path = save(tmp_path, "checkpoint-1", {"agent": linear(0)})
    error = refusal(io.load_modules, path, {"agent": linear(1), "critic": linear(2)})
    assert (error.checkpoint, error.file) == (str(path), "models/critic.safetensors")
    assert error.problem == "is missing: the checkpoint has no weights for 'critic'"
    error = refusal(io.load_modules, path, {"agent": linear(1, shape=(8, 4))})
    assert (error.checkpoint, error.file) == (str(path), "models/agent.safetensors")
    assert error.problem.startswith("the weights for 'agent' do not fit the model: ") and "size mismatch" in \
        error.problem, error.problem
    extra = torch.nn.Sequential(linear(1), linear(2))
    error = refusal(io.load_modules, path, {"agent": extra})  # strict: every tensor must be there
    assert error.problem.startswith("the weights for 'agent' do not fit the model: "), error.problem


def test_saving_a_boundary_again_replaces_it_and_leaves_nothing_else(tmp_path):
    first = save(tmp_path, "checkpoint-1", {"agent": linear(0)}, metadata={"boundary": 1, "save": "first"})
    (tmp_path / "checkpoint-0").mkdir()  # untouched neighbours
    again = save(tmp_path, "checkpoint-1", {"agent": linear(1)}, metadata={"boundary": 1, "save": "second"})
    assert again == first and entries(tmp_path) == ["checkpoint-0", "checkpoint-1"]  # no .old, no staging
    assert io.read_metadata(again)["save"] == "second"
    verify(again)
    model = linear(2)
    io.load_modules(again, {"agent": model})
    torch.testing.assert_close(model.weight, linear(1).weight, rtol=0, atol=0)


def test_install_puts_the_old_checkpoint_back_when_the_rename_fails(tmp_path):
    final = finished(tmp_path / "checkpoint-1", {"boundary": "old"})
    with pytest.raises(FileNotFoundError):
        io.install(tmp_path / ".checkpoint-1.tmp-gone", final)  # the staging directory is not there
    assert entries(tmp_path) == ["checkpoint-1"]
    assert io.read_metadata(final) == {"boundary": "old"}

    staging = finished(tmp_path / ".checkpoint-2.tmp-1-a", {"boundary": "new"})
    io.install(staging, tmp_path / "checkpoint-2")  # no checkpoint-2 yet: a plain rename
    assert entries(tmp_path) == ["checkpoint-1", "checkpoint-2"]
    assert io.read_metadata(tmp_path / "checkpoint-2") == {"boundary": "new"}
    staging = finished(tmp_path / ".checkpoint-2.tmp-1-b", {"boundary": "newer"})
    io.install(staging, tmp_path / "checkpoint-2")
    assert entries(tmp_path) == ["checkpoint-1", "checkpoint-2"]
    assert io.read_metadata(tmp_path / "checkpoint-2") == {"boundary": "newer"}
    assert io.staging_prefix("checkpoint-2") == f".checkpoint-2.tmp-{os.getpid()}-"


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names a descriptor's file through /proc (Linux)")
def test_a_save_fsyncs_every_file_and_folder_before_the_rename_then_the_rename(tmp_path, monkeypatch):
    """What a power loss would otherwise lose: every byte and every directory entry of a save is fsync'd before
    the checkpoint is renamed into place, and the rename after (observed on the real calls, which still run)."""
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    path = save(tmp_path / "run", "checkpoint-1", {"agent": linear(0), "critic": linear(1)})
    monkeypatch.undo()
    assert synced[-1] == str(tmp_path / "run")  # last: the directory that holds checkpoint-1 (the rename)
    [staging] = {Path(p).parent for p in synced if Path(p).name == COMPLETE_MARKER}
    assert staging.parent == tmp_path / "run" and staging.name.startswith(f".checkpoint-1.tmp-{os.getpid()}-")
    before_rename = {Path(p).relative_to(staging).as_posix() for p in synced[:-1]
                     if Path(p) == staging or staging in Path(p).parents}
    written = {p.relative_to(path).as_posix() for p in path.rglob("*")}
    assert before_rename == written | {"."}, (before_rename, written)  # every file and folder, and itself
    io.fsync_path(tmp_path / "not-there")  # nothing to sync: no error


# ----- a failed save ------------------------------------------------------------------------------------
def test_a_save_that_cannot_write_its_weights_leaves_the_older_checkpoints_and_no_staging(tmp_path):
    kept = save(tmp_path, "checkpoint-1", {"agent": linear(0)})
    big = linear(1, shape=(64, 64))  # 16 KB of weights
    with file_size_limit(4096), pytest.raises(CheckpointWriteError) as error:
        save(tmp_path, "checkpoint-2", {"agent": big})
    assert (error.value.checkpoint, error.value.file) == (str(tmp_path / "checkpoint-2"), "models/agent.safetensors")
    assert error.value.cause.startswith("file too large: the process's file-size limit (ulimit -f) is 4.0 KB"), \
        error.value.cause
    assert entries(tmp_path) == ["checkpoint-1"]
    verify(kept)


def test_a_save_that_cannot_write_its_state_or_metadata_names_that_file(tmp_path):
    small = {"agent": linear(0, shape=(2, 2))}
    with file_size_limit(32768), pytest.raises(CheckpointWriteError) as error:
        save(tmp_path, "checkpoint-1", small, state={"moments": torch.zeros(32768)})  # 128 KB
    assert error.value.file == io.STATE_FILE and error.value.cause.startswith("file too large"), error.value.cause
    with file_size_limit(32768), pytest.raises(CheckpointWriteError) as error:
        save(tmp_path, "checkpoint-1", small, metadata={"config": "x" * 65536})
    assert error.value.file == io.METADATA_FILE and error.value.cause.startswith("file too large"), error.value.cause
    assert entries(tmp_path) == []


def test_a_save_that_cannot_rename_into_place_keeps_the_checkpoint_it_would_replace(tmp_path):
    kept = save(tmp_path, "checkpoint-1", {"agent": linear(0)}, metadata={"boundary": 1, "save": "first"})
    blocker = tmp_path / f".checkpoint-1.old-{os.getpid()}"  # a non-empty directory where the old copy would go
    blocker.mkdir()
    (blocker / "left").write_text("x")
    with pytest.raises(CheckpointWriteError) as error:
        save(tmp_path, "checkpoint-1", {"agent": linear(1)}, metadata={"boundary": 1, "save": "second"})
    assert error.value.file == "the directory (rename into place)"
    assert entries(tmp_path) == [blocker.name, "checkpoint-1"]  # no staging directory left
    assert io.read_metadata(kept)["save"] == "first"


def test_an_error_that_is_not_a_write_failure_is_raised_as_it_is(tmp_path):
    with pytest.raises(TypeError):
        save(tmp_path, "checkpoint-1", {"agent": linear(0)}, metadata={"boundary": object()})  # not JSON
    with pytest.raises(RuntimeError, match="only a test's") as error:
        save(tmp_path, "checkpoint-1", {"agent": linear(0)}, state={"step": Unsaveable()})
    assert not isinstance(error.value, CheckpointWriteError)
    assert entries(tmp_path) == []  # the staging directory was removed either way
    for words in ["[enforce fail at inline_container.cc:672] .", "unexpected pos 4096 vs 4032", "file write failed",
                  "PytorchStreamWriter failed writing file data/0"]:  # each of torch's ways of saying it, alone
        assert io._looks_like_a_write_failure(RuntimeError(words)), words
    assert not io._looks_like_a_write_failure(RuntimeError("only a test's error"))


class Unsaveable:
    def __reduce__(self):
        raise RuntimeError("only a test's error")


# ----- the limit -----------------------------------------------------------------------------------------
def test_a_limit_keeps_the_newest_and_the_resumed_checkpoint(tmp_path):
    for name in ["checkpoint-1", "checkpoint-2", "checkpoint-2-step9", "checkpoint-3", "checkpoint-10"]:
        finished(tmp_path / name)
    (tmp_path / "checkpoint-0").mkdir()  # unfinished: not counted, not deleted
    finished(tmp_path / "abandoned" / "A" / "checkpoint-1")
    io.prune(tmp_path, 2, spare=str(tmp_path / "checkpoint-2"))
    assert entries(tmp_path) == ["abandoned", "checkpoint-0", "checkpoint-10", "checkpoint-2", "checkpoint-3"]
    assert io.read_metadata(tmp_path / "abandoned" / "A" / "checkpoint-1")
    io.prune(tmp_path, 1)
    assert entries(tmp_path) == ["abandoned", "checkpoint-0", "checkpoint-10"]
    io.prune(tmp_path, 1, spare=tmp_path / "checkpoint-10")
    assert entries(tmp_path) == ["abandoned", "checkpoint-0", "checkpoint-10"]


def test_a_checkpoint_that_is_a_link_is_never_followed_by_a_prune_or_a_save(tmp_path):
    """rmtree refuses a link: the directory it points to keeps its files, and neither the limit nor the save
    that replaces the link fails the run."""
    elsewhere = finished(tmp_path / "elsewhere" / "checkpoint-1")
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint-1").symlink_to(elsewhere, target_is_directory=True)
    finished(run / "checkpoint-2")
    io.prune(run, 1)
    assert entries(elsewhere) == [COMPLETE_MARKER, MANIFEST_FILE, io.METADATA_FILE]
    path = save(run, "checkpoint-1", {"agent": linear(0)}, metadata={"boundary": 1, "save": "new"})
    assert not path.is_symlink() and io.read_metadata(path)["save"] == "new"
    assert entries(elsewhere) == [COMPLETE_MARKER, MANIFEST_FILE, io.METADATA_FILE]
