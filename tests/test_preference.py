"""MARLHF and MARLHFIter: preference collection, the joint reward model, the policy stage."""

import json

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from comlrl.rollout import preferences
from comlrl.training.metrics import MetricWindow
from comlrl.trainers.preference.guard import PolicySnapshot
from comlrl.models.reward_model import JointRewardModel
from comlrl.training.reward_fit import fit_reward_model, preference_accuracy
from comlrl.trainers import MARLHFConfig as ReexportedConfig
from comlrl.trainers.preference import MARLHFConfig, MARLHFIterTrainer, MARLHFTrainer

FAST = dict(num_generations=4, max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=None, reward_model_device=None,
            disable_tqdm=True, per_device_train_batch_size=2, reward_train_epochs=2, reward_learning_rate=1e-4)


def test_reexported():
    assert ReexportedConfig is MARLHFConfig


def test_spec_example_fails_fast_without_cuda_then_runs_with_fallback(tiny_llama, tiny_gpt2, train_dataset, reward_func):
    # The guide's example, tiny models for the hub names. This machine has no "cuda:1":
    # the device rule fails before any model loads...
    with pytest.raises(ValueError) as error:
        MARLHFTrainer(
            agent_model=tiny_llama,
            num_agents=2,
            reward_func=reward_func,
            train_dataset=train_dataset,
            args=MARLHFConfig(
                num_agents=2,
                num_turns=1,
                reward_model_name=tiny_gpt2,
                reward_model_device="cuda:1",
            ),
        )
    message = str(error.value)
    assert "reward_model_device='cuda:1' is not available" in message and "reward_model_device_fallback=True" in message
    # ...and with the opt-in fallback the same example trains, the reward model on the trainer's device.
    trainer = MARLHFTrainer(
        agent_model=tiny_llama,
        num_agents=2,
        reward_func=reward_func,
        train_dataset=train_dataset,
        args=MARLHFConfig(
            num_agents=2,
            num_turns=1,
            reward_model_name=tiny_gpt2,
            reward_model_device="cuda:1",
            reward_model_device_fallback=True,
            max_new_tokens=6,
            num_train_epochs=1,
            disable_tqdm=True,
        ),
    )
    assert trainer.reward_device == trainer.device
    trainer.train()
    assert trainer.reward_model is not None and len(trainer.reward_model.tokenizer) == 128  # its own tokenizer
    assert [r["stage"] for r in trainer.state.stage_records] == ["collect_preferences", "fit_reward_model", "learn_policy"]


def test_reward_model_defaults_to_first_actor(tiny_llama, train_dataset, reward_func):
    trainer = MARLHFTrainer(agent_model=tiny_llama, num_agents=2, reward_func=reward_func,
                            train_dataset=train_dataset, args=MARLHFConfig(num_train_epochs=1, num_agents=2, **FAST))
    assert trainer.reward_model_source == tiny_llama


def test_object_actors_need_reward_model_name(tiny_llama, train_dataset, reward_func):
    from transformers import AutoTokenizer

    from comlrl.tiny import tiny_llama_config

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    models = [AutoModelForCausalLM.from_config(tiny_llama_config(tokenizer)) for _ in range(2)]  # built, not loaded
    assert not models[0].name_or_path
    with pytest.raises(ValueError, match="reward_model_name is required when the actors are model objects"):
        MARLHFTrainer(agents=models, tokenizer=AutoTokenizer.from_pretrained(tiny_llama), reward_func=reward_func,
                      train_dataset=train_dataset, args=MARLHFConfig(num_train_epochs=1, num_agents=2, **FAST))


def test_ranked_pairs_drop_ties_and_keep_widest():
    assert preferences.ranked_pairs(torch.tensor([0.0, 1.0, 1.0, 3.0])) == [(3, 0), (3, 1), (3, 2), (1, 0), (2, 0)]
    assert preferences.ranked_pairs(torch.tensor([0.0, 0.05]), tie_margin=0.1) == []
    assert preferences.ranked_pairs(torch.tensor([0.0, 1.0, 3.0]), max_pairs=1) == [(2, 0)]


def marker_pairs(count: int) -> Dataset:
    """Synthetic pairs: the chosen joint response always contains the marker word 'moon'."""
    words = "cat dog sun tree river hill road book".split()
    records = []
    for i in range(count):
        filler = " ".join(words[(i + k) % len(words)] for k in range(3))
        records.append({
            "iteration": 0, "row_index": i, "prompt": f"tell me about the {words[i % len(words)]}",
            "chosen": [f"{filler} moon", f"the {words[(i + 3) % len(words)]}"],
            "rejected": [f"{filler} cat", f"the {words[(i + 3) % len(words)]}"],
            "chosen_reward": 1.0, "rejected_reward": 0.0,
        })
    return preferences.pairs_dataset(records)


def test_bradley_terry_fit_learns_the_marker(tiny_llama):
    torch.manual_seed(0)
    model = JointRewardModel.load(tiny_llama, torch.device("cpu"), torch.float32)
    pairs = marker_pairs(48)
    train, heldout = preferences.split_heldout(len(pairs), 0.25, seed=0)
    assert preference_accuracy(model, pairs, heldout, 8) == 0.0  # a zero-initialised head ties every pair
    result = fit_reward_model(model, pairs, train, heldout, epochs=6, batch_size=8, learning_rate=3e-3, seed=0)
    assert result.heldout_accuracy >= 0.9, result
    assert result.losses[-1] < result.losses[0]


def test_frozen_backbone_is_bit_identical_and_head_moves(tiny_llama):
    torch.manual_seed(0)
    model = JointRewardModel.load(tiny_llama, torch.device("cpu"), torch.float32)
    backbone_before = {k: v.clone() for k, v in model.backbone.state_dict().items()}
    head_before = {k: v.clone() for k, v in model.value_head.state_dict().items()}
    pairs = marker_pairs(16)
    fit_reward_model(model, pairs, list(range(16)), [], epochs=2, batch_size=8, learning_rate=1e-2, seed=0,
                     freeze_backbone=True)
    assert all(torch.equal(backbone_before[k], v) for k, v in model.backbone.state_dict().items())
    assert any(not torch.equal(head_before[k], v) for k, v in model.value_head.state_dict().items())


def test_iter_trainer_reloads_the_reward_model_each_iteration(tiny_llama, train_dataset, reward_func, monkeypatch):
    loads = []
    real_load = JointRewardModel.load.__func__

    def recording_load(cls, *args, **kwargs):
        model = real_load(cls, *args, **kwargs)
        loads.append(({k: v.clone() for k, v in model.backbone.state_dict().items()},
                      {k: v.clone() for k, v in model.value_head.state_dict().items()}))
        return model

    monkeypatch.setattr(JointRewardModel, "load", classmethod(recording_load))
    trainer = MARLHFIterTrainer(agent_model=tiny_llama, num_agents=2, reward_func=reward_func, train_dataset=train_dataset,
                                args=MARLHFConfig(num_train_epochs=1, num_agents=2, num_iterations=2, agent_learning_rate=1e-3, **FAST))
    trainer.train()
    assert len(loads) == 2
    source = AutoModelForCausalLM.from_pretrained(tiny_llama).state_dict()
    for backbone, head in loads:
        assert all(torch.equal(source[k], v) for k, v in backbone.items())  # the source weights, not the fitted ones
        assert all(torch.equal(loads[0][1][k], v) for k, v in head.items())  # the same fresh head every time
    assert len(trainer.pairs_by_iteration) == 2
    assert set(trainer.pairs_by_iteration[1]["iteration"]) == {1}  # kept apart
    assert [r["stage"] for r in trainer.state.stage_records].count("fit_reward_model") == 2


def test_output_layout_and_resume_subdirectory(tiny_llama, train_dataset, reward_func, tmp_path):
    out = tmp_path / "pbrl"
    args = MARLHFConfig(num_train_epochs=1, num_agents=2, output_dir=str(out), **FAST)
    trainer = MARLHFTrainer(agent_model=tiny_llama, num_agents=2, reward_func=reward_func, train_dataset=train_dataset,
                            args=args)
    trainer.train(checkpoint_dir=tmp_path / "ckpt")
    pairs = preferences.load_pairs(out / "iteration_0" / "pairs.parquet")
    assert set(pairs.column_names) == set(preferences.PAIR_COLUMNS) and len(pairs) > 0
    assert all(c > r for c, r in zip(pairs["chosen_reward"], pairs["rejected_reward"]))
    assert (out / "iteration_0" / "reward_model" / "value_head.pt").is_file()
    stages = [json.loads(line)["stage"] for line in (out / "history.jsonl").read_text().splitlines()]
    assert stages == ["collect_preferences", "fit_reward_model", "learn_policy"]
    # A fresh run may not write into it...
    with pytest.raises(ValueError, match="already contains files"):
        MARLHFTrainer(agent_model=tiny_llama, num_agents=2, reward_func=reward_func, train_dataset=train_dataset,
                      args=args).train()
    # ...a resumed one writes into resume-1 and leaves the original alone.
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    resumed = MARLHFTrainer(agent_model=tiny_llama, num_agents=2, reward_func=reward_func, train_dataset=train_dataset,
                            args=args)
    resumed.train(resume_from_checkpoint=tmp_path / "ckpt" / "checkpoint-1", checkpoint_dir=tmp_path / "ckpt2")
    assert (out / "resume-1" / "history.jsonl").is_file()
    assert sorted(p.relative_to(out) for p in out.rglob("*") if "resume-1" not in p.parts) == before


def test_heldout_pairs_are_whole_prompts():
    """Pairs of one prompt share completions: a held-out prompt's pairs are all held out, or none is."""
    pairs = marker_pairs(12)
    rows = [i // 3 for i in range(12)]  # four prompts, three pairs each
    train, heldout = preferences.split_heldout(len(pairs), 0.25, seed=0, groups=rows)
    assert sorted(train + heldout) == list(range(12)) and len(heldout) == 3
    assert not {rows[i] for i in train} & {rows[i] for i in heldout}
    # without groups, the old pair-level split (same seed, same indices as before)
    assert preferences.split_heldout(12, 0.25, seed=0)[1] == sorted(torch.randperm(12, generator=torch.Generator()
                                                                                  .manual_seed(0))[:3].tolist())


def test_early_stopping_keeps_the_best_heldout_epoch(tiny_llama):
    torch.manual_seed(0)
    model = JointRewardModel.load(tiny_llama, torch.device("cpu"), torch.float32)
    pairs = marker_pairs(48)
    train, heldout = preferences.split_heldout(len(pairs), 0.25, seed=0)
    # an absurd learning rate makes later epochs worse: the fit must stop and keep the best epoch
    result = fit_reward_model(model, pairs, train, heldout, epochs=8, batch_size=8, learning_rate=0.5, seed=0,
                              patience=2)
    curve = result.heldout_curve
    assert result.best_epoch == curve.index(max(curve))
    assert len(curve) == len(result.losses) <= result.best_epoch + 3  # stopped 2 epochs after the best
    assert result.heldout_accuracy == preference_accuracy(model, pairs, heldout, 8) == max(curve)


def guarded_trainer(tiny_llama, train_dataset, reward_func):
    trainer = MARLHFTrainer(agent_model=tiny_llama, num_agents=2, reward_func=reward_func, train_dataset=train_dataset,
                            args=MARLHFConfig(num_train_epochs=1, num_agents=2, agent_learning_rate=1e-2, **FAST))
    trainer.run_next_stage()  # collect
    trainer.run_next_stage()  # fit
    return trainer


@pytest.mark.parametrize("lowered", [True, False], ids=["lowered", "kept"])
def test_policy_guard_restores_a_stage_that_lowers_the_task_reward(tiny_llama, train_dataset, reward_func, lowered):
    trainer = guarded_trainer(tiny_llama, train_dataset, reward_func)
    policy = trainer.policy_trainer
    before = {k: v.clone() for k, v in policy.agents[0].state_dict().items()}
    moments = {k: v.clone() for k, v in policy.optimizers[0].state_dict()["state"].get(0, {}).items()}
    snapshot = PolicySnapshot.take(policy, trainer.guard_scores()["task_reward"])
    # the guard's score compares against what the snapshot says the task reward was before the stage
    snapshot.task_reward = float("inf") if lowered else float("-inf")
    trainer.guard = snapshot
    for _ in range(2):
        policy.take_step(MetricWindow())
    moved = any(not torch.equal(before[k], v) for k, v in policy.agents[0].state_dict().items())
    assert moved
    metrics = trainer.apply_guard()
    assert metrics["policy/guard_reverted"] == float(lowered) and trainer.guard is None
    after = policy.agents[0].state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before) == lowered
    if lowered:
        assert policy.optimizers[0].state_dict()["state"].get(0, {}).keys() == moments.keys()
        assert policy.state.global_step == 2  # the steps happened; only weights and moments went back


def test_bit_exact_resume_across_an_iteration_boundary(tiny_llama, train_dataset, reward_func, tmp_path):
    def build(iterations):
        return MARLHFIterTrainer(agent_model=tiny_llama, num_agents=2, reward_func=reward_func,
                                 train_dataset=train_dataset,
                                 args=MARLHFConfig(num_train_epochs=1, num_agents=2, num_iterations=iterations, seed=5,
                                                   agent_learning_rate=1e-3, **FAST))

    straight = build(2)
    straight.train()
    first = build(1)
    first.train(checkpoint_dir=tmp_path, checkpoint_interval=1)
    assert [p.name for p in sorted(tmp_path.glob("checkpoint-*"))] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    resumed = build(2)
    resumed.train(resume_from_checkpoint=tmp_path / "checkpoint-3", checkpoint_dir=tmp_path)
    for a, b in zip(straight.agents, resumed.agents):
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert [s["reward_mean"] for s in straight.state.history] == [s["reward_mean"] for s in resumed.state.history]
    assert torch.equal(
        straight.reward_model.value_head.layers[-1].weight, resumed.reward_model.value_head.layers[-1].weight
    )


@pytest.mark.parametrize("rl_algorithm, overrides", [("maac", {}), ("iac", {"use_separate_critic": True}),
                                                      ("iac", {"use_separate_critic": False})])
def test_actor_critic_policy_stage(tiny_llama, tiny_llama_b, train_dataset, reward_func, rl_algorithm, overrides):
    trainer = MARLHFTrainer(
        agent_model=tiny_llama, num_agents=2, reward_func=reward_func, train_dataset=train_dataset,
        args=MARLHFConfig(num_train_epochs=1, num_agents=2, rl_algorithm=rl_algorithm, policy_overrides={"num_generations": 1, **overrides},
                          **FAST),
    )
    policy = trainer.policy_trainer
    assert type(policy).__name__ == {"maac": "MAACTrainer", "iac": "IACTrainer"}[rl_algorithm]
    assert all(a is b for a, b in zip(policy.agents, trainer.agents))  # one set of weights
    if overrides.get("use_separate_critic", True):
        assert policy.critics and all(c.name_or_path == tiny_llama for c in policy.critics)  # default: first actor
    trainer.train()
    assert any("monitor/task_reward" in step for step in trainer.state.history)
    # critic_model_name in the config selects another backbone
    other = MARLHFTrainer(
        agent_model=tiny_llama, num_agents=2, reward_func=reward_func, train_dataset=train_dataset,
        args=MARLHFConfig(num_train_epochs=1, num_agents=2, rl_algorithm="maac", critic_model_name=tiny_llama_b,
                          policy_overrides={"num_generations": 1}, **FAST),
    )
    assert other.policy_trainer.critics[0].name_or_path == tiny_llama_b


def test_critic_arguments_are_refused_for_magrpo(tiny_llama, train_dataset, reward_func):
    with pytest.raises(ValueError, match="apply only to rl_algorithm 'maac' or 'iac'"):
        MARLHFTrainer(agent_model=tiny_llama, num_agents=2, reward_func=reward_func, train_dataset=train_dataset,
                      critic_model=tiny_llama, args=MARLHFConfig(num_train_epochs=1, num_agents=2, **FAST))
    with pytest.raises(ValueError, match=r"policy_overrides has fields \['critic_type'\] that MAGRPOConfig does not define"):
        MARLHFTrainer(agent_model=tiny_llama, num_agents=2, reward_func=reward_func, train_dataset=train_dataset,
                      args=MARLHFConfig(num_train_epochs=1, num_agents=2, policy_overrides={"critic_type": "q"}, **FAST))


def test_collection_follows_the_rollout_settings(tiny_llama, train_dataset, reward_func):
    """Preference collection samples through the policy's RolloutSpec: prompt_overflow='error' holds there too."""
    trainer = MARLHFTrainer(agent_model=tiny_llama, num_agents=2, reward_func=reward_func, train_dataset=train_dataset,
                            args=MARLHFConfig(num_train_epochs=1, num_agents=2, max_prompt_length=2, prompt_overflow="error", **FAST))
    with pytest.raises(ValueError, match="prompt 0 has .* tokens but only 2 fit"):
        trainer.run_next_stage()
