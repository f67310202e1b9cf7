"""Multi-turn rollouts written out (``comlrl/rollout/episodes.py``): each agent's draw from its own seed, the turn
tree (which node each joint sample spawns, its prompts from the transition and its histories), what the transition
is called with, early termination's choice of nodes (a strict threshold on the mean of the kept rewards), the
episodes a chain's rows belong to, each sample scored once, a trainer's rollout settings, and each refusal's words."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.rollout.episodes import Rollout, RolloutSpec, Turn, rollout_episodes, score_rollout
from comlrl.rollout.generation import Generation, generate_completions
from comlrl.rollout.rewards import JointReward
from comlrl.rollout.sampling import SamplingParams
from comlrl.trainers.actor_critic import IACConfig
from comlrl.trainers.reinforce import MAGRPOConfig

ROWS = [{"prompt": "the cat", "tag": "a"}, {"prompt": "the dog", "tag": "b"}]


def first(row):
    return f"{row['prompt']} and more"


def second(row):
    return f"tell me about {row['prompt']}"


@pytest.fixture(scope="module")
def team(tiny_llama, tiny_llama_b):
    """Two agents with different weights (so that whose seed drives which agent shows)."""
    agents = [AutoModelForCausalLM.from_pretrained(path) for path in (tiny_llama, tiny_llama_b)]
    tokenizers = [AutoTokenizer.from_pretrained(path) for path in (tiny_llama, tiny_llama_b)]
    return agents, tokenizers


def spec(**changes) -> RolloutSpec:
    settings = dict(formatters=(first, second), sampling=SamplingParams(max_new_tokens=3), num_generations=2)
    settings.update(changes)
    return RolloutSpec(**settings)


class Transition:
    """Records every call (copies of what it was given); the n-th call returns 'step <letter n> for <agent>'."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
        self.calls.append(copy.deepcopy(dict(prompt=prompt, completions=agent_completions, num_agents=num_agents,
                                             prompts=prompt_history_per_agent, responses=response_history_per_agent)))
        step = chr(ord("a") + len(self.calls) - 1)
        return [f"step {step} for {'xy'[agent]}" for agent in range(num_agents)]


def refusal(error_type, call, *args, **kwargs) -> str:
    with pytest.raises(error_type) as raised:
        call(*args, **kwargs)
    return str(raised.value)


# ----- one turn: each agent's own seeded draw ------------------------------------------------------
def test_each_agent_samples_from_a_seed_drawn_from_the_global_generator(team):
    agents, tokenizers = team
    rollout_spec = spec(max_prompt_length=3)
    torch.manual_seed(11)
    rollout = rollout_episodes(agents, tokenizers, rollout_spec, ROWS)
    torch.manual_seed(11)
    seeds = torch.randint(2**62, (2,)).tolist()  # one per agent, in agent order, before any generation
    for agent, formatter in enumerate((first, second)):
        expected = generate_completions(agents[agent], tokenizers[agent], [formatter(row) for row in ROWS], 2,
                                        rollout_spec.sampling, 3, "truncate",
                                        torch.Generator().manual_seed(seeds[agent]))
        got = rollout.turns[0].generations[agent]
        assert got.prompt_ids.shape[1] == 3  # the prompts keep their last 3 tokens
        assert torch.equal(got.prompt_ids, expected.prompt_ids)
        assert torch.equal(got.completion_ids, expected.completion_ids) and got.texts == expected.texts
    assert rollout.generated_tokens() == sum(int(g.completion_mask.sum()) for g in rollout.turns[0].generations)
    with pytest.raises(ValueError, match=r"prompt 0 has \d+ tokens but only 3 fit"):
        rollout_episodes(agents, tokenizers, spec(max_prompt_length=3, prompt_overflow="error"), ROWS)


def test_the_draws_do_not_depend_on_the_order_the_agent_map_runs_the_agents_in(team):
    agents, tokenizers = team
    order = []

    def backwards(function, devices):  # a user's map: runs the agents last to first
        order.extend(reversed(range(len(devices))))
        return [function(index) for index in reversed(range(len(devices)))][::-1]

    torch.manual_seed(4)
    mapped = rollout_episodes(agents, tokenizers, spec(), ROWS, agent_map=backwards)
    torch.manual_seed(4)
    plain = rollout_episodes(agents, tokenizers, spec(), ROWS)
    assert order == [1, 0]
    for got, want in zip(mapped.turns[0].generations, plain.turns[0].generations):
        assert torch.equal(got.completion_ids, want.completion_ids) and got.texts == want.texts


def test_a_formatters_fault_names_the_rows_label_and_the_agent(team):
    agents, tokenizers = team

    def needs_title(row):
        return row["title"]

    assert refusal(ValueError, rollout_episodes, agents, tokenizers, spec(formatters=(first, needs_title)), ROWS,
                   row_labels=["first", "second"]) == (
        "row first has no field 'title' needed by the formatter of agent 1 (fields present: ['prompt', 'tag'])")


# ----- the turn tree ------------------------------------------------------------------------------
def test_every_joint_sample_spawns_a_node_whose_prompts_come_from_the_transition(team):
    agents, tokenizers = team
    transition = Transition()
    torch.manual_seed(3)
    rollout = rollout_episodes(agents, tokenizers, spec(num_turns=3, transition=transition), ROWS)
    formatters = (first, second)
    assert [turn.num_nodes for turn in rollout.turns] == [2, 4, 8]
    assert [turn.node_rows for turn in rollout.turns] == [[0, 1], [0, 0, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1]]
    assert rollout.parents() == [None, None, None] and rollout.episode_rows() is None
    start = rollout.turns[0]
    assert start.prompts == [[first(row) for row in ROWS], [second(row) for row in ROWS]]
    assert start.prompt_history == [[[first(row)], [second(row)]] for row in ROWS]
    assert start.response_history == [[[], []], [[], []]]
    calls = iter(transition.calls)
    for number in (0, 1):
        turn, child = rollout.turns[number], rollout.turns[number + 1]
        texts = [generation.texts for generation in turn.generations]  # aligned: joint sample j is sample j of each
        assert rollout.joint_completions(number) == texts
        assert rollout.joint_rows(number) == [ROWS[row] for row in turn.node_rows for _ in range(2)]
        for node in range(turn.num_nodes):
            row = ROWS[turn.node_rows[node]]
            for j in range(2):
                flat = node * 2 + j  # the node it spawns
                call = next(calls)
                chosen = [texts[agent][flat] for agent in range(2)]
                responses = [turn.response_history[node][agent] + [chosen[agent]] for agent in range(2)]
                assert call == dict(prompt=row["prompt"], completions=chosen, num_agents=2,
                                    prompts=turn.prompt_history[node], responses=responses)
                step = chr(ord("a") + transition.calls.index(call))
                new = [formatters[agent]({**row, "prompt": f"step {step} for {'xy'[agent]}"}) for agent in range(2)]
                assert [child.prompts[agent][flat] for agent in range(2)] == new
                assert child.prompt_history[flat] == [turn.prompt_history[node][a] + [new[a]] for a in range(2)]
                assert child.response_history[flat] == responses
    assert next(calls, None) is None  # the last turn spawns nothing
    assert rollout.generated_tokens() == sum(int(g.completion_mask.sum()) for t in rollout.turns for g in t.generations)


def test_passthrough_prompts_are_the_transitions_own_and_the_task_prompt_defaults_to_agent_0s_first(team):
    agents, tokenizers = team
    rows = [{"question": "the sun"}]  # no 'prompt' field: the transition gets agent 0's first prompt

    def ask(row):
        return f"ask {row.get('prompt', row['question'])}"

    def answer(row):
        return f"answer {row.get('prompt', row['question'])}"

    transition = Transition()
    rollout = rollout_episodes(agents, tokenizers, spec(formatters=(ask, answer), num_generations=1, num_turns=3,
                                                        transition=transition, passthrough=True), rows)
    assert [call["prompt"] for call in transition.calls] == ["ask the sun", "ask the sun"]
    assert rollout.turns[1].prompts == [["step a for x"], ["step a for y"]]
    assert rollout.turns[2].prompts == [["step b for x"], ["step b for y"]]
    assert transition.calls[1]["prompts"] == [["ask the sun", "step a for x"], ["answer the sun", "step a for y"]]


def test_cross_joint_samples_pair_every_completion(team):
    agents, tokenizers = team
    torch.manual_seed(0)
    rollout = rollout_episodes(agents, tokenizers, spec(joint_mode="cross"), ROWS[:1])
    a, b = (generation.texts for generation in rollout.turns[0].generations)
    assert rollout.num_joint == 4
    assert rollout.joint_completions(0) == [[a[0], a[0], a[1], a[1]], [b[0], b[1], b[0], b[1]]]


# ----- the transition's faults and the multi-turn refusals ----------------------------------------
class Named:
    """A callable object: it has no __qualname__, so its repr names it."""

    def __init__(self, returned):
        self.returned = returned

    def __repr__(self) -> str:
        return "Named()"

    def __call__(self, **_):
        return self.returned


def returning(value):
    def transition(**_):
        return value
    return transition


def test_a_transitions_faults_are_refused_with_its_name(team):
    agents, tokenizers = team

    def run(transition, rows=ROWS[:1]):
        return refusal(ValueError, rollout_episodes, agents, tokenizers,
                       spec(num_generations=1, num_turns=2, transition=transition), rows)

    name = "returning.<locals>.transition"  # a function is named by its qualified name
    for value in ("one prompt", None, {"x": "y"}):
        assert run(returning(value)) == (
            "External transition must return a list or tuple of external prompts for each agent: "
            f"external_transition {name} must return a list of 2 prompts (one per agent), got {value!r}")
    assert run(Named(["only one"])) == (
        "External transition returned 1 values but expected 2: external_transition Named() must return a list of "
        "2 prompts (one per agent), got ['only one']")
    assert run(returning(("fine", 7))) == f"external_transition {name} returned a non-string prompt for agent 1: 7"
    assert run(Named([b"x", "fine"])) == "external_transition Named() returned a non-string prompt for agent 0: b'x'"
    # A formatter's fault at a later turn names the row's label and the agent.
    def picky(row):
        return "fine" if row["prompt"] == "the cat" else row["missing"]

    assert refusal(ValueError, rollout_episodes, agents, tokenizers,
                   spec(formatters=(first, picky), num_generations=1, num_turns=2, transition=Transition()), ROWS[:1],
                   row_labels=["row seven"]) == (
        "row row seven has no field 'missing' needed by the formatter of agent 1 (fields present: ['prompt', 'tag'])")


def test_multi_turn_needs_a_transition_and_early_termination_the_reward(team):
    agents, tokenizers = team
    assert refusal(ValueError, rollout_episodes, agents, tokenizers, spec(num_turns=2), ROWS) == (
        "external_transition is required for multi-turn: num_turns=2 needs an external_transition to produce the next "
        "turn's prompts")
    assert refusal(ValueError, rollout_episodes, agents, tokenizers,
                   spec(num_turns=2, transition=Transition(), early_termination_threshold=0.5), ROWS) == (
        "early_termination_threshold needs the reward while rolling out: pass reward=")
    # One turn has no next turn to end early: the threshold is not read, and nothing is scored on the way.
    single = rollout_episodes(agents, tokenizers, spec(early_termination_threshold=0.5), ROWS)
    assert len(single.turns) == 1 and single.scores == {} and single.scored_by is None
    # Without a threshold nothing is scored on the way either: score_rollout scores every turn with any reward.
    counter = RowScores()
    reward = JointReward(counter)
    rows = [{"prompt": "the cat", "scores": [0.25]}]
    plain = rollout_episodes(agents, tokenizers, spec(num_turns=2, transition=Transition()), rows, reward=reward)
    assert plain.scores == {} and plain.scored_by is None and counter.scored == 0
    assert [r.tolist() for r in score_rollout(plain, reward)] == [[[0.25, 0.25]], [[0.25, 0.25], [0.25, 0.25]]]
    assert counter.scored == 2 + 4


# ----- early termination --------------------------------------------------------------------------
class RowScores:
    """Sample j of every node of a row gets ``row['scores'][j]`` (None: an invalid reward, dropped); counts samples."""

    def __init__(self) -> None:
        self.scored = 0

    def __call__(self, completions_0, completions_1, batch_items):
        self.scored += len(completions_0)
        return [row["scores"][index % len(row["scores"])] for index, row in enumerate(batch_items)]


def test_a_node_ends_when_the_mean_of_its_kept_rewards_exceeds_the_threshold(team):
    agents, tokenizers = team
    rows = [{"prompt": "the cat", "scores": [0.5, 0.5]},    # mean equal to the threshold: goes on
            {"prompt": "the dog", "scores": [None, 0.75]},  # one reward dropped: the kept one's 0.75 ends it
            {"prompt": "the sun", "scores": [0.0, 0.25]},   # goes on
            {"prompt": "the moon", "scores": [1.0, 1.0]}]   # ends
    counter = RowScores()
    reward = JointReward(counter, on_invalid="drop")
    transition = Transition()
    rollout = rollout_episodes(agents, tokenizers, spec(num_turns=3, transition=transition,
                                                        early_termination_threshold=0.5), rows, reward=reward)
    second, third = rollout.turns[1], rollout.turns[2]
    assert second.node_rows == [0, 0, 2, 2] and second.parents == [0, 1, 4, 5]
    assert third.node_rows == [0, 0, 0, 0, 2, 2, 2, 2] and third.parents == list(range(8))
    assert [call["prompt"] for call in transition.calls] == ["the cat"] * 2 + ["the sun"] * 2 + \
        ["the cat"] * 4 + ["the sun"] * 4
    texts = [generation.texts for generation in rollout.turns[0].generations]
    assert [call["completions"] for call in transition.calls[:4]] == [[texts[0][i], texts[1][i]] for i in (0, 1, 4, 5)]
    assert rollout.scored_by is reward and sorted(rollout.scores) == [0, 1]
    assert counter.scored == 8 + 8  # the first two turns, scored on the way
    rewards = score_rollout(rollout, reward)
    assert counter.scored == 8 + 8 + 16  # the last turn only: the others are reused
    expected = [[[0.5, 0.5], [float("nan"), 0.75], [0.0, 0.25], [1.0, 1.0]], [[0.5, 0.5], [0.5, 0.5], [0.0, 0.25],
                [0.0, 0.25]], [[0.5, 0.5]] * 4 + [[0.0, 0.25]] * 4]
    for got, want in zip(rewards, expected):
        torch.testing.assert_close(got, torch.tensor(want), equal_nan=True)
    other = RowScores()
    score_rollout(rollout, JointReward(other, on_invalid="drop"))  # another reward scores every turn itself
    assert other.scored == 8 + 8 + 16


def test_the_episodes_of_a_chains_rows_follow_the_nodes_that_went_on(team):
    agents, tokenizers = team
    rows = [{"prompt": "the cat", "scores": [0.0]}, {"prompt": "the dog", "scores": [1.0]},
            {"prompt": "the sun", "scores": [0.0]}]
    rollout = rollout_episodes(agents, tokenizers, spec(num_generations=1, num_turns=3, transition=Transition(),
                                                        early_termination_threshold=0.5), rows,
                               reward=JointReward(RowScores()))
    assert [turn.node_rows for turn in rollout.turns] == [[0, 1, 2], [0, 2], [0, 2]]
    assert [rows_.tolist() for rows_ in rollout.episode_rows()] == [[0, 1, 2], [0, 2], [0, 2]]


def test_a_turn_without_parents_continues_every_node_in_order():
    """``parents=None`` after a pruned turn: each node spawned one node, in order (a rollout written by hand)."""
    def turn(nodes, parents):
        ids = torch.zeros(nodes, 1, dtype=torch.long)
        return Turn(node_rows=list(range(nodes)), prompts=[[""] * nodes], prompt_history=[], response_history=[],
                    generations=[Generation(ids, ids, ids, ids, [""] * nodes, num_generations=1)], parents=parents)

    rollout = Rollout(rows=[{}] * 3, turns=[turn(3, None), turn(2, [0, 2]), turn(2, None), turn(1, [1])],
                      joint_index=torch.zeros(1, 1, dtype=torch.long))
    assert [rows.tolist() for rows in rollout.episode_rows()] == [[0, 1, 2], [0, 2], [0, 2], [2]]


# ----- a trainer's rollout settings ---------------------------------------------------------------
def test_a_trainers_config_becomes_its_rollout_settings():
    args = MAGRPOConfig(num_agents=2, temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=3,
                        generation_backend="transformers", num_generations=3, num_turns=2, joint_mode="cross",
                        external_prompt_passthrough=True, max_prompt_length=17, prompt_overflow="error",
                        early_termination_threshold=0.25, num_train_epochs=1)
    transition = Transition()
    built = RolloutSpec.from_config(args, [first, second], transition)
    assert built == RolloutSpec(
        formatters=(first, second),
        sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=3, backend="transformers"),
        num_generations=3, num_turns=2, joint_mode="cross", transition=transition, passthrough=True,
        max_prompt_length=17, prompt_overflow="error", early_termination_threshold=0.25)
    assert built.joint_index.shape == (9, 2)
    assert built.replace(num_turns=1, joint_mode="aligned") == RolloutSpec(
        formatters=(first, second), sampling=built.sampling, num_generations=3, num_turns=1, transition=transition,
        passthrough=True, max_prompt_length=17, prompt_overflow="error", early_termination_threshold=0.25)
    # A config without joint samples' modes or early termination (an actor-critic one, or an older object).
    actor_critic = RolloutSpec.from_config(IACConfig(num_agents=2, max_new_tokens=3, num_train_epochs=1), [first], None)
    assert actor_critic.joint_mode == "aligned"
    fields = dict(temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=3, generation_backend="comlrl",
                  num_generations=1, num_turns=1, external_prompt_passthrough=False, max_prompt_length=None,
                  prompt_overflow="truncate")
    bare = RolloutSpec.from_config(SimpleNamespace(**fields), [first], None)
    assert bare.joint_mode == "aligned" and bare.early_termination_threshold is None
