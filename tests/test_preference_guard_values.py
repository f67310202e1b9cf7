"""The preference layer above the maths, as a user sees it: the policy guard's snapshot through a saved state and a
stop mid-stage, the guard's rows and its agreement score by hand, the history comparator's snapshots across a
resume, and what a collection writes out (docs/mutation.md, "Above the maths: the preference stages")."""

from __future__ import annotations

import copy
import io
import json
import math
import os
import signal

import pytest
import torch
from datasets import Dataset

from comlrl.callbacks import TrainerCallback
from comlrl.errors import TrainingInterrupted
from comlrl.training.metrics import MetricWindow
from comlrl.trainers.preference import MADPOIterTrainer, MARLHFConfig, MARLHFTrainer
from comlrl.trainers.preference.guard import PolicySnapshot, guard_rows, pairwise_agreement, revert_warning
from test_iterative import PROMPTS, StopAt, build

FAST = dict(num_generations=4, max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=None, reward_model_device=None,
            disable_tqdm=True, per_device_train_batch_size=2, reward_train_epochs=2, reward_learning_rate=1e-4)


def marlhf(model: str, dataset: Dataset, reward, **options) -> MARLHFTrainer:
    return MARLHFTrainer(agent_model=model, num_agents=2, reward_func=reward, train_dataset=dataset,
                         args=MARLHFConfig(**{"num_train_epochs": 1, "num_agents": 2, "agent_learning_rate": 1e-2,
                                              "seed": 4, **FAST, **options}))


def weights(trainer) -> list[dict[str, torch.Tensor]]:
    return [{k: v.detach().clone() for k, v in agent.state_dict().items()} for agent in trainer.agents]


def same_weights(a, b) -> bool:
    return all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


def through_a_file(state):
    """The state as a resume reads it: saved, then loaded without running code (``weights_only``)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


class StopAtPolicyStep(TrainerCallback):
    """A real SIGTERM after the policy trainer's ``step``-th step (the run finishes the step and checkpoints)."""

    def __init__(self, step: int, trainer_class: str) -> None:
        self.step, self.trainer_class = step, trainer_class

    def on_log(self, trainer, metrics, step):
        if type(trainer).__name__ == self.trainer_class and step == self.step and "agent_0/loss" in metrics:
            os.kill(os.getpid(), signal.SIGTERM)


# ----- the guard's snapshot through a saved state -------------------------------------------------
def test_a_guard_saved_mid_stage_restores_the_weights_from_before_the_stage(tiny_llama, train_dataset, reward_func):
    """The snapshot is part of the run's state while a stage is in progress: saved, loaded into a new trainer,
    and a stage that lowered the task reward goes back to the weights and moments from before it."""
    trainer = marlhf(tiny_llama, train_dataset, reward_func)
    trainer.run_next_stage()  # collect
    trainer.run_next_stage()  # fit
    policy = trainer.policy_trainer
    before = weights(policy)
    trainer.guard = PolicySnapshot.take(policy, float("inf"))  # any score after the stage is lower
    for _ in range(2):
        policy.take_step(MetricWindow())
    assert not same_weights(before, weights(policy))
    state = through_a_file(trainer.state_dict())
    assert state["guard"]["task_reward"] == float("inf")

    resumed = marlhf(tiny_llama, train_dataset, reward_func)
    for name, module in trainer.checkpoint_modules().items():  # a checkpoint's weights files, as a resume loads them
        resumed.checkpoint_modules()[name].load_state_dict(through_a_file(module.state_dict()))
    resumed.load_state_dict(state)
    assert resumed.guard is not None and resumed.guard.task_reward == float("inf")
    assert same_weights(weights(policy), weights(resumed.policy_trainer))  # the stage's steps, as they were
    metrics = resumed.apply_guard()
    assert metrics["policy/guard_reverted"] == 1.0 and metrics["policy/guard_task_reward_before"] == float("inf")
    assert same_weights(before, weights(resumed.policy_trainer))
    # the optimizer's moments went back as well: the step counter of every AdamW parameter is the one before
    for optimizer in resumed.policy_trainer.optimizers:
        assert all(s.get("step", torch.tensor(0.0)).item() == 0.0 for s in optimizer.state_dict()["state"].values())


def test_a_snapshot_round_trips_its_reward_and_components(tiny_llama, train_dataset, reward_func):
    trainer = marlhf(tiny_llama, train_dataset, reward_func)
    policy = trainer.policy_trainer
    snapshot = PolicySnapshot.take(policy, 0.25)
    state = through_a_file(snapshot.state_dict())
    assert set(state) == {"task_reward", "components"} and state["task_reward"] == 0.25
    assert set(state["components"]) == set(policy.model_optimizers)
    again = PolicySnapshot.from_state_dict(state)
    assert again.task_reward == 0.25 and set(again.components) == set(policy.model_optimizers)
    assert PolicySnapshot.from_state_dict(None) is None


def test_a_saved_state_without_a_components_optimizer_is_refused_in_words_naming_the_checkpoint(
        tiny_llama, train_dataset, reward_func):
    trainer = marlhf(tiny_llama, train_dataset, reward_func)
    state = trainer.state_dict()
    missing = sorted(state["policy"]["optimizers"])[0]
    del state["policy"]["optimizers"][missing]
    with pytest.raises(ValueError) as given:
        marlhf(tiny_llama, train_dataset, reward_func).load_state_dict(copy.deepcopy(state), "checkpoint-7")
    assert str(given.value) == f"checkpoint-7 holds no optimizer state for {[missing]}"
    with pytest.raises(ValueError) as default:
        marlhf(tiny_llama, train_dataset, reward_func).load_state_dict(copy.deepcopy(state))
    assert str(default.value) == f"the checkpoint holds no optimizer state for {[missing]}"


def test_a_stop_mid_policy_stage_resumes_under_the_guard_taken_before_the_stage(tiny_llama, train_dataset,
                                                                                reward_func, tmp_path):
    """A SIGTERM two steps into the policy stage: the resumed run's guard compares with the task reward from
    before the stage (not with one scored after the steps already taken), so its record equals an
    uninterrupted run's."""
    straight = marlhf(tiny_llama, train_dataset, reward_func)
    straight.train()
    interrupted = marlhf(tiny_llama, train_dataset, reward_func)
    interrupted.callbacks.append(StopAtPolicyStep(2, "MAGRPOTrainer"))
    with pytest.raises(TrainingInterrupted) as info:
        interrupted.train(checkpoint_dir=tmp_path, checkpoint_interval=1)
    assert interrupted.guard is not None  # the stop fell inside the guarded stage
    resumed = marlhf(tiny_llama, train_dataset, reward_func)
    resumed.train(resume_from_checkpoint=info.value.checkpoint)

    def guard_record(trainer):
        (record,) = [r for r in trainer.state.stage_records if r["stage"] == "learn_policy"]
        return {k: v for k, v in record.items() if k.startswith("policy/")}

    expected, got = guard_record(straight), guard_record(resumed)
    assert got["policy/guard_task_reward_before"] == expected["policy/guard_task_reward_before"]
    assert got == pytest.approx(expected, nan_ok=True) and got["policy/steps"] == 4.0
    assert same_weights(weights(straight), weights(resumed))
    assert resumed.guard is None


# ----- the policy stage's record, from its steps ---------------------------------------------------
def mean(values):
    return sum(values) / len(values)


class StepAtRecords(TrainerCallback):
    """The run's step counter when each policy stage's record is logged (what a callback reads then)."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_log(self, trainer, metrics, step):
        if "pbrl/policy/steps" in metrics:
            self.steps.append(trainer.state.global_step)


@pytest.mark.parametrize("policy_guard", [True, False], ids=["guarded, held-out pairs", "unguarded, no held-out pairs"])
def test_the_policy_stage_record_is_its_steps_by_hand(tiny_llama, reward_func, policy_guard):
    """Two iterations of two epochs: each policy stage trains its own two epochs (4 steps of 2 rows), tags its
    steps with the iteration and the fit's held-out accuracy (none without held-out pairs), and reports the means
    of its own steps."""
    from comlrl.trainers.preference import MARLHFIterTrainer

    dataset = Dataset.from_dict({"prompt": ["write about the cat", "write about the sun", "write about the tree",
                                            "write about the road"]})
    trainer = MARLHFIterTrainer(agent_model=tiny_llama, num_agents=2, reward_func=reward_func, train_dataset=dataset,
                                args=MARLHFConfig(**{**FAST, "num_train_epochs": 2, "num_agents": 2, "num_iterations": 2,
                                                     "agent_learning_rate": 1e-2, "seed": 4,
                                                     "policy_guard": policy_guard,
                                                     "reward_heldout_fraction": 0.2 if policy_guard else 0.0}))
    at_records = StepAtRecords()
    trainer.callbacks.append(at_records)
    trainer.train()
    history = trainer.state.history
    assert [step["iteration"] for step in history] == [0] * 4 + [1] * 4
    assert trainer.state.global_step == trainer.policy_trainer.state.global_step == len(history) == 8
    assert at_records.steps == [4, 8]  # the stage's record is logged with the steps it took counted
    records = [r for r in trainer.state.stage_records if r["stage"] == "learn_policy"]
    fits = [r for r in trainer.state.stage_records if r["stage"] == "fit_reward_model"]
    assert [r["iteration"] for r in records] == [0, 1]
    for iteration, (record, fit) in enumerate(zip(records, fits)):
        steps = [step for step in history if step["iteration"] == iteration]
        assert record["policy/steps"] == 4.0
        assert record["policy/learned_reward_mean"] == pytest.approx(mean([s["reward_mean"] for s in steps]))
        assert record["policy/task_reward_mean"] == pytest.approx(mean([s["monitor/task_reward"] for s in steps]))
        if policy_guard:
            assert all(s["reward_model/heldout_accuracy"] == fit["reward_model/heldout_accuracy"] for s in steps)
        else:
            assert "reward_model/heldout_accuracy" not in fit
            assert not any("reward_model/heldout_accuracy" in s for s in steps)
        guard_keys = {k for k in record if k.startswith("policy/guard_")}
        if policy_guard:
            assert guard_keys == {"policy/guard_task_reward_before", "policy/guard_task_reward_after",
                                  "policy/guard_reverted"}
            assert record["policy/guard_reverted"] == float(
                record["policy/guard_task_reward_after"] < record["policy/guard_task_reward_before"])
        else:
            assert not guard_keys
    assert trainer.guard is None


# ----- the guard's scores and decision ------------------------------------------------------------
class RecordingReward:
    """The conftest's joint letter reward, remembering each call's prompts and values."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], list[float]]] = []

    def __call__(self, completions_0, completions_1, batch_items=None):
        from conftest import joint_letter_reward

        values = joint_letter_reward(completions_0, completions_1)
        self.calls.append(([row["prompt"] for row in batch_items], values))
        return values


def test_the_guards_score_is_the_task_reward_of_its_seeded_rows(tiny_llama, train_dataset):
    reward = RecordingReward()
    trainer = marlhf(tiny_llama, train_dataset, reward, policy_guard_rows=3, seed=9)
    before_fit = trainer.guard_scores()
    prompts, values = reward.calls[-1]
    rows = sorted(torch.randperm(len(train_dataset), generator=torch.Generator().manual_seed(9))[:3].tolist())
    assert sorted(set(prompts)) == sorted(train_dataset[i]["prompt"] for i in rows)
    assert set(before_fit) == {"task_reward"}  # no reward model yet: nothing to judge it on
    assert before_fit["task_reward"] == pytest.approx(sum(values) / len(values))
    assert trainer.guard_scores() == before_fit  # a fixed draw: the same samples each time
    trainer.run_next_stage()  # collect
    trainer.run_next_stage()  # fit
    after_fit = trainer.guard_scores()
    assert set(after_fit) == {"task_reward", "reward_model_agreement"}
    assert after_fit["task_reward"] == pytest.approx(sum(reward.calls[-1][1]) / len(reward.calls[-1][1]))
    agreement = after_fit["reward_model_agreement"]
    assert math.isnan(agreement) or 0.0 <= agreement <= 1.0


@pytest.mark.parametrize("tolerance, margin, reverted", [(0.0, 0.0, False), (0.0, 1e-6, True), (0.1, 0.05, False),
                                                        (0.1, 0.15, True)],
                         ids=["equal-kept", "lower-reverted", "within-tolerance", "beyond-tolerance"])
def test_the_guard_reverts_only_a_fall_beyond_the_tolerance(tiny_llama, train_dataset, reward_func, caplog,
                                                            tolerance, margin, reverted):
    """The snapshot's score is set ``margin`` above what the policy scores after its steps."""
    trainer = marlhf(tiny_llama, train_dataset, reward_func, policy_guard_tolerance=tolerance)
    trainer.run_next_stage()  # collect
    trainer.run_next_stage()  # fit
    policy = trainer.policy_trainer
    before = weights(policy)
    snapshot = PolicySnapshot.take(policy, 0.0)
    for _ in range(2):
        policy.take_step(MetricWindow())
    stepped = weights(policy)
    after = trainer.guard_scores()  # the same fixed draw apply_guard scores
    snapshot.task_reward = after["task_reward"] + margin
    trainer.guard = snapshot
    with caplog.at_level("WARNING"):
        metrics = trainer.apply_guard()
    assert metrics == pytest.approx({
        "policy/guard_task_reward_before": after["task_reward"] + margin,
        "policy/guard_task_reward_after": after["task_reward"], "policy/guard_reverted": float(reverted),
        "policy/reward_model_agreement": after["reward_model_agreement"]}, nan_ok=True)
    assert trainer.guard is None
    assert same_weights(weights(policy), before if reverted else stepped)
    warnings = [r.getMessage() for r in caplog.records if "policy_guard" in r.getMessage()]
    expected = revert_warning(trainer.state.iteration, after["task_reward"] + margin, after["task_reward"],
                              after["reward_model_agreement"])
    assert warnings == ([expected] if reverted else [])


def test_a_policy_stage_before_a_fit_is_refused_in_words(tiny_llama, train_dataset, reward_func):
    trainer = marlhf(tiny_llama, train_dataset, reward_func, policy_guard=False)
    with pytest.raises(RuntimeError) as refused:
        trainer.learn_policy()
    assert str(refused.value) == ("reward function MARLHFTrainer._learned_reward raised RuntimeError: the policy stage "
                                  "ran before a reward model was fitted")


# ----- the guard's rows and agreement by hand -----------------------------------------------------
def test_guard_rows_are_a_seeded_sorted_draw_or_every_row():
    data = list(range(10))
    drawn = guard_rows(data, 4, seed=11)
    expected = sorted(torch.randperm(10, generator=torch.Generator().manual_seed(11))[:4].tolist())
    assert drawn == expected and len(set(drawn)) == 4
    assert guard_rows(data, 4, seed=11) == drawn and guard_rows(data, 4, seed=12) != drawn
    assert guard_rows(data, 10, seed=0) == list(range(10)) and guard_rows(data, 25, seed=0) == list(range(10))
    assert guard_rows(data, 9, seed=0) != list(range(10)) and len(guard_rows(data, 9, seed=0)) == 9


def test_pairwise_agreement_counts_the_pairs_the_reference_orders():
    reference = torch.tensor([[1.0, 0.0, 0.5], [2.0, 2.0, float("nan")]])
    # row 0's pairs (0,1) (0,2) (1,2) differ in the reference; row 1's (0,1) is a tie, the others hold a NaN
    scores = torch.tensor([[3.0, 1.0, 4.0], [0.0, 9.0, 1.0]])
    # (0,1): 3>1 as 1>0 agree; (0,2): 3<4 but 1>0.5 disagree; (1,2): 1<4 as 0<0.5 agree
    assert pairwise_agreement(scores, reference) == pytest.approx(2 / 3)
    assert pairwise_agreement(-scores, reference) == pytest.approx(1 / 3)
    assert pairwise_agreement(reference, reference) == 1.0
    # a tie in the reference skips that pair only, not the rest of the row: (0,2) and (1,2) are judged
    assert pairwise_agreement(torch.tensor([[5.0, 0.0, 1.0]]), torch.tensor([[1.0, 1.0, 0.0]])) == 0.5
    # each pair counted once: with ties in the reference, only (0,2) disagrees of the four pairs that differ
    assert pairwise_agreement(torch.tensor([[5.0, 0.0, 1.0, 6.0]]), torch.tensor([[0.0, 0.0, 1.0, 1.0]])) == 0.75
    # a score tie never agrees with a reference that differs
    assert pairwise_agreement(torch.tensor([[1.0, 1.0]]), torch.tensor([[0.0, 1.0]])) == 0.0
    assert math.isnan(pairwise_agreement(torch.tensor([[1.0, 2.0]]), torch.tensor([[5.0, 5.0]])))
    assert pairwise_agreement(torch.tensor([[1, 2]]), torch.tensor([[0, 3]])) == 1.0  # integer tensors as floats


def test_the_revert_warning_in_its_words():
    judged = revert_warning(3, 0.5, 0.25, 0.625)
    assert judged == (
        "iteration 3: the policy stage lowered the task reward on the guard's rows 0.5000 -> 0.2500, so its weights "
        "are restored (policy_guard). The reward model orders fresh samples as the task reward does in 62% of pairs "
        "(50% is chance): a reward model near chance cannot teach the policy; collect more pairs "
        "(preference_num_generations, max_pairs_per_prompt) or fit longer (reward_train_epochs, reward_learning_rate)")
    unjudged = revert_warning(0, 1.0, 0.0, float("nan"))
    assert unjudged == (
        "iteration 0: the policy stage lowered the task reward on the guard's rows 1.0000 -> 0.0000, so its weights "
        "are restored (policy_guard). No fresh pair of samples differed in task reward, so how the reward model "
        "orders them could not be judged; score more rows (policy_guard_rows) or sample more varied answers "
        "(num_generations, temperature)")


# ----- the history comparator across a resume ----------------------------------------------------
def madpo_iter(model: str, output_dir, **options) -> MADPOIterTrainer:
    """tests/test_iterative.py's tiny MADPOIter run, three iterations, writing into ``output_dir``."""
    return build(model, **{"num_iterations": 3, "output_dir": str(output_dir), **options})


def test_the_history_comparator_keeps_its_snapshots_across_a_resume(tiny_llama, tmp_path):
    """A stop inside iteration 1's DPO stage: the resumed run's iteration 2 compares against the snapshot the
    uninterrupted run used (iteration 1's, listed in the saved state), and ends with the same weights."""
    history = dict(comparator_policy="history", comparator_history_k=1, log_reward_distribution=True)
    straight = madpo_iter(tiny_llama, tmp_path / "straight", **history)
    straight.train()
    first_iteration_steps = len([s for s in straight.state.history if s["iteration"] == 0])
    interrupted = madpo_iter(tiny_llama, tmp_path / "stopped", **history)
    interrupted.callbacks.append(StopAt(first_iteration_steps + 1))
    with pytest.raises(TrainingInterrupted) as info:
        interrupted.train(checkpoint_dir=tmp_path / "checkpoints", checkpoint_interval=1)
    assert interrupted.state.iteration == 1
    resumed = madpo_iter(tiny_llama, tmp_path / "stopped", **history)
    resumed.train(resume_from_checkpoint=info.value.checkpoint)
    root = tmp_path / "stopped" / "policies"
    assert resumed.comparator.loaded_from == [(0, str(root / "iteration_0000")), (1, str(root / "iteration_0000")),
                                              (2, str(root / "iteration_0001"))]
    # iterations 0 and 1 wrote theirs before the stop (the saved state lists them); iteration 2 in the resume's folder
    assert resumed.comparator.snapshots == {0: str(root / "iteration_0000"), 1: str(root / "iteration_0001"),
                                            2: str(tmp_path / "stopped" / "resume-1" / "policies" / "iteration_0002")}
    straight_root = tmp_path / "straight" / "policies"
    assert straight.comparator.loaded_from == [(i, p.replace(str(root), str(straight_root)))
                                               for i, p in resumed.comparator.loaded_from]
    # with a comparator, its candidates' rewards are a group of the distribution beside the policy's
    distribution = json.loads((tmp_path / "straight" / "iteration_2" / "reward_distribution.json").read_text())
    assert set(distribution) == {"policy", "chosen", "rejected", "comparator"}
    assert distribution["comparator"]["count"] == len(distribution["comparator"]["values"]) == len(PROMPTS) * 3
    collected = [r for r in straight.state.stage_records if r["stage"] == "collect_preferences"]
    assert all(r["distribution/comparator_reward_max"] == pytest.approx(max(json.loads(
        (tmp_path / "straight" / f"iteration_{r['iteration']}" / "reward_distribution.json").read_text()
    )["comparator"]["values"])) for r in collected)
    assert same_weights(weights(straight), weights(resumed))


# ----- what a collection writes out --------------------------------------------------------------
def test_a_collection_reports_its_pairs_prompts_and_rewards_by_hand(tiny_llama, tmp_path):
    trainer = madpo_iter(tiny_llama, tmp_path, num_preference_prompts=3, num_iterations=1,
                         log_reward_distribution=True)
    trainer.prepare_output_dir(resuming=False)  # as a run begins
    metrics = trainer.collect_preferences()
    pairs = trainer.pairs_by_iteration[0]
    assert metrics["preferences/pairs"] == float(len(pairs)) > 0
    assert metrics["preferences/prompts"] == 3.0
    expected_rows = sorted(torch.randperm(4, generator=torch.Generator().manual_seed(3 * 7919 + 0))[:3].tolist())
    assert trainer.collection.preference_rows(4, 0) == expected_rows
    assert trainer.collection.preference_rows(4, 1) == sorted(
        torch.randperm(4, generator=torch.Generator().manual_seed(3 * 7919 + 1))[:3].tolist())
    assert set(pairs["row_index"]) <= set(expected_rows)
    distribution = json.loads((tmp_path / "iteration_0" / "reward_distribution.json").read_text())
    policy_rewards = distribution["policy"]["values"]
    assert len(policy_rewards) == 3 * 3  # three prompts, three candidates each
    assert metrics["preferences/task_reward_mean"] == pytest.approx(sum(policy_rewards) / len(policy_rewards))
    assert distribution["chosen"]["values"] == list(pairs["chosen_reward"])
    assert distribution["rejected"]["values"] == list(pairs["rejected_reward"])
    assert metrics["distribution/chosen_reward_mean"] == pytest.approx(sum(pairs["chosen_reward"]) / len(pairs))
    assert metrics["distribution/policy_reward_max"] == pytest.approx(max(policy_rewards))
    assert metrics["distribution/rejected_reward_min"] == pytest.approx(min(pairs["rejected_reward"]))
    assert "comparator" not in distribution and not any("comparator" in k for k in metrics)
    # every pair is two candidates of one prompt, the chosen one scored higher by the task reward
    assert all(c > r for c, r in zip(pairs["chosen_reward"], pairs["rejected_reward"]))
    from comlrl.rollout import preferences
    assert preferences.load_pairs(tmp_path / "iteration_0" / "pairs.parquet").to_list() == pairs.to_list()
