"""Centralized collaboration: one model writes every role's response in one joint completion.

A collaboration adapter owns the joint completion's format. ``build_prompt(row, role_prompts)``
writes the joint prompt from the roles' own prompts (what the decentralized formatters give each
agent); ``parse_completion(completion)`` splits a joint completion back into one response per
role; ``format_completion(responses)`` writes responses in the format (the inverse of parsing).
A completion that does not split raises :class:`CollaborationParseError`, which carries what
could still be read (the roles found exactly once; ``""`` for the others), so a trainer can
choose its policy (:func:`split_completions`).

Two formats: :class:`TaggedCollaboration` (the default, ``<agent_0>...</agent_0>``) and
:class:`SeparatedCollaboration` (sections in role order, joined by a separator string). The
method names and arguments are those of comlrl 1.4.3's centralized adapters, so an adapter
written for it plugs in through :func:`as_adapter`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

ROLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
# Any tag-shaped markup: <name>, </name>, with optional spaces inside the brackets.
TAG = re.compile(r"<\s*(/?)\s*([A-Za-z_][A-Za-z0-9_.-]*)\s*>")
FORMATS = ("tagged", "separated")
PARSE_FAILURE_POLICIES = ("partial", "empty", "raise")


class CollaborationParseError(ValueError):
    """A joint completion that does not split into one response per role.

    ``responses`` holds what could be read: each role found exactly once and cleanly keeps its
    text, every other role is ``""``. ``None``: nothing could be read (comlrl 1.4.3's adapters
    raise this error, its ``CentralizedComparatorParseError``, with a message alone).
    """

    def __init__(self, message: str, responses: Sequence[str] | None = None) -> None:
        super().__init__(message)
        self.responses = list(responses) if responses is not None else None


def _excerpt(text: str, limit: int = 120) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


@dataclass(frozen=True)
class CollaborationAdapter:
    """Roles and their names; subclasses define the format (:meth:`parse_completion`, :meth:`format_completion`).

    ``role_names`` (default ``agent_0``, ``agent_1``, ...) name the roles in the prompt and in the
    format; they must be distinct (ignoring case) and look like identifiers.
    """

    num_roles: int
    role_names: tuple[str, ...] | None = None
    format_name = ""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if isinstance(self.num_roles, bool) or not isinstance(self.num_roles, int) or self.num_roles < 1:
            raise ValueError(f"{owner}.num_roles must be a positive integer, got {self.num_roles!r}")
        if self.role_names is None:
            return
        names = tuple(self.role_names)
        object.__setattr__(self, "role_names", names)
        if len(names) != self.num_roles:
            raise ValueError(f"{owner}.role_names has {len(names)} names {list(names)} for {self.num_roles} roles")
        bad = [name for name in names if not isinstance(name, str) or not ROLE_NAME.fullmatch(name)]
        if bad:
            raise ValueError(f"{owner}.role_names: {bad[0]!r} is not a valid role name (letters, digits, '_', '.', '-'; "
                             "not starting with a digit)")
        lowered = [name.lower() for name in names]
        if len(set(lowered)) != len(lowered):
            raise ValueError(f"{owner}.role_names must be distinct (ignoring case), got {list(names)}")

    @property
    def names(self) -> tuple[str, ...]:
        return self.role_names or tuple(f"agent_{index}" for index in range(self.num_roles))

    def describe(self) -> dict[str, Any]:
        """What a checkpoint records: the same description means the same joint format."""
        return {"format": self.format_name, "roles": list(self.names)}

    # ----- the joint prompt ------------------------------------------------------------------
    def build_prompt(self, row: Any, role_prompts: Sequence[str]) -> str:
        """One prompt asking for every role's response: each role's task, then the answer format."""
        del row  # the built-in formats need only the role prompts; custom adapters may read the row
        self._check_count(role_prompts, "role_prompts")
        tasks = "\n\n".join(f"{name}: {prompt}" for name, prompt in zip(self.names, role_prompts))
        return (f"Write the responses of {self.num_roles} roles in one reply. Each role has its own task.\n\n"
                f"{tasks}\n\n{self.answer_instructions()}\n")

    def answer_instructions(self) -> str:
        raise NotImplementedError

    # ----- the joint completion --------------------------------------------------------------
    def parse_completion(self, completion: str, row: Any = None, num_roles: int | None = None) -> list[str]:
        """One response per role, in role order; raises :class:`CollaborationParseError`."""
        raise NotImplementedError

    def format_completion(self, responses: Sequence[str]) -> str:
        """The joint completion that :meth:`parse_completion` reads back as ``responses``."""
        raise NotImplementedError

    def _check_count(self, values: Sequence[Any], what: str) -> None:
        if isinstance(values, str) or len(values) != self.num_roles:
            raise ValueError(f"{type(self).__name__}: {what} must hold one entry per role ({self.num_roles}: "
                             f"{list(self.names)}), got {values!r:.200}")

    def _check_num_roles(self, num_roles: int | None) -> None:
        if num_roles is not None and num_roles != self.num_roles:
            raise ValueError(f"{type(self).__name__} parses {self.num_roles} roles, asked for {num_roles}")

    def _failure(self, completion: str, problems: list[str], responses: list[str]) -> CollaborationParseError:
        return CollaborationParseError(
            f"joint completion does not split into the {self.num_roles} roles {list(self.names)} "
            f"({self.format_name} format): {'; '.join(problems)}; completion: {_excerpt(completion)}",
            responses,
        )


@dataclass(frozen=True)
class TaggedCollaboration(CollaborationAdapter):
    """Each role's response between its tags: ``<agent_0>...</agent_0><agent_1>...</agent_1>``.

    Parsing: sections may come in any order, text outside them is ignored, tags match ignoring
    case and spaces inside the brackets, and a response is its section's text stripped of
    surrounding whitespace. Inside a section, tags that are not role tags are content (HTML in
    an answer). It fails on a missing section, a duplicated one, an unclosed or stray tag, a role
    tag inside another role's section, or a tag outside the sections that names no role.
    """

    format_name = "tagged"

    def answer_instructions(self) -> str:
        layout = "\n".join(f"<{name}>\nresponse of {name}\n</{name}>" for name in self.names)
        return f"Put each role's response between its tags, each role exactly once:\n{layout}"

    def format_completion(self, responses: Sequence[str]) -> str:
        self._check_count(responses, "responses")
        return "\n".join(f"<{name}>\n{text}\n</{name}>" for name, text in zip(self.names, responses))

    def parse_completion(self, completion: str, row: Any = None, num_roles: int | None = None) -> list[str]:
        self._check_num_roles(num_roles)
        completion = str(completion)
        index = {name.lower(): role for role, name in enumerate(self.names)}
        sections: dict[int, list[tuple[int, int]]] = {}
        spoiled: set[int] = set()
        problems: list[str] = []
        open_role, open_at = None, 0
        for match in TAG.finditer(completion):
            closing, role = match.group(1) == "/", index.get(match.group(2).lower())
            if open_role is not None:
                if role is None:
                    continue  # markup inside a response
                if closing and role == open_role:
                    sections.setdefault(role, []).append((open_at, match.start()))
                    open_role = None
                    continue
                problems.append(f"{match.group(0)} inside the section of {self.names[open_role]} "
                                f"(close </{self.names[open_role]}> first)")
                spoiled.update({role, open_role})
            elif role is None:
                problems.append(f"unknown role tag {match.group(0)} (roles: {', '.join(self.names)})")
            elif closing:
                problems.append(f"{match.group(0)} without its opening <{self.names[role]}>")
                spoiled.add(role)
            else:
                open_role, open_at = role, match.end()
        if open_role is not None:
            problems.append(f"<{self.names[open_role]}> is never closed")
            spoiled.add(open_role)
        for role, found in sorted(sections.items()):
            if len(found) > 1:
                problems.append(f"duplicated section <{self.names[role]}> ({len(found)} times)")
                spoiled.add(role)
        missing = [self.names[role] for role in range(self.num_roles) if role not in sections and role not in spoiled]
        if missing:
            problems.append("missing section(s) " + ", ".join(f"<{name}>...</{name}>" for name in missing))
        responses = ["" if role in spoiled or role not in sections else
                     completion[sections[role][0][0]:sections[role][0][1]].strip() for role in range(self.num_roles)]
        if problems:
            raise self._failure(completion, problems, responses)
        return responses


@dataclass(frozen=True)
class SeparatedCollaboration(CollaborationAdapter):
    """The responses in role order, separated by ``separator``: ``r_0 <sep> r_1 <sep> ... r_{n-1}``.

    Parsing splits on every occurrence of the separator and strips each section; it fails unless
    there are exactly ``num_roles`` sections (a response may not contain the separator). When it
    fails, the first sections still fill the roles in order (missing roles ``""``, extra sections
    dropped).
    """

    separator: str = "\n===\n"
    format_name = "separated"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.separator, str) or not self.separator.strip():
            raise ValueError(f"{type(self).__name__}.separator must be a string with a visible character, "
                             f"got {self.separator!r}")

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "separator": self.separator}

    def answer_instructions(self) -> str:
        return (f"Write the responses in role order ({', '.join(self.names)}), separating each from the next "
                f"with {self.separator.strip()}")

    def format_completion(self, responses: Sequence[str]) -> str:
        self._check_count(responses, "responses")
        return self.separator.join(responses)

    def parse_completion(self, completion: str, row: Any = None, num_roles: int | None = None) -> list[str]:
        self._check_num_roles(num_roles)
        completion = str(completion)
        sections = [section.strip() for section in completion.split(self.separator)]
        responses = (sections + [""] * self.num_roles)[:self.num_roles]
        if len(sections) < self.num_roles:
            missing = ", ".join(self.names[len(sections):])
            raise self._failure(completion, [f"missing role(s) {missing}: {len(sections)} section(s) for "
                                             f"{self.num_roles} roles, separated by {self.separator!r}"], responses)
        if len(sections) > self.num_roles:
            raise self._failure(completion, [f"{len(sections) - self.num_roles} section(s) beyond the last role "
                                             f"{self.names[-1]} (the separator {self.separator!r} appears "
                                             f"{len(sections) - 1} times)"], responses)
        return responses


@dataclass(frozen=True)
class ProtocolAdapter(CollaborationAdapter):
    """A comlrl 1.4.3 adapter (``build_prompt(batch_item, agent_prompts)``, ``parse_completion(completion,
    batch_item, num_agents)``): its parse errors (ValueErrors) become :class:`CollaborationParseError`
    with every response ``""`` (one that carries the readable responses is kept), and its outputs are checked."""

    adapter: Any = None
    format_name = "custom"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "format": f"custom:{type(self.adapter).__qualname__}"}

    def build_prompt(self, row: Any, role_prompts: Sequence[str]) -> str:
        prompt = self.adapter.build_prompt(row, list(role_prompts))
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{type(self.adapter).__qualname__}.build_prompt must return a non-empty string, "
                             f"got {prompt!r:.200}")
        return prompt

    def parse_completion(self, completion: str, row: Any = None, num_roles: int | None = None) -> list[str]:
        self._check_num_roles(num_roles)
        name = type(self.adapter).__qualname__
        try:
            outputs = self.adapter.parse_completion(completion, row, self.num_roles)
        except ValueError as error:
            if isinstance(error, CollaborationParseError) and error.responses is not None:
                raise
            raise self._failure(completion, [f"{name}.parse_completion raised {type(error).__name__}: {error}"],
                                [""] * self.num_roles) from error
        outputs = [outputs] if isinstance(outputs, (str, bytes)) else list(outputs)
        if len(outputs) != self.num_roles or not all(isinstance(output, str) for output in outputs):
            raise TypeError(f"{name}.parse_completion must return {self.num_roles} strings, got {outputs!r:.200}")
        return outputs


def build_adapter(num_roles: int, collaboration_format: str = "tagged", role_names: Sequence[str] | None = None,
                  separator: str = "\n===\n") -> CollaborationAdapter:
    """The built-in adapter a config names (``collaboration_format`` one of :data:`FORMATS`)."""
    names = tuple(role_names) if role_names is not None else None
    if collaboration_format == "tagged":
        return TaggedCollaboration(num_roles, names)
    if collaboration_format == "separated":
        return SeparatedCollaboration(num_roles, names, separator)
    raise ValueError(f"collaboration_format must be one of {list(FORMATS)}, got {collaboration_format!r}")


def as_adapter(adapter: Any, num_roles: int) -> CollaborationAdapter:
    """``adapter`` as a :class:`CollaborationAdapter` for ``num_roles`` roles (a 1.4.3 adapter is wrapped)."""
    if isinstance(adapter, CollaborationAdapter):
        if adapter.num_roles != num_roles:
            raise ValueError(f"the collaboration adapter has {adapter.num_roles} roles but the config has "
                             f"num_agents={num_roles} roles")
        return adapter
    missing = [name for name in ("build_prompt", "parse_completion") if not callable(getattr(adapter, name, None))]
    if missing:
        raise TypeError(f"a collaboration adapter needs build_prompt and parse_completion methods; "
                        f"{type(adapter).__qualname__} lacks {missing}")
    return ProtocolAdapter(num_roles, adapter=adapter)


def split_completions(adapter: CollaborationAdapter, completions: Sequence[str], rows: Sequence[Any],
                      on_failure: str = "partial") -> tuple[list[list[str]], list[bool]]:
    """``([role][sample] responses, [sample] failed)`` for joint completions and their dataset rows.

    A completion that does not parse contributes, with ``on_failure="partial"``, what could be read
    (:attr:`CollaborationParseError.responses`: ``""`` for the unreadable roles); with ``"empty"``,
    ``""`` for every role; with ``"raise"`` the error propagates.
    """
    if on_failure not in PARSE_FAILURE_POLICIES:
        raise ValueError(f"on_failure must be one of {list(PARSE_FAILURE_POLICIES)}, got {on_failure!r}")
    if len(rows) != len(completions):
        raise ValueError(f"{len(completions)} completions but {len(rows)} rows")
    per_role: list[list[str]] = [[] for _ in range(adapter.num_roles)]
    failed = []
    for completion, row in zip(completions, rows):
        try:
            responses = adapter.parse_completion(completion, row, adapter.num_roles)
            failed.append(False)
        except CollaborationParseError as error:
            if on_failure == "raise":
                raise
            readable = error.responses if on_failure == "partial" else None
            responses = readable if readable is not None else [""] * adapter.num_roles
            failed.append(True)
        for role, response in enumerate(responses):
            per_role[role].append(response)
    return per_role, failed


def role_samples_callback(adapter: CollaborationAdapter, callback: Callable[[list[Any]], Any],
                          on_failure: str = "partial") -> Callable[[list[Any]], Any]:
    """``metrics_callback`` seeing one sample per role (``agent_idx`` the role, ``completion`` its
    response, read as :func:`split_completions` reads it) where the trainer has one joint sample."""

    def per_role(samples: list[Any]) -> Any:
        expanded = []
        for sample in samples:
            responses, _ = split_completions(adapter, [sample.completion], [sample.metadata.get("batch_item")],
                                             on_failure)
            expanded.extend(dataclasses.replace(sample, agent_idx=role, completion=texts[0])
                            for role, texts in enumerate(responses))
        return callback(expanded)

    return per_role


def role_eval_logger(adapter: CollaborationAdapter, eval_logger: Callable[..., Any],
                     on_failure: str = "partial") -> Callable[..., Any]:
    """``eval_logger`` receiving ``agent_completions_turns`` per role (``[role][row][turn]``), as from
    decentralized agents, where the trainer has one joint completion per row and turn."""

    def per_role(*, agent_completions_turns: list[list[list[str]]], batch_items: list[Any], **kwargs: Any) -> Any:
        joint = agent_completions_turns[0]
        roles: list[list[list[str]]] = [[[] for _ in joint] for _ in range(adapter.num_roles)]
        for row, (turns, item) in enumerate(zip(joint, batch_items)):
            responses, _ = split_completions(adapter, turns, [item] * len(turns), on_failure)
            for role in range(adapter.num_roles):
                roles[role][row] = responses[role]
        return eval_logger(agent_completions_turns=roles, batch_items=batch_items, **kwargs)

    return per_role
