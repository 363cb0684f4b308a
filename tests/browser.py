"""A real headless Chromium for tests: Debian's `chromium` driven through Debian's `chromedriver`
(package chromium-driver) by selenium. scripts/setup.sh installs both for the test extra; a test
fails (with how to install them) when they are missing. Screenshots go to `artifact_path`."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

INSTALL_HINT = (
    "a headless Chromium is needed: install Debian's chromium and chromium-driver packages "
    "(`apt-get update && apt-get install -y --no-install-recommends chromium chromium-driver`)"
)
ROOT = Path(__file__).resolve().parents[1]


def _binary(*names: str) -> str:
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    pytest.fail(f"{names[0]} not found: {INSTALL_HINT}")


def headless_chromium(width: int = 1280, height: int = 860) -> Any:
    """A selenium Chrome driver over the system's Chromium (no download, no network)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = _binary("chromium", "chromium-browser")
    for arg in (
        "--headless=new",
        "--no-sandbox",  # tests run as root in containers
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--no-first-run",
        f"--window-size={width},{height}",
    ):
        options.add_argument(arg)
    service = Service(executable_path=_binary("chromedriver"))
    return webdriver.Chrome(service=service, options=options)


def artifact_path(name: str) -> Path:
    """Where a test saves `name` for people to look at: $WICK_TEST_ARTIFACTS, else
    test-artifacts/ at the repository root (git-ignored)."""
    folder = Path(os.environ.get("WICK_TEST_ARTIFACTS") or ROOT / "test-artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name
