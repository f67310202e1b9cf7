"""Per-agent Prefect tasks: each agent's share of a stage (its generation, its backward pass) as
its own ``agent_work`` task run on the flow's Dask task runner.

The trainer and its models are objects of the flow's process, and Dask pickles what it sends
to a worker even when the worker is a thread of the same process (a ``LocalCluster`` with
``processes=False``); cloudpickle even ships a Prefect task's function by value, with the
module globals it reads. A task handed the per-agent function would run on a copy of the
models and its gradients would be silently lost. So the function stays in this process, in
``_PENDING`` under a fresh key, and the task receives only the key and the agent index;
``_PENDING`` itself unpickles as the table of the process that unpickles it. A worker in
another process (``processes=True``, a remote ``dask-scheduler``'s workers) finds no such key
and the task fails, naming the fix. The flow therefore starts an in-process ``LocalCluster``
unless ``execution.dask_address`` names a scheduler of its own.
"""

from __future__ import annotations

import contextvars
import functools
import os
import socket
import uuid
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Sequence

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext, TaskRunContext
from prefect.futures import wait

from comlrl.trainers.epochs import current_activity
from flows.spec import ExecutionSpec


class _ProcessTable(dict):
    """Objects of this process by key (the per-agent functions of the agent maps now running, the
    training flows' task runners); pickled, a table stands for the same table of the unpickling process."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def __reduce__(self) -> tuple[Callable[[str], "_ProcessTable"], tuple]:
        return _this_process_table, (self.name,)


_TABLES: dict[str, _ProcessTable] = {}


def _this_process_table(name: str) -> "_ProcessTable":
    return process_table(name)


def process_table(name: str) -> _ProcessTable:
    """This process's table ``name`` (created on first use)."""
    return _TABLES.setdefault(name, _ProcessTable(name))


_PENDING = process_table("pending")
# The task runner of each training flow run that installed agent tasks, by key: the agent map keeps
# only the key, so the trainer holds no started runner (a client, locks).
_RUNNERS = process_table("runners")

# Where the flow is (``b2``: the boundary), set by its tasks; with the trainer's own activity
# (comlrl.trainers.epochs.current_activity: ``rollout-s3``) it names the agent_work task runs
# (``agent_work-rollout-b2-s3-agent0``).
_STAGE_LABEL: contextvars.ContextVar[str | None] = contextvars.ContextVar("comlrl_stage_label", default=None)


@contextmanager
def stage_label(label: str) -> Iterator[None]:
    """Name the agent_work task runs submitted inside the block after ``label``."""
    token = _STAGE_LABEL.set(label)
    try:
        yield
    finally:
        _STAGE_LABEL.reset(token)


def process_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


# No retries: a repeated backward pass would add its gradients twice.
@task(cache_policy=NO_CACHE, persist_result=False, retries=0, task_run_name="agent_work-{label}-agent{agent}")
def agent_work(key: str, agent: int, label: str, owner: str) -> Any:
    """Agent ``agent``'s share of the stage ``label``: the function the flow's process registered as ``key``."""
    function = _PENDING.get(key)
    if function is None:
        raise RuntimeError(
            f"agent_work for agent {agent} of {label} ran in process {process_name()}, but the trainer lives in the "
            f"flow's process {owner}. Per-agent tasks must run on Dask workers inside the flow's process (a worker "
            "elsewhere would get a pickled copy of the models and their updates would be lost): leave "
            "execution.dask_address unset, so the flow starts an in-process LocalCluster, or point it at a "
            "scheduler whose workers are threads of the flow's process."
        )
    return function(agent)


def run_agents_as_tasks(function: Callable[[int], Any], devices: Sequence[torch.device],
                        task_runner_key: str | None = None) -> list[Any]:
    """An :data:`comlrl.parallel.placement.AgentMap`: one ``agent_work`` task run per agent on the task
    runner :func:`install` registered as ``task_runner_key`` (default: the current flow run's), all
    awaited, results in agent order. The training flow binds its own Dask runner, so its boundary
    subflows submit there too."""
    context = FlowRunContext.get()
    if context is None:
        raise RuntimeError("run_agents_as_tasks submits agent_work tasks to the current flow run, and there is none; "
                           "outside a flow use comlrl.parallel.placement.map_by_device (the trainers' default agent_map)")
    runner = _RUNNERS[task_runner_key] if task_runner_key is not None else context.task_runner
    parent = TaskRunContext.get()
    where = _STAGE_LABEL.get() or (parent.task_run.name if parent is not None else "flow")
    doing = current_activity()  # the trainer's stage and step (rollout-s2) or evaluate
    label = where if doing is None else "-".join([doing.split("-s")[0], where, *doing.split("-")[1:]])

    def on_device(agent: int) -> Any:  # a worker thread starts on the default CUDA device
        device = devices[agent]
        with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
            return function(agent)

    key = uuid.uuid4().hex
    _PENDING[key] = on_device
    try:
        futures = _outside_task_run(lambda: [
            runner.submit(agent_work, {"key": key, "agent": agent, "label": label, "owner": process_name()})
            for agent in range(len(devices))])
        wait(futures)  # every agent has finished before any failure propagates
        return [future.result() for future in futures]
    finally:
        del _PENDING[key]


def _outside_task_run(submit: Callable[[], Any]) -> Any:
    """``submit()`` in a copy of the current context without the current task run. Dask serialises
    the submitting context with every task, the task run's parameters (the trainer, its callbacks'
    threads) included; agent_work needs none of it and runs in the flow run as before."""
    context = contextvars.copy_context()
    context.run(TaskRunContext.__var__.set, None)
    return context.run(submit)


def _dask_task_runner_class() -> type:
    try:
        from prefect_dask import DaskTaskRunner
    except ImportError as error:
        raise RuntimeError(f"execution.task_runner 'dask' needs prefect-dask: pip install 'comlrl[pipeline]' "
                           f"({error})") from None
    return DaskTaskRunner


def dask_task_runner(execution: ExecutionSpec) -> Any:
    """The ``DaskTaskRunner`` that ``execution`` describes: an in-process ``LocalCluster`` (threads of
    the flow's process, inproc transport, no ports, no dashboard) or the scheduler at ``dask_address``."""
    runner_class = _dask_task_runner_class()
    if execution.dask_address:
        return runner_class(address=execution.dask_address)
    return runner_class(cluster_class="distributed.LocalCluster",
                        cluster_kwargs={"processes": False, "n_workers": execution.dask_workers,
                                        "threads_per_worker": 1, "dashboard_address": None})


def install(trainer: Any) -> None:
    """Route the trainer's per-agent work through ``agent_work`` tasks; the flow run must use a Dask task runner."""
    runner = FlowRunContext.get().task_runner
    if not isinstance(runner, _dask_task_runner_class()):
        raise RuntimeError(f"the spec sets execution.task_runner 'dask' but this flow run uses {type(runner).__name__}; "
                           "start it with flows.training.training_flow(spec), as `comlrl run` does")
    key = uuid.uuid4().hex
    _RUNNERS[key] = runner
    # Fast tokenizers are not thread-safe: each agent gets its own copies.
    trainer.run_agents_with(functools.partial(run_agents_as_tasks, task_runner_key=key), private_tokenizers=True)
