"""tf.distribute: every replica skips the same steps and holds the same scale (acceptance 4).

Each test launches tests/keras_scripts/distributed_fit.py in fresh processes: logical devices
and TF_CONFIG must be set before TensorFlow initialises, and MultiWorkerMirroredStrategy needs
one process per worker. The Inf is injected on the second replica/worker only.
"""

import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow")

from lossscale_callbacks import DynamicPolicy
from lossscale_callbacks.testing import reference_run

SCRIPT = os.path.join(os.path.dirname(__file__), "keras_scripts", "distributed_fit.py")
POLICY = DynamicPolicy(initial_scale=256.0, growth_interval=2, max_scale=2048.0)
BATCHES, POISONED = 6, (2, 4)


def _env():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    env.pop("TF_CONFIG", None)
    return env


def _free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _check_replicas_agree(records, replicas_per_process):
    finite = [b not in POISONED for b in range(BATCHES)]
    ref = reference_run(POLICY, finite)
    expected = [[float(getattr(ref, f)[t]) for f in ref._fields] for t in range(BATCHES)]
    assert len(records["states"]) == BATCHES
    for t, per_field in enumerate(records["states"]):
        for field_values, want in zip(per_field, expected[t], strict=False):
            assert len(field_values) == replicas_per_process
            assert all(float(v) == want for v in field_values), (t, per_field, expected[t])
    for t in POISONED:  # skipped on every replica: the weights did not move
        assert records["weights"][t] == records["weights"][t - 1]
    for t in range(1, BATCHES):
        if t not in POISONED:
            assert records["weights"][t] != records["weights"][t - 1]
    for hashes in records["weights"]:
        assert len(set(hashes)) == 1
    assert records["optimizer"] == "LossScaleOptimizer"


@pytest.mark.slow
def test_mirrored_strategy_two_logical_cpus(tmp_path):
    out = tmp_path / "mirrored.json"
    proc = subprocess.run([sys.executable, SCRIPT, "mirrored", str(out)], env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(out.read_text())
    assert records["replicas"] == 2
    _check_replicas_agree(records, replicas_per_process=2)
    assert records["sink_records"] == 3  # after optimizer steps 2, 4 and 6 (the last)


@pytest.mark.slow
def test_multi_worker_mirrored_strategy_two_processes(tmp_path):
    ports = ",".join(str(p) for p in _free_ports(2))
    outs = [tmp_path / f"worker{i}.json" for i in range(2)]
    commands = [[sys.executable, SCRIPT, "mwms", str(outs[i]), "--index", str(i), "--ports", ports]
                for i in range(2)]
    procs = [subprocess.Popen(c, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in commands]
    try:
        results = [p.communicate(timeout=150) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, results, strict=False):
        assert p.returncode == 0, err[-3000:]
    workers = [json.loads(o.read_text()) for o in outs]
    for records in workers:
        assert records["replicas"] == 2
        _check_replicas_agree(records, replicas_per_process=1)
    assert workers[0]["states"] == workers[1]["states"]
    assert workers[0]["weights"] == workers[1]["weights"]
    # LossScaleCallback (driven by a CallbackList in the custom loop): only the chief writes.
    assert workers[0]["sink_records"] == 3 and workers[1]["sink_records"] == 0  # steps 2, 4, 6


@pytest.mark.slow
def test_contrast_keras_own_optimizer_applies_an_inf_seen_by_one_replica(tmp_path):
    """Why the all-reduced overflow decision matters (Keras 3.15, MirroredStrategy).

    Keras' LossScaleOptimizer checks each replica's *local* gradients and keeps replica 0's
    verdict, so an Inf on replica 1 alone is summed into the update and every replica's
    weights turn non-finite. Ours skips that step everywhere (test above). If this test fails,
    Keras has fixed its optimizer: update the README's comparison.
    """
    out = tmp_path / "keras.json"
    proc = subprocess.run([sys.executable, SCRIPT, "mirrored-keras", str(out)], env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(out.read_text())
    first_poisoned = POISONED[0]
    assert records["finite_weights"][first_poisoned - 1] == [True, True]
    assert records["finite_weights"][first_poisoned] == [False, False]


@pytest.mark.slow
def test_tf_keras_custom_loop_on_two_replicas_unscales_once_per_replica():
    """get_unscaled_gradients → (a sync point) → apply_gradients in each replica's thread: every replica's
    apply takes its own gradients as unscaled, eagerly and in a tf.function (see PendingUnscales)."""
    script = os.path.join(os.path.dirname(__file__), "keras_scripts", "mirrored_custom_loop.py")
    proc = subprocess.run([sys.executable, script], env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    assert result["replicas"] == 2
    assert result["moved"] == {"eager": -2.0, "function": -2.0}  # -1.125 if one replica divided twice
    assert (result["steps"], result["skipped"]) == (2, 0)
