"""Both run readers: a file cut short is said to be cut short, and memory stays bounded by a constant.

Runtime: about 15 to 30 s on 2 shared cores (one W&B offline run, three subprocesses reading 256 MiB sparse
tails).
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest
import wandb
from report_json import the_read_run

from lossscale_callbacks import _metrics as m
from lossscale_callbacks._cli import main
from lossscale_callbacks.report._run_readers import RunReadError
from lossscale_callbacks.tensorboard import TensorBoardSink
from lossscale_callbacks.tensorboard._reader import masked_crc32c_rows
from lossscale_callbacks.tensorboard._reader import read_run as read_tensorboard
from lossscale_callbacks.wandb import WandbSink
from lossscale_callbacks.wandb._reader import read_run as read_wandb
from lossscale_callbacks.wandb._reader import wait_until_finished

STEPS = 200
TAIL = 256 * 2**20  # the sparse tail: no disk used, and a reader that holds it shows it in its peak


def _write(sink) -> None:
    for step in range(1, STEPS + 1):
        sink.write(step, {m.SCALE: 1024.0, m.GROWTH_COUNTER: float(step % 7),
                          m.SKIPPED_STEPS: float(step // 10), m.SKIPPED_IN_INTERVAL: 0.0, m.SKIP_RATE: 0.0})
    sink.close()


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory):
    """The ``.wandb`` file of a finished offline run that logged :data:`STEPS` steps."""
    folder = tmp_path_factory.mktemp("wandb")
    _write(WandbSink(project="t", dir=str(folder), mode="offline"))
    if wandb.run is not None:
        wandb.run.finish()
    (run_dir,) = (folder / "wandb").glob("offline-run-*")
    wait_until_finished(str(run_dir))
    (run_file,) = run_dir.glob("*.wandb")
    return run_file


@pytest.fixture
def tensorboard_run(tmp_path):
    folder = tmp_path / "good"
    _write(TensorBoardSink(folder))
    (event_file,) = folder.glob("events.out.tfevents.*")
    return event_file


def _copy(run_file, tmp_path):
    target = tmp_path / "run" / run_file.name
    target.parent.mkdir()
    shutil.copyfile(run_file, target)
    return target


def test_a_wandb_file_cut_in_the_middle_is_read_as_cut_short(wandb_run, tmp_path, capsys):
    cut = _copy(wandb_run, tmp_path)
    data = cut.read_bytes()
    cut.write_bytes(data[: len(data) // 2 + 3])  # inside a chunk, far from the exit record
    series = read_wandb(str(cut))
    assert 0 < series[m.SCALE][-1][0] < STEPS
    (note,) = series.notes
    assert " ends inside the record at byte " in note and "cut short" in note
    assert main(["report", str(cut.parent), "--json"]) == 0
    payload = the_read_run(capsys.readouterr().out)
    assert payload["notes"] == [note] and payload["steps"] == series[m.SCALE][-1][0]


def test_a_wandb_file_cut_at_a_record_boundary_says_the_exit_record_is_missing(wandb_run, tmp_path):
    cut = _copy(wandb_run, tmp_path)
    data = cut.read_bytes()
    block = 32 * 1024
    cut.write_bytes(data[: block * (len(data) // block // 2)])  # a whole number of blocks
    series = read_wandb(str(cut))
    assert series[m.SCALE][-1][0] < STEPS and len(series.notes) == 1
    assert "cut short" in series.notes[0]


def test_a_file_cut_inside_its_first_record_cannot_be_read_by_either_reader(wandb_run, tensorboard_run,
                                                                            tmp_path):
    cut = _copy(wandb_run, tmp_path)
    cut.write_bytes(cut.read_bytes()[:20])
    tensorboard_run.write_bytes(tensorboard_run.read_bytes()[:20])
    for read, path in ((read_wandb, cut), (read_tensorboard, tensorboard_run)):
        with pytest.raises(RunReadError, match="not one whole record"):
            read(str(path))


def test_a_tensorboard_run_cut_to_20_bytes_beside_a_good_run_fails_the_check(tensorboard_run, tmp_path,
                                                                            capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / tensorboard_run.name).write_bytes(tensorboard_run.read_bytes()[:20])
    assert main(["report", str(tmp_path), "--fail-unhealthy"]) == 1
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if line.strip().startswith("bad"))
    assert "not read" in row and "not one whole record" in row and "no loss-scale" not in row
    assert main(["report", str(tmp_path), "--json"]) == 0
    runs = {run["path"]: run for run in json.loads(capsys.readouterr().out)["runs"]}
    assert runs[str(bad)]["status"] == "unreadable"


def test_a_cut_or_empty_file_beside_a_good_one_in_a_run_is_left_out(tensorboard_run, tmp_path):
    folder = tensorboard_run.parent
    (folder / "events.out.tfevents.2.cut").write_bytes(tensorboard_run.read_bytes()[:20])
    (folder / "events.out.tfevents.3.empty").write_bytes(b"")
    series = read_tensorboard(str(folder))
    assert len(series[m.SCALE]) == STEPS
    (damage,) = series.damage  # a cut file lost what was written to it
    assert "events.out.tfevents.2.cut: not one whole record" in damage
    assert damage.endswith("(the file is left out)")
    assert series.notes == [f"{folder / 'events.out.tfevents.3.empty'} is empty (left out)"]  # lost nothing
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "events.out.tfevents.1.empty").write_bytes(b"")
    with pytest.raises(RunReadError, match="not one whole record"):
        read_tensorboard(str(alone))


def _tensorboard_header(length: int) -> bytes:
    head = struct.pack("<Q", length)
    crc = masked_crc32c_rows(np.frombuffer(head, dtype=np.uint8).reshape(1, -1))[0]
    return head + struct.pack("<I", int(crc))


_PEAK = textwrap.dedent("""
    import json, resource, sys, time
    from lossscale_callbacks.{reader}._reader import read_run
    def peak():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    read_run(sys.argv[1])  # imports, caches and the run itself
    base, start = peak(), time.perf_counter()
    series = read_run(sys.argv[2])
    seconds, notes = time.perf_counter() - start, json.dumps(series.notes)
    print(peak() - base, seconds, len(series["loss_scale/scale"]), notes)
""")


def _extra_peak(reader: str, plain, tailed) -> tuple[int, float, int, list[str]]:
    """Peak memory (bytes) that reading ``tailed`` adds over reading ``plain``, in a fresh process."""
    done = subprocess.run([sys.executable, "-c", _PEAK.format(reader=reader), str(plain), str(tailed)],
                          capture_output=True, text=True, timeout=240, check=True)
    extra, seconds, points, notes = done.stdout.strip().split(" ", 3)
    return int(extra), float(seconds), int(points), json.loads(notes)


def _sparse_tail(path, size: int) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(size)


@pytest.mark.parametrize("length", [2**40, TAIL - 16], ids=["past-the-end", "all-there"])
def test_tensorboard_memory_does_not_grow_with_a_long_record(tensorboard_run, tmp_path, length):
    tailed = tmp_path / "tailed" / tensorboard_run.name
    tailed.parent.mkdir()
    shutil.copyfile(tensorboard_run, tailed)
    with open(tailed, "ab") as handle:
        handle.write(_tensorboard_header(length))
    _sparse_tail(tailed, tailed.stat().st_size + TAIL)
    extra, seconds, points, notes = _extra_peak("tensorboard", tensorboard_run, tailed)
    print(f"tensorboard {length}: +{extra / 2**20:.1f} MiB, {seconds:.2f} s")
    assert extra < 64 * 2**20 and points == STEPS, (extra, points)
    assert bool(notes) == (length == 2**40)
    assert seconds < 20  # linear: about 2 s on 2 shared cores; a loaded CI machine gets slack


def test_wandb_memory_does_not_grow_with_a_sparse_tail(wandb_run, tmp_path):
    tailed = _copy(wandb_run, tmp_path)
    _sparse_tail(tailed, tailed.stat().st_size + TAIL)
    extra, seconds, points, _ = _extra_peak("wandb", wandb_run, tailed)
    print(f"wandb: +{extra / 2**20:.1f} MiB, {seconds:.2f} s")
    assert extra < 64 * 2**20 and points == STEPS, (extra, points)
    assert seconds < 20  # linear: about 2 s on 2 shared cores; a loaded CI machine gets slack


def _wandb_file(path, records: list[bytes]) -> None:
    """A ``.wandb`` file framed as W&B's writer frames it: 32 KiB blocks of checksummed chunks."""
    out = bytearray(struct.pack("<4sHB", b":W&B", 0xBEE1, 0))
    block = 32 * 1024
    for record in records:
        first = True
        while True:
            left = block - len(out) % block
            if left < 7:
                out += bytes(left)
                continue
            piece, record = record[: left - 7], record[left - 7:]
            kind = (1 if not record else 2) if first else (4 if not record else 3)
            crc = zlib.crc32(piece, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF
            out += struct.pack("<IHB", crc, len(piece), kind) + piece
            first = False
            if not record:
                break
    path.write_bytes(bytes(out))


def test_a_wandb_record_longer_than_the_reader_holds_is_left_out_as_damage(tmp_path):
    from wandb.proto import wandb_internal_pb2

    def history(step: int, padding: int = 0) -> bytes:
        record = wandb_internal_pb2.Record()
        for key, value in (("loss_scale/scale", 1024), ("_step", step), ("pad", "x" * padding)):
            item = record.history.item.add()
            item.key, item.value_json = key, json.dumps(value)
        return record.SerializeToString()

    path = tmp_path / "run-x.wandb"
    _wandb_file(path, [history(1), history(2, padding=17 * 2**20), history(3)])
    series = read_wandb(str(path))
    assert series[m.SCALE] == [(1, 1024.0), (3, 1024.0)]
    (damage,) = series.damage
    assert "is longer than the 16777216 bytes this reader holds at once (left out)" in damage
