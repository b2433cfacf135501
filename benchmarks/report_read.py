"""How long ``lossscale-callbacks report`` takes on a big TensorBoard run, against TensorBoard's own reader.

Writes one event file of ``--events`` events, like a long run whose per-batch metrics (loss,
accuracy, learning rate) fill the file, with the loss-scale metrics every ``--loss-scale-every``-th
event, then times, each in its own process (wall time and peak memory of that process):

* ``lossscale-callbacks report DIR --json`` (ours: streams the file, parses only ``loss_scale/*``
  records), and
* TensorBoard's ``EventAccumulator`` loading every scalar and tensor of the same file (what
  ``report`` used before, through TensorBoard's record reader and compat layers).

    python benchmarks/report_read.py                      # 1,000,000 events
    python benchmarks/report_read.py --events 100000 --skip-tensorboard
    python benchmarks/report_read.py --quick              # 3,000 events: checks it runs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from _quick import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_event_file(folder: str, events: int, every: int) -> str:
    """One event file: ``events`` events, a loss-scale one every ``every`` (written with TF's C++ writer)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    from tensorboard.compat.proto import event_pb2, summary_pb2

    from lossscale_callbacks import metrics as m

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


def measure(code: str, folder: str) -> tuple[float, float]:
    """Wall seconds and peak memory (MiB) of a fresh Python process running ``code`` on ``folder``."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code + _PEAK, folder], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"the reader failed: {done.stderr[-2000:]}")
    peak_kib = int(next(line.split()[1] for line in done.stderr.splitlines() if line.startswith("PEAK_KIB")))
    return seconds, peak_kib / 1024


OURS = """
import sys
from lossscale_callbacks.cli import main
assert main(["report", sys.argv[1], "--json"]) == 0
"""

TB_READ = """
import sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0, "tensors": 0})
acc.Reload()
print(len(acc.Tags()["scalars"]), len(acc.Scalars("loss_scale/scale")))
"""


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--loss-scale-every", type=int, default=100)
    parser.add_argument("--dir", default=None, help="where to write the event file (default: a temp folder)")
    parser.add_argument("--skip-tensorboard", action="store_true", help="time only ours")
    parser.add_argument("--json", default=None)
    args = parse_args(parser, argv, events=3000)

    folder = args.dir or tempfile.mkdtemp(prefix="report_read_")
    path = write_event_file(folder, args.events, args.loss_scale_every)
    size_mib = os.path.getsize(path) / 2**20
    ours = measure(OURS, folder)
    result = {"events": args.events, "loss_scale_events": args.events // args.loss_scale_every,
              "file_mib": round(size_mib, 1), "ours_seconds": round(ours[0], 2),
              "ours_peak_mib": round(ours[1])}
    print(f"{args.events} events ({result['loss_scale_events']} with loss_scale/*), {size_mib:.0f} MiB")
    print(f"lossscale-callbacks report: {ours[0]:.2f} s, peak {ours[1]:.0f} MiB")
    if not args.skip_tensorboard:
        theirs = measure(TB_READ, folder)
        result.update(tensorboard_seconds=round(theirs[0], 2), tensorboard_peak_mib=round(theirs[1]),
                      ratio_seconds=round(ours[0] / theirs[0], 3))
        print(f"TensorBoard EventAccumulator (all scalars): {theirs[0]:.2f} s, peak {theirs[1]:.0f} MiB")
        print(f"ours / TensorBoard's: {ours[0] / theirs[0]:.3f} (time)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return result


if __name__ == "__main__":
    main()
