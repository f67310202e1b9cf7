"""Centralized MAGRPO above the maths, against values worked out here: the joint prompt a row becomes, the
roles' reward (weights, processor, dropped samples, retries) over hand-written joint completions, the metrics
of a rollout (each role's parsed response in tokens, the joint length, the parse error rate), what the
callbacks see, what a checkpoint records, and each refusal's exact words.

The tiny tokenizer spells only a-z and spaces, so the joint completions are hand-written (as in
tests/test_centralized.py) and the 'separated' format uses the separator "x".
"""

from __future__ import annotations

import re

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer

from comlrl.rollout.collaboration import TaggedCollaboration
from comlrl.rollout.episodes import Rollout, Turn
from comlrl.rollout.generation import Generation
from comlrl.rollout.rewards import JointReward
from comlrl.trainers.base import CallbackSample
from comlrl.trainers.reinforce import CentralizedMAGRPOConfig, CentralizedMAGRPOTrainer, MAGRPOConfig

ROWS = [{"prompt": "write about the cat", "topic": "cat", "sep": "x"},
        {"prompt": "write about the sun", "topic": "sun", "sep": "y"}]
SMALL = dict(num_agents=2, num_generations=2, max_new_tokens=4, num_train_epochs=1, temperature=1.0, top_p=1.0,
             top_k=None, per_device_train_batch_size=2, disable_tqdm=True, seed=0,
             collaboration_format="separated", section_separator="x")


def length_reward(completions_0, completions_1):
    return [float(len(a) + 10 * len(b)) for a, b in zip(completions_0, completions_1)]


def build(model: str, reward=length_reward, trainer_class=CentralizedMAGRPOTrainer, **changes):
    inputs = {key: changes.pop(key) for key in ("formatters", "collaboration", "centralized_adapter",
                                                "metrics_callback", "eval_logger", "reward_processor",
                                                "agents", "tokenizer") if key in changes}
    model_input = {} if "agents" in inputs else {"agent_model": model}
    return trainer_class(**model_input, reward_func=reward, train_dataset=Dataset.from_list(ROWS),
                         args=CentralizedMAGRPOConfig(**{**SMALL, **changes}), **inputs)


def hand_rollout(texts: list[str], node_rows: list[int], lengths: list[int] | None = None) -> Rollout:
    """One turn: nodes ``node_rows`` (dataset rows) with 2 joint completions each, ``texts`` in row order."""
    rows = len(texts)
    lengths = lengths or [1] * rows
    mask = torch.tensor([[1] * n + [0] * (max(lengths) - n) for n in lengths], dtype=torch.long)
    ids = torch.zeros(rows, 1, dtype=torch.long)
    generation = Generation(ids, torch.ones_like(ids), torch.zeros_like(mask), mask, texts, num_generations=2)
    turn = Turn(node_rows=node_rows, prompts=[["joint prompt"] * len(node_rows)], generations=[generation],
                prompt_history=[], response_history=[])
    return Rollout(rows=ROWS, turns=[turn], joint_index=torch.arange(2).reshape(-1, 1))


# ----- the joint prompt -------------------------------------------------------------------------------------
def test_the_joint_prompt_is_the_adapters_over_each_roles_own_prompt(tiny_llama):
    formatters = [lambda row: f"write a plan about the {row['topic']}", lambda row: f"check the {row['topic']}"]
    trainer = build(tiny_llama, formatters=formatters, role_names=["writer", "critic"])
    expected = ("Write the responses of 2 roles in one reply. Each role has its own task.\n\n"
                "writer: write a plan about the sun\n\ncritic: check the sun\n\n"
                "Write the responses in role order (writer, critic), separating each from the next with x\n")
    assert trainer.joint_prompt(ROWS[1]) == expected
    rollout = trainer.rollout([ROWS[1]])
    assert rollout.turns[0].prompts == [[expected]]
    # one formatter serves every role
    same = build(tiny_llama, formatters=lambda row: row["topic"])
    assert "agent_0: cat\n\nagent_1: cat\n\n" in same.joint_prompt(ROWS[0])


def test_a_formatters_failure_names_the_role_and_the_fields(tiny_llama):
    """Refused at construction (the trainer formats a first row before training) and for any later row."""
    message = ("the row has no field 'question' needed by the formatter of role 1 (critic); fields present: "
               "['prompt', 'sep', 'topic']")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        build(tiny_llama, formatters=[lambda row: row["prompt"], lambda row: row["question"]],
              role_names=["writer", "critic"])
    trainer = build(tiny_llama, formatters=[lambda row: row["prompt"], lambda row: 3 if "question" in row else "b"])
    with pytest.raises(ValueError, match=r"^the formatter of role 1 \(agent_1\) returned int; it must return str$"):
        trainer.joint_prompt(ROWS[0] | {"question": "why"})
    with pytest.raises(ValueError, match=r"^the formatter of role 0 \(agent_0\) returned int; it must return str$"):
        build(tiny_llama, formatters=[lambda row: 3, lambda row: "b"])


# ----- scoring ----------------------------------------------------------------------------------------------
TEXTS = ["ab x cde", "a x b", "abc x", "no separator"]  # node 0 (row 1), then node 1 (row 0)


def test_score_is_the_roles_reward_per_node_and_joint_sample(tiny_llama):
    """Separated by "x": (ab, cde) -> 2 + 30, (a, b) -> 1 + 10, (abc, "") -> 3, "no separator" unparsed: its
    readable first section with 'partial' (12), nothing with 'empty' (0)."""
    trainer = build(tiny_llama)
    rollout = hand_rollout(TEXTS, node_rows=[1, 0])
    [scores] = trainer.score(rollout)
    assert scores.shape == (2, 2)
    assert scores.tolist() == [[32.0, 11.0], [3.0, 12.0]]
    trainer.args.parse_failure = "empty"
    assert trainer.score(rollout)[0].tolist() == [[32.0, 11.0], [3.0, 0.0]]
    # a plain function given to score is called with the roles, as the trainer's own reward
    [other] = trainer.score(rollout, lambda first, second: [float(len(a) - len(b)) for a, b in zip(first, second)])
    assert other.tolist() == [[-1.0, 0.0], [3.0, 0.0]]  # 'empty' still
    joint = JointReward(lambda first, second: [1.0] * len(first), weights=[4.0], num_agents=2)
    assert trainer.score(rollout, joint)[0].tolist() == [[4.0, 4.0], [4.0, 4.0]]


def test_the_roles_reward_takes_the_configs_weights_processor_drops_and_retries(tiny_llama):
    calls = []

    def flaky(completions_0, completions_1):
        calls.append(len(completions_0))
        if len(calls) == 1:
            raise ConnectionError("the scorer is busy")
        return [float(len(a)) if a != "abc" else float("nan") for a in completions_0]

    def second(completions_0, completions_1):
        return [float(len(b)) for b in completions_1]

    trainer = build(tiny_llama, reward=[flaky, second], reward_weights=[2.0, 0.5],
                    reward_processor=lambda value: value - 1.0, invalid_reward="drop", reward_retries=1,
                    reward_retry_backoff=0.0)
    [scores] = trainer.score(hand_rollout(TEXTS, node_rows=[1, 0]))
    # 2 x |role 0| + 0.5 x |role 1|, less 1; "abc" gives NaN: dropped
    expected = [[2 * 2 + 0.5 * 3 - 1, 2 * 1 + 0.5 * 1 - 1], [float("nan"), 2 * 12 + 0.5 * 0 - 1]]
    torch.testing.assert_close(scores, torch.tensor(expected), equal_nan=True)
    assert calls == [4, 4]  # the first call failed and was retried once
    assert trainer.reward.dropped == 1
    strict = build(tiny_llama, reward=lambda a, b: [float("nan")] * len(a))
    with pytest.raises(ValueError, match="returned nan at index 0; rewards must be finite"):
        strict.score(hand_rollout(TEXTS, node_rows=[1, 0]))


# ----- a rollout's metrics ----------------------------------------------------------------------------------
class RowSeparated:
    """A comlrl 1.4.3 adapter whose separator is the row's ``sep`` field."""

    def build_prompt(self, batch_item, agent_prompts):
        return f"on the {batch_item['topic']}: " + " | ".join(agent_prompts)

    def parse_completion(self, completion, batch_item, num_agents):
        parts = completion.split(batch_item["sep"])
        if len(parts) != num_agents:
            raise ValueError(f"{len(parts)} parts")
        return parts


def test_rollout_metrics_measure_each_roles_parsed_response_in_tokens(tiny_llama):
    """Node 0 is row 1 (separator y), node 1 row 0 (separator x): the parses, hence the roles' texts, depend on
    each completion's own row. A tokenizer that adds BOS adds none to the counted tokens."""
    from tokenizers.processors import TemplateProcessing

    trainer = build(tiny_llama, centralized_adapter=RowSeparated())
    tokenizer = trainer.tokenizers[0]
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)])
    texts = ["the cat y dog and road", "sun x moon", "tree x road", "hill"]
    rollout = hand_rollout(texts, node_rows=[1, 0], lengths=[5, 1, 3, 2])
    metrics = trainer.rollout_metrics(rollout, [torch.tensor([[1.0, 2.0], [4.0, 5.0]])])

    plain = AutoTokenizer.from_pretrained(tiny_llama)

    def tokens(text: str) -> int:
        return len(plain(text, add_special_tokens=False)["input_ids"])

    role_0 = ["the cat ", "", "tree ", ""]  # the unparsed completions give "" to every role
    role_1 = [" dog and road", "", " road", ""]
    assert [tokens(text) for text in role_0] != [tokens(text) for text in role_1]
    assert metrics["agent_0/completion_length"] == pytest.approx(sum(map(tokens, role_0)) / 4)
    assert metrics["agent_1/completion_length"] == pytest.approx(sum(map(tokens, role_1)) / 4)
    assert metrics["joint/completion_length"] == pytest.approx((5 + 1 + 3 + 2) / 4)
    assert metrics["collaboration/parse_error_rate"] == 0.5
    assert metrics["reward_mean"] == 3.0
    assert set(metrics) == {"reward_mean", "reward_std", "turn_1/reward_mean", "turn_1/expected_return",
                            "joint/completion_length", "collaboration/parse_error_rate",
                            "agent_0/completion_length", "agent_1/completion_length"}


def test_rollout_metrics_read_the_configs_parse_failure_and_three_roles(tiny_llama):
    trainer = build(tiny_llama, num_agents=3, parse_failure="empty")
    texts = ["the x cat x dog", "sun x moon", "tree x road x hill", "red"]
    metrics = trainer.rollout_metrics(hand_rollout(texts, node_rows=[0, 1]), [torch.zeros(2, 2)])
    plain = AutoTokenizer.from_pretrained(tiny_llama)
    # 'empty': "sun x moon" (two sections) and "red" (one) give nothing to any role
    roles = [["the", "", "tree", ""], ["cat", "", "road", ""], ["dog", "", "hill", ""]]
    for role, role_texts in enumerate(roles):
        expected = sum(len(plain(text, add_special_tokens=False)["input_ids"]) for text in role_texts) / 4
        assert metrics[f"agent_{role}/completion_length"] == pytest.approx(expected)
    assert metrics["collaboration/parse_error_rate"] == 0.5
    assert "agent_3/completion_length" not in metrics


def test_rollout_metrics_cover_every_turn_of_a_rollout(tiny_llama):
    """Centralized runs one turn; a rollout of two (made here) is measured over both turns' completions."""
    trainer = build(tiny_llama)
    first = hand_rollout(["the x cat", "sun"], node_rows=[0], lengths=[4, 2])
    second = hand_rollout(["dog x hill and road", "moon x red"], node_rows=[1], lengths=[6, 3])
    second.turns[0].parents = [1]  # spawned by the first turn's joint sample 1
    rollout = Rollout(rows=ROWS, turns=first.turns + second.turns, joint_index=first.joint_index)
    metrics = trainer.rollout_metrics(rollout, [torch.zeros(1, 2), torch.ones(1, 2)])
    plain = AutoTokenizer.from_pretrained(tiny_llama)

    def mean_tokens(texts: list[str]) -> float:
        return sum(len(plain(text, add_special_tokens=False)["input_ids"]) for text in texts) / len(texts)

    assert metrics["agent_0/completion_length"] == pytest.approx(mean_tokens(["the", "sun", "dog", "moon"]))
    assert metrics["agent_1/completion_length"] == pytest.approx(mean_tokens(["cat", "", "hill and road", "red"]))
    assert metrics["joint/completion_length"] == pytest.approx((4 + 2 + 6 + 3) / 4)
    assert metrics["collaboration/parse_error_rate"] == 0.25


# ----- the callbacks see roles ------------------------------------------------------------------------------
def test_the_callbacks_see_each_roles_response_read_with_the_configs_policy(tiny_llama):
    seen: dict[str, list] = {"samples": [], "eval": []}

    def metrics_callback(samples):
        seen["samples"].append([(sample.agent_idx, sample.completion) for sample in samples])
        return {"roles_seen": float(len({sample.agent_idx for sample in samples}))}

    def eval_logger(agent_completions_turns, batch_items, **_):
        seen["eval"].append(agent_completions_turns)
        return []

    trainer = build(tiny_llama, metrics_callback=metrics_callback, eval_logger=eval_logger, parse_failure="empty")
    rollout = hand_rollout(["ab x cd", "ee"], node_rows=[0])
    rollout.rows = ROWS[:1]
    metrics = trainer.rollout_metrics(rollout, [torch.tensor([[1.0, 0.0]])])
    assert metrics["roles_seen"] == 2.0
    assert seen["samples"] == [[(0, "ab"), (1, "cd"), (0, ""), (1, "")]]  # "ee" unparsed: 'empty'
    trainer.eval_logger(agent_completions_turns=[[["ab x cd"], ["ee"]]], batch_items=[{}, {}], prompts=["", ""])
    assert seen["eval"] == [[[["ab"], [""]], [["cd"], [""]]]]
    partial = build(tiny_llama, metrics_callback=metrics_callback, eval_logger=eval_logger)
    partial.eval_logger(agent_completions_turns=[[["ee"]]], batch_items=[{}], prompts=[""])
    assert seen["eval"][-1] == [[["ee"]], [[""]]]


# ----- construction -----------------------------------------------------------------------------------------
def test_the_trainer_keeps_the_users_config_and_counts_one_model(tiny_llama):
    args = CentralizedMAGRPOConfig(**SMALL)
    trainer = CentralizedMAGRPOTrainer(agent_model=tiny_llama, num_agents=2, reward_func=length_reward,
                                       train_dataset=Dataset.from_list(ROWS), args=args)
    assert trainer.args is args and args.num_agents == 2 and args.num_roles == 2
    assert trainer.num_agents == 1 and trainer.num_roles == 2 and len(trainer.agents) == 1
    assert trainer.collaboration.describe() == {"format": "separated", "roles": ["agent_0", "agent_1"],
                                                "separator": "x"}
    # without args, the default config: two roles in the tagged format
    default = CentralizedMAGRPOTrainer(agent_model=tiny_llama, reward_func=length_reward,
                                       train_dataset=Dataset.from_list(ROWS))
    assert type(default.args) is CentralizedMAGRPOConfig and default.num_roles == default.args.num_agents == 2
    assert default.collaboration.describe() == {"format": "tagged", "roles": ["agent_0", "agent_1"]}
    # the roles are num_agents of the config when the constructor does not say
    three = build(tiny_llama, num_agents=3)
    assert three.num_roles == 3 and three.collaboration.names == ("agent_0", "agent_1", "agent_2")
    # one model in agents, one tokenizer in a list
    listed = build(tiny_llama, agents=[tiny_llama], tokenizer=[AutoTokenizer.from_pretrained(tiny_llama)])
    assert listed.num_agents == 1 and listed.num_roles == 2


def test_an_adapter_given_by_either_name_replaces_the_configs(tiny_llama):
    tagged = TaggedCollaboration(2, ("left", "right"))
    by_new_name = build(tiny_llama, collaboration=tagged)
    assert by_new_name.collaboration is tagged
    assert build(tiny_llama, centralized_adapter=tagged).collaboration is tagged
    assert build(tiny_llama, collaboration=tagged, centralized_adapter=tagged).collaboration is tagged
    old = build(tiny_llama, centralized_adapter=RowSeparated())
    assert old.joint_prompt(ROWS[0]) == "on the cat: write about the cat | write about the cat"
    assert old.collaboration.describe() == {"format": "custom:RowSeparated", "roles": ["agent_0", "agent_1"]}


def test_compat_settings_add_the_roles_and_the_format(tiny_llama):
    trainer = build(tiny_llama, num_agents=3, role_names=["a", "b", "c"])
    assert trainer.compat_settings() == {
        "num_agents": 1, "tokenizer_sizes": [len(AutoTokenizer.from_pretrained(tiny_llama))],
        "train_dataset_rows": 2, "train_batch_size": 2, "gradient_accumulation_steps": 1, "seed": 0,
        "num_roles": 3, "collaboration": {"format": "separated", "roles": ["a", "b", "c"], "separator": "x"}}


class NamedTrainer(CentralizedMAGRPOTrainer):
    pass


def refusal(match_words: str, **inputs) -> None:
    args = inputs.pop("args", CentralizedMAGRPOConfig(**SMALL))
    with pytest.raises(ValueError, match=f"^{re.escape(match_words)}$"):
        NamedTrainer(**{"agent_model": "/nonexistent/model", "reward_func": length_reward, **inputs}, args=args)


def test_each_refusal_names_the_trainer_and_comes_before_loading():
    refusal("args must be a CentralizedMAGRPOConfig, got MAGRPOConfig", args=MAGRPOConfig(max_new_tokens=4))
    many = ("Centralized collaboration requires exactly one actor model: NamedTrainer trains one model for its 2 "
            "roles: agents must be a list of one model, got {} (the roles are num_agents)")
    refusal(many.format("2 entries"), agents=["/nonexistent/a", "/nonexistent/b"])
    refusal(many.format("0 entries"), agents=[])
    refusal(many.format("a string"), agents="/nonexistent/a")
    refusal(many.format("a string"), agents=b"/nonexistent/a")
    refusal("Centralized collaboration requires one actor tokenizer: NamedTrainer trains one model: give one "
            "tokenizer, got a list of 2", tokenizer=["a", "b"])
    refusal("Centralized collaboration requires one actor tokenizer: NamedTrainer trains one model: give one "
            "tokenizer, got a list of 0", tokenizer=())
    refusal("NamedTrainer runs one-turn episodes, so external_transition is never called; leave it None",
            external_transition=lambda *a, **k: ["next", "next"])
    refusal("collaboration and centralized_adapter name the same argument (1.4.3 called it centralized_adapter); "
            "give one of them", collaboration=TaggedCollaboration(2), centralized_adapter=TaggedCollaboration(2))
    refusal("reward_func must be callable: NamedTrainer needs reward_func (a callable or a list of callables), "
            "got None", reward_func=None)
    refusal("num_agents must match args.num_agents: num_agents=3 (constructor) disagrees with "
            "CentralizedMAGRPOConfig.num_agents=2; set both to the same value (the config alone never overrides "
            "the constructor argument)", num_agents=3)
