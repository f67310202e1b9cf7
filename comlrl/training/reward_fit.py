"""Fitting the joint reward model (:class:`~comlrl.models.reward_model.JointRewardModel`) on preference pairs:
the Bradley-Terry loss through its own optimizer-step component, held-out accuracy per epoch, early stopping."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import torch
from datasets import Dataset

from comlrl.algorithms.losses import bradley_terry_loss
from comlrl.models.reward_model import JointRewardModel, identical_pairs
from comlrl.parallel.distributed import DataParallel
from comlrl.training.optimizer_step import ModelOptimizer, OptimizerSettings

logger = logging.getLogger(__name__)


@dataclass
class RewardFitResult:
    losses: list[float]
    train_accuracy: float
    heldout_accuracy: float | None
    num_train_pairs: int
    num_heldout_pairs: int
    identical_pairs: int = 0  # pairs whose chosen and rejected encode to the same ids (train + held-out)
    heldout_curve: list[float] = field(default_factory=list)  # held-out accuracy after each epoch (early stopping)
    best_epoch: int = -1  # the epoch whose weights the model keeps


    def metrics(self) -> dict[str, float]:
        metrics = {
            "reward_model/loss": self.losses[-1] if self.losses else float("nan"),
            "reward_model/train_accuracy": self.train_accuracy,
            "reward_model/train_pairs": float(self.num_train_pairs),
            "reward_model/heldout_pairs": float(self.num_heldout_pairs),
            "reward_model/identical_pairs": float(self.identical_pairs),
            "reward_model/epochs": float(len(self.losses)),
            "reward_model/best_epoch": float(self.best_epoch),
        }
        if self.heldout_accuracy is not None:
            metrics["reward_model/heldout_accuracy"] = self.heldout_accuracy
        return metrics


def patience_spent(epoch: int, best_epoch: int, patience: int) -> bool:
    """Early stopping's rule: ``patience`` epochs in a row after the best one (``epoch - best_epoch``) have not
    improved on it."""
    return epoch - best_epoch >= patience


def _pair_batch(model: JointRewardModel, pairs: Dataset, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen then the rejected joint responses of the pairs ``indices``, encoded."""
    rows = pairs.select(indices)
    prompts = list(rows["prompt"])
    return model.encode_joint(prompts + prompts, list(rows["chosen"]) + list(rows["rejected"]))


@torch.no_grad()
def _accuracy_and_identical(
    model: JointRewardModel, pairs: Dataset, indices: Sequence[int], batch_size: int
) -> tuple[float, int]:
    """Preference accuracy and the number of pairs encoded identically (warned about)."""
    if not indices:
        return float("nan"), 0
    model.eval()
    correct = identical = 0
    for start in range(0, len(indices), batch_size):
        input_ids, attention_mask = _pair_batch(model, pairs, indices[start:start + batch_size])
        identical += identical_pairs(input_ids, attention_mask)
        scores = model(input_ids, attention_mask)
        half = scores.shape[0] // 2
        correct += int((scores[:half] > scores[half:]).sum())
    if identical:
        logger.warning(
            "%d of %d preference pairs encode chosen and rejected to identical ids (reward_max_length=%s); "
            "the reward model cannot tell them apart", identical, len(indices), model.max_length,
        )
    return correct / len(indices), identical


def preference_accuracy(model: JointRewardModel, pairs: Dataset, indices: Sequence[int], batch_size: int) -> float:
    """Fraction of pairs where the model scores the chosen response strictly higher."""
    return _accuracy_and_identical(model, pairs, indices, batch_size)[0]


def fit_reward_model(
    model: JointRewardModel,
    pairs: Dataset,
    train_indices: Sequence[int],
    heldout_indices: Sequence[int],
    epochs: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
    freeze_backbone: bool = False,
    patience: int | None = None,
) -> RewardFitResult:
    """Bradley-Terry fit on the train pairs; accuracy on train and held-out pairs.

    With held-out pairs and ``patience``, the fit is judged on held-out accuracy after every
    epoch: it stops once ``patience`` epochs in a row have not improved on the best one, and the
    model keeps the best epoch's weights (so a few pairs cannot be memorised at the cost of
    generalisation).
    """
    if freeze_backbone:
        model.freeze_backbone()
    parameters = [p for p in model.parameters() if p.requires_grad]
    settings = OptimizerSettings(weight_decay=0.01, lr_scheduler_type="constant", warmup_steps=0, accumulation_steps=1,
                                 max_grad_norm=None, data_parallel=DataParallel())  # every rank fits the same pairs
    optimizer = ModelOptimizer("reward_model", model, parameters, learning_rate, 1, settings)
    generator = torch.Generator().manual_seed(seed)
    losses, heldout_curve = [], []
    train_indices, heldout_indices = list(train_indices), list(heldout_indices)
    best: tuple[float, int, dict[str, torch.Tensor]] | None = None
    for epoch in range(epochs if train_indices else 0):
        model.train()
        order = [train_indices[i] for i in torch.randperm(len(train_indices), generator=generator).tolist()]
        epoch_losses = []
        for start in range(0, len(order), batch_size):
            scores = model(*_pair_batch(model, pairs, order[start:start + batch_size]))
            half = scores.shape[0] // 2
            loss = bradley_terry_loss(scores[:half], scores[half:])
            loss.backward()
            optimizer.micro_step()
            epoch_losses.append(float(loss.detach()))
        losses.append(sum(epoch_losses) / len(epoch_losses))
        if patience is None or not heldout_indices:
            continue
        accuracy = preference_accuracy(model, pairs, heldout_indices, batch_size)
        heldout_curve.append(accuracy)
        if best is None or accuracy > best[0]:
            best = (accuracy, epoch, {k: v.detach().clone() for k, v in model.state_dict().items()})
        elif patience_spent(epoch, best[1], patience):
            break
    if best is not None:
        model.load_state_dict(best[2])
    train_accuracy, train_identical = _accuracy_and_identical(model, pairs, train_indices, batch_size)
    heldout_accuracy, heldout_identical = _accuracy_and_identical(model, pairs, heldout_indices, batch_size)
    return RewardFitResult(
        losses=losses,
        train_accuracy=train_accuracy,
        heldout_accuracy=heldout_accuracy if heldout_indices else None,
        num_train_pairs=len(train_indices),
        num_heldout_pairs=len(heldout_indices),
        identical_pairs=train_identical + heldout_identical,
        heldout_curve=heldout_curve,
        best_epoch=best[1] if best is not None else len(losses) - 1,
    )
