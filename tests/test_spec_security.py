"""Run specs cannot execute arbitrary code, and are validated before anything loads: the import
allow-list (comlrl/imports.py), duplicate keys and alias bombs (flows/spec_yaml.py), agent
counts and model options (flows/spec.py)."""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from flows.build import load_dataset_source
from flows.spec import DatasetSource, SpecError, load_spec, parse_spec
from comlrl.imports import ALLOWED_MODULES_VARIABLE, ImportRefused, check_import_path, resolve_callable
from flows.spec_yaml import MAX_EXPANDED_NODES, MAX_SPEC_BYTES, read_spec_yaml

SPEC = {
    "name": "secure",
    "algorithm": "magrpo",
    "models": {"agent_model": {"tiny": {"architecture": "llama", "vocab_size": 96}}},
    "dataset": {"train": "data/rows.jsonl"},
    "reward": "comlrl.tasks.letters:letters_reward",
    "config": {"num_agents": 2, "num_generations": 2},
}


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """A spec root with one dataset file; the operator's allow-list starts empty."""
    monkeypatch.delenv(ALLOWED_MODULES_VARIABLE, raising=False)
    root = tmp_path / "project"
    (root / "data").mkdir(parents=True)
    (root / "data" / "rows.jsonl").write_text('{"prompt": "a cat"}\n{"prompt": "a dog"}\n')
    return root


def problems_of(data, root) -> dict[str, str]:
    with pytest.raises(SpecError) as caught:
        parse_spec(data, "s.yaml", root)
    return dict(caught.value.problems)


@pytest.fixture
def marker_module(tmp_path, monkeypatch):
    """A module on sys.path, outside the spec root, that writes a marker file when it is imported."""
    name = f"marker_{uuid.uuid4().hex[:8]}"
    directory = tmp_path / "elsewhere"
    directory.mkdir()
    marker = tmp_path / "imported.txt"
    (directory / f"{name}.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "def reward(*completions):\n    return [0.0] * len(completions[0])\n"
        "from os import system as shell\n")
    monkeypatch.syspath_prepend(str(directory))
    yield name, marker
    sys.modules.pop(name, None)


def test_a_subprocess_dataset_entry_point_is_refused_and_never_runs(project, tmp_path):
    target = tmp_path / "pwned"
    spec_file = tmp_path / "evil.yaml"
    spec_file.write_text(yaml.safe_dump({**SPEC, "dataset": {
        "train": {"entry_point": "subprocess:run", "kwargs": {"args": ["touch", str(target)]}}}}))
    with pytest.raises(SpecError) as caught:
        load_spec(spec_file, project)
    problems = dict(caught.value.problems)
    assert "'subprocess:run' is refused" in problems["dataset.train.entry_point"], problems
    # The build path goes through the same check: a spec object that skipped validation cannot run it either.
    with pytest.raises(ValueError, match="'subprocess:run' is refused"):
        load_dataset_source(DatasetSource(entry_point="subprocess:run", kwargs={"args": ["touch", str(target)]}), project)
    assert not target.exists()


@pytest.mark.parametrize("path", ["os:system", "builtins:exec", "builtins:eval", "importlib:import_module",
                                  "runpy:run_path"])
def test_process_and_exec_entry_points_are_refused_even_when_listed(path, project, monkeypatch):
    monkeypatch.setenv(ALLOWED_MODULES_VARIABLE, "os,builtins,importlib,runpy")
    problems = problems_of({**SPEC, "reward": path}, project)
    assert f"{path!r} is refused" in problems["reward"] and "even when" in problems["reward"], problems


DOCUMENTED_REFUSALS = ["subprocess", "os", "posix", "pty", "signal", "multiprocessing", "builtins", "sys", "importlib",
                       "pkgutil", "runpy", "code", "pdb", "timeit", "profile", "doctest", "ctypes", "pickle", "marshal",
                       "shelve", "shutil", "site", "pip", "dill", "cloudpickle", "joblib"]


def test_every_documented_refusal_is_refused_by_name(monkeypatch):
    """docs/pipeline.md, "What a spec may run": these never pass, even when listed; nothing is imported."""
    monkeypatch.setenv(ALLOWED_MODULES_VARIABLE, ",".join(DOCUMENTED_REFUSALS + ["torch", "numpy", "pandas", "yaml"]))
    for module in DOCUMENTED_REFUSALS:
        with pytest.raises(ImportRefused, match="even when"):
            check_import_path(f"{module}.sub:anything", None)
    for path in ["torch:load", "numpy:load", "pandas:read_pickle", "yaml:load"]:
        with pytest.raises(ImportRefused, match="loads pickled objects"):
            check_import_path(path, None)


def test_a_module_outside_the_allow_list_is_refused_without_being_imported(project, marker_module):
    name, marker = marker_module
    problems = problems_of({**SPEC, "reward": f"{name}:reward", "formatters": [f"{name}:reward"] * 2}, project)
    assert f"module {name!r} is not on the spec allow-list" in problems["reward"], problems
    assert ALLOWED_MODULES_VARIABLE in problems["reward"] and "formatters[1]" in problems
    assert not marker.exists() and name not in sys.modules
    # The operator's list is configuration, never part of the spec.
    assert "allowed_modules" in problems_of({**SPEC, "allowed_modules": [name]}, project)


def test_the_same_module_is_allowed_when_the_operator_lists_it(project, marker_module, monkeypatch):
    name, marker = marker_module
    monkeypatch.setenv(ALLOWED_MODULES_VARIABLE, f"some.other, {name}")
    spec = parse_spec({**SPEC, "reward": f"{name}:reward"}, "s.yaml", project)
    assert marker.read_text() == "ran"
    assert resolve_callable(spec.reward, project)(["a", "b"], ["c", "d"]) == [0.0, 0.0]
    # A listed module's re-export of a refused function is still refused (it is defined in posix).
    problems = problems_of({**SPEC, "reward": f"{name}:shell"}, project)
    assert "defined in module 'posix'" in problems["reward"], problems


def test_modules_of_the_spec_root_are_allowed_and_nothing_reaches_through_them(project):
    name = f"task_{uuid.uuid4().hex[:8]}"
    (project / f"{name}.py").write_text("import os\nfrom pathlib import Path\n"
                                        "def reward(*completions):\n    return [1.0] * len(completions[0])\n")
    try:
        spec = parse_spec({**SPEC, "reward": f"{name}:reward"}, "s.yaml", project)
        function = resolve_callable(spec.reward, project)
        assert Path(sys.modules[name].__file__).parent == project.resolve() and function(["a"], ["b"]) == [1.0]
        assert str(project) not in sys.path and str(project.resolve()) not in sys.path
        (project / "json.py").write_text("")
        (project / "yaml.py").write_text("")
        problems = problems_of({**SPEC, "reward": f"{name}:os.system", "reward_processor": f"{name}:Path",
                                "transition": "comlrl.trainers.base:set_seed",
                                "formatters": [f"{name}:reward.__globals__", "json:loads"],
                                "dataset": {"train": "data/rows.jsonl", "eval": {"entry_point": "yaml:safe_load"}}},
                               project)
        assert "'os' is a module" in problems["reward"], problems
        assert "defined in module 'pathlib'" in problems["reward_processor"], problems
        assert "only comlrl.tasks may be named" in problems["transition"], problems
        assert "dunder attributes" in problems["formatters[0]"], problems
        assert "has the name of the standard-library module 'json'" in problems["formatters[1]"], problems
        assert "has the name of the module 'yaml' found at" in problems["dataset.eval.entry_point"], problems
    finally:
        sys.modules.pop(name, None)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return path


def test_python_tags_are_refused(project, tmp_path):
    target = tmp_path / "pwned"
    with pytest.raises(SpecError, match="not valid YAML: could not determine a constructor"):
        load_spec(write(tmp_path, f"name: !!python/object/apply:os.system ['touch {target}']\n"), project)
    assert not target.exists()


def test_duplicate_keys_name_the_key_and_the_line(project, tmp_path):
    text = yaml.safe_dump(SPEC, sort_keys=False)
    text = text.replace("config:\n", "config:\n  num_generations: 8\n") + "name: again\n"
    with pytest.raises(SpecError) as caught:
        load_spec(write(tmp_path, text), project)
    problems = dict(caught.value.problems)
    lines = text.splitlines()
    assert problems["name"] == (f"duplicate key 'name' at line {len(lines)} (first at line 1); keep one of them")
    first, second = [i + 1 for i, line in enumerate(lines) if line.strip().startswith("num_generations")]
    assert f"duplicate key 'num_generations' at line {second} (first at line {first})" in problems["config.num_generations"]
    # A merge key is not a duplicate: explicit keys override what it brings, as YAML defines.
    assert read_spec_yaml("base: &b {x: 1, y: 2}\nother: {<<: *b, x: 3}\n")["other"] == {"x": 3, "y": 2}


def test_an_alias_bomb_and_an_oversized_file_are_refused_quickly(project, tmp_path):
    # Nine levels of ten aliases each: 10**9 nodes once expanded, 400 bytes on disk.
    levels = ["l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 9)]
    path = write(tmp_path, yaml.safe_dump(SPEC) + "\n".join(levels) + "\n")
    started = time.perf_counter()
    with pytest.raises(SpecError) as caught:
        load_spec(path, project)
    assert time.perf_counter() - started < 2.0
    assert f"more than {MAX_EXPANDED_NODES} nodes" in str(caught.value)
    path.write_text(yaml.safe_dump(SPEC) + "# " + "x" * MAX_SPEC_BYTES + "\n")
    with pytest.raises(SpecError, match=f"a run spec is at most {MAX_SPEC_BYTES}"):
        load_spec(path, project)


def test_the_number_of_agents_must_match_config_num_agents(project):
    tiny = {"tiny": {"architecture": "llama", "vocab_size": 96}}
    problems = problems_of({**SPEC, "models": {"agents": [tiny, tiny, tiny]}}, project)
    assert problems["models.agents"].startswith("agents length (3) must match num_agents (2): agents has 3 entries but the number of agents is 2"), problems
    assert "config.num_agents=2" in problems["models.agents"]
    problems = problems_of({**SPEC, "algorithm": "maac", "models": {"agent_model": tiny, "critics": [tiny, tiny]}}, project)
    assert "critics must have exactly one element; got 2" in problems["models.critics"], problems


def test_model_options_need_known_keys_and_dtypes(project):
    problems = problems_of({**SPEC, "model_options": {"dtype": "float33", "torch_dtype": "float16"}}, project)
    assert problems["model_options.dtype"] == "'float33' is not one of ['float32', 'float16', 'bfloat16']"
    assert "takes no model option 'torch_dtype'" in problems["model_options.torch_dtype"]
    assert parse_spec({**SPEC, "model_options": {"dtype": "bfloat16"}}, "s.yaml", project).model_options["dtype"] == "bfloat16"


# ----- every path a spec names stays under the documented roots (issue 26, case 6) ---------------------
def test_paths_outside_the_roots_are_refused_at_validation(project, tmp_path):
    outside = tmp_path / "outside"
    (outside / "model").mkdir(parents=True)
    (outside / "model" / "config.json").write_text("{}")
    (outside / "rows").mkdir()
    cases = {
        "models.agent_model": dict(SPEC, models={"agent_model": str(outside / "model")}),
        "dataset.train.name": dict(SPEC, dataset={"train": {"name": str(outside / "rows")}}),
        "dataset.train.kwargs.directory": dict(SPEC, dataset={"train": {
            "entry_point": "comlrl.tasks.letters:write_dataset", "kwargs": {"directory": str(outside / "written")}}}),
    }
    for field, data in cases.items():
        problems = problems_of(data, project)
        assert field in problems, (field, problems)
        assert "outside" in problems[field] or "leaves the project directory" in problems[field] or "is a path" in problems[field]
    assert not (outside / "written").exists()
    # inside the roots the same kinds of value are fine
    (project / "models" / "m").mkdir(parents=True)
    (project / "models" / "m" / "config.json").write_text("{}")
    assert parse_spec(dict(SPEC, models={"agent_model": str(project / "models" / "m")}), "s.yaml", project)
    assert parse_spec(dict(SPEC, dataset={"train": {"name": "org/hub-dataset"}}), "s.yaml", project)
    with pytest.raises(ValueError, match="is a path"):
        load_dataset_source(DatasetSource(name=str(outside / "rows")), project)  # the build checks again


def test_a_root_module_that_links_elsewhere_is_refused_before_it_is_imported(project, tmp_path):
    marker = tmp_path / "imported.txt"
    (tmp_path / "evil.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
                                      "def reward(*c):\n    return [0.0] * len(c[0])\n")
    (project / "linked_reward.py").symlink_to(tmp_path / "evil.py")
    problems = problems_of(dict(SPEC, reward="linked_reward:reward"), project)
    assert "symbolic link" in problems["reward"] and "was not imported" in problems["reward"]
    assert not marker.exists()
    sys.modules.pop("linked_reward", None)
