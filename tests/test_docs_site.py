"""The documentation site is checked like code: it builds with ``mkdocs build --strict`` (a broken link or anchor,
a page outside the nav, a missing snippet or a docstring cross-reference that does not resolve fails the build),
its API reference has every public module of ``comlrl`` and ``flows``, no document links outside the repository,
and the README stays a front page whose commands exist as printed.

The site is built once per session into a temporary directory (seconds). The ``docs`` extra installs MkDocs; the
test job installs it, so a missing MkDocs is a failure here, not a skip."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
REFERENCE = DOCS / "reference"
VENV_BIN = Path(sys.executable).parent
README_MAX_LINES = 150
INSTALL_HINT = ("MkDocs is not installed: the documentation tests need the `docs` extra "
                "(.venv/bin/pip install -e \".[docs]\"; bash infra/bootstrap.sh test installs it)")


class ConfigLoader(yaml.SafeLoader):
    """mkdocs.yml as data: MkDocs' ``!relative`` tag read as its plain argument."""


ConfigLoader.add_constructor("!relative", lambda loader, node: loader.construct_scalar(node))


def mkdocs_config() -> dict:
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=ConfigLoader)


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # the parent of a dotted name is missing
            found = False
        if not found:
            pytest.fail(f"{INSTALL_HINT}; missing module {module}", pytrace=False)
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=config.parent, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The repository's site, built as the README says (``mkdocs build --strict``), into a temporary directory."""
    site = tmp_path_factory.mktemp("site")
    built = mkdocs_build(ROOT / "mkdocs.yml", site)
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stderr[-6000:]}"
    return site


def public_modules() -> list[str]:
    """Every module of the comlrl and flows packages whose dotted name has no part with a leading underscore."""
    found = []
    for path in sorted([*(ROOT / "comlrl").rglob("*.py"), *(ROOT / "flows").rglob("*.py")]):
        parts = path.relative_to(ROOT).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if not any(part.startswith("_") for part in parts):
            found.append(".".join(parts))
    return found


def documented_modules() -> dict[str, list[str]]:
    """Module -> the reference pages whose ``::: module`` line renders it."""
    found: dict[str, list[str]] = {}
    for page in sorted(REFERENCE.glob("*.md")):
        for name in re.findall(r"^::: ([\w.]+)\s*$", page.read_text(), flags=re.M):
            found.setdefault(name, []).append(page.name)
    return found


def nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in nav_pages(value)]
    return [page for item in nav for page in nav_pages(item)]


def documents() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def links(text: str) -> list[str]:
    """The targets of a Markdown document's links and images (inline, reference definitions and HTML), outside
    code blocks and code spans."""
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    found = re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)
    found += re.findall(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", text, flags=re.M)
    found += re.findall(r"(?:href|src)=\"([^\"]+)\"", text)
    return found


# ----- the build ----------------------------------------------------------------------------------------------
def test_the_site_builds_strictly_and_renders_every_page(site):
    config = mkdocs_config()
    assert config["strict"] is True and config["theme"]["name"] == "material"
    pages = nav_pages(config["nav"])
    for page in pages:
        path = Path(page)
        html = site / (path.parent if path.stem == "index" else path.with_suffix("")) / "index.html"
        assert html.is_file(), f"{page} is in the nav but {html.relative_to(site)} was not built"
    on_disk = {str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md")}
    assert on_disk == set(pages), f"pages outside the nav: {sorted(on_disk - set(pages))}"


def test_the_strict_build_fails_on_a_broken_link_anchor_snippet_or_cross_reference(tmp_path):
    """The same configuration on a small site with one of each defect: every one is reported and the build fails."""
    config = mkdocs_config()
    docs = tmp_path / "docs"
    (docs / "_ext").mkdir(parents=True)
    for extension in (DOCS / "_ext").glob("*.py"):
        (docs / "_ext" / extension.name).write_text(extension.read_text())
    (docs / "index.md").write_text("# Home\n\n--8<-- \"README.md:no-such-section\"\n")
    (docs / "api.md").write_text("# API\n\n::: probe_module\n")
    (tmp_path / "README.md").write_text("# A readme without sections\n")
    (tmp_path / "probe_module.py").write_text(textwrap.dedent('''\
        """A module whose docstring refers to [an object][probe_module.not_there] that does not exist."""


        def shown():
            """A documented function that names :func:`vanished` in a Sphinx role."""
    '''))
    config["nav"] = ["index.md", "api.md"]
    [snippets] = [entry for entry in config["markdown_extensions"] if "pymdownx.snippets" in entry]
    snippets["pymdownx.snippets"]["base_path"] = [str(tmp_path)]
    config.pop("site_dir", None)
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    built = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert built.returncode != 0, built.stderr
    assert "Snippet section 'no-such-section' could not be located" in built.stderr, built.stderr  # stops at once
    (docs / "index.md").write_text("# Home\n\n[gone](missing.md) and [no anchor](api.md#nowhere)\n")
    built = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert built.returncode != 0, built.stderr
    log = built.stderr
    assert "missing.md" in log, log
    assert "#nowhere" in log, log
    assert "probe_module.not_there" in log, log
    assert "'vanished'" in log, log


def test_the_listed_unresolved_roles_are_still_in_their_docstrings():
    """mkdocs.yml lists the few Sphinx roles that cannot resolve (rendered as code until fixed); an entry whose
    role is gone from its file is stale and must be removed, so the list only shrinks."""
    config = mkdocs_config()
    options = config["plugins"][2]["mkdocstrings"]["handlers"]["python"]["options"]
    [extension] = [entry for entry in options["extensions"] if isinstance(entry, dict)]
    [(name, settings)] = extension.items()
    assert name == "docs/_ext/docstrings.py:DocstringMarkdown"
    stale = []
    for entry in settings["unresolved"]:
        path, target = (part.strip() for part in entry.split(":", 1))
        if not re.search(rf":[a-z]+:`~?{re.escape(target)}(?:\(\))?`", (ROOT / path).read_text()):
            stale.append(entry)
    assert not stale, f"fixed in the source: remove from mkdocs.yml's `unresolved`: {stale}"


# ----- the API reference ----------------------------------------------------------------------------------------
def test_every_public_module_has_an_api_page(site):
    documented = documented_modules()
    missing = [name for name in public_modules() if name not in documented]
    assert not missing, ("public modules without an API page: add a `::: NAME` line to their package's page in "
                         f"docs/reference/: {missing}")
    twice = {name: pages for name, pages in documented.items() if len(pages) > 1}
    assert not twice, f"documented on more than one page: {twice}"
    unknown = sorted(set(documented) - set(public_modules()))
    assert not unknown, f"reference pages name modules that are not public modules of comlrl or flows: {unknown}"
    rendered = "".join(path.read_text() for path in (site / "reference").rglob("index.html"))
    unrendered = [name for name in public_modules() if f'id="{name}"' not in rendered]
    assert not unrendered, f"no section rendered for: {unrendered}"


def test_every_reference_page_is_listed_on_the_reference_index():
    index = (REFERENCE / "index.md").read_text()
    unlisted = [page.name for page in REFERENCE.glob("*.md") if page.name != "index.md" and f"]({page.name})"
                not in index]
    assert not unlisted, f"docs/reference/index.md does not link: {unlisted}"


# ----- links -----------------------------------------------------------------------------------------------------
def test_no_document_links_outside_the_repository():
    """README.md and docs/: a link is a public http(s) URL, an anchor, or a file of this repository that exists;
    no document names a path above the repository (such as the maintainers' ../shared/)."""
    bad = []
    for document in documents():
        text = document.read_text()
        where = document.relative_to(ROOT)
        if re.search(r"\.\./shared/|(?<![\w.])shared/spec/", text):
            bad.append(f"{where}: names a file outside the repository (../shared/...)")
        for target in links(text):
            url = urlparse(target)
            if url.scheme in ("http", "https"):
                host = url.hostname or ""
                if host in ("localhost", "127.0.0.1", "0.0.0.0") or host.endswith(".local") or "." not in host:
                    bad.append(f"{where}: {target} is not a public URL")
                continue
            if url.scheme or target.startswith(("/", "~")):
                bad.append(f"{where}: {target} is neither a public URL nor a relative path")
                continue
            if not url.path:  # an anchor on the same page
                continue
            path = (document.parent / url.path).resolve()
            if not path.is_relative_to(ROOT):
                bad.append(f"{where}: {target} points outside the repository")
            elif not path.exists():
                bad.append(f"{where}: {target} does not exist")
            elif document.is_relative_to(DOCS) and not path.is_relative_to(DOCS):
                bad.append(f"{where}: {target} leaves docs/, so the site cannot follow it: name the file as code")
    assert not bad, "\n".join(bad)


def test_the_link_check_sees_what_it_should():
    """The extraction itself: links in prose are found; code is not prose."""
    text = "see [a](../shared/spec/x.md) and ![img](img/a.png)\n\n```md\n[b](nowhere.md)\n```\n`[c](x.md)`\n"
    assert links(text) == ["../shared/spec/x.md", "img/a.png"]
    assert links('<img src="img/b.png">\n[ref]: https://example.org/x\n') == ["https://example.org/x", "img/b.png"]


# ----- the README as a front page --------------------------------------------------------------------------------
def readme_commands() -> list[str]:
    text = README.read_text()
    commands = []
    for block in re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line:
                commands.append(line)
    return commands


def test_the_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, f"README.md has {len(text.splitlines())} lines"
    for command in ("bash infra/bootstrap.sh demo", "bash infra/bootstrap.sh test", "bash infra/bootstrap.sh test -m e2e",
                    ".venv/bin/mkdocs build --strict", ".venv/bin/mkdocs serve"):
        assert command in readme_commands(), f"the README does not print `{command}`"
    for verb in ("run", "resume", "promote", "serve"):
        assert any(c.startswith(f".venv/bin/comlrl {verb} ") for c in readme_commands()), verb
    assert any(" ui " in c for c in readme_commands()), "the README's pipeline lines open no UI"
    assert "<!-- --8<-- [start:first-script] -->" in text  # docs/getting-started.md includes the first script
    linked = {target.split("#")[0] for target in links(text)}
    for page in ("docs/index.md", "docs/getting-started.md", "docs/pipeline.md", "docs/reference/index.md"):
        assert page in linked, f"the README does not link {page}"


def test_the_readme_commands_exist_as_printed():
    """Each program a README command calls is where the line says: the bootstrap script and its jobs, the venv's
    executables (the docs tools included: the test job installs the `docs` extra), and the files they are given."""
    bootstrap = (ROOT / "infra" / "bootstrap.sh").read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    problems = []
    for command in readme_commands():
        words = command.split()
        if words[:2] == ["bash", "infra/bootstrap.sh"]:
            if not re.search(rf"^\s*{re.escape(words[2])}\)", bootstrap, flags=re.M):
                problems.append(f"{command}: bootstrap.sh has no job {words[2]!r}")
            continue
        assert words[0].startswith(".venv/bin/"), f"{command}: call the venv's executable by path"
        executable = VENV_BIN / words[0].removeprefix(".venv/bin/")
        if not executable.exists():
            problems.append(f"{command}: {executable} does not exist")
        for word in words[1:]:
            if re.fullmatch(r"[\w./-]+\.(?:ya?ml|py)", word) and not (ROOT / word).is_file():
                problems.append(f"{command}: {word} does not exist")
        if words[1:3] == ["install", "-e"]:
            wanted = re.fullmatch(r'"?\.\[([\w,-]+)\]"?', words[3]).group(1).split(",")
            problems += [f"{command}: no extra {extra!r} in pyproject.toml" for extra in wanted if extra not in extras]
    assert not problems, "\n".join(problems)
    assert {"mkdocs", "mkdocs-material", "mkdocstrings"} <= {re.split(r"[\[<>=!~ ]", requirement)[0]
                                                          for requirement in extras["docs"]}
    assert re.search(r'EXTRAS\+=",docs"', bootstrap), "the test job does not install the docs extra"


def test_the_getting_started_page_shows_the_readme_first_script(site):
    html = (site / "getting-started" / "index.html").read_text()
    assert "MAGRPOTrainer" in html and "reward_func" in html and "--8&lt;--" not in html
