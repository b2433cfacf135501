import subprocess
import sys

FRAMEWORKS = ("tensorflow", "torch", "keras", "lightning", "pytorch_lightning", "wandb", "tensorboard")


def test_importing_the_core_imports_no_framework():
    # A fresh interpreter: the test process itself may already hold frameworks.
    code = (
        "import sys, lossscale_callbacks, lossscale_callbacks.testing, lossscale_callbacks.alignment\n"
        f"print(','.join(m for m in {FRAMEWORKS!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_version_lives_in_one_place():
    from importlib.metadata import version

    import lossscale_callbacks

    assert lossscale_callbacks.__version__ == version("lossscale-callbacks")
