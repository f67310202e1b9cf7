"""docs/guide.md's Python examples run as written, top to bottom, in one fresh offline process.

A block preceded by ``<!-- not run: reason -->`` is skipped (it needs the hub or GPUs); the test
keeps those few, so the guide stays something a reader can run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guide.md"
MAX_NOT_RUN = 2
TIMEOUT_S = 300

BLOCK = re.compile(r"(?:<!--\s*not run:\s*(?P<reason>.*?)\s*-->\s*\n)?```python\n(?P<code>.*?)```", re.S)

# Runs the blocks in one namespace, each compiled under the guide's name and line numbers, so a
# traceback points at the guide's own line.
RUNNER = """
import json, sys
blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
for line, code in blocks:
    print(f"guide block at line {line}", flush=True)
    exec(compile("\\n" * (line - 1) + code, sys.argv[2], "exec"), namespace)
print("all blocks ran", flush=True)
"""


def guide_blocks() -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(runnable, not run): each as (line of the block's first code line in the guide, code or reason)."""
    text = GUIDE.read_text()
    runnable, skipped = [], []
    for match in BLOCK.finditer(text):
        line = text.count("\n", 0, match.start("code")) + 1
        if match.group("reason") is not None:
            skipped.append((line, match.group("reason")))
        else:
            runnable.append((line, match.group("code")))
    return runnable, skipped


def test_every_python_block_is_found():
    runnable, skipped = guide_blocks()
    assert len(runnable) + len(skipped) == GUIDE.read_text().count("```python")
    assert all(reason for _, reason in skipped), "a not-run block must say why"


def test_few_blocks_are_not_run():
    runnable, skipped = guide_blocks()
    assert len(runnable) >= 10
    assert len(skipped) <= MAX_NOT_RUN, f"{len(skipped)} blocks are marked not run: {skipped}"


def test_guide_examples_run(tmp_path):
    runnable, _ = guide_blocks()
    (tmp_path / "blocks.json").write_text(json.dumps(runnable))
    (tmp_path / "runner.py").write_text(RUNNER)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"}
    work = tmp_path / "work"
    work.mkdir()
    result = subprocess.run([sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "blocks.json"), str(GUIDE)],
                            cwd=work, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"a guide example failed (exit {result.returncode}):\n{output[-6000:]}"
    assert "all blocks ran" in result.stdout
    assert result.stdout.count("guide block at line") == len(runnable)
