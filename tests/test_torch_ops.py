"""The core's update rule on torch tensors reproduces the NumPy reference bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from lossscale_callbacks._state import STATE_FIELDS, LossScaleState  # noqa: E402
from lossscale_callbacks._update import initial_state, next_state  # noqa: E402
from lossscale_callbacks.testing import assert_conforms, conformance_cases  # noqa: E402
from lossscale_callbacks.torch._ops import TorchOps  # noqa: E402


def _run_torch(case, device: str = "cpu") -> LossScaleState:
    ops = TorchOps(device)
    flags = torch.as_tensor(case.finite, device=device)
    state = initial_state(case.policy, ops)
    rows = []
    for t in range(flags.shape[0]):
        state = next_state(case.policy, state, flags[t], ops)
        rows.append(state)
    # One host read per field at the end; the loop itself never leaves the device.
    stacked = {f: torch.stack([getattr(r, f) for r in rows]).cpu().numpy() for f in STATE_FIELDS}
    return LossScaleState(**stacked)


def test_every_conformance_case_is_bit_identical_on_cpu():
    cases = conformance_cases()
    assert len(cases) == 31
    for case in cases:
        actual = _run_torch(case)
        assert actual.scale.dtype == np.float32
        assert actual.steps.dtype == np.int64
        assert_conforms(case, actual)


def test_a_wrong_backend_is_caught():
    """The comparison must be able to fail: float64 arithmetic on the scale differs from the reference."""

    class Float64Ops(TorchOps):
        def scale(self, value):
            return torch.full((), float(value), dtype=torch.float64)

    case = next(c for c in conformance_cases(num_random=0) if c.name == "odd_factors_to_cap")
    ops = Float64Ops("cpu")
    state, rows = initial_state(case.policy, ops), []
    for flag in case.finite:
        state = next_state(case.policy, state, bool(flag), ops)
        rows.append(state)
    actual = LossScaleState(**{f: torch.stack([getattr(r, f) for r in rows]).numpy() for f in STATE_FIELDS})
    actual = actual._replace(scale=actual.scale.astype(np.float32))
    with pytest.raises(AssertionError, match="scale differs"):
        assert_conforms(case, actual)


def test_python_bools_and_float_flags_are_accepted():
    ops = TorchOps("cpu")
    case = conformance_cases(num_random=0)[0]
    a = next_state(case.policy, initial_state(case.policy, ops), False, ops)
    b = next_state(case.policy, initial_state(case.policy, ops), torch.tensor(0.0) != 0, ops)
    assert torch.equal(a.scale, b.scale) and int(a.skipped_steps) == 1


@pytest.mark.cuda
def test_conformance_on_cuda():
    for case in conformance_cases(num_random=8, max_len=300):
        assert_conforms(case, _run_torch(case, "cuda"))
