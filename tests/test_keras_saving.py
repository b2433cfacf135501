"""The Keras LossScaleOptimizer's state on its way out and back in: one host read, saved models, bad files.

- ``read_state()`` is one device-to-host copy (issue 21), counted on TensorFlow's eager tensors.
- A model trained with ``LossScaleCallback`` and saved with ``model.save()`` loads in a process that never
  imports this library (Keras' own class, compiled, with the scale and counter) when Keras can run the
  policy, says what it needs otherwise, and comes back as ours, state included, where the library is
  imported (issue 19).
- A ``model.weights.h5`` holding a bad loss-scale state is refused through the core's state gate (issue 24).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import zipfile

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
h5py = pytest.importorskip("h5py")

from tensorflow.python.framework import ops as tf_framework_ops  # noqa: E402

from lossscale_callbacks._policy import DynamicPolicy, FixedPolicy  # noqa: E402
from lossscale_callbacks._state import LossScaleState  # noqa: E402
from lossscale_callbacks.keras._callback import LossScaleCallback  # noqa: E402
from lossscale_callbacks.keras._optimizer import LossScaleOptimizer  # noqa: E402

POLICY = DynamicPolicy(initial_scale=2.0**10, growth_interval=50, hysteresis=2)
STATE = {"scale": 1234.5678, "growth_counter": 7, "hysteresis_left": 1, "skipped_steps": 3,
         "steps": 2**40 + 5}


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.fixture
def host_copies(monkeypatch):
    """Counts the copies of eager tensors to the host: ``.numpy()``, ``__array__``, ``float()``, variable
    reads (all through ``_numpy``) and ``keras.ops.convert_to_numpy`` (NumPy's buffer protocol, which the
    former does not see)."""
    copies = []
    numpy_of = tf_framework_ops._EagerTensorBase._numpy
    to_numpy = keras.ops.convert_to_numpy

    def counted_numpy(self):
        copies.append("numpy")
        return numpy_of(self)

    def counted_convert(x):
        copies.append("convert_to_numpy")
        return to_numpy(x)

    monkeypatch.setattr(tf_framework_ops._EagerTensorBase, "_numpy", counted_numpy)
    monkeypatch.setattr(keras.ops, "convert_to_numpy", counted_convert)
    return copies


def _built_optimizer(policy=POLICY, state=STATE):
    var = keras.Variable(np.ones(3, "float32"))
    opt = LossScaleOptimizer(keras.optimizers.Adam(), policy=policy)
    opt.build([var])
    opt.assign_state(state)
    return opt


# ---- issue 21: one host read ----

def test_read_state_is_one_host_copy_and_bit_exact(host_copies):
    opt = _built_optimizer()
    state = opt.read_state()
    assert len(host_copies) == 1
    assert state == LossScaleState(np.float32(1234.5678), 7, 1, 3, 2**40 + 5)  # int64 beyond int32, exact
    assert type(state.scale) is np.float32 and all(type(c) is np.int64 for c in state[1:])
    host_copies.clear()
    per_variable = [np.asarray(v.numpy()) for v in opt.state_variables]  # what one read replaces
    assert len(host_copies) == 5
    assert [x.tobytes() for x in per_variable] == [np.asarray(x).tobytes() for x in state]


def test_read_state_keeps_every_float32_scale_bit():
    rng = np.random.default_rng(0)
    random = np.exp2(rng.uniform(0.0, 24.0, 50)).astype(np.float32).tolist()
    scales = [*random, 1.0, 2.0**24, float(np.nextafter(np.float32(1), 2))]
    opt = _built_optimizer(DynamicPolicy())
    for scale in scales:
        opt.assign_state({"scale": scale})
        assert opt.read_state().scale.tobytes() == np.float32(scale).tobytes()


def test_read_forensics_reuses_the_state_just_read(host_copies):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), diagnose=True).watch(model)
    opt.build(model.trainable_variables)
    state = opt.read_state()
    host_copies.clear()
    given = opt.read_forensics(state)
    reads_with_state = len(host_copies)
    host_copies.clear()
    opt.read_forensics()
    assert len(host_copies) == reads_with_state + 1 and given.step == 0


# ---- issue 24: a bad state in model.weights.h5 is refused ----

@pytest.fixture
def saved(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=LossScaleOptimizer(keras.optimizers.Adam(), policy=POLICY), loss="mse")
    model.optimizer.build(model.trainable_variables)
    model.optimizer.assign_state(STATE)
    path = tmp_path / "good.keras"
    model.save(path)
    return path


def _corrupted(path, dataset, value, out):
    """A copy of the ``.keras`` file at ``path`` with one dataset of its ``model.weights.h5`` rewritten."""
    with zipfile.ZipFile(path) as src:
        weights = io.BytesIO(src.read("model.weights.h5"))
        with h5py.File(weights, "r+") as f:
            f[dataset][()] = value
        with zipfile.ZipFile(out, "w") as dst:
            for name in src.namelist():
                dst.writestr(name, weights.getvalue() if name == "model.weights.h5" else src.read(name))
    return out


# Keras' own LossScaleOptimizer layout: [iteration, learning_rate, step_counter, dynamic_scale, inner...]
SCALE = "optimizer/vars/3"
COUNTER = "optimizer/vars/2"
HYSTERESIS, SKIPPED, STEPS = (f"optimizer/loss_scale_counters/vars/{i}" for i in range(3))
BAD_FILES = [
    (SCALE, np.nan, "scale must be a finite number"),
    (SCALE, np.inf, "scale must be a finite number"),
    (SCALE, 0.0, "scale must be a finite number"),
    (SCALE, -1024.0, "scale must be a finite number"),
    (SCALE, 2.0**30, r"scale must be a finite number in \[1, 1.67772e\+07\]"),
    (COUNTER, -1, "growth_counter must be an integer in"),
    (HYSTERESIS, 3, r"hysteresis_left must be in \[0, 2\]"),
    (HYSTERESIS, -1, "hysteresis_left must be an integer in"),
    (SKIPPED, 2**41, r"skipped_steps \(2199023255552\) cannot exceed steps"),
    (STEPS, -5, "steps must be an integer in"),
]


@pytest.mark.parametrize("dataset, value, match", BAD_FILES)
def test_load_model_refuses_a_bad_saved_state_naming_the_field(saved, tmp_path, dataset, value, match):
    bad = _corrupted(saved, dataset, value, tmp_path / "bad.keras")
    with pytest.raises(ValueError, match=match) as raised:
        keras.models.load_model(bad)
    assert "the saved optimizer state (model.weights.h5)" in str(raised.value)


def test_load_weights_of_a_bad_state_loads_nothing_into_the_optimizer(saved, tmp_path):
    model = keras.models.load_model(saved)  # the good file round-trips
    assert model.optimizer.read_state() == _built_optimizer().read_state()
    model.optimizer.assign_state({"scale": 64.0, "steps": 2**40 + 9})
    before = model.optimizer.read_state()
    slots_before = [np.array(v.numpy()) for v in model.optimizer.variables]
    bad = _corrupted(saved, SCALE, np.nan, tmp_path / "bad.keras")
    with zipfile.ZipFile(bad) as z:
        (tmp_path / "bad.weights.h5").write_bytes(z.read("model.weights.h5"))
    with pytest.raises(ValueError, match="scale must be a finite number"):
        model.load_weights(tmp_path / "bad.weights.h5")
    assert model.optimizer.read_state() == before
    for a, b in zip(slots_before, model.optimizer.variables, strict=True):
        np.testing.assert_array_equal(a, b.numpy())  # the inner optimizer's slots as well


def test_weights_saved_by_keras_own_optimizer_are_refused_with_what_to_do(tmp_path):
    def compiled(optimizer):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer=optimizer, loss="mse")
        model.optimizer.build(model.trainable_variables)
        return model

    keras_own = compiled(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()))
    keras_own.save_weights(tmp_path / "k.weights.h5")
    ours = compiled(LossScaleOptimizer(keras.optimizers.Adam(), policy=POLICY))
    ours.optimizer.assign_state(STATE)
    with pytest.raises(ValueError, match="saved by Keras' own LossScaleOptimizer loads into that class"):
        ours.load_weights(tmp_path / "k.weights.h5")
    assert ours.optimizer.read_state() == _built_optimizer().read_state()


# ---- issue 19: a saved model loads without this library ----

WITHOUT_LIBRARY = textwrap.dedent("""
    import importlib.abc, json, os, sys
    class Hidden(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "lossscale_callbacks":
                raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)")
    sys.meta_path.insert(0, Hidden())
    sys.path = [p for p in sys.path if p not in ("", os.getcwd(), REPO)]
    import keras, numpy as np
    results = {}
    for path in PATHS:
        try:
            model = keras.models.load_model(path)
        except Exception as exc:
            results[path] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        opt = model.optimizer
        loaded = {"class": f"{type(opt).__module__}.{type(opt).__name__}", "compiled": model.compiled,
                  "scale": float(opt.dynamic_scale.numpy()), "counter": int(opt.step_counter.numpy()),
                  "applied": int(opt.iterations.numpy())}
        rng = np.random.default_rng(0)
        model.fit(rng.normal(size=(16, 4)).astype("float32"), np.ones((16, 1), "float32"), batch_size=8,
                  verbose=0)
        loaded["applied_after_fit"] = int(opt.iterations.numpy())
        results[path] = loaded
    results["imported"] = sorted(m for m in sys.modules if m.split(".")[0] == "lossscale_callbacks")
    print("RESULT " + json.dumps(results))
""")


def _fit_and_save(path, policy):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1, dtype="float32")])
    model.compile(optimizer="adam", loss="mse")  # under mixed_float16: Keras' own LossScaleOptimizer
    rng = np.random.default_rng(1)
    x = rng.normal(size=(32, 4)).astype("float32")
    x[9, 2] = np.inf  # the second batch overflows: one skipped step, the scale backs off
    kwargs = {} if policy is None else {"policy": policy}
    model.fit(x, np.ones((32, 1), "float32"), batch_size=8, verbose=0, shuffle=False,
              callbacks=[LossScaleCallback(health=None, **kwargs)])
    model.save(path)
    return model.optimizer.read_state()


def _load_without_library(tmp_path, paths):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = f"REPO = {repo!r}\nPATHS = {[str(p) for p in paths]!r}\n" + WITHOUT_LIBRARY
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


NOT_FOR_KERAS = [DynamicPolicy(hysteresis=2), DynamicPolicy(max_scale=2.0**20), FixedPolicy(1024.0)]


@pytest.mark.slow
def test_a_model_saved_after_fit_with_the_callback_loads_without_the_library(tmp_path, mixed_float16):
    portable = tmp_path / "portable.keras"
    saved_state = _fit_and_save(portable, None)  # the callback's default policy: Keras' class runs it
    assert (float(saved_state.scale), saved_state.skipped_steps, saved_state.steps) == (2.0**14, 1, 4)
    others = [tmp_path / f"needs_library_{i}.keras" for i in range(len(NOT_FOR_KERAS))]
    states = [_fit_and_save(path, policy) for path, policy in zip(others, NOT_FOR_KERAS, strict=True)]

    without = _load_without_library(tmp_path, [portable, *others])
    assert without["imported"] == []
    loaded = without[str(portable)]
    assert loaded["class"] == "keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer"
    assert loaded["compiled"] and loaded["scale"] == 2.0**14
    assert loaded["counter"] == int(saved_state.growth_counter) == 2 and loaded["applied"] == 3
    assert loaded["applied_after_fit"] == 5  # it keeps training
    for path, policy in zip(others, NOT_FOR_KERAS, strict=True):
        error = without[str(path)]["error"]
        assert "import lossscale_callbacks.keras" in error and str(policy) in error, error

    # Where the library is imported, every file resumes with ours, state included.
    policies = [DynamicPolicy(), *NOT_FOR_KERAS]
    for path, state, policy in zip([portable, *others], [saved_state, *states], policies, strict=True):
        model = keras.models.load_model(path)
        assert type(model.optimizer) is LossScaleOptimizer and model.optimizer.policy == policy
        assert model.optimizer.read_state() == state
    model.fit(np.ones((16, 4), "float32"), np.ones((16, 1), "float32"), batch_size=8, verbose=0,
              callbacks=[LossScaleCallback(health=None)])
    assert int(model.optimizer.read_state().steps) == int(states[-1].steps) + 2


def test_the_compile_config_names_keras_class_only_for_a_policy_it_can_run():
    for policy, module in ((DynamicPolicy(initial_scale=64.0, growth_interval=7), "keras.optimizers"),
                           (DynamicPolicy(hysteresis=3), "lossscale_callbacks.keras._optimizer")):
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        callback = LossScaleCallback(policy=policy, health=None)
        callback.set_model(model)  # what fit() does first: our optimizer goes in
        entry = model.get_compile_config()["optimizer"]
        assert entry["module"] == module and entry["class_name"] == "LossScaleOptimizer"
        if module == "keras.optimizers":
            assert entry["registered_name"] == "LossScaleOptimizer"
            assert set(entry["config"]) == {"name", "inner_optimizer", "initial_scale",
                                            "dynamic_growth_steps"}
            assert (entry["config"]["initial_scale"], entry["config"]["dynamic_growth_steps"]) == (64.0, 7)
            restored = keras.optimizers.deserialize(entry)
            assert type(restored) is LossScaleOptimizer and restored.policy == policy
        else:
            assert entry["config"]["policy"] == policy.to_config()
            assert "import lossscale_callbacks.keras" in entry["config"]["needs"]
