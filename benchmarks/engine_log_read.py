"""How long ``lossscale-callbacks report`` takes on a 1,000,000-line engine log, against a bare read of it.

Two logs of ``--lines`` lines each, written in the engines' own formats (``tests/engine_log_writers.py``)
from a simple model of a dynamic scale (halve on overflow, double after 50 clean steps; an overflow
every 97 steps):

* ``deepspeed``: what a DeepSpeed run prints: a timer line every step, ``step=N, skipped=K`` every 10
  steps, an overflow line at each overflow (about one line in nine is a loss-scale line);
* ``megatron``: Megatron-LM's iteration line at every iteration (``--log-interval 1``): every line is a
  log point, the worst case for the report's series.

Each is timed in a fresh process (wall time, CPU time, peak memory of that process): ``report LOG``
(the text report: reading, judging, printing), the engine-log reader alone (the series, no judging),
and the baseline, the same process reading the file's lines and doing nothing with them. The ratio is
ours over that floor. Memory: the same run at a quarter of the lines shows what grows with the lines.

    python benchmarks/engine_log_read.py                  # 1,000,000 lines per log
    python benchmarks/engine_log_read.py --quick          # 3,000 lines: checks it runs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from _quick import parse_args
from report_read import measure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from engine_log_writers import deepspeed_log, megatron_log  # noqa: E402

REPORT = """
import sys
from lossscale_callbacks._cli import main
assert main(["report", sys.argv[1]]) == 0
"""

READER = """
import sys
from lossscale_callbacks.report._engine_logs import read_run
print(len(read_run(sys.argv[1])["loss_scale/scale"]))
"""

LINES_ONLY = """
import sys
with open(sys.argv[1], encoding="utf-8", errors="replace") as log:
    print(sum(1 for _ in log))
"""


def states(steps: int, start: int = 1, scale: float = 2.0**16, clean: int = 0, skipped: int = 0):
    """The writers' states ``(step, scale, skipped, hysteresis left, overflow)`` for steps ``start..``."""
    out = []
    for step in range(start, start + steps):
        overflow = step % 97 == 0
        if overflow:
            scale, clean, skipped = max(scale / 2, 1.0), 0, skipped + 1
        else:
            clean += 1
            if clean == 50:
                scale, clean = min(scale * 2, 2.0**24), 0
        out.append((step, scale, skipped, 1, overflow))
    return out, (scale, clean, skipped)


def write_log(path: str, lines: int, engine: str) -> int:
    """Write a log of about ``lines`` lines in chunks (each chunk's states continue the last); its lines."""
    scale, clean, skipped, step, written = 2.0**16, 0, 0, 1, 0
    per_step = 1.0 if engine == "megatron" else 1.1 + 1 / 97  # DeepSpeed: timer + progress/10 + overflows
    with open(path, "w") as log:
        while written < lines:
            chunk = min(100_000, max(10, int((lines - written) / per_step) // 10 * 10))
            before = scale
            block, (scale, clean, skipped) = states(chunk, step, scale, clean, skipped)
            text = megatron_log(block, 1)[0] if engine == "megatron" else deepspeed_log(block, 10, before)[0]
            log.write(text)
            written += text.count("\n")
            step += chunk
    return written


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--dir", default=None, help="where to write the logs (default: a temp folder)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parse_args(parser, argv, lines=3000)
    folder = args.dir or tempfile.mkdtemp(prefix="engine_log_read_")
    result = {}
    for engine in ("deepspeed", "megatron"):
        path, quarter = os.path.join(folder, f"{engine}.log"), os.path.join(folder, f"{engine}-quarter.log")
        count = write_log(path, args.lines, engine)
        write_log(quarter, args.lines // 4, engine)
        ours, reader, floor = measure(REPORT, path), measure(READER, path), measure(LINES_ONLY, path)
        small = measure(REPORT, quarter)
        result[engine] = {"lines": count, "mib": round(os.path.getsize(path) / 2**20), "report": ours,
                          "reader": reader, "lines_only": floor, "report_quarter": small}
        print(f"{engine}: {count} lines, {result[engine]['mib']} MiB")
        print(f"  lossscale-callbacks report: {ours['seconds']:.2f} s wall, {ours['cpu_seconds']:.2f} s CPU, "
              f"peak {ours['peak_mib']} MiB")
        print(f"  the engine-log reader alone: {reader['seconds']:.2f} s wall, {reader['cpu_seconds']:.2f} s "
              f"CPU, peak {reader['peak_mib']} MiB")
        print(f"  reading the lines only: {floor['seconds']:.2f} s wall, peak {floor['peak_mib']} MiB")
        print(f"  a quarter of the lines: {small['seconds']:.2f} s wall, peak {small['peak_mib']} MiB")
        ratio = ours["cpu_seconds"] / max(floor["cpu_seconds"], 0.01)
        print(f"  ours / reading the lines: {ratio:.2f} (CPU time)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return result


if __name__ == "__main__":
    main()
