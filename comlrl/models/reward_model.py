"""The joint reward model of preference-based training: an LM backbone with a scalar head.

The backbone is loaded from a causal-LM identifier or directory with its own tokenizer; the
head reads the hidden state of the last non-padding token. It is fitted with the
Bradley-Terry loss on preference pairs, then kept fixed as the reward for policy learning.

(The fit itself is :mod:`comlrl.training.reward_fit`.) A joint response is read section by section (:func:`comlrl.rollout.preferences.joint_input_sections`)
and, past ``max_length``, cut by :func:`joint_token_budget` so every agent keeps a share.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from comlrl.parallel.device import resolve_device
from comlrl.models.entities import load_causal_lm, load_tokenizer, prepare_tokenizer
from comlrl.models.export import save_value_head
from comlrl.rollout.preferences import agent_tag, joint_input_sections
from comlrl.tokenizers import encode
from comlrl.models.value_heads import attach_value_head, sequence_values

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


def fair_shares(lengths: Sequence[int], budget: int) -> list[int]:
    """Max-min fair split of ``budget`` tokens over sections of ``lengths`` (water-filling).

    A section no longer than the equal share keeps all its tokens and leaves the rest to the
    others; the longer ones get equal shares, any remainder one token each to the earliest.
    """
    kept = list(lengths)
    open_sections = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    while open_sections:
        share = budget // len(open_sections)
        if lengths[open_sections[0]] <= share:
            budget -= lengths[open_sections.pop(0)]
            continue
        extra = budget - share * len(open_sections)
        for rank, index in enumerate(sorted(open_sections)):
            kept[index] = share + int(rank < extra)
        break
    return kept


def budget_problem(max_length: int, tag_lengths: Sequence[int]) -> str | None:
    """Why ``max_length`` cannot hold a truncated joint response (None when it can): the agent tags are kept
    whole, and every agent's completion must keep at least one token, or two joint responses that differ
    only past the cut encode identically (and the reward model cannot tell them apart)."""
    needed = sum(tag_lengths) + len(tag_lengths)
    if max_length >= needed:
        return None
    return (f"reward_max_length={max_length} leaves no room for content: the {len(tag_lengths)} agent tags take "
            f"{sum(tag_lengths)} tokens ({', '.join(str(n) for n in tag_lengths)}) and every agent's completion needs "
            f"at least one more, so the reward model would read prompt-less, completion-less joint responses (chosen "
            f"and rejected identical); set reward_max_length to at least {needed} (better: room for the prompt and "
            "the completions, e.g. the longest joint response you expect), or None for no truncation")


def joint_tag_lengths(tokenizer: PreTrainedTokenizerBase, num_agents: int) -> list[int]:
    """Tokens of each agent's tag in a joint response, as :meth:`JointRewardModel.encode_joint` tokenizes it."""
    return [len(encode(tokenizer, agent_tag(index), add_special_tokens=False)["input_ids"]) for index in range(num_agents)]


def check_joint_budget(tokenizer: PreTrainedTokenizerBase, num_agents: int, max_length: int | None) -> None:
    """Raise (before any work) when ``max_length`` cannot hold ``num_agents`` agents' tags and one token of
    each completion (:func:`budget_problem`)."""
    if max_length is None:
        return
    problem = budget_problem(max_length, joint_tag_lengths(tokenizer, num_agents))
    if problem:
        raise ValueError(problem)


def joint_token_budget(
    prompt_length: int, tag_lengths: Sequence[int], completion_lengths: Sequence[int], max_length: int | None
) -> tuple[int, list[int]]:
    """Tokens kept of the prompt and of each completion so a joint response fits ``max_length``.

    Nothing is cut when it all fits (or ``max_length`` is None). Otherwise the agent tags are
    kept whole and the ``room = max_length - sum(tag_lengths)`` left is split: the prompt gives
    way first, down to a floor of ``room // (num_agents + 1)`` tokens (all of it if shorter);
    the completions share the rest by :func:`fair_shares`. A budget without room for one token of
    every completion fails (:func:`budget_problem`).
    """
    if max_length is None or prompt_length + sum(tag_lengths) + sum(completion_lengths) <= max_length:
        return prompt_length, list(completion_lengths)
    problem = budget_problem(max_length, tag_lengths)
    if problem:
        raise ValueError(problem)
    room = max_length - sum(tag_lengths)
    floor = room // (len(completion_lengths) + 1)
    prompt_kept = min(prompt_length, max(floor, room - sum(completion_lengths)))
    return prompt_kept, fair_shares(completion_lengths, room - prompt_kept)


def truncate_joint_ids(section_ids: Sequence[Sequence[int]], max_length: int | None) -> list[int]:
    """One joint response's ids from its tokenized sections (``[prompt, tag_0, completion_0, ...]``),
    cut by :func:`joint_token_budget`: the prompt keeps its last tokens, each completion its first."""
    prompt, tags, completions = section_ids[0], section_ids[1::2], section_ids[2::2]
    prompt_kept, kept = joint_token_budget(
        len(prompt), [len(t) for t in tags], [len(c) for c in completions], max_length
    )
    ids = list(prompt[len(prompt) - prompt_kept:])
    for tag, completion, length in zip(tags, completions, kept, strict=True):
        ids += list(tag) + list(completion[:length])
    return ids


def pad_rows(rows: Sequence[Sequence[int]], pad_id: int, side: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask``, ``[batch, longest]``, padded on ``side``."""
    width = max((len(row) for row in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        columns = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, columns] = torch.tensor(list(row), dtype=torch.long)
        mask[i, columns] = 1
    return ids, mask


def identical_pairs(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """How many rows of the first half encode exactly as the matching row of the second half."""
    half = input_ids.shape[0] // 2
    same = (input_ids[:half] == input_ids[half:2 * half]) & (attention_mask[:half] == attention_mask[half:2 * half])
    return int(same.all(dim=1).sum())


class JointRewardModel(torch.nn.Module):
    """Scores joint responses: ``score(prompts, joint_completions) -> [batch]`` floats.

    ``backbone`` is a causal LM carrying a value head (:mod:`comlrl.models.value_heads`), the same
    representation the critics use; the head is registered here so ``parameters()`` covers it.
    """

    def __init__(self, backbone: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, max_length: int | None = None,
                 num_agents: int | None = None):
        """``num_agents`` (when known) checks now that ``max_length`` holds every agent's tag and some content
        (:func:`check_joint_budget`); encoding checks it again on every truncated joint response."""
        if num_agents is not None:
            check_joint_budget(tokenizer, num_agents, max_length)
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
        num_agents: int | None = None,
    ) -> "JointRewardModel":
        """The backbone from ``source`` with its own tokenizer and a new scalar head; with ``num_agents`` the
        budget ``max_length`` is checked (:func:`check_joint_budget`) before the backbone loads."""
        tokenizer = prepare_tokenizer(load_tokenizer(source, trust_remote_code), "the reward model")
        if num_agents is not None:
            check_joint_budget(tokenizer, num_agents, max_length)
        backbone = load_causal_lm(source, device, dtype, trust_remote_code)
        attach_value_head(backbone)
        return cls(backbone, tokenizer, max_length, num_agents)

    @property
    def device(self) -> torch.device:
        return next(self.backbone.parameters()).device

    def freeze_backbone(self) -> None:
        for parameter in self.backbone.parameters():
            parameter.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return sequence_values(self.backbone, input_ids, attention_mask)

    def encode(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Plain texts, cut at their end; joint responses go through :meth:`encode_joint`."""
        encoded = encode(
            self.tokenizer, list(texts), return_tensors="pt", padding=True, truncation=self.max_length is not None,
            max_length=self.max_length, add_special_tokens=False,
        )
        return encoded["input_ids"].to(self.device), encoded["attention_mask"].to(self.device)

    def score_texts(self, texts: Sequence[str]) -> torch.Tensor:
        return self(*self.encode(texts))

    def encode_joint(
        self, prompts: Sequence[str], responses: Sequence[Sequence[str]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Ids and mask of joint responses, ``responses[sample][agent]``, padded on the tokenizer's
        side; each section tokenized alone and the whole cut by :func:`truncate_joint_ids`."""
        sections = [joint_input_sections(p, r) for p, r in zip(prompts, responses, strict=True)]
        flat = [text for row in sections for text in row]
        flat_ids = encode(self.tokenizer, flat, add_special_tokens=False)["input_ids"] if flat else []
        rows, start = [], 0
        for row in sections:
            rows.append(truncate_joint_ids(flat_ids[start:start + len(row)], self.max_length))
            start += len(row)
        ids, mask = pad_rows(rows, self.tokenizer.pad_token_id, self.tokenizer.padding_side)
        return ids.to(self.device), mask.to(self.device)

    def score_joint(self, prompts: Sequence[str], responses: Sequence[Sequence[str]]) -> torch.Tensor:
        """Rewards of joint responses, ``responses[sample][agent]``, with autograd."""
        return self(*self.encode_joint(prompts, responses))

    @torch.no_grad()
    def score(self, prompts: Sequence[str], joint_completions: Sequence[Sequence[str]]) -> torch.Tensor:
        """Rewards of joint responses; ``joint_completions[agent][sample]``."""
        responses = [[agent[i] for agent in joint_completions] for i in range(len(prompts))]
        self.eval()
        return self.score_joint(prompts, responses).cpu()

    def save(self, directory: str | Path) -> Path:
        """Backbone and tokenizer as a Hugging Face directory, the head as ``value_head.pt``."""
        directory = Path(directory)
        self.backbone.save_pretrained(directory, safe_serialization=True)
        self.tokenizer.save_pretrained(directory)
        save_value_head(self.value_head, directory)
        return directory


def learned_reward(model: JointRewardModel, prompt_field: str = "prompt") -> Any:
    """A reward function for the policy trainers that scores joint samples with ``model``."""

    def reward_model_score(*completions: Sequence[str], batch_items: Sequence[dict[str, Any]]) -> list[float]:
        prompts = [str(row.get(prompt_field, "")) for row in batch_items]
        return model.score(prompts, completions).tolist()

    return reward_model_score
