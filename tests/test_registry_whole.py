"""Issue 42 item 10: the registry changes as a whole. A team version names the agent versions it was made of
(``comlrl.agent_versions``); a promotion moves exactly those and the team last, so the champion is always a team
that was registered, whatever moves the agents' aliases meanwhile (a run registering, or one that died half
way); retraining reads the champion through its team; a registration stopped between a version and its tags is
completed by the resume. A real MLflow registry (SQLite, in tmp_path) holds real registered models and versions;
what is asserted is read back with MlflowClient, never through the functions under test."""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient

from flows import build, gate, registry
from flows.spec import parse_spec
from letters_spec import letters_spec

BASE = "whole"
TEAM, AGENTS = f"{BASE}-team", [f"{BASE}-agent-0", f"{BASE}-agent-1"]


def source(name: str) -> str:
    """Where a version's files would be (MLflow records it; nothing here loads them)."""
    return f"file:///tmp/whole-registry-sources/{name}"


@pytest.fixture
def client(tmp_path) -> MlflowClient:
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    for name in [TEAM, *AGENTS]:
        client.create_registered_model(name)
    return client


def register(client: MlflowClient, team_tagged: bool = True, decision: str = "promoted") -> dict[str, str]:
    """One run's versions (as registration leaves them, before any alias moves): each agent, then the team
    naming them; ``name -> version``."""
    versions = {name: str(client.create_model_version(name, source=source(name)).version) for name in AGENTS}
    team = str(client.create_model_version(TEAM, source=source(TEAM)).version)
    if team_tagged:
        client.set_model_version_tag(TEAM, team, "comlrl.agent_versions", json.dumps(versions))
    client.set_model_version_tag(TEAM, team, "comlrl.gate.decision", decision)
    return {**versions, TEAM: team}


def holders(client: MlflowClient, alias: str) -> dict[str, str]:
    return {name: str(client.get_model_version_by_alias(name, alias).version) for name in [TEAM, *AGENTS]}


def uri(client: MlflowClient) -> str:
    return client._registry_uri


def test_promote_moves_the_candidate_team_with_its_own_agents_while_a_run_moves_agent_aliases(client):
    first = register(client)
    registry.point_alias(uri(client), {"name": TEAM, "version": first[TEAM]},
                         [{"name": name, "version": first[name]} for name in AGENTS], "candidate")
    second = register(client)
    # A second run is half way through moving its candidate alias (agent 0 moved, agent 1 and the team not),
    # or died there: a promote now must not make agent-0 v2 the champion beside team v1.
    client.set_registered_model_alias(AGENTS[0], "candidate", second[AGENTS[0]])
    moved = gate.promote(uri(client), BASE)
    assert holders(client, "champion") == first  # team v1 with the agents it was made of
    assert [entry["name"] for entry in moved] == [*AGENTS, TEAM]  # the team last
    # Retraining from the champion, and the gate's view of it, read the agents through the team.
    spec = parse_spec({**letters_spec(BASE)}, "spec.yaml", ".")
    assert gate.champion_versions(uri(client), spec, 2) == {name: first[name] for name in AGENTS}
    pinned = build.with_registered_agents(spec, uri(client), "champion")
    assert pinned.models["agents"] == [f"models:/{name}/{first[name]}" for name in AGENTS]


def test_a_team_registered_without_its_agents_tag_is_promoted_by_each_models_alias(client):
    old = register(client, team_tagged=False)
    for name, version in old.items():
        client.set_registered_model_alias(name, "candidate", version)
    gate.promote(uri(client), BASE)
    assert holders(client, "champion") == old


def test_the_gate_refusal_still_holds_and_force_moves_exactly_the_team(client):
    first = register(client, decision="kept champion")
    for name, version in first.items():
        client.set_registered_model_alias(name, "candidate", version)
    with pytest.raises(ValueError, match="did not pass the champion/challenger gate"):
        gate.promote(uri(client), BASE)
    with pytest.raises(Exception):
        client.get_model_version_by_alias(TEAM, "champion")  # nothing moved
    gate.promote(uri(client), BASE, force=True)
    assert holders(client, "champion") == first


def test_a_registration_stopped_before_its_tags_is_completed_by_the_resume(client, tmp_path):
    """The versions exist for this MLflow run but carry no tags (a SIGKILL between creating and tagging): a
    resume's registration finds them, registers nothing new, and tags them; then the alias moves."""
    import mlflow

    mlflow.set_tracking_uri(uri(client))
    run_id = client.create_run(client.create_experiment("whole")).info.run_id
    for name in [*AGENTS, TEAM]:
        client.create_model_version(name, source=source(name), run_id=run_id)
    identity = {"tracking_uri": uri(client), "run_id": run_id}
    spec = parse_spec(letters_spec(BASE), "spec.yaml", ".")
    tags = {"comlrl.run_id": "run-1", "comlrl.spec_hash": "ab" * 32, "mlflow.run_id": run_id}
    from comlrl import tracking

    # The existing versions are found, so no model is logged: the models and tokenizers are not needed.
    agents = [registry._entry(entry["name"], entry["version"], "candidate")
              for entry in tracking.register_agents(identity, [None, None], [None, None], BASE, tags, None)]
    team = registry.register_team(identity, None, spec, tags, "candidate", tmp_path / "team", agents)
    registry.point_alias(uri(client), team, agents, "candidate")
    assert [len(client.search_model_versions(f"name = '{name}'")) for name in [*AGENTS, TEAM]] == [1, 1, 1]
    for index, name in enumerate(AGENTS):
        assert client.get_model_version(name, "1").tags == {**tags, "agent_index": str(index)}
    assert client.get_model_version(TEAM, "1").tags == {**tags, "comlrl.agent_versions": json.dumps(
        {AGENTS[0]: "1", AGENTS[1]: "1"})}
    assert holders(client, "candidate") == {TEAM: "1", AGENTS[0]: "1", AGENTS[1]: "1"}


@pytest.mark.parametrize("stopped", ["after the tags", "after the alias moved"])
def test_a_gate_stopped_after_its_decision_is_completed_with_that_decision_not_a_new_one(client, stopped, monkeypatch):
    """The first run's gate: no champion yet, promoted. A stop (SIGKILL) after its tags (before the alias move),
    or after the alias move: the resume's gate finds the decision the team version records and completes it:
    the same decision ("no champion yet", not "already champion"), the alias on exactly these versions."""
    from comlrl import tracking

    spec = parse_spec(letters_spec(BASE), "spec.yaml", ".")
    versions = {name: str(client.create_model_version(name, source=source(name)).version) for name in AGENTS}
    versions[TEAM] = str(client.create_model_version(TEAM, source=source(TEAM)).version)
    client.set_model_version_tag(TEAM, versions[TEAM], "comlrl.agent_versions",
                                 json.dumps({name: versions[name] for name in AGENTS}))
    evaluation = {"eval/reward_mean": 0.25}
    if stopped == "after the tags":
        moved = []
        monkeypatch.setattr(tracking, "move_aliases", lambda *args: moved.append(args) or (_ for _ in ()).throw(
            KeyboardInterrupt("stopped before the alias moved")))
        with pytest.raises(KeyboardInterrupt):
            gate.run_gate(spec, evaluation, versions, uri(client), ".", ".", "candidate")
        monkeypatch.undo()
        assert moved and not client.get_registered_model(TEAM).aliases  # tagged, not moved
    else:
        gate.run_gate(spec, evaluation, versions, uri(client), ".", ".", "candidate")
    assert client.get_model_version(TEAM, versions[TEAM]).tags["comlrl.gate.reason"] == "no champion yet"

    again = gate.run_gate(spec, evaluation, versions, uri(client), ".", ".", "candidate")
    assert (again.promoted, again.reason, again.champion, again.candidate_score) == (True, "no champion yet", None, 0.25)
    assert holders(client, "champion") == versions
    for name, version in versions.items():
        tags = client.get_model_version(name, version).tags
        assert (tags["comlrl.gate.decision"], tags["comlrl.gate.reason"], tags["comlrl.gate.champion"]) == \
            ("promoted", "no champion yet", ""), name
