"""The one owner of optimizer steps: :class:`ModelOptimizer`, one per trained model.

A trained model (an actor, a critic with its value head, an actor carrying a value head) gets
one ``ModelOptimizer``. It owns the AdamW optimizer, the learning-rate schedule, gradient
accumulation, data-parallel gradient averaging, clipping and the non-finite skip; trainers
call :meth:`ModelOptimizer.micro_step` after each backward pass and
:meth:`ModelOptimizer.flush` at the end of an epoch, and nothing else steps an optimizer or a
schedule.

Counting. ``gradient_accumulation_steps`` (A) counts backward passes ("micro-batches") per
optimizer step; every update pass over a rollout batch is one micro-batch, so with P passes
per batch and B batches per epoch an epoch takes ``ceil(B * P / A)`` optimizer steps: a
trailing partial window is applied by :meth:`ModelOptimizer.flush` with the mean gradient of what it holds.

Weighting. A loss that is a mean over items (completions, completion tokens, preference pairs)
registers each micro-batch's item count with :meth:`ModelOptimizer.item_loss_scale` before its
backward pass: the window's gradient is then the mean over every item of the window, exactly
what one batch of all of them gives, however unevenly they fall into micro-batches (token counts
always differ). Other losses scale each micro-batch by :attr:`ModelOptimizer.loss_scale`
(``1 / A``): the mean over micro-batches. The schedule is planned over the whole run
(:func:`planned_optimizer_steps`), and it advances on every planned step, a skipped
(non-finite) one included, so the LR at each step is where the plan puts it.

State. :meth:`ModelOptimizer.state_dict` holds the optimizer and schedule states, the counters (a counted window's
items as their total over the processes) and the
gradients of a window still pending (averaged over the processes, as the step would average them),
so a checkpoint taken between two optimizer steps resumes exactly, in as many processes as it likes. Under FSDP the optimizer state is gathered to rank 0 (a collective: every rank calls
it); a pending window of sharded gradients cannot be saved and raises an error naming the fix.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from comlrl.parallel import sharding


def planned_optimizer_steps(epochs: int, batches_per_epoch: int, passes: int, accumulation_steps: int) -> int:
    """Optimizer steps of a run: ``epochs * ceil(batches * passes / accumulation)`` (each epoch flushes)."""
    return epochs * math.ceil(batches_per_epoch * passes / accumulation_steps)


@dataclass(frozen=True)
class OptimizerSettings:
    """What every :class:`ModelOptimizer` of a run shares; built once from the trainer's config."""

    weight_decay: float
    lr_scheduler_type: str
    warmup_steps: int
    accumulation_steps: int
    max_grad_norm: float | None
    data_parallel: Any  # comlrl.parallel.distributed.DataParallel


@dataclass
class StepResult:
    """What one optimizer step did: the gradient norm before clipping, and whether it was skipped."""

    grad_norm: float
    skipped: bool
    learning_rate: float


def _tensors(parameters: Sequence[Any]) -> list[torch.Tensor]:
    return [p for item in parameters for p in (item["params"] if isinstance(item, dict) else [item])]


def build_adamw(parameters: Sequence[Any], learning_rate: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW, fused where it applies (plain CPU/CUDA tensors, not FSDP's DTensors): one kernel for all
    parameters, a third of the optimizer step's time on the benchmark model (benchmarks/README.md)."""
    parameters = list(parameters)  # a generator would be spent by the check below
    tensors = _tensors(parameters)
    fused = all(p.device.type in ("cpu", "cuda") and type(p.data) is torch.Tensor for p in tensors)
    return torch.optim.AdamW(parameters, lr=learning_rate, weight_decay=weight_decay, fused=fused or None)


class ModelOptimizer:
    """Optimizer, schedule, accumulation, clipping and non-finite skip of one trained model.

    ``module`` is what the gradients live on (clipped, averaged over processes, saved while
    pending); ``parameters`` are the optimizer's parameters or parameter groups.
    """

    def __init__(self, name: str, module: torch.nn.Module, parameters: Sequence[Any], learning_rate: float,
                 planned_steps: int, settings: OptimizerSettings, passes: int = 1) -> None:
        self.name = name
        self.module = module
        self.passes = passes  # micro-batches per rollout batch, what the plan was computed from
        self.settings = settings
        self.planned_steps = max(1, planned_steps)
        self.optimizer = build_adamw(parameters, learning_rate, settings.weight_decay)
        self.scheduler = self._build_scheduler()
        self.pending = 0  # micro-batches backpropagated since the last optimizer step
        self.pending_items = 0.0  # items registered by the window's micro-batches (item_loss_scale)
        self.counted = False  # whether this window's micro-batches registered their item counts
        self.steps = 0  # optimizer steps taken (skipped ones included)
        self.skipped = 0
        self.consecutive_skipped = 0

    def _build_scheduler(self) -> Any:
        if self.settings.lr_scheduler_type == "constant":
            return None  # (and transformers' optimisation module, which pulls peft, stays unimported)
        from transformers import get_scheduler

        return get_scheduler(self.settings.lr_scheduler_type, self.optimizer,
                             num_warmup_steps=self.settings.warmup_steps, num_training_steps=self.planned_steps)

    def replan(self, planned_steps: int) -> None:
        """Plan the schedule over ``planned_steps`` instead (only before the first step)."""
        if self.steps:
            raise RuntimeError(f"{self.name}: the schedule cannot be re-planned after {self.steps} steps")
        self.planned_steps = max(1, planned_steps)
        for group in self.optimizer.param_groups:  # a scheduler scaled these at construction
            group["lr"] = group.get("initial_lr", group["lr"])
        self.scheduler = self._build_scheduler()

    # ----- stepping -----------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """Factor on each micro-batch's loss, so a full window's gradient is the mean over its micro-batches."""
        return 1.0 / self.settings.accumulation_steps

    def item_loss_scale(self, count: float) -> float:
        """Factor on the loss of a micro-batch that is a mean over ``count`` items (tokens, completions, pairs;
        under data parallelism the mean count over the processes), called before its backward pass.

        The gradient held so far is rescaled by ``N / (N + count)`` (``N`` the window's items so far) and the
        factor is ``count / (N + count)``, so after the backward pass the gradient is the mean over every item
        of the window: the same as one batch of them all. A micro-batch without items adds nothing (factor 0).
        Every process calls it with the same count, items of its own or not, so the rescaling agrees.
        """
        if not math.isfinite(count) or count < 0:
            raise ValueError(f"{self.name}: a micro-batch's item count must be a finite number >= 0, got {count!r}")
        total = self.pending_items + count
        if self.pending_items > 0 and count > 0:
            for parameter in self._parameters_with_grad():
                parameter.grad.mul_(self.pending_items / total)
        self.pending_items = total
        self.counted = True
        return count / total if total > 0 else 0.0

    @property
    def learning_rate(self) -> float:
        """The learning rate the next optimizer step uses (first parameter group)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def micro_step(self) -> StepResult | None:
        """Count one backward pass; step when the accumulation window is full."""
        self.pending += 1
        if self.pending < self.settings.accumulation_steps:
            return None
        return self._step()

    def flush(self) -> StepResult | None:
        """Apply a partial window (end of an epoch) with the mean gradient of what it holds (a counted window
        holds that mean already; an uncounted one is rescaled from ``1 / A`` per micro-batch)."""
        if self.pending == 0:
            return None
        factor = 1.0 if self.counted else self.settings.accumulation_steps / self.pending
        if factor != 1.0:
            for parameter in self._parameters_with_grad():
                parameter.grad.mul_(factor)
        return self._step()

    def _parameters_with_grad(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]

    def _step(self) -> StepResult:
        """Average over processes, clip, step (unless non-finite), advance the schedule, zero."""
        self.settings.data_parallel.average_gradients(sharding.unsharded_parts(self.module))
        parameters = self._parameters_with_grad()
        if not parameters:
            norm = torch.tensor(0.0)
        elif self.settings.max_grad_norm is None:  # the norm (metrics, the non-finite check) without clipping
            norm = torch.nn.utils.get_total_norm([p.grad for p in parameters])
        else:
            norm = torch.nn.utils.clip_grad_norm_(parameters, self.settings.max_grad_norm)
        learning_rate = self.learning_rate
        finite = bool(torch.isfinite(norm))
        if finite:
            self.optimizer.step()
        if self.scheduler is not None:  # a skipped step still uses its planned slot
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.pending = 0
        self.pending_items = 0.0
        self.counted = False
        self.steps += 1
        self.skipped += 0 if finite else 1
        self.consecutive_skipped = 0 if finite else self.consecutive_skipped + 1
        return StepResult(grad_norm=float(norm), skipped=not finite, learning_rate=learning_rate)

    # ----- state --------------------------------------------------------------------------------
    def _named_parameters(self) -> dict[str, torch.Tensor]:
        return dict(self.module.named_parameters())

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly (tensors and plain values; a collective under FSDP)."""
        if sharding.holds_shards(self.module):
            if self.pending:
                raise RuntimeError(
                    f"{self.name}: a checkpoint between optimizer steps cannot hold sharded (FSDP) gradients; "
                    "set gradient_accumulation_steps=1 or checkpoint only at epoch boundaries"
                )
            optimizer_state = sharding.gather_optimizer_state(self.module, self.optimizer)
        else:
            optimizer_state = self.optimizer.state_dict()
        grads = {}
        if self.pending:  # the window's gradient so far: its mean over the processes, as the step will use
            own = {name: p.grad if p.grad is not None else torch.zeros_like(p)
                   for name, p in self._named_parameters().items() if p.requires_grad}
            averaged = self.settings.data_parallel.average_tensors(own) if self.settings.data_parallel.enabled else own
            grads = {name: grad.detach().cpu().clone() for name, grad in averaged.items()}
        return {
            "optimizer": optimizer_state,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "pending": self.pending,
            # over all processes (each holds the mean count): a resume in another number of processes goes on exactly
            "pending_items": self.pending_items * self.settings.data_parallel.world_size,
            "counted": self.counted,
            "steps": self.steps,
            "skipped": self.skipped,
            "consecutive_skipped": self.consecutive_skipped,
            "pending_grads": grads,
        }

    def load_state_dict(self, state: dict[str, Any], where: str = "") -> None:
        if sharding.holds_shards(self.module):
            sharding.load_optimizer_state(self.module, self.optimizer, lambda: state["optimizer"],
                                          where or self.name)
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.pending = int(state["pending"])
        # the window's items over all processes (absent from checkpoints before item counts), as a mean per process
        self.pending_items = float(state.get("pending_items", 0.0)) / self.settings.data_parallel.world_size
        self.counted = bool(state.get("counted", False))
        self.steps = int(state["steps"])
        self.skipped = int(state["skipped"])
        self.consecutive_skipped = int(state["consecutive_skipped"])
        self.optimizer.zero_grad(set_to_none=True)
        parameters = self._named_parameters()
        for name, grad in state["pending_grads"].items():
            if name not in parameters:
                raise ValueError(f"{where or self.name}: saved pending gradient for {name!r}, which the model lacks")
            parameters[name].grad = grad.to(device=parameters[name].device, dtype=parameters[name].dtype)

    # ----- snapshots (the policy guard of preference runs) ---------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """This model's trainable weights and optimizer moments now (CPU copies), for :meth:`restore_snapshot`."""
        if sharding.holds_shards(self.module):
            raise RuntimeError(f"{self.name}: snapshots of sharded (FSDP) models are not supported")
        parameters = {name: p.detach().cpu().clone() for name, p in self._named_parameters().items() if p.requires_grad}
        return {"parameters": parameters, "moments": copy.deepcopy(self.optimizer.state_dict()["state"])}

    @torch.no_grad()
    def restore_snapshot(self, snapshot: dict[str, Any]) -> None:
        """Put back a :meth:`snapshot`'s weights and optimizer moments. Step counters, the schedule and the
        groups' learning rates go on (the steps were taken); a pending accumulation window is dropped."""
        live = self._named_parameters()
        for name, saved in snapshot["parameters"].items():
            live[name].copy_(saved.to(device=live[name].device, dtype=live[name].dtype))
        current = self.optimizer.state_dict()
        current["state"] = copy.deepcopy(snapshot["moments"])
        self.optimizer.load_state_dict(current)
        self.optimizer.zero_grad(set_to_none=True)
        self.pending = 0
        self.pending_items = 0.0
        self.counted = False
