"""``lossscale-callbacks report RUN`` walks through at most 6 modules of the library beyond the core.

Counted where it happens: the command runs in a fresh interpreter on a real TensorBoard run, and the
library modules in ``sys.modules`` at exit are compared with those ``import lossscale_callbacks`` loads
(the policy, metrics, health rules and sinks every command and integration shares). What is left is
the report's own way from the command line to the printed table. About 10 s on 2 CPU cores.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("tensorboard")

MAX_REPORT_MODULES = 6
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


def test_report_runs_through_at_most_6_library_modules_beyond_the_core(tmp_path):
    from lossscale_callbacks.tensorboard import TensorBoardSink

    sink = TensorBoardSink(str(tmp_path / "runs" / "fp16"))
    sink.write(100, {"loss_scale/scale": 32768.0, "loss_scale/skipped_steps": 0})
    sink.close()
    out, report = _modules(_REPORT, "report", str(tmp_path / "runs"))
    assert out.returncode == 0, out.stderr
    assert "Loss scale: final 32768" in out.stdout  # the printed table came out of this path
    _, core = _modules(_CORE)
    assert core < report
    own = sorted(report - core)
    assert len(own) <= MAX_REPORT_MODULES, f"report runs through {len(own)} modules beyond the core: {own}"
    # the check command's modules are not on the way
    assert not [name for name in own if "alignment" in name or "check" in name]
