"""The update paths of the torch scaler: bit-identical to the core's rule, in few dispatched ops."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from aten_ops import AtenOps  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from update_strategies import dynamic_policies, expand, fixed_policies, runs  # noqa: E402

from lossscale_callbacks._policy import DynamicPolicy, FixedPolicy  # noqa: E402
from lossscale_callbacks._update import initial_state  # noqa: E402
from lossscale_callbacks.testing import (  # noqa: E402
    ConformanceCase,
    assert_conforms,
    conformance_cases,
    reference_run,
    stack_states,
)
from lossscale_callbacks.torch._update_paths import (  # noqa: E402
    AmpPath,
    CudaGraphPath,
    PathState,
    RulePath,
    TablePath,
    make_path,
    path_class,
)

CPU = torch.device("cpu")
PATHS = {"amp": AmpPath, "table": TablePath, "rule": RulePath}


def _takes(cls, policy) -> bool:
    # AmpPath is the rule only without hysteresis; the others take any policy.
    return cls is not AmpPath or policy.constants.hysteresis <= 1


def _flag(finite: bool, device=CPU) -> torch.Tensor:
    return torch.full((), 0.0 if finite else 1.0, device=device)


def run_path(cls, policy, finite, device=CPU):
    """The state after every step of ``finite``, stacked like the reference."""
    path = cls(policy, device, PathState.from_host(initial_state(policy)))
    rows = []
    for flag in finite:
        path.update(_flag(bool(flag), device))
        rows.append(path.read())
    return stack_states([r._replace(scale=np.float32(r.scale)) for r in rows])


@pytest.mark.parametrize("name", PATHS)
def test_every_path_reproduces_every_conformance_case(name):
    cls = PATHS[name]
    cases = [c for c in conformance_cases(max_len=600) if _takes(cls, c.policy)]
    assert len(cases) >= 15
    for case in cases:
        assert_conforms(case, run_path(cls, case.policy, case.finite))


hysteresis_1_to_4 = st.integers(1, 4)
any_interval = st.one_of(st.integers(1, 60), st.sampled_from([2000, 2**31 - 1]))
policies = st.one_of(dynamic_policies(hysteresis=hysteresis_1_to_4, intervals=any_interval), fixed_policies)


@settings(max_examples=60, deadline=None)
@given(policy=policies, run_list=runs, name=st.sampled_from(sorted(PATHS)))
def test_every_path_reproduces_the_reference_on_generated_sequences(policy, run_list, name):
    cls = PATHS[name]
    finite = expand(run_list, limit=1500)
    if not finite or not _takes(cls, policy):
        return
    expected = reference_run(policy, finite)
    case = ConformanceCase(f"{name} path", policy, np.asarray(finite), expected)
    assert_conforms(case, run_path(cls, policy, finite))


def test_the_comparison_can_fail():
    """A path that forgets the clamp grows past max_scale, and the comparison says where."""

    class Unclamped(AmpPath):
        def __init__(self, policy, device, start):
            super().__init__(policy, device, start)
            self._high.fill_(float("inf"))

    policy = DynamicPolicy(initial_scale=3.0e4, growth_interval=2, growth_factor=1.7, max_scale=1.0e5)
    finite = [True] * 8
    case = ConformanceCase("unclamped", policy, np.asarray(finite), reference_run(policy, finite))
    with pytest.raises(AssertionError, match="scale differs first at step 5"):
        assert_conforms(case, run_path(Unclamped, policy, finite))


@pytest.mark.parametrize("policy, expected", [
    (DynamicPolicy(), AmpPath), (FixedPolicy(1.0), AmpPath), (DynamicPolicy(hysteresis=2), TablePath),
    (DynamicPolicy(hysteresis=2, growth_interval=2**31 - 1), TablePath),
])
def test_the_path_a_policy_gets(policy, expected):
    assert path_class(policy, CPU) is expected
    assert path_class(policy, torch.device("meta")) is RulePath  # a device the fast paths were not proven on
    assert path_class(DynamicPolicy(hysteresis=3), torch.device("cuda")) is RulePath


def _update_ops(path, finite: bool) -> list[str]:
    flag = _flag(finite)
    with AtenOps() as ops:
        path.update(flag)
    return ops.names


@pytest.mark.parametrize("policy, most", [
    (DynamicPolicy(), 4), (DynamicPolicy(growth_interval=1), 4), (FixedPolicy(128.0), 4),
    (DynamicPolicy(hysteresis=2), 6), (DynamicPolicy(hysteresis=2**31 - 1, growth_interval=2**31 - 1), 6),
])
def test_an_update_dispatches_at_most_4_ops_without_hysteresis_and_6_with(policy, most):
    path = make_path(policy, CPU, PathState.from_host(initial_state(policy)))
    for finite in (True, False, True, True):
        ops = _update_ops(path, finite)
        assert len(ops) <= most, ops
    assert len(_update_ops(RulePath(policy, CPU, PathState.from_host(initial_state(policy))), True)) > 20


def test_a_path_built_from_another_on_the_device_continues_the_same_sequence():
    """A policy change (set_growth_factor...) rebuilds the path from the device state, nothing read back."""
    policy = DynamicPolicy(initial_scale=2.0**10, growth_interval=5, hysteresis=2, growth_factor=1.7)
    finite = [True] * 4 + [False] + [True] * 7 + [False, False, True]
    path = TablePath(policy, CPU, PathState.from_host(initial_state(policy)))
    for flag in finite[:7]:
        path.update(_flag(flag))
    for cls in (RulePath, TablePath, RulePath):
        path = cls(policy, CPU, path.export())
    for flag in finite[7:]:
        path.update(_flag(flag))
    state = path.read()
    expected = reference_run(policy, finite)
    assert (np.float32(state.scale), *state[1:]) == tuple(np.asarray(f)[-1] for f in expected)


@pytest.mark.parametrize("cls", [AmpPath, TablePath, RulePath])
def test_a_shorter_interval_caps_the_counter_and_keeps_the_trajectory(cls):
    """growth_counter >= a new, shorter interval grows at the next finite step, exactly as the rule does."""
    long, short = DynamicPolicy(growth_interval=10), DynamicPolicy(growth_interval=3)
    path = cls(long, CPU, PathState.from_host(initial_state(long)))
    for _ in range(6):
        path.update(_flag(True))
    path = cls(short, CPU, path.export())
    assert path.read().growth_counter == 2  # capped to the largest value the new interval allows
    path.update(_flag(True))
    assert path.read()[:2] == (2.0**16, 0)  # grown, as next_state grows any counter >= interval


def test_counters_from_a_checkpoint_beyond_float_precision_stay_exact():
    policy = DynamicPolicy(hysteresis=2)
    big = 2**62 + 1
    start = PathState(1024.0, 3, 2, big - 5, big)
    for cls in PATHS.values():
        if not _takes(cls, policy):
            continue
        path = cls(policy, CPU, start)
        path.update(_flag(False))
        state = path.read()
        assert (state.skipped_steps, state.steps) == (big - 4, big + 1)
        assert int(path.tensors().skipped_steps) == big - 4


@pytest.mark.parametrize("cls", [AmpPath, TablePath, RulePath])
def test_the_cuda_graph_wrapper_answers_every_name_a_path_has(cls):
    """The scaler reads its path by these names whatever the device; on CUDA the path is wrapped, and a
    name the wrapper lacks fails only there (``device`` did, on the first GPU run). Built around a CPU
    path: the constructor runs no CUDA op, and the names are what is compared."""
    policy = DynamicPolicy(growth_interval=3)
    inner = cls(policy, CPU, PathState.from_host(initial_state(policy)))
    wrapped = CudaGraphPath(inner)
    names = {n for n in dir(inner) if not n.startswith("_")} - {"device_step", "recorded_step", "after_step"}
    missing = sorted(n for n in names if not hasattr(wrapped, n))
    assert not missing, f"CudaGraphPath lacks {missing}"
    assert wrapped.device == inner.device and wrapped.policy is inner.policy
    assert wrapped.scale is inner.scale and wrapped.steps == inner.steps
    assert wrapped.read() == inner.read()


@pytest.mark.cuda
@pytest.mark.parametrize("policy", [DynamicPolicy(growth_interval=3),
                                    DynamicPolicy(hysteresis=3, growth_interval=2), FixedPolicy(8.0)])
def test_on_cuda_a_captured_graph_conforms_in_two_launches(policy):
    device = torch.device("cuda")
    finite = [True, True, False, True, True, True, False, False, True] * 20
    path = make_path(policy, device, PathState.from_host(initial_state(policy)))
    rows = []
    for i, flag in enumerate(finite):
        f = _flag(flag, device)
        if i == 1:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            with AtenOps() as ops:
                path.update(f)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if i >= 1:
            assert len(ops) <= 2, ops.names
        rows.append(path.read())
    assert path.name.startswith("cuda_graph")
    expected = reference_run(policy, finite)
    case = ConformanceCase("cuda graph", policy, np.asarray(finite), expected)
    assert_conforms(case, stack_states([r._replace(scale=np.float32(r.scale)) for r in rows]))


@pytest.mark.parametrize("cls", [AmpPath, RulePath])
def test_the_float32_skip_count_is_folded_into_the_exact_count_in_time(cls, monkeypatch):
    """Skips are summed in float32 (exact to 2**24) and folded into float64 every 2**20 steps; here
    every 3 steps, on a sequence of 50 overflows and finite steps, with the count read in between."""
    from lossscale_callbacks.torch import _update_paths as update_paths

    monkeypatch.setattr(update_paths, "_FOLD_EVERY", 3)
    policy = DynamicPolicy(growth_interval=4)
    finite = [bool(i % 3) for i in range(50)]
    case = ConformanceCase("folded", policy, np.asarray(finite), reference_run(policy, finite))
    assert_conforms(case, run_path(cls, policy, finite))
    path = cls(policy, CPU, PathState.from_host(initial_state(policy)))
    for flag in finite[:7]:
        path.update(_flag(flag))
    # two skips folded after steps 3 and 6, the 7th step's skip not yet
    assert (path._since_fold, float(path._skipped_new), float(path._recent)) == (1, 2.0, 1.0)
    assert cls(policy, CPU, path.export()).read() == path.read()
