"""The public faces: what each package exports is pinned here, so a new public name is a decision.

Each package's ``__init__`` exports what users type (DESIGN.md): at most 40 names in all, no name in two
faces, every one importable; everything else is imported from the module that defines it.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# face -> its exact __all__ (sorted as ruff sorts it); __version__ is not counted as a name.
FACES: dict[str, list[str]] = {
    "lossscale_callbacks": [
        "METRIC_NAMES", "DynamicPolicy", "FixedPolicy", "InMemorySink", "LoggingLoop", "LossScaleHealthError",
        "LossScaleHealthWarning", "LossScaleState", "Sink", "__version__", "initial_state", "next_state"],
    "lossscale_callbacks.alignment": [
        "AlignmentReport", "Finding", "NoRuleAppliedWarning", "analyze", "check_alignment"],
    "lossscale_callbacks.keras": [
        "DynamicLossScale", "LossScaleCallback", "LossScaleOptimizer", "audit_keras_precision",
        "keep_keras_layers_in_float32"],
    "lossscale_callbacks.torch": ["LossScaler", "ScalerReader", "audit_precision", "keep_in_float32"],
    "lossscale_callbacks.lightning": ["LossScaleFSDPPlugin", "LossScaleMonitor", "LossScalePlugin"],
    "lossscale_callbacks.lightning.fabric": [
        "FabricLossScaleMonitor", "LossScaleFabricFSDPPlugin", "LossScaleFabricPlugin"],
    "lossscale_callbacks.tensorboard": ["TensorBoardSink"],
    "lossscale_callbacks.wandb": ["WandbSink"],
    "lossscale_callbacks.accelerate": ["AccelerateLossScaleMonitor", "install_loss_scaler"],
    "lossscale_callbacks.transformers": ["LossScaleTrainerCallback"],
}
# The outside package a face needs (its test is skipped where that is not installed).
NEEDS = {"lossscale_callbacks.keras": "keras", "lossscale_callbacks.torch": "torch",
         "lossscale_callbacks.lightning": "lightning", "lossscale_callbacks.lightning.fabric": "lightning",
         "lossscale_callbacks.tensorboard": "tensorboard", "lossscale_callbacks.wandb": "wandb",
         "lossscale_callbacks.accelerate": "accelerate", "lossscale_callbacks.transformers": "transformers"}
NOT_COUNTED = {"__version__"}
MAX_NAMES = 40

# Names that left a face stay importable from the module that defines them.
MOVED: dict[str, list[str]] = {
    "lossscale_callbacks.health": ["ConsecutiveSkips", "HealthMonitor", "ScaleOnlyDecreases", "SkipRate",
                                   "StuckAtMinScale", "Verdict", "default_rules"],
    "lossscale_callbacks.metrics": ["MetricsTracker", "Snapshot"],
    "lossscale_callbacks.ops": ["NUMPY_OPS", "NumpyOps", "Ops"],
    "lossscale_callbacks.policy": ["Policy", "policy_from_config"],
    "lossscale_callbacks.sinks": ["GuardedSink", "SinkGroup"],
    "lossscale_callbacks.summary": ["summarize"],
    "lossscale_callbacks.alignment.audit": ["CATEGORIES", "LayerPrecision", "OpPrecision", "PrecisionInfo",
                                            "categorize", "run_audit"],
    "lossscale_callbacks.alignment.gemm": ["einsum_gemm", "matmul_gemm"],
    "lossscale_callbacks.alignment.records": ["Capture", "GemmDim", "LayerInfo", "ModelDim", "OpKind",
                                              "OpRecord", "Pass", "Role"],
    "lossscale_callbacks.alignment.report": ["AuditFinding", "SEVERITIES"],
    "lossscale_callbacks.alignment.rules": ["warn_if_nothing_checked"],
    "lossscale_callbacks.alignment.targets": ["TARGETS", "next_multiple", "recommended_multiple",
                                              "required_multiple", "wave_efficiency"],
    "lossscale_callbacks.keras.arguments": ["resolve_policy"],
    "lossscale_callbacks.keras.wrapping": ["wrap"],
    "lossscale_callbacks.keras.keras_ops": ["KERAS_OPS", "KerasOps", "all_finite"],
    "lossscale_callbacks.keras.tf_ops": ["TF_OPS", "TFOps", "all_finite"],
    "lossscale_callbacks.keras.alignment": ["check_alignment"],
    "lossscale_callbacks.torch.ops": ["TorchOps"],
    "lossscale_callbacks.torch.stock": ["StockSkipCounter", "check_stock_state"],
    "lossscale_callbacks.torch.deepspeed_reader": ["DeepSpeedScalerReader"],
    "lossscale_callbacks.torch.alignment": ["check_alignment"],
    "lossscale_callbacks.tensorboard.reader": ["RunReadError", "read_run", "read_texts"],
    "lossscale_callbacks.tensorboard.sink": ["LAYOUT_CATEGORY", "loss_scale_layout"],
    "lossscale_callbacks.wandb.reader": ["RunInfo", "RunReadError", "read_run", "read_run_info",
                                         "read_tables", "wait_until_finished"],
    "lossscale_callbacks.wandb.sink": ["FINAL_SCALE", "OVERALL_SKIP_RATE", "STEP_METRIC",
                                       "TOTAL_SKIPPED_STEPS", "WandbOfflineWarning"],
}
FRAMEWORKS = ("tensorflow", "torch", "keras", "lightning", "pytorch_lightning", "wandb", "tensorboard",
              "accelerate", "transformers")


def _package_dirs() -> tuple[list[str], dict[str, str]]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return setuptools["packages"], setuptools["package-dir"]


def _source(face: str) -> Path:
    """The file that defines a face, through pyproject's package-dir (integrations/keras is
    lossscale_callbacks.keras)."""
    _, dirs = _package_dirs()
    package = max((p for p in dirs if face == p or face.startswith(p + ".")), key=len)
    path = ROOT / dirs[package]
    path = path.joinpath(*face[len(package):].split(".")[1:])
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _declared_all(face: str) -> list[str]:
    """``__all__`` as written in the face's source (read without importing its framework)."""
    tree = ast.parse(_source(face).read_text())
    values = [ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)]
    assert len(values) == 1, f"{face} must assign __all__ exactly once"
    return list(values[0])


@pytest.mark.parametrize("face", sorted(FACES))
def test_every_face_exports_exactly_its_pinned_names(face):
    assert _declared_all(face) == FACES[face]


def test_every_package_has_a_pinned_face():
    packages, _ = _package_dirs()
    assert set(packages) | {"lossscale_callbacks.lightning.fabric"} == set(FACES)


def test_at_most_40_public_names_and_none_in_two_faces():
    counted = [name for names in FACES.values() for name in names if name not in NOT_COUNTED]
    assert len(counted) <= MAX_NAMES, f"{len(counted)} public names; the budget is {MAX_NAMES}"
    twice = sorted({name for name in counted if counted.count(name) > 1})
    assert twice == [], f"exported from more than one face: {twice}"
    assert not [name for name in counted if name.startswith("_")]


@pytest.mark.parametrize("face", sorted(FACES))
def test_every_public_name_is_importable(face):
    if face in NEEDS:
        pytest.importorskip(NEEDS[face])
    module = importlib.import_module(face)
    assert module.__all__ == FACES[face]
    missing = [name for name in module.__all__ if getattr(module, name, None) is None]
    assert missing == []
    namespace: dict = {}
    exec(f"from {face} import *", namespace)  # star-import follows __all__, lazy names included
    assert set(module.__all__) <= set(namespace)


@pytest.mark.parametrize("module_name", sorted(MOVED))
def test_names_that_left_a_face_are_importable_from_their_module(module_name):
    top = module_name.split(".")[1]
    need = {"keras": "tensorflow", "torch": "torch", "tensorboard": "tensorboard", "wandb": "wandb"}.get(top)
    if need:
        pytest.importorskip(need)
    module = importlib.import_module(module_name)
    assert [name for name in MOVED[module_name] if not hasattr(module, name)] == []


def test_importing_the_core_imports_no_framework():
    # A fresh interpreter: the test process itself may already hold frameworks.
    code = (
        "import sys, lossscale_callbacks, lossscale_callbacks.testing, lossscale_callbacks.alignment\n"
        f"print(','.join(m for m in {FRAMEWORKS!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
