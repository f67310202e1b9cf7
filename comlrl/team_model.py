"""The team model: every agent of a run as one model — prompts in, each agent's completion out.

A team model runs the joint generation the trainer runs (its formatters, its sampling settings
and, with ``num_turns > 1``, its external transition between turns) through the library's own
:func:`comlrl.rollout.episodes.rollout_episodes`, one joint sample per prompt.

It is stored as plain files, so loading it runs no code shipped with the model::

    team.json        format, number of agents, dtype, the rollout settings and the import
                     paths of the formatters / transition (no pickled objects)
    agent_0/ ...     one Hugging Face directory per agent (config, safetensors weights, tokenizer)

MLflow loads it through this module (``loader_module="comlrl.team_model"``: MLflow imports the
installed ``comlrl`` and calls :func:`_load_pyfunc`); nothing is cloudpickled and no code is
copied into the model. Import paths in ``team.json`` are resolved through the pipeline's
allow-list (:func:`comlrl.imports.resolve_callable`), as a run spec's are: the bundled
``comlrl.tasks`` and modules the operator lists in ``COMLRL_SPEC_ALLOWED_MODULES``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from comlrl.data import resolve_formatters
from comlrl.models import entities
from comlrl.rollout.episodes import RolloutSpec, rollout_episodes
from comlrl.rollout.generation import SamplingParams

FORMAT = "comlrl-team/1"
SETTINGS_FILE = "team.json"
# What a consumer needs to load a team model besides comlrl itself.
REQUIREMENTS = ["torch", "transformers", "tokenizers", "safetensors", "pandas"]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class TeamSettings:
    """What ``team.json`` holds: everything the joint generation needs besides the weights."""

    num_agents: int
    sampling: dict[str, Any]
    num_turns: int = 1
    joint_mode: str = "aligned"
    passthrough: bool = False
    max_prompt_length: int | None = None
    prompt_overflow: str = "truncate"
    formatters: list[str] | None = None
    transition: str | None = None
    dtype: str = "float32"

    @classmethod
    def from_rollout(cls, rollout: RolloutSpec, num_agents: int, dtype: torch.dtype,
                     formatters: str | Sequence[str] | None, transition: str | None) -> "TeamSettings":
        """From a trainer's rollout settings; ``formatters`` / ``transition`` are the import paths
        (``package.module:function``) the callables were resolved from."""
        if rollout.transition is not None and transition is None:
            raise ValueError("the trainer has an external transition but no import path for it was given; "
                             "a team model names its code by import path only")
        paths = [formatters] * num_agents if isinstance(formatters, str) else formatters
        names = {value: key for key, value in DTYPES.items()}
        return cls(num_agents=num_agents, sampling=dataclasses.asdict(rollout.sampling), num_turns=rollout.num_turns,
                   joint_mode=rollout.joint_mode, passthrough=rollout.passthrough,
                   max_prompt_length=rollout.max_prompt_length, prompt_overflow=rollout.prompt_overflow,
                   formatters=list(paths) if paths is not None else None, transition=transition,
                   dtype=names.get(dtype, "float32"))

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **dataclasses.asdict(self)}, indent=2)

    @classmethod
    def from_json(cls, text: str, source: str) -> "TeamSettings":
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{source} is not a team model settings file (expected format {FORMAT!r}, "
                             f"got {data.get('format') if isinstance(data, dict) else type(data).__name__!r})")
        fields = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields - {"format"})
        if unknown:
            raise ValueError(f"{source} has unknown fields {unknown}; known: {sorted(fields)}")
        settings = cls(**{key: value for key, value in data.items() if key != "format"})
        if settings.dtype not in DTYPES:
            raise ValueError(f"{source}: dtype {settings.dtype!r} is not one of {sorted(DTYPES)}")
        if settings.formatters is not None and len(settings.formatters) != settings.num_agents:
            raise ValueError(f"{source}: {len(settings.formatters)} formatters for {settings.num_agents} agents")
        return settings

    def output_columns(self) -> list[str]:
        """``agent_<i>`` (the last turn's completion), and ``agent_<i>_turn_<t>`` with several turns."""
        columns = [f"agent_{agent}" for agent in range(self.num_agents)]
        if self.num_turns > 1:
            columns += [f"agent_{agent}_turn_{turn}" for agent in range(self.num_agents)
                        for turn in range(1, self.num_turns + 1)]
        return columns


def resolve_import_path(path: str) -> Callable:
    """The callable ``path`` names, allowed by the pipeline's allow-list (bundled tasks and the modules
    listed in ``COMLRL_SPEC_ALLOWED_MODULES``); raises a ValueError naming the path otherwise."""
    from comlrl.imports import resolve_callable

    return resolve_callable(path, None)


class TeamModel:
    """Loaded agents plus their rollout settings; :meth:`generate` runs one joint episode per row."""

    def __init__(self, agents: Sequence[Any], tokenizers: Sequence[Any], settings: TeamSettings,
                 resolve: Callable[[str], Callable] = resolve_import_path) -> None:
        if len(agents) != settings.num_agents or len(tokenizers) != settings.num_agents:
            raise ValueError(f"a team of {settings.num_agents} agents got {len(agents)} models and "
                             f"{len(tokenizers)} tokenizers")
        self.agents, self.tokenizers, self.settings = list(agents), list(tokenizers), settings
        formatters = [resolve(path) for path in settings.formatters] if settings.formatters else None
        self.rollout_spec = RolloutSpec(
            formatters=tuple(resolve_formatters(formatters, settings.num_agents)),
            sampling=SamplingParams(**settings.sampling),
            num_generations=1,
            num_turns=settings.num_turns,
            joint_mode=settings.joint_mode,
            transition=resolve(settings.transition) if settings.transition else None,
            passthrough=settings.passthrough,
            max_prompt_length=settings.max_prompt_length,
            prompt_overflow=settings.prompt_overflow,
        )

    @classmethod
    def load(cls, directory: str | Path, device: str | torch.device | None = None) -> "TeamModel":
        """A saved team (:func:`save_team`) on ``device`` (default: the first GPU if any, else the CPU)."""
        directory = Path(directory)
        settings_path = directory / SETTINGS_FILE
        if not settings_path.is_file():
            raise ValueError(f"{directory} holds no {SETTINGS_FILE}: not a team model directory")
        settings = TeamSettings.from_json(settings_path.read_text(), str(settings_path))
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        sources = [str(directory / f"agent_{agent}") for agent in range(settings.num_agents)]
        tokenizers = [entities.load_tokenizer(source) for source in sources]
        loaded = entities.load_models(sources, tokenizers, device, DTYPES[settings.dtype], "agent")
        for model in loaded.models:
            model.eval()
        return cls(loaded.models, loaded.tokenizers, settings)

    def generate(self, rows: Sequence[dict[str, Any]], seed: int = 0, **sampling: Any) -> list[dict[str, str]]:
        """Each agent's completion for every row (a dict with ``prompt`` and whatever the formatters
        read); ``sampling`` overrides fields of the saved sampling settings (``temperature``,
        ``max_new_tokens``, ``do_sample``, ...). The same ``seed`` gives the same completions."""
        unknown = sorted(set(sampling) - {field.name for field in dataclasses.fields(SamplingParams)})
        if unknown:
            raise ValueError(f"unknown sampling settings {unknown}; known: {sorted(self.settings.sampling)}")
        spec = self.rollout_spec.replace(sampling=dataclasses.replace(self.rollout_spec.sampling, **sampling))
        devices = sorted({next(agent.parameters()).device.index or 0 for agent in self.agents
                          if next(agent.parameters()).device.type == "cuda"})
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(seed)
            rollout = rollout_episodes(self.agents, self.tokenizers, spec, list(rows))
        turns = [rollout.joint_completions(turn) for turn in range(len(rollout.turns))]
        # One joint sample per row: with num_generations=1 every turn has one node per row.
        results = []
        for row in range(len(rows)):
            result = {f"agent_{agent}": turns[-1][agent][row] for agent in range(self.settings.num_agents)}
            if self.settings.num_turns > 1:
                result.update({f"agent_{agent}_turn_{turn + 1}": turns[turn][agent][row]
                               for agent in range(self.settings.num_agents) for turn in range(len(turns))})
            results.append(result)
        return results

    def predict(self, model_input: Any, params: dict[str, Any] | None = None) -> Any:
        """The pyfunc entry point: rows (a DataFrame with a ``prompt`` column, a list of dicts or of
        strings) in, a DataFrame with one column per agent out; ``params``: ``seed`` and sampling overrides."""
        import pandas

        params = dict(params or {})
        seed = int(params.pop("seed", 0))
        results = self.generate(input_rows(model_input), seed=seed, **params)
        return pandas.DataFrame(results, columns=self.settings.output_columns())


def input_rows(model_input: Any) -> list[dict[str, Any]]:
    """Rows from what a pyfunc receives: a DataFrame, a dict of columns, a list of dicts or of prompts."""
    import pandas

    if isinstance(model_input, pandas.DataFrame):
        rows = model_input.to_dict(orient="records")
    elif isinstance(model_input, dict):
        rows = pandas.DataFrame(model_input).to_dict(orient="records")
    elif isinstance(model_input, str):
        rows = [{"prompt": model_input}]
    else:
        rows = [{"prompt": item} if isinstance(item, str) else dict(item) for item in model_input]
    missing = [index for index, row in enumerate(rows) if not row.get("prompt")]
    if missing:
        raise ValueError(f"team model input rows {missing[:5]} have no 'prompt'; give a 'prompt' column")
    return rows


def save_team(trainer: Any, directory: str | Path, settings: TeamSettings) -> Path:
    """Export the trainer's agents (``trainer.save_model``: merged LoRA, gathered FSDP shards) and the
    settings as a team model directory."""
    directory = Path(directory)
    trainer.save_model(directory)
    (directory / SETTINGS_FILE).write_text(settings.to_json() + "\n")
    return directory


def _load_pyfunc(data_path: str) -> TeamModel:
    """MLflow's loader-module hook (``mlflow.pyfunc.load_model`` and ``mlflow models serve``)."""
    return TeamModel.load(data_path)


def signature(settings: TeamSettings, columns: Sequence[str] = ("prompt",)) -> Any:
    """Input: a ``prompt`` column and, optional, the other text ``columns`` the formatters may read (the coding
    task's ``entry_point``); output: one string column per agent (and per turn); params: ``seed``,
    ``temperature``, ``max_new_tokens``, ``do_sample`` with the saved defaults."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema

    sampling = settings.sampling
    inputs = [ColSpec("string", "prompt")] + [ColSpec("string", column, required=False)
                                              for column in columns if column != "prompt"]
    return ModelSignature(
        inputs=Schema(inputs),
        outputs=Schema([ColSpec("string", column) for column in settings.output_columns()]),
        params=ParamSchema([
            ParamSpec("seed", "long", 0),
            ParamSpec("temperature", "double", float(sampling["temperature"])),
            ParamSpec("max_new_tokens", "long", int(sampling["max_new_tokens"])),
            ParamSpec("do_sample", "boolean", bool(sampling.get("do_sample", True))),
        ]),
    )


def log_team_model(directory: str | Path, settings: TeamSettings, examples: Sequence[str | dict[str, str]],
                   name: str = "team") -> Any:
    """Log a saved team directory as a pyfunc model of the active MLflow run (loader module: this
    module) with its signature and an input example; returns MLflow's ``ModelInfo``. ``examples`` are prompts
    or rows of text fields (a ``prompt`` and whatever else the formatters read, which the signature then takes)."""
    import mlflow
    import pandas

    rows = [{"prompt": example} if isinstance(example, str) else dict(example) for example in examples]
    columns = list(dict.fromkeys(column for row in rows for column in row))
    return mlflow.pyfunc.log_model(
        name=name,
        loader_module=__name__,
        data_path=str(directory),
        signature=signature(settings, columns),
        input_example=pandas.DataFrame(rows, columns=columns),
        pip_requirements=REQUIREMENTS,
    )
