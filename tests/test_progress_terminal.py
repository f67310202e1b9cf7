"""``comlrl run`` on a terminal draws a progress bar (steps, the current reward, elapsed and time left); in a
log that is not a terminal it draws none (flows.console.attach_bar).

The terminal is a real pseudo-terminal: ``comlrl run`` writes its standard error to it as it would to an
operator's shell.
"""

from __future__ import annotations

import fcntl
import io
import logging
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import yaml

from comlrl.tasks.letters import write_dataset
from letters_spec import letters_spec


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_is_drawn_on_a_terminal_only():
    from flows.console import attach_bar

    progress = logging.getLogger("flows.progress")
    before = (list(progress.handlers), progress.level, progress.propagate)
    assert attach_bar(io.StringIO()) is None and progress.handlers == before[0]  # a log file or a pipe: nothing
    screen, seen = Terminal(), []
    log = logging.Handler(logging.DEBUG)
    log.emit = seen.append  # what reaches the handlers above (the console's log lines, the flow-run log)
    logging.getLogger().addHandler(log)
    console = attach_bar(screen)
    try:
        progress.info("training", extra={"progress": {"kind": "start", "total": 4, "done": 0}})
        progress.debug("step 3/4", extra={"progress": {"kind": "step", "done": 3, "reward": 0.25}})
        console.close_bar()
    finally:
        logging.getLogger().removeHandler(log)
        progress.handlers[:] = before[0]
        progress.setLevel(before[1])
        progress.propagate = before[2]
    assert re.search(r"training: +75%.*3/4.*reward=0\.250", screen.getvalue()), screen.getvalue()
    # the INFO record goes on as before; the per-step DEBUG record feeds the bar only
    assert [record.getMessage() for record in seen] == ["training"]


@pytest.mark.slow
@pytest.mark.e2e
def test_comlrl_run_on_a_terminal_shows_the_bar(tmp_path):
    root = tmp_path / "project"
    write_dataset(root / "data" / "letters", num_train=8, num_eval=2)
    spec = letters_spec("bar", num_generations=2, max_new_tokens=4, num_train_epochs=2, per_device_train_batch_size=2)
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_", "MLFLOW_"))}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", COLUMNS="120")
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # 40 rows, 160 columns
    with open(tmp_path / "out.log", "w") as out:
        process = subprocess.Popen([str(Path(sys.executable).parent / "comlrl"), "run", str(root / "spec.yaml"),
                                    "--root", str(root), "--run-id", "bar", "--workdir", str(tmp_path / "work")],
                                   env=env, stdout=out, stderr=secondary, start_new_session=True)
    os.close(secondary)
    screen = b""
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([primary], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(primary, 65536)
                except OSError:  # the terminal closed: the process has ended
                    break
                if not chunk:
                    break
                screen += chunk
            elif process.poll() is not None:
                break
        assert process.wait(timeout=60) == 0, screen.decode(errors="replace")[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
        os.close(primary)
    text = screen.decode(errors="replace")
    # a bar over the run's 8 steps (4 rows / batch 2 x 2 epochs), with the reward and the time left
    assert re.search(r"training: +100%.*8/8 \[\d+:\d+<\d+:\d+.*reward=", text), text[-3000:]
    assert re.search(r"[\r\n]  epoch 2 · reward", text), text[-3000:]  # the boundary line, written above the bar
