"""Centralized MAGRPO: the collaboration adapter's format, scoring through it, resume, export, flows, learning.

The tiny test tokenizer (comlrl/tiny.py) spells only a-z and spaces: '<', '>', '_' and digits
encode to <unk>, so a tiny model cannot write the tagged format at all. The trainer tests that
generate therefore use the 'separated' format with the separator "x" (a single token of that
vocabulary that no corpus word contains); the tagged format is tested on hand-written
completions, through the same score stage.
"""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from comlrl.rollout.collaboration import (CollaborationParseError, SeparatedCollaboration, TaggedCollaboration,
                                          as_adapter, role_eval_logger, role_samples_callback, split_completions)
from comlrl.rollout.episodes import Rollout, Turn
from comlrl.rollout.generation import Generation
from comlrl.tasks.letters import letters_reward, rows, write_dataset
from comlrl.trainers.base import CallbackSample
from comlrl.trainers.reinforce import (CentralizedMAGRPOConfig, CentralizedMAGRPOTrainer, MAGRPOConfig,
                                       MAGRPOTrainer)

ALL_ROWS = rows(48)
SMALL = dict(num_agents=2, num_generations=2, max_new_tokens=6, num_train_epochs=1, temperature=1.0, top_p=1.0,
             top_k=None, agent_learning_rate=3e-3,
             per_device_train_batch_size=2, eval_num_samples=2, disable_tqdm=True, seed=0)
SEPARATED = dict(collaboration_format="separated", section_separator="x")


def centralized(model: str, rows_: list[dict] | None = None, **changes) -> CentralizedMAGRPOTrainer:
    config = {**SMALL, **SEPARATED, **changes}
    data = Dataset.from_list(rows_ or ALL_ROWS[:2])
    return CentralizedMAGRPOTrainer(agent_model=model, reward_func=letters_reward, train_dataset=data,
                                    eval_dataset=Dataset.from_list(ALL_ROWS[40:42]),
                                    args=CentralizedMAGRPOConfig(**config))


def hand_written_rollout(texts: list[str], row: dict) -> Rollout:
    """A one-turn rollout of one prompt whose joint completions are ``texts`` (what score reads of a rollout)."""
    empty = torch.zeros(len(texts), 1, dtype=torch.long)
    generation = Generation(empty, empty, empty, empty, texts, num_generations=len(texts))
    turn = Turn(node_rows=[0], prompts=[["prompt"]], generations=[generation], prompt_history=[], response_history=[])
    return Rollout(rows=[row], turns=[turn], joint_index=torch.arange(len(texts)).reshape(-1, 1))


# ----- the adapter --------------------------------------------------------------------------------
def test_tagged_round_trip_and_the_joint_prompt():
    adapter = TaggedCollaboration(2)
    prompt = adapter.build_prompt({"prompt": "unused"}, ["write about the cat", "write about the dog"])
    assert "agent_0: write about the cat" in prompt and "agent_1: write about the dog" in prompt
    assert "<agent_0>" in prompt and "</agent_1>" in prompt
    responses = ["first answer\nover two lines", "second <b>bold</b> answer"]
    assert adapter.parse_completion(adapter.format_completion(responses)) == responses
    # Any order, case and spaces in tags, text outside the sections ignored, markup inside kept.
    written = "Sure!\n< AGENT_1 >second</agent_1>\n<agent_0>\n first \n</ agent_0>\nDone."
    assert adapter.parse_completion(written) == ["first", "second"]
    named = TaggedCollaboration(2, ("writer", "critic"))
    assert named.parse_completion("<writer>w</writer><critic>c</critic>") == ["w", "c"]
    assert "<critic>" in named.build_prompt({}, ["a", "b"])


def test_separated_round_trip():
    adapter = SeparatedCollaboration(3, separator="\n===\n")
    responses = ["one", "two words", ""]
    assert adapter.parse_completion(adapter.format_completion(responses)) == responses
    assert adapter.parse_completion(" a \n===\nb\n===\n c") == ["a", "b", "c"]
    assert "===" in adapter.build_prompt({}, ["p", "q", "r"])


@pytest.mark.parametrize("completion, message, readable", [
    ("<agent_0>a</agent_0>", "missing section(s) <agent_1>...</agent_1>", ["a", ""]),
    ("<agent_0>a</agent_0><agent_1>b</agent_1><agent_0>c</agent_0>", "duplicated section <agent_0> (2 times)",
     ["", "b"]),
    ("<agent_0>a</agent_0><agent_1>b</agent_1><agent_2>c</agent_2>", "unknown role tag <agent_2>", ["a", "b"]),
    ("<agent_0>a<agent_1>b</agent_1></agent_0>", "<agent_1> inside the section of agent_0", ["", ""]),
    ("<agent_0>a</agent_0><agent_1>b", "<agent_1> is never closed", ["a", ""]),
    ("a</agent_0><agent_1>b</agent_1>", "</agent_0> without its opening <agent_0>", ["", "b"]),
    ("no tags at all", "missing section(s) <agent_0>...</agent_0>, <agent_1>...</agent_1>", ["", ""]),
], ids=["missing", "duplicated", "unknown-role", "nested", "unclosed", "stray-close", "untagged"])
def test_tagged_parse_errors_name_the_problem_and_keep_what_is_readable(completion, message, readable):
    with pytest.raises(CollaborationParseError) as error:
        TaggedCollaboration(2).parse_completion(completion)
    assert message in str(error.value)
    assert "['agent_0', 'agent_1']" in str(error.value) and repr(completion) in str(error.value)
    assert error.value.responses == readable
    assert isinstance(error.value, ValueError)


def test_separated_parse_errors():
    adapter = SeparatedCollaboration(2, separator="x")
    with pytest.raises(CollaborationParseError, match=r"missing role\(s\) agent_1: 1 section\(s\) for 2 roles") as few:
        adapter.parse_completion("eee")
    assert few.value.responses == ["eee", ""]
    with pytest.raises(CollaborationParseError, match=r"1 section\(s\) beyond the last role agent_1") as many:
        adapter.parse_completion("a x b x c")
    assert many.value.responses == ["a", "b"]


def test_adapter_settings_are_checked():
    with pytest.raises(ValueError, match="role_names has 1 names"):
        TaggedCollaboration(2, ("writer",))
    with pytest.raises(ValueError, match="distinct"):
        TaggedCollaboration(2, ("Writer", "writer"))
    with pytest.raises(ValueError, match="not a valid role name"):
        TaggedCollaboration(2, ("a b", "c"))
    with pytest.raises(ValueError, match="visible character"):
        SeparatedCollaboration(2, separator="\n")


def test_an_original_style_adapter_plugs_in():
    class Original:  # comlrl 1.4.3's protocol: its own ValueError subclass on a bad completion
        def build_prompt(self, batch_item, agent_prompts):
            return " | ".join(agent_prompts)

        def parse_completion(self, completion, batch_item, num_agents):
            if "/" not in completion:
                raise ValueError("no slash")
            return completion.split("/", 1)

    adapter = as_adapter(Original(), 2)
    assert adapter.build_prompt({}, ["a", "b"]) == "a | b"
    responses, failed = split_completions(adapter, ["x/y", "none"], [{}, {}])
    assert responses == [["x", ""], ["y", ""]] and failed == [False, True]
    with pytest.raises(CollaborationParseError, match="no slash"):
        split_completions(adapter, ["none"], [{}], on_failure="raise")
    class PromptOnly:
        def build_prompt(self, batch_item, agent_prompts):
            return ""

    with pytest.raises(TypeError, match="PromptOnly lacks \\['parse_completion'\\]"):
        as_adapter(PromptOnly(), 2)


def test_callbacks_see_roles_as_decentralized_agents_do():
    adapter = TaggedCollaboration(2)
    seen = {}

    def eval_logger(agent_completions_turns, batch_items, prompts):
        seen["eval"] = agent_completions_turns
        return []

    joint = [["<agent_0>a</agent_0><agent_1>b</agent_1>"], ["broken"]]  # [row][turn] of the one model
    role_eval_logger(adapter, eval_logger)(agent_completions_turns=[joint], batch_items=[{}, {}], prompts=["", ""])
    assert seen["eval"] == [[["a"], [""]], [["b"], [""]]]  # [role][row][turn]
    sample = CallbackSample(0, "p", "<agent_1>y</agent_1><agent_0>x</agent_0>", torch.zeros(1), torch.zeros(1),
                            {"batch_item": {}, "turn_idx": 0, "generation_idx": 0})
    roles = role_samples_callback(adapter, lambda samples: {"roles": [(s.agent_idx, s.completion) for s in samples]})
    assert roles([sample]) == {"roles": [(0, "x"), (1, "y")]}


# ----- the config ---------------------------------------------------------------------------------
def test_config_counts_roles_and_refuses_what_it_cannot_do():
    config = CentralizedMAGRPOConfig(max_new_tokens=32, num_train_epochs=1, num_agents=3, device=["cpu"])  # a device per model: one model
    assert config.num_roles == 3 and config.collaboration_adapter().names == ("agent_0", "agent_1", "agent_2")
    with pytest.raises(ValueError, match="collaboration_mode must be 'centralized'.*use MAGRPOConfig"):
        CentralizedMAGRPOConfig(collaboration_mode="decentralized")
    with pytest.raises(ValueError, match="num_turns=2 is not supported"):
        CentralizedMAGRPOConfig(num_turns=2)
    with pytest.raises(ValueError, match="role_names/section_separator: .*3 names"):
        CentralizedMAGRPOConfig(num_agents=2, role_names=["a", "b", "c"])
    with pytest.raises(ValueError, match=r"agent_devices length \(2\) must be 1 or 1: CentralizedMAGRPOConfig\.device"):
        CentralizedMAGRPOConfig(device=["cpu", "cpu"])


def test_trainer_refuses_several_models_before_loading():
    with pytest.raises(ValueError, match="trains one model for its 2 roles: agents must be a list of one model"):
        CentralizedMAGRPOTrainer(agents=["/nonexistent/a", "/nonexistent/b"], reward_func=letters_reward,
                                 args=CentralizedMAGRPOConfig(max_new_tokens=32, num_train_epochs=1))
    with pytest.raises(ValueError, match="disagrees"):
        CentralizedMAGRPOTrainer(agent_model="/nonexistent", num_agents=3, reward_func=letters_reward,
                                 args=CentralizedMAGRPOConfig(max_new_tokens=32, num_train_epochs=1, num_agents=2))


# ----- scoring and evaluation ---------------------------------------------------------------------
def test_the_task_reward_receives_per_role_lists(tiny_llama):
    calls = []

    def recording_reward(completions_0, completions_1, batch_items=None):
        calls.append((list(completions_0), list(completions_1), list(batch_items)))
        return letters_reward(completions_0, completions_1, batch_items)

    row = ALL_ROWS[0]
    trainer = CentralizedMAGRPOTrainer(agent_model=tiny_llama, reward_func=recording_reward,
                                       train_dataset=Dataset.from_list(ALL_ROWS[:2]),
                                       args=CentralizedMAGRPOConfig(**SMALL))
    texts = ["<agent_0>eeee</agent_0><agent_1>oooo</agent_1>", "<agent_1>oo</agent_1><agent_0>ee xx</agent_0>",
             "<agent_0>ee</agent_0>", "nothing parses"]
    rewards = trainer.score(hand_written_rollout(texts, row))
    assert calls == [(["eeee", "ee xx", "ee", ""], ["oooo", "oo", "", ""], [row] * 4)]
    assert rewards[0].reshape(-1).tolist() == pytest.approx([1.0, 0.7, 0.5, 0.0])

    # During training, each step's reward call gets one entry per joint sample for every role.
    calls.clear()
    trainer.train()
    assert len(calls) == 1 and all(len(call[0]) == len(call[1]) == len(call[2]) == 4 for call in calls)

    # parse_failure='empty': no credit for any role of an unparsed completion; 'raise': the error.
    trainer.args.parse_failure = "empty"
    assert trainer.score(hand_written_rollout(texts, row))[0].reshape(-1).tolist() == pytest.approx([1.0, 0.7, 0, 0])
    trainer.args.parse_failure = "raise"
    with pytest.raises(CollaborationParseError, match="missing section"):
        trainer.score(hand_written_rollout(texts, row))


def test_evaluation_reports_what_decentralized_magrpo_reports(tiny_llama):
    data = dict(reward_func=letters_reward, train_dataset=Dataset.from_list(ALL_ROWS[:2]),
                eval_dataset=Dataset.from_list(ALL_ROWS[40:42]))
    decentralized = MAGRPOTrainer(agent_model=tiny_llama, args=MAGRPOConfig(**SMALL), **data).evaluate()
    trainer = centralized(tiny_llama)
    metrics = trainer.evaluate()
    assert set(metrics) - set(decentralized) == {"eval/joint/completion_length", "eval/collaboration/parse_error_rate"}
    assert set(decentralized) <= set(metrics)
    # The eval reward is the task reward of the parsed roles, recomputed here from the same completions.
    rollout_rows = ALL_ROWS[40:42]
    with torch.random.fork_rng():
        torch.manual_seed(trainer.args.seed + 1)
        rollout = trainer.rollout(rollout_rows, row_labels=[0, 1])
    texts = rollout.turns[0].generations[0].texts
    joint_rows = [row for row in rollout_rows for _ in range(2)]
    roles, failed = split_completions(trainer.collaboration, texts, joint_rows)
    assert metrics["eval/reward_mean"] == pytest.approx(sum(letters_reward(*roles, joint_rows)) / len(texts))
    assert metrics["eval/collaboration/parse_error_rate"] == pytest.approx(sum(failed) / len(failed))


# ----- checkpoints and export ---------------------------------------------------------------------
def test_resume_equals_the_uninterrupted_run_and_save_model_exports_one_model(tiny_llama, tmp_path):
    changes = dict(num_train_epochs=2, per_device_train_batch_size=1)  # one row: one step per epoch
    straight = centralized(tiny_llama, ALL_ROWS[:1], **changes)
    initial = {key: tensor.clone() for key, tensor in straight.agents[0].state_dict().items()}
    straight.train(checkpoint_dir=tmp_path / "run", checkpoint_interval=1)
    resumed = centralized(tiny_llama, ALL_ROWS[:1], **changes)
    resumed.train(resume_from_checkpoint=tmp_path / "run" / "checkpoint-1", checkpoint_dir=tmp_path / "resumed")
    assert straight.state.global_step == 2 and resumed.state.global_step == 2
    expected, actual = straight.agents[0].state_dict(), resumed.agents[0].state_dict()
    assert all(torch.equal(expected[key], actual[key]) for key in expected)
    assert not all(torch.equal(expected[key], initial[key]) for key in expected)  # training moved the weights
    assert [s["reward_mean"] for s in straight.state.history] == [s["reward_mean"] for s in resumed.state.history]
    metadata = json.loads((tmp_path / "run" / "checkpoint-1" / "metadata.json").read_text())
    assert metadata["compat"]["num_roles"] == 2 and metadata["config"]["num_agents"] == 2

    other_format = centralized(tiny_llama, ALL_ROWS[:1], **changes, section_separator="q")
    with pytest.raises(ValueError, match="collaboration is"):
        other_format.train(resume_from_checkpoint=tmp_path / "run" / "checkpoint-1")

    exported = straight.save_model(tmp_path / "export")
    assert sorted(p.name for p in exported.iterdir()) == ["agent_0"]
    assert (exported / "agent_0" / "model.safetensors").is_file() and (exported / "agent_0" / "tokenizer.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(exported / "agent_0")
    assert all(torch.equal(tensor, loaded.state_dict()[key]) for key, tensor in expected.items())
    continued = CentralizedMAGRPOTrainer(agents=[str(exported / "agent_0")], num_agents=2, reward_func=letters_reward,
                                         train_dataset=Dataset.from_list(ALL_ROWS[:2]),
                                         args=CentralizedMAGRPOConfig(**{**SMALL, **SEPARATED}))
    assert continued.num_agents == 1 and continued.num_roles == 2


# ----- the pipeline -------------------------------------------------------------------------------
def test_runnable_from_a_run_spec(tmp_path):
    from flows.build import build_trainer
    from flows.spec import parse_spec

    write_dataset(tmp_path / "data" / "letters", num_train=2, num_eval=2)
    spec = parse_spec({
        "name": "centralized", "algorithm": "magrpo_centralized",
        "models": {"agent_model": {"tiny": {"architecture": "llama", "vocab_size": 96, "seed": 0}}},
        "dataset": {"train": "data/letters/train.parquet", "eval": "data/letters/eval.parquet"},
        "reward": "comlrl.tasks.letters:letters_reward",
        "config": {**SMALL, **SEPARATED},
    }, root=tmp_path)
    trainer = build_trainer(spec, tmp_path, tmp_path / "work")
    assert isinstance(trainer, CentralizedMAGRPOTrainer)
    values = trainer.begin_step([trainer.train_dataset[0], trainer.train_dataset[1]])
    for stage in trainer.step_stages:  # what the flow runs, one task per stage
        trainer.run_stage(stage, values)
    assert values["rewards"][0].shape == (2, 2) and "agent_0/loss" in values["update_metrics"]


# ----- learning -----------------------------------------------------------------------------------
# Measured rises, seeds 0-5: 0.119, 0.181, 0.092, 0.116, 0.153, 0.230 (almost all of it role 0's 'e's).
LEARNING_MARGIN = 0.08


def test_centralized_magrpo_learns_the_letters_task(tiny_llama):
    """Held-out reward of 8 unseen prompts rises by LEARNING_MARGIN within 48 steps (seed 0).

    With the separated format and parse_failure='partial', a completion without the separator gives
    role 0 its whole text and role 1 an empty response: the reward then pays for role 0's 'e's, and
    writing the separator and 'o's after it pays more, so the signal exists from the first step.
    """
    trainer = centralized(tiny_llama, ALL_ROWS[:32], num_generations=4, max_new_tokens=24, num_train_epochs=3,
                          eval_num_samples=8)
    trainer.eval_dataset = Dataset.from_list(ALL_ROWS[40:48])
    before = trainer.evaluate()["eval/reward_mean"]
    trainer.train()
    after = trainer.evaluate()["eval/reward_mean"]
    assert after >= before + LEARNING_MARGIN, f"held-out reward {before:.3f} -> {after:.3f}"
