"""Whether a file is another engine's log or a Trainer state, by its first 64 KiB (what ``report`` reads).

Example:
    >>> looks_like_engine_log("no/such/train.log")
    False
"""

from __future__ import annotations

import os

from lossscale_callbacks._engine_parsers import PARSERS

__all__ = ["ENGINE_LOG", "looks_like_engine_log"]

ENGINE_LOG = "engine_log"
_HEAD_BYTES = 64 * 1024
# Files that are never a log: checkpoints, arrays, data sets, archives, pictures.
_NOT_LOGS = (".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".npy", ".npz", ".pkl", ".pickle", ".h5",
             ".keras", ".onnx", ".msgpack", ".gz", ".zip", ".tar", ".png", ".jpg", ".svg", ".pdf", ".wandb",
             ".csv", ".tsv", ".parquet", ".arrow", ".model", ".yaml", ".yml", ".py")
# What each engine prints once at start, so a log is recognised before its first loss-scale line:
# deepspeed/__init__.py initialize (log_dist "DeepSpeed info: version=..."), deepspeed/runtime/engine.py
# ("DeepSpeedEngine configuration"), megatron/training/arguments.py _print_args("arguments", ...),
# fairseq's logger names (fairseq_cli/train.py format "%(asctime)s | %(levelname)s | %(name)s | ..."),
# apex/amp/frontend.py initialize ("Selected optimization level ..."); versions as in _engine_formats.
_BANNERS = ("DeepSpeed info: version=", "DeepSpeedEngine configuration",
            "------------------------ arguments ------------------------", "| fairseq_cli.train |",
            "| fairseq.trainer |", "Selected optimization level O")


def _has_loss_scale_line(text: str) -> bool:
    parsers = [parser() for parser in PARSERS]
    for line in text.splitlines():
        if any(any(marker in line for marker in p.markers) and p.feed(line) for p in parsers):
            return True
    return False


def looks_like_engine_log(path: str) -> bool:
    """Whether ``path`` is, by its first 64 KiB, another engine's log or a Trainer state (a cheap test).

    A ``.json`` file counts only when it is a Trainer state (it holds ``"log_history"``); a text file
    when it holds an engine's start-up banner or one of its loss-scale lines. A binary file (a NUL
    byte) never counts. The caller passes regular files only (opening a FIFO would block).
    """
    name = os.path.basename(path).lower()
    if name.endswith(_NOT_LOGS) or "tfevents" in name:
        return False
    try:
        with open(path, "rb") as file:
            head = file.read(_HEAD_BYTES)
    except OSError:
        return False
    if b"\0" in head:
        return False
    text = head.decode("utf-8", errors="replace")
    if name.endswith(".json"):
        return '"log_history"' in text
    return any(banner in text for banner in _BANNERS) or _has_loss_scale_line(text)



