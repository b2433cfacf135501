"""``lossscale-callbacks check`` bounds what a model file costs and says what it needs (issues 19 and 24).

Each case failed on main at 52cfc0a: a zip bomb was inflated (+1 GiB), ``--batch-size 10**14`` printed
TensorFlow's shape error about other numbers, a deep chain was "not a model this check can read
(RecursionError)", and a missing Keras said ``No module named 'keras'``.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import threading
import tracemalloc
import zipfile

import background
import pytest

from lossscale_callbacks._cli import build_parser
from lossscale_callbacks.alignment._alignment_cli import add_check_parser, run_check
from lossscale_callbacks.alignment._check_limits import (
    MAX_BATCH_SIZE,
    ArchiveTooLargeError,
    ModelTooDeepError,
    check_archive,
    check_batch_size,
    run_deep,
)

PIP_KERAS = 'pip install "lossscale-callbacks[keras]" tensorflow'


def _cli(argv):
    parser = argparse.ArgumentParser(prog="lossscale-callbacks")
    add_check_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def _one_error_line(err: str) -> str:
    (line,) = err.strip().splitlines()
    assert line.startswith("lossscale-callbacks check: error: ") and "Traceback" not in err
    return line


@pytest.fixture(scope="module")
def bomb(tmp_path_factory):
    """A 0.5 MiB .keras whose config.json inflates to 512 MiB (the issue's zip bomb)."""
    path = tmp_path_factory.mktemp("bomb") / "bomb.keras"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("metadata.json", '{"keras_version": "3.15.1"}')
        with archive.open("config.json", "w", force_zip64=True) as member:
            piece = b" " * 2**20
            for _ in range(512):
                member.write(piece)
    assert path.stat().st_size < 2**20
    return path


def test_a_zip_bomb_is_refused_before_anything_is_inflated(bomb):
    tracemalloc.start()
    try:
        with pytest.raises(ArchiveTooLargeError, match=r"would inflate to 512 MiB \(config\.json: 512 MiB "):
            check_archive(str(bomb))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20
    check_archive(str(bomb), max_unzipped_mib=1024)  # raised, it inflates what it declares, piece by piece


def test_the_check_command_refuses_the_bomb_naming_the_flag(bomb):
    pytest.importorskip("keras")
    pytest.importorskip("tensorflow")
    err = io.StringIO()
    tracemalloc.start()
    try:
        assert run_check(_cli(["check", str(bomb)]), err=err) == 2
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    line = _one_error_line(err.getvalue())
    assert "more than the 256 MiB the check inflates from a model file: a zip bomb" in line
    assert "--max-unzipped-mib sets the limit" in line
    assert peak < 64 * 2**20


def test_a_member_that_does_not_inflate_to_what_it_declares_is_refused(tmp_path):
    path = tmp_path / "m.keras"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr("config.json", b"{" + b" " * 100 + b"}")
    data = bytearray(path.read_bytes())
    data[data.index(b"{ ") + 1] = ord("x")  # the stored bytes no longer match their CRC
    path.write_bytes(bytes(data))
    with pytest.raises(ArchiveTooLargeError, match=r"config\.json does not inflate to the 102 bytes it"):
        check_archive(str(path))


def test_a_file_that_is_not_an_archive_is_left_to_the_loader(tmp_path):
    path = tmp_path / "legacy.h5"
    path.write_bytes(b"\x89HDF\r\n\x1a\n")
    check_archive(str(path))
    with pytest.raises(ValueError, match="max_unzipped_mib must be a number > 0, got 0"):
        check_archive(str(path), 0)


def test_a_batch_size_tensorflow_cannot_trace_is_refused_by_name(capsys):
    check_batch_size(MAX_BATCH_SIZE)
    for bad in (0, MAX_BATCH_SIZE + 1, 10**14, True, 8.0):
        with pytest.raises(ValueError, match="batch_size must be an integer from 1 to 2147483647"):
            check_batch_size(bad)
    with pytest.raises(SystemExit):
        _cli(["check", "m.keras", "--batch-size", str(10**14)])
    err = capsys.readouterr().err
    assert "--batch-size must be an integer from 1 to 2147483647, got '100000000000000'" in err
    assert "32-bit integers" in err


def test_check_model_file_refuses_the_batch_size_by_name(tmp_path):
    pytest.importorskip("tensorflow")
    from lossscale_callbacks.keras._alignment import check_model_file

    with pytest.raises(ValueError, match="batch_size must be an integer from 1 to 2147483647"):
        check_model_file(str(tmp_path / "m.keras"), batch_size=10**14)


def test_run_deep_gives_the_frames_or_says_it_ran_out():
    def depth(n):
        return 0 if n == 0 else 1 + depth(n - 1)

    limit, stack = sys.getrecursionlimit(), threading.stack_size()
    assert run_deep(lambda: depth(5000), 10_000) == 5000
    with pytest.raises(ModelTooDeepError, match="needs more than 2000 Python frames") as info:
        run_deep(lambda: depth(5000), 2000)
    assert info.value.limit == 2000
    assert (sys.getrecursionlimit(), threading.stack_size()) == (limit, stack)
    with pytest.raises(KeyError):
        run_deep(lambda: {}["x"])
    with pytest.raises(ValueError, match="recursion_limit must be an integer >= 100"):
        run_deep(lambda: 0, 50)


_BUILD_CHAIN = ("import sys, threading, keras\n"
                "def build():\n"
                "    x = inp = keras.Input((2,))\n"
                "    for _ in range(1000): x = keras.layers.Dense(2)(x)\n"
                "    keras.Model(inp, x).save('chain.keras')\n"
                "sys.setrecursionlimit(20000); threading.stack_size(512 << 20)\n"
                "worker = threading.Thread(target=build); worker.start(); worker.join()\n")
_CHAIN_FOLDER: list = []  # where the chain is built in the background runs


def start_in_background(items, tmp_path_factory) -> None:
    """The chain (10 to 20 s to build) is built beside the other tests (``tests/background.py``)."""
    index = next((i for i, item in enumerate(items) if item.module.__name__ == __name__
                  and "chain" in getattr(item, "fixturenames", ())), None)
    if index is not None and _has_keras_and_tensorflow():
        folder = tmp_path_factory.mktemp("chain")
        background.submit("chain", [sys.executable, "-c", _BUILD_CHAIN], timeout=600, cwd=str(folder),
                          env=dict(os.environ, KERAS_BACKEND="tensorflow"), order=index)
        _CHAIN_FOLDER.append(folder)


def _has_keras_and_tensorflow() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("keras", "tensorflow"))


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """The issue's saved chain of 1000 Dense layers (built with a raised recursion limit in a subprocess)."""
    pytest.importorskip("keras")
    pytest.importorskip("tensorflow")
    folder = _CHAIN_FOLDER[0] if background.submitted("chain") else tmp_path_factory.mktemp("chain")
    built = background.result("chain", [sys.executable, "-c", _BUILD_CHAIN], timeout=600, cwd=str(folder),
                              env=dict(os.environ, KERAS_BACKEND="tensorflow"))
    assert built.returncode == 0 and not built.timed_out, built.failure()
    return folder / "chain.keras"


@pytest.mark.slow
def test_a_1000_layer_chain_is_checked_and_a_deeper_one_named_as_such(chain):
    out = io.StringIO()  # main: "is not a model this check can read (RecursionError: ...)"
    assert run_check(_cli(["check", str(chain), "--fail-on", "never"]), out=out) == 0
    assert "Exit status 0" in out.getvalue()
    err = io.StringIO()
    assert run_check(_cli(["check", str(chain), "--recursion-limit", "300"]), err=err) == 2
    line = _one_error_line(err.getvalue())
    assert "needs more than --recursion-limit 300 Python frames (it is nested too deeply for that)" in line
    assert "--recursion-limit 1200" in line and "RecursionError" not in line


def _check_without(packages, *argv, entry="console"):
    hide = "".join(f"sys.modules[{p!r}] = None; " for p in packages)
    code = (f"import sys; {hide}from lossscale_callbacks import _cli as cli; "
            f"sys.exit(cli.{entry}(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, "check", *argv], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("missing", [["keras"], ["tensorflow"], ["keras", "tensorflow"]])
def test_a_missing_keras_or_tensorflow_is_named_with_the_install_command(tmp_path, missing):
    path = tmp_path / "m.keras"
    path.write_bytes(b"PK")
    done = _check_without(missing, str(path))
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("lossscale-callbacks: error: check needs Keras and its TensorFlow backend: ")
    assert PIP_KERAS in line and line.endswith(f"not installed: {', '.join(missing)}")
    # main() itself raises the ImportError, for callers and the wheel's extras probes
    raised = _check_without(missing, str(path), entry="main")
    assert raised.returncode == 1 and "MissingExtraError: check needs Keras" in raised.stderr


def test_help_says_what_each_command_needs(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps at the terminal's width: no line breaks in words
    parser = build_parser()
    top = parser.format_help()
    assert "needs the [tensorboard] and/or [wandb] extra" in top
    assert "needs the [keras] extra and TensorFlow" in top
    commands = parser._subparsers._group_actions[0].choices
    report, check = commands["report"].format_help(), commands["check"].format_help()
    for extra in ("tensorboard", "wandb", "plot"):
        assert f'pip install "lossscale-callbacks[{extra}]"' in report
    assert PIP_KERAS in check and "--max-unzipped-mib" in check and "--recursion-limit" in check
