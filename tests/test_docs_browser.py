"""The documentation site as a reader sees it, in a real browser (Debian's Chromium driven by Selenium, found as
tests/test_ui_browser.py finds it).

The site is built as the README says (``mkdocs build --strict``) and served over HTTP on a free loopback port;
the browser opens the front page (its title, the navigation, the Material theme's styles, the search finding a
trainer) and one API page (a module's section rendered from its docstrings, with signatures, a cross-reference
link and a doctest example as code). Screenshots of both pages are saved under the test's tmp directory; with
``COMLRL_DOCS_SCREENSHOTS=DIR`` they are copied there too.
"""

from __future__ import annotations

import functools
import http.server
import threading
from pathlib import Path
from typing import Iterator

import pytest

from test_docs_site import ROOT, mkdocs_build

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

from browser import headless_chromium, kept_screenshots  # skips this module without a browser
from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

PAGE_TIMEOUT = 30  # seconds for a page's scripts (the search index) on a busy 2-core machine
API_PAGE = "reference/comlrl.algorithms/"
API_FUNCTION = "comlrl.algorithms.advantages.group_relative_advantages"


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def site_url(tmp_path_factory) -> Iterator[str]:
    """The strictly built site, served from a temporary directory on a free loopback port."""
    site = tmp_path_factory.mktemp("site")
    built = mkdocs_build(ROOT / "mkdocs.yml", site)
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stderr[-6000:]}"
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def browser():
    with headless_chromium() as driver:
        yield driver


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Iterator[Path]:
    with kept_screenshots(tmp_path_factory.mktemp("screenshots"), "COMLRL_DOCS_SCREENSHOTS") as directory:
        yield directory


def wait_until(driver, condition, what: str):
    try:
        return WebDriverWait(driver, PAGE_TIMEOUT, poll_frequency=0.5).until(lambda d: condition(d))
    except TimeoutException:
        pytest.fail(f"after {PAGE_TIMEOUT} s: {what}\n--- page text ---\n"
                    f"{driver.find_element(By.TAG_NAME, 'body').text[:3000]}")


def save(driver, directory: Path, name: str) -> None:
    assert driver.save_screenshot(str(directory / name))
    assert (directory / name).stat().st_size > 10_000  # a rendered page, not a blank one


def test_the_front_page_renders_with_its_navigation_and_search(site_url, browser, screenshots):
    browser.get(site_url)
    assert browser.title.startswith("CoMLRL")
    heading = browser.find_element(By.CSS_SELECTOR, "article h1")
    assert heading.text.strip() == "CoMLRL"
    article = browser.find_element(By.CSS_SELECTOR, "article").text
    assert "MAGRPOTrainer" in article and "Where to read on" in article
    header = browser.find_element(By.CSS_SELECTOR, "header.md-header")
    assert header.is_displayed()
    assert header.value_of_css_property("background-color") not in ("rgba(0, 0, 0, 0)", "transparent"), \
        "the Material theme's stylesheet did not apply"
    nav = browser.find_element(By.CSS_SELECTOR, "nav.md-nav--primary").get_attribute("textContent")
    for section in ("Getting started", "User guide", "Algorithms", "The pipeline", "API reference"):
        assert section in nav, section
    save(browser, screenshots, "docs-front-page.png")
    search = browser.find_element(By.CSS_SELECTOR, "input.md-search__input")
    if not search.is_displayed():  # a narrow window shows only the search icon
        browser.find_element(By.CSS_SELECTOR, "label.md-header__button[for='__search']").click()
        wait_until(browser, lambda d: search.is_displayed(), "the search box did not open")
    search.click()
    search.send_keys("MAGRPOTrainer")
    wait_until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".md-search-result__item"),
               "the search found nothing for MAGRPOTrainer (the search index did not load?)")
    search.send_keys(Keys.ESCAPE)


def test_an_api_page_renders_the_docstrings(site_url, browser, screenshots):
    browser.get(site_url + API_PAGE)
    assert browser.title.startswith("comlrl.algorithms")
    section = wait_until(browser, lambda d: d.find_element(By.ID, API_FUNCTION), f"no section {API_FUNCTION}")
    assert section.is_displayed()
    text = browser.find_element(By.CSS_SELECTOR, "article").text
    assert "group_relative_advantages(" in text  # the signature
    assert "comlrl.algorithms.losses" in text and "comlrl.algorithms.dpo" in text  # every module of the package
    links = browser.find_elements(By.CSS_SELECTOR, "article a.autorefs-internal")
    assert links, "no cross-reference link was rendered from the docstrings"
    browser.execute_script("arguments[0].scrollIntoView();", section)
    save(browser, screenshots, "docs-api-page.png")
