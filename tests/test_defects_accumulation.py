"""Issue 27, suspicion a: gradient accumulation gives the gradient of the un-accumulated batch for every loss
that is a mean over items: each loss_type of the MAGRPO family (over completions or completion tokens) and
MADPO's mean over pairs, however unevenly the items fall into micro-batches.

The gradients compared are those each optimizer step uses (read by a step pre-hook), not weights: AdamW's
first step is nearly sign(gradient) and would hide a wrong scale.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from datasets import Dataset

from comlrl.parallel.distributed import DataParallel
from comlrl.rollout import preferences
from comlrl.rollout.episodes import Rollout
from comlrl.tasks.letters import letters_reward
from comlrl.trainers.preference import MADPOConfig, MADPOTrainer
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from comlrl.training.optimizer_step import ModelOptimizer, OptimizerSettings

PROMPTS = ["write about the cat", "a short story about the moon and the river", "the sun"]


def step_gradients(trainer) -> list[list[torch.Tensor]]:
    """Every optimizer step's gradients of agent 0, as the step sees them (after the window's accumulation)."""
    optimizer = trainer.model_optimizers["agent_0"].optimizer
    seen: list[list[torch.Tensor]] = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(
        [p.grad.detach().clone() for group in opt.param_groups for p in group["params"] if p.grad is not None]))
    return seen


def assert_same_gradients(expected: list[torch.Tensor], actual: list[torch.Tensor]) -> None:
    assert len(expected) == len(actual) > 0
    for a, b in zip(expected, actual):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)


# ----- the component, by hand -----------------------------------------------------------------------
def component(accumulation: int) -> ModelOptimizer:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1, bias=False)
    settings = OptimizerSettings(weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0,
                                 accumulation_steps=accumulation, max_grad_norm=None, data_parallel=DataParallel())
    return ModelOptimizer("m", model, model.parameters(), 0.1, 1, settings)


def test_counted_micro_batches_average_over_items_by_hand():
    part = component(accumulation=3)
    seen = []
    part.optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(part.module.weight.grad[0].tolist()))
    # three micro-batches whose mean losses have gradient 1, 4, -2 per weight, over 1, 2 and 5 items:
    # one batch of the 8 items has the mean gradient (1 * 1 + 2 * 4 + 5 * -2) / 8 = -1 / 8
    for count, gradient in ((1, 1.0), (2, 4.0), (5, -2.0)):
        (part.module.weight.sum() * gradient * part.item_loss_scale(count)).backward()
        part.micro_step()
    assert seen == [pytest.approx([-0.125, -0.125])]
    # a partial window (flushed at an epoch's end) is the mean over what it holds: (3 * 2 + 1 * 6) / 4 = 3
    for count, gradient in ((3, 2.0), (1, 6.0)):
        (part.module.weight.sum() * gradient * part.item_loss_scale(count)).backward()
        part.micro_step()
    part.flush()
    assert seen[1] == pytest.approx([3.0, 3.0])
    # a micro-batch without items adds nothing; a negative count is refused
    assert part.item_loss_scale(0) == 0.0 and part.pending_items == 0
    with pytest.raises(ValueError, match="item count must be a finite number >= 0, got -1"):
        part.item_loss_scale(-1)


# ----- MAGRPO: one batch of 3 prompts vs 3 micro-batches of 1 -------------------------------------------
def magrpo(model: str, accumulation: int, loss_type: str) -> MAGRPOTrainer:
    return MAGRPOTrainer(agent_model=model, num_agents=2, reward_func=letters_reward,
                         train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                         args=MAGRPOConfig(num_agents=2, num_generations=2, max_new_tokens=8, temperature=1.0,
                                           top_p=1.0, top_k=None, loss_type=loss_type, max_grad_norm=None,
                                           per_device_train_batch_size=3, gradient_accumulation_steps=accumulation,
                                           device="cpu", disable_tqdm=True, seed=0))


def prompt_rollout(rollout: Rollout, prompt: int, per_prompt: int) -> Rollout:
    """The part of a one-turn rollout that belongs to one prompt (its rows, padding kept)."""
    rows = list(range(prompt * per_prompt, (prompt + 1) * per_prompt))
    turn = rollout.turns[0]
    part = dataclasses.replace(turn, node_rows=[0], prompts=[p[prompt:prompt + 1] for p in turn.prompts],
                               generations=[preferences.generation_rows(g, rows) for g in turn.generations])
    return dataclasses.replace(rollout, rows=[rollout.rows[prompt]], turns=[part])


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_magrpo_accumulating_three_prompts_equals_one_batch_of_three(tiny_llama, loss_type):
    whole = magrpo(tiny_llama, accumulation=1, loss_type=loss_type)
    rollout = whole.rollout([{"prompt": p} for p in PROMPTS])
    for generation in rollout.turns[0].generations:  # completions of uneven lengths, as EOS would end them
        for row, length in enumerate((8, 3, 5, 8, 2, 6)):
            generation.completion_mask[row, length:] = 0
    advantages = [[torch.tensor([1.0, -0.5, 0.25, -1.0, 0.75, 0.5])], [torch.tensor([-1.0, 1.0, 0.5, 0.5, -0.25, 1.0])]]
    expected = step_gradients(whole)
    whole.update(rollout, advantages)
    accumulated = magrpo(tiny_llama, accumulation=3, loss_type=loss_type)
    actual = step_gradients(accumulated)
    for prompt in range(3):
        accumulated.update(prompt_rollout(rollout, prompt, 2),
                           [[agent[0][2 * prompt:2 * prompt + 2]] for agent in advantages])
    assert len(expected) == len(actual) == 1
    assert_same_gradients(expected[0], actual[0])


# ----- MADPO: one micro-batch of 6 pairs vs micro-batches of 1, 2 and 3 pairs ----------------------------
def madpo(model: str, accumulation: int) -> MADPOTrainer:
    return MADPOTrainer(agent_model=model, reward_func=letters_reward, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                        args=MADPOConfig(num_agents=2, num_generations=4, max_new_tokens=6, temperature=1.0, top_p=1.0,
                                         top_k=None, max_grad_norm=None, gradient_accumulation_steps=accumulation,
                                         device="cpu", disable_tqdm=True, seed=0))


def test_madpo_accumulating_uneven_pair_batches_equals_one_batch(tiny_llama):
    whole = madpo(tiny_llama, accumulation=1)
    turn = whole.rollout([{"prompt": p} for p in PROMPTS[:2]]).turns[0]  # 8 candidates per agent
    pairs = [(0, 1), (2, 3), (4, 5), (6, 7), (0, 2), (5, 7)]

    def sides(chosen_rejected):
        return [preferences.generation_rows(g, [c for c, _ in chosen_rejected] + [r for _, r in chosen_rejected])
                for g in turn.generations]

    expected = step_gradients(whole)
    whole.preference_update(sides(pairs))
    accumulated = madpo(tiny_llama, accumulation=3)
    actual = step_gradients(accumulated)
    for part in (pairs[:1], pairs[1:3], pairs[3:]):
        accumulated.preference_update(sides(part))
    assert len(expected) == len(actual) == 1
    assert_same_gradients(expected[0], actual[0])
