"""Declarative config fields: every field carries a help text and its valid range.

Trainer configs are dataclasses built from :func:`option`; :class:`ConfigBase` checks
every field at construction, so a bad value fails before any model is loaded, with a
message naming the config class, the field, the value seen and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence


def option(
    default: Any,
    help: str,
    *,
    min: float | None = None,
    max: float | None = None,
    min_exclusive: bool = False,
    choices: Sequence[Any] | None = None,
    optional: bool = False,
    kind: type | tuple[type, ...] | None = None,
) -> Any:
    """A dataclass field with help text and validation rules.

    ``optional=True`` admits ``None``; ``kind`` is the expected Python type (inferred from
    the default when omitted); ``min``/``max`` bound numbers; ``choices`` lists allowed values.
    """
    if kind is None and default is not None and not isinstance(default, (list, dict)):
        kind = (int, float) if isinstance(default, float) else type(default)
    metadata = {
        "help": help,
        "min": min,
        "max": max,
        "min_exclusive": min_exclusive,
        "choices": tuple(choices) if choices is not None else None,
        "optional": optional or default is None,
        "kind": kind,
    }
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _check_field(owner: str, field: dataclasses.Field, value: Any) -> str | None:
    meta = field.metadata
    if not meta:
        return None
    where = f"{owner}.{field.name}"
    if value is None:
        return None if meta["optional"] else f"{where} must be set, got None"
    kind = meta["kind"]
    if kind is not None:
        if isinstance(value, bool) and kind in (int, float, (int, float)):
            return f"{where} must be a number, got {value!r}"
        if not isinstance(value, kind):
            names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            return f"{where} must be of type {names}, got {value!r} ({type(value).__name__})"
    if meta["choices"] is not None and value not in meta["choices"]:
        return f"{where} must be one of {list(meta['choices'])}, got {value!r}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            return f"{where} must be finite, got {value!r}"
        low, high = meta["min"], meta["max"]
        if low is not None:
            if meta["min_exclusive"] and value <= low:
                return f"{where} must be > {low}, got {value!r}"
            if not meta["min_exclusive"] and value < low:
                return f"{where} must be >= {low}, got {value!r}"
        if high is not None and value > high:
            return f"{where} must be <= {high}, got {value!r}"
    return None


@dataclasses.dataclass
class ConfigBase:
    """Validates every :func:`option` field, then calls :meth:`validate` for cross-field rules."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        problems = [
            problem
            for field in dataclasses.fields(self)
            if (problem := _check_field(owner, field, getattr(self, field.name)))
        ]
        if not problems:
            problems = self.validate()
        if problems:
            raise ValueError("; ".join(problems))

    def validate(self) -> list[str]:
        """Cross-field rules; return the list of problems (empty when valid)."""
        return []

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def help(cls) -> dict[str, str]:
        """Field name -> help text, for CLIs and docs."""
        return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)}
