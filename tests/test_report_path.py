"""``lossscale-callbacks report RUN`` on a TensorBoard run loads at most 15 modules of the library in all.

Counted where it happens: the command runs in a fresh interpreter on a real TensorBoard run, and the
library modules in ``sys.modules`` at exit are counted, the package itself included. ``import
lossscale_callbacks`` loads nothing behind the face (its names are imported when first used), so what is
counted is the report's own way from the command line to the printed table. About 10 s on 2 CPU cores.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("tensorboard")

MAX_REPORT_MODULES = 15
# Prints the library's modules in sys.modules (at exit, for the command line), on stderr.
_LIST = ("def _library():\n"
         "    names = sorted(m for m in sys.modules if m.split('.')[0] == 'lossscale_callbacks')\n"
         "    sys.stderr.write('MODULES ' + ' '.join(names) + chr(10))\n")
_CORE = "import sys\n" + _LIST + "import lossscale_callbacks\n_library()\n"
_REPORT = ("import atexit, sys\n" + _LIST + "atexit.register(_library)\n"
           "from lossscale_callbacks._cli import console\nsys.exit(console(sys.argv[1:]))\n")


def _modules(code: str, *argv: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    line = next(line for line in out.stderr.splitlines() if line.startswith("MODULES "))
    return out, set(line.split()[1:])


def test_report_on_a_tensorboard_run_loads_at_most_15_library_modules(tmp_path):
    from lossscale_callbacks.tensorboard import TensorBoardSink

    sink = TensorBoardSink(str(tmp_path / "runs" / "fp16"))
    sink.write(100, {"loss_scale/scale": 32768.0, "loss_scale/skipped_steps": 0})
    sink.close()
    out, report = _modules(_REPORT, "report", str(tmp_path / "runs"))
    assert out.returncode == 0, out.stderr
    assert "Loss scale: final 32768" in out.stdout  # the printed table came out of this path
    _, core = _modules(_CORE)
    assert core == {"lossscale_callbacks", "lossscale_callbacks._extras"}  # nothing behind the face yet
    assert "lossscale_callbacks.tensorboard._reader" in report
    assert len(report) <= MAX_REPORT_MODULES, f"report loads {len(report)} library modules: {sorted(report)}"
    # neither the check command's modules, nor the loop, the sinks or the forensics are on the way
    assert not [name for name in report if any(part in name for part in (
        "alignment", "check", "loop", "_sinks", "forensics"))], sorted(report)
