"""A project whose run fails where a test says: the letters task with MAGRPO on a tiny Llama, its reward
(``judge.py`` in the project) raising from the N-th call on while the file ``fail-at`` holds N. With 4 training
rows, 2 generations and batches of 2, an epoch is 2 steps and 2 reward calls: ``fail-at`` 3 fails the first step of
epoch 2, after ``checkpoint-1``. Remove ``fail-at`` (and ``calls``) and the judge is well again."""

from __future__ import annotations

from pathlib import Path

import yaml

from comlrl.tasks.letters import write_dataset
from letters_spec import letters_spec

JUDGE = '''
from pathlib import Path

from comlrl.tasks.letters import letters_reward

HERE = Path(__file__).parent


def reward(completions_0, completions_1, batch_items=None):
    calls = HERE / "calls"
    count = int(calls.read_text()) + 1 if calls.exists() else 1
    calls.write_text(str(count))
    if (HERE / "fail-at").exists() and count >= int((HERE / "fail-at").read_text()):
        raise ValueError(f"the judge is down (call {count})")
    return letters_reward(completions_0, completions_1, batch_items)
'''


def judged_project(root: Path, name: str, epochs: int, fail_at: int | None) -> Path:
    """The project at ``root`` (data, ``judge.py``, ``spec.yaml``); returns the spec's path."""
    write_dataset(root / "data" / "letters", num_train=4, num_eval=2)
    (root / "judge.py").write_text(JUDGE)
    if fail_at is not None:
        (root / "fail-at").write_text(str(fail_at))
    spec = letters_spec(name, num_generations=2, max_new_tokens=4, num_train_epochs=epochs,
                        per_device_train_batch_size=2)
    spec["reward"] = "judge:reward"
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    return root / "spec.yaml"


def heal(root: Path) -> None:
    for name in ("fail-at", "calls"):
        (root / name).unlink(missing_ok=True)
