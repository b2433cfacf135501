"""The loss-scale lines other engines print, one pattern per line format, each taken from the engine's source.

Every pattern names the file, repository and version (or commit) its text was read from. A pattern
matches the message only (``re.search``), so a logger's prefix (DeepSpeed's ``[time] [INFO]
[file:line:func]``, fairseq's ``time | INFO | name |``, a launcher's ``[default0]:``) is no part of it.
Numbers are matched as Python prints them (``65536``, ``65536.0``, ``1e-05``, ``inf``).

Example:
    >>> MEGATRON_LOSS_SCALE.search(" iteration       10/     100 | loss scale: 4096.0 |"
    ...     " number of skipped iterations:   1 | number of nan iterations:   0 |").group("scale")
    '4096.0'
"""

from __future__ import annotations

import re

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|[-+]?inf|nan"

# --- DeepSpeed ------------------------------------------------------------------------------------------
# deepspeed/runtime/fp16/loss_scaler.py, DynamicLossScaler.update_scale (microsoft/DeepSpeed, since v0.8.3
# (PR #3008), unchanged to 0.16.5 at 38327e07f6cd): used by the engine's fp16 path and ZeRO stages 1-3
# (stage_1_and_2.py, stage3.py build it with CreateLossScaler). Scales printed with int():
#   f"[deepspeed] OVERFLOW! Rank {rank} Skipping step."
#   + f" Attempted loss scale: {int(cur_scale)}, reducing to {int(next_scale)}"
#   ... + f" Attempted loss scale: {int(cur_scale)}, but hysteresis is {h}. Reducing hysteresis to {h-1}"
# (the " Attempted ..." part only when the dtype is fp16).
DEEPSPEED_OVERFLOW = re.compile(
    r"\[deepspeed\] OVERFLOW! Rank (?P<rank>\d+) Skipping step\."
    rf"(?: Attempted loss scale: (?P<attempted>{_NUM}), (?:reducing to (?P<scale>{_NUM})"
    r"|but hysteresis is (?P<hysteresis>\d+)\. Reducing hysteresis to (?P<left>-?\d+)))?\s*$")
# deepspeed/runtime/fp16/fused_optimizer.py FP16_Optimizer.step and unfused_optimizer.py (verbose), the
# format of DeepSpeed before 0.8.3 and of its fused/unfused fp16 optimizers since (38327e07f6cd):
#   "[deepspeed] fp16 dynamic loss scale overflow! Skipping step. Attempted loss scale: {}, reducing to {}"
# and fused_optimizer.py step_fused_lamb... (log_dist, "[Rank 0] " prefix):
#   "Overflow detected. Skipping step. Attempted loss scale: {prev_scale}, reducing to {self.cur_scale}"
DEEPSPEED_FP16_OVERFLOW = re.compile(
    r"(?:\[deepspeed\] fp16 dynamic loss scale overflow!|Overflow detected\.) Skipping step\. "
    rf"Attempted loss scale: (?P<attempted>{_NUM}), reducing to (?P<scale>{_NUM})\s*$")
# deepspeed/runtime/fp16/loss_scaler.py update_scale, raised (so printed in the traceback) at the minimum:
DEEPSPEED_AT_MINIMUM = "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."
# deepspeed/runtime/engine.py DeepSpeedEngine._report_progress, every steps_per_print steps (38327e07f6cd;
# the same text since the pipeline engine, PR #392): global_steps counts skipped steps too.
#   log_dist(f"step={step}, skipped={self.skipped_steps}, lr={lr}, mom={mom}", ranks=[0])
DEEPSPEED_PROGRESS = re.compile(r"\bstep=(?P<step>\d+), skipped=(?P<skipped>\d+), lr=")
# deepspeed/runtime/config.py DeepSpeedConfig.print: '  {arg} {dots} {value}' with 29 - len(arg) dots;
# dynamic_loss_scale_args is get_dynamic_loss_scale_args(): None, or a dict with init_scale,
# scale_window, delayed_shift, consecutive_hysteresis, min_scale (38327e07f6cd).
DEEPSPEED_INITIAL_SCALE = re.compile(rf"\binitial_dynamic_scale \.+ (?P<value>{_NUM})\s*$")
DEEPSPEED_SCALE_ARGS = re.compile(r"\bdynamic_loss_scale_args \.+ (?P<value>\{.*\}|None)\s*$")

# --- apex -----------------------------------------------------------------------------------------------
# NVIDIA/apex at e13873debc46 (version 0.1, the last commit before amp and fp16_utils were removed in
# cb65b8ed). apex prints no step number. apex/amp/handle.py scale_loss (patched optimizer.step), loss
# scale from apex/amp/scaler.py LossScaler (init 2**16, scale_window 2000, factor 2, max 2**24):
#   ("Gradient overflow.  Skipping step, loss scaler " + "{} reducing loss scale to {}").format(id, scale)
APEX_AMP_OVERFLOW = re.compile(
    r"Gradient overflow\.  Skipping step, loss scaler (?P<scaler>\d+) "
    rf"reducing loss scale to (?P<scale>{_NUM})\s*$")
# apex/fp16_utils/fp16_optimizer.py FP16_Optimizer.step and its closure path; its DynamicLossScaler
# (apex/fp16_utils/loss_scaler.py) starts at 2**32 with scale_window 1000:
#   "Gradient overflow.  Skipping step, reducing " + "loss scale to {}".format(...)
#   "OVERFLOW within closure! Skipping step, reducing loss scale to {}".format(...)
APEX_FP16_OVERFLOW = re.compile(
    rf"(?:Gradient overflow\.  Skipping step, reducing|OVERFLOW within closure! Skipping step, reducing) "
    rf"loss scale to (?P<scale>{_NUM})\s*$")
APEX_AMP_WINDOW, APEX_AMP_INITIAL = 2000, 2.0**16
APEX_FP16_WINDOW, APEX_FP16_INITIAL = 1000, 2.0**32

# --- fairseq --------------------------------------------------------------------------------------------
# facebookresearch/fairseq at 3d262bb25690 (0.12.2). fairseq/trainer.py train_step, on the OverflowError
# that fairseq/optim/dynamic_loss_scaler.py check_overflow raises ("setting loss scale to: " + str(scale)):
#   logger.info(f"NOTE: gradient overflow detected, ignoring gradient, {str(e)}")
FAIRSEQ_OVERFLOW = re.compile(
    rf"NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: (?P<scale>{_NUM})\s*$")
# fairseq/optim/amp_optimizer.py AMPOptimizer.clip_grad_norm (--amp; the "to to" is fairseq's):
#   logger.info("AMP: overflow detected, setting scale to " f"to {new_loss_scale}")
FAIRSEQ_AMP_OVERFLOW = re.compile(rf"AMP: overflow detected, setting scale to to (?P<scale>{_NUM})\s*$")
# dynamic_loss_scaler.py / amp_optimizer.py, raised at the minimum (the run stops):
FAIRSEQ_AT_MINIMUM = re.compile(rf"(?:AMP: )?Minimum loss scale reached \((?P<scale>{_NUM})\)")
# The train_inner progress lines: fairseq/logging/progress_bar.py SimpleProgressBar.log
# ("{prefix}:  {i:5d} / {n:d} {key=value, ...}"), JsonProgressBar.log (json.dumps, values as "{:g}"
# strings) and .print ("{prefix} | key value | ..."); loss_scale comes from trainer.py
# metrics.log_scalar("loss_scale", ...) and num_updates counts applied updates only (trainer.py
# set_num_updates runs when there was no overflow).
FAIRSEQ_NUM_UPDATES = re.compile(r'\bnum_updates(?:=|": "?| )(?P<value>\d+)')
FAIRSEQ_LOSS_SCALE = re.compile(rf'\bloss_scale(?:=|": "?| )(?P<value>{_NUM})')
# fairseq's config dump (a dict printed once): the dynamic scaler's settings.
FAIRSEQ_SCALE_WINDOW = re.compile(r"'fp16_scale_window': (?P<value>\d+|None)")
FAIRSEQ_MIN_SCALE = re.compile(rf"'min_loss_scale': (?P<value>{_NUM})")

# --- Megatron-LM ----------------------------------------------------------------------------------------
# NVIDIA/Megatron-LM megatron/training/training.py training_log, identical at core_v0.16.1 (55ac7082517c)
# and d98e8a64ddf3 (core 0.20.0 dev); Megatron-DeepSpeed's training_log prints the same fields:
#   ' iteration {:8d}/{:8d} |', ... f' loss scale: {loss_scale:.1f} |', ...
#   ' number of skipped iterations: {:3d} |', ' number of nan iterations: {:3d} |'
# The two counts cover the log interval (total_loss_dict is reset after each line); the iteration
# counts skipped iterations too.
# Four searches, each led by its literal text (a regex that spans the line scans it several times over).
MEGATRON_ITERATION = re.compile(r"iteration\s+(?P<iteration>\d+)/\s*\d+ \|")
MEGATRON_LOSS_SCALE = re.compile(rf" loss scale: (?P<scale>{_NUM}) \|")
MEGATRON_SKIPPED = re.compile(r" number of skipped iterations:\s*(?P<skipped>\d+) \|")
MEGATRON_NAN = re.compile(r" number of nan iterations:\s*(?P<nan>\d+) \|")
# megatron/training/arguments.py _print_args: '  {arg} {dots} {value}' with 48 - len(arg) dots.
MEGATRON_ARG = re.compile(rf"^\s*(?P<arg>loss_scale_window|min_loss_scale) \.+ (?P<value>{_NUM})\s*$")

# --- the Transformers Trainer ---------------------------------------------------------------------------
# transformers/trainer_callback.py TrainerState.save_to_json (json.dumps(asdict(state), indent=2,
# sort_keys=True); transformers 5.24.0): "log_history" holds the logs with "step" (global_step, skipped
# optimizer steps included); trainer.py _maybe_log_save_evaluate adds "grad_norm" (the norm of the
# last step, NaN/Infinity when its gradients were not finite and the GradScaler skipped it).
TRAINER_STATE_KEYS = ("log_history", "global_step")

# A line that speaks of loss scaling or skipped steps (its lower-case text holds one of these): every line of
# the formats above does (DeepSpeed's initial_dynamic_scale dump line aside), and one that matches none
# of them is counted and quoted as a format this reader does not know. Substring tests, not a regex: a
# log's lines are mostly unrelated, and these reject them fastest.
LOSS_SCALE_WORDS = ("overflow", "loss scal", "loss_scal", "skipp")
# A config dump line ("  name ...... value"): settings, not events (DeepSpeed and Megatron print them).
SETTING_LINE = re.compile(r"^\s*(?:\[[^\]]*\]\s*)*\s*\w+ \.{3,} ")
