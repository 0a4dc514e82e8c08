"""The server's tests: the package behind their servers and its Chats (a Probe, one per module: the models load once),
the yardstick Chat, a running server, and a real browser: Debian's Chromium, driven through its chromedriver by
Selenium (no driver or browser download; .ci/run installs both packages), one per test session."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from builder_plugin.runtime import Chat
from tests.support.serving import Probe, Running, running_server

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
# Headless as root, and nothing that reaches for the network on its own (the machines have none: without these flags
# Chromium's background connections fail, many at a time); a fake microphone that plays a beep, granted without asking.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1100,800", "--use-fake-device-for-media-stream",
                  "--use-fake-ui-for-media-stream")


@pytest.fixture(scope="module")
def package(tiny_package) -> Path:
    return tiny_package


@pytest.fixture(scope="module")
def served(tiny_package) -> Probe:
    """The package and Chats behind the module's servers (its gate can hold the worker before an answer)."""
    return Probe(tiny_package)


@pytest.fixture(scope="module")
def chat(tiny_package) -> Chat:
    """The yardstick: a Chat of its own on the same package."""
    return Chat(tiny_package)


@pytest.fixture
def server(served) -> Iterator[Running]:
    served.gate.set()
    served.failure = None
    with running_server(served) as running:
        yield running


@pytest.fixture(scope="session")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    for path in (CHROMIUM, CHROMEDRIVER):
        assert path.exists(), f"{path} is missing: apt-get install chromium chromium-driver (as .ci/run does)"
    folder = tmp_path_factory.mktemp("chromium")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={folder / 'profile'}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console, read by driver.get_log("browser")
    # Chromium's own temporary files go to its folder, not to the session's temp folder (checked empty at the end).
    service = Service(str(CHROMEDRIVER), env={**os.environ, "TMPDIR": str(folder)})
    driver = webdriver.Chrome(service=service, options=options)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
