"""The contract between the core and an integration: what a framework integration may use from the core.

An integration (a folder ``integrations/<name>/``, installed as ``lossscale_callbacks.<name>``) imports the
core only through the package faces and this module:

* :mod:`lossscale_callbacks`: what users type (the policies, the state and its update rule, ``LoggingLoop``,
  the ``Sink`` protocol, ``METRIC_NAMES``);
* :mod:`lossscale_callbacks.alignment`: ``analyze`` and ``AlignmentReport``, for a shape capture;
* this module: each name below, with one line on what it is for. The names of
  :mod:`lossscale_callbacks.extend` an integration needs (``require``, ``Policy``, ``Snapshot``...) are
  re-exported here, so that an integration imports one module besides the faces.

Never a private module (a leading underscore) of the core, and never another integration's private
module: one that builds on torch (Lightning, Fabric, Accelerate, the Trainer, Ray, Keras on its torch
backend) uses :mod:`lossscale_callbacks.torch.integration`, and a sink integration's face only when the
user asks for that sink. ``tests/test_integration_contract.py`` reads every import of every file under
``integrations/`` (those inside functions too) and keeps it so; ``docs/adding_an_integration.md`` lists the
names from this module. Everything behind the faces and this contract may change in any release.

The names are imported from the modules behind them when first used, so an integration that needs one
corner of the core (a run reader) loads only that corner.

Example:
    >>> from lossscale_callbacks.integration import check_int
    >>> check_int("trace_every", 100)
    100
    >>> check_int("trace_every", 0)
    Traceback (most recent call last):
    ...
    ValueError: trace_every must be an integer in [1, 2147483647], got 0
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lossscale_callbacks._extras import lazy_attributes

if TYPE_CHECKING:  # for type checkers and editors; at run time each name is imported on first use
    from lossscale_callbacks._extras import MissingExtraError, require
    from lossscale_callbacks._health import Verdict
    from lossscale_callbacks._metrics import (
        APPLIED_STEPS,
        COUNT_METRICS,
        DASHBOARD_CHARTS,
        DASHBOARD_SECTION,
        FINAL_SCALE,
        FP8_TAG_PREFIX,
        GROWTH_INTERVAL,
        MAX_SCALE,
        MIN_SCALE,
        OVERALL_SKIP_RATE,
        POLICY_TAG,
        SCALE,
        SKIPPED_STEPS,
        STEP_METRIC,
        TAG_PREFIX,
        TOTAL_APPLIED_STEPS,
        TOTAL_SKIPPED_STEPS,
        Snapshot,
        observed_state,
        policy_bounds_from_markdown,
        policy_values_from_markdown,
    )
    from lossscale_callbacks._policy import Policy, check_policy, is_policy, policy_from_config
    from lossscale_callbacks._ranks import process_rank
    from lossscale_callbacks._sinks import GuardedSink, ManagedSink
    from lossscale_callbacks._stacklevel import user_stacklevel
    from lossscale_callbacks._state import STATE_FIELDS
    from lossscale_callbacks._validation import (
        INT64_MAX,
        check_bool,
        check_choice,
        check_int,
        check_known,
        check_number,
        host_number,
        validate_state,
    )
    from lossscale_callbacks.alignment._audit import LayerPrecision, OpPrecision, PrecisionInfo
    from lossscale_callbacks.alignment._check_limits import (
        DEFAULT_MAX_UNZIPPED_MIB,
        ModelTooDeepError,
        check_archive,
        check_batch_size,
    )
    from lossscale_callbacks.alignment._gemm import einsum_gemm, matmul_gemm
    from lossscale_callbacks.alignment._records import (
        Capture,
        FrameworkAdvice,
        LayerInfo,
        ModelDim,
        OpRecord,
        Pass,
        Role,
    )
    from lossscale_callbacks.alignment._rules import warn_if_nothing_checked
    from lossscale_callbacks.alignment._targets import get_target
    from lossscale_callbacks.forensics._activations import ActivationTrace
    from lossscale_callbacks.forensics._advice import (
        AuditResult,
        GradientRange,
        advise,
        largest_finite_scale,
        smallest_keep_set,
    )
    from lossscale_callbacks.forensics._gradients import (
        CAUSES,
        FP16_MIN_SUBNORMAL,
        HISTOGRAM_EXPONENTS,
        IntervalForensics,
        LayerHeadroom,
        check_diagnose,
        layer_of,
        sampled_within,
    )
    from lossscale_callbacks.fp8._delayed import DelayedHistory, observe_together
    from lossscale_callbacks.fp8._formats import E4M3, E5M2, Fp8Format
    from lossscale_callbacks.fp8._ranks import Fp8Ranks
    from lossscale_callbacks.fp8._reads import Fp8Read, TensorRead
    from lossscale_callbacks.ledger._book import Ledger, bad_steps, check_ledger
    from lossscale_callbacks.ledger._entry import MicroBatch, Replay
    from lossscale_callbacks.ledger._samples import SampleTracker
    from lossscale_callbacks.loop._clock import interval_args
    from lossscale_callbacks.loop._logging_loop import LoggingArgs, logging_args
    from lossscale_callbacks.loop._rank_agreement import RankedState, RankStates
    from lossscale_callbacks.report._run_readers import (
        RunReadError,
        RunSeries,
        ended_inside_record,
        is_event_file_name,
        is_regular_file,
    )
    from lossscale_callbacks.skips._followers import EMA, SCHEDULER, TRAINER_STEP, FollowerCount
    from lossscale_callbacks.skips._outcomes import (
        APPLIED_NONFINITE_CODE,
        CODES,
        SPIKE_CODE,
        IntervalOutcomes,
        carry,
        decode_records,
        nonfinite_cause,
        step_code,
    )
    from lossscale_callbacks.skips._spike import SpikeRule, check_spike

# section -> {name: (the module that defines it, what an integration uses it for: one line)}.
_CONTRACT: dict[str, dict[str, tuple[str, str]]] = {
    "Arguments and state": {
        "check_bool": ("_validation", "An argument that must be a bool, else a ValueError naming it."),
        "check_choice": ("_validation",
            "An argument that must be one of a few values, else a ValueError listing them."),
        "check_int": ("_validation",
            "An integer argument inside a range, else a ValueError naming it and the range."),
        "check_known": ("_validation",
            "Refuse the keys or names of a dict or list that are not among the allowed ones."),
        "check_number": ("_validation",
            "A finite number inside an interval, else a ValueError naming it and the interval."),
        "check_policy": ("_policy",
            "An argument that must be a policy (or None where allowed), else a ValueError."),
        "is_policy": ("_policy", "Whether a value is a DynamicPolicy or a FixedPolicy."),
        "INT64_MAX": ("_validation",
            "The largest count a state holds (int64): the upper bound of the count checks."),
        "STATE_FIELDS": ("_state", "The names of the state's fields in order, as checkpoints store them."),
        "validate_state": ("_validation",
            "The one check of a state that comes in (constructor, checkpoint, load_state_dict): all or "
            "nothing."),
        "host_number": ("_validation",
            "A one-element array or tensor as its Python number (reads the device): at the log interval "
            "only."),
        "observed_state": ("_metrics",
            "A state read from a scaler, checked and as host numbers: what the loop observes."),
    },
    "The logging loop": {
        "LoggingArgs": ("loop._logging_loop",
            "The shared logging arguments (tensorboard, wandb, sinks, health, echo) an integration takes as"
            " **logging."),
        "logging_args": ("loop._logging_loop",
            "An integration's **logging checked against LoggingArgs, refused as Python refuses an unknown "
            "keyword."),
        "interval_args": ("loop._clock",
            "An integration's log_every and every= sorted out once (old spellings warn)."),
        "user_stacklevel": ("_stacklevel",
            "The stacklevel that points a warning at the user's line, not at the framework's."),
        "RankStates": ("loop._rank_agreement",
            "Every rank's state gathered at one read, for the loop's rank agreement."),
        "RankedState": ("loop._rank_agreement",
            "A state read on one rank that carries every rank's (RankStates)."),
    },
    "Skip truth: each step applied or skipped, and what follows the optimizer": {
        "IntervalOutcomes": ("skips._outcomes",
            "The steps of one log interval that were not ordinary applied ones, and the counts per cause."),
        "CODES": ("skips._outcomes", "The outcome codes a device writes each step (0 is an applied step)."),
        "SPIKE_CODE": ("skips._outcomes", "The code of a step the spike rule skipped."),
        "APPLIED_NONFINITE_CODE": ("skips._outcomes",
            "The code of a step applied with non-finite gradients (monitoring only)."),
        "decode_records": ("skips._outcomes",
            "A device ring's records since the last read, oldest first, and how many were overwritten."),
        "step_code": ("skips._outcomes",
            "A step's outcome code from its skip decision, branch-free on an Ops: what a ring writes."),
        "nonfinite_cause": ("skips._outcomes",
            "What a skipped non-finite step is called under a policy: overflow (fp16) or nonfinite."),
        "carry": ("skips._outcomes",
            "A state read at the interval carrying its outcomes and the followers' counts to the loop."),
        "SpikeRule": ("skips._spike", "The opt-in loss-spike rule's settings (sigma, window, warmup)."),
        "check_spike": ("skips._spike", "The spike argument checked: None, True or a SpikeRule."),
        "FollowerCount": ("skips._followers",
            "A scheduler's, an EMA's or a trainer's own step count at a read, for the not-held check."),
        "SCHEDULER": ("skips._followers", "The follower kind of an LR scheduler."),
        "EMA": ("skips._followers", "The follower kind of an EMA."),
        "TRAINER_STEP": ("skips._followers", "The follower kind of a trainer's step counter."),
    },
    "Sinks and run readers": {
        "GuardedSink": ("_sinks",
            "Runs a sink so that its failure costs one warning, never the training run."),
        "ManagedSink": ("_sinks",
            "The base of a sink that owns a backend: guarded, rank 0 only, closed at exit."),
        "lazy_attributes": ("_extras",
            "A face's __getattr__ that imports each name from its module on first use."),
        "RunSeries": ("report._run_readers",
            "What a run reader returns with its series: the notes on what it read."),
        "ended_inside_record": ("report._run_readers",
            "The one rule for a run file that ends inside a record (a run still being written)."),
        "is_event_file_name": ("report._run_readers", "Whether a file name is a TensorBoard event file's."),
        "is_regular_file": ("report._run_readers",
            "Whether a path is a regular file (a FIFO named like a run file would block)."),
    },
    "Metric names and the policy table": {
        "SCALE": ("_metrics", "The loss scale's tag, loss_scale/scale."),
        "SKIPPED_STEPS": ("_metrics", "The cumulative skipped steps' tag, loss_scale/skipped_steps."),
        "COUNT_METRICS": ("_metrics",
            "The metrics that are whole numbers (written as integers where a logger can)."),
        "TAG_PREFIX": ("_metrics", "The prefix of every tag this library writes, loss_scale/."),
        "DASHBOARD_SECTION": ("_metrics", "The title of the dashboards' loss-scale section."),
        "DASHBOARD_CHARTS": ("_metrics", "The dashboards' loss-scale charts in order: (title, tag)."),
        "STEP_METRIC": ("_metrics", "The step axis' own metric, where a dashboard needs one (W&B)."),
        "FINAL_SCALE": ("_metrics", "The run summary's final scale."),
        "TOTAL_SKIPPED_STEPS": ("_metrics", "The run summary's skipped steps."),
        "APPLIED_STEPS": ("_metrics", "The cumulative applied steps' tag, loss_scale/applied_steps."),
        "TOTAL_APPLIED_STEPS": ("_metrics", "The run summary's applied steps."),
        "OVERALL_SKIP_RATE": ("_metrics", "The run summary's skip rate."),
        "POLICY_TAG": ("_metrics", "The tag under which the policy is written once per run."),
        "MIN_SCALE": ("_metrics", "The policy's min_scale, written beside the scale."),
        "MAX_SCALE": ("_metrics", "The policy's max_scale, written beside the scale."),
        "GROWTH_INTERVAL": ("_metrics", "The policy's growth interval, read back by the reports."),
        "policy_values_from_markdown": ("_metrics",
            "The policy table written as text, read back as setting -> value."),
        "policy_bounds_from_markdown": ("_metrics",
            "The policy's (min_scale, max_scale) read back from its table."),
    },
    "Overflow forensics and precision advice": {
        "check_diagnose": ("forensics._gradients",
            "The diagnose argument checked: False, True or \"every_step\"."),
        "IntervalForensics": ("forensics._gradients",
            "What the device accumulated over one log interval, read once (host numbers)."),
        "LayerHeadroom": ("forensics._gradients",
            "One layer's largest scaled gradient and underflow share at a sampled step."),
        "CAUSES": ("forensics._gradients",
            "The causes of a skipped step, in the order the device counts them."),
        "FP16_MIN_SUBNORMAL": ("forensics._gradients",
            "float16's smallest subnormal: below it a gradient underflows to zero."),
        "HISTOGRAM_EXPONENTS": ("forensics._gradients",
            "The first and the last edge of the gradient histogram, as binary exponents."),
        "layer_of": ("forensics._gradients", "The layer that owns a parameter, from its name."),
        "sampled_within": ("forensics._gradients",
            "Whether a step of an execution is one to sample, on the host's count."),
        "ActivationTrace": ("forensics._activations",
            "What the forward trace captured over one log interval (host numbers)."),
        "AuditResult": ("forensics._advice",
            "An offline audit's answer: the advice and the numbers it rests on."),
        "GradientRange": ("forensics._advice",
            "The unscaled gradients' largest and smallest significant magnitudes."),
        "advise": ("forensics._advice",
            "The precision advice from what was seen: the core's rules and words."),
        "largest_finite_scale": ("forensics._advice",
            "The largest power-of-two scale at which a run stays finite, by bisection."),
        "smallest_keep_set": ("forensics._advice",
            "The layers to keep in float32, found by running until a run is finite."),
    },
    "FP8 scales": {
        "TensorRead": ("fp8._reads",
            "One fp8 tensor (a layer's input, weight or output gradient) at one read: amax, scale, counts."),
        "Fp8Read": ("fp8._reads", "Every watched fp8 tensor at one read, what the loop observes as fp8=."),
        "Fp8Ranks": ("fp8._ranks",
            "Every rank's scales that must agree, gathered at one read (Fp8Read.ranks)."),
        "DelayedHistory": ("fp8._delayed",
            "An amax history followed from read to read: every step's amax and scale, a load, an outlier."),
        "observe_together": ("fp8._delayed",
            "DelayedHistory.observe of several histories read at one step, rebuilt at once where alike."),
        "Fp8Format": ("fp8._formats",
            "An fp8 format: its largest value, the saturation and underflow thresholds of a cast."),
        "E4M3": ("fp8._formats", "float8_e4m3fn: inputs and weights (448 at most)."),
        "E5M2": ("fp8._formats", "float8_e5m2: gradients under the hybrid recipes (57344 at most)."),
        "FP8_TAG_PREFIX": ("_metrics", "The prefix of the fp8 scales' tags, fp8/ (readers keep them)."),
    },
    "Shape capture for the alignment checker": {
        "Capture": ("alignment._records", "Everything one capture recorded: ops, layers, model dimensions."),
        "OpRecord": ("alignment._records",
            "One executed GEMM or convolution (op, M, N, K, dtype, layer, pass)."),
        "LayerInfo": ("alignment._records", "A layer's type and model dimensions."),
        "ModelDim": ("alignment._records", "A model dimension a layer declares, and what changing it costs."),
        "Pass": ("alignment._records", "The pass an op runs in (forward, backward)."),
        "Role": ("alignment._records", "What a model dimension is (features, heads, vocabulary...)."),
        "FrameworkAdvice": ("alignment._records",
            "How the framework fixes what the rules find: its API in a report's words."),
        "matmul_gemm": ("alignment._gemm", "(batch, M, N, K) of a @ b."),
        "einsum_gemm": ("alignment._gemm", "(batch, M, N, K) of a two-operand einsum."),
        "get_target": ("alignment._targets", "The target argument checked: a GPU name or None."),
        "warn_if_nothing_checked": ("alignment._rules",
            "Warn when a report is clean only because no rule applied."),
        "PrecisionInfo": ("alignment._audit", "The mixed-precision audit's inputs, filled by a capture."),
        "LayerPrecision": ("alignment._audit", "One layer's precision as configured."),
        "OpPrecision": ("alignment._audit", "One executed op's dtype, layer and pass."),
        "check_archive": ("alignment._check_limits",
            "Refuse a model archive that would inflate beyond a limit (a zip bomb)."),
        "check_batch_size": ("alignment._check_limits",
            "The batch size checked against what a traced graph holds."),
        "DEFAULT_MAX_UNZIPPED_MIB": ("alignment._check_limits",
            "The default limit of check_archive, in MiB."),
        "ModelTooDeepError": ("alignment._check_limits",
            "A model too deep to load or trace within the recursion limit."),
    },
    "The ledger of bad steps": {
        "Ledger": ("ledger._book",
            "One rank's bad steps: bounded, written as JSON lines beside the dashboards, told in words."),
        "bad_steps": ("ledger._book",
            "An interval's bad steps (cause, scale, applied) from the skip truth's IntervalOutcomes."),
        "check_ledger": ("ledger._book",
            "An integration's ledger= argument checked: False, True or a folder, else a ValueError."),
        "MicroBatch": ("ledger._entry",
            "One micro-batch of a bad step: its place and its sample identities."),
        "Replay": ("ledger._entry",
            "What replaying a bad step found: same scale, lower scale, float32, layers."),
        "SampleTracker": ("ledger._samples",
            "Sample identities per micro-batch on the host, filed under their optimizer step, bounded."),
        "process_rank": ("_ranks", "This process's global rank (0 outside a distributed job)."),
    },
    "Re-exported from lossscale_callbacks.extend, so that an integration imports one module": {
        "require": ("_extras",
            "Import an integration's outside package, or raise MissingExtraError naming the pip extra."),
        "MissingExtraError": ("_extras", "The ImportError of a missing optional package, naming the extra."),
        "Policy": ("_policy", "The type of a policy: DynamicPolicy or FixedPolicy."),
        "policy_from_config": ("_policy",
            "A policy from its saved config (a checkpoint's or a framework's)."),
        "Snapshot": ("_metrics", "What the loop saw at one read: the state, the interval's skips and rates."),
        "Verdict": ("_health", "A health rule's finding: rule, action, step and message."),
        "RunReadError": ("report._run_readers",
            "A run reader's error when a path is not its format or is damaged."),
    },
}

__all__ = [
    "APPLIED_NONFINITE_CODE",
    "APPLIED_STEPS",
    "CAUSES",
    "CODES",
    "COUNT_METRICS",
    "DASHBOARD_CHARTS",
    "DASHBOARD_SECTION",
    "DEFAULT_MAX_UNZIPPED_MIB",
    "E4M3",
    "E5M2",
    "EMA",
    "FINAL_SCALE",
    "FP8_TAG_PREFIX",
    "FP16_MIN_SUBNORMAL",
    "GROWTH_INTERVAL",
    "HISTOGRAM_EXPONENTS",
    "INT64_MAX",
    "MAX_SCALE",
    "MIN_SCALE",
    "OVERALL_SKIP_RATE",
    "POLICY_TAG",
    "SCALE",
    "SCHEDULER",
    "SKIPPED_STEPS",
    "SPIKE_CODE",
    "STATE_FIELDS",
    "STEP_METRIC",
    "TAG_PREFIX",
    "TOTAL_APPLIED_STEPS",
    "TOTAL_SKIPPED_STEPS",
    "TRAINER_STEP",
    "ActivationTrace",
    "AuditResult",
    "Capture",
    "DelayedHistory",
    "FollowerCount",
    "Fp8Format",
    "Fp8Ranks",
    "Fp8Read",
    "FrameworkAdvice",
    "GradientRange",
    "GuardedSink",
    "IntervalForensics",
    "IntervalOutcomes",
    "LayerHeadroom",
    "LayerInfo",
    "LayerPrecision",
    "Ledger",
    "LoggingArgs",
    "ManagedSink",
    "MicroBatch",
    "MissingExtraError",
    "ModelDim",
    "ModelTooDeepError",
    "OpPrecision",
    "OpRecord",
    "Pass",
    "Policy",
    "PrecisionInfo",
    "RankStates",
    "RankedState",
    "Replay",
    "Role",
    "RunReadError",
    "RunSeries",
    "SampleTracker",
    "Snapshot",
    "SpikeRule",
    "TensorRead",
    "Verdict",
    "advise",
    "bad_steps",
    "carry",
    "check_archive",
    "check_batch_size",
    "check_bool",
    "check_choice",
    "check_diagnose",
    "check_int",
    "check_known",
    "check_ledger",
    "check_number",
    "check_policy",
    "check_spike",
    "decode_records",
    "einsum_gemm",
    "ended_inside_record",
    "get_target",
    "host_number",
    "interval_args",
    "is_event_file_name",
    "is_policy",
    "is_regular_file",
    "largest_finite_scale",
    "layer_of",
    "lazy_attributes",
    "logging_args",
    "matmul_gemm",
    "nonfinite_cause",
    "observe_together",
    "observed_state",
    "policy_bounds_from_markdown",
    "policy_from_config",
    "policy_values_from_markdown",
    "process_rank",
    "require",
    "sampled_within",
    "smallest_keep_set",
    "step_code",
    "user_stacklevel",
    "validate_state",
    "warn_if_nothing_checked",
]

_MODULES = {name: f"lossscale_callbacks.{module}" for entries in _CONTRACT.values()
            for name, (module, _) in entries.items()}
__getattr__ = lazy_attributes(__name__, _MODULES)


def __dir__() -> list[str]:
    """The contract only: the modules behind it stay out of ``dir()``."""
    return list(__all__)
