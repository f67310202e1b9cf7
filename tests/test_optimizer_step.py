"""The optimizer-step component on a two-parameter model: counting, flushing, skipping and its state."""

from __future__ import annotations

import pytest
import torch

from comlrl.parallel.distributed import DataParallel
from comlrl.training.optimizer_step import ModelOptimizer, OptimizerSettings, planned_optimizer_steps


def settings(accumulation: int = 3, schedule: str = "linear", max_grad_norm: float | None = None) -> OptimizerSettings:
    return OptimizerSettings(weight_decay=0.0, lr_scheduler_type=schedule, warmup_steps=0,
                             accumulation_steps=accumulation, max_grad_norm=max_grad_norm, data_parallel=DataParallel())


def component(accumulation: int = 3, planned: int = 4, **options) -> ModelOptimizer:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1, bias=False)
    return ModelOptimizer("m", model, model.parameters(), 0.1, planned, settings(accumulation, **options))


def backward(part: ModelOptimizer, value: float) -> None:
    """A micro-batch whose loss has gradient ``value`` on every weight (before the component's scale)."""
    (part.module.weight.sum() * value * part.loss_scale).backward()


def grads_at_steps(part: ModelOptimizer) -> list[list[float]]:
    seen: list[list[float]] = []
    part.optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(part.module.weight.grad[0].tolist()))
    return seen


def test_planned_steps_by_hand():
    assert planned_optimizer_steps(epochs=2, batches_per_epoch=4, passes=1, accumulation_steps=3) == 4  # 3+1 a epoch
    assert planned_optimizer_steps(epochs=2, batches_per_epoch=4, passes=2, accumulation_steps=3) == 6  # 8 -> 3+3+2
    assert planned_optimizer_steps(epochs=1, batches_per_epoch=5, passes=1, accumulation_steps=1) == 5


def test_a_full_window_steps_with_the_mean_and_a_flushed_one_with_its_own_mean():
    part = component()
    seen = grads_at_steps(part)
    for value in (1.0, 2.0):
        backward(part, value)
        assert part.micro_step() is None  # the window of 3 is not full
    backward(part, 6.0)
    assert part.micro_step() is not None and part.pending == 0
    assert seen[-1] == pytest.approx([3.0, 3.0])  # (1 + 2 + 6) / 3
    backward(part, 4.0)  # one micro-batch, then the epoch ends
    assert part.micro_step() is None
    result = part.flush()
    assert result is not None and seen[-1] == pytest.approx([4.0, 4.0])  # its mean, not 4/3
    assert part.flush() is None and part.module.weight.grad is None  # nothing left


def test_the_schedule_advances_per_optimizer_step_and_a_skipped_step_keeps_its_slot():
    part = component(accumulation=1, planned=4)
    rates = []
    for value in (1.0, float("nan"), 1.0, 1.0):
        backward(part, value)
        before = part.module.weight.detach().clone()
        result = part.micro_step()
        rates.append(result.learning_rate)
        if result.skipped:
            assert torch.equal(before, part.module.weight)  # a NaN gradient never reaches the weights
    assert rates == pytest.approx([0.1, 0.075, 0.05, 0.025])  # linear over the 4 planned steps, never 0
    assert (part.steps, part.skipped, part.consecutive_skipped) == (4, 1, 0)


def test_pending_gradients_survive_the_state_round_trip():
    part = component()
    backward(part, 2.0)
    part.micro_step()
    state = part.state_dict()
    assert state["pending"] == 1 and torch.allclose(state["pending_grads"]["weight"], torch.full((1, 2), 2.0 / 3))
    fresh = component()
    fresh.load_state_dict(state)
    for target in (part, fresh):
        backward(target, 4.0)
        target.micro_step()
        backward(target, 6.0)
        target.micro_step()
    assert torch.equal(part.module.weight, fresh.module.weight)
    assert part.optimizer.state_dict()["state"][0]["exp_avg"].tolist() == \
        fresh.optimizer.state_dict()["state"][0]["exp_avg"].tolist()


def test_a_schedule_cannot_be_replanned_after_a_step():
    part = component(accumulation=1)
    part.replan(8)
    assert part.planned_steps == 8 and part.learning_rate == pytest.approx(0.1)
    backward(part, 1.0)
    part.micro_step()
    with pytest.raises(RuntimeError, match="cannot be re-planned after 1 steps"):
        part.replan(4)


def test_nothing_else_steps_an_optimizer_or_a_schedule():
    """docs/architecture.md's claim: only the optimizer-step component calls optimizer.step() / scheduler.step()."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "comlrl"
    calls = re.compile(r"\.(optimizer|scheduler|_scheduler|lr_scheduler)\.step\(|\boptimizer\.step\(|\bscheduler\.step\(")
    found = sorted(str(path.relative_to(root)) for path in root.rglob("*.py") if calls.search(path.read_text()))
    assert found == ["training/optimizer_step.py"], found


@pytest.mark.parametrize("max_norm", [None, 0.5])
def test_the_reported_norm_is_the_gradient_norm_and_only_a_max_clips(max_norm):
    part = component(accumulation=1, max_grad_norm=max_norm)
    seen = grads_at_steps(part)
    backward(part, 3.0)  # gradient 3 on each of 2 weights: norm 3 * sqrt(2)
    result = part.micro_step()
    assert result.grad_norm == pytest.approx(3.0 * 2 ** 0.5)
    expected = 3.0 if max_norm is None else max_norm / 2 ** 0.5  # clipped to norm max_norm
    assert seen == [pytest.approx([expected, expected])]
