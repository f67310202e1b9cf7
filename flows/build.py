"""From a validated run spec to library objects: datasets, model sources, callables, the trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from flows.spec import (
    DATA_SUFFIXES,
    DatasetSource,
    RewardSource,
    RunSpec,
    TinySource,
    data_path,
    dataset_name,
    entry_point_paths,
    model_path_or_id,
)
from comlrl.imports import resolve_callable


def load_dataset_source(source: str | DatasetSource | None, root: Path) -> Any:
    if source is None:
        return None
    import datasets

    source = DatasetSource(path=source) if isinstance(source, str) else source
    if source.path:
        path = data_path(source.path, root)
        return datasets.load_dataset(DATA_SUFFIXES[path.suffix], data_files={"rows": str(path)}, split="rows")
    if source.name:
        return datasets.load_dataset(dataset_name(source.name, root), source.config, split=source.split)
    if entry_point_paths(source.kwargs, root):  # as at validation
        raise ValueError(f"dataset entry point {source.entry_point}: {entry_point_paths(source.kwargs, root)}")
    rows = resolve_callable(source.entry_point, root)(**source.kwargs)  # the allow-list again, as at validation
    return rows if isinstance(rows, datasets.Dataset) else datasets.Dataset.from_list(list(rows))


def model_source(source: str | TinySource, root: Path, workdir: Path, tracking_uri: str | None = None) -> str:
    """A loadable identifier: tiny recipes are built once under ``workdir/models``; registry URIs
    are exported there as Hugging Face directories."""
    if isinstance(source, TinySource):
        from comlrl.tiny import save_tiny_model

        tiny = source.tiny
        directory = workdir / "models" / f"tiny-{tiny.architecture}-v{tiny.vocab_size}-h{tiny.hidden_size or 'default'}-s{tiny.seed}"
        if not (directory / "config.json").is_file():
            staging = directory.with_name(directory.name + ".partial")
            save_tiny_model(staging, tiny.architecture, vocab_size=tiny.vocab_size, hidden_size=tiny.hidden_size, seed=tiny.seed)
            staging.rename(directory)
        return str(directory)
    resolved = model_path_or_id(source, root)
    if resolved.startswith("models:/"):
        import mlflow

        from comlrl.tracking import export_registered_model

        name = resolved[len("models:/"):].replace("/", "-v").replace("@", "-")
        uri = tracking_uri or mlflow.get_tracking_uri()
        return str(export_registered_model(uri, resolved, workdir / "models" / "registry" / name))
    return resolved


def _callables(value: str | RewardSource | Sequence[str | RewardSource] | None, root: Path) -> Any:
    """The spec's import paths as callables (a reward factory's reward), through the same allow-list check as
    validation."""
    if value is None:
        return None
    if isinstance(value, (str, RewardSource)):
        return _callable(value, root)
    return [_callable(path, root) for path in value]


def _callable(value: str | RewardSource, root: Path) -> Any:
    return value.build(root) if isinstance(value, RewardSource) else resolve_callable(value, root)


def build_trainer(spec: RunSpec, root: str | Path, workdir: str | Path, callbacks: Sequence[Any] = (),
                  tracking_uri: str | None = None) -> Any:
    """The trainer the spec describes (models load here, after the spec was validated);
    ``tracking_uri`` is where ``models:/`` sources are looked up."""
    root, workdir = Path(root), Path(workdir)
    trainer_class = spec.classes()[0]
    models = {
        key: [model_source(s, root, workdir, tracking_uri) for s in value] if isinstance(value, list)
        else model_source(value, root, workdir, tracking_uri)
        for key, value in spec.models.items()
    }
    return trainer_class(
        **models,
        reward_func=_callables(spec.reward, root),
        reward_processor=_callables(spec.reward_processor, root),
        formatters=_callables(spec.formatters, root),
        external_transition=_callables(spec.transition, root),
        train_dataset=load_dataset_source(spec.dataset.train, root),
        eval_dataset=load_dataset_source(spec.dataset.eval, root),
        callbacks=list(callbacks),
        model_config=spec.model_options or None,
        args=spec.trainer_config,
    )


def with_registered_agents(spec: RunSpec, tracking_uri: str, alias: str) -> RunSpec:
    """The spec with its agents replaced by the agent versions of the registry's ``alias`` team
    (:func:`flows.registry.team_versions`), pinned (``models:/NAME/VERSION``), when every agent role has one;
    otherwise the spec unchanged (e.g. before the first promotion)."""
    from flows.registry import team_versions

    versions = team_versions(tracking_uri, spec.registered_name, spec.trainer_config.num_agents, alias)
    if versions is None:
        return spec
    names = list(versions)
    models = {key: value for key, value in spec.models.items() if key not in ("agent_model", "agents")}
    models["agents"] = [f"models:/{name}/{versions[name]}" for name in names]
    return spec.model_copy(update={"models": models})
