"""Code written for comlrl 1.4.3 runs unchanged: its train/evaluate keywords, constructor hooks and metric names."""

from __future__ import annotations

import json
import logging
import sys
import types

import pytest
from datasets import Dataset

from comlrl.callbacks import MetricsRecorder
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

# One prompt per step (the default is two, tests/test_default_batching.py): these tests count steps per row.
FAST = dict(num_agents=2, num_generations=2, max_new_tokens=4, num_train_epochs=1, disable_tqdm=True,
            per_device_train_batch_size=1)


def rows(count: int) -> Dataset:
    return Dataset.from_dict({"prompt": [f"say {word}" for word in ["cat", "dog", "sun", "moon"][:count]]})


def constant_reward(c0, c1):
    return [0.25] * len(c0)


def length_reward(c0, c1):
    return [float(len(a) + len(b)) for a, b in zip(c0, c1)]


def build(model, train_dataset=None, **kwargs):
    settings = {**FAST, **kwargs.pop("config", {})}
    return MAGRPOTrainer(agent_model=model, num_agents=2, reward_func=kwargs.pop("reward_func", length_reward),
                         train_dataset=train_dataset, args=MAGRPOConfig(**settings), **kwargs)


# ----- 1. eval_interval=0 -------------------------------------------------------------------------
def test_eval_interval_zero_means_no_periodic_evaluation(tiny_llama):
    trainer = build(tiny_llama, rows(2), eval_dataset=rows(1), config=dict(eval_interval=0))
    calls = []
    trainer.evaluate = lambda *a, **k: calls.append(1) or {}
    assert len(trainer.train()) == 2
    assert calls == []
    with pytest.raises(ValueError, match=r"eval_interval must be >= 0 or null \(None\), got -1"):
        MAGRPOConfig(eval_interval=-1)


# ----- 2. train() keywords --------------------------------------------------------------------------
def test_train_keywords_are_checked_before_any_work(tiny_llama, tmp_path):
    trainer = build(tiny_llama, rows(1))
    with pytest.raises(TypeError, match="checkpoint_every"):
        trainer.train(checkpoint_every=2)
    with pytest.raises(ValueError, match="checkpoint_total_limit=1 and save_total_limit=2"):
        trainer.train(checkpoint_dir=tmp_path, checkpoint_total_limit=1, save_total_limit=2)
    with pytest.raises(ValueError, match="checkpoint_total_limit must be a positive integer"):
        trainer.train(checkpoint_dir=tmp_path, checkpoint_total_limit=0)
    assert trainer.state.global_step == 0 and not any(tmp_path.iterdir())


def test_checkpoint_total_limit_keeps_newest_and_the_resumed_one(tiny_llama, tmp_path):
    first = build(tiny_llama, rows(1), config=dict(num_train_epochs=2))
    # The pipeline's way (keyword dict, our save_total_limit) keeps working, equal values under both names too.
    first.train(**{"checkpoint_dir": tmp_path, "save_total_limit": 2, "checkpoint_total_limit": 2})
    # beside the checkpoints: the run's appended per-step history (comlrl.checkpointing.history)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-2", "history"]

    resumed = build(tiny_llama, rows(1), config=dict(num_train_epochs=4))
    resumed.train(resume_from_checkpoint=tmp_path / "checkpoint-1", checkpoint_dir=tmp_path,
                  checkpoint_interval=1, checkpoint_total_limit=1)
    assert resumed.state.epoch == 4
    # newest one kept, and the checkpoint the run resumed from is never deleted; the abandoned branch's
    # checkpoint-2 is archived, not deleted
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-4"]
    assert [p.name for p in (tmp_path / "abandoned").glob("*/*")] == ["checkpoint-2"]


# ----- 3. evaluate(num_eval_samples=) ---------------------------------------------------------------
def test_evaluate_num_eval_samples(tiny_llama):
    trainer = build(tiny_llama, rows(1), eval_dataset=rows(3))
    seen = []
    original_rollout = trainer.rollout
    trainer.rollout = lambda batch, row_labels=None: seen.append(len(batch)) or original_rollout(batch, row_labels)
    by_old_name = trainer.evaluate(num_eval_samples=2)
    by_new_name = trainer.evaluate(num_samples=2)
    assert seen == [2, 2]
    assert by_old_name == by_new_name
    assert trainer.evaluate(num_samples=2, num_eval_samples=2) == by_old_name
    with pytest.raises(ValueError, match="num_samples=1 and num_eval_samples=2"):
        trainer.evaluate(num_samples=1, num_eval_samples=2)


# ----- 4. metrics_callback, eval_logger/eval_aggregator, wandb_config --------------------------------
def test_metrics_callback_gets_the_original_samples(tiny_llama):
    data = rows(2)
    calls = []

    def callback(samples):
        calls.append(samples)
        return {"domain/first_agent_share": sum(s.agent_idx == 0 for s in samples) / len(samples),
                "domain/ignored": "not a number"}

    trainer = build(tiny_llama, data, eval_dataset=data, metrics_callback=callback, config=dict(shuffle=False))
    history = trainer.train()
    assert len(calls) == 2  # once per batch item (one row per step here)
    for step, samples in zip(history, calls):
        assert len(samples) == 2 * 2  # agents x generations, one turn
        assert {s.agent_idx for s in samples} == {0, 1}
        assert all(isinstance(s.completion, str) and isinstance(s.prompt, str) for s in samples)
        assert {s.metadata["turn_idx"] for s in samples} == {0}
        assert {s.metadata["generation_idx"] for s in samples} == {0, 1}
        for generation in (0, 1):  # aligned joints: generation g of each agent forms joint sample g
            pair = sorted((s for s in samples if s.metadata["generation_idx"] == generation), key=lambda s: s.agent_idx)
            joint = float(len(pair[0].completion) + len(pair[1].completion))
            assert float(pair[0].reward[0]) == float(pair[1].reward[0]) == joint
        assert step["domain/first_agent_share"] == 0.5
        assert "domain/ignored" not in step
    assert [calls[i][0].metadata["batch_item"] for i in range(2)] == [data[0], data[1]]
    calls.clear()
    metrics = trainer.evaluate(num_eval_samples=2)
    assert len(calls) == 2 and metrics["eval/domain/first_agent_share"] == 0.5


def test_eval_logger_and_aggregator(tiny_llama):
    logged = {}

    def eval_logger(agent_completions_turns, batch_items, prompts):
        logged.update(completions=agent_completions_turns, items=batch_items, prompts=prompts)
        return [{"length": len(turns[0])} for turns in agent_completions_turns[0]]

    def eval_aggregator(metrics, num_turns):
        logged["num_turns"] = num_turns
        return {"turn_1/length_mean": sum(m["length"] for m in metrics) / len(metrics)}

    data = rows(3)
    trainer = build(tiny_llama, data, eval_dataset=data, eval_logger=eval_logger, eval_aggregator=eval_aggregator)
    metrics = trainer.evaluate(num_eval_samples=2)
    completions = logged["completions"]
    assert len(completions) == 2 and all(len(agent) == 2 for agent in completions)  # [agent][sample][turn]
    assert all(len(turns) == 1 and isinstance(turns[0], str) for agent in completions for turns in agent)
    assert logged["items"] == [data[0], data[1]] and logged["prompts"] == [data[0]["prompt"], data[1]["prompt"]]
    assert logged["num_turns"] == 1
    expected = sum(len(turns[0]) for turns in completions[0]) / 2
    assert metrics["eval/turn_1/length_mean"] == expected


def test_wandb_config_without_wandb_warns_once_and_trains(tiny_llama, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with caplog.at_level(logging.WARNING):
        trainer = build(tiny_llama, rows(2), wandb_config={"project": "compat"}, config=dict(logging_steps=1))
        history = trainer.train()
    assert len(history) == 2
    warnings = [r for r in caplog.records if "wandb" in r.getMessage()]
    assert len(warnings) == 1
    assert "wandb_config" in warnings[0].getMessage() and "MLflow" in warnings[0].getMessage()


def test_wandb_config_with_wandb_logs_and_records_the_run(tiny_llama, monkeypatch, tmp_path):
    events = []

    class Run:
        id, project, entity = "run-123", "compat", "team"

        def finish(self):
            events.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: events.append(("init", kwargs)) or Run()
    fake.log = lambda metrics, step=None: events.append(("log", step, dict(metrics)))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    trainer = build(tiny_llama, rows(2), wandb_config={"project": "compat", "config_sections": {"a": 1}})
    assert events == []  # opened lazily, at train begin
    trainer.train(checkpoint_dir=tmp_path)
    assert events[0] == ("init", {"project": "compat", "config": {"a": 1}})
    assert [e[1] for e in events if e[0] == "log"] == [1, 2]
    assert "reward_mean" in events[1][2]
    assert events[-1] == ("finish",)
    assert trainer.run_identity["wandb"] == {"id": "run-123", "project": "compat", "entity": "team"}
    metadata = json.loads((tmp_path / "checkpoint-1" / "metadata.json").read_text())
    assert metadata["wandb"] == {"id": "run-123", "project": "compat", "entity": "team"}
    events.clear()  # a resumed run continues the W&B run its checkpoint names
    resumed = build(tiny_llama, rows(2), wandb_config={"project": "compat"}, config=dict(num_train_epochs=2))
    resumed.train(resume_from_checkpoint=tmp_path / "checkpoint-1", checkpoint_dir=tmp_path)
    assert events[0] == ("init", {"project": "compat", "id": "run-123", "resume": "allow"})
    assert [e[1] for e in events if e[0] == "log"] == [3, 4]


# ----- 5. no train_dataset at construction ------------------------------------------------------------
def test_train_dataset_may_come_after_construction(tiny_llama, tmp_path):
    config = dict(lr_scheduler_type="linear", num_train_epochs=2)
    trainer = build(tiny_llama, None, config=config)
    for start in (trainer.train, trainer.start_run):
        with pytest.raises(ValueError, match="train_dataset"):
            start(checkpoint_dir=tmp_path)
    assert not any(tmp_path.iterdir()) and trainer.state.global_step == 0
    with pytest.raises(ValueError, match="train_dataset is empty"):
        trainer.train_dataset = Dataset.from_dict({"prompt": []})
    trainer.train_dataset = rows(3)
    reference = build(tiny_llama, rows(3), config=config)
    assert trainer.model_optimizers["agent_0"].planned_steps == reference.model_optimizers["agent_0"].planned_steps == 6
    history = trainer.train()
    assert len(history) == 6
    assert [s["agent_0/learning_rate"] for s in history] == [s["agent_0/learning_rate"] for s in reference.train()]


# ----- 6. the original's metric names ------------------------------------------------------------------
def test_turn_metrics_one_turn(tiny_llama):
    trainer = build(tiny_llama, rows(1), eval_dataset=rows(1), reward_func=constant_reward)
    step = trainer.train()[-1]
    assert step["turn_1/reward_mean"] == pytest.approx(0.25) and step["turn_1/expected_return"] == pytest.approx(0.25)
    assert step["reward_mean"] == pytest.approx(0.25)  # our keys stay
    metrics = trainer.evaluate()
    assert metrics["eval/turn_1/reward_mean"] == pytest.approx(0.25)
    assert metrics["eval/turn_1/expected_return"] == pytest.approx(0.25)
    assert "eval/reward_mean" in metrics


def test_turn_metrics_two_turns(tiny_llama):
    def reward(c0, c1):
        return [float(len(a)) for a in c0]

    def transition(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
        return [f"again: {c[:4]}" for c in agent_completions]

    trainer = build(tiny_llama, rows(1), eval_dataset=rows(1), reward_func=reward, external_transition=transition,
                    config=dict(num_turns=2, discount=0.5))
    step = trainer.train()[-1]
    # undiscounted sum from each turn on, whatever the training discount
    assert step["turn_2/expected_return"] == pytest.approx(step["turn_2/reward_mean"])
    assert step["turn_1/expected_return"] == pytest.approx(step["turn_1/reward_mean"] + step["turn_2/reward_mean"])
    assert step["return_mean"] == pytest.approx(step["turn_1/reward_mean"] + 0.5 * step["turn_2/reward_mean"])
    metrics = trainer.evaluate()
    assert {"eval/turn_1/reward_mean", "eval/turn_2/reward_mean", "eval/turn_1/expected_return",
            "eval/turn_2/expected_return"} <= set(metrics)


def test_a_preference_run_takes_the_same_keywords(tiny_llama, train_dataset, reward_func):
    from comlrl.trainers.preference import MARLHFConfig, MARLHFTrainer

    calls = []
    trainer = MARLHFTrainer(agent_model=tiny_llama, num_agents=2, reward_func=reward_func, train_dataset=train_dataset,
                            eval_dataset=train_dataset, metrics_callback=lambda samples: calls.append(samples) or {},
                            args=MARLHFConfig(num_train_epochs=1, num_agents=2, num_generations=2, max_new_tokens=4,
                                              reward_model_device=None, disable_tqdm=True))
    assert trainer.policy_trainer.metrics_callback is not None
    two = trainer.evaluate(num_eval_samples=2)
    assert two == trainer.evaluate(num_samples=2) and "eval/task_reward_mean" in two


def test_the_original_trainer_names_import():
    from comlrl.trainers import ActorCriticTrainerBase, JointRewardModel
    from comlrl.trainers.actor_critic import IACTrainer, MAACTrainer, RolloutSample
    from comlrl.trainers.base import CallbackSample
    from comlrl.trainers.preference import JointRewardModel as FromPreference

    assert issubclass(IACTrainer, ActorCriticTrainerBase) and issubclass(MAACTrainer, ActorCriticTrainerBase)
    assert JointRewardModel is FromPreference and RolloutSample is CallbackSample
