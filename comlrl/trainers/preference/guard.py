"""The policy guard of preference runs: a policy stage may not lower the task reward.

A learned reward model can be wrong where the policy goes (reward hacking), so the policy stage
is judged by the task reward: before the stage the guard scores the policy on its own
validation rows (:func:`guard_rows`: never the evaluation set, whose reward is reported as held
out) and takes a snapshot of every trained model through its optimizer-step component
(:meth:`~comlrl.training.optimizer_step.ModelOptimizer.snapshot`: trainable weights and optimizer
moments); after the stage it scores again, and if the task reward fell by more than the
tolerance, every component restores its snapshot. Progress counters and LR schedules go on (the
steps happened; the plan stays aligned with the data). The snapshot is part of the run's state
while a stage is in progress, so a stop mid-stage resumes with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import isnan
from typing import Any


@dataclass
class PolicySnapshot:
    """The task reward before a policy stage and, per optimizer-step component, what to restore."""

    task_reward: float
    components: dict[str, dict[str, Any]]

    @classmethod
    def take(cls, policy: Any, task_reward: float) -> "PolicySnapshot":
        return cls(task_reward, {name: component.snapshot() for name, component in policy.model_optimizers.items()})

    def restore(self, policy: Any) -> None:
        for name, component in policy.model_optimizers.items():
            component.restore_snapshot(self.components[name])

    def state_dict(self) -> dict[str, Any]:
        return {"task_reward": self.task_reward, "components": self.components}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any] | None) -> "PolicySnapshot | None":
        return cls(state["task_reward"], state["components"]) if state is not None else None


def guard_rows(train_dataset: Any, num_rows: int, seed: int) -> list[int]:
    """The guard's validation rows: ``num_rows`` training rows drawn with ``seed`` (every row when the
    set is smaller). The evaluation set is never among them, so the reported eval reward stays held out."""
    import torch

    size = len(train_dataset)
    if num_rows >= size:
        return list(range(size))
    generator = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(size, generator=generator)[:num_rows].tolist())


def pairwise_agreement(scores: Any, reference: Any) -> float:
    """How often ``scores`` order two samples of the same row as ``reference`` does: over every pair of
    a row (``[rows, samples]`` each) whose reference rewards differ (NaN = dropped, left out); NaN
    when no pair differs. 1 = the same order everywhere, 0.5 = chance."""
    import torch

    agree = total = 0
    for row_scores, row_reference in zip(scores.float(), reference.float()):
        for i in range(row_reference.numel()):
            for j in range(i + 1, row_reference.numel()):
                difference = row_reference[i] - row_reference[j]
                if torch.isnan(difference) or difference == 0:
                    continue
                total += 1
                agree += int(bool(torch.sign(row_scores[i] - row_scores[j]) == torch.sign(difference)))
    return agree / total if total else float("nan")


def revert_warning(iteration: int, before: float, after: float, agreement: float) -> str:
    """The warning of a reverted policy stage: the task reward before and after, and how well the reward
    model orders fresh samples (:func:`pairwise_agreement`). The revert is always reported; when no fresh
    pair differed in task reward (agreement NaN) there is nothing to judge the reward model on, and the
    warning says so instead of printing a percentage."""
    head = (f"iteration {iteration}: the policy stage lowered the task reward on the guard's rows {before:.4f} -> "
            f"{after:.4f}, so its weights are restored (policy_guard).")
    if isnan(agreement):
        return (f"{head} No fresh pair of samples differed in task reward, so how the reward model orders them "
                "could not be judged; score more rows (policy_guard_rows) or sample more varied answers "
                "(num_generations, temperature)")
    return (f"{head} The reward model orders fresh samples as the task reward does in {100 * agreement:.0f}% of "
            "pairs (50% is chance): a reward model near chance cannot teach the policy; collect more pairs "
            "(preference_num_generations, max_pairs_per_prompt) or fit longer (reward_train_epochs, "
            "reward_learning_rate)")
