"""The optimizer-step component (comlrl/training/optimizer_step.py) against values worked out in the test: the
first AdamW step with weight decay, a warm-up schedule over the plan (and re-planned), item-weighted windows and
their refusals, the skip counters, the state a checkpoint holds (and the item counts' process scaling), and a
snapshot put back."""

from __future__ import annotations

import math

import pytest
import torch

from comlrl.parallel.distributed import DataParallel
from comlrl.training.optimizer_step import ModelOptimizer, OptimizerSettings, build_adamw

GRADIENT = torch.tensor([[2.0, -3.0]])


def settings(accumulation: int = 1, schedule: str = "constant", warmup: int = 0, max_grad_norm: float | None = None,
             weight_decay: float = 0.0, world_size: int = 1) -> OptimizerSettings:
    return OptimizerSettings(weight_decay=weight_decay, lr_scheduler_type=schedule, warmup_steps=warmup,
                             accumulation_steps=accumulation, max_grad_norm=max_grad_norm,
                             data_parallel=DataParallel(world_size=world_size))


def component(planned: int = 4, learning_rate: float = 0.5, **options) -> ModelOptimizer:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1, bias=False)
    return ModelOptimizer("actor", model, model.parameters(), learning_rate, planned, settings(**options))


def backward(part: ModelOptimizer, gradient: torch.Tensor, scale: float = 1.0) -> None:
    """A micro-batch whose loss has ``gradient`` on the weight, times ``scale``."""
    ((part.module.weight * gradient).sum() * scale).backward()


def grads_at_steps(part: ModelOptimizer) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    part.optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(part.module.weight.grad.clone()))
    return seen


def test_the_first_step_is_adamw_with_the_runs_weight_decay_by_hand():
    part = component(learning_rate=0.5, weight_decay=0.1)
    before = part.module.weight.detach().clone()
    backward(part, GRADIENT)
    result = part.micro_step()
    # AdamW's first step: decay w by lr * wd, then move by lr * g / (|g| + eps) (the moments' bias corrected)
    expected = before * (1 - 0.5 * 0.1) - 0.5 * GRADIENT / (GRADIENT.abs() + 1e-8)
    torch.testing.assert_close(part.module.weight.detach(), expected)
    assert result.grad_norm == pytest.approx(math.sqrt(13.0)) and not result.skipped and result.learning_rate == 0.5
    assert part.optimizer.defaults["fused"] is True  # plain CPU tensors: the fused kernel


def test_build_adamw_takes_groups_a_generator_and_leaves_fusing_to_torch_for_other_tensors():
    first, second = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    optimizer = build_adamw(iter([{"params": [first], "lr": 0.2}, {"params": [second]}]), 0.1, 0.01)
    assert [group["lr"] for group in optimizer.param_groups] == [0.2, 0.1]
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.01, 0.01]
    assert [group["params"][0] for group in optimizer.param_groups] == [first, second]
    assert optimizer.defaults["fused"] is True
    meta = build_adamw([torch.nn.Parameter(torch.zeros(2, device="meta"))], 0.1, 0.0)
    assert meta.defaults["fused"] is None


def test_a_warmup_schedule_over_the_plan_and_replanned():
    expected = [0.0, 0.5, 1.0, 0.75, 0.5, 0.25]  # warm-up over 2 steps, then linear to 0 at step 6
    part = component(planned=6, learning_rate=1.0, schedule="linear", warmup=2)
    replanned = component(planned=3, learning_rate=1.0, schedule="linear", warmup=2)
    assert replanned.learning_rate == 0.0  # the schedule set the first step's rate
    replanned.replan(6)
    for target in (part, replanned):
        rates = []
        for _ in range(6):
            backward(target, GRADIENT)
            rates.append(target.micro_step().learning_rate)
        assert rates == pytest.approx(expected)
        assert target.planned_steps == 6 and target.steps == 6
    assert component(planned=0).planned_steps == 1
    constant = component(planned=3, learning_rate=0.5)
    constant.replan(6)  # no schedule: the rate stays
    backward(constant, GRADIENT)
    assert constant.micro_step().learning_rate == 0.5 and constant.learning_rate == 0.5
    assert constant.state_dict()["scheduler"] is None and component().state_dict()["counted"] is False
    replanned = component(planned=3)
    replanned.replan(-2)
    assert replanned.planned_steps == 1 and replanned.passes == 1


def test_a_window_of_counted_micro_batches_is_the_mean_over_its_items():
    part = component(accumulation=4)
    seen = grads_at_steps(part)
    assert part.loss_scale == 0.25
    assert part.item_loss_scale(0) == 0.0  # nothing yet, nothing to weigh
    assert part.item_loss_scale(2) == 1.0
    backward(part, GRADIENT, 1.0)  # the mean over 2 items, gradient g1
    assert part.micro_step() is None
    assert part.item_loss_scale(6) == pytest.approx(6 / 8)  # the first 2 items now weigh 2 / 8
    backward(part, 3 * GRADIENT, 6 / 8)  # 6 items, gradient g2 = 3 g
    assert part.micro_step() is None
    assert part.item_loss_scale(0) == 0.0  # a micro-batch without items changes nothing
    assert part.micro_step() is None
    assert (part.pending, part.pending_items, part.counted) == (3, 8.0, True)
    assert part.flush() is not None  # a counted window holds its mean already
    torch.testing.assert_close(seen[-1], (2 * GRADIENT + 6 * 3 * GRADIENT) / 8)
    assert (part.pending, part.pending_items, part.counted) == (0, 0.0, False)


@pytest.mark.parametrize("count", [float("nan"), float("inf"), -1.0])
def test_an_item_count_must_be_finite_and_not_negative(count):
    part = component()
    with pytest.raises(ValueError, match=rf"^actor: a micro-batch's item count must be a finite number >= 0, "
                                         rf"got {count!r}$"):
        part.item_loss_scale(count)
    assert part.pending_items == 0.0 and not part.counted


def test_an_uncounted_partial_window_is_flushed_with_its_mean():
    part = component(accumulation=4)
    seen = grads_at_steps(part)
    for factor in (1.0, 3.0):
        backward(part, factor * GRADIENT, part.loss_scale)
        assert part.micro_step() is None
    part.flush()
    torch.testing.assert_close(seen[-1], 2 * GRADIENT)  # (g + 3 g) / 2


def test_skipped_steps_are_counted_and_a_step_without_gradients_is_no_skip():
    part = component(max_grad_norm=1.0)
    before = part.module.weight.detach().clone()
    for consecutive in (1, 2):
        backward(part, torch.tensor([[float("inf"), 1.0]]))
        result = part.micro_step()
        assert result.skipped and math.isinf(result.grad_norm)
        assert (part.steps, part.skipped, part.consecutive_skipped) == (consecutive, consecutive, consecutive)
        assert part.module.weight.grad is None and torch.equal(part.module.weight.detach(), before)
    result = part.micro_step()  # no backward pass: no gradient anywhere
    assert (result.grad_norm, result.skipped) == (0.0, False)
    assert (part.steps, part.skipped, part.consecutive_skipped) == (3, 2, 0)
    backward(part, GRADIENT)
    assert part.micro_step().grad_norm == pytest.approx(math.sqrt(13.0))
    assert (part.steps, part.skipped, part.consecutive_skipped) == (4, 2, 0)


def test_the_state_holds_the_counters_the_schedule_and_the_pending_window():
    part = component(planned=6, learning_rate=1.0, accumulation=3, schedule="linear", warmup=2)
    backward(part, torch.tensor([[float("nan"), 1.0]]), part.loss_scale)
    for _ in range(3):
        part.micro_step()  # one skipped step (its slot in the schedule taken)
    part.item_loss_scale(5)
    backward(part, GRADIENT, 1.0)
    part.micro_step()
    state = part.state_dict()
    assert {key: state[key] for key in ("pending", "pending_items", "counted", "steps", "skipped",
                                        "consecutive_skipped")} == {
        "pending": 1, "pending_items": 5.0, "counted": True, "steps": 1, "skipped": 1, "consecutive_skipped": 1}
    torch.testing.assert_close(state["pending_grads"]["weight"], GRADIENT)
    fresh = component(planned=6, learning_rate=1.0, accumulation=3, schedule="linear", warmup=2)
    fresh.module.double()  # another dtype: the pending gradient is cast to the parameter's
    fresh.load_state_dict(state)
    assert (fresh.pending, fresh.pending_items, fresh.counted) == (1, 5.0, True)
    assert (fresh.steps, fresh.skipped, fresh.consecutive_skipped) == (1, 1, 1)
    assert fresh.learning_rate == 0.5 and part.learning_rate == 0.5  # the second step of the warm-up
    assert fresh.module.weight.grad.dtype == torch.float64
    torch.testing.assert_close(fresh.module.weight.grad, GRADIENT.double())
    for target in (part, fresh):  # the schedule goes on from the saved step: 1.0, then 0.75
        target.micro_step()
        target.micro_step()
        assert target.learning_rate == 1.0
        for _ in range(3):
            target.micro_step()
        assert target.learning_rate == 0.75
    constant = component(accumulation=3)
    constant.load_state_dict(state)  # a scheduled run's state in a constant-rate optimizer: the rate is the saved one
    assert constant.scheduler is None and constant.learning_rate == 0.5


def test_an_older_state_without_item_counts_and_a_gradient_the_model_lacks():
    part = component(accumulation=2)
    backward(part, GRADIENT, part.loss_scale)
    part.micro_step()
    state = part.state_dict()
    del state["pending_items"], state["counted"]
    fresh = component(accumulation=2)
    fresh.item_loss_scale(3)
    fresh.load_state_dict(state)
    assert (fresh.pending, fresh.pending_items, fresh.counted) == (1, 0.0, False)
    assert fresh.item_loss_scale(3) == 1.0  # no items counted yet: the loaded gradient is kept as it is
    torch.testing.assert_close(fresh.module.weight.grad, GRADIENT / 2)
    stepped = component(accumulation=2)
    backward(stepped, GRADIENT)
    stepped.load_state_dict(component(accumulation=2).state_dict())  # a state between windows
    assert stepped.module.weight.grad is None and stepped.pending == 0
    state["pending_grads"]["bias"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"^actor: saved pending gradient for 'bias', which the model lacks$"):
        component(accumulation=2).load_state_dict(state)
    with pytest.raises(ValueError, match=r"^checkpoint-4/agent_0: saved pending gradient for 'bias'"):
        component(accumulation=2).load_state_dict(state, where="checkpoint-4/agent_0")


def test_a_windows_item_count_is_saved_over_the_processes_and_loaded_as_their_mean():
    """Each process holds the processes' mean count; the state holds their total (no collective is needed before a
    micro-batch's backward pass, so none runs here)."""
    two = component(world_size=2)
    two.item_loss_scale(3)
    state = two.state_dict()
    assert state["pending_items"] == 6.0
    three = component(world_size=3)
    three.load_state_dict(state)
    assert three.pending_items == 2.0


def test_frozen_parameters_hold_no_pending_gradient():
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    model.bias.requires_grad_(False)
    part = ModelOptimizer("critic", model, [model.weight], 0.1, 4, settings(accumulation=2))
    part.micro_step()  # a micro-batch that reached no parameter
    state = part.state_dict()
    assert list(state["pending_grads"]) == ["weight"] and torch.equal(state["pending_grads"]["weight"],
                                                                      torch.zeros(1, 2))


def test_a_snapshot_puts_back_the_weights_and_moments_and_the_schedule_goes_on():
    part = component(planned=4, learning_rate=1.0, accumulation=2, schedule="linear")
    backward(part, GRADIENT, part.loss_scale)
    part.micro_step()
    part.micro_step()
    snapshot = part.snapshot()
    weight = part.module.weight.detach().clone()
    moments = {key: value.clone() for key, value in part.optimizer.state_dict()["state"][0].items()}
    for _ in range(2):
        backward(part, 5 * GRADIENT, part.loss_scale)
        part.micro_step()
        part.micro_step()
    part.item_loss_scale(4)
    backward(part, GRADIENT)
    part.micro_step()  # a pending window, dropped by the restore
    part.restore_snapshot(snapshot)
    assert torch.equal(part.module.weight.detach(), weight)
    restored = part.optimizer.state_dict()["state"][0]
    assert all(torch.equal(restored[key], moments[key]) for key in ("exp_avg", "exp_avg_sq", "step"))
    assert (part.steps, part.learning_rate) == (3, 0.25)  # the steps were taken
    assert (part.pending, part.pending_items, part.counted, part.module.weight.grad) == (0, 0.0, False, None)
    backward(part, 5 * GRADIENT, part.loss_scale)
    part.micro_step()
    part.micro_step()
    part.restore_snapshot(snapshot)  # the snapshot was not moved on by the steps after the first restore
    assert torch.equal(part.module.weight.detach(), weight)
    assert torch.equal(part.optimizer.state_dict()["state"][0]["exp_avg"], moments["exp_avg"])
    assert set(snapshot["parameters"]) == {"weight"}


@pytest.fixture
def one_process_group(tmp_path):
    """A gloo process group of one process: enough for FSDP2 to shard a model on the CPU."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def two_layers(shard: bool, accumulation: int = 1) -> ModelOptimizer:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    if shard:
        fully_shard(model)
    return ModelOptimizer("actor", model, model.parameters(), 0.5, 4, settings(accumulation=accumulation))


def step(part: ModelOptimizer, value: float) -> None:
    (part.module(torch.full((1, 2), value)).sum() * part.loss_scale).backward()
    part.micro_step()


def test_a_sharded_models_state_is_the_unsharded_format_and_resumes(one_process_group):
    """FSDP in one process: the gathered optimizer state equals an unsharded run's, and a sharded optimizer that
    loads it goes on as the unsharded one does."""
    plain, sharded = two_layers(shard=False), two_layers(shard=True)
    for part in (plain, sharded):
        step(part, 1.0)
    saved, expected = sharded.state_dict()["optimizer"], plain.state_dict()["optimizer"]
    assert saved["param_groups"][0]["params"] == expected["param_groups"][0]["params"] == [0, 1, 2, 3]
    for index, moments in expected["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert type(saved["state"][index][key]) is torch.Tensor  # gathered: plain tensors, not shards
            torch.testing.assert_close(saved["state"][index][key], moments[key])
    resumed = two_layers(shard=True)
    with torch.no_grad():  # the weights come back with the model (a checkpoint's other half)
        for mine, theirs in zip(resumed.module.parameters(), sharded.module.parameters()):
            mine.to_local().copy_(theirs.to_local())
    resumed.load_state_dict(sharded.state_dict())
    for part in (plain, resumed):
        step(part, -2.0)
    for mine, theirs in zip(resumed.module.parameters(), plain.module.parameters()):
        torch.testing.assert_close(mine.full_tensor(), theirs.detach())
    wrong = sharded.state_dict()
    wrong["optimizer"]["param_groups"][0]["params"] = [0, 1, 2]
    with pytest.raises(ValueError, match=r"^checkpoint-1/agent_0: the saved optimizer state covers 3 parameters"):
        two_layers(shard=True).load_state_dict(wrong, where="checkpoint-1/agent_0")
    with pytest.raises(ValueError, match=r"^actor: the saved optimizer state covers 3 parameters"):
        two_layers(shard=True).load_state_dict(wrong)


def test_a_sharded_model_refuses_a_pending_window_and_snapshots(one_process_group):
    part = two_layers(shard=True, accumulation=2)
    step(part, 1.0)
    with pytest.raises(RuntimeError) as error:
        part.state_dict()
    assert str(error.value) == ("actor: a checkpoint between optimizer steps cannot hold sharded (FSDP) gradients; "
                                "set gradient_accumulation_steps=1 or checkpoint only at epoch boundaries")
    with pytest.raises(RuntimeError) as error:
        part.snapshot()
    assert str(error.value) == "actor: snapshots of sharded (FSDP) models are not supported"
