"""Debian's Chromium driven by Selenium, for the browser tests (the UIs, the documentation site): where the
browser and its driver are, one headless driver, and the screenshots a test keeps.

Importing this module skips the importing test module when the browser, its driver or selenium is missing
(``bash infra/bootstrap.sh test`` installs all three as root).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver") or next(
    (path for path in ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver") if os.path.exists(path)), None)
if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip("no browser: the browser tests need Debian's Chromium and its driver (apt-get install chromium "
                "chromium-driver; bash infra/bootstrap.sh test installs them as root)", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="the browser tests need selenium: pip install -e "
                                                             "'.[browser]'")


@contextlib.contextmanager
def headless_chromium() -> Iterator["webdriver.Chrome"]:
    """A headless Chromium at a fixed 1280x1000 window, quit on exit."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--window-size=1280,1000", "--hide-scrollbars"):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


@contextlib.contextmanager
def kept_screenshots(directory: Path, variable: str) -> Iterator[Path]:
    """``directory`` for a test's screenshots; on exit they are copied to the folder the environment variable
    ``variable`` names, when it is set (made if missing)."""
    yield directory
    if target := os.environ.get(variable):
        Path(target).mkdir(parents=True, exist_ok=True)
        for image in directory.glob("*.png"):
            shutil.copy(image, Path(target) / image.name)
