"""The joint reward model of preference-based training: an LM backbone with a scalar head.

The backbone is loaded from a causal-LM identifier or directory with its own tokenizer; the
head reads the hidden state of the last non-padding token. It is fitted with the
Bradley-Terry loss on preference pairs, then kept fixed as the reward for policy learning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from datasets import Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from comlrl.algorithms.losses import bradley_terry_loss
from comlrl.device import resolve_device
from comlrl.entities import load_causal_lm, load_tokenizer, prepare_tokenizer
from comlrl.export import save_value_head
from comlrl.preferences import joint_input_text
from comlrl.value_heads import attach_value_head, sequence_values

logger = logging.getLogger(__name__)


def resolve_reward_device(requested: str | None, trainer_device: torch.device, fallback: bool) -> torch.device:
    """``None`` means the trainer's device; a missing CUDA device fails unless ``fallback``."""
    if requested is None:
        return trainer_device
    try:
        return resolve_device(requested)
    except ValueError as error:
        if not fallback:
            raise ValueError(
                f"reward_model_device={requested!r} is not available ({error}); set reward_model_device=None "
                "(the trainer's device) or 'cpu', or reward_model_device_fallback=True to fall back to the "
                "trainer's device with a warning"
            ) from None
        logger.warning("reward_model_device=%r is not available; using the trainer's device %s", requested, trainer_device)
        return trainer_device


class JointRewardModel(torch.nn.Module):
    """Scores joint responses: ``score(prompts, joint_completions) -> [batch]`` floats.

    ``backbone`` is a causal LM carrying a value head (:mod:`comlrl.value_heads`), the same
    representation the critics use; the head is registered here so ``parameters()`` covers it.
    """

    def __init__(self, backbone: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, max_length: int | None = None):
        super().__init__()
        self.backbone = backbone
        self.value_head = backbone.value_head if hasattr(backbone, "value_head") else attach_value_head(backbone)
        self.tokenizer = tokenizer
        self.max_length = max_length

    @classmethod
    def load(
        cls,
        source: str,
        device: torch.device,
        dtype: torch.dtype,
        max_length: int | None = None,
        trust_remote_code: bool = False,
    ) -> "JointRewardModel":
        """The backbone from ``source`` with its own tokenizer and a new scalar head."""
        tokenizer = prepare_tokenizer(load_tokenizer(source, trust_remote_code), "the reward model")
        backbone = load_causal_lm(source, device, dtype, trust_remote_code)
        attach_value_head(backbone)
        return cls(backbone, tokenizer, max_length)

    @property
    def device(self) -> torch.device:
        return next(self.backbone.parameters()).device

    def freeze_backbone(self) -> None:
        for parameter in self.backbone.parameters():
            parameter.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return sequence_values(self.backbone, input_ids, attention_mask)

    def encode(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        encoded = self.tokenizer(
            list(texts), return_tensors="pt", padding=True, truncation=self.max_length is not None,
            max_length=self.max_length, add_special_tokens=False,
        )
        return encoded["input_ids"].to(self.device), encoded["attention_mask"].to(self.device)

    def score_texts(self, texts: Sequence[str]) -> torch.Tensor:
        return self(*self.encode(texts))

    @torch.no_grad()
    def score(self, prompts: Sequence[str], joint_completions: Sequence[Sequence[str]]) -> torch.Tensor:
        """Rewards of joint responses; ``joint_completions[agent][sample]``."""
        texts = [
            joint_input_text(prompt, [agent[i] for agent in joint_completions]) for i, prompt in enumerate(prompts)
        ]
        self.eval()
        return self.score_texts(texts).cpu()

    def save(self, directory: str | Path) -> Path:
        """Backbone and tokenizer as a Hugging Face directory, the head as ``value_head.pt``."""
        directory = Path(directory)
        self.backbone.save_pretrained(directory, safe_serialization=True)
        self.tokenizer.save_pretrained(directory)
        save_value_head(self.value_head, directory)
        return directory


@dataclass
class RewardFitResult:
    losses: list[float]
    train_accuracy: float
    heldout_accuracy: float | None
    num_train_pairs: int
    num_heldout_pairs: int

    def metrics(self) -> dict[str, float]:
        metrics = {
            "reward_model/loss": self.losses[-1] if self.losses else float("nan"),
            "reward_model/train_accuracy": self.train_accuracy,
            "reward_model/train_pairs": float(self.num_train_pairs),
            "reward_model/heldout_pairs": float(self.num_heldout_pairs),
        }
        if self.heldout_accuracy is not None:
            metrics["reward_model/heldout_accuracy"] = self.heldout_accuracy
        return metrics


def _pair_texts(pairs: Dataset, indices: Sequence[int]) -> tuple[list[str], list[str]]:
    rows = pairs.select(indices)
    chosen = [joint_input_text(p, c) for p, c in zip(rows["prompt"], rows["chosen"])]
    rejected = [joint_input_text(p, r) for p, r in zip(rows["prompt"], rows["rejected"])]
    return chosen, rejected


@torch.no_grad()
def preference_accuracy(model: JointRewardModel, pairs: Dataset, indices: Sequence[int], batch_size: int) -> float:
    """Fraction of pairs where the model scores the chosen response strictly higher."""
    if not indices:
        return float("nan")
    model.eval()
    correct = 0
    for start in range(0, len(indices), batch_size):
        chosen, rejected = _pair_texts(pairs, indices[start:start + batch_size])
        scores = model.score_texts(chosen + rejected)
        correct += int((scores[: len(chosen)] > scores[len(chosen):]).sum())
    return correct / len(indices)


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
) -> RewardFitResult:
    """Bradley-Terry fit on the train pairs; accuracy on train and held-out pairs."""
    if freeze_backbone:
        model.freeze_backbone()
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=learning_rate)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    train_indices = list(train_indices)
    for _ in range(epochs if train_indices else 0):
        model.train()
        order = [train_indices[i] for i in torch.randperm(len(train_indices), generator=generator).tolist()]
        epoch_losses = []
        for start in range(0, len(order), batch_size):
            chosen, rejected = _pair_texts(pairs, order[start:start + batch_size])
            scores = model.score_texts(chosen + rejected)
            loss = bradley_terry_loss(scores[: len(chosen)], scores[len(chosen):])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            epoch_losses.append(float(loss.detach()))
        losses.append(sum(epoch_losses) / len(epoch_losses))
    return RewardFitResult(
        losses=losses,
        train_accuracy=preference_accuracy(model, pairs, train_indices, batch_size),
        heldout_accuracy=preference_accuracy(model, pairs, list(heldout_indices), batch_size) if heldout_indices else None,
        num_train_pairs=len(train_indices),
        num_heldout_pairs=len(heldout_indices),
    )


def learned_reward(model: JointRewardModel, prompt_field: str = "prompt") -> Any:
    """A reward function for the policy trainers that scores joint samples with ``model``."""

    def reward_model_score(*completions: Sequence[str], batch_items: Sequence[dict[str, Any]]) -> list[float]:
        prompts = [str(row.get(prompt_field, "")) for row in batch_items]
        return model.score(prompts, completions).tolist()

    return reward_model_score
