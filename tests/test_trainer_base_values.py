"""What every trainer that owns its agents shares (comlrl.trainers.base), checked against values worked out here.

The evaluation metrics are recomputed from a rollout drawn in the test under the evaluation seed (``seed + 1``) and
scored by the test's own reward; the returns of a two-turn tree are summed by hand; each refusal is compared word
for word; the state a checkpoint holds is loaded into a fresh trainer and compared tensor by tensor.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys
import types

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.callbacks import TrainerCallback
from comlrl.errors import NonFiniteTrainingError
from comlrl.rollout.rewards import JointReward
from comlrl.trainers.actor_critic import IACConfig
from comlrl.trainers.algorithms import ALGORITHMS, algorithm
from comlrl.trainers.base import MultiAgentTrainer
from comlrl.trainers.epochs import current_activity
from comlrl.trainers.inputs import input_names
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from comlrl.training.metrics import MetricWindow

WORDS = ["cat", "dog", "sun", "moon", "tree", "river"]
FAST = dict(num_agents=2, num_generations=2, max_new_tokens=4, num_train_epochs=1, disable_tqdm=True,
            per_device_train_batch_size=1, seed=7)
# The reference KL with untruncated sampling (truncated sampling warns that the k3 estimate is then biased).
KL = dict(reference_kl_enabled=True, top_p=1.0, top_k=None)


def rows(count: int) -> Dataset:
    return Dataset.from_dict({"prompt": [f"say {word}" for word in WORDS[:count]]})


def length_reward(c0, c1):
    """Different for every pair of completions: the weights 1 and 3 keep the agents apart."""
    return [float(len(a) + 3 * len(b)) for a, b in zip(c0, c1)]


def build(model, train_dataset=None, **kwargs) -> MAGRPOTrainer:
    settings = {**FAST, **kwargs.pop("config", {})}
    return MAGRPOTrainer(agent_model=model, num_agents=2, reward_func=kwargs.pop("reward_func", length_reward),
                         train_dataset=train_dataset, args=MAGRPOConfig(**settings), **kwargs)


def message(error_info) -> str:
    return str(error_info.value)


def rollout_as_evaluated(trainer, dataset, count):
    """The rollout an evaluation of the first ``count`` rows makes: the same stage under ``seed + 1``."""
    state = torch.get_rng_state()
    torch.manual_seed(trainer.args.seed + 1)
    rollout = trainer.rollout([dataset[i] for i in range(count)], row_labels=list(range(count)))
    torch.set_rng_state(state)
    return rollout


def joint_rewards(rollout, turn, reward=length_reward):
    """``[nodes, joint]`` rewards of a turn, computed from the completions by the test's reward."""
    c0, c1 = rollout.joint_completions(turn)
    return torch.tensor(reward(c0, c1), dtype=torch.float64).reshape(-1, rollout.num_joint)


# ----- refusals at construction, word for word -------------------------------------------------------
def test_construction_refusals_name_the_argument(tiny_llama):
    with pytest.raises(ValueError) as error:
        MAGRPOTrainer(agent_model=tiny_llama, reward_func=length_reward, args=IACConfig())
    assert message(error) == "args must be a MAGRPOConfig, got IACConfig"
    with pytest.raises(ValueError) as error:
        MAGRPOTrainer(agent_model=tiny_llama, args=MAGRPOConfig(**FAST))
    assert message(error) == ("reward_func must be a callable: MAGRPOTrainer needs reward_func (a callable or a list "
                              "of callables), got None")
    with pytest.raises(ValueError) as error:
        build(tiny_llama, config=dict(num_turns=2))
    assert message(error) == ("Multi-turn MAGRPO requires an external_transition: num_turns=2 needs "
                              "external_transition to produce the next turn's prompts")
    for hook in ("metrics_callback", "eval_logger", "eval_aggregator"):
        with pytest.raises(ValueError) as error:
            build(tiny_llama, **{hook: 3})
        assert message(error) == f"{hook} must be callable, got int"
    with pytest.raises(ValueError) as error:
        build(tiny_llama, external_transition="next", config=dict(num_turns=2))
    assert message(error) == "external_transition must be callable"
    with pytest.raises(ValueError) as error:
        build(tiny_llama, external_transition=lambda **_: ["a", "b"])
    assert message(error) == (
        "external_transition is given but MAGRPOConfig.num_turns was left at its default, 1, so the transition "
        "would never run (comlrl 1.4.3's default was 2 turns); set num_turns explicitly")
    with pytest.raises(ValueError) as error:
        build(tiny_llama, model_config={"dtype": torch.float32, "rope": 1, "attn": 2})
    assert message(error) == "model_config has unknown keys ['attn', 'rope']; allowed: ['attn_implementation', 'dtype']"
    with pytest.raises(ValueError) as error:
        build(tiny_llama, eval_dataset=[])
    assert message(error) == "eval_dataset is empty; it needs at least one row"


def test_a_multi_turn_trainer_is_built_with_an_explicit_single_turn_and_a_transition(tiny_llama):
    trainer = build(tiny_llama, external_transition=lambda **_: ["a", "b"], config=dict(num_turns=1))
    assert trainer.args.num_turns == 1 and trainer.external_transition is not None


def test_the_training_rows_are_checked_at_construction_and_when_given_later(tiny_llama):
    with pytest.raises(ValueError) as error:
        build(tiny_llama, [])
    assert message(error) == "train_dataset is empty; it needs at least one row"
    with pytest.raises(ValueError) as error:
        build(tiny_llama, rows(2), config=dict(per_device_train_batch_size=3))
    assert message(error) == ("train_dataset has 2 rows, fewer than one batch (per_device_train_batch_size=3); "
                              "lower the batch size")
    # exactly one batch is enough
    assert build(tiny_llama, rows(3), config=dict(per_device_train_batch_size=3)).batches_per_epoch() == 1
    second_reads_question = [lambda row: row["prompt"], lambda row: row["question"]]
    with pytest.raises(ValueError) as error:
        build(tiny_llama, rows(2), formatters=second_reads_question)
    assert message(error) == "row 0 has no field 'question' needed by the formatter of agent 1 (fields present: ['prompt'])"
    trainer = build(tiny_llama, config=dict(per_device_train_batch_size=3))
    with pytest.raises(ValueError) as error:
        trainer.train_dataset = rows(2)
    assert message(error).startswith("train_dataset has 2 rows, fewer than one batch")
    assert trainer.train_dataset is None
    trainer.train_dataset = None  # taking the dataset away is allowed
    assert trainer.train_dataset is None


def test_the_context_must_leave_room_for_the_completion(tiny_llama):
    # the tiny Llama's context is 256 tokens
    trainer = build(tiny_llama, rows(1), eval_dataset=rows(1), config=dict(max_new_tokens=256))
    with pytest.raises(ValueError) as error:
        trainer.evaluate()
    assert message(error) == ("MAGRPOConfig.max_new_tokens=256 leaves no room for a prompt in the 256-token context "
                              "of agent 0; lower it")
    with pytest.raises(ValueError) as error:
        trainer.train()
    assert message(error).startswith("MAGRPOConfig.max_new_tokens=256 leaves no room")
    assert trainer.state.global_step == 0
    fits = build(tiny_llama, rows(1), config=dict(max_new_tokens=255))
    fits.check_context(fits.agents)  # 255 new tokens leave one for the prompt


def test_model_config_dtype_and_the_agents_as_1_4_3_read_them(tiny_llama, tiny_llama_b):
    trainer = MAGRPOTrainer(agents=[tiny_llama, tiny_llama_b], reward_func=length_reward,
                            model_config={"dtype": torch.float64}, args=MAGRPOConfig(**FAST))
    assert trainer.dtype == torch.float64
    assert {p.dtype for agent in trainer.agents for p in agent.parameters()} == {torch.float64}
    assert trainer.model_name == trainer.agent_model_name == tiny_llama  # the first source, as given
    assert trainer.agent_sources == [tiny_llama, tiny_llama_b]  # what a run's record names as its models
    models = trainer.agent_models
    assert models == trainer.agents and models is not trainer.agents
    expected = AutoModelForCausalLM.from_pretrained(tiny_llama_b, dtype=torch.float64)
    torch.testing.assert_close(dict(trainer.agents[1].named_parameters()), dict(expected.named_parameters()))
    assert trainer.optimizers == [trainer.model_optimizers["agent_0"].optimizer,
                                  trainer.model_optimizers["agent_1"].optimizer]
    assert [group["params"] for group in trainer.optimizers[1].param_groups][0][0] is \
        next(trainer.agents[1].parameters())
    assert trainer.checkpoint_modules() == {"agent_0": trainer.agents[0], "agent_1": trainer.agents[1]}
    assert trainer.reference_models == []
    with pytest.raises(ValueError):
        trainer.num_agents = 3
    trainer.num_agents = 2
    assert trainer.num_agents == 2


# ----- batches and the planned schedule -----------------------------------------------------------------
def test_batch_sizes_and_the_planned_optimizer_steps(tiny_llama):
    # a default batch size (2) is capped at a one-row dataset's rows
    one_row = MAGRPOTrainer(agent_model=tiny_llama, num_agents=2, reward_func=length_reward, train_dataset=rows(1),
                            args=MAGRPOConfig(num_generations=2, max_new_tokens=4))
    assert one_row.batch_size == one_row.global_batch_size == 1
    assert MAGRPOTrainer(agent_model=tiny_llama, num_agents=2, reward_func=length_reward, train_dataset=rows(5),
                         args=MAGRPOConfig(num_generations=2, max_new_tokens=4)).batch_size == 2
    # 5 rows in batches of 2: 3 batches; 3 epochs x ceil(3 / 2) windows of two
    trainer = build(tiny_llama, rows(5), config=dict(per_device_train_batch_size=2, num_train_epochs=3,
                                                      gradient_accumulation_steps=2))
    assert trainer.batch_size == trainer.global_batch_size == 2
    assert trainer.batches_per_epoch() == 3
    assert [c.planned_steps for c in trainer.model_optimizers.values()] == [3 * 2, 3 * 2]
    assert trainer.compat_settings() == {"num_agents": 2, "tokenizer_sizes": [96, 96], "train_dataset_rows": 5,
                                         "train_batch_size": 2, "gradient_accumulation_steps": 2, "seed": 7}
    # a dataset given later re-plans every schedule over its batches (built without one: 1 planned step)
    later = build(tiny_llama, config=dict(num_train_epochs=2, lr_scheduler_type="linear"))
    assert later.batch_size == 1 and later.batches_per_epoch() == 0
    assert [c.planned_steps for c in later.model_optimizers.values()] == [1, 1]
    later.train_dataset = rows(3)
    assert [c.planned_steps for c in later.model_optimizers.values()] == [2 * 3, 2 * 3]
    later.replan_schedules(2)
    assert later.schedule_repeats == 2
    assert [c.planned_steps for c in later.model_optimizers.values()] == [2 * 2 * 3, 2 * 2 * 3]
    # linear decay over 12 steps: the rate after one step is 11/12 of the initial rate
    lr = later.args.agent_learning_rate
    later.train_dataset = rows(3)
    assert later.schedule_repeats == 2
    later.train_steps(1, MetricWindow())
    assert later.model_optimizers["agent_0"].steps == 3  # one per batch; the epoch's end has nothing to flush
    assert [c.planned_steps for c in later.model_optimizers.values()] == [12, 12]
    later.train_dataset = rows(4)  # after a step: no re-planning
    assert [c.planned_steps for c in later.model_optimizers.values()] == [12, 12]
    assert math.isclose(later.model_optimizers["agent_0"].learning_rate, lr * (12 - 3) / 12, rel_tol=1e-9)


# ----- evaluation ---------------------------------------------------------------------------------------
def test_evaluate_reports_the_rewards_and_lengths_of_the_evaluation_rollout(tiny_llama):
    data = rows(5)
    activities = []

    def reward(c0, c1):
        activities.append(current_activity())  # what per-agent work and the flows see the trainer doing
        return length_reward(c0, c1)

    trainer = build(tiny_llama, rows(1), eval_dataset=data, reward_func=reward, config=dict(eval_num_samples=3))
    before = torch.get_rng_state()
    metrics = trainer.evaluate()
    assert torch.equal(torch.get_rng_state(), before)  # a forked RNG: training's draws are untouched
    rollout = rollout_as_evaluated(trainer, data, 3)
    rewards = joint_rewards(rollout, 0)
    assert rewards.shape == (3, 2)
    mean = float(rewards.mean())
    std = math.sqrt(float(((rewards - mean) ** 2).mean()))  # the population deviation
    lengths = [rollout.turns[0].generations[agent].lengths().double() for agent in range(2)]
    expected = {"eval/reward_mean": mean, "eval/reward_std": std, "eval/turn_1/reward_mean": mean,
                "eval/turn_1/expected_return": mean, "eval/reward/dropped": 0.0,
                "eval/agent_0/completion_length": float(lengths[0].mean()),
                "eval/agent_1/completion_length": float(lengths[1].mean())}
    assert metrics.keys() == expected.keys()
    for name, value in expected.items():
        assert math.isclose(metrics[name], value, rel_tol=1e-5, abs_tol=1e-6), name
    assert std > 0 and activities == ["evaluate"]
    # num_samples, num_eval_samples and a dataset argument; more rows asked than there are: all of them
    assert trainer.evaluate(num_samples=3) == metrics == trainer.evaluate(num_eval_samples=3)
    two = trainer.evaluate(data, num_samples=2)
    assert math.isclose(two["eval/reward_mean"], float(joint_rewards(rollout_as_evaluated(trainer, data, 2), 0).mean()),
                        rel_tol=1e-5)
    other = rows(2)
    everything = trainer.evaluate(other, num_samples=10)
    assert math.isclose(everything["eval/reward_mean"],
                        float(joint_rewards(rollout_as_evaluated(trainer, other, 2), 0).mean()), rel_tol=1e-5)
    with pytest.raises(ValueError) as error:
        trainer.evaluate(num_samples=1, num_eval_samples=2)
    assert message(error) == ("num_samples=1 and num_eval_samples=2 disagree; they name the same setting, give one "
                              "of them")
    # another reward scores the same rollout
    constant = JointReward(lambda c0, c1: [0.5] * len(c0))
    scored = trainer.evaluate(reward=constant)
    assert scored["eval/reward_mean"] == 0.5 and scored["eval/reward_std"] == 0.0
    assert scored["eval/agent_0/completion_length"] == metrics["eval/agent_0/completion_length"]
    with pytest.raises(ValueError) as error:
        build(tiny_llama, rows(1)).evaluate()
    assert message(error) == "evaluate() needs eval_dataset (given to the trainer or as an argument)"


def test_evaluate_leaves_dropped_rewards_out_and_counts_them(tiny_llama):
    def some_invalid(c0, c1):
        return [float("nan") if index % 2 else float(len(a) + 3 * len(b)) for index, (a, b) in enumerate(zip(c0, c1))]

    data = rows(2)
    trainer = build(tiny_llama, rows(1), eval_dataset=data, reward_func=some_invalid,
                    config=dict(invalid_reward="drop", eval_num_samples=2))
    metrics = trainer.evaluate()
    rollout = rollout_as_evaluated(trainer, data, 2)
    kept = joint_rewards(rollout, 0)[:, 0]  # every second joint sample is dropped
    assert metrics["eval/reward/dropped"] == 2.0
    assert math.isclose(metrics["eval/reward_mean"], float(kept.mean()), rel_tol=1e-5)
    assert math.isclose(metrics["eval/reward_std"], float(kept.std(unbiased=False)), rel_tol=1e-5, abs_tol=1e-6)
    assert trainer.reward.dropped == 0  # training's count never holds an evaluation's drops


def test_three_turn_evaluation_gives_each_turn_its_own_expected_return(tiny_llama):
    def transition(prompt, agent_completions, num_agents, **_):
        return [f"on {agent}: {agent_completions[agent][:2]}" for agent in range(num_agents)]

    data = rows(1)
    trainer = build(tiny_llama, rows(1), eval_dataset=data, external_transition=transition,
                    config=dict(num_turns=3, discount=0.5, eval_num_samples=1))
    metrics = trainer.evaluate()
    rollout = rollout_as_evaluated(trainer, data, 1)
    rewards = [joint_rewards(rollout, turn) for turn in range(3)]

    def returns_from(turn: int, later: torch.Tensor) -> torch.Tensor:
        """Turn ``turn``'s undiscounted returns: each joint sample's reward plus the mean return (``later``, one row
        per node of the next turn) of the node it spawned."""
        parents = rollout.parents()[turn + 1] or list(range(later.shape[0]))
        spawned = {parent: later[node].mean() for node, parent in enumerate(parents)}
        flat = rewards[turn].flatten()
        return torch.stack([flat[k] + spawned[k] for k in range(flat.numel())]).reshape(rewards[turn].shape)

    second_returns = returns_from(1, rewards[2])
    first_returns = returns_from(0, second_returns)
    expected = {"eval/turn_1/expected_return": first_returns.mean(),
                "eval/turn_2/expected_return": second_returns.mean(),
                "eval/turn_3/expected_return": rewards[2].mean(), "eval/turn_3/reward_mean": rewards[2].mean()}
    assert len({round(float(v), 6) for v in expected.values()}) >= 3  # the turns' numbers differ
    for name, value in expected.items():
        assert math.isclose(metrics[name], float(value), rel_tol=1e-5), name


def test_two_turn_evaluation_sums_the_returns_over_the_tree(tiny_llama):
    def transition(prompt, agent_completions, num_agents, **_):
        return [f"again {agent}: {agent_completions[agent][:3]}" for agent in range(num_agents)]

    data = rows(2)
    samples_per_row = []
    trainer = build(tiny_llama, rows(1), eval_dataset=data, external_transition=transition,
                    metrics_callback=lambda samples: samples_per_row.append(samples) or {},
                    config=dict(num_turns=2, discount=0.5, eval_num_samples=2))
    metrics = trainer.evaluate()
    rollout = rollout_as_evaluated(trainer, data, 2)
    first, second = joint_rewards(rollout, 0), joint_rewards(rollout, 1)
    assert first.shape == (2, 2) and second.shape == (4, 2)  # each joint sample of turn 1 spawned a node
    parents = rollout.parents()[1] or list(range(4))
    children = {parent: second[node].mean() for node, parent in enumerate(parents)}
    undiscounted = torch.stack([first.flatten()[k] + children[k] for k in range(4)])
    discounted = torch.stack([first.flatten()[k] + 0.5 * children[k] for k in range(4)])
    expected = {"eval/turn_1/reward_mean": first.mean(), "eval/turn_2/reward_mean": second.mean(),
                "eval/turn_1/expected_return": undiscounted.mean(), "eval/turn_2/expected_return": second.mean(),
                "eval/return_mean": discounted.mean(), "eval/reward_mean": first.mean(),
                "eval/reward_std": first.std(unbiased=False)}
    for name, value in expected.items():
        assert math.isclose(metrics[name], float(value), rel_tol=1e-5), name
    # the callback's samples: a first-turn completion's return is its reward plus half its child node's mean
    for row, samples in enumerate(samples_per_row):
        first_turn = [s for s in samples if s.metadata["turn_idx"] == 0]
        assert len(first_turn) == 4 and len(samples) == 4 + 2 * 4  # two child nodes per row in the second turn
        for sample in first_turn:
            k = row * 2 + sample.metadata["generation_idx"]  # aligned: generation g is joint sample g
            assert math.isclose(float(sample.reward[0]), float(first.flatten()[k]), rel_tol=1e-5)
            assert math.isclose(float(sample.returns[0]), float(discounted[k]), rel_tol=1e-5)
    for agent in range(2):
        lengths = torch.cat([turn.generations[agent].lengths().double() for turn in rollout.turns])
        assert lengths.numel() == 2 * 2 + 4 * 2
        assert math.isclose(metrics[f"eval/agent_{agent}/completion_length"], float(lengths.mean()), rel_tol=1e-6)


def test_the_metrics_callback_gets_each_row_and_its_numbers_are_averaged(tiny_llama):
    calls = []

    def callback(samples):
        calls.append(samples)
        if len(calls) == 2:
            return "not a dict"
        first = [s for s in samples if s.agent_idx == 1 and s.metadata["generation_idx"] == 1]
        return {"picked": float(first[0].reward[0]), "returns": float(first[0].returns[0]), "label": "words",
                "count": len(samples)}

    data = rows(3)
    trainer = build(tiny_llama, rows(1), eval_dataset=data, metrics_callback=callback,
                    config=dict(joint_mode="cross", eval_num_samples=3))
    metrics = trainer.evaluate()
    rollout = rollout_as_evaluated(trainer, data, 3)
    rewards = joint_rewards(rollout, 0)  # [rows, 4]: joint j pairs generation j // 2 of agent 0, j % 2 of agent 1
    joint = rollout.joint_index
    assert len(calls) == 3 and all(len(samples) == 2 * 2 for samples in calls)
    for row, samples in enumerate(calls):
        assert [s.metadata["batch_item"] for s in samples] == [data[row]] * 4
        for sample in samples:
            agent, generation = sample.agent_idx, sample.metadata["generation_idx"]
            uses = [j for j in range(4) if int(joint[j, agent]) == generation]
            assert len(uses) == 2
            expected = float(rewards[row, uses].mean())
            assert math.isclose(float(sample.reward[0]), expected, rel_tol=1e-5)
            assert math.isclose(float(sample.returns[0]), expected, rel_tol=1e-5)
            assert sample.completion == rollout.turns[0].generations[agent].texts[row * 2 + generation]
            assert sample.prompt == rollout.turns[0].prompts[agent][row]
            assert sample.metadata["turn_idx"] == 0
    # rows 0 and 2 returned numbers (row 1 returned no dict): their mean
    picked = [float(rewards[row, [j for j in range(4) if int(joint[j, 1]) == 1]].mean()) for row in (0, 2)]
    assert math.isclose(metrics["eval/picked"], sum(picked) / 2, rel_tol=1e-5)
    assert metrics["eval/count"] == 4.0 and "eval/label" not in metrics


def test_eval_logger_and_aggregator_see_the_first_joint_sample_of_every_turn(tiny_llama):
    def transition(prompt, agent_completions, num_agents, **_):
        return [f"again {agent}: {agent_completions[agent][:3]}" for agent in range(num_agents)]

    seen = {}

    def eval_logger(agent_completions_turns, batch_items, prompts):
        seen["logger"] = (agent_completions_turns, batch_items, prompts)
        return ["detailed"]

    def eval_aggregator(detailed, num_turns):
        seen["aggregator"] = (detailed, num_turns)
        return {"team/score": 2.5}

    data = Dataset.from_dict({"prompt": ["say cat", "say dog"], "id": [4, 5]})
    trainer = build(tiny_llama, rows(1), eval_dataset=data, external_transition=transition,
                    eval_logger=eval_logger, eval_aggregator=eval_aggregator,
                    config=dict(num_turns=2, eval_num_samples=2, joint_mode="cross"))
    metrics = trainer.evaluate()
    assert metrics["eval/team/score"] == 2.5
    assert seen["aggregator"] == (["detailed"], 2)
    completions, items, prompts = seen["logger"]
    assert items == [data[0], data[1]] and prompts == ["say cat", "say dog"]
    rollout = rollout_as_evaluated(trainer, data, 2)
    joint = rollout.joint_index
    for agent in range(2):
        for row in range(2):
            first = rollout.turns[0].generations[agent].texts[row * 2 + int(joint[0, agent])]
            child = row * rollout.num_joint  # the node spawned by the row's first joint sample
            second = rollout.turns[1].generations[agent].texts[child * 2 + int(joint[0, agent])]
            assert completions[agent][row] == [first, second]
    # a row without a "prompt" field, or a mapping that is not a dict, gives the logger an empty prompt
    questions = [{"question": "say sun"}, types.MappingProxyType({"question": "say moon", "prompt": "moon"})]
    asking = build(tiny_llama, None, eval_dataset=questions, formatters=lambda row: row["question"],
                   eval_logger=eval_logger, eval_aggregator=eval_aggregator, config=dict(eval_num_samples=2))
    asking.evaluate()
    assert seen["logger"][2] == ["", ""] and seen["logger"][1] == questions
    assert seen["aggregator"] == (["detailed"], 1)
    # one of the two hooks alone adds nothing
    alone = build(tiny_llama, rows(1), eval_dataset=data, eval_logger=eval_logger, config=dict(eval_num_samples=2))
    assert "eval/team/score" not in alone.evaluate()


def test_sample_rewards_scores_every_row_once_per_reward(tiny_llama):
    data = rows(3)
    trainer = build(tiny_llama, rows(1), config=dict(joint_mode="cross"))
    doubled = JointReward(lambda c0, c1: [2.0 * value for value in length_reward(c0, c1)])
    first, second = trainer.sample_rewards(data, [trainer.reward, doubled])
    expected = joint_rewards(rollout_as_evaluated(trainer, data, 3), 0)
    assert first.shape == (3, 4)
    torch.testing.assert_close(first.double(), expected)
    torch.testing.assert_close(second.double(), 2 * expected)
    # a plain function is scored as a JointReward of it
    rollout = rollout_as_evaluated(trainer, data, 3)
    tripled = trainer.score(rollout, lambda c0, c1: [3.0 * value for value in length_reward(c0, c1)])
    torch.testing.assert_close(tripled[0].double(), 3 * expected)


# ----- the optimizer steps' metrics and the non-finite guard ------------------------------------------------
def test_each_optimizer_step_reports_its_norm_and_rate_and_the_epoch_end_flushes(tiny_llama):
    trainer = build(tiny_llama, rows(3), config=dict(gradient_accumulation_steps=2, agent_learning_rate=3e-4,
                                                     shuffle=False))
    history = trainer.train()
    assert len(history) == 3
    step_keys = {f"agent_{a}/{name}" for a in range(2) for name in ("grad_norm", "learning_rate")}
    assert not step_keys & history[0].keys()  # the first micro-batch of a window of two takes no step
    for row in (history[1], history[2]):  # the window's step; the epoch end's flush of the third batch
        assert step_keys <= row.keys()
        assert row["agent_0/learning_rate"] == row["agent_1/learning_rate"] == 3e-4
        assert all(math.isfinite(row[f"agent_{a}/grad_norm"]) and row[f"agent_{a}/grad_norm"] > 0 for a in range(2))
    assert [c.steps for c in trainer.model_optimizers.values()] == [2, 2]
    assert trainer.state.nonfinite_updates == 0 and history[2]["nonfinite_updates"] == 0.0
    assert trainer.flush_optimizers() == {}  # nothing pending after the epoch


def test_skipped_updates_are_counted_and_too_many_in_a_row_stop(tiny_llama):
    trainer = build(tiny_llama, rows(1), config=dict(max_nonfinite_updates=2))
    trainer.record_nonfinite(1)
    trainer.record_nonfinite(0)  # a good step ends the run of skipped ones
    assert (trainer.state.nonfinite_updates, trainer.state.consecutive_nonfinite) == (1, 0)
    trainer.record_nonfinite(1)
    assert (trainer.state.nonfinite_updates, trainer.state.consecutive_nonfinite) == (2, 1)
    with pytest.raises(NonFiniteTrainingError) as error:
        trainer.record_nonfinite(1)
    assert message(error) == ("2 consecutive optimizer steps had a NaN/inf loss or gradient (max_nonfinite_updates=2); "
                              "check the rewards and learning rate")
    assert trainer.state.nonfinite_updates == 3


# ----- state --------------------------------------------------------------------------------------------
class CountingCallback(TrainerCallback):
    def __init__(self):
        self.logs = 0

    def on_log(self, trainer, logs, step):
        self.logs += 1

    def state_dict(self):
        return {"logs": self.logs}

    def load_state_dict(self, state):
        self.logs = state["logs"]


class SaveOnlyCallback(TrainerCallback):
    def state_dict(self):
        return {"never": "loaded"}


class StatefulRows(list):
    position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def test_state_dict_holds_what_a_resume_needs_and_loads_into_a_fresh_trainer(tiny_llama):
    data = StatefulRows({"prompt": f"say {word}"} for word in WORDS[:2])
    data.position = 9
    trained = build(tiny_llama, data, callbacks=[CountingCallback(), SaveOnlyCallback(), TrainerCallback()])
    assert len(trained.callbacks) == 3
    trained.train()
    trained.reward.load_state_dict({"dropped": 3, "per_sample": []})
    state = trained.state_dict()
    after_capture = torch.rand(4)
    assert state.keys() == {"progress", "optimizers", "reward", "stateful", "rng"}
    assert state["progress"] == dataclasses.asdict(trained.state) and state["progress"]["global_step"] == 2
    assert state["reward"] == {"dropped": 3, "per_sample": []}
    assert state["stateful"] == {"train_dataset": {"position": 9}, "callback_0": {"logs": trained.callbacks[0].logs}}
    assert trained.callbacks[0].logs > 0
    assert set(state["optimizers"]) == {"agent_0", "agent_1"} and state["optimizers"]["agent_1"]["steps"] == 2

    fresh_data = StatefulRows(data)
    fresh = build(tiny_llama, fresh_data, callbacks=[CountingCallback()])
    fresh.load_state_dict(state)
    torch.testing.assert_close(torch.rand(4), after_capture)  # the RNGs come back last
    assert fresh.state == trained.state and fresh.state.history == trained.history
    assert fresh.reward.dropped == 3
    assert fresh.callbacks[0].logs == trained.callbacks[0].logs and fresh_data.position == 9
    for name in ("agent_0", "agent_1"):
        loaded, saved = fresh.model_optimizers[name], trained.model_optimizers[name]
        assert loaded.steps == saved.steps == 2
        torch.testing.assert_close(loaded.optimizer.state_dict()["state"], saved.optimizer.state_dict()["state"])

    without_rng = trained.state_dict(include_rng=False)
    assert "rng" not in without_rng
    without_rng["stateful"] = {}  # what a checkpoint of other objects holds: the user's objects keep their state
    fresh.callbacks[0].logs = 41
    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    fresh.load_state_dict(without_rng)
    torch.testing.assert_close(torch.rand(2), expected)  # no RNG saved: none restored
    assert fresh.callbacks[0].logs == 41

    del without_rng["optimizers"]["agent_1"]
    with pytest.raises(ValueError) as error:
        fresh.load_state_dict(without_rng)
    assert message(error) == "the checkpoint holds no optimizer state for ['agent_1']"
    with pytest.raises(ValueError) as error:
        fresh.load_state_dict(without_rng, "checkpoint-2")
    assert message(error) == "checkpoint-2 holds no optimizer state for ['agent_1']"
    broken = trained.state_dict()
    broken["optimizers"]["agent_1"]["pending_grads"] = {"nowhere.weight": torch.zeros(1)}
    with pytest.raises(ValueError) as error:
        fresh.load_state_dict(broken, "checkpoint-2")
    assert message(error) == ("checkpoint-2, optimizer 'agent_1': saved pending gradient for 'nowhere.weight', which "
                              "the model lacks")


def test_a_resume_past_the_planned_epochs_is_refused(tiny_llama):
    trainer = build(tiny_llama, rows(1), config=dict(num_train_epochs=2))
    trainer.check_resume_progress({"epoch": 2})
    with pytest.raises(ValueError) as error:
        trainer.check_resume_progress({"epoch": 3})
    assert message(error) == ("the checkpoint has completed 3 epochs but num_train_epochs is 2; num_train_epochs counts "
                              "the whole run, so raise it")


def test_construction_seeds_every_generator_from_the_config(tiny_llama):
    draws = []
    for noise in (1, 2):
        torch.manual_seed(noise)
        build(tiny_llama, rows(1), config=dict(seed=11))
        draws.append(torch.rand(3))
    torch.testing.assert_close(draws[0], draws[1])
    build(tiny_llama, rows(1), config=dict(seed=12))
    assert not torch.equal(torch.rand(3), draws[0])


# ----- export -------------------------------------------------------------------------------------------
def test_save_model_writes_each_agent_in_its_own_directory(tiny_llama, tiny_llama_b, tmp_path):
    trainer = MAGRPOTrainer(agents=[tiny_llama, tiny_llama_b], reward_func=length_reward, train_dataset=rows(1),
                            args=MAGRPOConfig(**FAST))
    trainer.train()  # the weights moved away from both sources
    target = tmp_path / "new" / "export"
    assert trainer.save_model(str(target)) == target
    assert sorted(p.name for p in target.iterdir()) == ["agent_0", "agent_1"]
    for index, agent in enumerate(trainer.agents):
        saved = AutoModelForCausalLM.from_pretrained(target / f"agent_{index}")
        torch.testing.assert_close(dict(saved.named_parameters()), dict(agent.named_parameters()))
        assert (target / f"agent_{index}" / "tokenizer.json").is_file()
    source = AutoModelForCausalLM.from_pretrained(tiny_llama)
    assert not torch.equal(source.lm_head.weight, trainer.agents[0].lm_head.weight)


# ----- the reference KL's metrics ------------------------------------------------------------------------
def test_reference_kl_metrics_are_the_mean_the_per_agent_means_and_the_penalty(tiny_llama, tiny_llama_b):
    trainer = build(tiny_llama, rows(1), config=dict(**KL, reference_model=tiny_llama_b,
                                                     reference_kl_coef=0.25))
    assert len(trainer.reference_models) == 2
    reference_b = AutoModelForCausalLM.from_pretrained(tiny_llama_b)
    torch.testing.assert_close(trainer.reference_models[1].lm_head.weight, reference_b.lm_head.weight)
    row = trainer.train()[0]
    per_agent = [row["agent_0/reference_kl"], row["agent_1/reference_kl"]]
    assert per_agent[0] != per_agent[1] and min(per_agent) > 0
    # both agents have num_generations completions: the mean per completion is the mean of the agents' means
    assert math.isclose(row["reference_kl_mean"], sum(per_agent) / 2, rel_tol=1e-5)
    assert math.isclose(row["reference_kl_penalty_mean"], 0.25 * row["reference_kl_mean"], rel_tol=1e-6)
    assert "reference_kl_mean" not in build(tiny_llama, rows(1)).train()[0]


def completion_logprobs_by_hand(model, generation, temperature, dtype):
    """Each completion token's log-probability under ``model``: one forward over prompt and completion (positions
    counting real tokens), under CPU autocast to ``dtype`` when given, the logits over the temperature in float32."""
    ids = torch.cat([generation.prompt_ids, generation.completion_ids], dim=1)
    mask = torch.cat([generation.prompt_mask, generation.completion_mask], dim=1)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    logits = logits[:, generation.prompt_ids.shape[1] - 1:-1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, generation.completion_ids.unsqueeze(-1)).squeeze(-1)


def test_under_bf16_mixed_the_reference_is_read_under_bf16_autocast(tiny_llama, tiny_llama_b):
    """``precision="bf16-mixed"``: the reference's log-probabilities are those of a bf16-autocast forward (within
    1e-4), not a float32 one (measured 1.6e-3 to 2.6e-3 away)."""
    data = rows(2)
    trainer = build(tiny_llama, data, config=dict(**KL, reference_model=tiny_llama_b, precision="bf16-mixed",
                                                  temperature=0.7))
    torch.manual_seed(0)
    rollout = trainer.rollout([data[0], data[1]])
    terms = trainer.reference(rollout)
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_b)
    for agent in range(2):
        generation = rollout.turns[0].generations[agent]
        kept = generation.completion_mask.bool()
        read = terms.reference[agent][0][kept]
        torch.testing.assert_close(read, completion_logprobs_by_hand(reference, generation, 0.7, torch.bfloat16)[kept],
                                   rtol=0, atol=1e-4)
        assert (read - completion_logprobs_by_hand(reference, generation, 0.7, None)[kept]).abs().max() > 5e-4


# ----- the reward and the per-agent map ------------------------------------------------------------------
def test_use_reward_swaps_the_reward_and_returns_the_old_one(tiny_llama):
    data = rows(2)
    trainer = build(tiny_llama, rows(1), eval_dataset=data, config=dict(eval_num_samples=2))
    original = trainer.reward
    with pytest.raises(TypeError) as error:
        trainer.use_reward(length_reward)
    assert message(error) == "use_reward needs a JointReward, got function"
    constant = JointReward(lambda c0, c1: [1.5] * len(c0))
    assert trainer.use_reward(constant) is original
    assert trainer.reward is constant and trainer.evaluate()["eval/reward_mean"] == 1.5


def test_run_agents_with_routes_the_agents_work_and_copies_the_tokenizers(tiny_llama):
    shared = AutoTokenizer.from_pretrained(tiny_llama)
    trainer = build(tiny_llama, rows(1), eval_dataset=rows(1), tokenizer=shared)
    assert trainer.agents_run_in_turn()
    calls = []

    def in_order(function, devices):
        calls.append(len(devices))
        return [function(index) for index in range(len(devices))]

    before = list(trainer.tokenizers)
    trainer.run_agents_with(in_order)
    assert trainer.tokenizers == before and not trainer.agents_run_in_turn()
    trainer.evaluate()
    assert calls == [2]
    trainer.run_agents_with(in_order, private_tokenizers=True)
    assert before[0] is before[1] is shared  # one tokenizer given: one object for both agents
    assert trainer.tokenizers[0] is before[0] and trainer.tokenizers[1] is not before[0]
    assert [t("say cat")["input_ids"] for t in trainer.tokenizers] == [t("say cat")["input_ids"] for t in before]


# ----- the algorithm registry and the constructor's inputs --------------------------------------------------
def test_the_registry_loads_each_algorithm_and_names_the_known_ones():
    from comlrl.trainers.preference import MADPOConfig, MADPOTrainer

    assert algorithm("madpo").load() == (MADPOTrainer, MADPOConfig)
    assert algorithm("magrpo").load() == (MAGRPOTrainer, MAGRPOConfig)
    assert algorithm("iac").homes == {"IACTrainer": "comlrl.trainers.actor_critic",
                                      "IACConfig": "comlrl.trainers.actor_critic"}
    with pytest.raises(ValueError) as error:
        algorithm("ppo")
    assert message(error) == ("unknown algorithm 'ppo'; choose one of ['iac', 'maac', 'madpo', 'madpo_iter', "
                              "'magrpo', 'magrpo_centralized', 'mareinforce', 'maremax', 'marlhf', "
                              "'marlhf_iter', 'marloo']")
    assert error.value.__cause__ is None and error.value.__suppress_context__
    assert ALGORITHMS["marlhf"].kind == "pbrl" and ALGORITHMS["maac"].kind == "epochs"


def test_input_names_are_the_trainer_constructors_arguments():
    expected = {"agent_model", "agents", "num_agents", "tokenizer", "reward_func", "reward_processor", "formatters",
                "external_transition", "train_dataset", "eval_dataset", "callbacks", "model_config", "wandb_config",
                "metrics_callback", "eval_logger", "eval_aggregator", "model"}
    assert input_names() == expected
    assert set(inspect.signature(MultiAgentTrainer.__init__).parameters) - {"self", "args"} == expected


def test_an_episode_that_ends_early_has_its_own_returns_and_logged_turns(tiny_llama):
    def reward(c0, c1, batch_items):  # "say cat" scores above the threshold: its episode ends after one turn
        bonus = [1000.0 if item["prompt"] == "say cat" else 0.0 for item in batch_items]
        return [value + extra for value, extra in zip(length_reward(c0, c1), bonus)]

    def transition(prompt, agent_completions, num_agents, **_):
        return [f"again {agent}: {agent_completions[agent][:3]}" for agent in range(num_agents)]

    seen, samples_per_row = {}, []
    data = rows(3)
    trainer = build(tiny_llama, rows(1), eval_dataset=data, reward_func=reward, external_transition=transition,
                    metrics_callback=lambda samples: samples_per_row.append(samples) or {},
                    eval_logger=lambda agent_completions_turns, **_: seen.setdefault("turns", agent_completions_turns),
                    eval_aggregator=lambda detailed, num_turns: {},
                    config=dict(num_turns=2, discount=0.5, eval_num_samples=3, early_termination_threshold=500.0))
    metrics = trainer.evaluate()
    rollout = rollout_as_evaluated(trainer, data, 3)
    first = joint_rewards(rollout, 0, lambda c0, c1: reward(c0, c1, rollout.joint_rows(0)))
    parents = rollout.parents()[1]
    assert parents == [2, 3, 4, 5]  # row 0's two joint samples spawned nothing
    c0, c1 = rollout.joint_completions(1)
    second = torch.tensor(length_reward(c0, c1), dtype=torch.float64).reshape(4, 2)
    child = {parent: second[node].mean() for node, parent in enumerate(parents)}
    flat = first.flatten()
    undiscounted = torch.stack([flat[k] + child.get(k, 0.0) for k in range(6)])
    discounted = torch.stack([flat[k] + 0.5 * child.get(k, 0.0) for k in range(6)])
    assert math.isclose(metrics["eval/turn_1/expected_return"], float(undiscounted.mean()), rel_tol=1e-5)
    assert math.isclose(metrics["eval/return_mean"], float(discounted.mean()), rel_tol=1e-5)
    for row, samples in enumerate(samples_per_row):
        for sample in (s for s in samples if s.metadata["turn_idx"] == 0):
            k = row * 2 + sample.metadata["generation_idx"]
            assert math.isclose(float(sample.returns[0]), float(discounted[k]), rel_tol=1e-5)
    # the logger: row 0 ended after its first turn; rows 1 and 2 go on from their first joint sample (k = 2, 4)
    for agent in range(2):
        texts = [turn.generations[agent].texts for turn in rollout.turns]
        assert seen["turns"][agent] == [[texts[0][0]], [texts[0][2], texts[1][0]], [texts[0][4], texts[1][4]]]


def test_each_agent_gets_its_own_reference_loaded_with_the_agents_options(tiny_llama, tiny_llama_b):
    config = dict(**KL, reference_model=[tiny_llama_b, tiny_llama], reference_devices="cpu")
    trainer = build(tiny_llama, rows(1), model_config={"dtype": torch.float64}, config=config)
    for reference, source in zip(trainer.reference_models, (tiny_llama_b, tiny_llama)):
        expected = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float64)
        assert {p.dtype for p in reference.parameters()} == {torch.float64}
        torch.testing.assert_close(dict(reference.named_parameters()), dict(expected.named_parameters()))
        assert not any(p.requires_grad for p in reference.parameters())
    # without reference_model: a frozen copy of each agent's initial weights, apart from the agent
    copies = build(tiny_llama, rows(1), config=dict(KL))
    for agent, reference in zip(copies.agents, copies.reference_models):
        assert reference is not agent
        torch.testing.assert_close(dict(reference.named_parameters()), dict(agent.named_parameters()))
    with pytest.raises(ValueError) as error:
        build(tiny_llama, rows(1), config=dict(**KL, reference_devices="cuda:99"))
    assert message(error).startswith("MAGRPOConfig.reference_devices='cuda:99' cannot be used: device 'cuda:99' was "
                                     "requested but this machine has ")


def test_a_partial_window_is_flushed_before_any_step_was_counted(tiny_llama):
    trainer = build(tiny_llama, rows(2), config=dict(gradient_accumulation_steps=2))
    trainer.train_step([rows(2)[0]])  # a step's stages, not yet counted: one micro-batch pending, no history
    assert trainer.history == [] and trainer.model_optimizers["agent_0"].pending == 1
    metrics = trainer.flush_optimizers()
    assert set(metrics) == {f"agent_{a}/{name}" for a in range(2) for name in ("grad_norm", "learning_rate")}
    assert trainer.history == [] and trainer.model_optimizers["agent_0"].steps == 1


def test_save_model_writes_a_lora_agents_adapters_when_asked(tiny_llama, tmp_path):
    trainer = build(tiny_llama, rows(1), config=dict(lora_rank=2, lora_alpha=4, lora_save="adapter"))
    trainer.save_model(tmp_path)
    for index in range(2):
        files = {p.name for p in (tmp_path / f"agent_{index}").iterdir()}
        assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "model.safetensors" not in files


def test_the_original_buffer_size_sets_a_batch_that_a_small_dataset_cannot_fill(tiny_llama):
    # comlrl 1.4.3's rollout_buffer_size=3 gives 3 prompts per step here, a batch not capped at the dataset's rows
    with pytest.raises(ValueError) as error:
        MAGRPOTrainer(agent_model=tiny_llama, num_agents=2, reward_func=length_reward, train_dataset=rows(2),
                      args=MAGRPOConfig(num_generations=2, max_new_tokens=4, rollout_buffer_size=3))
    assert message(error) == ("train_dataset has 2 rows, fewer than one batch (per_device_train_batch_size=3); "
                              "lower the batch size")


def test_the_agents_optimizers_and_memory_options_follow_the_config(tiny_llama):
    with pytest.raises(ValueError) as error:
        build(tiny_llama, rows(1), config=dict(device="cuda:99"))
    assert message(error).startswith("MAGRPOConfig.device='cuda:99' cannot be used: device 'cuda:99' was requested")
    config = dict(agent_learning_rate=2e-4, weight_decay=0.05, lr_scheduler_type="linear", warmup_steps=3,
                  max_grad_norm=0.5, gradient_accumulation_steps=2, gradient_checkpointing=True)
    trainer = build(tiny_llama, rows(2), config=config)
    settings = trainer.optimizer_settings
    assert (settings.weight_decay, settings.lr_scheduler_type, settings.warmup_steps, settings.accumulation_steps,
            settings.max_grad_norm) == (0.05, "linear", 3, 2, 0.5)
    for index, agent in enumerate(trainer.agents):
        component = trainer.model_optimizers[f"agent_{index}"]
        assert component.name == f"agent_{index}" and component.module is agent and component.passes == 1
        (group,) = component.optimizer.param_groups
        assert group["params"] == list(agent.parameters())
        assert group["weight_decay"] == 0.05 and group["initial_lr"] == 2e-4
        assert group["lr"] == 0.0  # linear warm-up starts from 0
        assert agent.is_gradient_checkpointing
    assert not build(tiny_llama, rows(1)).agents[0].is_gradient_checkpointing


def test_lora_adapters_get_the_configured_rank_scaling_dropout_and_layers(tiny_llama, tmp_path):
    trainer = build(tiny_llama, rows(1), config=dict(lora_rank=2, lora_alpha=6, lora_dropout=0.25,
                                                     lora_target_modules=["q_proj", "v_proj"], lora_save="adapter"))
    trainer.save_model(tmp_path)
    import json

    for index in range(2):
        adapter = json.loads((tmp_path / f"agent_{index}" / "adapter_config.json").read_text())
        assert (adapter["r"], adapter["lora_alpha"], adapter["lora_dropout"]) == (2, 6, 0.25)
        assert sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]
    # a rollout samples with every dropout off, after training put the agents in training mode
    trainer.train()
    trainer.rollout([rows(1)[0]])
    assert not any(module.training for agent in trainer.agents for module in agent.modules())


def test_the_constructors_defaults_old_names_and_the_agent_count(tiny_llama):
    default = MAGRPOTrainer(model=tiny_llama, reward_func=length_reward)  # agent_model's name before comlrl 1.4
    assert type(default.args) is MAGRPOConfig and default.args.num_generations == MAGRPOConfig().num_generations
    assert len(default.agents) == MAGRPOConfig().num_agents
    expected = AutoModelForCausalLM.from_pretrained(tiny_llama)
    torch.testing.assert_close(dict(default.agents[0].named_parameters()), dict(expected.named_parameters()))
    with pytest.raises(ValueError) as error:
        MAGRPOTrainer(agent_model=tiny_llama, num_agents=3, reward_func=length_reward, args=MAGRPOConfig(**FAST))
    assert message(error) == ("num_agents must match args.num_agents: num_agents=3 (constructor) disagrees with "
                              "MAGRPOConfig.num_agents=2; set both to the same value (the config alone never overrides "
                              "the constructor argument)")
    # two update epochs per batch: two backward passes, the schedule planned over twice the micro-batches
    twice = build(tiny_llama, rows(3), config=dict(policy_update_epochs=2))
    assert [(c.passes, c.planned_steps) for c in twice.model_optimizers.values()] == [(2, 6), (2, 6)]


def test_the_reward_takes_the_configured_weights_processor_and_retries(tiny_llama):
    data = rows(2)
    calls = []

    def flaky(c0, c1):  # fails on its first call; one retry (no backoff) makes the evaluation go through
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the scorer's server is not up yet")
        return [2.0] * len(c0)

    trainer = build(tiny_llama, rows(1), eval_dataset=data, reward_func=[length_reward, flaky],
                    reward_processor=lambda value: 2.0 * value,
                    config=dict(reward_weights=[1.0, 0.5], reward_retries=1, reward_retry_backoff=0.0,
                                eval_num_samples=2))
    metrics = trainer.evaluate()
    lengths = joint_rewards(rollout_as_evaluated(trainer, data, 2), 0)
    assert math.isclose(metrics["eval/reward_mean"], float((2.0 * (lengths + 0.5 * 2.0)).mean()), rel_tol=1e-5)
    assert len(calls) == 2


def test_wandb_config_is_kept_checked_and_without_the_package_adds_no_tracker(tiny_llama, caplog):
    with pytest.raises(ValueError) as error:
        build(tiny_llama, rows(1), wandb_config="project-x")
    assert message(error) == "wandb_config must be a dict of wandb.init arguments, got str"
    config = {"project": "comlrl-tests", "mode": "offline"}
    with caplog.at_level("WARNING"):
        trainer = build(tiny_llama, rows(1), wandb_config=config, callbacks=[TrainerCallback()])
    assert trainer.wandb_config == config and len(trainer.callbacks) == 1  # wandb is not installed here
    assert "wandb_config was given but the wandb package is not installed" in caplog.text


def test_mixed_precision_samples_from_bf16_copies_and_a_plain_trainer_needs_no_peft(tiny_llama, monkeypatch):
    mixed = build(tiny_llama, rows(1), config=dict(precision="bf16-mixed"))
    assert mixed.autocast_dtype == torch.bfloat16
    assert {p.dtype for model in mixed.sampling_agents() for p in model.parameters()} == {torch.bfloat16}
    assert {p.dtype for model in mixed.agents for p in model.parameters()} == {torch.float32}
    plain = build(tiny_llama, rows(1))
    assert plain.autocast_dtype is None and plain.sampling_agents() == plain.agents
    monkeypatch.setitem(sys.modules, "peft", None)  # peft not installed: only LoRA needs it
    assert len(build(tiny_llama, rows(1)).agents) == 2


def test_a_tokenizer_larger_than_the_agents_vocabulary_is_refused_naming_the_agent(tiny_llama, tiny_gpt2):
    with pytest.raises(ValueError) as error:
        build(tiny_llama, rows(1), tokenizer=AutoTokenizer.from_pretrained(tiny_gpt2))
    assert message(error).startswith(f"the tokenizer given for agent_0 has 128 tokens but the model {tiny_llama!r} "
                                     "embeds only 96")


def test_three_turns_with_an_early_end_log_each_episodes_own_path(tiny_llama):
    def reward(c0, c1, batch_items):  # "say cat" ends after its first turn; the other rows run all three
        bonus = [1000.0 if item["prompt"] == "say cat" else 0.0 for item in batch_items]
        return [value + extra for value, extra in zip(length_reward(c0, c1), bonus)]

    def transition(prompt, agent_completions, num_agents, **_):
        return [f"again {agent}: {agent_completions[agent][:3]}" for agent in range(num_agents)]

    seen = {}
    data = rows(3)
    trainer = build(tiny_llama, rows(1), eval_dataset=data, reward_func=reward, external_transition=transition,
                    eval_logger=lambda agent_completions_turns, **_: seen.setdefault("turns", agent_completions_turns),
                    eval_aggregator=lambda detailed, num_turns: {},
                    config=dict(num_turns=3, eval_num_samples=3, early_termination_threshold=500.0))
    trainer.evaluate()
    rollout = rollout_as_evaluated(trainer, data, 3)
    assert [turn.num_nodes for turn in rollout.turns] == [3, 4, 8]
    assert rollout.parents()[1] == [2, 3, 4, 5] and rollout.parents()[2] in (None, list(range(8)))
    # row 1: first joint sample k=2 -> turn-2 node 0 -> its first sample 0 -> turn-3 node 0; row 2: 4 -> 2 -> 4
    for agent in range(2):
        texts = [turn.generations[agent].texts for turn in rollout.turns]
        assert seen["turns"][agent] == [[texts[0][0]], [texts[0][2], texts[1][0], texts[2][0]],
                                        [texts[0][4], texts[1][4], texts[2][8]]]
