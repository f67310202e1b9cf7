"""The README's Python examples run as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_training_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    block = next(b for b in python_blocks() if "MAGRPOTrainer(" in b)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    assert len(namespace["history"]) == 8
    assert (tmp_path / "saved-models/run-1/agent_1/model.safetensors").is_file()


def test_transition_example_returns_one_prompt_per_agent():
    block = next(b for b in python_blocks() if "def transition" in b)
    namespace: dict = {}
    exec(block, namespace)
    prompts = namespace["transition"]("task", ["a", "b"], 2)
    assert prompts == ["task\nYour last answer: a\nImprove it.", "task\nYour last answer: b\nImprove it."]
