"""The policy guard of preference runs: a policy stage may not lower the task reward.

A learned reward model can be wrong where the policy goes (reward hacking), so the policy stage
is judged by the task reward: before the stage the guard scores the policy on its evaluation
rows (the policy trainer's ``evaluate`` with the task reward: fixed seed, forked RNG) and keeps a
copy of every trainable parameter and optimizer state; after the stage it scores again, and if
the task reward fell by more than the tolerance, the trainable parameters and optimizer moments
go back to the copy. Progress counters and LR schedules (the groups' current rates) are kept (the steps happened; the plan
stays aligned with the data). The copy is part of the run's state while a stage is in progress,
so a stop mid-stage resumes with it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch


def trainable_parameters(policy: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Every trainable parameter of the policy trainer's models, by model and parameter name."""
    return {name: {key: p for key, p in module.named_parameters() if p.requires_grad}
            for name, module in policy.checkpoint_modules().items()}


@dataclass
class PolicySnapshot:
    """The task reward before a policy stage and what to restore if the stage lowers it."""

    task_reward: float
    parameters: dict[str, dict[str, torch.Tensor]]
    optimizers: dict[str, dict[str, Any]]

    @classmethod
    def take(cls, policy: Any, task_reward: float) -> "PolicySnapshot":
        parameters = {name: {key: p.detach().cpu().clone() for key, p in params.items()}
                      for name, params in trainable_parameters(policy).items()}
        optimizers = {name: copy.deepcopy(component.optimizer.state_dict())
                      for name, component in policy.model_optimizers.items()}
        return cls(task_reward, parameters, optimizers)

    @torch.no_grad()
    def restore(self, policy: Any) -> None:
        live = trainable_parameters(policy)
        for name, params in self.parameters.items():
            for key, saved in params.items():
                live[name][key].copy_(saved.to(live[name][key].device))
        for name, component in policy.model_optimizers.items():
            rates = [(group["lr"], group.get("initial_lr")) for group in component.optimizer.param_groups]
            component.optimizer.load_state_dict(copy.deepcopy(self.optimizers[name]))
            for group, (rate, initial) in zip(component.optimizer.param_groups, rates):  # the schedule goes on
                group["lr"] = rate
                if initial is not None:
                    group["initial_lr"] = initial

    def state_dict(self) -> dict[str, Any]:
        return {"task_reward": self.task_reward, "parameters": self.parameters, "optimizers": self.optimizers}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any] | None) -> "PolicySnapshot | None":
        return cls(**state) if state is not None else None


def guard_rows(policy: Any) -> Any:
    """Where the guard scores the policy: the evaluation set, else the first training rows."""
    return policy.eval_dataset if policy.eval_dataset is not None else policy.train_dataset
