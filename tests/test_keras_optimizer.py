"""LossScaleOptimizer and DynamicLossScale for Keras 3: the seed examples and API, skipping, saving."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from keras_scripts.toy import (  # noqa: E402
    StateRecorder,
    bit_identical,
    build_model,
    expected_states,
    make_data,
)

from lossscale_callbacks import DynamicPolicy, FixedPolicy  # noqa: E402
from lossscale_callbacks.keras import DynamicLossScale, LossScaleOptimizer  # noqa: E402
from lossscale_callbacks.keras._callback import wrap  # noqa: E402


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def _host_states(states):
    return [tuple(float(x) for x in s) for s in states]


# ---- acceptance 1: the seed documents' examples, as written ----

def test_seed_minimize_then_gradient_tape():
    opt = keras.optimizers.SGD(0.25)
    opt = LossScaleOptimizer(opt)
    var = tf.Variable(1.0)
    loss_fn = lambda: var**2  # noqa: E731
    # 'minimize' applies loss scaling and updates the loss scale.
    opt.minimize(loss_fn, var_list=var)
    assert var.numpy() == 0.5

    with tf.GradientTape() as tape:
        loss = loss_fn()
        scaled_loss = opt.get_scaled_loss(loss)
    scaled_grad = tape.gradient(scaled_loss, var)
    (grad,) = opt.get_unscaled_gradients([scaled_grad])
    opt.apply_gradients([(grad, var)])  # Loss scale is updated here
    assert var.numpy() == 0.25
    assert float(scaled_loss) == 0.25 * 2.0**15
    state = opt.read_state()
    assert int(state.steps) == 2 and int(state.skipped_steps) == 0 and int(opt.dynamic_counter.numpy()) == 2


def test_seed_hyperparameter_delegation_beta_1_yes_epsilon_no():
    opt = keras.optimizers.Adam(beta_1=0.8, epsilon=1e-5)
    opt = LossScaleOptimizer(opt)
    assert opt.beta_1 == 0.8  # Equivalent to `opt.inner_optimizer.beta_1`
    opt.beta_1 = 0.7  # Equivalent to `opt.inner_optimizer.beta_1 = 0.7`
    assert opt.beta_1 == 0.7
    assert opt.inner_optimizer.beta_1 == 0.7

    assert opt.inner_optimizer.epsilon == 1e-5
    with pytest.raises(AttributeError, match="'LossScaleOptimizer' object has no attribute 'epsilon'"):
        opt.epsilon  # noqa: B018
    opt.epsilon = 1e-4  # This does NOT set epsilon on `opt.inner_optimizer`
    assert opt.inner_optimizer.epsilon == 1e-5

    opt.learning_rate = 0.5  # learning_rate always reaches the inner optimizer
    assert float(opt.inner_optimizer.learning_rate.numpy()) == 0.5
    assert float(opt.learning_rate.numpy()) == 0.5


def test_seed_properties_dynamic_and_fixed():
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    assert opt.dynamic is True and opt.initial_scale == 2.0**15 and opt.dynamic_growth_steps == 2000
    assert opt.loss_scale.dtype == tf.float32 and float(opt.loss_scale) == 2.0**15
    assert int(opt.dynamic_counter.numpy()) == 0
    assert opt.dynamic_counter.dtype == "int64"
    assert isinstance(opt.inner_optimizer, keras.optimizers.SGD)
    assert isinstance(opt, keras.optimizers.LossScaleOptimizer)  # Keras treats it as its own kind

    fixed = LossScaleOptimizer(keras.optimizers.SGD(0.1), dynamic=False, initial_scale=128)
    assert fixed.dynamic is False and fixed.dynamic_growth_steps is None and fixed.dynamic_counter is None
    assert fixed.policy == FixedPolicy(128.0)
    var = tf.Variable([1.0])
    for grad in ([1.0], [np.inf], [1.0]):
        fixed.apply_gradients([(tf.constant(grad) * 128.0, var)])
    assert float(fixed.loss_scale) == 128.0 and int(fixed.read_state().skipped_steps) == 1
    assert var.numpy()[0] == pytest.approx(0.8)

    custom = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=64, dynamic_growth_steps=3)
    assert custom.policy == DynamicPolicy(initial_scale=64.0, growth_interval=3)


@pytest.mark.parametrize("kwargs, match", [
    ({"dynamic": False}, '"initial_scale" must be specified if "dynamic" is False.*set `loss_scale_factor`'),
    ({"dynamic": False, "initial_scale": 8.0, "dynamic_growth_steps": 10},
     '"dynamic_growth_steps" must be None if "dynamic" is False'),
    ({"policy": DynamicPolicy(), "initial_scale": 8.0}, "either policy or"),
    ({"policy": DynamicPolicy(), "dynamic": False}, "contradicts"),
    ({"policy": {"type": "dynamic"}}, "policy must be"),
    ({"dynamic": "yes"}, '"dynamic" argument to LossScaleOptimizer.__init__ must be a bool'),
    # The message names the argument the caller passed, not only the policy's field.
    ({"dynamic_growth_steps": 0}, r"dynamic_growth_steps must be an integer in \[1, 2147483647\], got 0"),
    ({"dynamic_growth_steps": 2.5}, "dynamic_growth_steps"),
    ({"dynamic_growth_steps": True}, "dynamic_growth_steps"),
    ({"initial_scale": -1.0}, r"initial_scale must be in \(0, inf\], got -1.0"),
    ({"dynamic": False, "initial_scale": float("inf")}, "initial_scale must be a finite number"),
    ({"dynamic": False, "initial_scale": "128"}, "initial_scale must be a real number"),
    ({"foo": True, "bar": 3}, "LossScaleOptimizer does not support arguments: `foo`, `bar`"),
    ({"clipnorm": 1.0}, "does not support `clipnorm`. Instead, set `clipnorm` on the `inner_optimizer`"),
    ({"use_ema": True}, "set `use_ema` on the `inner_optimizer`"),
])
def test_invalid_argument_combinations_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossScaleOptimizer(keras.optimizers.SGD(0.1), **kwargs)


def test_invalid_inner_optimizer():
    # Both a ValueError (Keras 3, this project) and a TypeError (tf.keras) for code written against either.
    with pytest.raises(ValueError, match="inner_optimizer") as raised:
        LossScaleOptimizer("adam")
    assert isinstance(raised.value, TypeError)
    with pytest.raises(TypeError, match="cannot wrap another LossScaleOptimizer"):
        LossScaleOptimizer(LossScaleOptimizer(keras.optimizers.SGD(0.1)))
    inner = keras.optimizers.SGD(0.1)
    LossScaleOptimizer(inner)
    with pytest.raises(ValueError, match="already wrapped by a LossScaleOptimizer"):
        LossScaleOptimizer(inner)


def test_an_inner_loss_scale_factor_is_cleared_as_keras_does():
    inner = keras.optimizers.SGD(0.5, loss_scale_factor=100.0)
    opt = LossScaleOptimizer(inner)
    assert inner.loss_scale_factor is None
    var = tf.Variable([1.0, 2.0])
    opt.apply_gradients([(tf.constant([1.0, 6.0]) * opt.initial_scale, var)])
    np.testing.assert_allclose(var.numpy(), [0.5, -1.0])


def test_dynamic_growth_steps_may_be_an_integral_float_like_tf_keras():
    assert LossScaleOptimizer(keras.optimizers.SGD(0.1), dynamic_growth_steps=2.0).dynamic_growth_steps == 2


def test_policy_with_hysteresis_and_bounds():
    policy = DynamicPolicy(initial_scale=8.0, growth_interval=2, hysteresis=2, min_scale=2.0, max_scale=16.0)
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.0), policy=policy)
    var = tf.Variable([0.0])
    finite = [False, False, False, False, True, True, True, True, True, True]
    states = []
    for ok in finite:
        opt.apply_gradients([(tf.constant([1.0 if ok else np.nan]), var)])
        states.append(tuple(float(x) for x in opt.read_state()))
    assert states == expected_states(policy, finite)


def test_config_round_trip_and_keras_config():
    policy = DynamicPolicy(initial_scale=1024.0, growth_interval=7, hysteresis=3, min_scale=0.5)
    opt = LossScaleOptimizer(keras.optimizers.Adam(1e-3, beta_1=0.85), policy=policy, name="ls")
    config = opt.get_config()
    assert (config["initial_scale"], config["dynamic_growth_steps"]) == (1024.0, 7)
    assert "dynamic" not in config
    assert config["policy"] == policy.to_config()  # only because it says more than the two seed keys
    plain = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8.0).get_config()
    keras_own = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8.0).get_config()
    assert plain.keys() == keras_own.keys()  # a default policy has Keras' config: either class loads it
    again = LossScaleOptimizer.from_config(config)
    assert again.policy == policy and again.name == "ls" and again.inner_optimizer.beta_1 == 0.85
    # Generic Keras (de)serialization finds the registered class.
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(restored) is LossScaleOptimizer and restored.policy == policy
    # A config written by Keras' own LossScaleOptimizer deserializes too.
    keras_config = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=256.0,
                                                       dynamic_growth_steps=5).get_config()
    assert LossScaleOptimizer.from_config(keras_config).policy == DynamicPolicy(256.0, 5)
    fixed = LossScaleOptimizer(keras.optimizers.SGD(0.1), dynamic=False, initial_scale=4.0)
    assert LossScaleOptimizer.from_config(fixed.get_config()).policy == FixedPolicy(4.0)


@pytest.mark.parametrize("mode", ["eager", "tf_function", "xla"])
def test_skipped_step_leaves_weights_and_slotsbit_identical(mode):
    policy = DynamicPolicy(initial_scale=2.0**10, growth_interval=3)
    opt = LossScaleOptimizer(keras.optimizers.Adam(0.01), policy=policy)
    kernel = keras.Variable(np.ones((3, 2), "float32"), name="kernel")
    bias = keras.Variable(np.zeros((2,), "float32"), name="bias")
    variables = [kernel, bias]
    opt.build(variables)

    def step(g_kernel, g_bias):
        opt.apply_gradients(zip([g_kernel, g_bias], variables, strict=False))

    if mode != "eager":
        step = tf.function(step, jit_compile=mode == "xla")
    finite_pattern = [True, True, False, True, True, True, False, False, True]
    snapshots, states = [], []
    rng = np.random.default_rng(0)
    for ok in finite_pattern:
        g_kernel = rng.normal(size=(3, 2)).astype("float32") * 2.0**10
        if not ok:
            g_kernel[1, 0] = np.inf if len(states) % 2 else np.nan
        step(tf.constant(g_kernel), tf.constant(rng.normal(size=2).astype("float32")))
        snapshots.append([np.array(v.numpy()) for v in [*variables, *opt.inner_optimizer.variables]])
        states.append(tuple(float(x) for x in opt.read_state()))
    for t, ok in enumerate(finite_pattern):
        if not ok:
            for before, after in zip(snapshots[t - 1], snapshots[t], strict=False):
                assert before.tobytes() == after.tobytes()
        else:
            assert not np.array_equal(snapshots[t - 1][0], snapshots[t][0]) if t else True
    assert states == expected_states(policy, finite_pattern)
    # iterations counts applied steps only; state.steps counts every attempt.
    assert int(opt.iterations.numpy()) == sum(finite_pattern)
    assert int(opt.read_state().steps) == len(finite_pattern)


def test_apply_unscales_scaled_gradients_keras3_style():
    opt = LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=2.0**12)
    var = tf.Variable(2.0)
    with tf.GradientTape() as tape:
        scaled = opt.scale_loss(var**2)  # what Keras' trainer does
    opt.apply_gradients([(tape.gradient(scaled, var), var)])
    assert var.numpy() == 2.0 - 4.0


@pytest.mark.parametrize("clip", ["clipnorm", "global_clipnorm"])
def test_clipnorm_sees_unscaled_gradients(clip):
    opt = LossScaleOptimizer(keras.optimizers.SGD(1.0, **{clip: 1.0}), initial_scale=2.0**15)
    var = tf.Variable(1.0)
    opt.minimize(lambda: 0.25 * var**2, var_list=[var])  # gradient 0.5: below the clip norm
    assert var.numpy() == 0.5
    opt.minimize(lambda: 4.0 * var**2, var_list=[var])  # gradient 4: clipped to 1
    assert var.numpy() == -0.5


def test_learning_rate_schedule_follows_applied_steps():
    schedule = keras.optimizers.schedules.ExponentialDecay(1.0, decay_steps=1, decay_rate=0.5)
    opt = LossScaleOptimizer(keras.optimizers.SGD(schedule), initial_scale=4.0)
    var = tf.Variable(0.0)
    for grad in (4.0, np.inf, 4.0):  # scaled gradients of 1.0
        opt.apply_gradients([(tf.constant(grad), var)])
    # lr 1.0 at the first applied step, 0.5 at the second: the skipped step did not decay it.
    assert var.numpy() == pytest.approx(-(1.0 + 0.5 * 2.0))  # the scale halved to 2 after the overflow
    assert int(opt.iterations.numpy()) == 2


def test_tf_train_checkpoint_restores_state(tmp_path):
    policy = DynamicPolicy(initial_scale=64.0, growth_interval=2)
    var = keras.Variable(np.ones(3, "float32"))
    opt = LossScaleOptimizer(keras.optimizers.Adam(0.1), policy=policy)
    for grad in ([1.0, 1.0, 1.0], [np.inf, 0.0, 0.0], [1.0, 2.0, 3.0]):
        opt.apply_gradients([(tf.constant(grad, tf.float32), var)])
    saved_state = opt.read_state()
    path = tf.train.Checkpoint(optimizer=opt).save(str(tmp_path / "ckpt"))

    fresh_var = keras.Variable(np.ones(3, "float32"))
    fresh = LossScaleOptimizer(keras.optimizers.Adam(0.1), policy=policy)
    fresh.build([fresh_var])
    tf.train.Checkpoint(optimizer=fresh).restore(path).assert_existing_objects_matched()
    assert [float(x) for x in fresh.read_state()] == [float(x) for x in saved_state]
    assert int(fresh.iterations.numpy()) == 2
    for a, b in zip(opt.inner_optimizer.variables, fresh.inner_optimizer.variables, strict=False):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_wrap_carries_keras_running_scale_into_the_policy_bounds():
    var = tf.Variable([1.0])
    keras_lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**10,
                                                    dynamic_growth_steps=3)
    for grad in ([1.0], [1.0], [np.inf], [1.0], [1.0]):  # Keras: back off to 512, counter 2
        keras_lso.apply_gradients([(tf.constant(grad), var)])
    ours = wrap(keras_lso)
    assert ours.inner_optimizer is keras_lso.inner_optimizer
    assert ours.policy == DynamicPolicy(initial_scale=1024.0, growth_interval=3)
    state = ours.read_state()
    assert (float(state.scale), int(state.growth_counter), int(state.steps)) == (512.0, 2, 4)
    bounded = wrap(keras_lso, DynamicPolicy(initial_scale=64.0, growth_interval=2, max_scale=128.0))
    assert (float(bounded.loss_scale), int(bounded.dynamic_counter.numpy())) == (128.0, 1)
    untouched = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    untouched.build([var])
    assert float(wrap(untouched, DynamicPolicy(initial_scale=8.0)).loss_scale) == 8.0
    assert wrap(ours) is ours


@pytest.mark.slow
def test_compile_fit_under_mixed_float16_is_not_wrapped_twice_and_skips(mixed_float16):
    policy = DynamicPolicy(initial_scale=256.0, growth_interval=4, max_scale=4096.0)
    model = build_model()
    model.compile(optimizer=LossScaleOptimizer(keras.optimizers.Adam(0.01), policy=policy), loss="mse")
    assert type(model.optimizer) is LossScaleOptimizer
    poisoned = [2, 5]
    x, y = make_data(8, poisoned=poisoned)
    recorder = StateRecorder()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, callbacks=[recorder], verbose=0)
    finite = [b not in poisoned for b in range(8)]
    assert _host_states(recorder.states) == expected_states(policy, finite)
    for b in poisoned:
        assert bit_identical(recorder.weights[b - 1], recorder.weights[b])


@pytest.mark.slow
def test_fit_with_jit_compile(mixed_float16):
    policy = DynamicPolicy(initial_scale=128.0, growth_interval=2, max_scale=1024.0)
    model = build_model()
    model.compile(optimizer=LossScaleOptimizer(keras.optimizers.SGD(0.01, momentum=0.9), policy=policy),
                  loss="mse", jit_compile=True)
    poisoned = [1, 4, 5]
    x, y = make_data(7, poisoned=poisoned)
    recorder = StateRecorder()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, callbacks=[recorder], verbose=0)
    assert model.jit_compile
    assert _host_states(recorder.states) == expected_states(policy, [b not in poisoned for b in range(7)])
    for b in poisoned:
        assert bit_identical(recorder.slots[b - 1], recorder.slots[b])
        assert bit_identical(recorder.weights[b - 1], recorder.weights[b])
    assert not bit_identical(recorder.weights[2], recorder.weights[3])  # finite steps do train
    assert recorder.iterations[-1] == 7 - len(poisoned)


# ---- the seed's DynamicLossScale ----

def test_dynamic_loss_scale_seed_api(tmp_path):
    loss_scale = DynamicLossScale()
    defaults = {"initial_loss_scale": 2.0**15, "increment_period": 2000, "multiplier": 2.0}
    assert loss_scale.get_config() == defaults
    loss_scale = DynamicLossScale(initial_loss_scale=16.0, increment_period=2, multiplier=4.0)
    assert loss_scale.initial_loss_scale == 16.0 and loss_scale.increment_period == 2
    assert loss_scale.multiplier == 4.0
    value = loss_scale()
    assert value.dtype == tf.float32 and float(value) == 16.0
    update = tf.function(loss_scale.update)
    outcomes = []
    steps = ([tf.constant([1.0])], [tf.constant([1.0]), None], [tf.constant([np.nan])], [tf.constant(2.0)])
    for grads in steps:
        update_op, should_apply = update(grads)
        assert update_op is None
        outcomes.append((bool(should_apply), float(loss_scale())))
    assert outcomes == [(True, 16.0), (True, 64.0), (False, 16.0), (True, 16.0)]
    again = DynamicLossScale.from_config(loss_scale.get_config())
    assert again.get_config() == loss_scale.get_config() and float(again()) == 16.0
    path = tf.train.Checkpoint(ls=loss_scale).save(str(tmp_path / "ls"))
    tf.train.Checkpoint(ls=again).restore(path)
    assert [int(v.numpy()) for v in again.state[1:]] == [1, 0, 1, 4]
    with pytest.raises(ValueError, match="multiplier"):
        DynamicLossScale(multiplier=1.0)


@pytest.mark.parametrize("kwargs, match", [
    ({"multiplier": 1.0}, r"multiplier must be in \(1, 65536\], got 1.0"),
    ({"multiplier": True}, "multiplier"),
    ({"increment_period": 0}, r"increment_period must be an integer in \[1, 2147483647\], got 0"),
    ({"increment_period": 2.0}, "increment_period"),
    ({"initial_loss_scale": 0.5}, r"initial_loss_scale must be in \[1, 1.67772e\+07\], got 0.5"),
    ({"initial_loss_scale": 2.0**25}, "initial_loss_scale"),
])
def test_dynamic_loss_scale_errors_name_the_seed_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicLossScale(**kwargs)


def test_import_loads_no_sink_integration_or_alignment():
    import os
    import subprocess
    import sys

    lazy = ["wandb", "lossscale_callbacks.tensorboard", "lossscale_callbacks.wandb",
            "lossscale_callbacks.keras._alignment"]
    code = (f"import sys, lossscale_callbacks.keras; print([m for m in {lazy!r} if m in sys.modules]); "
            "import lossscale_callbacks.keras._alignment as a; print(a.check_alignment.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]", "lossscale_callbacks.keras._alignment"]


# ---- no state can corrupt a run ----

def _fit_weights(model, opt_factory, x, y, run_eagerly=False, stray_call=False):
    model.compile(optimizer=opt_factory(), loss="mse", run_eagerly=run_eagerly)
    if stray_call:
        # An unscaled-gradient call with no apply after it (a user inspecting gradients, say).
        model.optimizer.get_unscaled_gradients([tf.ones((4, 8))])
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    return [w.numpy() for w in model.weights]


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_a_stray_get_unscaled_gradients_call_cannot_leak_into_fit(run_eagerly):
    x, y = make_data(8)
    policy = DynamicPolicy(initial_scale=2.0**12, growth_interval=100)

    def factory():
        return LossScaleOptimizer(keras.optimizers.SGD(0.01), policy=policy)

    clean = _fit_weights(build_model(), factory, x, y, run_eagerly)
    after_stray = _fit_weights(build_model(), factory, x, y, run_eagerly, stray_call=True)
    assert all(np.abs(w).max() < 10 for w in after_stray)  # the old bug: weights near -1e12 in 8 steps
    for a, b in zip(clean, after_stray, strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_unscaled_mark_belongs_to_one_context_and_one_apply():
    opt = LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=4.0)
    var = tf.Variable([0.0])
    scaled = tf.constant([4.0])  # the gradient 1.0 at scale 4
    opt.get_unscaled_gradients([scaled])  # eager mark

    @tf.function
    def traced_step(grad):
        opt.apply_gradients([(grad, var)])  # another context: takes them as scaled

    traced_step(scaled)
    np.testing.assert_allclose(var.numpy(), [-1.0])
    opt.apply_gradients([(scaled, var)])  # the eager mark did not survive the traced apply
    np.testing.assert_allclose(var.numpy(), [-2.0])
    (grad,) = opt.get_unscaled_gradients([scaled])
    opt.apply_gradients([(tf.clip_by_value(grad, -0.5, 0.5), var)])  # tf.keras: transformed, still unscaled
    np.testing.assert_allclose(var.numpy(), [-2.5])
    opt.get_unscaled_gradients([scaled])
    opt.scale_loss(tf.constant(1.0))  # a Keras 3 step began: the mark is forgotten
    opt.apply_gradients([(scaled, var)])
    np.testing.assert_allclose(var.numpy(), [-3.5])
    opt.apply_gradients([(tf.constant([1.0]), var)], unscaled=True)  # explicit
    np.testing.assert_allclose(var.numpy(), [-4.5])
    with pytest.raises(ValueError, match="unscaled must be None, True or False"):
        opt.apply_gradients([(scaled, var)], unscaled="yes")


BAD_KERAS_STATES = [
    ({"scale": 0.0}, "assign_state: scale must be a finite number"),
    ({"scale": np.nan}, "assign_state: scale must be a finite number"),
    ({"scale": np.inf}, "assign_state: scale must be a finite number"),
    ({"scale": -2.0}, "assign_state: scale must be a finite number"),
    ({"scale": 2.0**30}, "assign_state: scale must be a finite number"),
    ({"growth_counter": -1}, "growth_counter"),
    ({"skipped_steps": 9, "steps": 3}, "cannot exceed steps"),
    ({"steps": 2.5}, "steps"),
    ({"scael": 8.0}, r"assign_state: unknown field\(s\) \['scael'\]; allowed: \['scale'"),
]


@pytest.mark.parametrize("change, match", BAD_KERAS_STATES)
def test_assign_state_refuses_a_bad_state_and_assigns_nothing(change, match):
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), policy=DynamicPolicy(initial_scale=256.0))
    var = tf.Variable([1.0])
    for grad in ([1.0], [np.inf], [1.0]):
        opt.apply_gradients([(tf.constant(grad), var)])
    before = opt.read_state()
    with pytest.raises(ValueError, match=match):
        opt.assign_state(change)
    assert opt.read_state() == before


def test_assign_state_takes_tensors_and_variables_as_numbers():
    # Copying a state from another optimizer's variables must not be refused as "not a number".
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), policy=DynamicPolicy(initial_scale=256.0))
    opt.apply_gradients([(tf.constant([1.0]), tf.Variable([1.0]))])
    for value, want in [(tf.constant(64.0), 64.0), (tf.Variable(32.0), 32.0), (keras.Variable(16.0), 16.0)]:
        opt.assign_state({"scale": value, "growth_counter": tf.constant(1)})
        assert opt.read_state().scale == want and opt.read_state().growth_counter == 1
    with pytest.raises(ValueError, match="assign_state: scale must be a finite number"):
        opt.assign_state({"scale": tf.constant([4.0, 2.0])})
    assert opt.read_state().scale == 16.0


def test_use_ema_is_the_inner_optimizers_and_fit_finalizes_it():
    inner = keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.5)
    opt = LossScaleOptimizer(inner)
    assert (opt.use_ema, opt.ema_momentum) == (True, 0.5)
    opt.ema_momentum = 0.9
    assert inner.ema_momentum == 0.9
    x, y = make_data(4)
    model = build_model()
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    # Keras finalizes the averages into the model at the end of fit; no second set of averages exists.
    averages = inner._model_variables_moving_average
    for weight, average in zip(model.trainable_variables, averages, strict=True):
        np.testing.assert_array_equal(weight.numpy(), average.numpy())
    assert not any("average" in v.path for v in opt._variables)


def test_configs_saved_by_earlier_keras_releases_load():
    # Keras 3.0-3.3 wrote the base optimizer's settings into LossScaleOptimizer configs.
    old = {
        "name": "loss_scale_optimizer", "weight_decay": None, "clipnorm": None, "global_clipnorm": None,
        "clipvalue": None, "use_ema": False, "ema_momentum": 0.99, "ema_overwrite_frequency": None,
        "loss_scale_factor": None, "gradient_accumulation_steps": None,
        "inner_optimizer": {"module": "keras.optimizers", "class_name": "SGD", "config": {
            "name": "SGD", "learning_rate": 0.5, "momentum": 0.0, "nesterov": False},
            "registered_name": None},
        "initial_scale": 2.0, "dynamic_growth_steps": 2,
    }
    opt = LossScaleOptimizer.from_config(old)
    assert opt.policy == DynamicPolicy(initial_scale=2.0, growth_interval=2)
    with pytest.raises(ValueError, match="does not support `clipnorm`"):
        LossScaleOptimizer.from_config({**old, "clipnorm": 1.0})


@pytest.mark.slow
def test_load_model_in_a_fresh_process(tmp_path):
    """Keras imports only its own packages when it deserializes: a fresh process must import ours first
    (the documented way), and then finds the class by its registered name."""
    import os
    import subprocess
    import sys

    x, y = make_data(4)
    model = build_model()
    policy = DynamicPolicy(initial_scale=64.0, hysteresis=2)
    model.compile(optimizer=LossScaleOptimizer(keras.optimizers.Adam(0.01), policy=policy), loss="mse")
    model.fit(x, y, batch_size=8, verbose=0)
    path = str(tmp_path / "ours.keras")
    model.save(path)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": os.path.dirname(__file__)}
    load = (f"import keras, keras_scripts.toy; m = keras.models.load_model({path!r}); "
            "print(type(m.optimizer).__module__, m.optimizer.policy.hysteresis, "
            "int(m.optimizer.read_state().steps))")
    without = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=180,
                             env=env)
    assert without.returncode != 0 and "lossscale_callbacks" in without.stderr
    fresh = subprocess.run([sys.executable, "-c", "import lossscale_callbacks.keras; " + load],
                           capture_output=True, text=True, timeout=180, env=env)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert fresh.stdout.split() == ["lossscale_callbacks.keras._optimizer", "2", "4"]
