"""What a run finds when it starts in a checkpoint directory, checked on real files: the leftovers of
killed saves settled (comlrl/checkpointing/recovery.py: which copy becomes the checkpoint, what is
deleted, what is left to a live writer, what is said), and the history rows a checkpoint names, written
and read back (comlrl/checkpointing/history.py: the bytes, the record, each refusal in its words)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
from pathlib import Path

import pytest
import torch

from comlrl.checkpointing import history, io, recovery
from comlrl.checkpointing.history import HISTORY_DIR, HistoryLog, encode_rows
from comlrl.checkpointing.lineage import ARCHIVE_DIR, JOURNAL_FILE
from comlrl.checkpointing.manifest import COMPLETE_MARKER, MANIFEST_FILE, seal
from comlrl.errors import CheckpointError


@pytest.fixture(scope="module")
def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def saved(root: Path, name: str, label: str) -> Path:
    """A real, sealed save of a tiny model whose metadata says which save it is."""
    torch.manual_seed(0)
    return io.write_checkpoint(root, name, {"agent": torch.nn.Linear(2, 2)}, {"progress": {}}, {"save": label})


def leftover(root: Path, name: str, label: str, mtime_s: int, state: str = "sealed") -> Path:
    """``root/name`` as a killed save leaves it: a sealed copy, or one cut short before its seal ("unsealed");
    its modification time set to ``mtime_s`` (what the recovery orders copies by)."""
    path = saved(root / "sources", f"checkpoint-{label}", label)
    path = path.rename(root / name)
    if state == "unsealed":
        (path / COMPLETE_MARKER).unlink()
        (path / MANIFEST_FILE).unlink()
    os.utime(path, ns=(mtime_s * 10**9, mtime_s * 10**9))
    return path


def label_of(path: Path) -> str:
    return json.loads((path / io.METADATA_FILE).read_text())["save"]


def entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name != "sources")


# ----- settling a checkpoint name --------------------------------------------------------------------------
def test_the_newest_finished_staging_copy_becomes_the_checkpoint_whatever_the_names(tmp_path, dead_pid, caplog):
    # names sort a, b, c; times say b is the newest, then c, then a
    leftover(tmp_path, f".checkpoint-4.tmp-{dead_pid}-a", "a", 1_000)
    leftover(tmp_path, f".checkpoint-4.tmp-{dead_pid}-b", "b", 3_000)
    leftover(tmp_path, f".checkpoint-4.tmp-{dead_pid}-c", "c", 2_000)
    leftover(tmp_path, f".checkpoint-4.old-{dead_pid}", "old", 500)
    with caplog.at_level(logging.WARNING, logger="comlrl.checkpointing.recovery"):
        actions = recovery.recover(tmp_path)
    assert entries(tmp_path) == ["checkpoint-4"] and label_of(tmp_path / "checkpoint-4") == "b"
    assert actions == [f"removed .checkpoint-4.tmp-{dead_pid}-a", f"removed .checkpoint-4.tmp-{dead_pid}-c",
                       f"removed .checkpoint-4.old-{dead_pid}",
                       f"checkpoint-4 is the finished save .checkpoint-4.tmp-{dead_pid}-b (its renames had been cut "
                       "short)"]
    logged = [record.getMessage() for record in caplog.records]
    assert logged == [f"checkpoint recovery in {tmp_path}: {action}" for action in actions]


def test_a_newer_damaged_or_unsealed_copy_loses_to_an_older_finished_one(tmp_path, dead_pid):
    leftover(tmp_path, f".checkpoint-4.tmp-{dead_pid}-a", "finished", 1_000)
    damaged = leftover(tmp_path, f".checkpoint-4.tmp-{dead_pid}-b", "damaged", 3_000)
    (damaged / io.STATE_FILE).write_bytes(b"[]")
    os.utime(damaged, ns=(3_000 * 10**9,) * 2)
    leftover(tmp_path, f".checkpoint-4.tmp-{dead_pid}-c", "unsealed", 2_000, state="unsealed")
    recovery.recover(tmp_path)
    assert entries(tmp_path) == ["checkpoint-4"] and label_of(tmp_path / "checkpoint-4") == "finished"


def test_without_a_finished_copy_the_newest_old_copy_is_put_back_and_the_rest_removed(tmp_path, dead_pid):
    leftover(tmp_path, f".checkpoint-4.old-{dead_pid}", "old-a", 1_000)
    leftover(tmp_path, f".checkpoint-4.old-{dead_pid}-b", "old-b", 3_000)
    leftover(tmp_path, f".checkpoint-4.old-{dead_pid}-c", "old-c", 2_000)
    leftover(tmp_path, f".checkpoint-4.tmp-{dead_pid}-x", "killed", 4_000, state="unsealed")
    actions = recovery.recover(tmp_path)
    assert entries(tmp_path) == ["checkpoint-4"] and label_of(tmp_path / "checkpoint-4") == "old-b"
    assert actions == [
        f"checkpoint-4 restored from .checkpoint-4.old-{dead_pid}-b (its replacement was never finished)",
        f"removed .checkpoint-4.tmp-{dead_pid}-x", f"removed .checkpoint-4.old-{dead_pid}",
        f"removed .checkpoint-4.old-{dead_pid}-c"]


def test_a_sealed_copy_without_metadata_is_no_checkpoint_and_the_old_copy_is_kept(tmp_path, dead_pid):
    """Its manifest verifies, but a directory without metadata.json is never loaded: installing it would
    delete the last readable copy."""
    staged = leftover(tmp_path, f".checkpoint-4.tmp-{dead_pid}-a", "new", 3_000)
    (staged / io.METADATA_FILE).unlink()
    seal(staged)
    leftover(tmp_path, f".checkpoint-4.old-{dead_pid}", "old", 1_000)
    recovery.recover(tmp_path)
    assert entries(tmp_path) == ["checkpoint-4"] and label_of(tmp_path / "checkpoint-4") == "old"


def test_old_copies_beside_a_checkpoint_are_removed_and_it_is_left_as_it_is(tmp_path, dead_pid):
    saved(tmp_path, "checkpoint-4", "current")
    leftover(tmp_path, f".checkpoint-4.old-{dead_pid}", "old", 9_000)
    half = leftover(tmp_path, f".checkpoint-4.old-{dead_pid}-2", "half", 9_500)
    (half / COMPLETE_MARKER).unlink()
    actions = recovery.recover(tmp_path)
    assert entries(tmp_path) == ["checkpoint-4"] and label_of(tmp_path / "checkpoint-4") == "current"
    assert actions == [f"removed .checkpoint-4.old-{dead_pid}", f"removed .checkpoint-4.old-{dead_pid}-2"]
    assert recovery.recover(tmp_path) == []  # settled: nothing more to do


def test_leftovers_of_several_names_are_each_settled_and_other_entries_untouched(tmp_path, dead_pid):
    leftover(tmp_path, f".checkpoint-2-step7.tmp-{dead_pid}-a", "step7", 1_000)
    leftover(tmp_path, f".checkpoint-3.tmp-{dead_pid}-a", "killed", 1_000, state="unsealed")
    (tmp_path / f".checkpoint-5.tmp-{dead_pid}-a").write_text("a file, not a save")
    (tmp_path / ".notes.tmp-1").mkdir()
    actions = recovery.recover(tmp_path)
    assert entries(tmp_path) == [f".checkpoint-5.tmp-{dead_pid}-a", ".notes.tmp-1", "checkpoint-2-step7"]
    assert len(actions) == 2
    assert recovery.recover(tmp_path / "missing") == []


def test_a_leftover_that_cannot_be_removed_does_not_stop_the_run_and_its_target_is_untouched(tmp_path, dead_pid):
    """A leftover that is a link to a directory: never followed (rmtree refuses links), never fatal."""
    elsewhere = saved(tmp_path / "elsewhere", "checkpoint-1", "elsewhere")
    leftover(tmp_path, f".checkpoint-4.tmp-{dead_pid}-a", "finished", 1_000)
    (tmp_path / f".checkpoint-4.old-{dead_pid}").symlink_to(elsewhere, target_is_directory=True)
    (tmp_path / f".checkpoint-6.tmp-{dead_pid}-a").symlink_to(elsewhere, target_is_directory=True)
    (elsewhere / COMPLETE_MARKER).rename(elsewhere / "COMPLETE.aside")  # unsealed: not a winner
    recovery.recover(tmp_path)
    assert label_of(tmp_path / "checkpoint-4") == "finished"
    assert sorted(p.name for p in elsewhere.iterdir()) == ["COMPLETE.aside", MANIFEST_FILE, io.METADATA_FILE,
                                                         io.MODELS_DIR, io.STATE_FILE]


# ----- whose leftovers ------------------------------------------------------------------------------------
def test_leftovers_of_a_live_writer_are_left_alone_and_the_writer_is_not_signalled(tmp_path):
    writer = subprocess.Popen(["sleep", "60"])
    try:
        names = [f".checkpoint-4.tmp-{writer.pid}-a", f".checkpoint-4.old-{writer.pid}"]
        for name in names:
            leftover(tmp_path, name, name, 1_000, state="unsealed")
        assert recovery.recover(tmp_path) == []
        assert entries(tmp_path) == sorted(names)
        assert writer.poll() is None  # still running: asked whether it lives, not sent a signal
    finally:
        writer.kill()
        writer.wait()


@pytest.mark.parametrize("suffix", ["own", "own-a", "x1", "a-1", "12x", "99999999999999999999999-a"])
def test_leftovers_of_this_process_or_of_no_named_process_are_settled(tmp_path, suffix):
    suffix = suffix.replace("own", str(os.getpid()))
    leftover(tmp_path, f".checkpoint-4.tmp-{suffix}", "killed", 1_000, state="unsealed")
    assert recovery.recover(tmp_path) == [f"removed .checkpoint-4.tmp-{suffix}"]
    assert entries(tmp_path) == []


def test_a_writer_of_another_user_counts_as_alive():
    """Signalling another user's process is refused (EPERM), which proves it runs: checked in a child that
    is not root, against process 1 (root's)."""
    child = os.fork()
    if child == 0:
        code = 3
        try:
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            code = 0 if recovery._writer_alive("1-a") else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert recovery._writer_alive("1-a")  # here too (root may signal it; a user may not, which proves it runs)


def test_an_interrupted_archive_is_finished_and_said(tmp_path):
    saved(tmp_path, "checkpoint-1", "kept")
    saved(tmp_path, "checkpoint-2", "abandoned")
    (tmp_path / ARCHIVE_DIR / "A").mkdir(parents=True)
    (tmp_path / JOURNAL_FILE).write_text(json.dumps({"moves": [["checkpoint-2", f"{ARCHIVE_DIR}/A/checkpoint-2"]]}))
    assert recovery.recover(tmp_path) == [f"archived checkpoint-2 -> {ARCHIVE_DIR}/A/checkpoint-2 (an interrupted "
                                          "archive)"]
    assert [p.name for p in io.list_checkpoints(tmp_path)] == ["checkpoint-1"]


# ----- the history rows ------------------------------------------------------------------------------------
ROWS = [{"step": 1, "reward_mean": 0.1, "loss": -0.25}, {"step": 2, "reward_mean": 1 / 3, "tags": ["a", "é"]},
        {"step": 3, "reward_mean": 2.5e-8, "done": True}]


def record_of(data: bytes, name: str, rows: int) -> dict:
    return {"file": name, "rows": rows, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_rows_are_json_lines_and_each_save_appends_only_the_new_ones(tmp_path):
    assert encode_rows(ROWS[:2]) == ('{"step": 1, "reward_mean": 0.1, "loss": -0.25}\n'
                                     '{"step": 2, "reward_mean": 0.3333333333333333, "tags": ["a", "\\u00e9"]}\n'
                                     ).encode()
    log = HistoryLog(tmp_path, "A")
    first = log.append(ROWS[:2])
    file = tmp_path / HISTORY_DIR / "A.jsonl"
    assert first == record_of(encode_rows(ROWS[:2]), "A.jsonl", 2)
    rows = [dict(row) for row in ROWS]
    second = log.append(rows)
    assert second == record_of(encode_rows(ROWS), "A.jsonl", 3) and file.read_bytes() == encode_rows(ROWS)
    assert log.append(rows) == second and file.read_bytes() == encode_rows(ROWS)  # nothing new: nothing written

    rows[0]["loss"] = 0.0  # a row already written changed: a file of its own, the first left as it was
    third = log.append(rows)
    assert third == record_of(encode_rows(rows), "A-2.jsonl", 3)
    assert (tmp_path / HISTORY_DIR / "A-2.jsonl").read_bytes() == encode_rows(rows)
    assert file.read_bytes() == encode_rows(ROWS)
    rows[1]["reward_mean"] = 0.0
    assert log.append(rows)["file"] == "A-3.jsonl"
    rows.append({"step": 4})
    assert log.append(rows) == record_of(encode_rows(rows), "A-3.jsonl", 4)


def test_an_append_writes_over_what_a_failed_append_left(tmp_path):
    log = HistoryLog(tmp_path, "A")
    log.append(ROWS[:1])
    file = tmp_path / HISTORY_DIR / "A.jsonl"
    with open(file, "ab") as handle:
        handle.write(b'{"step": 2, "rew')  # a write cut short
    assert log.append(ROWS) == record_of(encode_rows(ROWS), "A.jsonl", 3)
    assert file.read_bytes() == encode_rows(ROWS)


def test_a_history_folder_that_is_a_link_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / HISTORY_DIR).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError) as error:
        HistoryLog(tmp_path / "run", "A")
    assert (error.value.checkpoint, error.value.file) == (str(tmp_path / "run"), HISTORY_DIR)
    assert error.value.problem == (f"is a symbolic link (to {str(tmp_path / 'elsewhere')!r}); a run's history must "
                                   "lie inside its checkpoint directory")


def checkpoint_with_rows(root: Path, name: str, log: HistoryLog, rows: list[dict]) -> Path:
    record = log.append(rows)
    return io.write_checkpoint(root, name, {"agent": torch.nn.Linear(2, 2)}, {"progress": {}},
                               {"history": record, "boundary": len(rows)})


def test_a_checkpoint_reads_back_exactly_its_rows_beside_or_archived(tmp_path, caplog):
    log = HistoryLog(tmp_path, "A")
    first = checkpoint_with_rows(tmp_path, "checkpoint-1", log, ROWS[:1])
    checkpoint_with_rows(tmp_path, "checkpoint-3", log, ROWS)
    assert history.read_history(first) == ROWS[:1]  # later rows are past its prefix
    assert history.read(str(tmp_path / "checkpoint-3")) == (ROWS, "../history/A.jsonl")

    with open(tmp_path / HISTORY_DIR / "A.jsonl", "ab") as handle:
        handle.write(b'{"step": 4, "rew')  # torn by a kill
    with caplog.at_level(logging.WARNING, logger="comlrl.checkpointing.history"):
        assert history.read_history(tmp_path / "checkpoint-3") == ROWS
    assert len(caplog.records) == 1 and "ends with a partial row" in caplog.text

    archived = tmp_path / ARCHIVE_DIR / "A" / "checkpoint-3"
    archived.parent.mkdir(parents=True)
    (tmp_path / "checkpoint-3").rename(archived)
    assert history.read(archived) == (ROWS, "../../../history/A.jsonl")
    assert history.read(first, io.read_metadata(first)) == (ROWS[:1], "../history/A.jsonl")


def test_complete_rows_past_a_checkpoints_prefix_are_no_torn_line(tmp_path, caplog):
    log = HistoryLog(tmp_path, "A")
    first = checkpoint_with_rows(tmp_path, "checkpoint-1", log, ROWS[:1])
    log.append(ROWS)
    with caplog.at_level(logging.WARNING, logger="comlrl.checkpointing.history"):
        assert history.read_history(first) == ROWS[:1]
    assert caplog.records == []


def test_a_format_2_checkpoint_reads_its_own_history_json(tmp_path):
    path = io.write_checkpoint(tmp_path, "checkpoint-1", {"agent": torch.nn.Linear(2, 2)}, {"progress": {}},
                               {"boundary": 1})
    (path / io.HISTORY_FILE).write_text(json.dumps(ROWS))
    assert history.read(path) == (ROWS, io.HISTORY_FILE)


def refused_rows(checkpoint: Path, record: dict) -> CheckpointError:
    with pytest.raises(CheckpointError) as error:
        history.read_rows(checkpoint, record)
    assert error.value.checkpoint == str(checkpoint)
    return error.value


def test_each_way_a_history_file_is_wrong_is_named(tmp_path):
    checkpoint = tmp_path / "checkpoint-3"
    checkpoint.mkdir()
    folder = tmp_path / HISTORY_DIR
    folder.mkdir()
    data = encode_rows(ROWS)
    good = record_of(data, "A.jsonl", 3)

    error = refused_rows(checkpoint, good)
    assert (error.file, error.problem) == ("../history/A.jsonl", "is missing: the checkpoint's 3 history rows are "
                                           "kept in the history/ folder of its run directory; copy that folder "
                                           "beside a checkpoint that is moved or copied")
    (folder / "A.jsonl").write_bytes(data[:-5])
    error = refused_rows(checkpoint, good)
    assert error.problem == (f"has {len(data) - 5} bytes, fewer than the {len(data)} of the 3 rows metadata.json's "
                             "history record counts (truncated)")
    (folder / "A.jsonl").write_bytes(data.replace(b"0.1", b"0.2"))
    error = refused_rows(checkpoint, good)
    assert error.problem == (f"its first {len(data)} bytes changed since the checkpoint was saved (their sha256 "
                             "differs from metadata.json's history record)")
    (folder / "A.jsonl").write_bytes(data)
    error = refused_rows(checkpoint, dict(good, rows=2))
    assert error.problem == (f"its first {len(data)} bytes hold 3 whole lines, not the 2 rows metadata.json's "
                             "history record counts")
    cut = data[:-1]  # the last line without its newline
    error = refused_rows(checkpoint, record_of(cut, "A.jsonl", 2))
    assert error.problem == (f"its first {len(cut)} bytes hold 2 whole lines, not the 2 rows metadata.json's "
                             "history record counts")
    for bad, problem in [(b'{"step": 1}\n\xff\xfe\n', "line 2 is not UTF-8 text ("),
                         (b'{"step": 1}\n{"step": 2}\n{"step"\n', "line 3 is not valid JSON (Expecting ':' delimiter")]:
        (folder / "B.jsonl").write_bytes(bad)
        error = refused_rows(checkpoint, record_of(bad, "B.jsonl", bad.count(b"\n")))
        assert (error.file, error.problem[:len(problem)]) == ("../history/B.jsonl", problem), error.problem

    (folder / "C.jsonl").mkdir()  # not a readable file
    error = refused_rows(checkpoint, record_of(b"", "C.jsonl", 0))
    assert error.problem == "cannot be read (Is a directory)"
    (folder / "D.jsonl").symlink_to(folder / "A.jsonl")
    error = refused_rows(checkpoint, record_of(data, "D.jsonl", 3))
    link = f"is a symbolic link (to {str(folder / 'A.jsonl')!r}); a run's history must lie in its own directory"
    assert (error.file, error.problem) == ("../history/D.jsonl", link)


@pytest.mark.parametrize("record, problem", [
    ([], "history must be an object with exactly file, rows, bytes, sha256, got []"),
    ({"file": "A.jsonl", "rows": 1, "bytes": 2}, "history must be an object with exactly file, rows, bytes, sha256, "
                                                 "got {'file': 'A.jsonl', 'rows': 1, 'bytes': 2}"),
    ({"file": "../A.jsonl", "rows": 1, "bytes": 2, "sha256": "0" * 64},
     "history.file is '../A.jsonl', expected a file name '<attempt>.jsonl'"),
    ({"file": 7, "rows": 1, "bytes": 2, "sha256": "0" * 64},
     "history.file is 7, expected a file name '<attempt>.jsonl'"),
    ({"file": "A" * 82 + ".jsonl", "rows": 1, "bytes": 2, "sha256": "0" * 64},
     f"history.file is {'A' * 82 + '.jsonl'!r}, expected a file name '<attempt>.jsonl'"),
    ({"file": "A.json", "rows": 1, "bytes": 2, "sha256": "0" * 64},
     "history.file is 'A.json', expected a file name '<attempt>.jsonl'"),
    ({"file": "A.jsonl", "rows": -1, "bytes": 2, "sha256": "0" * 64},
     "history.rows is -1, expected a non-negative integer"),
    ({"file": "A.jsonl", "rows": True, "bytes": 2, "sha256": "0" * 64},
     "history.rows is True, expected a non-negative integer"),
    ({"file": "A.jsonl", "rows": 1, "bytes": 2.0, "sha256": "0" * 64},
     "history.bytes is 2.0, expected a non-negative integer"),
    ({"file": "A.jsonl", "rows": 1, "bytes": 2, "sha256": "0" * 63},
     f"history.sha256 is {'0' * 63!r}, expected 64 hexadecimal digits"),
    ({"file": "A.jsonl", "rows": 1, "bytes": 2, "sha256": "A" * 64},
     f"history.sha256 is {'A' * 64!r}, expected 64 hexadecimal digits"),
    ({"file": "A.jsonl", "rows": 1, "bytes": 2, "sha256": None},
     "history.sha256 is None, expected 64 hexadecimal digits"),
])
def test_a_malformed_history_record_is_named(record, problem):
    def fail(message):
        raise ValueError(message)

    with pytest.raises(ValueError) as error:
        history.check_record(record, fail)
    assert str(error.value) == problem
    history.check_record({"file": "A_b-2.jsonl", "rows": 0, "bytes": 0, "sha256": "0a" * 32}, fail)  # passes
    history.check_record({"file": "A" * 81 + ".jsonl", "rows": 0, "bytes": 0, "sha256": "0a" * 32}, fail)


def test_a_resume_appends_where_its_rows_end_and_otherwise_starts_its_own_file(tmp_path):
    first = HistoryLog(tmp_path, "A")
    checkpoint = checkpoint_with_rows(tmp_path, "checkpoint-2", first, ROWS[:2])
    record = io.read_metadata(checkpoint)["history"]

    resumed = HistoryLog(tmp_path, "B")
    rows = history.read_history(checkpoint)
    resumed.continue_file(checkpoint, record, rows)
    assert resumed.append(rows + ROWS[2:]) == record_of(encode_rows(ROWS), "A.jsonl", 3)

    again = HistoryLog(tmp_path, "C")  # A.jsonl now runs past checkpoint-2's rows
    again.continue_file(checkpoint, record, rows)
    assert again.append(rows + [{"step": 3}]) == record_of(encode_rows(ROWS[:2] + [{"step": 3}]), "C.jsonl", 3)

    changed = HistoryLog(tmp_path, "D")  # the last row written changes after the resume (the epoch's end)
    rows = history.read_history(tmp_path / "checkpoint-2")
    (tmp_path / HISTORY_DIR / "A.jsonl").write_bytes(encode_rows(ROWS[:2]))
    changed.continue_file(checkpoint, record, rows)
    rows[-1]["loss"] = 0.5
    assert changed.append(rows + ROWS[2:]) == record_of(encode_rows(rows + ROWS[2:]), "D.jsonl", 3)
    assert (tmp_path / HISTORY_DIR / "A.jsonl").read_bytes() == encode_rows(ROWS[:2])

    rewritten = HistoryLog(tmp_path, "F")  # the file holds as many bytes as the checkpoint's rows, but others
    (tmp_path / HISTORY_DIR / "A.jsonl").write_bytes(encode_rows(ROWS[:2]).replace(b"0.1", b"0.2"))
    rewritten.continue_file(checkpoint, record, ROWS[:2])
    assert rewritten.append(ROWS)["file"] == "F.jsonl"
    (tmp_path / HISTORY_DIR / "A.jsonl").write_bytes(encode_rows(ROWS[:2]))

    elsewhere = HistoryLog(tmp_path / "other-run", "E")  # a checkpoint of another directory: never appended to
    elsewhere.continue_file(checkpoint, record, ROWS[:2])
    assert elsewhere.append(ROWS)["file"] == "E.jsonl"
    assert (tmp_path / HISTORY_DIR / "A.jsonl").read_bytes() == encode_rows(ROWS[:2])
