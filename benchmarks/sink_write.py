"""Cost of one ``write`` call per sink, against ``InMemorySink`` as the baseline, in one process.

Each sink receives the same 10,000 writes of the five-metric schema (one write per log interval
in a real run) and every call is timed on its own. Reported: median and p99 per call, the ratio
of the median to ``InMemorySink``'s, and the time of the final ``close`` (the TensorBoard file's
last flush; finishing the W&B run).

W&B runs offline here (no network in the benchmark); ``run.log`` only hands the row to W&B's
service process over a local socket in either mode, so the per-call cost is the same online.

    python benchmarks/sink_write.py [--writes 10000] [--json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable

from _quick import parse_args

from lossscale_callbacks import _metrics as m
from lossscale_callbacks._sinks import GuardedSink, InMemorySink, Sink


def _metrics(i: int) -> dict[str, float]:
    return {
        m.SCALE: float(2 ** (10 + i % 8)),
        m.GROWTH_COUNTER: float(i % 2000),
        m.SKIPPED_STEPS: float(i // 50),
        m.SKIPPED_IN_INTERVAL: float(i % 3),
        m.SKIP_RATE: (i % 3) / 100.0,
    }


def _time_sink(sink: Sink, writes: int) -> dict[str, float]:
    payloads = [_metrics(i) for i in range(writes)]
    sink.write(0, payloads[0])  # open files / start the run outside the timed calls
    samples = []
    clock = time.perf_counter_ns
    for i, payload in enumerate(payloads, start=1):
        start = clock()
        sink.write(100 * i, payload)
        samples.append(clock() - start)
    start = clock()
    sink.close()
    close_ns = clock() - start
    samples.sort()
    return {
        "median_us": statistics.median(samples) / 1e3,
        "p99_us": samples[int(0.99 * (len(samples) - 1))] / 1e3,
        "mean_us": statistics.fmean(samples) / 1e3,
        "close_ms": close_ns / 1e6,
    }


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writes", type=int, default=10_000)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parse_args(parser, argv, writes=200)
    os.environ.setdefault("WANDB_SILENT", "true")

    from lossscale_callbacks.tensorboard import TensorBoardSink
    from lossscale_callbacks.wandb import WandbSink

    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        factories: dict[str, Callable[[], Sink]] = {
            "InMemorySink": InMemorySink,
            "GuardedSink(InMemorySink)": lambda: GuardedSink(InMemorySink()),
            "TensorBoardSink": lambda: TensorBoardSink(os.path.join(tmp, "tb")),
            "WandbSink (offline)": lambda: WandbSink(project="bench", dir=tmp, mode="offline"),
        }
        for name, factory in factories.items():
            results[name] = _time_sink(factory(), args.writes)
    base = results["InMemorySink"]["median_us"]
    for row in results.values():
        row["ratio_to_memory"] = row["median_us"] / base

    if args.json:
        print(json.dumps({"writes": args.writes, "python": sys.version.split()[0],
                          "machine": platform.machine(), "results": results}, indent=2))
    else:
        print(f"{args.writes} write calls per sink, five metrics each ({platform.machine()}, "
              f"Python {sys.version.split()[0]})")
        print(f"{'sink':<28} {'median us':>10} {'p99 us':>10} {'x memory':>10} {'close ms':>10}")
        for name, row in results.items():
            print(f"{name:<28} {row['median_us']:>10.2f} {row['p99_us']:>10.2f} "
                  f"{row['ratio_to_memory']:>10.1f} {row['close_ms']:>10.2f}")
    return results


if __name__ == "__main__":
    main()
