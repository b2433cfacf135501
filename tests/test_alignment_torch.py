"""torch shape capture: the zoo, attribution of backward ops, layout, meta device, state, audit."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from alignment_models.expected import CASES, finding_keys, note_keys  # noqa: E402
from alignment_models.reports import torch_report  # noqa: E402
from torch import nn  # noqa: E402

from lossscale_callbacks.alignment._records import Pass  # noqa: E402
from lossscale_callbacks.torch._alignment import capture, check_alignment  # noqa: E402


@pytest.mark.parametrize("name", sorted(CASES))
def test_zoo_model_gets_exactly_its_findings(name):
    report = torch_report(name)
    assert finding_keys(report) == CASES[name].findings, str(report)
    assert note_keys(report) == CASES[name].notes, str(report)


def test_every_pass_is_attributed_to_its_module():
    model = nn.Sequential()
    model.add_module("fc1", nn.Linear(50, 64))
    model.add_module("act", nn.ReLU())
    model.add_module("fc2", nn.Linear(64, 16))
    cap = capture(model, torch.randn(32, 50), dtype="float16")
    seen = {(r.layer, r.pass_, tuple(d.value for d in r.dims)) for r in cap.records}
    # no input gradient of x
    assert seen == {("fc1", Pass.FORWARD, (32, 64, 50)), ("fc1", Pass.BACKWARD, (64, 50, 32)),
                    ("fc2", Pass.FORWARD, (32, 16, 64)), ("fc2", Pass.BACKWARD, (32, 64, 16)),
                    ("fc2", Pass.BACKWARD, (16, 64, 32))}
    assert {r.dtype for r in cap.records} == {"float16"}
    report = check_alignment(model, torch.randn(32, 50), dtype="float16")
    passes = {f.dimension: f.passes for f in report.findings}
    assert passes == {"features_in": ("forward", "weight-gradient")}


def test_nchw_float16_convolutions_get_one_layout_finding():
    model = nn.Sequential(nn.Conv2d(3, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(),
                          nn.Conv2d(64, 64, 3))
    report = check_alignment(model, torch.randn(8, 3, 16, 16), dtype="float16")
    assert [(f.layer, f.dimension, f.severity) for f in report.findings] == [("*", "layout", "medium")]
    assert report.findings[0].layers == ("0", "2", "4")
    fp32 = check_alignment(model, torch.randn(8, 3, 16, 16), dtype="float32", tf32=True)
    assert fp32.findings == []  # the transpose only matters for 16-bit Tensor Core kernels


def test_meta_device_needs_no_memory():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(50, 4096), nn.ReLU(), nn.Linear(4096, 50257))
        sample = torch.empty(32, 50)
    report = check_alignment(model, sample, dtype="float16")
    assert {(f.layer, f.dimension, f.value) for f in report.findings} == {
        ("0", "features_in", 50), ("2", "features_out", 50257)}


def test_model_state_is_left_as_found():
    model = nn.Sequential(nn.Linear(16, 24), nn.BatchNorm1d(24), nn.Linear(24, 8))
    model[0].weight.grad = torch.ones_like(model[0].weight)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    check_alignment(model, torch.randn(32, 16) * 5 + 3, dtype="float16")
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight))
    assert model[2].weight.grad is None
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_the_random_stream_of_training_is_not_shifted():
    # dropout in the checked pass draws random numbers; the training that follows must not notice
    model = nn.Sequential(nn.Linear(16, 24), nn.Dropout(0.5), nn.Linear(24, 8))
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    check_alignment(model, torch.ones(32, 16), dtype="float16")
    assert torch.equal(torch.rand(4), expected)


def test_dtype_auto_follows_active_autocast_or_parameters():
    model = nn.Linear(50, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = check_alignment(model, torch.randn(32, 50), dtype="auto")
        assert {f.dtype for f in auto.findings} == {"bfloat16"}
    half = check_alignment(nn.Linear(50, 64).half(), torch.randn(32, 50).half(), dtype="auto")
    assert {f.dtype for f in half.findings} == {"float16"}


def test_dtype_is_required_and_a_check_where_no_rule_applies_warns():
    from lossscale_callbacks.alignment import NoRuleAppliedWarning

    model = nn.Linear(50, 64)
    with pytest.raises(ValueError, match="dtype is required"):
        check_alignment(model, torch.randn(32, 50))
    # The torch fixture's old silent pass: float32 without TF32 finds nothing, and now says why.
    with pytest.warns(NoRuleAppliedWarning, match="float32 with TF32 off"):
        report = check_alignment(model, torch.randn(32, 50), dtype="float32", tf32=False)
    assert report.findings == [] and report.context["precision"] == "float32"
    report = check_alignment(model, torch.randn(32, 50), dtype="16-mixed")
    assert report.context == {"model": "Linear", "framework": "torch", "parameters": 50 * 64 + 64,
                              "precision": "float16", "batch_size": 32, "tf32": False}
    assert report.header().startswith("Tensor Core alignment check: model Linear, 3,264 parameters")


def test_lightning_module_example_input_array_is_the_default_sample():
    lightning = pytest.importorskip("lightning")

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(50, 64)
            self.example_input_array = torch.zeros(32, 50)

        def forward(self, x):
            return self.fc(x)

    report = check_alignment(Module(), dtype="16-mixed")
    assert [(f.layer, f.dimension, f.value) for f in report.findings] == [("fc", "features_in", 50)]


def test_arguments_are_validated():
    with pytest.raises(ValueError, match="sample is required"):
        check_alignment(nn.Linear(8, 8), dtype="float16")
    with pytest.raises(ValueError, match="dtype must be one of"):
        check_alignment(nn.Linear(8, 8), torch.zeros(8, 8), dtype="float12")
    with pytest.raises(ValueError, match="target must be one of"):
        check_alignment(nn.Linear(8, 8), torch.zeros(8, 8), target="k80")
    with pytest.raises(ValueError, match=r"torch\.nn\.Module"):
        check_alignment(object(), torch.zeros(8, 8))


class SoftmaxNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 128)
        self.norm = nn.LayerNorm(128)
        self.out = nn.Linear(128, 16)

    def forward(self, x):
        return torch.softmax(self.out(self.norm(torch.relu(self.fc(x)))), dim=-1)


def test_audit_flags_a_half_model_with_float16_output_softmax():
    report = check_alignment(SoftmaxNet().half(), torch.randn(32, 64).half(), dtype="auto")
    checks = {(a.check, a.layer, a.severity) for a in report.audit}
    assert checks == {("variable_dtype", "fc", "high"), ("variable_dtype", "norm", "high"),
                      ("variable_dtype", "out", "high"), ("float16_normalization", "norm", "high"),
                      ("float16_softmax", "", "high")}


def test_audit_is_silent_under_autocast_and_flags_a_float16_loss():
    assert check_alignment(SoftmaxNet(), torch.randn(32, 64), dtype="float16").audit == []
    model = nn.Linear(64, 16).half()
    report = check_alignment(model, torch.randn(32, 64).half(), dtype="float16",
                             loss_fn=lambda y: torch.log_softmax(y, -1).mean())
    assert ("float16_loss", "", "high") in {(a.check, a.layer, a.severity) for a in report.audit}
    assert report.op_categories["allow"] == {"float16": 2}


def test_bidirectional_stacked_rnn_and_forward_only():
    model = nn.LSTM(20, 30, num_layers=2, bidirectional=True, batch_first=True)
    for backward in (True, False):
        report = check_alignment(model, torch.randn(8, 16, 20), dtype="float16", backward=backward)
        assert {(f.layer, f.dimension, f.value, f.severity) for f in report.findings} == {
            ("", "rnn_hidden", 30, "high"), ("", "rnn_input", 20, "high")}, str(report)


def test_lstm_projections_are_the_recurrent_gemm_k():
    # With proj_size, W_hh is [4*hidden, proj]: the recurrent GEMM reads the projected state.
    model = nn.LSTM(12, 30, proj_size=20, num_layers=2, batch_first=True)
    report = check_alignment(model, torch.randn(8, 16, 12), dtype="float16")
    found = {(f.layer, f.dimension, f.value, f.severity) for f in report.findings}
    assert found == {("", "rnn_hidden", 30, "high"), ("", "rnn_input", 12, "high"),
                     ("", "rnn_hidden", 20, "high")}, str(report)

    def params(**sizes):
        config = {"hidden_size": 30, "proj_size": 20, **sizes}
        return sum(p.numel() for p in nn.LSTM(12, num_layers=2, **config).parameters())

    by_value = {f.value: f for f in report.findings}
    assert by_value[20].suggested == 24 and by_value[30].suggested == 32
    # the prices are the real parameter growth of the module
    assert by_value[20].param_cost == params(proj_size=24) - params()
    assert by_value[30].param_cost == params(hidden_size=32) - params()


def test_no_gradient_accumulation_hook_fires():
    # DDP's reducer and optimizers in backward hook gradient accumulation; the check must not trigger them.
    model = nn.Linear(16, 24)
    fired = []
    model.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    check_alignment(model, torch.randn(8, 16), dtype="float16")
    assert fired == [] and model.weight.grad is None
