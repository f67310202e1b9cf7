"""Declarative config fields: every field carries a help text and its valid range.

Trainer configs are dataclasses built from :func:`option`; :class:`ConfigBase` checks
every field at construction, so a bad value fails before any model is loaded, with a
message naming the config class, the field, the value seen and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

INT64_LIMIT = 2**63  # integer fields reach torch, whose integers are int64


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
    aliases: Sequence[str] = (),
    supported: Sequence[Any] | None = None,
    says: str | None = None,
) -> Any:
    """A dataclass field with help text and validation rules.

    ``optional=True`` admits ``None``; ``kind`` is the expected Python type (inferred from
    the default when omitted); ``min``/``max`` bound numbers; ``choices`` lists allowed values.
    ``aliases`` are other keyword names the constructor accepts for this field (the names the
    original comlrl 1.4.3 used); ``supported`` lists the only values implemented so far: any
    other valid value is refused at construction as "not supported yet" (never ignored).
    ``says`` is the original's message for a value outside its rules, where the generic one
    (``<field> must be ...``, named by the first alias) would not contain it; the error starts with it.
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
        "aliases": tuple(aliases),
        "supported": tuple(supported) if supported is not None else None,
        "says": says,
    }
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def not_supported_yet(default: Any, help: str, *, also: Sequence[Any] = (), **rules: Any) -> Any:
    """A field of the original comlrl that is accepted but not implemented: only ``default``
    (and ``also``) construct; any other value raises a ValueError saying it is not supported yet."""
    return option(default, help, supported=(default, *also), **rules)


def _same_value(a: Any, b: Any) -> bool:
    """Equal values of the same sort (True is not 1, "1" is not 1)."""
    if a is None or b is None:
        return a is b
    if isinstance(a, bool) != isinstance(b, bool) or isinstance(a, str) != isinstance(b, str):
        return False
    try:
        return bool(a == b)
    except Exception:
        return False


def _number(value: float) -> str:
    """0.0 -> '0', 0.5 -> '0.5': bounds read as the original comlrl wrote them ('must be > 0')."""
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _broken_rule(meta: dict, value: Any) -> str | None:
    """The rule ``value`` breaks, as '<must be ...>' (None when it keeps them all)."""
    kind = meta["kind"]
    if kind is not None:
        if isinstance(value, bool) and kind in (int, float, (int, float)):
            return "must be a number"
        if not isinstance(value, kind):
            names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            return f"must be of type {names}"
    if meta["choices"] is not None and value not in meta["choices"]:
        return "must be one of: " + ", ".join(repr(choice) for choice in meta["choices"])
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            return "must be finite"
        low, high = meta["min"], meta["max"]
        # The original's wording for a field that also takes None: "must be >= 1 or null".
        or_none = " or null (None)" if meta["optional"] else ""
        if low is not None:
            if meta["min_exclusive"] and value <= low:
                return f"must be > {_number(low)}{or_none}"
            if not meta["min_exclusive"] and value < low:
                return f"must be >= {_number(low)}{or_none}"
        if high is not None and value > high:
            return f"must be <= {_number(high)}{or_none}"
        if isinstance(value, int) and not -INT64_LIMIT <= value < INT64_LIMIT:
            return "must fit in 64 bits (torch's int64: -2**63 to 2**63 - 1)"
    return None


def _allowed_range(meta: dict, name: str) -> str:
    """' (allowed: 0 <= seed <= 4294967295)' for a field bounded on both sides: the whole range, said after
    the value seen."""
    low, high = meta.get("min"), meta.get("max")
    if low is None or high is None:
        return ""
    return f" (allowed: {_number(low)} {'<' if meta['min_exclusive'] else '<='} {name} <= {_number(high)})"


def _check_field(owner: str, field: dataclasses.Field, value: Any) -> str | None:
    meta = field.metadata
    if not meta:
        return None
    where = f"{owner}.{field.name}"
    if value is None:
        return None if meta["optional"] else f"{where} must be set, got None"
    rule = _broken_rule(meta, value)
    if rule is not None:
        bound = rule.startswith(("must be >", "must be <"))
        seen = f"got {value!r}" + (_allowed_range(meta, field.name) if bound else "")
        # Lead with the original comlrl's words, so code that matches its messages still matches.
        if meta.get("says"):
            return f"{meta['says']} ({where} {rule}, {seen})"
        if meta["aliases"]:
            alias = meta["aliases"][0]
            return f"{alias} {rule}, {seen} ({where}, which comlrl 1.4.3 named {alias})"
        return f"{where} {rule}, {seen}"
    supported = meta.get("supported")
    if supported is not None and not any(_same_value(value, ok) for ok in supported):
        allowed = ", ".join(repr(ok) for ok in supported)
        return f"{where}={value!r} is not supported yet (accepted: {allowed}); see docs/migrating.md"
    return None


def _alias_map(cls: type) -> dict[str, str]:
    """alias -> canonical field name of a config class (cached per class)."""
    cached = cls.__dict__.get("_comlrl_alias_map")
    if cached is not None:
        return cached
    names = {f.name for f in dataclasses.fields(cls)}
    mapping: dict[str, str] = {}
    for field in dataclasses.fields(cls):
        for alias in field.metadata.get("aliases", ()) if field.metadata else ():
            if alias in names or alias in mapping:
                raise TypeError(f"{cls.__name__}: alias {alias!r} of {field.name!r} clashes with another field or alias")
            mapping[alias] = field.name
    type.__setattr__(cls, "_comlrl_alias_map", mapping)
    return mapping


class _ConfigMeta(type):
    """Translates alias keywords to their canonical field before the dataclass ``__init__`` runs,
    so ``dataclasses.fields``, ``to_dict`` and ``help`` only ever see the canonical names."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if kwargs and dataclasses.is_dataclass(cls):
            kwargs = _resolve_aliases(cls, kwargs)
        # Which fields the caller chose (keywords or positionally), so a default can be told from a choice;
        # known before __init__ so validate() can ask was_given.
        given = set(kwargs) | {f.name for f in dataclasses.fields(cls)[:len(args)]} if dataclasses.is_dataclass(cls) else set()
        config = cls.__new__(cls)
        object.__setattr__(config, "_given_fields", frozenset(given))
        config.__init__(*args, **kwargs)
        return config


def _resolve_aliases(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    mapping = _alias_map(cls)
    if not mapping or not mapping.keys() & kwargs.keys():
        return kwargs
    fields = {f.name: f for f in dataclasses.fields(cls)}
    resolved = {key: value for key, value in kwargs.items() if key not in mapping}
    given_as: dict[str, str] = {key: key for key in resolved}
    for alias in (key for key in kwargs if key in mapping):
        canonical, value = mapping[alias], kwargs[alias]
        meta = fields[canonical].metadata
        if value is None and not meta.get("optional", True):
            continue  # the original's "unset" for a field that takes no None here: keep our default
        if canonical in resolved:
            if not _same_value(resolved[canonical], value):
                raise ValueError(
                    f"{cls.__name__}: {given_as[canonical]}={resolved[canonical]!r} and {alias}={value!r} disagree; "
                    f"{alias} is another name of {canonical}: give one of them"
                )
            continue
        resolved[canonical] = value
        given_as[canonical] = alias
    return resolved


@dataclasses.dataclass
class ConfigBase(metaclass=_ConfigMeta):
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

    @classmethod
    def with_choices(cls, values: dict[str, Any], given: Any) -> "ConfigBase":
        """A config of ``values`` of which only the fields in ``given`` count as chosen (:meth:`was_given`): how a
        composed trainer passes settings on without turning its defaults into its user's choices."""
        values = _resolve_aliases(cls, dict(values))
        config = cls.__new__(cls)
        object.__setattr__(config, "_given_fields", frozenset(given) & frozenset(values))
        config.__init__(**values)
        return config

    def was_given(self, name: str) -> bool:
        """Whether the constructor received ``name`` (or one of its aliases), rather than taking the default."""
        return name in getattr(self, "_given_fields", ())

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def help(cls) -> dict[str, str]:
        """Field name -> help text, for CLIs and docs (aliases are named in the text)."""
        texts = {}
        for f in dataclasses.fields(cls):
            text = f.metadata.get("help", "")
            aliases = f.metadata.get("aliases", ())
            if aliases:
                text += f" (also accepted as {', '.join(aliases)}: the original comlrl's name)"
            texts[f.name] = text
        return texts
