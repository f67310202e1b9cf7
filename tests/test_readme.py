"""The README's and the training page's Python examples run as written, and the test tiers are as documented."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
TRAINING = README.parent / "docs" / "training.md"  # rewards, formatters, multi-turn
GETTING_STARTED = README.parent / "docs" / "getting-started.md"  # set-up and the test tiers


def python_blocks(document: Path = README) -> list[str]:
    return re.findall(r"```python\n(.*?)```", document.read_text(), flags=re.S)


def test_training_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    block = next(b for b in python_blocks() if "MAGRPOTrainer(" in b)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    assert len(namespace["history"]) == 8
    assert (tmp_path / "saved-models/run-1/agent_1/model.safetensors").is_file()


def test_transition_example_returns_one_prompt_per_agent():
    block = next(b for b in python_blocks(TRAINING) if "def transition" in b)
    namespace: dict = {}
    exec(block, namespace)
    prompts = namespace["transition"]("task", ["a", "b"], 2)
    assert prompts == ["task\nYour last answer: a\nImprove it.", "task\nYour last answer: b\nImprove it."]


def test_the_two_tiers_are_as_the_readme_says():
    """The README prints the test command and `test -m e2e`; the test command deselects the end-to-end tier,
    `test -m e2e` runs it, .ci/run runs both, and every module docs/getting-started.md names as a home of the
    tier's guarantees has tests in it."""
    root = README.parent
    readme = README.read_text()
    assert "bash infra/bootstrap.sh test " in readme and "bash infra/bootstrap.sh test -m e2e\n" in readme
    text = GETTING_STARTED.read_text()
    paragraph = text[text.index("only home of these guarantees"):text.index("[Timings](performance.md#timings).",
                                                                            text.index("only home of these guarantees"))]
    modules = sorted(set(re.findall(r"`(tests/test_\w+\.py)`", paragraph)))
    assert len(modules) >= 10, modules
    for module in modules:  # read, not collected: a module may skip at import (no psycopg, no selenium)
        source = (root / module).read_text()
        assert "pytest.mark.e2e" in source and "\ndef test_" in source, module
    bootstrap = (root / "infra" / "bootstrap.sh").read_text()
    # A later -m (e.g. `test -m e2e`) replaces the first, and a later -n the workers (docs/getting-started.md).
    assert '-m pytest -m "not e2e" -n "${COMLRL_TEST_WORKERS:-2}" --dist loadfile "$@"' in bootstrap
    ci = (root / ".ci" / "run").read_text()
    assert "bash infra/bootstrap.sh test ||" in ci and "bash infra/bootstrap.sh test -m e2e" in ci
