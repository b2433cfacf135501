"""The dashboards as users see them: a stock ``tensorboard`` with its default flags, and a real browser.

TensorBoard's default loader (the Rust data server) drops float64 scalars, which once made the
"Loss scale" section empty while tests that started TensorBoard with ``--load_fast=false`` passed.
So no test here passes any loader flag: ``tensorboard --logdir DIR --host 127.0.0.1 --port PORT``,
exactly what the README tells users to run. One server serves three runs written the three ways
users write them: Keras ``fit`` with ``LossScaleCallback(tensorboard=...)``, a Lightning run with
``TensorBoardLogger`` and ``LossScaleMonitor``, and a plain loop with ``TensorBoardSink``.

The browser test drives Debian's Chromium through Playwright (``python3 dev.py`` installs both;
Playwright's own browser download does not work everywhere). Without a browser it is skipped on a
developer machine and fails on CI (``CI`` set), where dev.py must have installed one.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from browser import browser_or_skip

from lossscale_callbacks.integration import DASHBOARD_CHARTS

pytestmark = pytest.mark.slow

RUNS = {"keras": "keras", "lightning": "lightning/version_0", "plain": "plain"}
PLAIN_STEPS, PLAIN_EVERY = 600, 25
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _write_keras_run(log_dir: Path) -> None:
    import keras
    from keras_scripts.toy import build_model, make_data

    from lossscale_callbacks import DynamicPolicy
    from lossscale_callbacks.keras import LossScaleCallback

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = build_model()  # default layer names, as tutorials build models
        model.compile(optimizer="adam", loss="mse")
        x, y = make_data(12, poisoned=(3, 7))
        policy = DynamicPolicy(initial_scale=2.0**10, growth_interval=4)
        callback = LossScaleCallback(log_every=2, policy=policy, tensorboard=str(log_dir), health=None)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[callback])
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _write_lightning_run(root: Path) -> None:
    import lightning.pytorch as pl
    from lightning_scripts import tiny

    from lossscale_callbacks import DynamicPolicy
    from lossscale_callbacks.lightning import LossScaleMonitor, LossScalePlugin

    tiny.quiet_lightning_warnings()
    logger = pl.loggers.TensorBoardLogger(str(root), name="lightning", version=0)
    policy = DynamicPolicy(initial_scale=2.0**10, growth_interval=3)
    trainer = pl.Trainer(plugins=[LossScalePlugin(device="cpu", policy=policy)],
                         callbacks=[LossScaleMonitor(log_every=2, health=None)],
                         **tiny.trainer_kwargs(max_steps=8, logger=[logger]))
    trainer.fit(tiny.module_class(pl)(inject_inf_at=(1, 5), snapshots=False), tiny.data())


def _write_plain_run(log_dir: Path) -> None:
    from lossscale_callbacks import DynamicPolicy, LoggingLoop, initial_state, next_state
    from lossscale_callbacks.tensorboard import TensorBoardSink

    policy = DynamicPolicy(initial_scale=2.0**15, growth_interval=40)
    loop = LoggingLoop(policy, sinks=[TensorBoardSink(log_dir)], log_every=PLAIN_EVERY, health=None,
                       echo=None)
    rng = np.random.default_rng(0)
    state = initial_state(policy)
    for _ in range(PLAIN_STEPS):
        state = next_state(policy, state, finite=bool(rng.random() > 0.05))
        loop.maybe_observe(int(state.steps), lambda: state)  # noqa: B023
    loop.finish(state)
    loop.close()


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("dashboards")
    _write_keras_run(root / "keras")
    _write_lightning_run(root)
    _write_plain_run(root / "plain")
    return root


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str):
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read().decode())


def _start(logdir) -> tuple[subprocess.Popen, str]:
    """A stock TensorBoard with its default flags on a free port; its base URL once it lists every run.

    The port is free when chosen and bound seconds later: where something took it meanwhile (the server
    exits), a new one is chosen, three times at most. A reply slower than ``_get``'s timeout on a busy
    machine is a reason to ask again, not a failure.
    """
    for _ in range(3):
        port = _free_port()
        command = [str(Path(sys.executable).with_name("tensorboard")), "--logdir", str(logdir),
                   "--host", "127.0.0.1", "--port", str(port)]
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if set(RUNS.values()) <= set(_get(f"{base}/data/runs")):
                    return server, base
            except (OSError, json.JSONDecodeError):  # not up yet, or slow: URLError and timeouts too
                pass
            time.sleep(0.5)
        server.kill()
        server.wait(timeout=30)
        if time.monotonic() >= deadline:
            pytest.fail("tensorboard never listed the three runs")
    pytest.fail("tensorboard exited three times (each port taken before it bound it?)")


@pytest.fixture(scope="module")
def tensorboard(logdir):
    """A stock TensorBoard with its default flags; killed by its pid however the tests end."""
    server, base = _start(logdir)
    try:
        yield base
    finally:
        server.kill()
        server.wait(timeout=30)


def _scalars(base: str, run: str, tag: str, expected_points: int | None = None, timeout: float = 60):
    query = urllib.parse.urlencode({"run": run, "tag": tag})
    deadline = time.monotonic() + timeout
    points: list = []
    while time.monotonic() < deadline:
        try:
            points = _get(f"{base}/data/plugin/scalars/scalars?{query}")
        except OSError:  # HTTPError (not loaded yet) and a reply slower than the timeout: ask again
            points = []
        if points and (expected_points is None or len(points) >= expected_points):
            break
        time.sleep(0.5)
    return [(p[1], p[2]) for p in points]  # each point is [wall_time, step, value]


@pytest.mark.parametrize("kind", list(RUNS))
def test_stock_tensorboard_with_default_flags_serves_the_loss_scale(tensorboard, logdir, kind):
    from lossscale_callbacks.tensorboard._reader import read_run

    expected = read_run(str(logdir / RUNS[kind]))["loss_scale/scale"]
    assert expected, f"the {kind} run wrote no loss_scale/scale"
    served = _scalars(tensorboard, RUNS[kind], "loss_scale/scale", len(expected))
    assert served == expected
    if kind == "plain":
        assert len(served) == PLAIN_STEPS // PLAIN_EVERY
    log2 = dict(_scalars(tensorboard, RUNS[kind], "loss_scale/log2_scale", len(expected)))
    assert all(log2[step] == np.log2(value) for step, value in expected)


def test_every_run_has_the_loss_scale_section_layout(tensorboard, logdir):
    layout = _get(f"{tensorboard}/data/plugin/custom_scalars/layout")
    assert [c["title"] for c in layout["category"]] == ["Loss scale"]
    # Each run carries the layout itself, the Lightning one too (written through TensorBoardLogger).
    for run in RUNS.values():
        files = list((logdir / run).glob("events.out.tfevents.*"))
        assert any(b"custom_scalars__config__" in f.read_bytes() for f in files), run


def test_the_loss_scale_section_has_data_in_a_real_browser(tensorboard, tmp_path):
    chromium, sync_playwright = browser_or_skip()
    # launch() gives the browser a fresh, temporary profile of its own.
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{tensorboard}/#custom_scalars", wait_until="networkidle")
            # Playwright's text locators pierce the open shadow roots of TensorBoard's Polymer UI.
            counts = page.locator("text=/Matches \\(\\d+\\)/")
            counts.first.wait_for(timeout=60_000)
            deadline = time.monotonic() + 60
            texts: list[str] = []
            while time.monotonic() < deadline:
                texts = counts.all_inner_texts()
                # the charts fill in as the page fetches each run's series
                if len(texts) >= len(DASHBOARD_CHARTS) and all(t == f"Matches ({len(RUNS)})" for t in texts):
                    break
                time.sleep(1)
            page.screenshot(path=str(tmp_path / "custom_scalars.png"))
            assert page.get_by_text("Loss scale", exact=True).count() >= 1
            assert len(texts) == len(DASHBOARD_CHARTS), texts  # one chart per metric of the section
            assert "Matches (0)" not in texts, texts
            assert all(t == f"Matches ({len(RUNS)})" for t in texts), texts
        finally:
            browser.close()
