"""Take the README's TensorBoard screenshots of the demo run, the way a user sees them.

Runs the demo (``examples/keras_quickstart.py``) into a temporary ``runs/`` folder, starts a stock
``tensorboard --logdir runs`` (default flags), and photographs the Scalars view (filtered to
``loss_scale``) and the Custom Scalars "Loss scale" section with headless Chromium via Playwright:

    .venv/bin/python docs/make_screenshots.py          # writes docs/tensorboard_*.png
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def main() -> None:
    from playwright.sync_api import sync_playwright

    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    with tempfile.TemporaryDirectory() as work:
        subprocess.run([sys.executable, str(ROOT / "examples" / "keras_quickstart.py")], cwd=work, env=env,
                       check=True, stdout=subprocess.DEVNULL)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = subprocess.Popen([str(Path(sys.executable).with_name("tensorboard")), "--logdir",
                                   os.path.join(work, "runs"), "--host", "127.0.0.1", "--port", str(port)],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            base = f"http://127.0.0.1:{port}"
            for _ in range(120):
                try:
                    urllib.request.urlopen(f"{base}/data/runs", timeout=2)
                    break
                except OSError:
                    time.sleep(0.5)
            time.sleep(5)  # the data server's first load
            chromium = shutil.which("chromium") or shutil.which("chromium-browser")
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=chromium, headless=True, args=ARGS)
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(f"{base}/#custom_scalars", wait_until="networkidle")
                page.locator("text=/Matches \\(\\d+\\)/").first.wait_for(timeout=60_000)
                time.sleep(3)
                page.screenshot(path=str(HERE / "tensorboard_custom_scalars.png"))
                page.goto(f"{base}/#scalars&tagFilter=loss_scale%2F(log2_scale%7Cskip_rate%7Cskipped_steps)",
                          wait_until="networkidle")
                time.sleep(5)
                page.screenshot(path=str(HERE / "tensorboard_scalars.png"))
                browser.close()
        finally:
            server.kill()
            server.wait(timeout=30)
    print(f"wrote {HERE / 'tensorboard_custom_scalars.png'} and {HERE / 'tensorboard_scalars.png'}")


if __name__ == "__main__":
    main()
