"""A real browser for the chat page's tests: Debian's Chromium driven through its chromedriver by Selenium
(nothing downloaded: Selenium Manager is never asked), headless, a fresh profile per module; screenshots go to
tests/e2e/screenshots/ (git-ignored) so a person can look at each state."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
SCREENSHOTS = Path(__file__).parent / "screenshots"
CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
    "--window-size=1200,900",
)
WAIT_S = 120.0


def missing_browser() -> str | None:
    """Why the browser cannot run here (the README's set-up installs it), or None."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not path.exists():
            return f"{path} is missing: apt-get install -y chromium chromium-driver"
    return None


class Browser:
    def __init__(self, profile: Path, shots: str) -> None:
        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for flag in CHROMIUM_FLAGS:
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={profile}")
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # CSP violations land in the console
        self.driver = webdriver.Chrome(options=options, service=Service(executable_path=str(CHROMEDRIVER)))
        self.shots = SCREENSHOTS / shots
        shutil.rmtree(self.shots, ignore_errors=True)
        self.shots.mkdir(parents=True, exist_ok=True)
        self.count = 0

    def quit(self) -> None:
        self.driver.quit()

    def shot(self, state: str) -> Path:
        self.count += 1
        path = self.shots / f"{self.count:02d}-{state}.png"
        self.driver.save_screenshot(str(path))
        return path

    def console(self) -> list[str]:
        """The console's messages since the last call."""
        return [entry["message"] for entry in self.driver.get_log("browser")]

    def by_id(self, element_id: str) -> WebElement:
        return self.driver.find_element(By.ID, element_id)

    def css(self, selector: str) -> list[WebElement]:
        return self.driver.find_elements(By.CSS_SELECTOR, selector)

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def until(self, check: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
        # The list is drawn again under the test's feet: an element gone stale is looked up again.
        return WebDriverWait(
            self.driver, timeout, poll_frequency=0.1, ignored_exceptions=(StaleElementReferenceException,)
        ).until(lambda _: check(), message=f"waited {timeout} s for {what}")
