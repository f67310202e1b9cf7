"""The layers hold: no import cycle, and no import (at module level or inside a function) from a lower
layer back up to a higher one.

Layers, lowest first (docs/architecture.md's picture):

0. ``comlrl/{errors,callbacks,config,progress,data,seeding,imports,tiny}.py`` — plain data and helpers
1. ``algorithms``, ``parallel``, ``checkpointing``, ``tracking*``, ``sandbox``, ``tasks`` — maths, devices, files,
   records, the one door for untrusted code and the tasks above it
2. ``rollout`` — sampling, generation, episodes, rewards, preference pairs
3. ``models`` — loading entities, LoRA, value heads, the joint reward model
4. ``training`` — log-probs, updates, optimizer steps, references, reward-model fit, the loop and its runs
5. ``trainers``, ``team_model`` — the algorithms' trainers and the registered team
6. ``utils`` — comlrl 1.4.3's helper names, over everything below
7. ``flows`` — orchestration
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {
    "errors": 0, "callbacks": 0, "config": 0, "progress": 0, "data": 0, "seeding": 0, "imports": 0, "tiny": 0,
    "executables": 0, "tokenizers": 0,
    "algorithms": 1, "parallel": 1, "checkpointing": 1, "tracking": 1, "tracking_spool": 1, "tracking_wandb": 1,
    "sandbox": 1, "tasks": 1, "rollout": 2, "models": 3, "training": 4, "trainers": 5, "team_model": 5, "utils": 6,
}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted([*(ROOT / "comlrl").rglob("*.py"), *(ROOT / "flows").rglob("*.py")]):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its code (relative imports resolved)."""
    known = modules()

    def owner(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
            for target in targets:
                resolved = owner(target)
                if resolved is not None and resolved != name:
                    graph[name].add(resolved)
    return graph


def layer(module: str) -> int:
    parts = module.split(".")
    if parts[0] == "flows":
        return 7
    if len(parts) == 1:
        return -1  # the package itself (its version string)
    assert parts[1] in LAYERS, f"{module}: place comlrl.{parts[1]} in a layer (tests/test_architecture.py)"
    return LAYERS[parts[1]]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_imports_at_every_level():
    graph = import_graph()
    assert "comlrl.training.run" in graph["comlrl.training.loop"]  # a function-level import
    assert "comlrl.checkpointing.runner" in graph["comlrl.training.run"]


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_no_import_from_a_lower_layer_back_up():
    upward = sorted((module, target) for module, targets in import_graph().items() for target in targets
                    if layer(target) > layer(module))
    assert upward == []


def test_the_checker_catches_a_cycle_and_an_upward_import():
    graph = {"a": {"b"}, "b": {"a"}, "c": set()}
    assert cycles(graph) == [["a", "b"]]
    assert layer("comlrl.rollout.generation") < layer("comlrl.models.entities") < layer("flows.cli")
