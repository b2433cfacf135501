"""How long ``lossscale-callbacks report`` takes on big runs and on a sweep, against TensorBoard's own loader.

Two cases, each reader in its own process (wall time, CPU time and peak memory of that process):

* one big file (the default): one event file of ``--events`` events, like a long run whose per-batch
  metrics (loss, accuracy, learning rate) fill the file, with the loss-scale metrics every
  ``--loss-scale-every``-th event; timed: ``lossscale-callbacks report DIR --json`` (ours: streams
  the file, verifies and parses only ``loss_scale/*`` records) and TensorBoard's ``EventAccumulator``
  loading every scalar and tensor of the same file.
* a sweep (``--sweep``): ``--runs`` run folders of ``--intervals`` log intervals each (every 100
  steps), written through the real ``LoggingLoop`` and ``TensorBoardSink`` (the policy, the metrics at
  every interval, the summary), from a simple model of a dynamic scale (halve on overflow, double
  after 2000 clean steps; runs overflow from once in 100,000 steps to once in 50, so some hold the
  maximum scale and some collapse); timed: the report as text, the report as ``--json`` written to a
  file, and TensorBoard's ``EventMultiplexer`` loading every run of the folder.

    python benchmarks/report_read.py                          # 1,000,000 events in one file
    python benchmarks/report_read.py --events 100000 --skip-tensorboard
    python benchmarks/report_read.py --quick                  # 3,000 events: checks it runs
    python benchmarks/report_read.py --sweep                  # 100 runs x 10,000 intervals
    python benchmarks/report_read.py --sweep --quick          # 3 runs x 200 intervals: checks it runs
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

from _quick import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_event_file(folder: str, events: int, every: int) -> str:
    """One event file: ``events`` events, a loss-scale one every ``every`` (written with TF's C++ writer)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    from tensorboard.compat.proto import event_pb2, summary_pb2

    from lossscale_callbacks import _metrics as m

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "events.out.tfevents.0.bench")
    with tf.io.TFRecordWriter(path) as writer:
        writer.write(event_pb2.Event(wall_time=0.0, file_version="brain.Event:2").SerializeToString())
        for i in range(1, events):
            if i % every == 0:
                step = i // every * 100
                values = [summary_pb2.Summary.Value(tag=tag, simple_value=float(v)) for tag, v in (
                    (m.SCALE, 2.0 ** (15 - (i // every) % 4)), (m.LOG2_SCALE, 15 - (i // every) % 4),
                    (m.GROWTH_COUNTER, i % 50), (m.SKIPPED_STEPS, i // (every * 10)),
                    (m.SKIPPED_IN_INTERVAL, 0), (m.SKIP_RATE, 0.0), (m.STEPS, step))]
            else:
                step = i
                tag = ("batch_loss", "batch_accuracy", "learning_rate")[i % 3]
                values = [summary_pb2.Summary.Value(tag=tag, simple_value=1.0 / i)]
            event = event_pb2.Event(wall_time=float(i), step=step, summary=summary_pb2.Summary(value=values))
            writer.write(event.SerializeToString())
    return path


# The child reports the peak of its own address space (VmHWM). getrusage's ru_maxrss would not
# do: Linux carries the high-water mark of the image a child was forked from (this parent, with
# TensorFlow loaded) across exec.
_PEAK = """
with open("/proc/self/status") as status:
    print("PEAK_KIB", next(line.split()[1] for line in status if line.startswith("VmHWM")), file=sys.stderr)
"""


def measure(code: str, folder: str, out: str = os.devnull) -> dict[str, float]:
    """Wall and CPU seconds and peak memory (MiB) of a fresh Python process running ``code`` on ``folder``,
    its standard output written to ``out``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with open(out, "w") as sink:
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
        done = subprocess.run([sys.executable, "-c", code + _PEAK, folder], stdout=sink,
                              stderr=subprocess.PIPE, text=True, env=env)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"the reader failed: {done.stderr[-2000:]}")
    peak_kib = int(next(line.split()[1] for line in done.stderr.splitlines() if line.startswith("PEAK_KIB")))
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return {"seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2), "peak_mib": round(peak_kib / 1024)}


OURS = """
import sys
from lossscale_callbacks._cli import main
assert main(["report", sys.argv[1], "--json"]) == 0
"""

OURS_TEXT = """
import sys
from lossscale_callbacks._cli import main
assert main(["report", sys.argv[1]]) == 0
"""

TB_READ = """
import sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0, "tensors": 0})
acc.Reload()
print(len(acc.Tags()["scalars"]), len(acc.Scalars("loss_scale/scale")))
"""

TB_SWEEP = """
import sys
from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
loader = EventMultiplexer(size_guidance={"scalars": 0, "tensors": 0}).AddRunsFromDirectory(sys.argv[1])
loader.Reload()
print(len(loader.Runs()))
"""


def simulated_states(intervals: int, every: int, p_overflow: float, seed: int) -> Iterator[dict]:
    """The state at the end of each interval of a dynamic scale (halve on overflow, double after 2000
    clean steps, within [1, 2**24]) whose steps overflow with probability ``p_overflow``."""
    rng = random.Random(seed)
    scale, counter, skipped = 2.0**15, 0, 0
    for step in range(1, intervals * every + 1):
        if rng.random() < p_overflow:
            scale, counter, skipped = max(scale / 2, 1.0), 0, skipped + 1
        else:
            counter += 1
            if counter == 2000:
                scale, counter = min(scale * 2, 2.0**24), 0
        if step % every == 0:
            yield {"steps": step, "scale": scale, "growth_counter": counter, "hysteresis_left": 1,
                   "skipped_steps": skipped}


def write_sweep(root: str, runs: int, intervals: int) -> None:
    """``runs`` run folders below ``root``, each written by the real logging loop and TensorBoard sink."""
    from lossscale_callbacks._policy import DynamicPolicy
    from lossscale_callbacks.loop._logging_loop import LoggingLoop
    from lossscale_callbacks.tensorboard._sink import TensorBoardSink

    policy = DynamicPolicy(initial_scale=2.0**15, growth_interval=2000)
    for run in range(runs):
        p_overflow = (1e-5, 1e-4, 1e-3, 2e-2)[run % 4]
        loop = LoggingLoop(policy, sinks=[TensorBoardSink(os.path.join(root, f"run{run:03d}"))], health=None,
                           echo=None)
        for state in simulated_states(intervals, 100, p_overflow, seed=run):
            loop.observe(state)
        loop.finish()
        loop.close()


def _single_file(args: argparse.Namespace, folder: str) -> dict:
    path = write_event_file(folder, args.events, args.loss_scale_every)
    size_mib = os.path.getsize(path) / 2**20
    ours = measure(OURS, folder)
    result = {"events": args.events, "loss_scale_events": args.events // args.loss_scale_every,
              "file_mib": round(size_mib, 1), "ours": ours}
    print(f"{args.events} events ({result['loss_scale_events']} with loss_scale/*), {size_mib:.0f} MiB")
    print(f"lossscale-callbacks report: {ours['seconds']:.2f} s, peak {ours['peak_mib']} MiB")
    print(f"  CPU {ours['cpu_seconds']:.2f} s")
    if not args.skip_tensorboard:
        theirs = measure(TB_READ, folder)
        result.update(tensorboard=theirs, ratio_seconds=round(ours["seconds"] / theirs["seconds"], 3))
        print(f"TensorBoard EventAccumulator (all scalars): {theirs['seconds']:.2f} s, peak "
              f"{theirs['peak_mib']} MiB")
        print(f"  CPU {theirs['cpu_seconds']:.2f} s")
        print(f"ours / TensorBoard's: {result['ratio_seconds']:.3f} (time)")
    return result


def _figures(measured: dict[str, float]) -> str:
    seconds, cpu, peak = measured["seconds"], measured["cpu_seconds"], measured["peak_mib"]
    return f"{seconds:.2f} s, CPU {cpu:.2f} s, peak {peak} MiB"


def _sweep(args: argparse.Namespace, folder: str) -> dict:
    if not os.path.isdir(folder) or not os.listdir(folder):
        start = time.perf_counter()
        write_sweep(folder, args.runs, args.intervals)
        print(f"wrote {args.runs} runs x {args.intervals} intervals in {time.perf_counter() - start:.0f} s")
    size_mib = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs) / 2**20
    with tempfile.TemporaryDirectory(prefix="report_json_") as tmp:
        json_out = os.path.join(tmp, "report.json")
        result = {"runs": args.runs, "intervals": args.intervals, "folder_mib": round(size_mib, 1),
                  "text": measure(OURS_TEXT, folder), "json": measure(OURS, folder, out=json_out),
                  "json_mib": round(os.path.getsize(json_out) / 2**20, 1)}
    print(f"{args.runs} runs x {args.intervals} intervals, {size_mib:.0f} MiB")
    print(f"lossscale-callbacks report (text): {_figures(result['text'])}")
    print(f"lossscale-callbacks report --json > file ({result['json_mib']} MiB): {_figures(result['json'])}")
    if not args.skip_tensorboard:
        result["tensorboard"] = measure(TB_SWEEP, folder)
        result["ratio_seconds"] = round(result["text"]["seconds"] / result["tensorboard"]["seconds"], 3)
        print(f"TensorBoard EventMultiplexer (every run, all scalars): {_figures(result['tensorboard'])}")
        print(f"ours (text) / TensorBoard's: {result['ratio_seconds']:.3f} (wall time)")
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--loss-scale-every", type=int, default=100)
    parser.add_argument("--sweep", action="store_true", help="time a folder of runs instead of one big file")
    parser.add_argument("--runs", type=int, default=100, help="runs in the sweep")
    parser.add_argument("--intervals", type=int, default=10_000, help="log intervals per run in the sweep")
    parser.add_argument("--dir", default=None, help="where to write the runs (default: a temp folder); "
                        "a sweep folder that holds files already is read as it is")
    parser.add_argument("--skip-tensorboard", action="store_true", help="time only ours")
    parser.add_argument("--json", default=None)
    args = parse_args(parser, argv, events=3000, runs=3, intervals=200)

    folder = args.dir or tempfile.mkdtemp(prefix="report_read_")
    result = _sweep(args, folder) if args.sweep else _single_file(args, folder)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return result


if __name__ == "__main__":
    main()
