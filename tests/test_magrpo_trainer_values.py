"""MAGRPO's stages above the maths, against values worked out here: which generation rows a skipped group
masks and what the loss is then normalised by, the zero-variance flags over a pruned rollout tree, and a
step's metrics (rewards, completion lengths, groups, timings, tokens per second) from the stages' own values.

Nothing of comlrl's maths is called on the expected side: rewards, lengths and token counts are read off the
reward function's return values and the completion masks.
"""

from __future__ import annotations

import time

import pytest
import torch
from datasets import Dataset

from comlrl.rollout.episodes import Rollout, Turn
from comlrl.rollout.generation import Generation
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from comlrl.trainers.reinforce.magrpo import kept_rows, loss_counts, masked_rows

ROWS = [{"prompt": "write about the cat"}, {"prompt": "write a story about the river"}]


def generation(masks: list[list[int]], num_generations: int, texts: list[str] | None = None) -> Generation:
    """Hand-made completions: ``masks`` row by row (1 a completion token), three prompt tokens each."""
    completion_mask = torch.tensor(masks, dtype=torch.long)
    rows, width = completion_mask.shape
    return Generation(prompt_ids=torch.full((rows, 3), 7), prompt_mask=torch.ones(rows, 3, dtype=torch.long),
                      completion_ids=torch.full((rows, width), 9), completion_mask=completion_mask,
                      texts=texts or ["text"] * rows, num_generations=num_generations)


def turn(generations: list[Generation], node_rows: list[int], parents: list[int] | None = None) -> Turn:
    return Turn(node_rows=node_rows, prompts=[["p"] * len(node_rows) for _ in generations], generations=generations,
                prompt_history=[], response_history=[], parents=parents)


# ----- the rows a skipped group masks, and the counts a loss is normalised by --------------------------------
# Turn 1: 2 nodes x 2 generations; turn 2: 3 nodes x 2 generations; 5 tokens wide (so a row's flag broadcast
# along the wrong axis cannot fit).
TURN_1_MASKS = [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]          # 3, 1, 5, 2 tokens
TURN_2_MASKS = [[1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0],           # 2, 4, 0, 1
                [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]                                             # 3, 5


def two_turn_rollout() -> Rollout:
    first = turn([generation(TURN_1_MASKS, 2)], node_rows=[0, 1])
    second = turn([generation(TURN_2_MASKS, 2)], node_rows=[0, 0, 1], parents=[0, 1, 3])
    return Rollout(rows=ROWS, turns=[first, second], joint_index=torch.arange(2).reshape(-1, 1))


def test_kept_rows_are_every_generation_row_outside_the_flagged_groups():
    rollout = two_turn_rollout()
    flags = [torch.tensor([True, False]), torch.tensor([False, True, False])]
    kept = kept_rows(rollout, flags)
    assert [rows.tolist() for rows in kept] == [[False, False, True, True],
                                               [True, True, False, False, True, True]]
    assert all(rows.dtype == torch.bool for rows in kept)


def test_masked_rows_zero_the_completion_mask_of_the_rows_left_out_and_nothing_else():
    original = generation(TURN_1_MASKS, 2, texts=["a", "b", "c", "d"])
    masked = masked_rows(original, torch.tensor([True, False, False, True]))
    assert masked.completion_mask.tolist() == [[1, 1, 1, 0, 0], [0] * 5, [0] * 5, [1, 1, 0, 0, 0]]
    assert masked.completion_mask.dtype == torch.long
    assert original.completion_mask.tolist() == TURN_1_MASKS  # the rollout's own generation is left as it was
    assert masked.completion_ids is original.completion_ids and masked.prompt_ids is original.prompt_ids
    assert masked.texts == ["a", "b", "c", "d"] and masked.num_generations == 2
    # a float mask stays float
    as_float = generation(TURN_1_MASKS, 2)
    as_float.completion_mask = as_float.completion_mask.float()
    assert masked_rows(as_float, torch.tensor([False, True, True, False])).completion_mask.tolist() == [
        [0.0] * 5, [1.0, 0, 0, 0, 0], [1.0] * 5, [0.0] * 5]


def test_loss_counts_count_the_kept_completions_and_their_tokens():
    rollout = two_turn_rollout()
    generations = [t.generations[0] for t in rollout.turns]
    # all rows: 4 + 6 completions; 3 + 1 + 5 + 2 and 2 + 4 + 0 + 1 + 3 + 5 tokens
    assert loss_counts(generations, None) == (10, 11 + 15)
    kept = [torch.tensor([False, True, True, False]), torch.tensor([True, False, True, True, False, True])]
    # kept: rows 1, 2 of turn 1 (1 + 5 tokens); rows 0, 2, 3, 5 of turn 2 (2 + 0 + 1 + 5): 6 completions
    counts = loss_counts(generations, kept)
    assert counts == (6, 6 + 8) and all(isinstance(value, int) for value in counts)
    assert loss_counts(generations, [torch.zeros(4, dtype=torch.bool), torch.zeros(6, dtype=torch.bool)]) == (0, 0)
    assert [g.completion_mask.tolist() for g in generations] == [TURN_1_MASKS, TURN_2_MASKS]


# ----- the zero-variance flags over the rollout's tree ---------------------------------------------------------
def trainer(model: str, reward=None, external_transition=None, **options) -> MAGRPOTrainer:
    settings = dict(num_agents=2, num_generations=2, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=None,
                    per_device_train_batch_size=2, num_train_epochs=1, seed=3, disable_tqdm=True)
    return MAGRPOTrainer(agent_model=model, reward_func=reward or (lambda c0, c1: [0.0] * len(c0)),
                         train_dataset=Dataset.from_list(ROWS), external_transition=external_transition,
                         args=MAGRPOConfig(**{**settings, **options}))


def test_the_flags_follow_a_pruned_tree_and_the_discount(tiny_llama):
    """Early termination kept one node at turn 2, spawned by turn 1's joint sample 1 (parents [1]). Turn 1
    earns (1, 0.5), turn 2 (1, 1): sample 0 ended with return 1, sample 1 returns 0.5 + 0.5 x 1 = 1, so the
    group is constant with discount 0.5 and not with discount 1 (1 against 1.5)."""
    first = turn([generation([[1], [1]], 2)], node_rows=[0])
    second = turn([generation([[1], [1]], 2)], node_rows=[0], parents=[1])
    rollout = Rollout(rows=ROWS[:1], turns=[first, second], joint_index=torch.arange(2).reshape(-1, 1))
    rewards = [torch.tensor([[1.0, 0.5]]), torch.tensor([[1.0, 1.0]])]
    half = trainer(tiny_llama, num_turns=2, discount=0.5,
                   external_transition=lambda prompt, agent_completions, num_agents, **_: ["next"] * num_agents)
    assert [flags.tolist() for flags in half.zero_variance(rewards, rollout)] == [[True], [True]]
    whole = trainer(tiny_llama, num_turns=2, discount=1.0,
                    external_transition=lambda prompt, agent_completions, num_agents, **_: ["next"] * num_agents)
    assert [flags.tolist() for flags in whole.zero_variance(rewards, rollout)] == [[False], [True]]
    # without a rollout the tree is full (every joint sample spawned a node, in order): the returns are
    # 1 + 0.5 x 1 = 0.5 + 0.5 x 2 = 1.5 with discount 0.5, 2 and 2.5 with discount 1
    full = [torch.tensor([[1.0, 0.5]]), torch.tensor([[1.0, 1.0], [2.0, 2.0]])]
    assert [flags.tolist() for flags in half.zero_variance(full)] == [[True], [True, True]]
    assert [flags.tolist() for flags in whole.zero_variance(full)] == [[False], [True, True]]


def test_group_metrics_count_every_turns_groups(tiny_llama):
    flags = [torch.tensor([True, False]), torch.tensor([True, True, False, False, False])]
    share = pytest.approx(3 / 7)  # a float32 mean
    assert trainer(tiny_llama).group_metrics(flags) == {"reward/zero_variance_groups": share}
    skipping = trainer(tiny_llama, skip_zero_variance_groups=True).group_metrics(flags)
    assert skipping == {"reward/zero_variance_groups": share, "reward/skipped_groups": 3.0}
    assert all(type(value) is float for value in skipping.values())


# ----- a step's metrics ---------------------------------------------------------------------------------------
def test_a_steps_metrics_are_the_stages_values(tiny_llama, tiny_llama_b):
    """The stages run one by one (as the flows run them); the metrics are the update's, the rewards' mean and
    std, each agent's mean completion length, the reference's KL, the zero-variance share, the stages' timings
    and the generated tokens per second of the step's time, every one worked out here."""
    returned: list[float] = []

    def reward(completions_0, completions_1):
        values = [float(len(a) - 2 * len(b)) for a, b in zip(completions_0, completions_1)]
        returned.extend(values)
        return values

    trainer_ = trainer(tiny_llama, reward, reference_kl_enabled=True, reference_kl_mode="loss",
                       reference_kl_coef=0.25, reference_model=tiny_llama_b)
    values = trainer_.begin_step(ROWS)
    for stage in trainer_.step_stages:
        trainer_.run_stage(stage, values)
    rollout = values["rollout"]
    before = time.perf_counter()
    metrics = trainer_.step_metrics(values)
    after = time.perf_counter()

    rewards = torch.tensor(returned, dtype=torch.float64)
    assert len(returned) == 4
    assert metrics["reward_mean"] == pytest.approx(float(rewards.mean()))
    assert metrics["reward_std"] == pytest.approx(float(rewards.std(unbiased=False)))
    for agent in range(2):
        masks = rollout.turns[0].generations[agent].completion_mask
        assert metrics[f"agent_{agent}/completion_length"] == pytest.approx(masks.sum().item() / masks.shape[0])
        assert metrics[f"agent_{agent}/loss"] == values["update_metrics"][f"agent_{agent}/loss"]
    constant = sum(len(set(returned[start:start + 2])) == 1 for start in (0, 2)) / 2
    assert metrics["reward/zero_variance_groups"] == constant
    assert "reward/skipped_groups" not in metrics
    kl = values["reference"].mean_kl()
    assert kl > 0 and metrics["reference_kl_mean"] == kl and metrics["reference_kl_penalty_mean"] == 0.25 * kl
    for name in ("generation_time", "reward_time", "update_time"):
        assert metrics[name] == values["timings"][name] > 0
    assert before - values["step_started"] <= metrics["step_time"] <= after - values["step_started"]
    tokens = sum(int(g.completion_mask.sum()) for g in rollout.turns[0].generations)
    assert tokens > 0
    assert metrics["tokens_per_second"] == pytest.approx(tokens / metrics["step_time"], rel=1e-9)

    # a timing no stage recorded is 0; a step time of 0 or less counts as 1e-9 s (no division by zero)
    del values["timings"]["reward_time"]
    values["step_started"] = time.perf_counter() + 3600.0
    later = trainer_.step_metrics(values)
    assert later["reward_time"] == 0.0 and later["step_time"] < 0
    assert later["tokens_per_second"] == pytest.approx(tokens / 1e-9, rel=1e-9)
