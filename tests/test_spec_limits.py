"""Issue 26, case 8: a spec value the filesystem or numpy cannot take never crashes the CLI — exit 2 and one
``comlrl:`` line naming the field, before Prefect, MLflow or a model is started (flows/path_limits.py,
flows/spec.py, the config's seed range in comlrl/trainers/config.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from comlrl.parallel.distributed import DataParallel
from comlrl.seeding import MAX_SEED, capture_rng_state, restore_rng_state
from comlrl.trainers import IACConfig, MAGRPOConfig
from flows.spec import SpecError, parse_spec
import test_spec_security as security

ROOT = Path(__file__).resolve().parent.parent
COMLRL = str(Path(sys.executable).parent / "comlrl")
LETTERS = (ROOT / "flows" / "specs" / "letters.yaml").read_text()
NAME_MAX = os.pathconf(ROOT, "PC_NAME_MAX")
LONG = "x" * (NAME_MAX + 45)


def spec_with(tmp_path: Path, old: str, new: str) -> Path:
    """The bundled letters spec with one line changed, written under ``tmp_path``."""
    assert old in LETTERS
    path = tmp_path / "spec.yaml"
    path.write_text(LETTERS.replace(old, new, 1))
    return path


def refused(tmp_path: Path, *arguments: str) -> str:
    """Run ``comlrl run ARGUMENTS`` (root: the repository); assert it was refused before anything started, as
    one ``comlrl:`` line; that line."""
    workdir = tmp_path / "work"
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_", "MLFLOW_"))}
    result = subprocess.run([COMLRL, "run", *arguments, *(["--workdir", str(workdir)] if "--workdir" not in
                                                            arguments else [])],
                            env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("comlrl: "), lines
    assert "Traceback" not in result.stderr and not result.stdout.strip()
    assert not workdir.exists(), sorted(p.name for p in workdir.iterdir())  # no runs/, prefect/, mlflow/
    return lines[0]


@pytest.mark.parametrize("old, new, field, says", [
    ("name: letters-demo", f"name: {LONG}", "name: ", "longer than 63 characters"),
    ("train: data/letters/demo_train.parquet", f"train: data/{LONG}.parquet", "dataset.train: ",
     f"a path component of {len(LONG) + 8} bytes"),
    ("agent_model: {tiny: {architecture: llama, vocab_size: 96, seed: 0}}", f"agent_model: ./models/{LONG}",
     "models.agent_model: ", f"a path component of {len(LONG)} bytes"),
    ("  seed: 0\n  disable_tqdm", f"  seed: {2**64}\n  disable_tqdm", "config.seed: ",
     f"got {2**64} (allowed: 0 <= seed <= {MAX_SEED})"),
    ("  seed: 0\n  disable_tqdm", "  seed: -1\n  disable_tqdm", "config.seed: ",
     f"got -1 (allowed: 0 <= seed <= {MAX_SEED})"),
], ids=["long-name", "long-dataset-path", "long-model-dir", "seed-2**64", "seed--1"])
def test_a_value_the_filesystem_or_numpy_cannot_take_is_one_line_and_exit_2(old, new, field, says, tmp_path):
    line = refused(tmp_path, str(spec_with(tmp_path, old, new)), "--root", str(ROOT))
    assert field in line and says in line, line
    if "path component" in says:
        assert f"allows at most {NAME_MAX} (PC_NAME_MAX)" in line, line


def test_a_symbolic_link_loop_under_data_is_a_problem_not_a_traceback(tmp_path):
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "data" / "one").symlink_to("two")
    (project / "data" / "two").symlink_to("one")
    (project / "data" / "eval.parquet").write_bytes((ROOT / "data" / "letters" / "eval.parquet").read_bytes())
    spec = spec_with(tmp_path, "train: data/letters/demo_train.parquet", "train: data/one/rows.parquet")
    spec.write_text(spec.read_text().replace("eval: data/letters/eval.parquet", "eval: data/eval.parquet"))
    line = refused(tmp_path, str(spec), "--root", str(project))
    assert "dataset.train: 'data/one/rows.parquet' cannot be looked up" in line and "ELOOP" in line, line


@pytest.mark.parametrize("option", ["--workdir", "--root"])
def test_an_over_long_path_option_is_refused_before_anything_starts(option, tmp_path):
    value = str(tmp_path / "work" / LONG)
    line = refused(tmp_path, "flows/specs/letters.yaml", option, value)
    assert line.startswith(f"comlrl: {option}: ") and f"allows at most {NAME_MAX} (PC_NAME_MAX)" in line, line


def test_a_workdir_must_leave_room_for_the_run_files_below_it(tmp_path):
    path_max = os.pathconf(ROOT, "PC_PATH_MAX")
    deep = str(tmp_path / "work" / "/".join(["d" * 99] * ((path_max - 400) // 100)))
    line = refused(tmp_path, "flows/specs/letters.yaml", "--workdir", deep)
    assert f"comlrl adds up to 512 below it, where this filesystem allows at most {path_max}" in line, line


SPEC = {**security.SPEC, "name": "limits"}  # the smallest valid spec (tests/test_spec_security.py)


def problems_of(data: dict, root: Path) -> dict[str, str]:
    with pytest.raises(SpecError) as caught:
        parse_spec(data, "s.yaml", root)
    return dict(caught.value.problems)


@pytest.fixture
def project(tmp_path) -> Path:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "rows.jsonl").write_text('{"prompt": "a cat"}\n')
    return tmp_path


@pytest.mark.parametrize("section, field, value, says", [
    ("name", "name", "a\x00b", r"contains '\x00'"),
    ("name", "name", "run/../../etc", "contains '/'"),
    ("name", "name", "bell\x07", r"contains '\x07'"),
    ("registry", "registry.model_name", "m" * 64, "is longer than 63 characters"),
    ("registry", "registry.alias", "-option", "starts with '-'"),
])
def test_names_that_become_files_are_portable_file_names(section, field, value, says, project):
    data = {**SPEC, section: {field.split(".")[1]: value} if section == "registry" else value}
    problems = problems_of(data, project)
    assert says in problems[field] and "letters, digits, '.', '_' and '-'" in problems[field], problems


def test_an_entry_point_path_argument_too_long_or_with_nul_is_named(project):
    source = {"entry_point": "comlrl.tasks.letters:rows", "kwargs": {"path": f"data/{LONG}.jsonl",
                                                                             "other": "data/a\x00b.jsonl"}}
    problems = problems_of({**SPEC, "dataset": {"train": source}}, project)
    assert f"a path component of {len(LONG) + 6} bytes" in problems["dataset.train.kwargs.path"], problems
    assert "contains a NUL character" in problems["dataset.train.kwargs.other"], problems


def test_a_tiny_model_seed_numpy_cannot_take_is_refused(project):
    data = {**SPEC, "models": {"agent_model": {"tiny": {"architecture": "llama", "seed": MAX_SEED + 1}}}}
    assert "models.agent_model.tiny.seed" in problems_of(data, project)


@pytest.mark.parametrize("config_class", [MAGRPOConfig, IACConfig])
@pytest.mark.parametrize("seed", [-1, MAX_SEED + 1, 2**64])
def test_a_config_seed_outside_numpys_range_is_refused_at_construction(config_class, seed):
    with pytest.raises(ValueError) as caught:
        config_class(seed=seed)
    message = str(caught.value)
    assert f"{config_class.__name__}.seed must be" in message and f"got {seed}" in message, message
    assert f"(allowed: 0 <= seed <= {2**32 - 1})" in message, message


@pytest.mark.parametrize("seed", [0, MAX_SEED])
def test_the_ends_of_the_seed_range_construct_and_seed_every_generator(seed):
    from comlrl.seeding import set_seed

    config = MAGRPOConfig(seed=seed)
    state = capture_rng_state()
    try:
        set_seed(config.seed)  # numpy, torch and random all take it
    finally:
        restore_rng_state(state)


def test_an_integer_field_beyond_int64_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"MAGRPOConfig.max_new_tokens must fit in 64 bits .*got 9223372036854775808"):
        MAGRPOConfig(max_new_tokens=2**63)


def test_a_derived_rank_seed_stays_in_numpys_range():
    """Rank and step offsets on the largest seed used to pass 2**32 and fail in np.random.seed."""
    state = capture_rng_state()
    try:
        DataParallel(rank=3, world_size=4).seed(MAX_SEED, global_step=10**6)
    finally:
        restore_rng_state(state)
