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
import importlib.util
import os
import re
import subprocess
import sys
import threading
import urllib.parse
from pathlib import Path

import background
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


def _build(out) -> tuple[list[str], dict]:
    argv = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html", "docs", str(out)]
    return argv, {**os.environ, **QUIET}


_SITE: list = []  # the folder of the build started in the background


def start_in_background(items, tmp_path_factory) -> None:
    """The site's build starts with the session (``tests/background.py``) when a test reads the site."""
    site_tests = [i for i, item in enumerate(items)
                  if item.module.__name__ == __name__ and "site" in getattr(item, "fixturenames", ())]
    if site_tests and importlib.util.find_spec("sphinx") is not None:
        out = tmp_path_factory.mktemp("site")
        argv, env = _build(out)
        background.submit("site", argv, env=env, timeout=600, cwd=str(ROOT), order=site_tests[0])
        _SITE.append(out)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("sphinx")
    if background.submitted("site"):
        out, build = _SITE[0], background.wait("site")
    else:
        out = tmp_path_factory.mktemp("site")
        argv, env = _build(out)
        build = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
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
    """What a page shows as code (``<code>``, ``<pre>``, option names) and as text, apart; ``blocks`` holds
    the text of each outermost code element whole (a highlighted block is many spans)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.code: list[str] = []
        self.text: list[str] = []
        self.blocks: list[str] = []
        self._open: list[tuple[str, bool, bool]] = []

    def _in_code(self) -> bool:
        return any(code for _, code, _ in self._open)

    def handle_starttag(self, tag, attrs):
        cls = dict(attrs).get("class") or ""
        code = tag in ("code", "pre", "kbd", "samp") or "sig-name" in cls or "sig-prename" in cls
        if code and not self._in_code():
            self.blocks.append("")
        self._open.append((tag, code, tag in ("script", "style")))

    def handle_endtag(self, tag):
        while self._open and self._open.pop()[0] != tag:
            pass

    def handle_data(self, data):
        if any(hidden for _, _, hidden in self._open):
            return
        if self._in_code():
            self.code.append(data)
            self.blocks[-1] += data
        else:
            self.text.append(data)


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


def _section(html: str, fragment: str) -> str:
    """The ``<section id=fragment>`` of a page (what a link to that anchor shows), or the whole page."""
    start = html.find(f'<section id="{fragment}">') if fragment else -1
    if start < 0:
        return html
    depth, at = 0, start
    for match in re.finditer(r"<(/?)section\b", html[start:]):
        depth += -1 if match.group(1) else 1
        if depth == 0:
            at = start + match.end()
            break
    return html[start:at]


def _links(html: str) -> list[tuple[str, str]]:
    """``(text, href)`` of every internal link."""
    found = []
    for href, inner in re.findall(r'<a\b[^>]*?href="([^"#:][^":]*|#[^"]*)"[^>]*>(.*?)</a>', html, re.S):
        found.append((re.sub(r"<[^>]+>", "", inner).strip(), href))
    return found


def _code_blocks(html: str) -> list[str]:
    """The text of each code element of ``html``."""
    scan = _CodeAndText()
    scan.feed(html)
    return scan.blocks


def _click(page: Path, href: str) -> tuple[Path, str]:
    """The page and the anchor a link of ``page`` leads to."""
    target, _, fragment = href.partition("#")
    return ((page.parent / target).resolve() if target else page), fragment


# What a new user looks for on the home page: the words of the link they would click first, and for each
# framework the code that turns diagnose=True on (a class and diagnose=True in one code element).
NAN_LINK = re.compile(r"\bNaN\b")
DIAGNOSE = {"PyTorch": "LossScaler(", "Keras": "LossScaleCallback(", "Lightning": "LossScaleMonitor(",
            "Fabric": "LossScaleFabricPlugin(", "Accelerate": "install_loss_scaler(",
            "Transformers": "LossScaleTrainerCallback("}


def _within_two_clicks(out: Path, first_link: re.Pattern, found) -> list[list[str]]:
    """Every path from the home page (a first link whose words match, then any link of the section it
    shows) whose target section satisfies ``found(section_html)``."""
    home = out / "index.html"
    paths = []
    for text, href in _links(home.read_text()):
        if not first_link.search(text):
            continue
        page, fragment = _click(home, href)
        section = _section(page.read_text(), fragment)
        if found(section):
            paths.append([text])
        for text2, href2 in _links(section):
            page2, fragment2 = _click(page, href2)
            if page2.suffix == ".html" and page2.exists() and found(_section(page2.read_text(), fragment2)):
                paths.append([text, text2])
    return paths


@pytest.mark.slow
def test_a_new_user_finds_it_within_two_clicks_of_the_home_page(site):
    out, _ = site
    for framework, cls in DIAGNOSE.items():
        def turns_diagnose_on(section, cls=cls):
            return any(cls in code and "diagnose=True" in code for code in _code_blocks(section))
        assert _within_two_clicks(out, NAN_LINK, turns_diagnose_on), f"my fp16 loss is NaN: {framework}"

    def ddp_page(section):
        code = "\n".join(_code_blocks(section))
        return "DistributedDataParallel(" in code and "scaler.read_state" in code and "fully_shard(" in code

    assert ["Training on many GPUs with DDP or FSDP"] in _within_two_clicks(out, re.compile(r"\bDDP\b"),
                                                                            ddp_page)

    def bf16_section(section):
        code = "\n".join(_code_blocks(section))
        return "bfloat16 Tensor Cores" in section and "get_device_capability" in code

    assert ["fp16 or bf16 on my GPU?"] in _within_two_clicks(out, re.compile(r"\bbf16\b"), bf16_section)


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



@pytest.mark.slow
def test_every_code_block_and_table_fits_its_column_and_code_has_a_copy_button(site):
    out, url = site
    chromium, sync_playwright = browser_or_skip()
    skip = ("genindex.html", "search.html", "py-modindex.html")
    pages = [str(p.relative_to(out)) for p in _site_pages(out) if p.name not in skip]
    measure = """() => [...document.querySelectorAll('article div.highlight pre')].map(pre => [
        pre.scrollWidth - pre.clientWidth, !!pre.closest('div.highlight').querySelector('button.copybtn'),
        pre.innerText.split('\\n')[0].slice(0, 60)])"""
    tables = """() => [...document.querySelectorAll('article table')].map(table => {
        const box = table.closest('.table-wrapper') || table.parentElement;
        return [box.scrollWidth - box.clientWidth, table.innerText.slice(0, 60)]; })"""
    wide, no_button, blocks = [], [], 0
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            for path in pages:
                # "load" has the page's styles and images; the fonts it lays out with are awaited too.
                # ("networkidle" waited 0.5 s more a page: 25 s of the suite, with both cores idle.)
                page.goto(f"{url}/{path}", wait_until="load")
                page.evaluate("() => document.fonts.ready.then(() => true)")
                for overflow, button, first_line in page.evaluate(measure):
                    blocks += 1
                    if overflow > 1:
                        wide.append(f"{path}: {overflow} px too wide: {first_line!r}")
                    if not button:
                        no_button.append(f"{path}: {first_line!r}")
                wide += [f"{path}: a table {overflow} px too wide: {text!r}"
                         for overflow, text in page.evaluate(tables) if overflow > 1]
        finally:
            browser.close()
    assert blocks > 60, blocks
    assert not wide, wide
    assert not no_button, no_button


@pytest.mark.slow
def test_a_new_user_clicks_from_the_home_page_to_the_code(site):
    _, url = site
    chromium, sync_playwright = browser_or_skip()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            # My fp16 loss is NaN (Keras): the troubleshooting section shows the line, the Keras page the run.
            page.goto(f"{url}/index.html", wait_until="networkidle")
            page.locator("article").get_by_role("link", name="My fp16 loss is NaN or Inf").click()
            page.wait_for_load_state("networkidle")
            assert page.url.endswith("troubleshooting.html#the-loss-is-nan")
            assert page.locator("code", has_text="LossScaleCallback(diagnose=True)").first.is_visible()
            page.locator("#the-loss-is-nan").get_by_role("link", name="Keras 3 fit").click()
            page.wait_for_load_state("networkidle")
            assert page.url.endswith("paths/keras.html#why-steps-are-skipped-diagnose-true")
            section = page.locator("#why-steps-are-skipped-diagnose-true")
            assert section.locator("pre", has_text="diagnose=True").first.is_visible()
            # DDP across GPUs, and fp16 or bf16 on my GPU: one click each.
            for link, address, heading in [
                    ("Training on many GPUs with DDP or FSDP", "paths/many-gpus.html",
                     "Many GPUs: DDP and FSDP with LossScaler"),
                    ("fp16 or bf16 on my GPU?", "concepts.html#float16-or-bfloat16-on-your-gpu",
                     "float16 or bfloat16 on your GPU")]:
                page.goto(f"{url}/index.html", wait_until="networkidle")
                page.locator("article").get_by_role("link", name=link).click()
                page.wait_for_load_state("networkidle")
                assert page.url.endswith(address), page.url
                assert page.get_by_role("heading", name=heading).first.is_visible()
        finally:
            browser.close()
