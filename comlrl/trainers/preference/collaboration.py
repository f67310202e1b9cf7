"""comlrl 1.4.3's ``comlrl.trainers.preference.collaboration``: one joint policy's text at the environment's edge.

:class:`CentralizedCollaboration` builds the joint prompt from the roles' prompts, splits a joint completion into
the roles' responses for the task reward, evaluation and metrics, and scores it with the user's reward. It is a
thin face over :mod:`comlrl.rollout.collaboration`, which the centralized trainers use themselves.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

from comlrl.data import resolve_formatters
from comlrl.rollout.collaboration import as_adapter, split_completions
from comlrl.rollout.rewards import is_number, plan_reward_call, resolve_reward_range


class CentralizedCollaboration:
    """The joint prompt, the split and the task reward of one joint policy writing ``num_roles`` roles.

    ``adapter`` has 1.4.3's ``build_prompt(batch_item, agent_prompts)`` and ``parse_completion(completion,
    batch_item, num_agents)`` (or is a :class:`~comlrl.rollout.collaboration.CollaborationAdapter`); a completion
    that does not parse gives every role ``""``."""

    def __init__(self, adapter: Any, formatters: Any, reward_func: Callable[..., Any], num_roles: int) -> None:
        self.adapter = as_adapter(adapter, num_roles)
        self.num_roles = num_roles
        self.formatters = resolve_formatters(formatters, num_roles)
        self.reward_func = reward_func
        self.reward_range = resolve_reward_range(reward_func)
        self._plan = plan_reward_call(reward_func, num_roles)  # how its signature asks to be called

    def build_prompt(self, item: dict[str, Any]) -> str:
        """The joint prompt over every role's formatted prompt for ``item``."""
        return self.adapter.build_prompt(item, [formatter(item) for formatter in self.formatters])

    def split(self, completion: str, item: dict[str, Any]) -> list[str]:
        """The roles' responses in ``completion`` (``""`` each when it does not parse)."""
        responses, _ = split_completions(self.adapter, [completion], [item], on_failure="empty")
        return [texts[0] for texts in responses]

    def __call__(self, completions: Sequence[str], *, prompts: Any = None,
                 batch_items: Sequence[dict[str, Any]] | None = None) -> list[float]:
        """One task reward per joint completion: the user's reward of its split, with the item's first prompt."""
        del prompts  # the reward reads the item's own prompt, as the decentralized agents' rewards do
        if not batch_items:
            raise ValueError("Centralized task rewards require batch_items: one item, or one per completion")
        if len(batch_items) not in {1, len(completions)}:
            raise ValueError(f"Centralized completions must align with batch_items: {len(completions)} completions, "
                             f"{len(batch_items)} items")
        rewards = []
        for index, completion in enumerate(completions):
            item = batch_items[0] if len(batch_items) == 1 else batch_items[index]
            args, kwargs = self._plan.arguments([self.formatters[0](item)],
                                                [[response] for response in self.split(completion, item)], [item])
            values = self.reward_func(*args, **kwargs)
            values = [values] if is_number(values) else list(values)
            if len(values) != 1:
                raise ValueError(f"Centralized task reward must return one joint reward, got {len(values)}")
            rewards.append(float(values[0]))
        return rewards

    def split_eval(self, joint_turns: Sequence[Sequence[Sequence[str]]],
                   items: Sequence[dict[str, Any]]) -> list[list[list[str]]]:
        """``[role][row][turn]`` responses from the joint policy's ``[1][row][turn]`` completions."""
        if len(joint_turns) != 1 or len(joint_turns[0]) != len(items):
            raise ValueError(f"Centralized evaluation outputs must align with items: {len(joint_turns)} policies "
                             f"(1 expected) for {len(items)} items")
        outputs: list[list[list[str]]] = [[] for _ in range(self.num_roles)]
        for turns, item in zip(joint_turns[0], items):
            parsed = [self.split(completion, item) for completion in turns]
            for role in range(self.num_roles):
                outputs[role].append([responses[role] for responses in parsed])
        return outputs

    def wrap_metrics_callback(self, callback: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
        """``callback`` seeing one sample per role (a copy of the joint sample with the role's ``agent_idx``
        and response; ``metadata`` shared) for each joint sample."""

        def role_metrics(samples: list[Any]) -> Any:
            role_samples = []
            for sample in samples:
                for role, response in enumerate(self.split(sample.completion, sample.metadata["batch_item"])):
                    role_sample = copy.copy(sample)
                    role_sample.agent_idx = role
                    role_sample.completion = response
                    role_samples.append(role_sample)
            return callback(role_samples)

        return role_metrics


__all__ = ["CentralizedCollaboration"]
