"""Run specifications: one YAML file describing a training run, validated before anything loads.

A spec is data: it is read with PyYAML's safe loader (no tags that build Python objects; duplicate
keys and oversized alias expansions are errors, :mod:`flows.spec_yaml`), and the only code it can
name is by import path (``package.module:function``) for rewards (or a reward factory with its keyword
arguments, :class:`RewardSource`), formatters, transitions and dataset entry points, each checked against the allow-list of :mod:`comlrl.imports` before
anything is imported. :func:`load_spec` checks the whole file and raises :class:`SpecError` listing
every problem with its path in the file (``config.num_generations``, ``dataset.train.path`` ...),
before any model loads.

Example (``flows/specs/letters.yaml`` is the bundled demo)::

    name: letters-demo
    algorithm: magrpo                      # magrpo | iac | maac | marlhf | marlhf_iter
    models:
      agent_model: {tiny: {architecture: llama, vocab_size: 96}}   # or a hub id / directory
    dataset:
      train: data/letters/train.parquet    # Parquet/JSONL under data/, {name: ...}, {entry_point: ...}
      eval: data/letters/eval.parquet
    reward: comlrl.tasks.letters:letters_reward
    config: {num_agents: 2, num_generations: 4, num_train_epochs: 3}
    execution: {task_runner: dask}         # optional: one Prefect task per agent on Dask (docs/scale-out.md, "Distributed task runner")
"""

from __future__ import annotations


import hashlib
import inspect
import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator,
                      model_validator)

from comlrl.trainers.algorithms import ALGORITHMS
from comlrl.imports import IMPORT_PATH, resolve_callable
from comlrl.seeding import MAX_SEED
from flows.path_limits import checked_path, os_error_problem, path_problem, shown
from flows.spec_yaml import MAX_SPEC_BYTES, SpecYAMLError, read_spec_yaml

NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
NAME_LENGTH = 63  # the longest NAME: the run directory <name>-<hash> stays far below any file-name limit
DATA_SUFFIXES = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}
# Constructor arguments a spec may not set: they come from other sections.
MANAGED_ARGUMENTS = {"self", "args", "reward_func", "reward_processor", "formatters", "external_transition",
                     "train_dataset", "eval_dataset", "callbacks", "num_agents", "tokenizer", "wandb_config",
                     "model_config"}
# What the models section may set, of the arguments a trainer takes.
MODEL_ARGUMENTS = {"agent_model", "agents", "critic_model", "critics"}
DTYPES = ("float32", "float16", "bfloat16")  # torch names, as transformers' from_pretrained(dtype=...) reads them
ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


class SpecError(ValueError):
    """An invalid run spec; ``problems`` lists ``(path, message)`` pairs."""

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        self.source = source
        self.problems = problems
        if len(problems) == 1:  # one line: what a shell user reads first
            path, message = problems[0]
            super().__init__(f"invalid run spec {source}: {path + ': ' if path else ''}{message}")
            return
        lines = "\n".join(f"  - {path or '(top level)'}: {message}" for path, message in problems)
        super().__init__(f"invalid run spec {source}: {len(problems)} problem(s)\n{lines}")


def check_name(value: str) -> str:
    """``value`` if it can be the run's name: it becomes a directory (``runs/<name>-<hash>``), the MLflow
    experiment and the registered models' names, so it is a short portable file name; a ValueError otherwise."""
    if re.fullmatch(NAME, value):
        return value
    odd = sorted({character for character in value if not re.fullmatch(r"[A-Za-z0-9._-]", character)})
    if len(value) > NAME_LENGTH:
        why = f"is longer than {NAME_LENGTH} characters"
    elif odd:
        why = f"contains {', '.join(repr(character) for character in odd)}"
    else:
        why = "is empty" if not value else f"starts with {value[0]!r}"
    raise ValueError(f"{shown(value)} {why}: a name may hold only letters, digits, '.', '_' and '-', start with a "
                     f"letter or digit, and be at most {NAME_LENGTH} characters (it names the run's directory, MLflow "
                     f"experiment and registered models)")


def check_run_id(run_id: str) -> None:
    """A ``ValueError`` unless ``run_id`` is a safe directory name: letters, digits, '.', '_', '-', at most 128,
    not starting with '.' or '-' (so never '..', a path or an option)."""
    if not re.fullmatch(NAME.replace("{0,62}", "{0,127}"), run_id):
        raise ValueError(f"run id {run_id!r} may hold only letters, digits, '.', '_' and '-', start with a letter "
                         f"or digit, and be at most 128 characters long")


Name = Annotated[str, AfterValidator(check_name)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TinyModel(Strict):
    architecture: Literal["llama", "gpt2"] = "llama"
    vocab_size: int = Field(96, ge=32, le=4096)
    hidden_size: int | None = Field(None, ge=8, le=1024)
    seed: int = Field(0, ge=0, le=MAX_SEED)


class TinySource(Strict):
    """A tiny randomly initialised model built locally (``comlrl.tiny``); no hub needed."""

    tiny: TinyModel


ModelSource = Union[str, TinySource]


class DatasetSource(Strict):
    """Exactly one of ``path`` (Parquet/JSONL under data/), ``name`` (a ``datasets`` name that
    resolves locally), or ``entry_point`` (``package.module:function`` returning rows)."""

    path: str | None = None
    name: str | None = None
    config: str | None = None
    split: str = "train"
    entry_point: str | None = Field(None, pattern=IMPORT_PATH)
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def one_source(self) -> "DatasetSource":
        given = [key for key in ("path", "name", "entry_point") if getattr(self, key)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of path, name, entry_point (got {given or 'none'})")
        return self


class DataSpec(Strict):
    train: Union[str, DatasetSource]
    eval: Union[str, DatasetSource, None] = None


class CheckpointSpec(Strict):
    keep: int | None = Field(None, ge=1, description="Keep only the newest K checkpoints (None = all).")


class RegistrySpec(Strict):
    model_name: Name | None = Field(None, description="Registered models are <model_name>-agent-<i>.")
    alias: Name = "candidate"


class ExecutionSpec(Strict):
    """Where the flow runs each agent's share of a stage. Never changes what is trained, so it is not
    part of the spec hash: a run may be resumed under another task runner."""

    task_runner: Literal["default", "dask"] = Field(
        "default", description="'default': agents' work runs inside the stage tasks (comlrl.parallel.placement.map_by_device); "
                               "'dask': one agent_work task per agent on a prefect-dask DaskTaskRunner.")
    dask_address: str | None = Field(
        None, description="A running Dask scheduler (tcp://host:8786) whose workers are threads of the flow's process; "
                          "default: the flow starts an in-process LocalCluster.")
    dask_workers: int = Field(2, ge=1, le=64,
                              description="Worker threads of the in-process LocalCluster: agents at work at once.")
    steps_per_task: int | None = Field(
        None, ge=1, description="Training steps per Prefect task in an epoch's subflow (default: all of the epoch's "
                                "steps in one task; 1: a task per step). Stage timings are metrics either way.")

    @field_validator("dask_address")
    @classmethod
    def scheduler_address(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^([a-z]+://)?[^\s/:]+(:\d+)?(/\S*)?$", value):
            raise ValueError(f"{value!r} is not a Dask scheduler address such as tcp://10.0.0.5:8786")
        return value

    @model_validator(mode="after")
    def dask_fields_need_dask(self) -> "ExecutionSpec":
        given = sorted({"dask_address", "dask_workers"} & self.model_fields_set)
        if self.task_runner != "dask" and given:
            raise ValueError(f"{', '.join(given)} apply only with task_runner: dask "
                             f"(task_runner is {self.task_runner!r})")
        if self.dask_address and "dask_workers" in given:
            raise ValueError("dask_workers sizes the flow's own LocalCluster; with dask_address the scheduler's "
                             "cluster brings its own workers: drop one of the two")
        return self


ImportPath = str  # checked by comlrl.imports.resolve_callable, so every bad path is reported with its location


class RewardSource(Strict):
    """A reward built by a factory: ``entry_point`` (``package.module:function``) called with ``kwargs``, e.g.
    the coding task with its sandbox's settings,
    ``{entry_point: comlrl.tasks.coding:make_reward, kwargs: {isolation: full, workers: 2, timeout: 10}}``."""

    entry_point: str = Field(pattern=IMPORT_PATH)
    kwargs: dict[str, Any] = Field(default_factory=dict)

    def build(self, root: Path) -> Any:
        """The reward: the factory, through the allow-list as at validation, called with ``kwargs``."""
        return resolve_callable(self.entry_point, root)(**self.kwargs)


RewardEntry = Union[ImportPath, RewardSource]


class RunSpec(Strict):
    name: Name = Field(description="Run and MLflow experiment name.")
    algorithm: str
    models: dict[str, Union[ModelSource, list[ModelSource]]]
    dataset: DataSpec
    reward: Union[RewardEntry, list[RewardEntry]]
    reward_processor: ImportPath | None = None
    formatters: Union[ImportPath, list[ImportPath], None] = None
    transition: ImportPath | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    model_options: dict[str, Any] = Field(default_factory=dict, description="The trainer's model_config (dtype, ...).")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    registry: RegistrySpec = Field(default_factory=RegistrySpec)
    execution: ExecutionSpec = Field(default_factory=ExecutionSpec)
    _built: Any = PrivateAttr(default=None)  # (config as JSON, the config built from it)

    @property
    def registered_name(self) -> str:
        return self.registry.model_name or self.name

    def classes(self) -> tuple[type, type]:
        """The trainer and config classes of ``algorithm``."""
        return ALGORITHMS[self.algorithm].load()

    @property
    def trainer_config(self) -> Any:
        """The trainer's config built from ``config``: once per spec and config (building one checks it, and
        may warn)."""
        key = json.dumps(self.config, sort_keys=True, default=str)
        if self._built is None or self._built[0] != key:
            self._built = (key, self.classes()[1](**self.config))
        return self._built[1]


def _where(location: tuple[Any, ...]) -> str:
    # pydantic adds union-branch names ("str", "TinySource", "list[...]") to locations; drop them.
    parts = [str(part) for part in location if not re.match(r"^(str|int|none|TinySource|DatasetSource|RewardSource|list\[.*\]|function-.*)$", str(part))]
    return ".".join(parts)


def data_path(value: str, root: Path) -> Path:
    """A dataset file under ``root/data``; ``..`` and absolute paths elsewhere are refused."""
    data_root = (root / "data").resolve()
    path = checked_path(value, root)
    if not path.is_relative_to(data_root):
        raise ValueError(f"{value!r} is outside the data directory {str(data_root)!r}")
    if path.suffix not in DATA_SUFFIXES:
        raise ValueError(f"{value!r} must be a .parquet, .jsonl or .json file")
    if not path.is_file():
        raise ValueError(f"{value!r} does not exist (looked for {str(path)!r})")
    return path


def looks_like_a_path(value: Any) -> bool:
    return isinstance(value, str) and (value.startswith(("/", ".", "~")) or os.sep in value or "\\" in value)


def dataset_name(value: str, root: Path) -> str:
    """A hub dataset name; a path (which ``datasets.load_dataset`` would read from disk) is refused."""
    if problem := path_problem(value, root, what="name"):  # looked up on disk below, so it must fit there
        raise ValueError(problem)
    local = (value.startswith(("/", ".", "~")) or value.count("/") > 1 or "\\" in value
             or (root / value).exists() or Path(value).exists())
    if local:
        raise ValueError(f"{value!r} is a path, not a hub dataset name: a dataset on disk goes in path (a file "
                         f"under {str((root / 'data').resolve())!r})")
    return value


def entry_point_paths(kwargs: dict[str, Any], root: Path) -> list[tuple[str, str]]:
    """``(keyword, problem)`` for every keyword argument of a dataset entry point that names a path outside
    ``root/data`` (the only place a spec may make an entry point read or write)."""
    data_root = (root / "data").resolve()
    problems = []
    for key, value in kwargs.items():
        if looks_like_a_path(value):
            try:
                path = checked_path(os.path.expanduser(value), root)
            except ValueError as error:
                problems.append((key, str(error)))
                continue
            if not path.is_relative_to(data_root):
                problems.append((key, f"{value!r} is outside the data directory {str(data_root)!r}"))
    return problems


def model_path_or_id(value: str, root: Path) -> str:
    """A local directory (relative to ``root``, kept inside it) or a hub identifier / registry URI."""
    if value.startswith("models:/"):
        return value
    candidate = checked_path(value, root)
    looks_local = value.startswith((".", "/", "~")) or candidate.exists()
    if looks_local:
        if not candidate.is_relative_to(root.resolve()):
            raise ValueError(f"{value!r} leaves the project directory {str(root)!r} (model directories lie under "
                             "--root)")
        if not (candidate / "config.json").is_file():
            raise ValueError(f"{value!r} is not a model directory (no config.json in {str(candidate)!r})")
        return str(candidate)
    if not re.match(r"^[\w.-]+(/[\w.-]+)?$", value):
        raise ValueError(f"{value!r} is neither a model directory, a hub identifier nor a models:/ URI")
    if hub_offline() and not in_hub_cache(value):
        raise ValueError(f"{value!r} is no directory under {str(root)!r} and, as a hub id, not in the local Hugging "
                         "Face cache, and HF_HUB_OFFLINE is set: give a model directory (e.g. ./models/NAME), or "
                         "download it first")
    return value


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def in_hub_cache(repo_id: str) -> bool:
    """Whether the local Hugging Face cache holds ``repo_id``'s config.json (no network)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # not a valid repo id
        return False
    return isinstance(found, str)


def constructor_arguments(trainer_class: type) -> set[str]:
    """The argument names ``trainer_class`` takes; ``**inputs`` forwards comlrl.trainers.inputs.TrainerInputs."""
    from comlrl.trainers.inputs import input_names

    names: set[str] = set()
    for klass in trainer_class.__mro__:
        if "__init__" in vars(klass):
            for p in inspect.signature(klass.__init__).parameters.values():
                if p.kind == p.VAR_KEYWORD and p.name == "inputs":
                    names |= input_names()
                elif p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                    names.add(p.name)
    return names - MANAGED_ARGUMENTS


def spec_hash(spec: RunSpec) -> str:
    """What the run trains; ``execution`` is left out (the task runner does not change the result)."""
    data = spec.model_dump(mode="json", exclude={"execution"})
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _source_name(source: ModelSource) -> str:
    return source if isinstance(source, str) else "tiny:" + json.dumps(source.model_dump(), sort_keys=True)


def _unbuilt(trainer_class: type) -> Any:
    """A trainer instance whose ``__init__`` never ran: enough for the trainers' own checks that read no
    state (model_config keys and values, critic sources), so a spec meets the library's rules, in the
    library's words, before anything loads."""
    return object.__new__(trainer_class)


def model_problems(spec: RunSpec, trainer_class: type, config: Any) -> list[tuple[str, str]]:
    """Model sources against ``config.num_agents`` (and the critics the trainer takes), and
    ``model_options``: known keys, allowed values."""
    from comlrl.models import entities

    problems: list[tuple[str, str]] = []
    names = {key: [_source_name(s) for s in value] if isinstance(value, list) else _source_name(value)
             for key, value in spec.models.items()}
    if names.get("agent_model") or names.get("agents"):
        try:
            entities.resolve_model_list(names.get("agent_model"), names.get("agents"), config.num_agents)
        except ValueError as error:
            problems.append(("models.agents" if "agents" in names else "models",
                             f"{error} (config.num_agents={config.num_agents})"))
    model_trainer = trainer_class
    if not hasattr(trainer_class, "allowed_model_config_keys") and hasattr(config, "rl_algorithm"):
        from comlrl.trainers.preference.policy import policy_classes  # a PbRL trainer's policy trainer loads the models

        model_trainer = policy_classes(config.rl_algorithm)[0]
    elif hasattr(trainer_class, "resolve_critic_sources"):
        try:
            _unbuilt(trainer_class).resolve_critic_sources(names.get("critic_model"), names.get("critics"), config,
                                                           config.num_agents)
        except ValueError as error:
            problems.append(("models.critics" if "critics" in names else "models", str(error)))
    options = spec.model_options
    known_keys = getattr(_unbuilt(model_trainer), "allowed_model_config_keys", None)
    if known_keys is not None:
        allowed = known_keys()
        owner = model_trainer.__name__ + ("" if model_trainer is trainer_class else
                                          f" (the policy trainer of {trainer_class.__name__})")
        problems += [(f"model_options.{key}", f"{owner} takes no model option {key!r}; allowed: {sorted(allowed)}")
                     for key in options if key not in allowed]
    for key, choices in (("dtype", DTYPES), ("attn_implementation", ATTENTION_IMPLEMENTATIONS)):
        if options.get(key) is not None and options[key] not in choices:
            problems.append((f"model_options.{key}", f"{options[key]!r} is not one of {list(choices)}"))
    check_values = getattr(_unbuilt(model_trainer), "check_model_config_values", None)
    if check_values is not None:
        try:
            check_values(dict(options))
        except ValueError as error:
            problems.append(("model_options", str(error)))
    return problems


def _check_semantics(spec: RunSpec, root: Path) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    algorithm = ALGORITHMS.get(spec.algorithm)
    trainer_class = config_class = None
    if algorithm is None:
        problems.append(("algorithm", f"unknown algorithm {spec.algorithm!r}; choose one of {sorted(ALGORITHMS)}"))
    else:
        try:
            trainer_class, config_class = algorithm.load()
        except (ImportError, AttributeError) as error:
            problems.append(("algorithm", f"{spec.algorithm!r} is not available in this installation: {error}"))
    config_errors = config_problems(config_class, spec.config) if config_class is not None else []
    problems += config_errors
    if trainer_class is not None:
        allowed = constructor_arguments(trainer_class) & MODEL_ARGUMENTS
        for key in spec.models:
            if key not in allowed:
                problems.append((f"models.{key}", f"{trainer_class.__name__} takes no model argument {key!r}; "
                                                  f"allowed: {sorted(allowed)}"))
        if not config_errors and not any(path.startswith("models.") for path, _ in problems):
            problems += model_problems(spec, trainer_class, spec.trainer_config)
    if not spec.models.get("agent_model") and not spec.models.get("agents"):
        problems.append(("models", "set models.agent_model (one model copied num_agents times) or models.agents (a list)"))
    for key, value in spec.models.items():
        for index, source in enumerate(value if isinstance(value, list) else [value]):
            where = f"models.{key}" + (f"[{index}]" if isinstance(value, list) else "")
            if isinstance(source, str):
                try:
                    model_path_or_id(source, root)
                except ValueError as error:
                    problems.append((where, str(error)))
                except OSError as error:  # looking into the directory was refused (permissions, ...)
                    problems.append((where, os_error_problem(source, error)))
    for split in ("train", "eval"):
        source = getattr(spec.dataset, split)
        if source is None:
            continue
        source = DatasetSource(path=source) if isinstance(source, str) else source
        where = f"dataset.{split}" + ("" if isinstance(getattr(spec.dataset, split), str) else ".path")
        try:
            if source.path:
                data_path(source.path, root)
            elif source.name:
                where = f"dataset.{split}.name"
                dataset_name(source.name, root)
            elif source.entry_point:
                where = f"dataset.{split}.entry_point"
                problems += [(f"dataset.{split}.kwargs.{key}", problem)
                             for key, problem in entry_point_paths(source.kwargs, root)]
                resolve_callable(source.entry_point, root)
        except ValueError as error:
            problems.append((where, str(error)))
        except OSError as error:  # looking at the file was refused (permissions, ...)
            problems.append((where, os_error_problem(source.path or source.name or "", error)))
    for field in ("reward", "reward_processor", "formatters", "transition"):
        value = getattr(spec, field)
        for index, path in enumerate(value if isinstance(value, list) else [value]):
            if path is None:
                continue
            where = field + (f"[{index}]" if isinstance(value, list) else "")
            if isinstance(path, RewardSource):
                problems += reward_source_problems(path, root, where)
                continue
            try:
                resolve_callable(path, root)
            except ValueError as error:
                problems.append((where, str(error)))
    return problems


def reward_source_problems(source: RewardSource, root: Path, where: str) -> list[tuple[str, str]]:
    """A reward factory that is not allowed, or whose signature does not take ``kwargs`` (checked without
    calling it: building a reward may start its sandbox)."""
    try:
        factory = resolve_callable(source.entry_point, root)
    except ValueError as error:
        return [(f"{where}.entry_point", str(error))]
    try:
        inspect.signature(factory).bind(**source.kwargs)
    except TypeError as error:
        return [(f"{where}.kwargs", f"{source.entry_point} does not take {sorted(source.kwargs)}: {error}")]
    except ValueError:  # no signature to read: the call itself will say
        pass
    return []


def config_problems(config_class: type, values: dict[str, Any]) -> list[tuple[str, str]]:
    """Every problem of ``values`` as ``config_class(**values)``, with ``config.<field>`` paths."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(config_class)}
    problems = [(f"config.{key}", f"{config_class.__name__} has no field {key!r}") for key in values if key not in fields]
    if problems:
        return problems
    try:
        config_class(**values)
    except (ValueError, TypeError) as error:
        for message in str(error).split("; "):
            # The field is named wherever the message names it (messages may lead with comlrl 1.4.3's words).
            match = re.search(rf"{config_class.__name__}\.(\w+)", message)
            problems.append((f"config.{match.group(1)}" if match else "config", message))
    return problems


def parse_spec(data: Any, source: str = "<spec>", root: str | Path = ".") -> RunSpec:
    """Validate already-parsed spec data; raises :class:`SpecError` with every problem."""
    root = Path(root)
    if not isinstance(data, dict):
        raise SpecError(source, [("", f"a run spec is a mapping of sections, got {type(data).__name__}")])
    try:
        spec = RunSpec.model_validate(data)
    except ValidationError as error:
        problems = [(_where(item["loc"]), item["msg"].removeprefix("Value error, ")) for item in error.errors()]
        # Also report what the valid sections would have failed on, so one pass shows everything.
        partial = {key: value for key, value in data.items() if key in ("algorithm", "config") and isinstance(value, (str, dict))}
        if isinstance(partial.get("algorithm"), str) and partial["algorithm"] in ALGORITHMS and isinstance(partial.get("config", {}), dict):
            try:
                _, config_class = ALGORITHMS[partial["algorithm"]].load()
                problems += config_problems(config_class, partial.get("config", {}))
            except ImportError:
                pass
        raise SpecError(source, problems) from None
    problems = _check_semantics(spec, root)
    if problems:
        raise SpecError(source, problems)
    return spec


def load_spec(path: str | Path, root: str | Path | None = None) -> RunSpec:
    """Read and validate a YAML run spec; relative paths in it are resolved against ``root``
    (default: the working directory), and dataset files must lie under ``root/data``."""
    if problem := path_problem(str(path)):
        raise SpecError("file", [("", problem)])
    path = Path(path)
    try:
        if not path.is_file():
            raise SpecError(str(path), [("", "file not found")])
        size = path.stat().st_size
        if size > MAX_SPEC_BYTES:
            raise SpecError(str(path), [("", f"the file has {size} bytes; a run spec is at most {MAX_SPEC_BYTES}")])
        data = read_spec_yaml(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise SpecError(str(path), [("", os_error_problem(str(path), error))]) from None
    except UnicodeDecodeError as error:
        raise SpecError(str(path), [("", f"not UTF-8 text: {error}")]) from None
    except SpecYAMLError as error:
        raise SpecError(str(path), error.problems) from None
    return parse_spec(data, str(path), root if root is not None else Path.cwd())
