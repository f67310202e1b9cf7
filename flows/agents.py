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

import os
import socket
import uuid
from contextlib import nullcontext
from typing import Any, Callable, Sequence

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext, TaskRunContext
from prefect.futures import wait

from comlrl.parallel.placement import private_tokenizers
from flows.spec import ExecutionSpec


class _ProcessTable(dict):
    """Per-agent functions of the agent maps now running in this process, by key; never copied."""

    def __reduce__(self) -> tuple[Callable[[], "_ProcessTable"], tuple]:
        return _this_process_table, ()


def _this_process_table() -> "_ProcessTable":
    return _PENDING


_PENDING = _ProcessTable()


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


def run_agents_as_tasks(function: Callable[[int], Any], devices: Sequence[torch.device]) -> list[Any]:
    """An :data:`comlrl.parallel.placement.AgentMap`: one ``agent_work`` task run per agent on the current flow
    run's task runner, all awaited, results in agent order."""
    if FlowRunContext.get() is None:
        raise RuntimeError("run_agents_as_tasks submits agent_work tasks to the current flow run, and there is none; "
                           "outside a flow use comlrl.parallel.placement.map_by_device (the trainers' default agent_map)")
    parent = TaskRunContext.get()
    label = parent.task_run.name if parent is not None else "flow"

    def on_device(agent: int) -> Any:  # a worker thread starts on the default CUDA device
        device = devices[agent]
        with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
            return function(agent)

    key = uuid.uuid4().hex
    _PENDING[key] = on_device
    try:
        futures = [agent_work.submit(key, agent, label, process_name()) for agent in range(len(devices))]
        wait(futures)  # every agent has finished before any failure propagates
        return [future.result() for future in futures]
    finally:
        del _PENDING[key]


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
    # A preference run's agents, and their map, belong to its policy trainer (it collects with them too).
    target = getattr(trainer, "policy_trainer", trainer)
    target.agent_map = run_agents_as_tasks
    target.tokenizers = private_tokenizers(target.tokenizers)  # fast tokenizers are not thread-safe
