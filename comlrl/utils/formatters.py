"""Per-agent prompt formatters in the original comlrl calling convention.

Each formatter returned by :func:`build_formatters` is called as
``formatter(item, external_prompts=None)``; the choice of one formatter per agent is made by
:func:`comlrl.data.resolve_formatters`.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Callable

from comlrl.data import resolve_formatters

Formatter = Callable[[dict[str, Any]], str]


def _prompt_or_external(item: dict[str, Any], external_prompts: Any = None) -> Any:
    """The default formatter: ``external_prompts`` if given, else the item's ``prompt`` (or ``""``)."""
    if external_prompts is not None:
        return external_prompts
    return item.get("prompt", "")


def _accepts_external_prompts(formatter: Callable[..., Any]) -> bool:
    try:
        return "external_prompts" in inspect.signature(formatter).parameters
    except (TypeError, ValueError):
        return False


def _adapt(formatter: Callable[..., Any], pass_none_external_prompts: bool) -> Callable[..., Any]:
    """``formatter`` callable as ``f(item, external_prompts=None)``; the user's callable stays reachable."""
    if not _accepts_external_prompts(formatter):
        def adapted(item, external_prompts=None):
            return formatter(item)
    elif pass_none_external_prompts:
        def adapted(item, external_prompts=None):
            return formatter(item, external_prompts=external_prompts)
    else:
        def adapted(item, external_prompts=None):
            if external_prompts is None:
                return formatter(item)
            return formatter(item, external_prompts=external_prompts)
    # The user's formatter (whose state a checkpoint may hold), kept out of inspect.signature's way.
    adapted._comlrl_checkpoint_source = formatter  # type: ignore[attr-defined]
    return adapted


def build_formatters(
    formatters: Formatter | Sequence[Formatter] | None,
    num_agents: int,
    *,
    pass_none_external_prompts: bool = True,
) -> list[Callable[..., str]]:
    """One formatter per agent, each callable as ``formatter(item, external_prompts=None)``.

    ``None`` gives the default (``external_prompts`` if given, else ``item["prompt"]`` or ``""``);
    one callable serves every agent; a sequence must hold ``num_agents`` callables. Formatters
    that declare ``external_prompts`` receive it (when it is ``None`` only if
    ``pass_none_external_prompts``); others are called with the item alone. Anything else
    raises ``ValueError``.
    """
    if formatters is None:
        return [_prompt_or_external for _ in range(num_agents)]
    if not callable(formatters) and (
        isinstance(formatters, (str, bytes)) or not isinstance(formatters, Sequence)
    ):
        raise ValueError("formatters must be None, a callable, or a sequence of callables.")
    chosen = resolve_formatters(formatters, num_agents)
    return [_adapt(formatter, pass_none_external_prompts) for formatter in chosen]


__all__ = ["Formatter", "build_formatters"]
