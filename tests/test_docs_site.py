"""The documentation site: built as ``python3 dev.py docs`` builds it, opened in a real browser.

The site is built once (Sphinx with warnings as errors and nitpicky references, about half a minute), served
on 127.0.0.1, and Debian's Chromium (driven by Playwright, as in ``test_dashboards_live.py``) opens the home
page, an API page and the troubleshooting page: each renders, and no image on them is broken. Every internal
link of every page, anchors included, is followed. Without Sphinx the site tests are skipped; without a
browser the browser test is skipped (and fails on CI, where ``python3 dev.py`` installs one).
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import subprocess
import sys
import threading
import urllib.parse
from pathlib import Path

import pytest
from browser import browser_or_skip

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "3", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def test_every_face_of_the_public_api_test_is_checked_by_the_build():
    pytest.importorskip("sphinx")
    import lsc_docs
    from test_public_api import EXTENSION, FACES

    conf = (ROOT / "docs" / "conf.py").read_text()
    extra = re.search(r"lsc_extra_faces = (\[.*?\])", conf, re.S).group(1)
    assert {*lsc_docs.package_faces(), *eval(extra)} == {*FACES, *EXTENSION}


def test_a_face_name_without_an_entry_is_reported():
    pytest.importorskip("sphinx")
    import lsc_docs

    names = {"lossscale_callbacks": ["LoggingLoop", "Sink"], "lossscale_callbacks.wandb": ["WandbSink"]}
    documented = {"lossscale_callbacks.LoggingLoop", "lossscale_callbacks.wandb.WandbSink",
                  "lossscale_callbacks._sinks.Sink"}  # a module path is not the face's entry
    assert lsc_docs.missing_entries(names, documented) == ["lossscale_callbacks.Sink"]
    assert "__version__" not in lsc_docs.face_names(["lossscale_callbacks"])["lossscale_callbacks"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("sphinx")
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html",
                            "docs", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                           env={**os.environ, **QUIET})
    assert build.returncode == 0, build.stderr[-5000:]
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(out))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield out, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _ids(html: str) -> set[str]:
    return set(re.findall(r'\bid="([^"]+)"', html))


@pytest.mark.slow
def test_every_internal_link_and_image_of_the_site_resolves(site):
    out, _ = site
    pages = sorted(out.rglob("*.html"))
    ids = {page: _ids(page.read_text()) for page in pages}
    broken = []
    for page in pages:
        html = page.read_text()
        for kind, ref in re.findall(r'<(?:a|img|link|script)\b[^>]*?\b(href|src)="([^"]+)"', html):
            parts = urllib.parse.urlsplit(ref)
            if parts.scheme or parts.netloc or ref.startswith("mailto:"):
                continue  # the site links nowhere outside itself but the theme's credits
            target = (page.parent / urllib.parse.unquote(parts.path)).resolve() if parts.path else page
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{page.relative_to(out)}: {kind}={ref}")
            elif parts.fragment and target.suffix == ".html" and parts.fragment not in ids.get(target, set()):
                broken.append(f"{page.relative_to(out)}: {ref} (no such anchor)")
    assert len(pages) > 20 and not broken, broken


# page -> (its heading, text that must be visible on it)
PAGES = {
    "index.html": ("lossscale-callbacks", "Troubleshooting"),
    "api/core.html": ("lossscale_callbacks (the core)", "class lossscale_callbacks.LoggingLoop"),
    "troubleshooting.html": ("Troubleshooting", "No inf checks were recorded for this optimizer"),
    "dashboards.html": ("Dashboards: TensorBoard and W&B", "Custom Scalars"),
}


@pytest.mark.slow
def test_the_site_renders_in_a_real_browser(site):
    _, url = site
    chromium, sync_playwright = browser_or_skip()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            failed: list[str] = []
            page.on("requestfailed", lambda request: failed.append(request.url))
            page.on("response", lambda r: failed.append(f"{r.status} {r.url}") if r.status >= 400 else None)
            for path, (heading, text) in PAGES.items():
                page.goto(f"{url}/{path}", wait_until="networkidle")
                assert page.locator("h1").first.inner_text().rstrip("#¶ \n") == heading, path
                assert page.get_by_text(text, exact=False).first.is_visible(), (path, text)
                images = page.eval_on_selector_all(
                    "img", "imgs => imgs.map(i => [i.getAttribute('src'), i.complete && i.naturalWidth > 0])")
                assert all(ok for _, ok in images), (path, images)
                if path == "dashboards.html":
                    assert len(images) >= 2  # the two TensorBoard screenshots
            assert not failed, failed
        finally:
            browser.close()
