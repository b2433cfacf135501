"""The browser tests' one way to get headless Chromium: Debian's package driven by Playwright."""

from __future__ import annotations

import os
import shutil

import pytest


def browser_or_skip():
    """``(chromium path, sync_playwright)``; skipped where either is missing, a failure on CI."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if chromium is None or sync_playwright is None:
        why = "no Chromium on PATH" if chromium is None else "the playwright package is not installed"
        if os.environ.get("CI"):
            pytest.fail(f"the browser test must run on CI, but {why} (python3 dev.py installs both)")
        pytest.skip(f"{why}; python3 dev.py installs Debian's chromium and playwright")
    return chromium, sync_playwright
