"""A Griffe extension for the API reference (mkdocs.yml): the library's docstrings as mkdocstrings renders them.

The docstrings are reStructuredText-flavoured prose: no Google/NumPy sections, ``>>>`` examples in the doctest
form, and Sphinx roles (``:class:`~comlrl.errors.CheckpointError```) for references to other objects. Before
mkdocstrings renders a docstring (the Python files are not changed):

- each doctest example, from its first ``>>>`` line to the next blank line, is fenced as a ``pycon`` code block
  (Markdown would read it as a paragraph, and an output such as ``['1\\n', '2\\n']`` after a line ending in ``]``
  as a reference link);
- each Sphinx role becomes a cross-reference, ``[`CheckpointError`][comlrl.errors.CheckpointError]``, resolved
  as Python resolves the name from the docstring's object (``scoped_crossrefs``). One that does not resolve
  fails the strict build, except the ones listed in mkdocs.yml under ``unresolved`` (``FILE: TARGET``), which
  render as code until their docstrings are corrected (tests/test_docs_site.py checks that each is still there).
"""

from __future__ import annotations

import re
from pathlib import Path

import griffe

ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):`(?P<tilde>~?)(?P<target>[\w.]+)(?:\(\))?`")
EXAMPLE = re.compile(r"^(?P<indent>[ \t]*)>>> .*?(?=\n[ \t]*\n|\Z)", flags=re.S | re.M)


def fence_examples(text: str) -> str:
    def fence(match: re.Match) -> str:
        indent = match.group("indent")
        return f"{indent}```pycon\n{match.group(0)}\n{indent}```"
    return EXAMPLE.sub(fence, text)


def cross_references(text: str, unresolved: frozenset[str] = frozenset()) -> str:
    """Sphinx roles as mkdocstrings cross-references; a target in ``unresolved`` as code."""
    def reference(match: re.Match) -> str:
        target = match.group("target")
        title = target.rsplit(".", 1)[-1] if match.group("tilde") else target
        return f"`{title}`" if target in unresolved else f"[`{title}`][{target}]"
    return ROLE.sub(reference, text)


class DocstringMarkdown(griffe.Extension):
    def __init__(self, unresolved: list[str] | None = None) -> None:
        self.unresolved: dict[str, frozenset[str]] = {}
        for entry in unresolved or []:
            path, target = (part.strip() for part in entry.split(":", 1))
            self.unresolved[path] = self.unresolved.get(path, frozenset()) | {target}

    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is None:
            return
        root = Path(obj.package.filepath).parent.parent  # the directory that holds the top-level package
        path = Path(obj.filepath).relative_to(root).as_posix() if isinstance(obj.filepath, Path) else ""
        obj.docstring.value = cross_references(fence_examples(obj.docstring.value),
                                               self.unresolved.get(path, frozenset()))
