"""Known loss-scale trajectories, written as other engines print them, and as our own LoggingLoop writes them.

A trajectory is the core update rule's states after each step (``trajectory(...)``); each writer
renders what that engine prints for it, each format string copied in shape (not code) from the
engine's source, cited beside it with the version:

* DeepSpeed 0.16.5 (microsoft/DeepSpeed 38327e07f6cd): deepspeed/runtime/fp16/loss_scaler.py
  ``update_scale`` (overflow and hysteresis lines), deepspeed/runtime/engine.py ``_report_progress``,
  logger prefix from deepspeed/utils/logging.py.
* apex 0.1 (NVIDIA/apex e13873debc46): apex/amp/handle.py ``scale_loss``.
* fairseq 0.12.2 (facebookresearch/fairseq 3d262bb25690): fairseq/trainer.py ``train_step``,
  fairseq/optim/dynamic_loss_scaler.py, fairseq/logging/progress_bar.py ``SimpleProgressBar.log``,
  logging format from fairseq_cli/train.py.
* Megatron-LM core_v0.16.1 (NVIDIA/Megatron-LM 55ac7082517c): megatron/training/training.py ``training_log``.
"""

from __future__ import annotations

from lossscale_callbacks._policy import DynamicPolicy
from lossscale_callbacks._update import initial_state, next_state
from lossscale_callbacks.loop._logging_loop import LoggingLoop

# steps, scale after, skipped (cumulative), hysteresis left before the step, overflow
Step = tuple[int, float, int, int, bool]


def trajectory(overflows: set[int], steps: int, initial: float = 2.0**16, growth_interval: int = 2000,
               hysteresis: int = 1) -> list[Step]:
    """The core rule's state after each step 1..steps, overflowing at the steps in ``overflows``."""
    policy = DynamicPolicy(initial_scale=initial, growth_interval=growth_interval, hysteresis=hysteresis,
                           max_scale=2.0**32)
    state, out = initial_state(policy), []
    for step in range(1, steps + 1):
        before_hysteresis = int(state.hysteresis_left)
        state = next_state(policy, state, step not in overflows)
        out.append((step, float(state.scale), int(state.skipped_steps), before_hysteresis, step in overflows))
    return out


def loop_run(log_dir: str, points: list[tuple[int, float, int]], policy: DynamicPolicy | None = None) -> None:
    """Our own LoggingLoop writing the log points ``(step, scale, skipped)`` to TensorBoard."""
    loop = LoggingLoop(policy, tensorboard=log_dir, health=None, echo=None)
    for step, scale, skipped in points:
        loop.observe({"steps": step, "scale": scale, "growth_counter": 0, "hysteresis_left": 1,
                      "skipped_steps": skipped})
    loop.finish()
    loop.close()


def _scale_before(states: list[Step], i: int, initial: float) -> float:
    return states[i - 1][1] if i else initial


# DeepSpeed: deepspeed/utils/logging.py formatter "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:
# %(funcName)s] %(message)s"; log_dist adds "[Rank 0] ".
_DS = "[2025-02-21 12:00:00,000] [INFO] "


def deepspeed_log(states: list[Step], every: int, initial: float = 2.0**16, window: int | None = None,
                  hysteresis: int = 2) -> tuple[str, list]:
    """DeepSpeed's lines for the trajectory (progress every ``every`` steps) and the log points; with
    ``window``, the config dump DeepSpeed prints at start (deepspeed/runtime/config.py print: 29 -
    len(arg) dots; dynamic_loss_scale_args from get_dynamic_loss_scale_args)."""
    lines, points = [], []
    if window is not None:
        args = {"init_scale": int(initial), "scale_window": window, "delayed_shift": hysteresis,
                "consecutive_hysteresis": False, "min_scale": 1}
        for arg, value in (("dynamic_loss_scale_args", args), ("initial_dynamic_scale", int(initial))):
            lines.append(f"{_DS}[config.py:1005:print]   {arg} {'.' * (29 - len(arg))} {value}")
    for i, (step, scale, skipped, hysteresis, overflow) in enumerate(states):
        before = _scale_before(states, i, initial)
        if overflow and scale < before:
            # loss_scaler.py update_scale: int() of both scales
            lines.append(f"{_DS}[loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping "
                         f"step. Attempted loss scale: {int(before)}, reducing to {int(scale)}")
        elif overflow:
            lines.append(f"{_DS}[loss_scaler.py:190:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping "
                         f"step. Attempted loss scale: {int(before)}, but hysteresis is {hysteresis}. "
                         f"Reducing hysteresis to {hysteresis - 1}")
        if step % every == 0:
            lines.append(f"{_DS}[logging.py:128:log_dist] [Rank 0] step={step}, skipped={skipped}, "
                         "lr=[0.0001], mom=[(0.9, 0.999)]")
            points.append((step, scale, skipped))
        lines.append(f"{_DS}[timer.py:264:stop] epoch=0/micro_step={step}/global_step={step}, "
                     "RunningAvgSamplesPerSec=41.2, CurrSamplesPerSec=40.9, MemAllocated=1.2GB")
    return "\n".join(lines) + "\n", points


def apex_log(states: list[Step]) -> tuple[str, list]:
    """apex amp's lines (one per overflow, no step number) and the log points (the overflow steps)."""
    lines, points = [], []
    for step, scale, skipped, _, overflow in states:
        if overflow:
            # apex/amp/handle.py: ("Gradient overflow.  Skipping step, loss scaler " +
            #                      "{} reducing loss scale to {}").format(loss_id, loss_scaler.loss_scale())
            lines.append(f"Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to {scale}")
            points.append((step, scale, skipped))
        elif step % 500 == 0:
            lines.append(f"Train Epoch: 1 [{step * 32}/1000000]\tLoss: 2.301")  # the user's own line
    return "\n".join(lines) + "\n", points


def fairseq_log(states: list[Step], every: int) -> tuple[str, list]:
    """fairseq's overflow and train_inner lines (``--log-format simple``) and the log points."""
    prefix = "2025-09-30 07:16:06 | INFO | "
    lines, points = [], []
    for step, scale, skipped, _, overflow in states:
        updates = step - skipped  # num_updates: applied updates only
        if overflow:
            # trainer.py: f"NOTE: gradient overflow detected, ignoring gradient, {str(e)}" with
            # dynamic_loss_scaler.py: OverflowError("setting loss scale to: " + str(self.loss_scale))
            lines.append(f"{prefix}fairseq.trainer | NOTE: gradient overflow detected, ignoring gradient, "
                         f"setting loss scale to: {scale}")
        if updates and updates % every == 0:
            # progress_bar.py SimpleProgressBar.log: "{}:  {:5d} / {:d} {}".format(prefix, i + 1, size,
            # postfix), postfix "key=value, ..."; values "{:g}" (format_stat)
            lines.append(f"{prefix}train_inner | epoch 001:  {step:5d} / 100000 loss=9.812, nll_loss=9.1, "
                         f"ppl=549.3, wps=1234.5, ups=3.21, wpb=4096, bsz=128, num_updates={updates}, "
                         f"lr=0.0005, gnorm=1.234, loss_scale={scale:g}, train_wall=31, gb_free=10.2, "
                         "wall=62")
            points.append((step, scale, skipped))
    return "\n".join(lines) + "\n", points


def megatron_log(states: list[Step], every: int, nan_not_skipped: frozenset[int] = frozenset()
                 ) -> tuple[str, list]:
    """Megatron-LM's training_log lines every ``every`` iterations, and the log points.

    ``nan_not_skipped``: iterations whose NaN loss Megatron counted as a NaN iteration without
    skipping it (Megatron-LLM#33): their interval's nan count exceeds its skipped count.
    """
    lines, points, skipped_in, nan_in = [], [], 0, 0
    for step, scale, skipped, _, overflow in states:
        skipped_in += overflow
        nan_in += overflow or step in nan_not_skipped
        if step % every == 0:
            lines.append(
                f" [2026-08-22 15:22:22.000000] iteration {step:8d}/{100000:8d} | consumed samples: "
                f"{step * 256:12d} | elapsed time per iteration (ms): 812.3 | learning rate: 1.000000E-04 | "
                f"global batch size:   256 | lm loss: 2.345678E+00 | loss scale: {scale:.1f} | grad norm: "
                f"1.234 | number of skipped iterations: {skipped_in:3d} | number of nan iterations: "
                f"{nan_in:3d} |")
            points.append((step, scale, skipped))
            skipped_in = nan_in = 0
    return "\n".join(lines) + "\n", points
