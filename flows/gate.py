"""Champion/challenger: a run's team becomes ``champion`` only if it is at least as good as the champion.

Every run registers its team and agents as candidates (:mod:`flows.registry`). :func:`run_gate`
then evaluates the current champion in the same run, on the spec's eval set, the way the run's
own evaluation is made (``trainer.evaluate()``: same rows, same seed, same reward), and
:func:`decide` compares the two scores on the run's eval metric (``eval/reward_mean``; PbRL runs:
``eval/task_reward_mean``). Promotion moves ``champion`` to the run's own versions, the team's and its agents'
together (:func:`flows.registry.move_team_alias`: whoever reads the registry sees the old team or the new one,
whole). The decision, the metric and both scores become tags of the candidate versions (``comlrl.gate.*``) and a
Prefect artifact.

The champion is what retraining continues from: the agent versions the ``champion`` team names
(:func:`flows.registry.team_versions`, :func:`flows.build.with_registered_agents`). ``comlrl promote`` moves the
alias by hand (:func:`plan_promotion` reads, :func:`carry_out` writes); it refuses a candidate the gate found
worse unless given ``--force``. The gate and ``comlrl promote`` both complete a ``champion`` a killed move left
half done (:func:`flows.registry.repair_team_alias`) and say so.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from comlrl import tracking
from flows import build, critical, registry
from flows.boundaries import primary_eval
from comlrl.executables import executable
from comlrl.tracking import mlflow_client
from flows.registry import set_version_tags, team_members, team_model_name, team_versions, version_tags
from flows.spec import RunSpec

CHAMPION = "champion"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GateDecision:
    promoted: bool
    reason: str
    candidate: str  # "NAME-team v3"
    champion: str | None
    metric: str | None
    candidate_score: float | None
    champion_score: float | None

    def tags(self) -> dict[str, str]:
        values = {"decision": "promoted" if self.promoted else "kept champion", "reason": self.reason,
                  "metric": self.metric, "candidate_score": self.candidate_score,
                  "champion_score": self.champion_score, "champion": self.champion}
        return {f"comlrl.gate.{key}": "" if value is None else str(value) for key, value in values.items()}

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def champion_team(self) -> str | None:
        """The champion judged against, without a "(not comparable: ...)" note."""
        return self.champion.split(" (not comparable: ", 1)[0] if self.champion else None


def decide(candidate_score: float | None, champion_score: float | None, has_champion: bool) -> tuple[bool, str]:
    """Promote when there is no champion, or when the candidate scores at least the champion's score."""
    if not has_champion:
        return True, "no champion yet"
    if candidate_score is None:
        return False, (f"the run has no eval set to compare on; promote by hand with "
                       f"{executable('comlrl')} promote MODEL --force")
    if champion_score is None:
        return False, "the champion could not be evaluated on this run's eval set"
    if candidate_score >= champion_score:
        return True, f"candidate {candidate_score:.4f} >= champion {champion_score:.4f}"
    return False, f"candidate {candidate_score:.4f} < champion {champion_score:.4f}"


def champion_versions(tracking_uri: str, spec: RunSpec, num_agents: int) -> dict[str, str] | None:
    """The agent versions of the ``champion`` team (None before the first promotion)."""
    return team_versions(tracking_uri, spec.registered_name, num_agents, CHAMPION)


def evaluate_champion(spec: RunSpec, tracking_uri: str, root: str | Path, workdir: str | Path) -> dict[str, float]:
    """The champion's evaluation: the spec's trainer built with the champion agents, ``evaluate()``."""
    champion_spec = build.with_registered_agents(spec, tracking_uri, CHAMPION)
    trainer = build.build_trainer(champion_spec, root, workdir, (), tracking_uri)
    return trainer.evaluate() if trainer.eval_dataset is not None else {}


def run_gate(spec: RunSpec, evaluation: dict[str, float], candidates: dict[str, str], tracking_uri: str,
             root: str | Path, workdir: str | Path, candidate_alias: str) -> GateDecision:
    """Compare the run's candidates (``name -> version``: team and agents) with the champion, tag the
    candidate versions with the decision (the team last) and then promote them if they win. A decision an
    earlier attempt of this run recorded (a stop during the gate) is the decision: it is completed (tags, alias
    move), never made again against a champion it may already have moved."""
    team = team_model_name(spec.registered_name)
    agents = {name: version for name, version in candidates.items() if name != team}
    ordered = {**agents, **({team: candidates[team]} if team in candidates else {})}  # the team last
    label = f"{team} v{candidates[team]}" if team in candidates else ", ".join(f"{n} v{v}" for n, v in agents.items())
    # What a killed promote or gate left: the agents' aliases completed onto the team that holds the alias.
    repaired = registry.repair_team_alias(tracking_uri, team, CHAMPION) if team in candidates else None
    if repaired is not None:
        logger.warning("the gate found %s", repaired)
    current = champion_versions(tracking_uri, spec, len(agents))
    decision = recorded_decision(tracking_uri, ordered, label)
    # A recorded decision is this gate's, stopped after its tags, while the champion is the one it judged against
    # (the alias had not moved) or these versions (it had); against any other champion the gate judges anew.
    if decision is None or not (current == agents
                                or decision.champion_team == _champion_label(tracking_uri, team, current)):
        decision = new_decision(spec, evaluation, tracking_uri, root, workdir, team, agents, label, current)
        set_version_tags(tracking_uri, ordered, decision.tags())
    if decision.promoted and team in candidates:  # the run's own versions, not whatever holds the candidate alias now
        registry.move_team_alias(tracking_uri, team, candidates[team], agents, CHAMPION)
    elif decision.promoted:
        tracking.move_aliases(tracking_uri, ordered, CHAMPION)
    return decision


def new_decision(spec: RunSpec, evaluation: dict[str, float], tracking_uri: str, root: str | Path,
                 workdir: str | Path, team: str, agents: dict[str, str], label: str,
                 current: dict[str, str] | None) -> GateDecision:
    metric, candidate_score = primary_eval(evaluation)
    if current == agents:  # promoted by hand before the gate judged it
        return GateDecision(True, "already champion", label, label, metric, candidate_score, candidate_score)
    champion_label = _champion_label(tracking_uri, team, current)
    champion_score = None
    if current is not None and candidate_score is not None:
        try:
            champion_score = evaluate_champion(spec, tracking_uri, root, workdir).get(metric)
        except Exception as error:  # a champion of another shape (agents, vocabulary) cannot be compared
            champion_label = f"{champion_label} (not comparable: {str(error)[:200]})"
    promoted, reason = decide(candidate_score, champion_score, current is not None)
    return GateDecision(promoted, reason, label, champion_label, metric, candidate_score, champion_score)


def recorded_decision(tracking_uri: str, ordered: dict[str, str], label: str) -> GateDecision | None:
    """The decision the last-tagged candidate version (the team) holds, None when the gate has not finished
    tagging (then no alias has moved either: the decision is made again, the same way)."""
    name = next(reversed(ordered))
    tags = version_tags(tracking_uri, name, ordered[name])
    if "comlrl.gate.decision" not in tags:
        return None

    def value(key: str) -> str | None:
        return tags.get(f"comlrl.gate.{key}") or None

    def score(key: str) -> float | None:
        return float(value(key)) if value(key) is not None else None

    return GateDecision(tags["comlrl.gate.decision"] == "promoted", value("reason") or "", label, value("champion"),
                        value("metric"), score("candidate_score"), score("champion_score"))


def _champion_label(tracking_uri: str, team: str, current: dict[str, str] | None) -> str | None:
    if current is None:
        return None
    version = tracking.aliased_versions(tracking_uri, [team], CHAMPION)
    if version:
        return f"{team} v{version[team]}"
    return ", ".join(f"{name} v{number}" for name, number in current.items())


def registered_base_names(tracking_uri: str, base: str) -> list[str]:
    """The team and agent models registered under ``base`` (team first, agents in order)."""
    client = mlflow_client(tracking_uri)
    agents = sorted((m.name for m in client.search_registered_models(filter_string=f"name LIKE '{base}-agent-%'")),
                    key=lambda name: int(name.rsplit("-", 1)[1]) if name.rsplit("-", 1)[1].isdigit() else 0)
    team = [m.name for m in client.search_registered_models(filter_string=f"name = '{team_model_name(base)}'")]
    return team + agents


@dataclass(frozen=True)
class Promotion:
    """What ``comlrl promote`` is to move (:func:`plan_promotion`, which only reads): ``alias`` onto ``versions``,
    or, when ``refusal`` says why not, nothing but the completion of a half-moved ``alias``."""

    alias: str
    versions: dict[str, str]  # registered model -> version: the agents, then the team (when there is one)
    team: str | None  # the team model; None for agents registered without one
    half_moved: registry.HalfMoved | None  # what a stopped move of ``alias`` left, completed by this one
    refusal: str | None = None

    def describe(self) -> str:
        """What ``alias`` names once this is carried out: ``NAME-team v2 (NAME-agent-0 v2, NAME-agent-1 v2)``."""
        if self.refusal is not None:
            return self.half_moved.describe_team() if self.half_moved is not None else "as it was"
        agents = ", ".join(f"{name} v{number}" for name, number in self.versions.items() if name != self.team)
        return f"{self.team} v{self.versions[self.team]} ({agents})" if self.team in self.versions else agents


def promotion_state(promotion: Promotion | None, moment: str) -> str:
    """Where the alias stands when ``comlrl promote`` ends ``moment`` (:mod:`flows.critical`) the writes of
    ``promotion`` (None: before it was read), for the command's closing line."""
    if moment == critical.BEFORE or promotion is None:
        return "before any alias moved: nothing in the registry changed"
    if moment == critical.AFTER:
        return f"once the writes it had begun were finished: {promotion.alias} is {promotion.describe()}, whole"
    if promotion.team is None:
        return (f"during the alias writes: the agents' {promotion.alias} aliases may name versions of two runs; "
                f"run this command again to complete the move")
    return (f"during the alias writes: {promotion.team}@{promotion.alias} names one whole team (the one before, "
            f"or {promotion.describe()}) and an agent's {promotion.alias} alias may be missing; run this command "
            f"again to complete the move")


def plan_promotion(tracking_uri: str, base: str, from_alias: str = "candidate", to_alias: str = CHAMPION,
                   force: bool = False) -> Promotion:
    """Read what :func:`promote` moves: the team version ``from_alias`` names and the agent versions it was
    registered with (its ``comlrl.agent_versions``; the agents' own ``from_alias`` for a team without it, or
    without a team), and whether ``to_alias`` is half moved. A candidate the gate kept out (its
    ``comlrl.gate.decision`` tag), or one the gate never judged, is refused unless ``force``; so is a model without
    a ``from_alias`` version. Raises ValueError only when nothing is registered under ``base``."""
    names = registered_base_names(tracking_uri, base)
    if not names:
        raise ValueError(f"no registered models named {team_model_name(base)} or {base}-agent-<i> in {tracking_uri}")
    team = team_model_name(base) if names[0] == team_model_name(base) else None
    half = registry.half_moved(tracking_uri, team, to_alias) if team is not None else None
    first = tracking.aliased_versions(tracking_uri, names[:1], from_alias)
    if first is None:
        return Promotion(to_alias, {}, team, half, f"registered model {names[0]!r} has no version with alias "
                                                   f"{from_alias!r}")
    tags = version_tags(tracking_uri, names[0], first[names[0]])
    if not force and tags.get("comlrl.gate.decision") != "promoted":
        why = tags.get("comlrl.gate.reason") or "the gate never judged it"
        return Promotion(to_alias, {}, team, half, f"{names[0]} version {first[names[0]]} ({from_alias}) did not pass "
                                                   f"the champion/challenger gate ({why}); use --force to promote it "
                                                   f"anyway")
    members = team_members(tracking_uri, team, first[team]) if team is not None else None
    if members is None:  # no team, or one registered without the tag: each model's own alias
        agents = [name for name in names if name != team]
        members = tracking.aliased_versions(tracking_uri, agents, from_alias)
        if members is None:
            missing = next(name for name in agents
                           if tracking.aliased_versions(tracking_uri, [name], from_alias) is None)
            return Promotion(to_alias, {}, team, half, f"registered model {missing!r} has no version with alias "
                                                       f"{from_alias!r}")
    return Promotion(to_alias, {**members, **first}, team, half)


def carry_out(tracking_uri: str, promotion: Promotion) -> list[dict[str, str | None]]:
    """Move what ``promotion`` names (:func:`flows.registry.move_team_alias`, which completes a half-moved alias
    on the way); a refused one only completes a half-moved alias. Returns what moved (nothing when refused)."""
    if promotion.refusal is not None:
        if promotion.half_moved is not None:
            registry.repair_team_alias(tracking_uri, promotion.half_moved.team, promotion.alias)
        return []
    if promotion.team is None:  # agents registered without a team: model by model, as they always were
        return tracking.move_aliases(tracking_uri, promotion.versions, promotion.alias)
    agents = {name: number for name, number in promotion.versions.items() if name != promotion.team}
    return registry.move_team_alias(tracking_uri, promotion.team, promotion.versions[promotion.team], agents,
                                    promotion.alias)


def promote(tracking_uri: str, base: str, from_alias: str = "candidate", to_alias: str = CHAMPION,
            force: bool = False) -> list[dict[str, str | None]]:
    """Move ``to_alias`` to the team version ``from_alias`` names and its agents (:func:`plan_promotion`,
    :func:`carry_out`); ValueError when refused, once a half-moved ``to_alias`` is completed."""
    promotion = plan_promotion(tracking_uri, base, from_alias, to_alias, force)
    moved = carry_out(tracking_uri, promotion)
    if promotion.half_moved is not None:
        logger.warning("the promotion found %s; completed", promotion.half_moved.describe())
    if promotion.refusal is not None:
        raise ValueError(promotion.refusal)
    return moved
