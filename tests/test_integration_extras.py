"""Every integration says which extra it needs, at import: each import runs in a fresh interpreter in which
the outside package is hidden, as if it were not installed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Refuses every module of the hidden top-level packages, as an environment without them would.
HIDE = """
import sys

class Hidden:
    def __init__(self, names):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Hidden(set(sys.argv[1].split(","))))
try:
    exec(sys.argv[2])
except ImportError as exc:
    print(type(exc).__name__, exc.name)
    print(exc)
else:
    print("imported")
"""


def _import_without(hidden: str, code: str, **env: str) -> tuple[str, str, str]:
    """``(error class, missing module, message)`` of running ``code`` with ``hidden`` refused."""
    proc = subprocess.run([sys.executable, "-c", HIDE, hidden, code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    head, _, message = proc.stdout.strip().partition("\n")
    assert head != "imported", f"{code!r} imported with {hidden} hidden"
    kind, name = head.split(" ")
    return kind, name, message


@pytest.mark.parametrize(("face", "hidden", "extra"), [
    ("torch", "torch", "torch"),
    ("lightning", "lightning,pytorch_lightning", "lightning"),
    ("lightning", "torch", "lightning"),  # the extra brings torch too
    ("tensorboard", "tensorboard", "tensorboard"),
    ("tensorboard", "google", "tensorboard"),  # TensorBoard installed without protobuf
    ("wandb", "wandb", "wandb"),
    ("ray", "ray", "ray"),
    ("ray", "torch", "ray"),  # the extra brings torch too
])
def test_a_missing_package_names_the_extra_at_import(face, hidden, extra):
    kind, missing, message = _import_without(hidden, f"import lossscale_callbacks.{face}")
    assert kind == "MissingExtraError" and missing.split(".")[0] in hidden.split(",")
    assert message.startswith(f"lossscale_callbacks.{face} needs the ")
    assert message.endswith(f'Install it with: pip install "lossscale-callbacks[{extra}]"')


@pytest.mark.parametrize(("installed", "error"), [
    ({"torch", "lightning.pytorch", "pytorch_lightning"}, None),
    ({"torch", "pytorch_lightning"}, None),  # the standalone namespace alone will do
    ({"torch", "lightning.pytorch"}, None),
    ({"torch"}, "lightning.pytorch"),  # neither: the error names `lightning`, what the extra installs
])
def test_lightning_needs_one_of_its_namespaces(monkeypatch, installed, error):
    pytest.importorskip("lightning")
    import lossscale_callbacks.lightning as face
    from lossscale_callbacks._extras import MissingExtraError

    asked = []

    def require(module, extra, **kwargs):
        asked.append(module)
        assert extra == "lightning" and kwargs == {"feature": "lossscale_callbacks.lightning"}
        if module not in installed:
            raise MissingExtraError(f"no {module}", name=module)

    monkeypatch.setattr(face, "require", require)
    if error is None:
        face._require_lightning()
    else:
        with pytest.raises(MissingExtraError, match=f"^no {error}$"):
            face._require_lightning()
    assert asked[0] == "torch"


def test_keras_missing_names_the_extra_and_the_backends():
    kind, missing, message = _import_without("keras", "import lossscale_callbacks.keras")
    assert (kind, missing) == ("MissingExtraError", "keras")
    assert 'Install it with: pip install "lossscale-callbacks[keras]". Keras 3 runs on a backend' in message
    assert "tensorflow (or tensorflow-cpu), jax or torch" in message and "KERAS_BACKEND" in message


def test_keras_without_its_backend_says_which_backends_exist_and_how_to_choose():
    pytest.importorskip("keras")
    kind, missing, message = _import_without("tensorflow", "import lossscale_callbacks.keras",
                                             KERAS_BACKEND="tensorflow")
    assert (kind, missing.split(".")[0]) == ("ImportError", "tensorflow")
    assert message.startswith("lossscale_callbacks.keras: Keras is installed, but its backend 'tensorflow' "
                              "is not (No module named 'tensorflow")
    assert "tensorflow (or tensorflow-cpu), jax or torch" in message
    assert "choose it with the KERAS_BACKEND environment variable" in message


@pytest.mark.slow
def test_dynamic_loss_scale_off_tensorflow_says_it_needs_tensorflow():
    pytest.importorskip("keras")
    pytest.importorskip("jax")
    code = "import lossscale_callbacks.keras as k; k.LossScaleOptimizer; k.DynamicLossScale"
    kind, missing, message = _import_without("tensorflow", code, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    assert (kind, missing.split(".")[0]) == ("ImportError", "tensorflow")
    assert message.startswith("DynamicLossScale is TensorFlow's tf.train.experimental API and needs "
                              "tensorflow")
    assert message.endswith("LossScaleOptimizer and LossScaleCallback run on every Keras backend without it")
