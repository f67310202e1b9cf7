"""The frozen reference policy of an agent: what a KL penalty or a DPO ratio compares against.

:meth:`ReferencePolicy.for_agent` gives, per agent, one of:

- the agent's own base model with its LoRA adapters switched off (``peft``'s
  ``disable_adapter``): LoRA's update starts at zero, so this *is* the initial policy, and no
  second copy of the weights is held;
- a model loaded from ``source`` (a hub id or directory), frozen;
- a frozen copy of the agent as it is when the trainer is built, i.e. its initial weights.
  A resume rebuilds the trainer from the same sources before loading the checkpoint, so the
  copy is again the initial weights: checkpoints never hold the reference.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from comlrl.algorithms.kl import k3_token_kl, sequence_kl
from comlrl.models import lora
from comlrl.parallel.placement import model_device
from comlrl.rollout.generation import Generation
from comlrl.training.logprobs import completion_logprobs
from comlrl.training.policy_update import behaviour_logprobs, dropout_disabled


class ReferencePolicy:
    """A frozen policy to score completions with; never trained, never saved in checkpoints."""

    def __init__(self, model: PreTrainedModel, *, shares_agent: bool = False, kind: str = "copy") -> None:
        self.model = model
        self.shares_agent = shares_agent
        self.kind = kind  # "adapters_off" | "source" | "copy"

    @classmethod
    def for_agent(cls, agent: PreTrainedModel, source: Any = None, device: Any = None,
                  load_kwargs: dict[str, Any] | None = None) -> "ReferencePolicy":
        """The reference of ``agent``: a LoRA agent's base (adapters off), ``source`` loaded and frozen, or a
        frozen copy of ``agent`` now (its initial weights when called at construction)."""
        if source is None and lora.is_peft_model(agent):
            return cls(agent, shares_agent=True, kind="adapters_off")
        if source is not None:
            if isinstance(source, torch.nn.Module):
                model, kind = source, "source"
            else:
                model, kind = AutoModelForCausalLM.from_pretrained(source, **(load_kwargs or {})), "source"
        else:
            model, kind = copy.deepcopy(agent), "copy"
        model.to(device if device is not None else model_device(agent))
        model.eval()
        model.requires_grad_(False)
        return cls(model, kind=kind)

    @contextlib.contextmanager
    def _active(self) -> Iterator[PreTrainedModel]:
        if self.shares_agent:
            with self.model.disable_adapter(), dropout_disabled(self.model):
                yield self.model
        else:
            with dropout_disabled(self.model):
                yield self.model

    @torch.no_grad()
    def logprobs(self, generation: Generation, temperature: float = 1.0,
                 autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Per-token log-probabilities of ``generation``'s completions under the reference, ``[rows, tokens]``
        (on the device of the completions; padding positions hold values to be masked by the caller)."""
        with self._active() as model:
            device = model_device(model)
            values = completion_logprobs(
                model, generation.prompt_ids.to(device), generation.prompt_mask.to(device),
                generation.completion_ids.to(device), generation.completion_mask.to(device), temperature,
                autocast_dtype,
            )
        return values.to(generation.completion_ids.device)


@dataclass
class ReferenceTerms:
    """Per agent and turn, for one rollout: the completions' log-probabilities under the sampling policy
    (``behaviour``) and under the reference, and each completion's KL estimate (``kl``, ``[rows]``)."""

    behaviour: list[list[torch.Tensor]]
    reference: list[list[torch.Tensor]]
    kl: list[list[torch.Tensor]]

    def mean_kl(self, agent: int | None = None) -> float:
        """The mean completion KL of one agent, or of all agents' completions."""
        agents = range(len(self.kl)) if agent is None else [agent]
        parts = [turn.float().reshape(-1).cpu() for a in agents for turn in self.kl[a]]
        values = torch.cat(parts) if parts else torch.empty(0)
        return float(values.mean()) if values.numel() else 0.0  # no completions: no divergence measured


def reference_terms(agents: Sequence[PreTrainedModel], references: Sequence[ReferencePolicy],
                    generations: Sequence[Sequence[Generation]], temperature: float,
                    autocast_dtype: torch.dtype | None = None) -> ReferenceTerms:
    """:class:`ReferenceTerms` of ``generations[agent][turn]``: one forward pass of each agent (no graph, dropout
    off, before any update: the behaviour log-probabilities) and one of its reference per turn."""
    behaviour, reference, kl = [], [], []
    for agent, policy, agent_generations in zip(agents, references, generations):
        policy_logprobs = behaviour_logprobs(agent, agent_generations, temperature, autocast_dtype)
        reference_logprobs = [policy.logprobs(g, temperature, autocast_dtype) for g in agent_generations]
        behaviour.append(policy_logprobs)
        reference.append(reference_logprobs)
        kl.append([sequence_kl(k3_token_kl(p, r.to(p.device)), g.completion_mask.to(p.device))
                   for p, r, g in zip(policy_logprobs, reference_logprobs, agent_generations)])
    return ReferenceTerms(behaviour, reference, kl)
