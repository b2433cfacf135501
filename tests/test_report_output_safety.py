"""What ``report`` prints can be trusted by a terminal and a script: names escaped, one JSON document always,
counters that are no numbers named, TensorFlow's start-up lines silenced.

Runtime: about 20 s on 2 shared cores (TensorBoard runs of a few points, one subprocess).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from lossscale_callbacks import _metrics as m
from lossscale_callbacks._cli import main
from lossscale_callbacks.forensics._gradients import CAUSE_METRICS
from lossscale_callbacks.report import _run_readers as run_readers
from lossscale_callbacks.tensorboard import TensorBoardSink

FORGED = "evil\nforged          9999       0          0.00%      1            OK"
ESCAPES = "\x1b]0;owned\x07\x1b[2J\u202eterm"


def _run(folder, overrides=None, points=5):
    sink = TensorBoardSink(folder)
    for i in range(1, points + 1):
        metrics = {m.SCALE: 1024.0, m.GROWTH_COUNTER: float(i), m.SKIPPED_STEPS: 1.0,
                   m.SKIPPED_IN_INTERVAL: 0.0, m.SKIP_RATE: 0.0}
        sink.write(100 * i, {**metrics, **(overrides or {})} if i == points else metrics)
    sink.close()


def _no_raw_controls(text: str) -> None:
    unsafe = [c for c in text if c != "\n" and (ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 or c == "\u202e")]
    assert unsafe == [], text


def test_a_run_named_with_a_newline_cannot_forge_a_row(tmp_path, capsys):
    for name in (FORGED, "good"):
        _run(tmp_path / name)
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) == 4, out  # header, rule, two runs
    assert any(line.startswith("evil\\nforged") for line in lines)
    assert not any(line.startswith("forged") for line in lines)


@pytest.mark.parametrize("layout", ["table", "summary", "not read"])
def test_escape_sequences_in_a_name_never_reach_the_terminal_raw(tmp_path, capsys, layout):
    _run(tmp_path / ESCAPES)
    if layout == "table":
        _run(tmp_path / "other")
    elif layout == "not read":
        (tmp_path / "good").mkdir()
        _run(tmp_path / "good")
        (tmp_path / ESCAPES / "events.out.tfevents.1.x").write_bytes(b"\x00" * 20)
    main(["report", str(tmp_path)])
    captured = capsys.readouterr()
    _no_raw_controls(captured.out)
    _no_raw_controls(captured.err)
    assert "\\x1b]0;owned\\x07" in captured.out


def test_an_error_naming_a_hostile_path_is_escaped_on_stderr(tmp_path, capsys):
    assert main(["report", str(tmp_path / ESCAPES)]) == 2
    err = capsys.readouterr().err
    _no_raw_controls(err)
    assert "\\x1b[2J" in err


def _cases(tmp_path):
    (tmp_path / "empty").mkdir()
    cut = tmp_path / "cut" / "a"
    cut.mkdir(parents=True)
    (cut / "events.out.tfevents.1.x").write_bytes(b"\x00" * 20)
    (tmp_path / "cut" / "b").mkdir()
    (tmp_path / "cut" / "b" / "events.out.tfevents.1.x").write_bytes(b"\x01" * 20)
    _run(tmp_path / "good")
    return {
        "nothing there": ([str(tmp_path / "missing")], 2),
        "no run found": ([str(tmp_path / "empty")], 2),
        "one run, unreadable": ([str(cut)], 2),
        "none readable": ([str(tmp_path / "cut")], 2),
        "a bad --png name": ([str(tmp_path / "good"), "--png", str(tmp_path / "p.txt")], 2),
        "done": ([str(tmp_path / "good")], 0),
    }


def test_json_is_always_exactly_one_document(tmp_path, capsys):
    for case, (args, status) in _cases(tmp_path).items():
        assert main(["report", *args, "--json"]) == status, case
        payload = json.loads(capsys.readouterr().out)  # one document, nothing before or after it
        assert set(payload) == {"root", "runs", "png", "counts", "error"}, case
        assert (payload["error"] is None) == (status == 0), case
        if case == "one run, unreadable":
            (run,) = payload["runs"]
            assert run["status"] == "unreadable" and "fails its checksum" in run["reason"]


@pytest.mark.parametrize(("tag", "value"), [(m.SKIPPED_STEPS, math.nan), (m.GROWTH_COUNTER, math.inf),
                                            (m.STEPS, -math.inf), (CAUSE_METRICS["grad_inf"], math.nan)])
def test_a_counter_that_is_no_number_is_named(tmp_path, capsys, tag, value):
    _run(tmp_path, {tag: value, **({CAUSE_METRICS["grad_nan"]: 0.0} if tag in CAUSE_METRICS.values()
                                   else {})})
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"the {tag} series holds {value!r} at step 500: not a count" in err
    assert "convert" not in err and "Overflow" not in err


def test_report_silences_what_a_reader_import_writes_to_stderr(tmp_path, capfd, monkeypatch):
    _run(tmp_path)
    load, noisy = run_readers.load_reader, []

    def load_like_tensorflow(name):
        if not noisy:  # a framework logs once, when it is first imported
            noisy.append(name)
            os.write(2, b"I0000 tensorflow/core/util/port.cc:153] oneDNN custom operations are on.\n")
        return load(name)

    monkeypatch.setattr(run_readers, "load_reader", load_like_tensorflow)
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "")  # recorded, so that the teardown puts it back as it was
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL")
    assert main(["report", str(tmp_path)]) == 0
    captured = capfd.readouterr()
    assert noisy and "oneDNN" not in captured.err and "Optimizer steps attempted: 500" in captured.out
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "3"  # a TensorFlow imported later stays quiet too


@pytest.mark.parametrize(("skipped", "said"), [(0.0, True), (3.0, False)])
def test_the_skip_rate_panel_says_when_nothing_was_skipped(tmp_path, skipped, said):
    matplotlib = pytest.importorskip("matplotlib")
    from lossscale_callbacks.report._report_cli import write_png
    from lossscale_callbacks.report._run_report import build_report

    series = {m.SCALE: [(100, 1024.0), (200, 2048.0)], m.SKIPPED_STEPS: [(100, 0.0), (200, skipped)]}
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # text as text, to be read back
        write_png(build_report("run", series), str(tmp_path / "run.svg"), "svg")
    assert ("no skipped steps" in (tmp_path / "run.svg").read_text()) == said


def test_json_is_one_document_when_the_plot_extra_is_missing(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; sys.modules['matplotlib.figure'] = None\n"
            "from lossscale_callbacks._cli import console; sys.exit(console(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "report", "nowhere", "--png", "x.png", "--json"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    payload = json.loads(done.stdout)
    assert done.returncode == 2 and payload["runs"] == [] and "lossscale-callbacks[plot]" in payload["error"]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("lossscale-callbacks: error: report --png needs")
