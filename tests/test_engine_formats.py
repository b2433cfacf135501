"""Each line format of each engine, one literal line apiece (as the engine's source prints it, versions in
``lossscale_callbacks/report/_engine_formats.py``), read by its parser: the variants the trajectory tests do
not write. Runtime: well under a second."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lossscale_callbacks.report._engine_logs import read_run
from lossscale_callbacks.report._engine_parsers import (
    ApexParser,
    DeepSpeedParser,
    FairseqParser,
    MegatronParser,
)
from lossscale_callbacks.report._run_readers import NoLossScaleError

DS = "[2023-05-01 10:00:00,000] [INFO] "


def _points(parser, lines):
    for line in lines:
        assert parser.feed(line), line
    return parser.trajectory()


def test_deepspeed_before_0_8_3_and_its_fused_optimizers():
    # fused_optimizer.py / unfused_optimizer.py (verbose), and fused_optimizer.py's log_dist variant
    trajectory = _points(DeepSpeedParser(), [
        f"{DS}[fused_optimizer.py:174:step] [deepspeed] fp16 dynamic loss scale overflow! Skipping step. "
        "Attempted loss scale: 65536.0, reducing to 32768.0",
        f"{DS}[logging.py:96:log_dist] [Rank 0] Overflow detected. Skipping step. Attempted loss scale: "
        "32768.0, reducing to 16384.0",
        f"{DS}[logging.py:96:log_dist] [Rank 0] step=10, skipped=2, lr=[0.001], mom=[(0.9, 0.999)]"])
    assert trajectory.points == [(10, 16384.0, 2)] and trajectory.findings == []


def test_deepspeed_bf16_overflow_without_a_scale_is_counted_and_said():
    parser = DeepSpeedParser()
    trajectory = _points(parser, [
        f"{DS}[config.py:1005:print]   initial_dynamic_scale ........ 1024",
        f"{DS}[loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step.",
        f"{DS}[logging.py:128:log_dist] [Rank 0] step=10, skipped=1, lr=[0.001], mom=[(0.9, 0.999)]"])
    assert trajectory.points == [(10, 1024.0, 1)]
    assert "gave no scale" in trajectory.findings[0]


def test_deepspeed_config_without_loss_scale_args_starts_at_the_scalers_default():
    """dynamic_loss_scale_args None: ZeRO's DynamicLossScaler starts at its 2**32, whatever
    initial_dynamic_scale says; the first overflow's attempted scale is taken instead."""
    trajectory = _points(DeepSpeedParser(), [
        f"{DS}[config.py:1005:print]   dynamic_loss_scale_args ...... None",
        f"{DS}[config.py:1005:print]   initial_dynamic_scale ........ 65536",
        f"{DS}[logging.py:128:log_dist] [Rank 0] step=1500, skipped=0, lr=[0.001], mom=[(0.9, 0.999)]",
        f"{DS}[loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step. "
        "Attempted loss scale: 4294967296, reducing to 2147483648",
        f"{DS}[logging.py:128:log_dist] [Rank 0] step=1510, skipped=1, lr=[0.001], mom=[(0.9, 0.999)]"])
    # no growth inferred before the first overflow: its attempted scale already holds them
    assert trajectory.points == [(1500, 2.0**32, 0), (1510, 2.0**31, 1)]
    assert trajectory.growth_interval == 1000


def test_deepspeed_progress_lines_alone_need_the_configured_scale():
    progress = f"{DS}[logging.py:128:log_dist] [Rank 0] step=2000, skipped=0, lr=[0.001], mom=[(0.9, 0.999)]"
    assert _points(DeepSpeedParser(), [progress]) is None
    trajectory = _points(DeepSpeedParser(), [
        f"{DS}[config.py:1005:print]   dynamic_loss_scale_args ...... {{'init_scale': 1024, 'scale_window': "
        "1000, 'delayed_shift': 2, 'consecutive_hysteresis': False, 'min_scale': 1}", progress])
    assert trajectory.points == [(2000, 4096.0, 0)] and trajectory.min_scale == 1.0  # grew twice, unseen


def test_fairseq_json_and_end_of_epoch_formats_and_the_amp_line():
    prefix = "2025-09-30 07:16:06 | INFO | "
    trajectory = _points(FairseqParser(), [
        f"{prefix}fairseq.optim.amp_optimizer | AMP: overflow detected, setting scale to to 64.0",
        # JsonProgressBar.log: json.dumps of "{:g}" strings
        f'{prefix}train_inner | {{"epoch": 1, "update": 0.01, "loss": "9.8", "loss_scale": "64", '
        '"num_updates": "9", "lr": "0.0005"}',
        # SimpleProgressBar.print at the end of an epoch: "{prefix} | key value | ..."
        f"{prefix}train | epoch 001 | loss 9.7 | loss_scale 128 | num_updates 19 | lr 0.0005",
        f"{prefix}fairseq_cli.train | FloatingPointError: Minimum loss scale reached (0.0001). Your loss "
        "is probably exploding. Try lowering the learning rate, using gradient clipping or increasing "
        "the batch size."])
    assert trajectory.points == [(10, 64.0, 1), (20, 128.0, 1)]
    assert "Minimum loss scale reached (0.0001)" in trajectory.findings[0]


def test_fairseq_six_digit_scales_are_read_as_the_power_of_two_they_print():
    trajectory = _points(FairseqParser(), [
        "epoch 001:    100 / 1000 loss=9.8, loss_scale=1.04858e+06, num_updates=100, lr=0.0005"])
    assert trajectory.points == [(100, 2.0**20, 0)]


def test_apex_fp16_optimizer_and_a_second_amp_loss_scaler():
    trajectory = _points(ApexParser(), [
        "Gradient overflow.  Skipping step, reducing loss scale to 2147483648.0",  # FP16_Optimizer
        "OVERFLOW within closure! Skipping step, reducing loss scale to 1073741824.0"])
    assert trajectory.points == [(1, 2.0**31, 1), (2, 2.0**30, 2)] and not trajectory.steps_known
    amp = _points(ApexParser(), [
        f"Gradient overflow.  Skipping step, loss scaler {loss} reducing loss scale to 32768.0"
        for loss in (0, 1)])
    assert amp.points == [(1, 32768.0, 1)] and "other than 0" in amp.findings[0]


def test_megatron_arguments_and_a_line_from_before_nan_iterations():
    trajectory = _points(MegatronParser(), [
        "  loss_scale_window ............................... 1000.0",
        "  min_loss_scale .................................. 1.0",
        " iteration      100/    1000 | consumed samples:        25600 | loss scale: 131072.0 | "
        "number of skipped iterations:   3 |"])
    assert trajectory.points == [(100, 131072.0, 3)]
    assert (trajectory.growth_interval, trajectory.min_scale) == (1000, 1.0)


def test_a_megatron_line_printed_twice_is_read_once():
    """Two log handlers (or several ranks) print each iteration line twice: read once, the skips counted
    once and no restart at each copy; the same iteration with other counts is no copy."""
    line = (" [2026-08-22 15:22:22] iteration      {}/    1000 | loss scale: 4096.0 | number of skipped "
            "iterations: {:3d} | number of nan iterations:   0 |")
    lines = [line.format(*at) for at in ((10, 2), (10, 2), (20, 1), (20, 1), (20, 1), (20, 3))]
    trajectory = _points(MegatronParser(), lines)
    assert trajectory.points == [(10, 4096.0, 2), (20, 4096.0, 3), (20, 4096.0, 3)] and trajectory.lines == 6
    assert "3 iteration line(s) repeated the one before them" in " ".join(trajectory.notes)


def test_two_megatron_logs_joined_count_each_runs_skips_from_its_start(tmp_path):
    """``cat run1.log run2.log``: the iteration goes back to 10, where the second run's count starts (it
    failed before: 6 skipped steps at step 10 of a run of 10 steps)."""
    from lossscale_callbacks.report._run_report import build_report

    line = " iteration {:8d}/     100 | loss scale: 1024.0 | number of skipped iterations: {:3d} |"
    lines = [line.format(step, 3) for step in (10, 20)] + [line.format(step, 1) for step in (10, 20, 30)]
    assert _points(MegatronParser(), lines).points == [(10, 1024.0, 3), (20, 1024.0, 6), (10, 1024.0, 1),
                                                       (20, 1024.0, 2), (30, 1024.0, 3)]
    (tmp_path / "joined.log").write_text("\n".join(lines) + "\n")
    report = build_report("joined.log", read_run(str(tmp_path / "joined.log")))
    assert (report.steps, report.skipped_steps, len(report.segments)) == (30, 3, 2)


def test_a_paste_that_collapsed_apexs_two_spaces_is_read():
    """A page's copy keeps one space of apex's two (NVIDIA/apex#318): the same message (issue 37)."""
    line = "Gradient overflow. Skipping step, loss scaler 0 reducing loss scale to 32768.0"
    trajectory = _points(ApexParser(), [line])
    assert trajectory.points == [(1, 32768.0, 1)]


@pytest.mark.parametrize("line", [
    "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 1024, lowering to 512",
    " iteration      100/    1000 | loss scale: 131072.0 | skipped: 3 |",
])
def test_a_variant_of_a_known_format_is_not_read(line):
    parsers = (DeepSpeedParser, MegatronParser, ApexParser, FairseqParser)
    assert not any(parser().feed(line) for parser in parsers)


_PIECES = ["[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: ", "reducing to ", "step=",
           ", skipped=", ", lr=", " iteration ", "/ 100 |", " loss scale: ",
           " number of skipped iterations: ",
           " |", "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to ", "num_updates=",
           "loss_scale=", "NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: ",
           "nan", "inf", "-1", "0", "1e400", "65536.0", "'scale_window': ", "initial_dynamic_scale ....... ",
           "Minimum loss scale reached (", "\x00", "\ufffd", "\r"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.one_of(st.sampled_from(_PIECES), st.text(max_size=8)), max_size=8), max_size=30))
def test_no_line_crashes_the_reader(tmp_path_factory, lines):
    """Any mix of pieces of the formats and other text: read, or refused as holding no loss scale."""
    path = tmp_path_factory.mktemp("fuzz") / "train.log"
    path.write_text("\n".join("".join(pieces) for pieces in lines), encoding="utf-8", errors="replace")
    try:
        series = read_run(str(path))
    except NoLossScaleError:
        return
    steps = [step for step, _ in series["loss_scale/scale"]]
    assert len(steps) == len(series["loss_scale/skipped_steps"]) and all(isinstance(s, int) for s in steps)


@pytest.mark.parametrize("scale", ["1e400", "inf", "nan", "0.0", "-2.0"])
def test_a_scale_that_is_no_loss_scale_is_refused_in_words(tmp_path, scale):
    from lossscale_callbacks.report._report_cli import UNREADABLE, judge_run
    from lossscale_callbacks.report._run_readers import discover_runs

    log = tmp_path / "train.log"
    log.write_text("Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 1024.0\n"
                   f"Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to {scale}\n")
    outcome = judge_run(discover_runs(str(log))[0])
    assert outcome.status == UNREADABLE and "not a loss scale" in outcome.reason


@pytest.mark.parametrize(("text", "level"), [
    ("1", (1.0, 1.0, 1.0, None)),  # not 0.5: Python rounds 0.5 to even, "0"
    ("0", (0.5, 0.0, 0.5, 0.5)),  # any power of two up to 0.5
    ("0.000", (2.0**-11, 0.0, 0.0005, 0.0005)),  # fairseq's '{:.3f}': below 0.0005 (issue 37, fairseq#1529)
    ("0.062", (0.0625, 0.0625, 0.0625, None)),  # 0.0625 rounds to even
    ("0.0001", (2.0**-14, 2.0**-14, 2.0**-13, None)),  # both print so: a level between
    ("1.04858e+06", (2.0**20, 2.0**20, 2.0**20, None)),  # '{:g}', six significant digits
    ("1399", None),  # no power of two prints so: a mean of several (fairseq 2020-01 to 2020-08)
])
def test_a_rounded_scale_is_the_powers_of_two_that_print_so(text, level):
    from lossscale_callbacks.report._engine_text import decimals_of, printed

    got = printed(text, decimals_of(text))
    assert (None if got is None else (got.value, got.low, got.high, got.below)) == level
