"""The public faces: what each package exports is pinned here, so a new public name is a decision.

Each package's ``__init__`` exports what users type: at most 41 names in all, no name in two faces, every
one importable, and ``dir()`` of a face shows that face only. Behind the faces is a wall: every other
module is private (a leading underscore) except the documented extension points pinned in ``EXTENSION``.
The core's rooms (``ROOMS``: sub-folders for a family of private modules) are packages with an empty face.
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
        "LossScaleHealthWarning", "LossScaleState", "Sink", "SpikeRule", "__version__", "initial_state",
        "next_state", "skip_samples"],
    "lossscale_callbacks.alignment": [
        "AlignmentReport", "Finding", "NoRuleAppliedWarning", "analyze", "check_alignment"],
    "lossscale_callbacks.keras": [
        "DynamicLossScale", "Fp8ScaleCallback", "LossScaleCallback", "LossScaleOptimizer",
        "audit_keras_precision", "keep_keras_layers_in_float32"],
    "lossscale_callbacks.torch": ["Fp8ScaleMonitor", "LossScaler", "ScalerReader", "audit_precision",
                                  "keep_in_float32"],
    "lossscale_callbacks.lightning": ["LossScaleFSDPPlugin", "LossScaleMonitor", "LossScalePlugin"],
    "lossscale_callbacks.lightning.fabric": [
        "FabricLossScaleMonitor", "LossScaleFabricFSDPPlugin", "LossScaleFabricPlugin"],
    "lossscale_callbacks.tensorboard": ["TensorBoardSink"],
    "lossscale_callbacks.wandb": ["WandbSink"],
    "lossscale_callbacks.accelerate": ["AccelerateLossScaleMonitor", "install_loss_scaler"],
    "lossscale_callbacks.transformers": ["LossScaleTrainerCallback"],
    "lossscale_callbacks.ray": ["RayTrainReporter"],
}
# The outside package a face needs (its test is skipped where that is not installed): an integration's
# folder is named as its outside package, integrations/<name> -> lossscale_callbacks.<name>.
NEEDS = {face: face.split(".")[1] for face in FACES
         if "." in face and face != "lossscale_callbacks.alignment"}
NOT_COUNTED = {"__version__"}
# 37 after round 4; round 5 decided on SpikeRule (the opt-in spike skip), Fp8ScaleCallback and
# Fp8ScaleMonitor (fp8 scale health) and skip_samples (resuming without a ledger's bad samples): 41.
MAX_NAMES = 41

# The documented extension points (what a sink, a health rule, a run reader or an integration needs),
# and the test oracles a backend proves itself with. Everything else behind the faces is private.
EXTENSION: dict[str, list[str]] = {
    "lossscale_callbacks.extend": [
        "ConsecutiveSkips", "IntervalOutcomes", "MissingExtraError", "NotHeld", "Ops", "Policy",
        "RanksDisagree", "Reader", "Rule", "RunReadError", "ScaleOnlyDecreases", "Series", "SkipRate",
        "Snapshot", "StepOutcome", "StuckAtMinScale", "Verdict", "default_rules", "policy_from_config",
        "register_sink", "require"],
    # The contract between the core and the integrations (docs/adding_an_integration.md), and what an
    # integration that builds on torch may use of the torch integration.
    "lossscale_callbacks.integration": [
        "APPLIED_NONFINITE_CODE", "APPLIED_STEPS", "CAUSES", "CODES", "COUNT_METRICS", "DASHBOARD_CHARTS",
        "DASHBOARD_SECTION", "DEFAULT_MAX_UNZIPPED_MIB", "E4M3", "E5M2", "EMA", "FINAL_SCALE",
        "FP8_TAG_PREFIX", "FP16_MIN_SUBNORMAL", "GROWTH_INTERVAL", "HISTOGRAM_EXPONENTS", "INT64_MAX",
        "MAX_SCALE", "MIN_SCALE", "OVERALL_SKIP_RATE", "POLICY_TAG", "SCALE", "SCHEDULER", "SKIPPED_STEPS",
        "SPIKE_CODE", "STATE_FIELDS", "STEP_METRIC", "TAG_PREFIX", "TOTAL_APPLIED_STEPS",
        "TOTAL_SKIPPED_STEPS", "TRAINER_STEP", "ActivationTrace", "AuditResult", "Capture", "DelayedHistory",
        "FollowerCount", "Fp8Format", "Fp8Ranks", "Fp8Read", "FrameworkAdvice", "GradientRange",
        "GuardedSink", "IntervalForensics", "IntervalOutcomes", "LayerHeadroom", "LayerInfo",
        "LayerPrecision", "Ledger", "LoggingArgs", "ManagedSink", "MicroBatch", "MissingExtraError",
        "ModelDim", "ModelTooDeepError", "OpPrecision", "OpRecord", "Pass", "Policy", "PrecisionInfo",
        "RankStates", "RankedState", "Replay", "Role", "RunReadError", "RunSeries", "SampleTracker",
        "Snapshot", "SpikeRule", "TensorRead", "Verdict", "advise", "bad_steps", "carry", "check_archive",
        "check_batch_size", "check_bool", "check_choice", "check_diagnose", "check_int", "check_known",
        "check_ledger",
        "check_number", "check_policy", "check_spike", "decode_records", "einsum_gemm", "ended_inside_record",
        "get_target", "host_number", "interval_args", "is_event_file_name", "is_policy", "is_regular_file",
        "largest_finite_scale", "layer_of", "lazy_attributes", "logging_args", "matmul_gemm",
        "nonfinite_cause", "observe_together", "observed_state", "policy_bounds_from_markdown",
        "policy_from_config", "policy_values_from_markdown", "process_rank", "require", "sampled_within",
        "smallest_keep_set", "step_code", "user_stacklevel", "validate_state", "warn_if_nothing_checked"],
    "lossscale_callbacks.torch.integration": [
        "GRAD_SCALER_KEYS", "ScalerStepMonitor", "TorchOps", "check_replay", "has_deepspeed_scaler",
        "ledger_capture", "loss_of_output", "warn_no_scaler"],
    "lossscale_callbacks.testing": [
        "ConformanceCase", "assert_conforms", "conformance_cases", "reference_headroom",
        "reference_histogram", "reference_run", "stack_states"],
}
# The core's rooms: private sub-packages that hold a family of modules and export nothing.
ROOMS = ("lossscale_callbacks.forensics", "lossscale_callbacks.fp8", "lossscale_callbacks.ledger",
         "lossscale_callbacks.loop", "lossscale_callbacks.report", "lossscale_callbacks.skips")
FRAMEWORKS = ("tensorflow", "torch", "keras", "lightning", "pytorch_lightning", "wandb", "tensorboard",
              "accelerate", "transformers", "ray")


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
    values = [ast.literal_eval(node.value) for node in tree.body
              if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                       for t in node.targets))
              or (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                  and node.target.id == "__all__")]
    assert len(values) == 1, f"{face} must assign __all__ exactly once"
    return list(values[0])


@pytest.mark.parametrize("face", sorted(FACES))
def test_every_face_exports_exactly_its_pinned_names(face):
    assert _declared_all(face) == FACES[face]


def test_every_package_has_a_pinned_face():
    packages, _ = _package_dirs()
    assert set(packages) | {"lossscale_callbacks.lightning.fabric"} == set(FACES) | set(ROOMS)


@pytest.mark.parametrize("room", ROOMS)
def test_a_room_is_private_and_exports_nothing(room):
    assert _declared_all(room) == []
    module = importlib.import_module(room)
    assert "private room" in module.__doc__
    namespace: dict = {}
    exec(f"from {room} import *", namespace)
    assert set(namespace) == {"__builtins__"}
    inside = [name for name in _modules() if name.startswith(room + ".")]
    assert inside and all(name.rsplit(".", 1)[1].startswith("_") for name in inside)


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


@pytest.mark.parametrize("module_name", sorted(EXTENSION))
def test_every_extension_point_exports_exactly_its_pinned_names(module_name):
    assert _declared_all(module_name) == EXTENSION[module_name]
    if module_name.startswith("lossscale_callbacks.torch."):
        pytest.importorskip("torch")
    module = importlib.import_module(module_name)
    assert [name for name in module.__all__ if not hasattr(module, name)] == []


def _modules() -> list[str]:
    """Every module of the installed package, by its dotted name (through pyproject's package-dir)."""
    packages, dirs = _package_dirs()
    names = []
    for package in packages:
        for path in sorted((ROOT / dirs.get(package, package.replace(".", "/"))).glob("*.py")):
            names.append(package if path.stem == "__init__" else f"{package}.{path.stem}")
    return names


def test_no_module_behind_the_faces_has_a_public_name():
    public = set(FACES) | set(EXTENSION) | set(ROOMS)
    leaked = [name for name in _modules() if name not in public
              and not name.split(".")[-1].startswith("_")]
    assert leaked == [], f"public module names that are neither a face nor an extension point: {leaked}"
    assert set(FACES) | set(EXTENSION) <= set(_modules())


@pytest.mark.parametrize("face", sorted(FACES))
def test_dir_of_a_face_shows_the_face_only(face):
    if face in NEEDS:
        pytest.importorskip(NEEDS[face])
    module = importlib.import_module(face)
    assert dir(module) == sorted(FACES[face])


def test_importing_the_core_imports_no_framework():
    # A fresh interpreter: the test process itself may already hold frameworks.
    code = (
        "import sys, lossscale_callbacks, lossscale_callbacks.testing, lossscale_callbacks.alignment\n"
        "import lossscale_callbacks.extend\n"
        f"print(','.join(m for m in {FRAMEWORKS!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
