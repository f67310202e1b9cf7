"""comlrl 1.4.3's names for the centralized comparator's adapter (its ``comlrl.trainers.preference.centralized``).

The comparator is :class:`~comlrl.trainers.preference.comparators.CentralizedComparator`
(``comparator_generation_mode='centralized'``); the joint prompt and its split are the collaboration
adapters' of :mod:`comlrl.rollout.collaboration`, which centralized MAGRPO uses too. An adapter with
1.4.3's two methods plugs into either (``centralized_comparator_adapter=``, ``centralized_adapter=``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from comlrl.rollout.collaboration import CollaborationParseError, TaggedCollaboration

# Raised for a completion that does not split; a 1.4.3 adapter may raise it with a message alone.
CentralizedComparatorParseError = CollaborationParseError


class CentralizedComparatorAdapter(Protocol):
    """What a 1.4.3 centralized adapter provides: the joint prompt over the agents' prompts, and its split."""

    def build_prompt(self, batch_item: Any, agent_prompts: Sequence[str]) -> str: ...

    def parse_completion(self, completion: str, batch_item: Any, num_agents: int) -> Sequence[str]: ...


@dataclass(frozen=True)
class TaggedCentralizedComparatorAdapter:
    """1.4.3's default adapter: the tagged format (``<agent_i>...</agent_i>`` per agent) of
    :class:`~comlrl.rollout.collaboration.TaggedCollaboration`, for as many agents as it is given."""

    def build_prompt(self, batch_item: Any, agent_prompts: Sequence[str]) -> str:
        """Each agent's original prompt under its number (as 1.4.3's prompt labels them), then the tagged
        answer format; ``batch_item`` is not read."""
        del batch_item
        sections = "\n\n".join(f"Agent {index} original prompt:\n{prompt}" for index, prompt in enumerate(agent_prompts))
        return (f"Write the separate outputs of {len(agent_prompts)} agents in one reply: each output answers its "
                f"agent's original prompt.\n\n{sections}\n\n"
                f"{TaggedCollaboration(len(agent_prompts)).answer_instructions()}\n")

    def parse_completion(self, completion: str, batch_item: Any, num_agents: int) -> list[str]:
        """The agents' sections of ``completion``; ``batch_item`` is not read."""
        del batch_item
        return TaggedCollaboration(num_agents).parse_completion(completion)


__all__ = ["CentralizedComparatorAdapter", "CentralizedComparatorParseError", "TaggedCentralizedComparatorAdapter"]
