"""Issue "Faults in the field, part 3", case 2: the disk under the working directory fills during a resumed run.

Everything the run writes fails at once: the next checkpoint, the tracking spool, the MLflow store, the log file.
Logging's own error report printed a traceback that Prefect's print-to-log handed back to the failing log file,
until Python's recursion limit: 18,000-38,000 console lines, the closing line a RecursionError, the MLflow run left
RUNNING. A full disk now reads as one line naming the file system and its free space, the MLflow run FAILED, and
the resume after freeing space completes.

The end-to-end test is a real ``comlrl run`` that fails in epoch 2, then its real ``comlrl resume`` with the working
directory on a 64 MB tmpfs (bubblewrap's ``--size``, the sandbox's binary), whose reward fills that tmpfs before
the epoch's checkpoint is staged; the MLflow store is read with ``sqlite3``."""

from __future__ import annotations

import logging
import re
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest
import yaml

from comlrl.tasks.letters import write_dataset
from flows import cli, full_disk
from flows.console import LogFile, log_file_trouble
from letters_spec import letters_spec
from test_run_failures import COMLRL, closing_line, environment, finished, start, statuses

RUN_ID = "full-disk-1"
TMPFS_BYTES = 64_000_000  # the run's stores and checkpoints (~12 MB) and the preflight's room for one (32 MB)
JUDGE = '''
from pathlib import Path

from comlrl.tasks.letters import letters_reward

HERE = Path(__file__).parent


def fill(path):
    """Write ``path`` until its file system is full (1 MiB at a time, then a page at a time)."""
    with open(path, "ab", buffering=0) as handle:
        for chunk in (1 << 20, 4096):
            try:
                while True:
                    handle.write(bytes(chunk))
            except OSError:
                pass


def reward(completions_0, completions_1, batch_items=None):
    """The letters reward; at the call ``fail-at`` names it raises, at the one ``fill-at`` names (counted across
    processes in ``calls``) it first fills the disk that file names."""
    calls = HERE / "calls"
    count = int(calls.read_text()) + 1 if calls.exists() else 1
    calls.write_text(str(count))
    if (HERE / "fail-at").exists() and int((HERE / "fail-at").read_text()) == count:
        raise RuntimeError(f"the judge failed at call {count}")
    if (HERE / "fill-at").exists():
        at, path = (HERE / "fill-at").read_text().split(maxsplit=1)
        if int(at) == count:
            fill(path.strip())
    return letters_reward(completions_0, completions_1, batch_items)
'''


def project(tmp_path: Path) -> tuple[Path, Path]:
    """The letters task, two epochs of two steps, ``judge.py`` as its reward."""
    root = tmp_path / "project"
    write_dataset(root / "data" / "letters", num_train=4, num_eval=2)
    (root / "judge.py").write_text(JUDGE)
    spec = letters_spec("fulldisk", num_generations=2, max_new_tokens=4, num_train_epochs=2,
                        per_device_train_batch_size=2)
    spec["reward"] = "judge:reward"
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    return root / "spec.yaml", root


def resume_on_a_tmpfs(workdir: Path, saved: Path, out: Path) -> subprocess.CompletedProcess:
    """``comlrl resume`` with ``workdir`` a tmpfs of :data:`TMPFS_BYTES` holding a copy of ``saved``; its free space
    on the closing line's disk is read before the filler goes; the workdir is copied to ``out`` without it."""
    from comlrl.sandbox.isolation import bwrap_binary

    script = ('cp -a "$1/." "$2/" || exit 99; "$0" resume ' + RUN_ID + ' --workdir "$2"; code=$?; '
              'rm -f "$2/filler"; cp -a "$2/." "$3/"; exit $code')
    out.mkdir()
    return subprocess.run([bwrap_binary(), "--dev-bind", "/", "/", "--size", str(TMPFS_BYTES), "--tmpfs",
                           str(workdir), "--", "sh", "-c", script, COMLRL, str(saved), str(workdir), str(out)],
                          env=environment(), cwd=workdir.parent / "cwd", capture_output=True, text=True, timeout=600)


@pytest.mark.e2e  # three real comlrl processes, ~3 min on a loaded 2-core machine
def test_a_disk_full_during_a_resume_ends_in_one_line_naming_it_and_the_resume_after_freeing_space_finishes(
        tmp_path):
    spec, root = project(tmp_path)
    workdir, cwd = tmp_path / "work", tmp_path / "cwd"
    command = ["run", str(spec), "--root", str(root), "--workdir", str(workdir), "--run-id", RUN_ID]
    (root / "fail-at").write_text("4")  # epoch 2's first step: checkpoint-1 and the failure's checkpoint-1-step3
    code, _, stderr = finished(start(command, cwd))
    assert code == 1 and "the judge failed at call 4" in closing_line(stderr), stderr[-4000:]
    (root / "fail-at").unlink()
    saved = tmp_path / "saved"
    shutil.copytree(workdir, saved, symlinks=True)
    shutil.rmtree(workdir)
    workdir.mkdir()

    (root / "fill-at").write_text(f"5 {workdir / 'filler'}")  # epoch 2's last step: the disk fills before checkpoint-2
    full = resume_on_a_tmpfs(workdir, saved, tmp_path / "out")
    assert full.returncode == 1, full.stderr[-4000:]
    assert int((root / "calls").read_text()) == 5  # it filled the disk, then never judged again
    line = closing_line(full.stderr)  # one comlrl: line, the last; no traceback on the console
    assert "--- Logging error ---" not in full.stderr and "RecursionError" not in full.stderr, full.stderr[-4000:]
    assert len(full.stderr.splitlines()) < 100, len(full.stderr.splitlines())  # was 18,000-38,000
    assert line.startswith(f"comlrl: run {RUN_ID} failed: CheckpointWriteError: "), line
    disk = re.search(r"; the disk is full: ([\d.]+ (?:bytes|KB|MB)) free of ([\d.]+) MB on the file system mounted at "
                     r"(.+?) \(tmpfs\), which holds (.+?) \(", line)
    assert disk is not None, line
    assert float(disk[2]) == pytest.approx(TMPFS_BYTES / 2**20, abs=0.1) and Path(disk[3]) == workdir, line
    assert f"after freeing space on {workdir}, continue with:" in line, line
    assert f"resume {RUN_ID} --workdir {workdir}" in line, line
    assert f"{workdir / 'logs' / RUN_ID}.log" in line, line  # where the traceback is, or that it could not be kept

    # The tmpfs went with the process: its copy, without the filler (the space freed), is the working directory.
    assert not any(workdir.iterdir())
    workdir.rmdir()
    (tmp_path / "out").rename(workdir)
    assert statuses(workdir) == ["FAILED"]  # was RUNNING
    checkpoints = workdir / "runs" / RUN_ID / "checkpoints"
    assert sorted(path.name for path in checkpoints.iterdir()) == ["checkpoint-1", "checkpoint-1-step3", "history"]
    assert all((checkpoints / name / "COMPLETE").is_file() for name in ("checkpoint-1", "checkpoint-1-step3"))
    assert not list(workdir.rglob(".comlrl-room-*"))  # the room kept for the end is given back

    code, _, stderr = finished(start(["resume", RUN_ID, "--workdir", str(workdir)], cwd))
    assert code == 0, stderr[-4000:]
    assert statuses(workdir) == ["FINISHED"]
    assert (checkpoints / "checkpoint-2" / "COMPLETE").is_file()
    with sqlite3.connect(workdir / "mlflow" / "mlflow.db") as db:
        names = sorted(name for (name,) in db.execute("SELECT name FROM model_versions"))
    assert names == ["fulldisk-agent-0", "fulldisk-agent-1", "fulldisk-team"]


# ---- the default tier: the log file, the closing line and the room, on real devices and files ---------------------

def test_a_log_file_on_a_full_device_loses_records_quietly_and_keeps_no_traceback_on_the_console(capfd, tmp_path):
    """/dev/full refuses every write with ENOSPC. logging's FileHandler reported each failure with a traceback on
    standard error (which Prefect's print-to-log turned into a record for the same file, recursing); the run's log
    file counts what it lost and the closing line says so."""
    logger = logging.getLogger("comlrl.tests.full_disk")
    keeper = LogFile(Path("/dev/full"))
    root = logging.getLogger()
    root.addHandler(keeper)
    try:
        for number in range(3):
            try:
                raise ValueError(f"failure {number}")
            except ValueError:
                logger.error("the flow could not run", exc_info=True)
        trouble = log_file_trouble(Path("/dev/full"))
        line = cli.failure_line("r", str(tmp_path), keeper.error, Path("/dev/full"))
    finally:
        root.removeHandler(keeper)
        keeper.close()
    captured = capfd.readouterr()
    assert "Logging error" not in captured.err and "Traceback" not in captured.err, captured.err
    assert keeper.lost == 3 and isinstance(keeper.error, OSError) and keeper.error.errno == 28
    assert trouble == ("the traceback could not be written to /dev/full (OSError: [Errno 28] No space left on "
                       "device); --verbose prints it")
    assert "(the traceback could not be written to /dev/full" in line and "(traceback:" not in line, line

    kept = LogFile(tmp_path / "run.log")  # a file that takes every record has nothing to say
    kept.emit(logging.LogRecord("x", logging.ERROR, __file__, 1, "written", None, None))
    kept.close()
    assert kept.trouble() is None and (tmp_path / "run.log").read_text().endswith("written\n")


def disk_full_errors() -> list[BaseException]:
    """A real ENOSPC (a write to /dev/full) and SQLite's real "database or disk is full" (a database held to one
    more page than its table), each as its writer raises it and under a wrapper that says something else."""
    errors: list[BaseException] = []
    try:
        with open("/dev/full", "wb", buffering=0) as device:
            device.write(b"x")
    except OSError as error:
        errors.append(error)
    database = sqlite3.connect(":memory:")
    database.execute("CREATE TABLE t (x BLOB)")
    database.execute(f"PRAGMA max_page_count = {database.execute('PRAGMA page_count').fetchone()[0] + 1}")
    try:
        database.execute("INSERT INTO t VALUES (zeroblob(100000))")
    except sqlite3.OperationalError as error:
        errors.append(error)
    for cause in list(errors):
        try:
            raise RuntimeError("the registry could not be written") from cause
        except RuntimeError as wrapped:
            errors.append(wrapped)
    return errors


def test_a_disk_full_error_names_the_file_system_and_its_free_space_on_the_closing_line(tmp_path):
    errors = disk_full_errors()
    assert len(errors) == 4 and all(full_disk.says_full(error) for error in errors)
    assert not full_disk.says_full(ValueError("the judge is down")) and not full_disk.says_full(OSError(13, "denied"))
    system = full_disk.file_system(tmp_path / "not yet" / "made")  # the nearest existing folder's
    usage = shutil.disk_usage(tmp_path)
    assert system is not None and system.total == usage.total and tmp_path.is_relative_to(system.mount)
    for error in errors:
        line = cli.failure_line("r", str(tmp_path), error, None)
        assert line.startswith(f"run r failed: {cli.summary(error)}; the disk is full: "), line
        assert f" free of {full_disk.size(usage.total)} on the file system mounted at {system.mount}" in line, line
        assert f"after freeing space on {system.mount}, " in line and "\n" not in line, line
    # Another error on a disk with room: the line as before.
    assert cli.failure_line("r", str(tmp_path), ValueError("boom"), None) == (
        "run r failed: ValueError: boom; nothing was checkpointed; after fixing the cause, run the same command again")


def test_the_room_kept_for_the_end_is_one_file_per_file_system_and_is_given_back(tmp_path):
    run, store = tmp_path / "runs" / "r", tmp_path / "mlflow"
    run.mkdir(parents=True)
    store.mkdir()
    other = Path("/dev/shm")
    folders = [run, store] + ([other] if other.is_dir() and other.stat().st_dev != tmp_path.stat().st_dev else [])
    kept = full_disk.keep_room(folders, ".comlrl-room-r")
    try:
        assert kept == [run / ".comlrl-room-r", *([other / ".comlrl-room-r"] if other in folders else [])]
        assert all(path.stat().st_blocks * 512 >= full_disk.ROOM_BYTES for path in kept)  # written, not sparse
    finally:
        freed = full_disk.release_room()
    assert freed == full_disk.ROOM_BYTES * len(kept) and not any(path.exists() for path in kept)
    assert full_disk.release_room() == 0
