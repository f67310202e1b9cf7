"""Data parallelism across processes started by ``torchrun`` or ``accelerate launch``.

Every process holds full copies of all agents. Each global batch of
``per_device_train_batch_size * world_size`` prompts is dealt out round-robin, rank ``r``
taking prompts ``r, r + world_size, ...``; a prompt's whole group of ``num_generations``
samples stays on one rank, so the group-relative advantages computed locally are exact.
Before every optimizer step the gradients are averaged over the processes with
``torch.distributed.all_reduce`` (the averaging DDP does), so every rank takes the same step
and the weights stay identical. Rank 0 writes checkpoints while the others wait at a barrier;
all ranks load them. Single-process runs never touch ``torch.distributed``.

An accelerate FSDP launch (``ACCELERATE_USE_FSDP=true``) shards the agents instead of
replicating them (comlrl/parallel/sharding.py); the data still splits as above. DeepSpeed is refused.
"""

from __future__ import annotations

import atexit
import logging
import os
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from comlrl.parallel import sharding
from comlrl.seeding import MAX_SEED, set_seed

logger = logging.getLogger(__name__)

# Set by ``accelerate launch`` when its config asks for DeepSpeed, which the trainers do not drive.
DEEPSPEED_FLAG = "ACCELERATE_USE_DEEPSPEED"


@dataclass(frozen=True)
class DataParallel:
    """Where this process stands in a data-parallel launch (rank 0 of 1 when launched plainly)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    fsdp: sharding.FSDPSettings | None = None  # set: agents are sharded (comlrl/parallel/sharding.py)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ----- data ---------------------------------------------------------------------------------
    def shard(self, batch: Sequence[int]) -> list[int]:
        """This rank's prompts of a global batch (round-robin)."""
        return list(batch[self.rank::self.world_size])

    def check_batches(self, num_rows: int, batch_size: int) -> None:
        """Every rank needs at least one prompt of every global batch, the last one included."""
        if not self.enabled:
            return
        last = num_rows % (batch_size * self.world_size) or batch_size * self.world_size
        if last < self.world_size:
            raise ValueError(
                f"train_dataset has {num_rows} rows: with per_device_train_batch_size={batch_size} on "
                f"{self.world_size} processes the last global batch has {last} prompt(s), too few for every "
                "process to get one; change the batch size, the number of processes or the dataset size"
            )

    # ----- collectives --------------------------------------------------------------------------
    def _comm_device(self) -> torch.device:
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def average_gradients(self, models: Sequence[torch.nn.Module]) -> None:
        """Replace every trainable parameter's gradient by its mean over the processes.

        A parameter without a gradient counts as zero, so every rank joins the same collectives.
        Sharded models are skipped: FSDP's backward already reduce-scattered their mean gradients.
        """
        if not self.enabled:
            return
        device = self._comm_device()
        for model in models:
            if sharding.is_sharded(model):
                continue
            for parameter in model.parameters():
                if not parameter.requires_grad:
                    continue
                if parameter.grad is None:
                    parameter.grad = torch.zeros_like(parameter)
                grad = parameter.grad
                buffer = grad if grad.device == device else grad.to(device)
                dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
                buffer /= self.world_size
                if buffer is not grad:
                    grad.copy_(buffer)

    def average_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """The mean of each scalar metric over the processes (every rank reports the same names)."""
        if not self.enabled:
            return metrics
        names = sorted(metrics)
        values = torch.tensor([float(metrics[name]) for name in names], dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        return dict(zip(names, (values / self.world_size).tolist()))

    def all_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over the processes (a copy; itself in one process)."""
        if not self.enabled:
            return values
        buffer = values.detach().clone().to(self._comm_device())
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
        return buffer.to(values.device)

    def mean_counts(self, counts: Sequence[float]) -> list[float]:
        """Each count's mean over the processes (one collective): what a loss that is a mean over this
        process's items (tokens, pairs) must divide its sum by, so that the averaged gradient is the mean
        over every process's items, as in one process. The counts themselves in one process."""
        if not self.enabled:
            return [float(count) for count in counts]
        total = self.all_sum(torch.tensor([float(count) for count in counts], dtype=torch.float64))
        return (total / self.world_size).tolist()

    def average_tensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each tensor averaged over the processes (copies; every rank passes the same names)."""
        return {name: self.all_sum(tensor) / self.world_size for name, tensor in sorted(tensors.items())}

    def broadcast_parameters(self, models: Sequence[torch.nn.Module]) -> None:
        """Rank 0's weights and buffers to every rank (as DDP does at construction)."""
        if not self.enabled:
            return
        device = self._comm_device()
        for model in models:
            for tensor in model.state_dict().values():
                buffer = tensor if tensor.device == device else tensor.to(device)
                dist.broadcast(buffer, src=0)
                if buffer is not tensor:
                    tensor.copy_(buffer)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def seed(self, seed: int, global_step: int) -> None:
        """Give each rank its own sampling stream (rank 0's RNG state is the one checkpoints keep)."""
        if self.enabled:
            set_seed((seed + 1_000_003 * self.rank + 7919 * global_step) % (MAX_SEED + 1))


def check_launch() -> sharding.FSDPSettings | None:
    """Refuse DeepSpeed launches before anything loads; an FSDP launch's settings, checked (None otherwise)."""
    if os.environ.get(DEEPSPEED_FLAG, "").lower() in sharding.TRUE_VALUES:
        raise ValueError(
            f"this process was launched with an accelerate DeepSpeed config ({DEEPSPEED_FLAG}=true), which the "
            "trainers do not drive; for models that do not fit one GPU launch with infra/accelerate/fsdp.yaml "
            "(FSDP2), otherwise with infra/accelerate/multi_gpu.yaml"
        )
    return sharding.FSDPSettings.from_environment()


def leave_group() -> None:
    """Destroy the process group this library joined, at the process's exit. Left to the interpreter's
    teardown, gloo's worker threads can be destroyed while joinable, and the process then aborts
    ("terminate called without an active exception", exit -6) after its work is done."""
    if dist.is_initialized():
        dist.destroy_process_group()


def current() -> DataParallel:
    """The data-parallel launch of this process, joining its process group on first use.

    ``torchrun`` and ``accelerate launch`` set ``WORLD_SIZE``/``RANK``/``LOCAL_RANK``; the group
    uses NCCL when CUDA is present and gloo otherwise.
    """
    fsdp = check_launch()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1 and not dist.is_initialized():
        return DataParallel()  # one process: nothing to shard over
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend)
        atexit.register(leave_group)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        logger.info("joined a %s process group: rank %d of %d", backend, dist.get_rank(), dist.get_world_size())
    return DataParallel(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(dist.get_world_size()))),
        fsdp=fsdp,
    )
