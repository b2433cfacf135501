"""Test-wide settings: quiet TensorFlow, keep W&B offline and inside temporary folders.

CUDA is never hidden: on a machine with a GPU the CUDA tests run, and the header of the run says
whether they do (and why not, when they are skipped).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_DISABLE_GIT", "true")
os.environ.setdefault("WANDB_CONSOLE", "off")


def _cuda_line() -> str:
    try:
        import torch
    except ImportError:
        return "CUDA tests: skipped (torch is not installed)"
    if not torch.cuda.is_available():
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = (f"CUDA_VISIBLE_DEVICES={hidden!r} hides the GPUs" if hidden is not None and not hidden.strip()
               else f"no CUDA device visible to torch {torch.__version__}")
        return f"CUDA tests: skipped ({why})"
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return f"CUDA tests: run on {names}"


def pytest_report_header(config):
    return _cuda_line()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    terminalreporter.write_line(_cuda_line())
