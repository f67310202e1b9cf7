"""A checkpoint's seal (comlrl/checkpointing/manifest.py) read back by a resume: every way a manifest or a
file can be wrong is refused as a CheckpointError that names the checkpoint, the file and the problem in
these words, checked on real files."""

from __future__ import annotations

import hashlib
import json

import pytest

from comlrl.checkpointing.manifest import (COMPLETE_MARKER, MANIFEST_FILE, read_manifest, seal, sha256_file,
                                           verify)
from comlrl.errors import CheckpointError

BIG = bytes(range(256)) * 5000  # 1.28 MB: more than one read chunk


@pytest.fixture
def checkpoint(tmp_path):
    directory = tmp_path / "checkpoint-1-step4"
    (directory / "agent_0").mkdir(parents=True)
    (directory / "agent_0" / "weights.bin").write_bytes(BIG)
    (directory / "state.json").write_text('{"step": 4}')
    seal(directory)
    return directory


def refusal(directory, *, file, problem):
    with pytest.raises(CheckpointError) as error:
        verify(directory)
    assert (error.value.checkpoint, error.value.file) == (str(directory), file)
    assert error.value.problem == problem, error.value.problem
    return error.value


def rewrite(directory, manifest):
    """A manifest written by hand, with a COMPLETE that matches it (so only its content is wrong)."""
    text = json.dumps(manifest)
    (directory / MANIFEST_FILE).write_text(text)
    (directory / COMPLETE_MARKER).write_text(hashlib.sha256(text.encode()).hexdigest() + "\n")


def test_the_seal_lists_every_file_with_its_size_and_sha256(checkpoint):
    assert sha256_file(checkpoint / "agent_0" / "weights.bin") == hashlib.sha256(BIG).hexdigest()
    assert read_manifest(checkpoint) == {
        "agent_0/weights.bin": {"size": len(BIG), "sha256": hashlib.sha256(BIG).hexdigest()},
        "state.json": {"size": 11, "sha256": hashlib.sha256(b'{"step": 4}').hexdigest()},
    }
    recorded = (checkpoint / COMPLETE_MARKER).read_text()
    assert recorded == hashlib.sha256((checkpoint / MANIFEST_FILE).read_bytes()).hexdigest() + "\n"
    verify(checkpoint)


def test_a_file_missing_changed_truncated_or_added_is_named(checkpoint):
    (checkpoint / "notes.txt").write_text("added later")
    refusal(checkpoint, file="notes.txt",
            problem="is not listed in manifest.json: it was added or renamed after the checkpoint was saved")
    (checkpoint / "notes.txt").unlink()
    (checkpoint / "state.json").write_text('{"step": 5}')  # same size, other bytes
    refusal(checkpoint, file="state.json", problem="its contents changed since the save (sha256 differs from "
                                                   "manifest.json)")
    (checkpoint / "state.json").write_text('{"step": 4')
    refusal(checkpoint, file="state.json", problem="has 10 bytes but 11 were saved (truncated or overwritten)")
    (checkpoint / "state.json").unlink()
    error = refusal(checkpoint, file="state.json", problem="is missing (listed in manifest.json)")
    assert str(error) == f"checkpoint {str(checkpoint)!r}, state.json: is missing (listed in manifest.json)"


def test_a_damaged_manifest_or_marker_is_named(checkpoint):
    (checkpoint / COMPLETE_MARKER).write_text("0" * 64 + "\n")
    refusal(checkpoint, file=MANIFEST_FILE, problem=f"its sha256 is not the one recorded in COMPLETE ({'0' * 64}); "
                                                    "the manifest or COMPLETE is damaged")
    (checkpoint / COMPLETE_MARKER).write_text("half written")
    refusal(checkpoint, file=MANIFEST_FILE, problem="its sha256 is not the one recorded in COMPLETE (12 characters "
                                                    "that are not a sha256); the manifest or COMPLETE is damaged")
    text = "{not json"
    (checkpoint / MANIFEST_FILE).write_text(text)
    (checkpoint / COMPLETE_MARKER).write_text(hashlib.sha256(text.encode()).hexdigest())
    with pytest.raises(CheckpointError) as error:
        verify(checkpoint)
    assert (error.value.checkpoint, error.value.file) == (str(checkpoint), MANIFEST_FILE)
    assert error.value.problem.startswith("is not valid JSON (Expecting property name")


SHA = "a" * 64
VERSION_PROBLEM = 'is not a version-1 manifest ({"version": 1, "files": {path: {"size", "sha256"}}})'


@pytest.mark.parametrize("manifest", [
    [1, 2],                                          # not an object
    {"version": 2, "files": {}},                     # another version
    {"version": 1, "files": []},                     # files not a table
    {"version": 1},                                  # no files
])
def test_a_manifest_of_another_shape_is_refused(checkpoint, manifest):
    rewrite(checkpoint, manifest)
    refusal(checkpoint, file=MANIFEST_FILE, problem=VERSION_PROBLEM)


@pytest.mark.parametrize("name, entry", [
    ("state.json", {"size": True, "sha256": SHA}),          # a bool is not a size
    ("state.json", {"size": "11", "sha256": SHA}),
    ("state.json", {"size": 11, "sha256": 7}),
    ("state.json", {"size": 11, "sha256": "A" * 64}),       # not a lowercase hex digest
    ("state.json", {"size": 11}),
    ("state.json", [11, SHA]),
    ("/etc/passwd", {"size": 11, "sha256": SHA}),           # outside the checkpoint
    ("agent_0/../../x", {"size": 11, "sha256": SHA}),
])
def test_a_malformed_entry_is_refused_before_any_file_is_read(checkpoint, name, entry):
    rewrite(checkpoint, {"version": 1, "files": {name: entry}})
    refusal(checkpoint, file=MANIFEST_FILE, problem=f"has a malformed entry for {name!r}: {entry!r}")
