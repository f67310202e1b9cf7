"""Reading a run spec's YAML: safe tags only, no duplicate keys, a bounded size after aliases.

``yaml.safe_load`` alone keeps the last of two equal keys and expands anchors and aliases
without limit (a few hundred bytes of nested aliases stand for billions of nodes). Here the
file is first composed into PyYAML's node graph, in which an alias is a reference to its
anchor's node, so nothing is expanded yet. One walk over that graph, remembering each node's
expanded size, then finds every duplicate key (with its path and line) and the size the
document would have once expanded; only a document within :data:`MAX_EXPANDED_NODES` is
constructed into Python data.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_SPEC_BYTES = 1_000_000
MAX_EXPANDED_NODES = 100_000  # a spec has a few hundred; dataset kwargs may add some thousands


class SpecYAMLError(ValueError):
    """A spec file that is not valid YAML for a run spec; ``problems`` lists ``(path, message)``."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{path}: {message}" if path else message for path, message in problems))


class _Walk:
    """Expanded sizes of the nodes (memoised by identity, so shared aliases cost one visit) and
    the duplicate keys of every mapping."""

    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}
        self.open: set[int] = set()
        self.duplicates: list[tuple[str, str]] = []

    def size(self, node: yaml.Node, path: str) -> int:
        key = id(node)
        if key in self.sizes:
            return self.sizes[key]
        if key in self.open:
            raise SpecYAMLError([(path, f"line {node.start_mark.line + 1}: an alias refers to a node that contains it")])
        self.open.add(key)
        total = 1
        if isinstance(node, yaml.MappingNode):
            self.check_duplicates(node, path)
            for key_node, value_node in node.value:
                name = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
                total += self.size(key_node, path) + self.size(value_node, f"{path}.{name}" if path else str(name))
                self.check_limit(total, path, node)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                total += self.size(item, f"{path}[{index}]")
                self.check_limit(total, path, node)
        self.open.discard(key)
        self.sizes[key] = total
        return total

    @staticmethod
    def check_limit(total: int, path: str, node: yaml.Node) -> None:
        if total > MAX_EXPANDED_NODES:
            raise SpecYAMLError([(path, f"line {node.start_mark.line + 1}: the document expands to more than "
                                        f"{MAX_EXPANDED_NODES} nodes once its anchors and aliases are expanded; "
                                        "a run spec is refused beyond that size")])

    def check_duplicates(self, node: yaml.MappingNode, path: str) -> None:
        first_line: dict[tuple[str, str], int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue  # merge keys (<<) may be overridden by explicit ones, as YAML defines
            identity = (key_node.tag, key_node.value)
            line = key_node.start_mark.line + 1
            if identity in first_line:
                where = f"{path}.{key_node.value}" if path else key_node.value
                self.duplicates.append((where, f"duplicate key {key_node.value!r} at line {line} "
                                               f"(first at line {first_line[identity]}); keep one of them"))
            else:
                first_line[identity] = line


def read_spec_yaml(text: str) -> Any:
    """The data of one YAML document, or :class:`SpecYAMLError` naming every duplicate key,
    an oversized expansion, or the YAML error."""
    if len(text.encode()) > MAX_SPEC_BYTES:
        raise SpecYAMLError([("", f"the file has {len(text.encode())} bytes; a run spec is at most {MAX_SPEC_BYTES}")])
    loader = None
    try:
        loader = yaml.SafeLoader(text)  # the reader refuses unprintable characters here
        node = loader.get_single_node()
        if node is None:
            return None
        walk = _Walk()
        walk.size(node, "")
        if walk.duplicates:
            raise SpecYAMLError(walk.duplicates)
        return loader.construct_document(node)
    except yaml.YAMLError as error:
        raise SpecYAMLError([("", f"not valid YAML: {error}")]) from None
    except RecursionError:
        raise SpecYAMLError([("", "not valid YAML: nested too deeply")]) from None
    finally:
        if loader is not None:
            loader.dispose()
