"""The registry side of a run: the team model and the per-agent models, registered with their tags.

Registered names for a spec whose ``registry.model_name`` (default: its name) is ``NAME``:

- ``NAME-team``: the team model (:mod:`comlrl.team_model`), an MLflow pyfunc holding every agent;
  prompts in, each agent's completion out. What consumers call.
- ``NAME-agent-<i>``: each agent alone, an MLflow ``transformers`` text-generation model
  (:func:`comlrl.tracking.register_agents`), for those who want one agent.

Both bound a prompt as the run's rollout does (its last tokens that fit, :mod:`comlrl.rollout.generation`):
the team through its saved settings, each agent through its saved tokenizer and pipeline settings. The input
examples (the first eval rows) are stored cut the same way (:func:`bounded_example`).

Every version carries the run's tags (``comlrl.run_id``, ``comlrl.algorithm``,
``comlrl.spec_hash``, ``mlflow.run_id``) and the spec's alias (``candidate``); the team version
also ``comlrl.agent_versions`` (the agent versions of the same run). Registration is idempotent per
MLflow run: a re-run of a finished run finds its versions instead of registering new ones, and tags them
again (a stop between a version and its tags leaves nothing missing after the resume). The alias moves once
every version is registered and tagged (:func:`point_alias`).

Aliases move model by model (MLflow has no transaction over several models, nor a read of several at one
instant), so the team is the unit: read ``NAME-team@ALIAS`` and, for one agent, the version its
``comlrl.agent_versions`` names. Every move of a team's alias (:func:`move_team_alias`: a run's ``candidate``,
the gate's and ``comlrl promote``'s ``champion``) keeps a second rule for those who read ``NAME-agent-i@ALIAS``
directly: at no instant does an agent's alias name a version of another team than the one ``NAME-team@ALIAS``
names; during a move (and after a SIGKILL inside one) an agent may have no alias at all. A move a kill left
half done is completed by the next one (:func:`half_moved`, :func:`repair_team_alias`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from comlrl import tracking
from comlrl.tracking import mlflow_client
from flows.spec import RunSpec

if TYPE_CHECKING:
    from comlrl.team_model import TeamSettings
# comlrl.rollout.generation and comlrl.team_model (torch, transformers) are imported by the functions that
# register: the alias functions below serve `comlrl promote`, which should start in seconds.

AGENT_VERSIONS_TAG = "comlrl.agent_versions"  # on a team version: json {agent model: version} it was made of
# A prompt for the per-agent models' input example when the eval set gives none.
DEFAULT_EXAMPLE = "tell me about the cat"


def team_model_name(base: str) -> str:
    return f"{base}-team"


def example_prompts(trainer: Any, count: int = 2) -> list[str]:
    """Prompts of the eval set (else the train set) for input examples, bounded (:func:`bounded_example`)."""
    return [row["prompt"] for row in example_rows(trainer, count)]


def example_rows(trainer: Any, count: int = 2) -> list[dict[str, str]]:
    """Rows of the eval set (else the train set) for the team's input example: the prompt, bounded
    (:func:`bounded_example`), and the row's other text fields, which formatters may read (the coding task's
    ``entry_point``)."""
    dataset = trainer.eval_dataset if trainer.eval_dataset is not None else trainer.train_dataset
    rows = [dataset[index] for index in range(min(count, len(dataset)))]
    rows = [{key: value for key, value in row.items() if isinstance(value, str)} for row in rows if row.get("prompt")]
    rows = [row for row in rows if isinstance(row.get("prompt"), str)] or [{"prompt": DEFAULT_EXAMPLE}]
    return [{**row, "prompt": bounded_example(trainer, row["prompt"])} for row in rows]


def prompt_limits(trainer: Any) -> list[int | None]:
    """The prompt tokens each agent's rollout keeps (None: all of them)."""
    from comlrl.rollout.generation import prompt_token_limit

    rollout = trainer.rollout_spec
    return [prompt_token_limit(agent, rollout.sampling.max_new_tokens, rollout.max_prompt_length)
            for agent in trainer.agents]


def bounded_example(trainer: Any, prompt: str) -> str:
    """``prompt`` as the run's rollout feeds it (:func:`comlrl.rollout.generation.bounded_prompt`: its last tokens
    that fit, cut on the left), the shortest over the agents. MLflow runs the model on an input example when it
    logs one, and keeps it with the model: an eval prompt of any size must cost no more than training's."""
    from comlrl.rollout.generation import bounded_prompt

    return min((bounded_prompt(tokenizer, prompt, limit)
                for tokenizer, limit in zip(trainer.tokenizers, prompt_limits(trainer))), key=len)


def team_settings(trainer: Any, spec: RunSpec) -> TeamSettings:
    from comlrl.team_model import TeamSettings

    return TeamSettings.from_rollout(trainer.rollout_spec, trainer.num_agents, trainer.dtype, spec.formatters,
                                     spec.transition)


def _entry(name: str, version: str, alias: str) -> dict[str, str]:
    return {"name": name, "version": str(version), "alias": alias, "uri": f"models:/{name}@{alias}"}


def register_team(identity: dict[str, Any], trainer: Any, spec: RunSpec, tags: dict[str, str], alias: str,
                  directory: str | Path, agent_versions: Sequence[dict[str, str]]) -> dict[str, str]:
    """Save the team (weights as safetensors directories, settings as JSON), log it as a pyfunc model
    of the MLflow run with signature and input example, register it as ``NAME-team``, tag it, alias it."""
    import mlflow

    from comlrl.team_model import log_team_model, save_team

    name = team_model_name(spec.registered_name)
    client = mlflow_client(identity["tracking_uri"])
    existing = [v for v in client.search_model_versions(f"name = '{name}'") if v.run_id == identity["run_id"]]
    if existing:
        version = str(existing[0].version)
    else:
        settings = team_settings(trainer, spec)
        save_team(trainer, directory, settings)
        mlflow.set_tracking_uri(identity["tracking_uri"])
        with mlflow.start_run(run_id=identity["run_id"]):
            info = log_team_model(directory, settings, example_rows(trainer))
        version = str(mlflow.register_model(info.model_uri, name).version)
    # Every call, the version found too: a registration stopped between the version and its tags is completed.
    versions = {entry["name"]: entry["version"] for entry in agent_versions}
    for key, value in {**tags, AGENT_VERSIONS_TAG: json.dumps(versions)}.items():
        client.set_model_version_tag(name, version, key, value)
    return _entry(name, version, alias)


def point_alias(tracking_uri: str, team: dict[str, str], agents: Sequence[dict[str, str]], alias: str) -> None:
    """Point ``alias`` at the run's versions, the team's and its agents' together (:func:`move_team_alias`)."""
    move_team_alias(tracking_uri, team["name"], team["version"],
                    {entry["name"]: entry["version"] for entry in agents}, alias)


def move_team_alias(tracking_uri: str, team: str, version: str, agents: Mapping[str, str],
                    alias: str) -> list[dict[str, str | None]]:
    """Point ``alias`` at team ``version`` and at its ``agents`` (``agent model -> version``) in the one order that
    keeps every reader on one whole team: each agent whose alias names another version loses it (that version kept
    as the model's tag ``previous_<alias>``, for a rollback by hand), then the team's alias moves, which is the
    switch, then the agents' (:func:`comlrl.tracking.move_aliases`). Before the switch an agent's alias names the
    old team's version or none, after it the new team's or none. Returns ``name``, ``version`` and ``previous`` (the
    holder before, None: none) for each agent, then the team."""
    client = mlflow_client(tracking_uri)
    wanted = {**agents, team: str(version)}
    holders = {name: holder(client, name, alias) for name in wanted}
    stale = [name for name in agents if holders[name] not in (None, wanted[name])]
    for name in stale:
        client.set_registered_model_tag(name, f"previous_{alias}", holders[name])
    for name in stale:
        client.delete_registered_model_alias(name, alias)
    tracking.move_aliases(tracking_uri, {name: wanted[name] for name in [team, *agents]
                                         if holders[name] != wanted[name]}, alias)
    return [{"name": name, "version": number, "previous": holders[name]} for name, number in wanted.items()]


def holder(client: Any, name: str, alias: str) -> str | None:
    """The version of registered model ``name`` that holds ``alias`` (None: none), read with MLflow ``client``."""
    version = client.get_registered_model(name).aliases.get(alias)
    return None if version is None else str(version)


@dataclass(frozen=True)
class HalfMoved:
    """A team alias whose agents' aliases do not all name the versions of the team that holds it: a move stopped
    between its writes (a SIGKILL, a second stop signal, a server that stopped answering)."""

    team: str
    version: str  # the team version holding the alias
    alias: str
    members: dict[str, str]  # agent model -> version, as that team version records them
    found: dict[str, str | None]  # the agents that disagree -> the version their alias names (None: none)

    def describe_team(self) -> str:
        """The team holding the alias and the versions it names: ``NAME-team v1 (NAME-agent-0 v1, ...)``."""
        agents = ", ".join(f"{name} v{number}" for name, number in self.members.items())
        return f"{self.team} v{self.version} ({agents})"

    def describe(self) -> str:
        found = ", ".join(f"{name} {'without it' if number is None else f'v{number}'}"
                          for name, number in self.found.items())
        return (f"{self.team}@{self.alias} was half moved, a move stopped between its alias writes (v{self.version} "
                f"beside {found})")


def half_moved(tracking_uri: str, team: str, alias: str) -> HalfMoved | None:
    """What a stopped move of ``alias`` left (None: the agents' aliases name the versions of the team holding it,
    or no team version holds it, or it does not record its agents)."""
    client = mlflow_client(tracking_uri)
    version = holder(client, team, alias)
    members = team_members(tracking_uri, team, version) if version is not None else None
    if not members:
        return None
    found = {name: holder(client, name, alias) for name in members}
    disagree = {name: number for name, number in found.items() if number != members[name]}
    return HalfMoved(team, version, alias, members, disagree) if disagree else None


def repair_team_alias(tracking_uri: str, team: str, alias: str) -> str | None:
    """Complete a half-moved ``alias`` (:func:`half_moved`) onto the agents of the team version that holds it: one
    line saying what was found and done, None when there was nothing to repair."""
    found = half_moved(tracking_uri, team, alias)
    if found is None:
        return None
    move_team_alias(tracking_uri, team, found.version, found.members, alias)
    return f"{found.describe()}; completed: every {alias} alias now names {found.describe_team()}"


def team_versions(tracking_uri: str, base: str, num_agents: int, alias: str) -> dict[str, str] | None:
    """``agent model -> version`` of the team that holds ``alias`` (its :data:`AGENT_VERSIONS_TAG`); for a team
    registered without that tag, or none, the agents' own ``alias``. None when an agent has no version."""
    team, names = team_model_name(base), tracking.agent_model_names(base, num_agents)
    held = tracking.aliased_versions(tracking_uri, [team], alias)
    members = team_members(tracking_uri, team, held[team]) if held is not None else None
    if members is not None and sorted(members) == sorted(names):
        return {name: members[name] for name in names}
    return tracking.aliased_versions(tracking_uri, names, alias)


def team_members(tracking_uri: str, team: str, version: str) -> dict[str, str] | None:
    """``agent model -> version`` that team ``version`` was registered with (None for a team registered
    without :data:`AGENT_VERSIONS_TAG`)."""
    recorded = version_tags(tracking_uri, team, version).get(AGENT_VERSIONS_TAG)
    return {str(name): str(number) for name, number in json.loads(recorded).items()} if recorded else None


def register_agents(identity: dict[str, Any], trainer: Any, spec: RunSpec, tags: dict[str, str],
                    alias: str) -> list[dict[str, str]]:
    """Every agent as its own text-generation model (``NAME-agent-<i>``), with an input example; served, it keeps
    as many prompt tokens as its rollout does."""
    entries = tracking.register_agents(identity, trainer.agents, trainer.tokenizers, spec.registered_name, tags, None,
                                       input_example=example_prompts(trainer, 1)[0],
                                       signature=agent_signature(trainer.args.max_new_tokens),
                                       prompt_limits=prompt_limits(trainer))
    return [_entry(entry["name"], entry["version"], alias) for entry in entries]  # aliased with the team


def agent_signature(max_new_tokens: int) -> Any:
    """A prompt in, its continuation out; ``max_new_tokens`` and ``do_sample`` as inference params
    (given, MLflow need not generate at logging time to infer it)."""
    from mlflow.models import infer_signature

    return infer_signature("a prompt", "a prompt and its continuation",
                           params={"max_new_tokens": int(max_new_tokens), "do_sample": True})


def version_tags(tracking_uri: str, name: str, version: str) -> dict[str, str]:
    return dict(mlflow_client(tracking_uri).get_model_version(name, version).tags)


def set_version_tags(tracking_uri: str, versions: dict[str, str], tags: dict[str, str]) -> None:
    client = mlflow_client(tracking_uri)
    for name, version in versions.items():
        for key, value in tags.items():
            client.set_model_version_tag(name, version, key, value)
