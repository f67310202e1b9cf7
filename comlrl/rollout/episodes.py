"""Multi-agent episodes: turns, joint samples, external transitions and joint rewards.

An episode starts from one dataset row per node. At each turn every agent samples
``num_generations`` completions for every node (one batched ``generate`` per agent and
turn, each from its own seeded ``torch.Generator``, so agents may sample side by side
(``agent_map``) and still reproducibly); joint samples combine them (:func:`comlrl.algorithms.advantages.joint_index`). With
more turns, each joint sample ``j`` of node ``n`` spawns node ``n * num_joint + j``, whose
prompts come from the ``external_transition``. With ``num_generations=1`` this is a chain,
which is what the actor-critic trainers use.

Early termination (``early_termination_threshold``): each turn but the last is scored as soon as it is
generated, and a node whose joint samples' mean reward exceeds the threshold spawns no node at the
next turn (as comlrl 1.4.3 decides it); its samples' episodes end there. Each node then records the
joint sample that spawned it (:attr:`Turn.parents`), and the scores are kept for :func:`score_rollout`.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from comlrl.algorithms.advantages import joint_index
from comlrl.data import Formatter, format_prompt
from comlrl.parallel.placement import AgentMap, devices_of, map_by_device, model_device
from comlrl.rollout.rewards import JointReward
from comlrl.rollout.generation import Generation, SamplingParams, generate_completions


@dataclass(frozen=True)
class RolloutSpec:
    """Everything a rollout needs besides the models and the rows, built once from a trainer's config
    (:meth:`from_config`) and passed whole to :func:`rollout_episodes`, evaluation and the flows."""

    formatters: tuple[Formatter, ...]
    sampling: SamplingParams
    num_generations: int
    num_turns: int = 1
    joint_mode: str = "aligned"
    transition: Callable[..., Sequence[str]] | None = None
    passthrough: bool = False
    max_prompt_length: int | None = None
    prompt_overflow: str = "truncate"
    early_termination_threshold: float | None = None

    @classmethod
    def from_config(cls, args: Any, formatters: Sequence[Formatter], transition: Callable | None) -> "RolloutSpec":
        return cls(
            formatters=tuple(formatters),
            sampling=SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                    max_new_tokens=args.max_new_tokens, backend=args.generation_backend),
            num_generations=args.num_generations,
            num_turns=args.num_turns,
            joint_mode=getattr(args, "joint_mode", "aligned"),
            transition=transition,
            passthrough=args.external_prompt_passthrough,
            max_prompt_length=args.max_prompt_length,
            prompt_overflow=args.prompt_overflow,
            early_termination_threshold=getattr(args, "early_termination_threshold", None),
        )

    def replace(self, **changes: Any) -> "RolloutSpec":
        return dataclasses.replace(self, **changes)

    @property
    def joint_index(self) -> torch.Tensor:
        """Which sample of each agent forms each joint sample (see :func:`joint_index`)."""
        return joint_index(len(self.formatters), self.num_generations, self.joint_mode)


@dataclass
class Turn:
    """One turn of every node: prompts and completions per agent, plus the histories so far."""

    node_rows: list[int]
    prompts: list[list[str]]
    generations: list[Generation]
    prompt_history: list[list[list[str]]]
    response_history: list[list[list[str]]]
    # Per node, the flat index (node * num_joint + j) of the previous turn's joint sample that spawned it;
    # None: every joint sample spawned one node, in order (no early termination).
    parents: list[int] | None = None

    @property
    def num_nodes(self) -> int:
        return len(self.node_rows)


@dataclass
class Rollout:
    rows: list[dict[str, Any]]
    turns: list[Turn]
    joint_index: torch.Tensor
    # Rewards computed while rolling out (early termination), by turn, and the reward that computed them.
    scores: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    scored_by: Any = None

    def parents(self) -> list[list[int] | None]:
        """Per turn, :attr:`Turn.parents` (what :func:`comlrl.algorithms.advantages.tree_returns` reads)."""
        return [turn.parents for turn in self.turns]

    def episode_rows(self) -> list[torch.Tensor] | None:
        """Per turn, the episode of each generation row (an episode is a row of the first turn), for chains
        (one joint sample per node after the first turn); None when every episode ran every turn."""
        if all(turn.parents is None for turn in self.turns):
            return None
        rows = [torch.arange(self.turns[0].num_nodes * self.num_joint)]
        for turn in self.turns[1:]:
            parents = torch.tensor(turn.parents if turn.parents is not None else range(turn.num_nodes), dtype=torch.long)
            rows.append(rows[-1][parents])
        return rows

    @property
    def num_joint(self) -> int:
        return self.joint_index.shape[0]

    def joint_completions(self, turn: int) -> list[list[str]]:
        """``[agent][node * num_joint + j]``: each agent's completion in every joint sample."""
        current = self.turns[turn]
        generations = current.generations
        per_node = generations[0].num_generations
        return [
            [
                generations[agent].texts[node * per_node + int(self.joint_index[j, agent])]
                for node in range(current.num_nodes)
                for j in range(self.num_joint)
            ]
            for agent in range(len(generations))
        ]

    def joint_rows(self, turn: int) -> list[dict[str, Any]]:
        """The dataset row of every joint sample of ``turn`` (aligned with :meth:`joint_completions`)."""
        return [self.rows[row] for row in self.turns[turn].node_rows for _ in range(self.num_joint)]

    def generated_tokens(self) -> int:
        return sum(g.num_tokens for turn in self.turns for g in turn.generations)


def _generate_turn(
    agents: Sequence[PreTrainedModel],
    tokenizers: Sequence[PreTrainedTokenizerBase],
    prompts: list[list[str]],
    num_generations: int,
    sampling: SamplingParams,
    max_prompt_length: int | None,
    prompt_overflow: str = "truncate",
    agent_map: AgentMap = map_by_device,
) -> list[Generation]:
    # Each agent's seed is drawn here, from the global RNG, whatever order agent_map runs them in.
    seeds = torch.randint(2**62, (len(agents),)).tolist()

    def generate(agent: int) -> Generation:
        generator = torch.Generator(device=model_device(agents[agent])).manual_seed(seeds[agent])
        return generate_completions(agents[agent], tokenizers[agent], prompts[agent], num_generations, sampling,
                                    max_prompt_length, prompt_overflow, generator)

    return agent_map(generate, devices_of(agents))


def transition_takes_row(transition: Callable[..., Sequence[str]]) -> bool:
    """Whether ``transition`` is given its episode's dataset row as ``batch_item=``: when it declares that keyword
    or takes ``**kwargs`` (comlrl 1.4.3's five keywords are given to every transition)."""
    try:
        parameters = inspect.signature(transition).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD or (p.name == "batch_item" and p.kind in (
        inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)) for p in parameters)


def _next_prompts(
    transition: Callable[..., Sequence[str]],
    row: dict[str, Any],
    completions: list[str],
    prompt_history: list[list[str]],
    response_history: list[list[str]],
    formatters: Sequence[Formatter],
    passthrough: bool,
    row_index: int,
    takes_row: bool = False,
) -> list[str]:
    num_agents = len(completions)
    task_prompt = row.get("prompt", prompt_history[0][0])
    row_given = {"batch_item": row} if takes_row else {}
    returned = transition(
        prompt=task_prompt,
        agent_completions=list(completions),
        num_agents=num_agents,
        prompt_history_per_agent=prompt_history,
        response_history_per_agent=response_history,
        **row_given,
    )
    name = getattr(transition, "__qualname__", repr(transition))
    # Led by the original comlrl's words for the same two faults.
    if isinstance(returned, str) or not isinstance(returned, (list, tuple)):
        raise ValueError(
            "External transition must return a list or tuple of external prompts for each agent: "
            f"external_transition {name} must return a list of {num_agents} prompts (one per agent), got {returned!r}"
        )
    if len(returned) != num_agents:
        raise ValueError(
            f"External transition returned {len(returned)} values but expected {num_agents}: "
            f"external_transition {name} must return a list of {num_agents} prompts (one per agent), got {returned!r}"
        )
    bad = [i for i, prompt in enumerate(returned) if not isinstance(prompt, str)]
    if bad:
        raise ValueError(f"external_transition {name} returned a non-string prompt for agent {bad[0]}: {returned[bad[0]]!r}")
    if passthrough:
        return list(returned)
    return [
        format_prompt(formatters[agent], {**row, "prompt": returned[agent]}, agent, row_index)
        for agent in range(num_agents)
    ]


def rollout_episodes(
    agents: Sequence[PreTrainedModel],
    tokenizers: Sequence[PreTrainedTokenizerBase],
    spec: RolloutSpec,
    rows: list[dict[str, Any]],
    row_labels: Sequence[int | str] | None = None,
    agent_map: AgentMap = map_by_device,
    reward: JointReward | None = None,
) -> Rollout:
    """Generate every turn of the episodes that start from ``rows``; ``agent_map`` spreads the agents' generation.
    With ``spec.early_termination_threshold`` and several turns, ``reward`` scores each turn to decide which
    nodes go on."""
    formatters, num_generations, sampling = spec.formatters, spec.num_generations, spec.sampling
    max_prompt_length, prompt_overflow = spec.max_prompt_length, spec.prompt_overflow
    transition, passthrough, joint_index = spec.transition, spec.passthrough, spec.joint_index
    if spec.num_turns > 1 and transition is None:
        raise ValueError(f"external_transition is required for multi-turn: num_turns={spec.num_turns} needs an "
                         "external_transition to produce the next turn's prompts")
    takes_row = transition is not None and transition_takes_row(transition)
    threshold = spec.early_termination_threshold if spec.num_turns > 1 else None
    if threshold is not None and reward is None:
        raise ValueError("early_termination_threshold needs the reward while rolling out: pass reward=")
    num_agents = len(agents)
    labels = list(row_labels) if row_labels is not None else list(range(len(rows)))
    prompts = [[format_prompt(formatters[a], row, a, labels[r]) for r, row in enumerate(rows)] for a in range(num_agents)]
    node_rows = list(range(len(rows)))
    prompt_history = [[[prompts[a][n]] for a in range(num_agents)] for n in node_rows]
    response_history: list[list[list[str]]] = [[[] for _ in range(num_agents)] for _ in node_rows]
    rollout = Rollout(rows=rows, turns=[], joint_index=joint_index, scored_by=reward if threshold is not None else None)
    parents: list[int] | None = None
    for turn_number in range(spec.num_turns):
        generations = _generate_turn(
            agents, tokenizers, prompts, num_generations, sampling, max_prompt_length, prompt_overflow, agent_map
        )
        turn = Turn(node_rows, prompts, generations, prompt_history, response_history, parents)
        rollout.turns.append(turn)
        if turn_number == spec.num_turns - 1:
            break
        going_on = list(range(turn.num_nodes))
        if threshold is not None:
            scores = _score_turn(rollout, turn_number, reward)
            rollout.scores[turn_number] = scores
            going_on = [node for node in going_on if not bool(scores[node].nanmean() > threshold)]
            if not going_on:
                break
        completions = rollout.joint_completions(turn_number)
        next_rows, next_prompts, next_prompt_history, next_response_history = [], [[] for _ in range(num_agents)], [], []
        parents = [] if threshold is not None else None
        for node in going_on:
            for j in range(rollout.num_joint):
                flat = node * rollout.num_joint + j
                chosen = [completions[a][flat] for a in range(num_agents)]
                responses = [turn.response_history[node][a] + [chosen[a]] for a in range(num_agents)]
                row_index = turn.node_rows[node]
                new = _next_prompts(
                    transition, rows[row_index], chosen, turn.prompt_history[node], responses,
                    formatters, passthrough, labels[row_index], takes_row,
                )
                next_rows.append(row_index)
                if parents is not None:
                    parents.append(flat)
                for a in range(num_agents):
                    next_prompts[a].append(new[a])
                next_prompt_history.append([turn.prompt_history[node][a] + [new[a]] for a in range(num_agents)])
                next_response_history.append(responses)
        node_rows, prompts = next_rows, next_prompts
        prompt_history, response_history = next_prompt_history, next_response_history
    return rollout


def _score_turn(rollout: Rollout, turn_number: int, reward: JointReward) -> torch.Tensor:
    values = reward(rollout.joint_completions(turn_number), rollout.joint_rows(turn_number))
    return values.reshape(rollout.turns[turn_number].num_nodes, rollout.num_joint)


def score_rollout(rollout: Rollout, reward: JointReward) -> list[torch.Tensor]:
    """Joint rewards of every turn, ``[num_nodes_t, num_joint]`` each (those the rollout already computed with
    the same reward, for early termination, are reused: each sample is scored once)."""
    return [rollout.scores[turn] if reward is rollout.scored_by and turn in rollout.scores
            else _score_turn(rollout, turn, reward) for turn in range(len(rollout.turns))]
