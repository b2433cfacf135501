"""The documentation site: built as ``python3 dev.py docs`` builds it, opened in a real browser.

The site is built once (Sphinx with warnings as errors and nitpicky references, about half a minute), served
on 127.0.0.1, and Debian's Chromium (driven by Playwright, as in ``test_dashboards_live.py``) opens the home
page, an API page and the troubleshooting page: each renders, and no image on them is broken. Every internal
link of every page, anchors included, is followed. No page shows a reST or MyST directive as text, and no
code holds a curly quote or a typographic dash (what a user copies must run). Without Sphinx the site tests
are skipped; without a browser the browser test is skipped (and fails on CI, where ``python3 dev.py``
installs one).
"""

from __future__ import annotations

import functools
import html.parser
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


def test_readthedocs_installs_what_exists():
    """Every extra, requirements file and configuration that ``.readthedocs.yaml`` names exists."""
    yaml = pytest.importorskip("yaml")
    import tomllib

    config = yaml.safe_load((ROOT / ".readthedocs.yaml").read_text())
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    installs = config["python"]["install"]
    named = [extra for step in installs for extra in step.get("extra_requirements", [])]
    files = [step["requirements"] for step in installs if "requirements" in step]
    assert named and set(named) <= extras, f"extras {sorted(set(named) - extras)} are not in pyproject.toml"
    assert files and all((ROOT / f).is_file() for f in files), files
    assert all((ROOT / step["path"]).is_dir() for step in installs if "path" in step)
    assert (ROOT / config["sphinx"]["configuration"]).is_file() and config["sphinx"]["fail_on_warning"]
    # The documentation tools come from the requirements file (the API pages need the extras' frameworks).
    wanted = {"sphinx", "furo", "myst-parser", "sphinx-copybutton"}
    listed = {re.split(r"[<>=!;\[ ]", line.strip())[0].lower() for f in files
              for line in (ROOT / f).read_text().splitlines() if line.strip() and not line.startswith("#")}
    assert wanted <= listed, sorted(wanted - listed)


def test_the_cli_reference_is_markdown_with_one_anchor_per_option():
    pytest.importorskip("sphinx")
    import argparse

    import lsc_docs

    parser = argparse.ArgumentParser(prog="tool sub", description="Needs pip install \"pkg[extra]\" jax.")
    parser.add_argument("run", help="a *run* folder")
    parser.add_argument("--png", metavar="PATH", help="draw it (needs the [plot] extra; see --json)")
    parser.add_argument("--json", action="store_true", help="as JSON: {\"runs\": [...]}")
    parser.add_argument("--target", choices=["a100", "h100"], help="the GPU")
    text = "\n".join(lsc_docs.parser_markdown(parser))
    assert ".. " not in text and "::" not in text  # no reST for the Markdown parser to show as text
    assert "```{program} tool sub" in text and "```{option} --png PATH" in text
    assert "```{option} --target {a100,h100}" in text and "(one of: a100, h100)" in text
    assert "```{option} run\na \\*run\\* folder" in text  # Markdown in help text is escaped
    assert "the `[plot]` extra; see {option}`--json`" in text and '`{"runs": [...]}`' in text
    assert 'Needs `pip install "pkg[extra]" jax`.' in text
    assert "-h, --help" not in text  # a subcommand's help flag is the command's


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


class _CodeAndText(html.parser.HTMLParser):
    """What a page shows as code (``<code>``, ``<pre>``, option names) and as text, apart."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.code: list[str] = []
        self.text: list[str] = []
        self._open: list[tuple[str, bool, bool]] = []

    def handle_starttag(self, tag, attrs):
        cls = dict(attrs).get("class") or ""
        code = tag in ("code", "pre", "kbd", "samp") or "sig-name" in cls or "sig-prename" in cls
        self._open.append((tag, code, tag in ("script", "style")))

    def handle_endtag(self, tag):
        while self._open and self._open.pop()[0] != tag:
            pass

    def handle_data(self, data):
        if any(hidden for _, _, hidden in self._open):
            return
        (self.code if any(code for _, code, _ in self._open) else self.text).append(data)


RAW_DIRECTIVE = re.compile(r"(?:^|\s)\.\. [a-z][\w:-]*::|```\{")  # `.. option::`, a MyST fence
TYPOGRAPHIC = re.compile("[\u2018\u2019\u201c\u201d\u2013\u2014\u2026]")  # curly quotes, dashes, ellipsis


def _site_pages(out: Path) -> list[Path]:
    return [p for p in sorted(out.rglob("*.html")) if "_static" not in p.parts]


@pytest.mark.slow
def test_no_page_shows_a_raw_directive_or_a_typographic_character_in_code(site):
    out, _ = site
    raw, typographic = [], []
    for page in _site_pages(out):
        scan = _CodeAndText()
        scan.feed(page.read_text())
        name = page.relative_to(out)
        raw += [f"{name}: {m.group(0)!r} in {t.strip()[:60]!r}"
                for t in scan.text for m in RAW_DIRECTIVE.finditer(t)]
        typographic += [f"{name}: {t.strip()[:60]!r}" for t in scan.code if TYPOGRAPHIC.search(t)]
        # an option name in prose, as smart quotes write `--json`
        typographic += [f"{name}: {m.group(0)!r}"
                        for t in scan.text for m in re.finditer(r"\u2013[a-z][\w-]*", t)]
    assert not raw, raw
    assert not typographic, typographic


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
