"""Every trainer learns: over a few fixed seeds, the median held-out task reward rises by a stated margin.

MAGRPO, its REINFORCE-family variants, IAC and MAAC learn the bundled letters task
(comlrl/tasks/letters.py): 32 training rows, 8 held-out rows whose prompts never occur in training,
evaluated before and after training with the trainer's own ``evaluate`` (fixed seed, forked RNG;
8 rows x 4 samples). MARLHF and its iterative form learn the keywords task
(comlrl/tasks/keywords.py) instead: on letters a tiny randomly initialised reward model, which
reads one token's hidden state, stays at chance on new samples (measured: 0.46-0.62 agreement
with the task reward), so no preference trainer can learn letters through it; the policy guard
keeps such a run from lowering the task reward (test_preference.py).

Margins come from the measured spread (benchmarks/README.md, "Learning tests: the spread of the
rise"; benchmarks/learning_spread.py): another CPU rounds differently and sends a seed's run down
another trajectory, so one seed's rise is a draw from that spread, not a fixed number. Each test
therefore runs several seeds and asserts on their median, with a margin at about half the smallest
rise measured over 8 seeds with and without perturbations, and well above zero, which is the rise
of a run that does not learn (the evaluation is seeded: unchanged weights score exactly the same).
"""

from __future__ import annotations

import statistics

import pytest
from datasets import Dataset

from comlrl.tasks.keywords import keywords_reward
from comlrl.tasks.letters import letters_reward, rows
from comlrl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from comlrl.trainers.preference import MARLHFConfig, MARLHFIterTrainer, MARLHFTrainer
from comlrl.trainers import reinforce
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

ALL_ROWS = rows(48)
TRAIN = Dataset.from_list(ALL_ROWS[:32])
HELD_OUT = Dataset.from_list(ALL_ROWS[40:48])  # prompts 40-47 of the task's 48: never trained on
COMMON = dict(num_agents=2, num_generations=4, max_new_tokens=16, temperature=1.0, top_p=1.0, top_k=None,
              agent_learning_rate=3e-3,
              num_train_epochs=3, per_device_train_batch_size=2, eval_num_samples=8, disable_tqdm=True)
# MARLHF: at 8 samples a prompt (<=12 pairs, ~240 to fit) the reward model memorised its pairs (train accuracy
# 0.98, held-out 0.50-0.74) and in 3 of 8 seeds the policy stage lowered the task reward, so the guard reverted it
# (rise 0: the knife edge of issue 27). 16 samples (<=40 pairs) at reward lr 3e-3 fit reward models at held-out
# accuracy 0.63-0.99 (median 0.89); the guard scores all 32 training rows, so the sampling noise of 8 rows cannot
# revert a good stage.
PREFERENCE = dict(COMMON, max_new_tokens=12, num_train_epochs=4, preference_num_generations=16, max_pairs_per_prompt=40,
                  reward_learning_rate=3e-3, reward_train_epochs=4, policy_guard_rows=32, reward_model_device=None)
ACTOR_CRITIC = dict(COMMON, critic_learning_rate=1e-3, normalize_advantages=True)

# kind -> the margin the median held-out rise over its seeds must reach: about half the smallest rise measured
# over 8 seeds with and without perturbations (benchmarks/README.md, "Learning tests: the spread of the rise").
MARGINS = {"magrpo": 0.15, "iac": 0.15, "maac": 0.15, "marlhf": 0.2, "marlhf_iter": 0.15,
           "mareinforce": 0.03, "maremax": 0.1, "marloo": 0.15}
SEEDS = (0, 1, 2)
# The REINFORCE family: MAGRPO's settings; without a baseline the raw rewards (~0.1) give small steps, so
# MAREINFORCE runs at a larger learning rate (2e-2 measured worse). Its rises spread widest (-0.014 to 0.397 over
# 16 runs, 2 below 0.05), so it takes the median of five seeds (its runs are the cheapest) against a margin of 0.03.
KIND_SEEDS = {"mareinforce": (0, 1, 2, 3, 4)}
FAMILY = {"mareinforce": ("MAREINFORCE", dict(agent_learning_rate=1e-2)), "maremax": ("MAReMax", {}),
          "marloo": ("MARLOO", {})}


def build(kind: str, model: str, seed: int, **changes):
    """The trainer of ``kind`` with the test's settings; ``changes`` override config fields
    (benchmarks/learning_spread.py measures other settings through it)."""
    letters = dict(reward_func=letters_reward, train_dataset=TRAIN, eval_dataset=HELD_OUT)
    keywords = dict(reward_func=keywords_reward, train_dataset=TRAIN, eval_dataset=HELD_OUT)
    if kind == "magrpo":
        return MAGRPOTrainer(agent_model=model, args=MAGRPOConfig(seed=seed, **dict(COMMON, **changes)), **letters)
    if kind in FAMILY:
        name, own = FAMILY[kind]
        config = getattr(reinforce, f"{name}Config")(seed=seed, **dict(dict(COMMON, **own), **changes))
        return getattr(reinforce, f"{name}Trainer")(agent_model=model, args=config, **letters)
    if kind == "iac":
        return IACTrainer(agent_model=model, critic_model=model, args=IACConfig(seed=seed, **dict(ACTOR_CRITIC, **changes)),
                          **letters)
    if kind == "maac":
        return MAACTrainer(agent_model=model, critic_model=model,
                           args=MAACConfig(seed=seed, **dict(ACTOR_CRITIC, **changes)), **letters)
    if kind == "marlhf":
        return MARLHFTrainer(agent_model=model, args=MARLHFConfig(seed=seed, **dict(PREFERENCE, **changes)), **keywords)
    iterative = dict(PREFERENCE, num_train_epochs=2, num_iterations=2)
    return MARLHFIterTrainer(agent_model=model, args=MARLHFConfig(seed=seed, **dict(iterative, **changes)), **keywords)


def held_out_reward(trainer) -> float:
    metrics = trainer.evaluate()
    return metrics.get("eval/task_reward_mean", metrics.get("eval/reward_mean"))


def held_out_rise(kind: str, model: str, seed: int) -> float:
    trainer = build(kind, model, seed)
    before = held_out_reward(trainer)
    trainer.train()
    return held_out_reward(trainer) - before


# The preference pipelines' learning runs take minutes: they are in the end-to-end tier (docs/getting-started.md, "Tests").
E2E_KINDS = ("marlhf", "marlhf_iter")


@pytest.mark.slow
@pytest.mark.parametrize("kind", [pytest.param(kind, marks=pytest.mark.e2e) if kind in E2E_KINDS else kind
                                  for kind in MARGINS])
def test_trainer_learns(kind, tiny_llama):
    rises = {seed: held_out_rise(kind, tiny_llama, seed) for seed in KIND_SEEDS.get(kind, SEEDS)}
    assert statistics.median(rises.values()) >= MARGINS[kind], (
        f"{kind}: median held-out rise below {MARGINS[kind]}; per seed {({s: round(r, 3) for s, r in rises.items()})}")
