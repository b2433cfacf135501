"""The loss-scale lines other engines have printed over their releases, each taken from the engine's source.

:data:`WORDINGS` is the table: every wording an engine printed, the tag (or commit) it first and last
printed it in, and the file it comes from; the regular expressions below it read them. A pattern matches
the message only and anywhere in a line (``re.search`` or ``finditer``), so a logger's prefix
(DeepSpeed's ``[time] [INFO] [file:line:func]``, fairseq's ``time | INFO | name |``, a launcher's
``[default0]:``), a progress bar the message was glued to, or another message before it is no part of
it. Words are matched with ``\\s+`` between them: a paste that collapsed apex's two spaces
(``Gradient overflow. Skipping step``) is the same message. Numbers are matched as Python prints them
(``65536``, ``65536.0``, ``1e-05``, ``inf``); how exactly a number was printed (all digits, or rounded to
a few decimals) is the parser's business (:mod:`._engine_text`).

Example:
    >>> MEGATRON_LOSS_SCALE.search(" iteration       10/     100 | loss scale: 4096.0 |"
    ...     " number of skipped iterations:   1 | number of nan iterations:   0 |").group("scale")
    '4096.0'
    >>> wording("deepspeed.hysteresis").since
    'v0.8.3'
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["WORDINGS", "Wording", "wording"]

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|[-+]?inf|nan"
_S = r"\s+"  # between two words of a message


@dataclasses.dataclass(frozen=True)
class Wording:
    """One wording an engine printed: its id, the engine, the text (``{}`` where a value goes), the first
    and last tag (or commit, with its date) that printed it (``""``: still printed), and its source file."""

    id: str
    engine: str
    text: str
    since: str
    until: str
    source: str


# Tags and commits are those of the engines' repositories: microsoft/DeepSpeed (tags v0.1.0 to v0.16.4),
# NVIDIA/apex (no version tags before 22.03: commits, with their dates; amp and fp16_utils were removed in
# cb65b8ed, 2025-05-08), facebookresearch/fairseq (v0.5.0 to v0.12.3), NVIDIA/Megatron-LM (from the first
# commit fb4cbdc277, 2019-03-27, to core_v0.16.1) and huggingface/transformers (v4.38.0 to v5.24.0).
WORDINGS: tuple[Wording, ...] = (
    # --- DeepSpeed -------------------------------------------------------------------------------------
    Wording("deepspeed.overflow-v0.1", "deepspeed",
            "[deepspeed] OVERFLOW! Skipping step. Attempted loss scale: {}, reducing to {}",
            "v0.1.0", "v0.3.11",
            "deepspeed/pt/fp16_optimizer.py, fp16_unfused_optimizer.py; deepspeed/runtime/zero/stage1.py"),
    Wording("deepspeed.fused.grad-overflow-on-iteration", "deepspeed",
            "\\nGrad overflow on iteration {} / Reducing dynamic loss scale from {} to {}", "v0.1.0", "",
            "deepspeed/runtime/fp16/fused_optimizer.py, unfused_optimizer.py _update_scale (verbose; "
            "cur_iter counts optimizer steps from 0)"),
    Wording("deepspeed.fused.growth", "deepspeed",
            "No Grad overflow for {} iterations / Increasing dynamic loss scale from {} to {}", "v0.1.0", "",
            "deepspeed/runtime/fp16/fused_optimizer.py _update_scale (verbose)"),
    Wording("deepspeed.fused.static", "deepspeed",
            "Grad overflow on iteration: {} / Using static loss scale of: {}", "v0.2.0", "",
            "deepspeed/runtime/fp16/fused_optimizer.py _update_scale (a static scale: the step is skipped)"),
    Wording("deepspeed.deepscale-rank", "deepspeed",
            "[deepscale] OVERFLOW! Rank {} Skipping step. Attempted loss scale: {}, reducing to {}", "v0.2.0",
            "v0.6.0", "deepspeed/runtime/zero/stage2.py (ZeRO-2 to v0.3.11, again v0.5.8-v0.6.0), stage3.py "
            "(v0.3.12-v0.6.0)"),
    Wording("deepspeed.fused.overflow-detected", "deepspeed",
            "[Rank 0] Overflow detected. Skipping step. Attempted loss scale: {}, reducing to {}",
            "v0.3.1", "",
            "deepspeed/runtime/fp16/fused_optimizer.py step_fused_lamb (log_dist, rank 0)"),
    Wording("deepspeed.fp16-dynamic-overflow", "deepspeed",
            "[deepspeed] fp16 dynamic loss scale overflow! [Rank {} ]Skipping step. "
            "Attempted loss scale: {}, reducing to {}", "v0.3.12", "",
            "deepspeed/runtime/fp16/fused_optimizer.py, unfused_optimizer.py (verbose); zero/stage1.py; "
            "zero/stage2.py with Rank (v0.3.12-v0.5.3)"),
    Wording("deepspeed.rank-overflow", "deepspeed",
            "[deepspeed] OVERFLOW! Rank {} Skipping step. Attempted loss scale: {}, reducing to {}",
            "v0.6.1", "",
            "deepspeed/runtime/zero/stage3.py, stage_1_and_2.py (scales as floats); "
            "deepspeed/runtime/fp16/loss_scaler.py update_scale since v0.8.3 (scales as int())"),
    Wording("deepspeed.hysteresis", "deepspeed",
            "[deepspeed] OVERFLOW! Rank {} Skipping step. Attempted loss scale: {}, but hysteresis is {}. "
            "Reducing hysteresis to {}", "v0.8.3", "", "deepspeed/runtime/fp16/loss_scaler.py update_scale"),
    Wording("deepspeed.overflow-no-scale", "deepspeed", "[deepspeed] OVERFLOW! Rank {} Skipping step.",
            "v0.8.2", "", "deepspeed/runtime/fp16/loss_scaler.py update_scale (a dtype other than fp16)"),
    Wording("deepspeed.at-minimum", "deepspeed",
            "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.",
            "v0.6.5", "",
            "deepspeed/runtime/fp16/loss_scaler.py update_scale (raised; raise_error_at_min_scale)"),
    Wording("deepspeed.progress", "deepspeed", "[Rank 0] step={}, skipped={}, lr={}, mom={}", "v0.1.0", "",
            "deepspeed/runtime/engine.py _report_progress ('rank:{} step={}, ...' in v0.1.0, "
            "deepspeed/pt/deepspeed_light.py)"),
    # --- apex ------------------------------------------------------------------------------------------
    Wording("apex.fp16_optimizer.2018", "apex",
            "OVERFLOW! Skipping step. Attempted loss scale: {}, reducing to {}", "2fa4dbaf (2018-04-25)",
            "889d1712 (2019-02-12)",
            "apex/fp16_utils/fp16_optimizer.py FP16_Optimizer.step (and Megatron-LM's copy in "
            "megatron/fp16/fp16.py, fb4cbdc277 2019-03-27 to v1.1)"),
    Wording("apex.fp16_optimizer.closure.2018", "apex",
            "OVERFLOW within closure! Skipping step. Attempted loss scale: {}, reducing to {}",
            "d52edb9e (2018-06-22)", "889d1712 (2019-02-12)", "apex/fp16_utils/fp16_optimizer.py"),
    Wording("apex.fp16_optimizer.attempted-only", "apex", "OVERFLOW! Skipping step. Attempted loss scale: {}",
            "NVIDIA/tacotron2 09bbec0 (2018-05-03)", "",
            "fp16_optimizer.py of NVIDIA/tacotron2 (its copy of the FP16_Optimizer, halving by 2)"),
    Wording("apex.fp16_optimizer.2019-02", "apex",
            "OVERFLOW[ within closure]! Skipping step, reducing loss scale to {}", "889d1712 (2019-02-12)",
            "d24c25b9 (2019-02-27)", "apex/fp16_utils/fp16_optimizer.py"),
    Wording("apex.gradient-overflow", "apex", "Gradient overflow.  Skipping step, reducing loss scale to {}",
            "d24c25b9 (2019-02-27)", "cb65b8ed (2025-05-08)",
            "apex/fp16_utils/fp16_optimizer.py; apex/amp/handle.py until 3f87614f (2019-04-03)"),
    Wording("apex.amp.loss-scaler", "apex",
            "Gradient overflow.  Skipping step, loss scaler {} reducing loss scale to {}",
            "3f87614f (2019-04-03)", "cb65b8ed (2025-05-08)",
            "apex/amp/handle.py scale_loss (printed by every process)"),
    Wording("apex.amp.old-handle", "apex", "Gradient overflow, skipping update", "e733e78c (2018-05-16)",
            "cb65b8ed (2025-05-08)", "apex/amp/handle.py, opt.py (amp.init; shown by default since fd03f26a, "
            "2019-02-03)"),
    Wording("apex.amp.banner", "apex", "Selected optimization level O{} / loss_scale             : {}",
            "889d1712 (2019-02-12)", "cb65b8ed (2025-05-08)", "apex/amp/frontend.py initialize"),
    # --- fairseq ---------------------------------------------------------------------------------------
    Wording("fairseq.warning-overflow", "fairseq", "| WARNING: overflow detected, setting loss scale to: {}",
            "v0.5.0", "v0.9.0", "fairseq/trainer.py train_step (print)"),
    Wording("fairseq.note-overflow", "fairseq", "NOTE: overflow detected, setting loss scale to: {}",
            "fb76dac1 (2020-01-16)", "v0.10.2", "fairseq/trainer.py train_step (logger.info)"),
    Wording("fairseq.note-gradient-overflow", "fairseq",
            "NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: {}", "v0.12.0", "",
            "fairseq/trainer.py train_step"),
    Wording("fairseq.amp-overflow", "fairseq", "AMP: overflow detected, setting scale to to {}",
            "v0.12.0", "",
            "fairseq/optim/amp_optimizer.py clip_grad_norm (--amp)"),
    Wording("fairseq.minimum", "fairseq",
            "FloatingPointError: Minimum loss scale reached ({}). Your loss is probably exploding. ...",
            "v0.6.0", "", "fairseq/trainer.py (v0.6-v0.9), fairseq/optim/dynamic_loss_scaler.py (v0.10+)"),
    Wording("fairseq.amp-minimum", "fairseq",
            "FloatingPointError: AMP: Minimum loss scale reached ({}). Your loss is probably exploding. Try "
            "restarting training or use fp32. {}", "v0.12.0", "", "fairseq/optim/amp_optimizer.py"),
    Wording("fairseq.nan-gradients", "fairseq", "FloatingPointError: gradients are Nan/Inf", "v0.12.0", "",
            "fairseq/trainer.py train_step (a non-finite norm without the fp16 scaler)"),
    Wording("fairseq.progress.simple", "fairseq", "epoch {:03d}:  {:5d} / {:d} loss=..., num_updates={}, "
            "loss_scale={}, ...", "v0.5.0", "",
            "fairseq/progress_bar.py simple_progress_bar (the index counted from 0 until ef5b71e8, "
            "2020-03-10; from 1 since); fairseq/logging/progress_bar.py SimpleProgressBar"),
    Wording("fairseq.progress.epoch", "fairseq",
            "| epoch {:03d} | ... | num_updates {} | ... | loss_scale {} |",
            "v0.5.0", "", "fairseq/progress_bar.py print (end of an epoch)"),
    Wording("fairseq.progress.json-epoch", "fairseq", '{"epoch": {}, ..., "train_num_updates": "{}", ..., '
            '"train_loss_scale": "{}", ...}', "v0.10.0", "",
            "fairseq/logging/progress_bar.py JsonProgressBar"),
    Wording("fairseq.progress.tqdm", "fairseq", "epoch {:03d}:  8%|▊ | {}/{} [..., num_updates={}, "
            "loss_scale={}]", "v0.6.0", "", "fairseq/logging/progress_bar.py TqdmProgressBar"),
    Wording("fairseq.scale.3-decimals", "fairseq", "loss_scale=0.062 ('{:.3f}': 0.000 is below 0.0005)",
            "v0.6.0", "86793391 (2020-01-11)", "fairseq/progress_bar.py format_stat, trainer.py meters"),
    Wording("fairseq.scale.interval-mean", "fairseq",
            "loss_scale=1399 (the interval's mean, rounded to an integer: no scale level)",
            "86793391 (2020-01-11)", "54b93441 (2020-08-19)",
            "fairseq/trainer.py metrics.log_scalar(round=0)"),
    Wording("fairseq.scale.4-decimals", "fairseq",
            "loss_scale=0.0002 (the last value, rounded to 4 decimals)",
            "83d701ac (2020-08-20)", "", "fairseq/trainer.py metrics.log_scalar(round=4, weight=0)"),
    # --- Megatron-LM -----------------------------------------------------------------------------------
    Wording("megatron.loss-scale-2019", "megatron", " iteration {:8d}/{:8d} | ... | loss scale {:.1f} |",
            "fb4cbdc277 (2019-03-27)", "73af129039 (2019-10-29)", "pretrain_gpt2.py, pretrain_bert.py"),
    Wording("megatron.loss-scale-colon", "megatron", " iteration {:8d}/{:8d} | ... | loss scale: {:.1f} |",
            "73af129039 (2019-10-29)", "", "megatron/training.py training_log (no skip counts before v2.0)"),
    Wording("megatron.skipped-nan", "megatron",
            " number of skipped iterations: {:3d} | number of nan iterations: {:3d} |", "v2.0", "",
            "megatron/training.py, megatron/training/training.py training_log (per log interval)"),
    Wording("megatron.grad-norm", "megatron", " grad norm: {:.3f} |", "v2.5", "",
            "megatron/training/training.py training_log"),
    Wording("megatron.nan-grad-norm-fatal", "megatron",
            "Rank {}: found NaN in local grad norm in backwards pass. Device: {}, node: {}",
            "core_v0.4.0", "",
            "megatron/optimizer/clip_grads.py (an assertion; later megatron/core/distributed "
            "param_and_grad_buffer.py 'found NaN in local grad norm for bucket #{} ...')"),
    # --- the Transformers Trainer ----------------------------------------------------------------------
    Wording("transformers.console-dict-old", "transformers",
            "{'loss': 1.6693, 'learning_rate': 0.0001977, 'epoch': 0.23}", "v4.0.0", "v4.37.2",
            "src/transformers/trainer_callback.py ProgressCallback.on_log (no grad_norm before v4.38.0)"),
    Wording("transformers.console-dict", "transformers",
            "{'loss': 0.0, 'grad_norm': nan, 'learning_rate': 5e-05, 'epoch': 0.54}", "v4.38.0", "v4.57",
            "src/transformers/trainer.py _maybe_log_save_evaluate (grad_norm), trainer_callback.py"),
    Wording("transformers.console-dict-str", "transformers",
            "{'loss': '0.6931', 'grad_norm': 'nan', 'learning_rate': '5e-05', 'epoch': '0.5'}", "v5.0.0", "",
            "src/transformers/trainer_callback.py ProgressCallback.on_log (floats as '{:.4g}' strings)"),
    Wording("transformers.trainer-state", "transformers",
            '"log_history": [{"grad_norm": NaN, ..., "step": 7}, ...]', "v4.38.0", "",
            "src/transformers/trainer_callback.py TrainerState.save_to_json"),
    # --- terminals ------------------------------------------------------------------------------------
    Wording("counter.tqdm", "any", "  1%|▉   | 6/1184 [00:21<1:09:10,  3.52s/it]", "", "",
            "tqdm's bar (the Trainer's, Lightning's, fairseq's): n/total, the steps done"),
    Wording("counter.epoch-bracket", "any", "Epoch: [0][  10/5005] / Train: [3/300][310/625]", "", "",
            "apex examples/imagenet/main_amp.py and the logs modelled on it (epoch and batch from 0)"),
    Wording("counter.dllogger", "any", "Training Epoch: 0 Training Iteration: 101", "", "",
            "NVIDIA DeepLearningExamples' DLLogger lines (global step)"),
    Wording("ansi.caret", "any", "^[[32m[2023-10-24 17:33:21 ...]^[[0m", "", "",
            "colours as a pager or `cat -v` shows them (and sent, \\x1b[32m): dropped"),
    Wording("script.grad-norm", "any", "grad_norm 1.0323 (nan) / grad norm: inf / gnorm=nan", "", "",
            "a training script's own line: the apex ImageNet example's and Swin-Transformer's AverageMeter "
            "(the value, then the running mean in brackets)"),
    Wording("wrapped", "any",
            "Attempted loss scal                                 e: 8192 / a line wrapped over lines",
            "", "", "a terminal's line wrapping: a word broken with padding, an iteration line over four"),
)

_BY_ID = {w.id: w for w in WORDINGS}


def wording(id: str) -> Wording:
    """The wording called ``id``.

    Raises:
        KeyError: no wording has that id.
    """
    return _BY_ID[id]


# --- DeepSpeed ------------------------------------------------------------------------------------------
# Every "Skipping step" message of DeepSpeed's fp16 optimizers and ZeRO stages, tag and rank optional in a
# paste that trimmed them; which wording a match is follows from its groups (see the parser).
DEEPSPEED_OVERFLOW = re.compile(
    rf"(?:\[(?P<tag>deepspeed|deepscale)\]{_S})?(?P<what>OVERFLOW!|fp16 dynamic loss scale overflow!)"
    rf"(?:{_S}Rank{_S}(?P<rank>\d+))?{_S}Skipping step\."
    rf"(?:{_S}Attempted loss scale:{_S}(?P<attempted>{_NUM}),{_S}(?:reducing to{_S}(?P<scale>{_NUM})"
    rf"|but hysteresis is{_S}(?P<hysteresis>\d+)\.{_S}Reducing hysteresis to{_S}(?P<left>-?\d+))"
    rf"|(?!{_S}Attempted))")  # no scale only where none follows (a dtype other than fp16)
DEEPSPEED_DETECTED = re.compile(
    rf"Overflow detected\.{_S}Skipping step\.{_S}Attempted loss scale:{_S}(?P<attempted>{_NUM}),"
    rf"{_S}reducing to{_S}(?P<scale>{_NUM})")
DEEPSPEED_GRAD_OVERFLOW = re.compile(r"Grad overflow on iteration(?P<static>:)?\s+(?P<iteration>\d+)")
DEEPSPEED_REDUCING = re.compile(
    rf"Reducing dynamic loss scale from{_S}(?P<attempted>{_NUM}){_S}to{_S}(?P<scale>{_NUM})")
DEEPSPEED_INCREASING = re.compile(
    rf"Increasing dynamic loss scale from{_S}(?P<before>{_NUM}){_S}to{_S}(?P<scale>{_NUM})")
DEEPSPEED_STATIC = re.compile(rf"Using static loss scale of:?{_S}(?P<scale>{_NUM})")
DEEPSPEED_AT_MINIMUM = "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."
DEEPSPEED_PROGRESS = re.compile(r"\bstep=(?P<step>\d+), skipped=(?P<skipped>\d+), lr=")
# deepspeed/runtime/config.py DeepSpeedConfig.print: '  {arg} {dots} {value}' with 29 - len(arg) dots;
# dynamic_loss_scale_args is get_dynamic_loss_scale_args(): None, or a dict with init_scale,
# scale_window, delayed_shift, consecutive_hysteresis, min_scale (v0.16.4).
DEEPSPEED_INITIAL_SCALE = re.compile(rf"\binitial_dynamic_scale \.+ (?P<value>{_NUM})\s*$")
DEEPSPEED_SCALE_ARGS = re.compile(r"\bdynamic_loss_scale_args \.+ (?P<value>\{.*\}|None)\s*$")
DEEPSPEED_MIN_SCALE = 1.0  # deepspeed/runtime/constants.py FP16_MIN_LOSS_SCALE_DEFAULT, loss_scaler.py

# --- apex -----------------------------------------------------------------------------------------------
APEX_AMP_OVERFLOW = re.compile(
    rf"Gradient overflow\.{_S}Skipping step,{_S}loss scaler{_S}(?P<scaler>\d+){_S}"
    rf"reducing loss scale to{_S}(?P<scale>{_NUM})")
APEX_REDUCING = re.compile(
    rf"(?:(?P<gradient>Gradient overflow\.)|OVERFLOW(?P<closure>{_S}within closure)?!){_S}Skipping step,"
    rf"{_S}reducing loss scale to{_S}(?P<scale>{_NUM})")
APEX_ATTEMPTED = re.compile(
    rf"OVERFLOW(?P<closure>{_S}within closure)?!{_S}Skipping step\.{_S}Attempted loss scale:{_S}"
    rf"(?P<attempted>{_NUM})(?:,{_S}reducing to{_S}(?P<scale>{_NUM}))?")
APEX_OLD_AMP = "Gradient overflow, skipping update"
APEX_BANNER = re.compile(
    rf"^\s*loss_scale\s+:\s+(?P<value>dynamic|{_NUM})\s*$|Selected optimization level O\d")
# apex/amp/scaler.py LossScaler (init 2**16, scale_window 2000, factor 2, max 2**24) and
# apex/fp16_utils/loss_scaler.py DynamicLossScaler (init 2**32, scale_window 1000)
APEX_AMP_WINDOW, APEX_AMP_INITIAL = 2000, 2.0**16
APEX_FP16_WINDOW, APEX_FP16_INITIAL = 1000, 2.0**32

# --- fairseq --------------------------------------------------------------------------------------------
FAIRSEQ_OVERFLOW = re.compile(
    rf"(?:(?P<warning>WARNING:){_S}|NOTE:{_S}(?P<gradient>gradient{_S})?)overflow detected,"
    rf"{_S}(?:ignoring gradient,{_S})?setting loss scale to:{_S}(?P<scale>{_NUM})")
FAIRSEQ_AMP_OVERFLOW = re.compile(rf"AMP: overflow detected, setting scale to(?: to)?{_S}(?P<scale>{_NUM})")
FAIRSEQ_AT_MINIMUM = re.compile(rf"(?P<amp>AMP: )?Minimum loss scale reached \((?P<scale>{_NUM})\)")
FAIRSEQ_NAN_GRADIENTS = "FloatingPointError: gradients are Nan/Inf"
# The progress lines: num_updates counts applied updates only (trainer.py set_num_updates runs when there
# was no overflow); loss_scale is printed rounded (see WORDINGS); a JSON line prefixes "train_".
FAIRSEQ_NUM_UPDATES = re.compile(r'(?<![A-Za-z])num_updates(?:=|": "?| )(?P<value>\d+)')
FAIRSEQ_LOSS_SCALE = re.compile(rf'(?<![A-Za-z])loss_scale(?:=|": "?| )(?P<value>{_NUM})')
FAIRSEQ_EPOCH_COUNTER = re.compile(r"\bepoch (?P<epoch>\d+):\s+(?P<i>\d+) / (?P<n>\d+)\b")
# fairseq's config dump (a dict printed once): the dynamic scaler's settings.
FAIRSEQ_SCALE_WINDOW = re.compile(r"'fp16_scale_window': (?P<value>\d+|None)")
FAIRSEQ_MIN_SCALE = re.compile(rf"'min_loss_scale': (?P<value>{_NUM})")
FAIRSEQ_DEFAULT_MIN_SCALE = 1e-4  # --min-loss-scale (fairseq/dataclass/configs.py, options.py)

# --- Megatron-LM ----------------------------------------------------------------------------------------
# Four searches, each led by its literal text (a regex that spans the line scans it several times over).
# The colon after "loss scale" came in 73af129039; a line a terminal wrapped has no space before a field.
MEGATRON_ITERATION = re.compile(r"iteration\s+(?P<iteration>\d+)/\s*\d+\s*\|")
MEGATRON_LOSS_SCALE = re.compile(rf"loss scale:?\s+(?P<scale>{_NUM})\s*(?:\||$)")
MEGATRON_SKIPPED = re.compile(r"number of skipped iterations:\s*(?P<skipped>\d+)"
                              r"(?:\s*\|\s*number of nan iterations:\s*(?P<nan>\d+))?")
MEGATRON_NAN = re.compile(r"number of nan iterations:\s*(?P<nan>\d+)")
MEGATRON_BAD_GRAD_NORM = ("grad norm: nan", "grad norm: inf", "grad norm: -inf")
MEGATRON_NAN_FATAL = re.compile(r"(?:Rank \d+: )?found NaN in local grad norm[^\n]*")
# megatron/training/arguments.py _print_args: '  {arg} {dots} {value}' with 48 - len(arg) dots.
MEGATRON_ARG = re.compile(rf"^\s*(?P<arg>loss_scale_window|min_loss_scale) \.+ (?P<value>{_NUM})\s*$")
MEGATRON_DEFAULT_MIN_SCALE = 1.0  # --min-loss-scale

# --- the Transformers Trainer ---------------------------------------------------------------------------
# src/transformers/trainer_callback.py TrainerState.save_to_json: "log_history" holds the logs with "step"
# (global_step, skipped optimizer steps included); trainer.py adds "grad_norm" (the norm of the last
# step, NaN/Infinity when its gradients were not finite and the GradScaler skipped it). The console prints
# each log as a dict (ProgressCallback.on_log; floats as '{:.4g}' strings since v5).
TRAINER_STATE_KEYS = ("log_history", "global_step")
TRAINER_GRAD_NORM = re.compile(rf"'grad_norm': '?(?P<value>{_NUM}|-?Infinity|NaN)'?")

# --- a training script's own gradient norm ---------------------------------------------------------------
# Scripts print the norm next to the engine's lines in their own words: "grad_norm 1.0323 (nan)" (Swin's
# and the apex ImageNet example's AverageMeter: the value, then the running mean in brackets), "grad norm
# inf", "gnorm=nan". A NaN or Inf there (in the mean too: one non-finite norm since it was reset) is a
# step whose gradients were not finite.
SCRIPT_GRAD_NORM = re.compile(
    r"\b(?:grad[_ ]norm|gnorm)[\s:=]+(?P<value>[^\s,|()]+)(?:\s+\((?P<mean>[^\s()]+)\))?", re.IGNORECASE)
NOT_FINITE = frozenset(("nan", "inf", "-inf", "+inf", "infinity", "-infinity"))

# --- progress counters of the terminal ------------------------------------------------------------------
TQDM_COUNTER = re.compile(r"\|\s*(?P<n>\d+)/(?P<total>\d+)\s+\[")
EPOCH_BRACKET_COUNTER = re.compile(r"\[\s*(?P<epoch>\d+)(?:/\s*\d+)?\]\s*\[\s*(?P<i>\d+)/(?P<n>\d+)\]")
DLLOGGER_COUNTER = re.compile(r"Training Epoch: \d+ Training Iteration: (?P<step>\d+)")
COUNTER_MARKERS = ("s/it", "it/s", "][", "Training Iteration")

# --- what a terminal does to a line ---------------------------------------------------------------------
ANSI = re.compile(r"(?:\x1b|\^\[)\[[0-9;]*[A-Za-z]")  # a colour as sent, or as `cat -v` shows it
WRAPPED = re.compile(r"(?<=[A-Za-z]) {8,}(?=[A-Za-z])")  # a word a terminal broke with its padding
TRACEBACK = "Traceback (most recent call last):"

# A line that speaks of loss scaling or skipped steps (its lower-case text holds one of these): every line of
# the formats above does (the config dump lines aside), and one that matches none of them is counted and
# quoted as a format this reader does not know. Substring tests, not a regex: a log's lines are mostly
# unrelated, and these reject them fastest.
LOSS_SCALE_WORDS = ("overflow", "loss scal", "loss_scal", "skipp")
# A line of the fatal errors and grad norms read besides: looked for in each line, case as printed.
OTHER_MARKERS = ("Traceback", "FloatingPointError", "found NaN", "grad_norm", "grad norm", "num_updates",
                 "{'loss':")
# A config dump line ("  name ...... value"): settings, not events (DeepSpeed and Megatron print them).
SETTING_LINE = re.compile(r"^\s*(?:\[[^\]]*\]\s*)*\s*\w+ \.{3,} ")
