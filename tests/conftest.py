"""Test-wide settings: quiet TensorFlow, keep W&B offline and inside temporary folders.

CUDA is never hidden: on a machine with a GPU the CUDA tests run, and the header of the run says
whether they do (and why not, when they are skipped). A CUDA test carries ``@pytest.mark.cuda``:
it is skipped, with that reason, where torch sees no CUDA device, and the summary line counts the
CUDA tests collected. ``pytest -m cuda`` selects them (``python3 dev.py gpu`` runs them).

The slow subprocess runs that several tests read (a Keras backend's check scripts, the Ray session, the
pages' scripts) start at the start of the session and run beside the other tests (``background.py``);
the tests that read them run last.
"""

import os

import background
import keras_backend_runs
import pytest
from hypothesis import settings

# Property tests are judged on their examples, not their speed: a per-example deadline turns a busy
# shared CI machine into flaky failures (DeadlineExceeded) that say nothing about the code.
# Under CI the examples are Hypothesis's own "ci" profile's (derandomized: the same examples every run,
# so a red CI is a change in the code, not a new draw); a developer's run draws new ones each time.
settings.register_profile("lossscale", deadline=None)
settings.register_profile("lossscale-ci", settings.get_profile("ci"), deadline=None)
settings.load_profile("lossscale-ci" if os.environ.get("CI") else "lossscale")

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_DISABLE_GIT", "true")
os.environ.setdefault("WANDB_CONSOLE", "off")

_CUDA_TESTS = pytest.StashKey[int]()


def _cuda_devices() -> tuple[str | None, str]:
    """The CUDA devices torch sees (None when none), and the reason when none."""
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = (f"CUDA_VISIBLE_DEVICES={hidden!r} hides the GPUs" if hidden is not None and not hidden.strip()
               else f"no CUDA device visible to torch {torch.__version__}")
        return None, why
    return ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())), ""


def _cuda_line(config=None) -> str:
    devices, why = _cuda_devices()
    count = config.stash.get(_CUDA_TESTS, None) if config is not None else None
    tests = "" if count is None else f": {count} test{'s' * (count != 1)} marked cuda"
    if devices is None:
        return f"CUDA tests: skipped ({why}){tests}"
    return f"CUDA tests: run on {devices}{tests}"


def pytest_report_header(config):
    return _cuda_line()


def _starter(item):
    """The function that starts the background runs of ``item``'s module, or None."""
    module = getattr(item, "module", None)
    if getattr(module, "KERAS_CHECKS", None):
        return keras_backend_runs.start_in_background
    return getattr(module, "start_in_background", None)


@pytest.hookimpl(trylast=True)  # after -m/-k have deselected: count what runs
def pytest_collection_modifyitems(config, items):
    if background.SESSION.lanes > 0:  # the tests reading background runs go last (stable: modules stay whole)
        items.sort(key=lambda item: _starter(item) is not None)
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    config.stash[_CUDA_TESTS] = len(cuda_items)
    devices, why = _cuda_devices()
    if devices is None:
        skip = pytest.mark.skip(reason=f"needs a CUDA device ({why})")
        for item in cuda_items:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    terminalreporter.write_line(_cuda_line(config))
    line = background.SESSION.summary()
    if line:
        terminalreporter.write_line(line)


@pytest.fixture(scope="session", autouse=True)
def _background_runs(request, tmp_path_factory):
    """Before the first test: the background runs that this session's tests read, started."""
    starters = {}
    for item in request.session.items:
        starter = _starter(item)
        if starter is not None:
            starters.setdefault(starter, None)
    for starter in starters:
        starter(request.session.items, tmp_path_factory)
    background.SESSION.start()
    yield
    background.SESSION.stop()
