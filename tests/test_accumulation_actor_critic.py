"""Accumulation in the actor-critic trainers (docs/algorithms.md, 'Accumulation and early termination'):
each micro-batch's loss is scaled by 1/gradient_accumulation_steps, so with equal micro-batches (no early
termination) the first optimizer step's gradients equal those of one batch of all their prompts; with
micro-batches of unequal counts the window's gradient is the mean of the micro-batch means.

Greedy decoding (top_k=1) makes each prompt's completion the same in a batch of two and alone, and
advantage standardisation (a batch statistic, not an accumulation matter) is off, so the two runs see the
same samples; the gradients compared are those the optimizer step reads (a step pre-hook).
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from comlrl.tasks.letters import letters_reward
from comlrl.trainers.actor_critic import IACConfig, IACTrainer

PROMPTS = ["write about the cat", "a short story about the moon and the river"]


def iac(model: str, batch: int, accumulation: int) -> IACTrainer:
    return IACTrainer(agent_model=model, num_agents=2, reward_func=letters_reward,
                      train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                      args=IACConfig(num_agents=2, num_turns=1, num_generations=1, max_new_tokens=6, temperature=1.0,
                                     top_p=1.0, top_k=1, normalize_advantages=False, max_grad_norm=None,
                                     use_separate_critic=False, value_head_hidden_dim=8,
                                     per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
                                     num_train_epochs=1, device="cpu", disable_tqdm=True, seed=0))


def first_step_gradients(trainer: IACTrainer) -> list[torch.Tensor]:
    optimizer = trainer.model_optimizers["agent_0"].optimizer
    seen: list[list[torch.Tensor]] = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(
        [p.grad.detach().clone() for group in opt.param_groups for p in group["params"] if p.grad is not None]))
    trainer.train()
    assert len(seen) == 1, len(seen)  # both set-ups make one optimizer step of the two prompts
    return seen[0]


def test_iac_accumulating_two_prompts_equals_one_batch_of_two(tiny_llama):
    whole = first_step_gradients(iac(tiny_llama, batch=2, accumulation=1))
    accumulated = first_step_gradients(iac(tiny_llama, batch=1, accumulation=2))
    assert len(whole) == len(accumulated) > 0
    for a, b in zip(whole, accumulated):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)
    # a wrong scale (no 1/accumulation, i.e. twice the gradient) would not pass: the gradients are not ~0
    assert max(float(g.abs().max()) for g in whole) > 1e-4


def test_micro_batch_means_are_averaged_not_pooled():
    """The window's gradient for micro-batches of 1 and 3 items is the mean of their means, by hand."""
    from comlrl.parallel.distributed import DataParallel
    from comlrl.training.optimizer_step import ModelOptimizer, OptimizerSettings

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1, bias=False)
    settings = OptimizerSettings(weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0,
                                 accumulation_steps=2, max_grad_norm=None, data_parallel=DataParallel())
    part = ModelOptimizer("m", model, model.parameters(), 0.1, 1, settings)
    seen = []
    part.optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(part.module.weight.grad[0].tolist()))
    # micro-batch means with gradient 4 (1 item) and -2 (3 items): (4 + -2) / 2 = 1, not (4 - 6) / 4 = -0.5
    for gradient in (4.0, -2.0):
        (part.module.weight.sum() * gradient * part.loss_scale).backward()
        part.micro_step()
    assert seen == [pytest.approx([1.0, 1.0])]
