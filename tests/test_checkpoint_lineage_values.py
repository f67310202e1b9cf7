"""The lineage record, the archive of abandoned checkpoints, the directory lock and a failed write's words.

Real directories in ``tmp_path``, real flocks (one held by a child process), real errors; every expected
value is written out here: the record's fields, the archive's destinations and journal, the refusals' words,
the byte counts and the free space (read with ``os.statvfs``, not through the code under test).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import resource
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from comlrl.checkpointing import lineage
from comlrl.checkpointing.lock import DirectoryLock, DirectoryLockedError
from comlrl.checkpointing.write_errors import describe, file_size_limit, tensor_bytes
from comlrl.errors import CheckpointError
import file_limits


class Refused(Exception):
    pass


def refuse(message: str) -> None:
    raise Refused(message)


def make_checkpoint(root: Path, name: str, attempt=None, complete: bool = True, metadata: str | None = None) -> Path:
    """A directory that ``io.list_checkpoints`` takes as complete: COMPLETE and metadata.json (with ``attempt``)."""
    path = root / name
    path.mkdir(parents=True)
    if metadata is None:
        body = {"boundary": 1} if attempt is None else {"lineage": {"attempt": attempt, "ancestors": [],
                                                                    "resumed_from": None}}
        metadata = json.dumps(body)
    (path / "metadata.json").write_text(metadata)
    (path / "marker.txt").write_text(name)  # which checkpoint a moved folder is
    if complete:
        (path / "COMPLETE").write_text("")
    return path


def tree(root: Path) -> dict[str, str]:
    """Every marker file under ``root``: relative folder -> the checkpoint it came from."""
    return {p.parent.relative_to(root).as_posix(): p.read_text() for p in sorted(root.rglob("marker.txt"))}


# ----- the lineage record ---------------------------------------------------------------------------------------


@pytest.fixture
def local_time_not_utc(monkeypatch):
    """The process's local time 5 h 30 min ahead of UTC, so that a local time would show."""
    monkeypatch.setenv("TZ", "IST-5:30")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_a_new_attempt_id_is_the_utc_start_and_eight_hex_digits(local_time_not_utc):
    assert time.localtime().tm_gmtoff == 5 * 3600 + 30 * 60
    before = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    first, second = lineage.new_attempt(), lineage.new_attempt()
    after = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for attempt in (first, second):
        assert re.fullmatch(r"\d{8}T\d{6}Z-[0-9a-f]{8}", attempt), attempt
        assert before <= attempt[:16] <= after
        lineage.check_record({"attempt": attempt, "ancestors": [], "resumed_from": None}, refuse)
    assert first != second


def test_the_record_of_a_fresh_run_a_resume_and_a_resume_of_an_unrecorded_checkpoint():
    assert lineage.record("b2", None, None) == {"attempt": "b2", "ancestors": [], "resumed_from": None}
    parent = {"attempt": "a1", "ancestors": ["z0", "y9"], "resumed_from": "checkpoint-1"}
    assert lineage.record("b2", Path("/runs/x/checkpoint-3-step7"), parent) == {
        "attempt": "b2", "ancestors": ["z0", "y9", "a1"], "resumed_from": "checkpoint-3-step7"}
    assert parent["ancestors"] == ["z0", "y9"]  # the parent's record is not changed
    assert lineage.record("b2", Path("/runs/x/checkpoint-2"), None) == {
        "attempt": "b2", "ancestors": [], "resumed_from": "checkpoint-2"}


@pytest.mark.parametrize("record", [
    {"attempt": "a", "ancestors": [], "resumed_from": None},
    {"attempt": "A0_-b", "ancestors": ["x", "Y-1", "z_2"], "resumed_from": "checkpoint-1"},
    {"attempt": "9" + "a" * 63, "ancestors": [], "resumed_from": "anything"},
])
def test_valid_lineage_records_pass(record):
    lineage.check_record(record, refuse)


@pytest.mark.parametrize("record, words", [
    ([1, 2], "lineage must be an object with exactly attempt, ancestors and resumed_from, got [1, 2]"),
    ({"attempt": "a", "ancestors": []},
     "lineage must be an object with exactly attempt, ancestors and resumed_from, got {'attempt': 'a', 'ancestors': []}"),
    ({"attempt": "a", "ancestors": [], "resumed_from": None, "x": 1},
     "lineage must be an object with exactly attempt, ancestors and resumed_from, got "
     "{'attempt': 'a', 'ancestors': [], 'resumed_from': None, 'x': 1}"),
    ({"attempt": "a/b", "ancestors": [], "resumed_from": None},
     "lineage holds an invalid attempt id 'a/b' (letters, digits, '-' and '_')"),
    ({"attempt": "", "ancestors": [], "resumed_from": None},
     "lineage holds an invalid attempt id '' (letters, digits, '-' and '_')"),
    ({"attempt": "-a", "ancestors": [], "resumed_from": None},
     "lineage holds an invalid attempt id '-a' (letters, digits, '-' and '_')"),
    ({"attempt": "a\n", "ancestors": [], "resumed_from": None},
     "lineage holds an invalid attempt id 'a\\n' (letters, digits, '-' and '_')"),
    ({"attempt": "a" * 65, "ancestors": [], "resumed_from": None},
     f"lineage holds an invalid attempt id '{'a' * 65}' (letters, digits, '-' and '_')"),
    ({"attempt": 7, "ancestors": [], "resumed_from": None},
     "lineage holds an invalid attempt id 7 (letters, digits, '-' and '_')"),
    ({"attempt": "a", "ancestors": "b", "resumed_from": None},
     "lineage holds an invalid attempt id None (letters, digits, '-' and '_')"),
    ({"attempt": "a", "ancestors": ["b", ".."], "resumed_from": None},
     "lineage holds an invalid attempt id '..' (letters, digits, '-' and '_')"),
    ({"attempt": "a", "ancestors": [], "resumed_from": 3},
     "lineage.resumed_from is 3, expected a checkpoint name or null"),
])
def test_each_invalid_lineage_record_is_refused_in_its_words(record, words):
    with pytest.raises(Refused) as refusal:
        lineage.check_record(record, refuse)
    assert str(refusal.value) == words


def test_a_long_lineage_refusal_is_cut_at_300_characters():
    record = {"attempt": "a", "ancestors": [], "resumed_from": None, "extra": "x" * 500}
    with pytest.raises(Refused) as refusal:
        lineage.check_record(record, refuse)
    whole = f"lineage must be an object with exactly attempt, ancestors and resumed_from, got {record!r}"
    assert str(refusal.value) == whole[:300] and len(str(refusal.value)) == 300


@pytest.mark.parametrize("metadata, attempt", [
    (json.dumps({"lineage": {"attempt": "run_7-b"}}), "run_7-b"),
    (None, "unrecorded"),  # no metadata.json
    ("{not json", "unrecorded"),
    (json.dumps({"boundary": 1}), "unrecorded"),
    (json.dumps({"lineage": ["a"]}), "unrecorded"),
    (json.dumps({"lineage": {"attempt": 5}}), "unrecorded"),
    (json.dumps({"lineage": {"attempt": "../up"}}), "unrecorded"),
    (json.dumps({"lineage": {"attempt": "run\n"}}), "unrecorded"),  # never a folder name with a newline
    (json.dumps([1]), "unrecorded"),
])
def test_the_attempt_a_checkpoint_belongs_to(tmp_path, metadata, attempt):
    checkpoint = tmp_path / "checkpoint-1"
    checkpoint.mkdir()
    if metadata is not None:
        (checkpoint / "metadata.json").write_text(metadata)
    assert lineage.attempt_of(checkpoint) == attempt


# ----- the archive ----------------------------------------------------------------------------------------------


def test_later_checkpoints_are_the_complete_ones_after_the_position(tmp_path):
    for name in ["checkpoint-1", "checkpoint-2", "checkpoint-2-step5", "checkpoint-3", "checkpoint-10"]:
        make_checkpoint(tmp_path, name)
    make_checkpoint(tmp_path, "checkpoint-4", complete=False)
    later = lambda position: [p.name for p in lineage.later_checkpoints(tmp_path, position)]  # noqa: E731
    assert later((2, -1)) == ["checkpoint-2-step5", "checkpoint-3", "checkpoint-10"]
    assert later((2, 5)) == ["checkpoint-3", "checkpoint-10"]
    assert later((10, -1)) == []
    assert later((0, -1)) == ["checkpoint-1", "checkpoint-2", "checkpoint-2-step5", "checkpoint-3", "checkpoint-10"]


def test_archive_moves_each_later_checkpoint_under_its_attempt_and_numbers_clashes(tmp_path, caplog):
    make_checkpoint(tmp_path, "checkpoint-1", "keep")
    make_checkpoint(tmp_path, "checkpoint-2", "old_a")
    make_checkpoint(tmp_path, "checkpoint-3", "old_a")
    make_checkpoint(tmp_path, "checkpoint-3-step9", "old_b")
    make_checkpoint(tmp_path, "checkpoint-4")  # no lineage: unrecorded
    make_checkpoint(tmp_path, "checkpoint-5", "old_a", complete=False)  # unfinished: stays
    (tmp_path / "abandoned" / "old_a" / "checkpoint-2").mkdir(parents=True)  # an earlier archive's
    (tmp_path / "abandoned" / "old_a" / "checkpoint-3").mkdir()
    (tmp_path / "abandoned" / "old_a" / "checkpoint-3.2").mkdir()
    with caplog.at_level(logging.WARNING, logger="comlrl.checkpointing.lineage"):
        moves = lineage.archive_later(tmp_path, (1, -1))
    expected = [("checkpoint-2", "abandoned/old_a/checkpoint-2.2"), ("checkpoint-3", "abandoned/old_a/checkpoint-3.3"),
                ("checkpoint-3-step9", "abandoned/old_b/checkpoint-3-step9"),
                ("checkpoint-4", "abandoned/unrecorded/checkpoint-4")]
    assert moves == expected
    assert tree(tmp_path) == {"checkpoint-1": "checkpoint-1", "checkpoint-5": "checkpoint-5",
                              **{destination: name for name, destination in expected}}
    assert not (tmp_path / ".archive.json").exists() and not (tmp_path / ".archive.json.tmp").exists()
    assert [r.getMessage() for r in caplog.records] == [
        f"moved 4 checkpoint(s) later than the starting point of this run to {tmp_path / 'abandoned'}/: "
        + ", ".join(f"{n} -> {d}" for n, d in expected)]


def test_the_archive_journal_lists_every_move_before_the_first(tmp_path, monkeypatch):
    make_checkpoint(tmp_path, "checkpoint-1", "a")
    make_checkpoint(tmp_path, "checkpoint-2", "a")
    make_checkpoint(tmp_path, "checkpoint-3", "b")
    seen = []
    real_replace = os.replace

    def recording_replace(source, target):  # what the directory holds at each rename
        seen.append((Path(source).name, Path(target).relative_to(tmp_path).as_posix(), sorted(
            p.name for p in tmp_path.iterdir()), json.loads((tmp_path / ".archive.json.tmp").read_text())
            if Path(target).name == ".archive.json" else None))
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", recording_replace)
    lineage.archive_later(tmp_path, (1, -1))
    moves = [["checkpoint-2", "abandoned/a/checkpoint-2"], ["checkpoint-3", "abandoned/b/checkpoint-3"]]
    assert seen == [
        (".archive.json.tmp", ".archive.json", [".archive.json.tmp", "checkpoint-1", "checkpoint-2", "checkpoint-3"],
         {"moves": moves}),
        ("checkpoint-2", "abandoned/a/checkpoint-2", [".archive.json", "abandoned", "checkpoint-1", "checkpoint-2",
                                                      "checkpoint-3"], None),
        ("checkpoint-3", "abandoned/b/checkpoint-3", [".archive.json", "abandoned", "checkpoint-1", "checkpoint-3"],
         None)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["abandoned", "checkpoint-1"]


def test_nothing_later_means_no_archive_folder_and_no_journal(tmp_path, caplog):
    make_checkpoint(tmp_path, "checkpoint-1", "a")
    (tmp_path / "abandoned").symlink_to(tmp_path / "elsewhere")  # not looked at when nothing moves
    with caplog.at_level(logging.WARNING, logger="comlrl.checkpointing.lineage"):
        assert lineage.archive_later(tmp_path, (1, -1)) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["abandoned", "checkpoint-1"] and not caplog.records


@pytest.mark.parametrize("link", ["abandoned", "abandoned/a"])
def test_an_archive_through_a_symbolic_link_is_refused(tmp_path, link):
    make_checkpoint(tmp_path, "checkpoint-1", "a")
    make_checkpoint(tmp_path, "checkpoint-2", "a")
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (tmp_path / link).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / link).symlink_to(outside)
    with pytest.raises(CheckpointError) as refusal:
        lineage.archive_later(tmp_path, (1, -1))
    assert refusal.value.file == link and refusal.value.checkpoint == str(tmp_path)
    assert refusal.value.problem == (f"is a symbolic link (to {str(outside)!r}); the archive of abandoned checkpoints "
                                     "must lie inside the checkpoint directory")
    assert tree(tmp_path) == {"checkpoint-1": "checkpoint-1", "checkpoint-2": "checkpoint-2"}
    assert list(outside.iterdir()) == [] and not (tmp_path / ".archive.json").exists()


def write_journal(root: Path, moves) -> None:
    (root / ".archive.json").write_text(json.dumps({"moves": moves}))


def test_finishing_a_journal_makes_the_moves_left_and_removes_it(tmp_path, caplog):
    make_checkpoint(tmp_path, "checkpoint-1", "a")
    make_checkpoint(tmp_path, "checkpoint-3", "a")
    make_checkpoint(tmp_path / "abandoned" / "a", "checkpoint-2", "a")  # moved before the kill
    make_checkpoint(tmp_path, "checkpoint-4", "a")
    make_checkpoint(tmp_path / "abandoned" / "a", "checkpoint-4", "other")  # a target never written over
    moves = [["checkpoint-2", "abandoned/a/checkpoint-2"], ["checkpoint-3", "abandoned/a/checkpoint-3"],
             ["checkpoint-4", "abandoned/a/checkpoint-4"]]
    write_journal(tmp_path, moves)
    (tmp_path / ".archive.json.tmp").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="comlrl.checkpointing.lineage"):
        done = lineage.finish_archive(tmp_path)
    assert done == [tuple(move) for move in moves]
    assert tree(tmp_path) == {"abandoned/a/checkpoint-2": "checkpoint-2", "abandoned/a/checkpoint-3": "checkpoint-3",
                              "abandoned/a/checkpoint-4": "checkpoint-4", "checkpoint-1": "checkpoint-1",
                              "checkpoint-4": "checkpoint-4"}
    assert json.loads((tmp_path / "abandoned/a/checkpoint-4/metadata.json").read_text())["lineage"]["attempt"] == "other"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["abandoned", "checkpoint-1", "checkpoint-4"]
    assert [r.getMessage() for r in caplog.records] == [
        f"completed an interrupted archive in {tmp_path}: " + ", ".join(f"{n} -> {d}" for n, d in moves)]


def test_a_staged_journal_alone_was_never_applied(tmp_path, caplog):
    make_checkpoint(tmp_path, "checkpoint-2", "a")
    (tmp_path / ".archive.json.tmp").write_text(json.dumps({"moves": [["checkpoint-2", "abandoned/a/checkpoint-2"]]}))
    with caplog.at_level(logging.WARNING, logger="comlrl.checkpointing.lineage"):
        assert lineage.finish_archive(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"] and not caplog.records


@pytest.mark.parametrize("journal, detail", [
    ("{not json", "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    (json.dumps({"other": []}), "'moves'"),
    (json.dumps({"moves": [1]}), "cannot unpack non-iterable int object"),
    (json.dumps([1]), "list indices must be integers or slices, not str"),
])
def test_an_unreadable_journal_is_ignored_and_left(tmp_path, caplog, journal, detail):
    make_checkpoint(tmp_path, "checkpoint-2", "a")
    (tmp_path / ".archive.json").write_text(journal)
    with caplog.at_level(logging.WARNING, logger="comlrl.checkpointing.lineage"):
        assert lineage.finish_archive(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [".archive.json", "checkpoint-2"]
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("ERROR", f"ignoring the unreadable archive journal {tmp_path / '.archive.json'} ({detail})")]


@pytest.mark.parametrize("move", [
    ["history", "abandoned/a/history"],  # not a checkpoint's name
    ["sub/checkpoint-2", "abandoned/a/checkpoint-2"],  # not a top-level name
    ["checkpoint-2", "elsewhere/checkpoint-2"],  # not under abandoned/
    ["checkpoint-2", "abandonedx/checkpoint-2"],
    ["checkpoint-2", "abandoned/../checkpoint-9"],
    ["checkpoint-2", "abandoned/a/.."],
])
def test_a_journal_with_a_move_outside_the_archive_is_ignored_whole(tmp_path, caplog, move):
    make_checkpoint(tmp_path, "checkpoint-2", "a")
    make_checkpoint(tmp_path, "checkpoint-3", "a")
    make_checkpoint(tmp_path / "sub", "checkpoint-2", "a")
    (tmp_path / "history").mkdir()
    (tmp_path / "history" / "marker.txt").write_text("history")
    before = tree(tmp_path)
    write_journal(tmp_path, [["checkpoint-3", "abandoned/a/checkpoint-3"], move])
    with caplog.at_level(logging.WARNING, logger="comlrl.checkpointing.lineage"):
        assert lineage.finish_archive(tmp_path) == []
    assert tree(tmp_path) == before and (tmp_path / ".archive.json").exists()
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("ERROR", f"ignoring the archive journal {tmp_path / '.archive.json'}: it holds the move "
                  f"{move[0]!r} -> {move[1]!r}")]


def test_no_journal_means_nothing_to_finish(tmp_path):
    make_checkpoint(tmp_path, "checkpoint-2", "a")
    assert lineage.finish_archive(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]


# ----- the directory lock ---------------------------------------------------------------------------------------


def test_an_unshared_lock_is_a_holder_of_its_own_and_names_this_process(tmp_path):
    directory = tmp_path / "deep" / "runs"  # made by acquire
    first = DirectoryLock(directory, shared=False).acquire()
    assert first.held and directory.is_dir() and list(directory.iterdir()) == []
    assert first.acquire() is first  # taking it again is a no-op
    second = DirectoryLock(directory, shared=False)
    with pytest.raises(DirectoryLockedError) as refusal:
        second.acquire()
    holder = f"pid {os.getpid()} on {socket.gethostname()}"
    assert refusal.value.path == directory and refusal.value.holder == holder
    assert str(refusal.value) == (f"directory {directory} is in use by another process ({holder}; it holds an flock "
                                  f"on {directory}): wait for it to end, or use another directory")
    assert not second.held
    first.release()
    assert not first.held
    second.acquire()
    assert second.held
    second.release()
    second.release()  # releasing twice is harmless
    assert not second.held


def test_a_named_lock_is_a_file_in_the_directory_and_says_what_it_guards(tmp_path):
    lock = DirectoryLock(tmp_path, "flow.lock", what="run 'r1'", shared=False).acquire()
    assert (tmp_path / "flow.lock").is_file() and lock.path == tmp_path / "flow.lock"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "flow.lock").stat().st_mode) == 0o644 & ~umask
    with pytest.raises(DirectoryLockedError) as refusal:
        DirectoryLock(tmp_path, "flow.lock", shared=False).acquire()
    assert str(refusal.value).startswith(f"directory {tmp_path} is in use by another process (pid {os.getpid()} on ")
    DirectoryLock(tmp_path, shared=False).acquire().release()  # the directory itself is another lock
    with pytest.raises(DirectoryLockedError) as refusal:
        DirectoryLock(tmp_path, "flow.lock", what="run 'r1'", shared=False).acquire()
    assert str(refusal.value).startswith("run 'r1' is in use by another process (")
    lock.release()
    DirectoryLock(tmp_path, "flow.lock", shared=False).acquire().release()


def test_shared_locks_in_one_process_count_their_holders(tmp_path):
    first = DirectoryLock(tmp_path).acquire()
    first.acquire()  # the same object again: still one holder
    second = DirectoryLock(tmp_path / "." / "").acquire()  # the same resolved path
    assert first.held and second.held
    outsider = DirectoryLock(tmp_path, shared=False)
    first.release()
    with pytest.raises(DirectoryLockedError):  # the second holder keeps the flock
        outsider.acquire()
    second.release()
    outsider.acquire()  # the last holder released it
    with pytest.raises(DirectoryLockedError):
        DirectoryLock(tmp_path).acquire()  # a shared lock meets the unshared holder's flock
    outsider.release()
    holders = [DirectoryLock(tmp_path).acquire() for _ in range(3)]
    holders[0].release()
    holders[1].release()
    with pytest.raises(DirectoryLockedError):  # the third holder keeps the flock
        DirectoryLock(tmp_path, shared=False).acquire()
    holders[2].release()
    DirectoryLock(tmp_path, shared=False).acquire().release()


def test_shared_locks_of_two_directories_lock_each(tmp_path):
    first, second = DirectoryLock(tmp_path / "a").acquire(), DirectoryLock(tmp_path / "b").acquire()
    for directory in ("a", "b"):
        with pytest.raises(DirectoryLockedError) as refusal:
            DirectoryLock(tmp_path / directory, shared=False).acquire()
        assert refusal.value.path == tmp_path / directory
    first.release()
    DirectoryLock(tmp_path / "a", shared=False).acquire().release()
    with pytest.raises(DirectoryLockedError):
        DirectoryLock(tmp_path / "b", shared=False).acquire()
    second.release()
    DirectoryLock(tmp_path / "b", shared=False).acquire().release()


HOLD = """
import fcntl, os, sys
unrelated = os.open(sys.argv[2], os.O_RDWR | os.O_CREAT)
fcntl.flock(unrelated, fcntl.LOCK_EX)
descriptor = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(descriptor, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


def test_a_lock_held_by_another_process_names_that_process(tmp_path):
    directory = tmp_path / "run"
    directory.mkdir()
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(directory), str(tmp_path / "other.lock")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "held\n"
        for shared in (True, False):
            # a POSIX lock of this process on the same directory: listed in /proc/locks, but not the flock's holder
            posix = os.open(directory, os.O_RDONLY)
            fcntl.lockf(posix, fcntl.LOCK_SH | fcntl.LOCK_NB)
            with pytest.raises(DirectoryLockedError) as refusal:
                DirectoryLock(directory, what="checkpoint directory x", shared=shared).acquire()
            assert refusal.value.holder == f"pid {child.pid} on {socket.gethostname()}"
            assert str(refusal.value).startswith(f"checkpoint directory x is in use by another process "
                                                 f"(pid {child.pid} on ")
            os.close(posix)
    finally:
        child.communicate("")
    DirectoryLock(directory, shared=False).acquire().release()  # the ended holder's lock went with it


def test_a_holder_that_cannot_be_read_is_unknown(tmp_path):
    held = DirectoryLock(tmp_path, shared=False).acquire()
    probe = os.open(os.devnull, os.O_RDONLY)  # the lowest free descriptor: the next lock attempt's
    os.close(probe)
    saved = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (probe + 1, saved[1]))  # no descriptor left for /proc/locks
    try:
        with pytest.raises(DirectoryLockedError) as refusal:
            DirectoryLock(tmp_path, shared=False).acquire()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, saved)
        held.release()
    assert refusal.value.holder == ""
    assert str(refusal.value) == (f"directory {tmp_path} is in use by another process (holder unknown; it holds an "
                                  f"flock on {tmp_path}): wait for it to end, or use another directory")


def test_a_refusal_without_a_known_holder_says_so(tmp_path):
    error = DirectoryLockedError(tmp_path / "x", "", "run 'r'")
    assert str(error) == (f"run 'r' is in use by another process (holder unknown; it holds an flock on {tmp_path / 'x'}):"
                          " wait for it to end, or use another directory")


# ----- a failed write's words -----------------------------------------------------------------------------------


def test_tensor_bytes_counts_every_tensor_once_per_place():
    assert tensor_bytes(torch.zeros(3, 4)) == 48
    assert tensor_bytes(torch.zeros(5, dtype=torch.int8)) == 5
    assert tensor_bytes(torch.zeros(2, 3, dtype=torch.bfloat16)) == 12
    assert tensor_bytes(torch.nn.Linear(3, 2)) == (3 * 2 + 2) * 4
    nested = {"a": torch.zeros(2), "b": [torch.zeros(3, dtype=torch.float64), (torch.zeros(1), 7)],
              "c": {"d": torch.zeros(4, dtype=torch.int16)}, "e": "text"}
    assert tensor_bytes(nested) == 2 * 4 + 3 * 8 + 4 + 4 * 2
    assert tensor_bytes(3.0) == 0 and tensor_bytes(None) == 0


def free_bytes(directory: Path) -> int:
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def free_in(message: str, unit: str = "MB") -> float:
    return float(re.search(rf"no space left on device: ([0-9.]+) {unit} free in ", message).group(1))


def megabytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * (2**20 if unit == "MB" else 2**10)


def test_a_full_disk_or_quota_names_the_free_space_and_the_need(tmp_path):
    for code in (errno.ENOSPC, errno.EDQUOT):
        cause, returned = describe(OSError(code, os.strerror(code)), tmp_path, 3 * 2**20 + 2**19)
        prefix = "no space left on device: "
        assert returned == code and cause.startswith(prefix)
        free_text, rest = cause[len(prefix):].split(" free in ")
        assert rest == f"{tmp_path}, this checkpoint needs ~3.5 MB"
        assert abs(megabytes(free_text) - free_bytes(tmp_path)) < 64 * 2**20  # other writers share the disk
    assert describe(OSError(errno.ENOSPC, "x"), tmp_path, 2**20)[0].endswith("needs ~1.0 MB")
    assert describe(OSError(errno.ENOSPC, "x"), tmp_path, 2**20 - 1)[0].endswith("needs ~1024.0 KB")
    assert describe(OSError(errno.ENOSPC, "x"), tmp_path, 1536)[0].endswith("needs ~1.5 KB")
    assert describe(OSError(errno.ENOSPC, "x"), Path("/proc"), 5 * 2**20) == (  # /proc has 0 bytes free
        "no space left on device: 0.0 KB free in /proc, this checkpoint needs ~5.0 MB", errno.ENOSPC)
    missing = tmp_path / "gone"
    assert describe(OSError(errno.ENOSPC, "x"), missing, 2048) == (
        f"no space left on device: unknown free in {missing}, this checkpoint needs ~2.0 KB", errno.ENOSPC)


def test_a_file_too_large_names_the_limit(tmp_path):
    with file_limits.file_size_limit(3 * 2**20):
        assert file_size_limit() == 3 * 2**20
        assert describe(OSError(errno.EFBIG, "File too large"), tmp_path, 5 * 2**20) == (
            "file too large: the process's file-size limit (ulimit -f) is 3.0 MB, this checkpoint's files need up "
            "to ~5.0 MB", errno.EFBIG)
    if resource.getrlimit(resource.RLIMIT_FSIZE)[0] == resource.RLIM_INFINITY:
        assert file_size_limit() is None
        assert describe(OSError(errno.EFBIG, "File too large"), tmp_path, 4096)[0] == (
            "file too large: the process's file-size limit (ulimit -f) is 0.0 KB, this checkpoint's files need up "
            "to ~4.0 KB")


def test_another_os_error_is_named_by_its_words_and_errno(tmp_path):
    assert describe(PermissionError(errno.EACCES, "Permission denied"), tmp_path, 10) == (
        "Permission denied (EACCES)", errno.EACCES)
    assert describe(OSError(9999, "odd"), tmp_path, 10) == ("odd (9999)", 9999)
    assert describe(OSError(errno.EIO, ""), tmp_path, 10) == (f"{OSError(errno.EIO, '')} (EIO)", errno.EIO)


def test_an_error_without_errno_is_judged_from_the_disk_and_the_limit(tmp_path):
    unexpected = RuntimeError("[enforce fail at inline_container.cc:595] . unexpected pos 64 vs 0")
    huge = free_bytes(tmp_path) * 4 + 2**40
    cause, code = describe(unexpected, tmp_path, huge)
    assert code == errno.ENOSPC and cause.startswith("no space left on device: ")
    assert cause.endswith(f"this checkpoint needs ~{huge / 2**20:.1f} MB")
    with file_limits.file_size_limit(2**20):
        assert describe(unexpected, tmp_path, 2 * 2**20) == (
            "file too large: the process's file-size limit (ulimit -f) is 1.0 MB, this checkpoint's files need up "
            "to ~2.0 MB", errno.EFBIG)
        assert describe(unexpected, tmp_path, 2**20)[1] is None  # exactly the limit fits
    assert describe(OSError("no errno"), tmp_path, 10) == ("OSError: no errno", None)
    assert describe(unexpected, Path("/proc"), 1) == (  # 0 bytes free, 1 needed
        "no space left on device: 0.0 KB free in /proc, this checkpoint needs ~0.0 KB", errno.ENOSPC)
    assert describe(unexpected, Path("/proc"), 0)[1] is None  # 0 needed fits in 0 free
    words = RuntimeError("a  b\n\tc " + "x" * 400)
    assert describe(words, tmp_path, 10) == (f"RuntimeError: {('a b c ' + 'x' * 400)[:300]}", None)
    assert describe(words, tmp_path / "gone", huge)[0].startswith("RuntimeError: a b c")  # free unknown: not judged
