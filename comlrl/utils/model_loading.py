"""Model-source helpers of the original comlrl API (names and the ``model``/``agents`` rule)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from comlrl.models.entities import infer_model_name


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def resolve_model_sources(
    *,
    kind: str,
    model: Any | None,
    models: Sequence[Any] | None,
    expected_count: int,
    expected_label: str | None = None,
    model_label: str = "model",
) -> tuple[list[Any], str | None]:
    """Merge a shared ``model`` and a per-role list ``models`` into ``expected_count`` sources.

    Returns the sources and the name of the first (:func:`infer_model_name`). Both may be
    given only if ``models`` is a list of ``expected_count`` whose names all equal ``model``'s.
    ``kind``/``model_label`` name the two arguments and ``expected_label`` the expected count
    in the ``ValueError`` raised for a conflict, a wrong length, a missing or ``None`` source.
    """
    label = expected_label or f"num_agents ({expected_count})"
    if model is not None and models is not None:
        if not _is_list(models):
            raise ValueError(
                f"Cannot provide both {model_label} and {kind} unless {kind} is a list of {label} model names."
            )
        if len(models) != expected_count:
            raise ValueError(f"{kind} length ({len(models)}) must match {label}.")
        shared = infer_model_name(model)
        names = [infer_model_name(source) for source in models]
        if shared is None or None in names:
            raise ValueError(
                f"Cannot verify consistency between {model_label} and {kind}; provide model names or omit one."
            )
        if any(name != shared for name in names):
            raise ValueError(f"{model_label} and {kind} conflict: {shared} != {names}.")
    if model is None and models is None:
        raise ValueError(f"Either {model_label} or {kind} must be provided.")
    if expected_count < 1:
        raise ValueError("expected_count must be >= 1.")
    if models is None:
        sources = [model] * expected_count
    else:
        if not _is_list(models):
            raise ValueError(f"{kind} must be a non-empty sequence.")
        sources = list(models)
        if len(sources) != expected_count:
            raise ValueError(f"{kind} length ({len(sources)}) must match {label}.")
    if any(source is None for source in sources):
        raise ValueError(f"{kind} entries must be non-null.")
    return sources, infer_model_name(sources[0])


__all__ = ["infer_model_name", "resolve_model_sources"]
