"""Issue 26, case 8: a bad run id never starts anything — exit 2 and one line naming it, before Prefect,
MLflow or a model is started (no traceback; nothing written under the working directory's runs/)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMLRL = str(Path(sys.executable).parent / "comlrl")


def comlrl(*arguments: str, workdir: Path) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_", "MLFLOW_"))}
    return subprocess.run([COMLRL, *arguments, "--workdir", str(workdir)], env=env, capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


@pytest.mark.parametrize("run_id", ["../escape", "a" * 207, "bad\x01id", "a/b", ".hidden", "two\nlines"])
def test_a_bad_run_id_is_refused_before_anything_starts(run_id, tmp_path):
    for command in (["run", "flows/specs/letters.yaml", "--run-id", run_id], ["resume", run_id]):
        started = time.monotonic()
        result = comlrl(*command, workdir=tmp_path / "work")
        assert result.returncode == 2, (command[0], result.stderr[-2000:])
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("comlrl: run id ") and repr(run_id) in lines[0], lines
        assert "Traceback" not in result.stderr and not result.stdout.strip()
        assert not (tmp_path / "work" / "runs").exists() and not (tmp_path / "work" / "prefect").exists()
        assert time.monotonic() - started < 60


@pytest.mark.parametrize("offline", ["1", None], ids=["HF_HUB_OFFLINE=1", "unset"])  # unset: the run's default, 1
def test_a_hub_id_that_is_not_available_offline_is_refused_at_validation(tmp_path, offline):
    spec = (ROOT / "flows" / "specs" / "letters.yaml").read_text()
    lines = [("  agent_model: my-models/llama-7b" if line.startswith("  agent_model:") else line)
             for line in spec.splitlines()]
    (tmp_path / "hub.yaml").write_text("\n".join(lines) + "\n")
    started = time.monotonic()
    result = subprocess.run([COMLRL, "run", str(tmp_path / "hub.yaml"), "--root", str(ROOT), "--workdir",
                             str(tmp_path / "work")], capture_output=True, text=True, cwd=ROOT, timeout=120,
                            env={**{k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"},
                                 **({"HF_HUB_OFFLINE": offline} if offline else {})})
    assert result.returncode == 2, result.stderr[-2000:]
    assert "models.agent_model: 'my-models/llama-7b' is no directory under" in result.stderr
    assert "not in the local Hugging Face cache" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "work" / "runs").exists()
    assert time.monotonic() - started < 60


def test_sync_refuses_a_path_the_filesystem_cannot_hold_and_says_when_there_is_no_spool(tmp_path):
    too_long = tmp_path / ("a" * 300)
    result = subprocess.run([COMLRL, "sync", str(too_long)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("comlrl: PATH: ") and "PC_NAME_MAX" in lines[0] and "Traceback" not in result.stderr
    (tmp_path / "empty").mkdir()
    result = subprocess.run([COMLRL, "sync", str(tmp_path / "empty")], capture_output=True, text=True, cwd=ROOT,
                            timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == f"comlrl sync: no tracking spool (spool.jsonl) under {tmp_path / 'empty'}"


def test_promote_names_a_missing_model_in_one_prefixed_line(tmp_path):
    result = comlrl("promote", "nosuch", workdir=tmp_path / "work")
    assert result.returncode == 2, result.stderr[-2000:]
    ours = [line for line in result.stderr.splitlines() if line.startswith("comlrl")]
    assert ours == [f"comlrl promote: no registered models named nosuch-team or nosuch-agent-<i> in "
                    f"sqlite:///{tmp_path / 'work' / 'mlflow' / 'mlflow.db'}"], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
