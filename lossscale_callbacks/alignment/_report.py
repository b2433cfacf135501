"""The alignment and mixed-precision report: findings, notes, audit results; Markdown, JSON and a table.

Example:
    >>> f = Finding(layer="fc", dimension="features_in", value=50, required_multiple=8, severity="high",
    ...             suggested=56, param_cost=384, dtype="float16")
    >>> report = AlignmentReport(findings=[f])
    >>> report.has("high"), report.has("medium"), report.has_at_least("low")
    (True, False, True)
    >>> print(report)  # doctest: +NORMALIZE_WHITESPACE
    severity  layer  dimension    value  multiple  suggested  +params  FLOPs  fix / note
    high      fc     features_in  50     8         56         384
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

SEVERITIES = ("high", "medium", "low", "info")
_HEADER = ("severity", "layer", "dimension", "value", "multiple", "suggested", "+params", "FLOPs",
           "fix / note")


def worst_first(severity: str) -> int:
    """Sort key that puts ``high`` first and ``info`` last."""
    return SEVERITIES.index(severity)


def check_severity(severity: str) -> str:
    """Validate a severity argument."""
    if severity not in SEVERITIES:
        raise ValueError(f"severity must be one of {SEVERITIES}, got {severity!r}")
    return severity


@dataclass(frozen=True)
class Finding:
    """One alignment finding (or info note) for one (layer, model dimension).

    Args:
        layer: the layer path; ``"*"`` for model-wide findings (token/batch sizes, layout, dtype).
        dimension: the semantic role (``features_in``, ``channels_out``, ``head_dim``, ``vocab``,
            ``rnn_hidden``, ``tokens``...), or ``layout``/``dtype``/``depthwise``.
        value: the model dimension's size (``None`` for layout/dtype notes).
        required_multiple: the multiple the value should have.
        severity: ``high``, ``medium``, ``low`` or ``info``.
        suggested: the next good value.
        param_cost: extra parameters the suggested value costs (``None`` when unknown or not a parameter).
        dtype: the effective math dtype.
        layers: every layer the finding covers (model-wide findings).
        ops: the executed ops behind it; passes: the passes (forward, input-/weight-gradient).
        message: a sentence for people.
        fix: the change that resolves it, naming the argument of the layer in ``layer``
            (``"units=1008"``, ``"out_channels=32"``); ``""`` when it is not one argument.
        flop_share: the share of the model's recorded GEMM/convolution FLOPs (forward and backward)
            that run with this dimension; the severity is weighted by it. ``None`` when unknown.
    """

    layer: str
    dimension: str
    value: int | None
    required_multiple: int | None
    severity: str
    suggested: int | str | None = None
    param_cost: int | None = None
    dtype: str = ""
    layers: tuple[str, ...] = ()
    ops: tuple[str, ...] = ()
    passes: tuple[str, ...] = ()
    message: str = ""
    fix: str = ""
    flop_share: float | None = None

    def key(self) -> tuple:
        """``(layer, dimension, value, severity)``: what two captures of one model must agree on."""
        return (self.layer, self.dimension, self.value, self.severity)


@dataclass(frozen=True)
class AuditFinding:
    """One mixed-precision audit result.

    Args:
        check: ``global_policy``, ``variable_dtype``, ``float16_softmax``, ``float16_output``,
            ``float16_normalization``, ``float16_loss`` or ``float16_deny_op``.
        layer: the layer path (``"*"`` for model-wide).
        severity: ``high``, ``medium``, ``low`` or ``info``.
        dtype: the offending dtype.
        message: what is wrong and what to do.
        layers: every layer covered.
    """

    check: str
    layer: str
    severity: str
    dtype: str
    message: str
    layers: tuple[str, ...] = ()


@dataclass
class AlignmentReport:
    """The checker's result.

    Attributes:
        findings: alignment findings (``high``/``medium``/``low``), worst first.
        notes: ``info`` results that are deliberately not findings (first-layer RGB convolutions,
            depthwise convolutions, float32 without TF32).
        audit: mixed-precision audit results.
        op_categories: executed ops per mixed-precision category (allow/deny/infer/clear/other) and dtype.
        efficiency: tile/wave quantization rows per forward GEMM when a target GPU was given.
        framework, target: where the shapes came from and which GPU the advice is for.
        context: what was checked (``model``, ``parameters``, ``precision``, ``batch_size``, ``tf32``),
            for the header of the ``check`` command and the JSON.
    """

    findings: list[Finding] = field(default_factory=list)
    notes: list[Finding] = field(default_factory=list)
    audit: list[AuditFinding] = field(default_factory=list)
    op_categories: dict[str, dict[str, int]] = field(default_factory=dict)
    efficiency: list[dict] = field(default_factory=list)
    framework: str = ""
    target: str | None = None
    ops_seen: int = 0
    context: dict = field(default_factory=dict)

    def header(self) -> str:
        """One line saying what was checked: model, target, precision, batch size, TF32."""
        c = self.context
        parts = [f"model {c['model']}" if c.get("model") else "model",
                 f"{c['parameters']:,} parameters" if c.get("parameters") is not None else None,
                 f"target {self.target.upper()}" if self.target else "target: any GPU (16-byte rule)",
                 f"precision {c['precision']}" if c.get("precision") else None,
                 f"batch size {c['batch_size']:,}" if c.get("batch_size") else None,
                 f"TF32 {'on' if c['tf32'] else 'off'}" if c.get("tf32") is not None else None]
        return "Tensor Core alignment check: " + ", ".join(p for p in parts if p)

    def _all(self) -> list:
        return [*self.findings, *self.notes, *self.audit]

    def has(self, severity: str) -> bool:
        """Whether any finding, note or audit result has exactly this severity."""
        check_severity(severity)
        return any(item.severity == severity for item in self._all())

    def has_at_least(self, severity: str) -> bool:
        """Whether anything is at least this severe (``"low"`` means low, medium or high)."""
        floor = worst_first(check_severity(severity))
        return any(worst_first(item.severity) <= floor for item in self._all())

    def at_least(self, severity: str) -> list:
        """Findings and audit results at least this severe, worst first."""
        floor = worst_first(check_severity(severity))
        items = [item for item in self._all() if worst_first(item.severity) <= floor]
        return sorted(items, key=lambda item: worst_first(item.severity))

    def __bool__(self) -> bool:
        # A report is "truthy" when it has something to act on.
        return bool(self.findings or [a for a in self.audit if a.severity != "info"])

    # ---- output -----------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {
            "framework": self.framework,
            "target": self.target,
            "ops_seen": self.ops_seen,
            "context": self.context,
            "findings": [asdict(f) for f in self.findings],
            "notes": [asdict(f) for f in self.notes],
            "audit": [asdict(a) for a in self.audit],
            "op_categories": self.op_categories,
            "efficiency": self.efficiency,
        }

    def to_json(self, indent: int | None = 2) -> str:
        """The whole report as JSON (tuples become lists)."""
        return json.dumps(self.to_dict(), indent=indent)

    def _rows(self) -> list[list[str]]:
        rows = []
        for f in [*self.findings, *self.notes]:
            share = "" if f.flop_share is None else f"{f.flop_share:.1%}"
            note = f.message if f.severity == "info" else f.fix
            rows.append([f.severity, f.layer or "(model)", f.dimension, _s(f.value), _s(f.required_multiple),
                         _s(f.suggested), _s(f.param_cost), share, note])
        return rows

    def __str__(self) -> str:
        header = list(_HEADER)
        rows = self._rows()
        lines = []
        if rows:
            widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
            for row in [header, *rows]:
                lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        else:
            lines.append(f"No Tensor Core alignment findings ({self.ops_seen} ops checked).")
        for a in self.audit:
            lines.append(f"[{a.severity}] {a.check} {a.layer or '(model)'}: {a.message}")
        return "\n".join(lines)

    def to_markdown(self) -> str:
        """A Markdown section for dashboards' text panels (TensorBoard text, W&B)."""
        out = ["### Tensor Core alignment", ""]
        where = f" for {self.target.upper()}" if self.target else ""
        if self.findings:
            out.append(f"{len(self.findings)} finding(s){where}, {self.ops_seen} ops checked.")
        else:
            out.append(f"No alignment findings{where} ({self.ops_seen} ops checked).")
        rows = self._rows()
        if rows:
            out += ["", "| " + " | ".join(_HEADER) + " |", "|" + "---|" * len(_HEADER)]
            out += ["| " + " | ".join(_md(c) for c in row) + " |" for row in rows]
        if self.efficiency:
            out += ["", "#### Tile and wave quantization (forward GEMMs)", "",
                    "| layer | M | N | K | efficiency |", "|---|---|---|---|---|"]
            out += [f"| {_md(e['layer'])} | {e['m']} | {e['n']} | {e['k']} | {e['efficiency']:.0%} |"
                    for e in self.efficiency]
        out += ["", "### Mixed-precision audit", ""]
        if self.audit:
            out += ["| severity | check | layer | dtype | advice |", "|---|---|---|---|---|"]
            out += [f"| {a.severity} | {a.check} | {_md(a.layer or '(model)')} | {a.dtype} "
                    f"| {_md(a.message)} |" for a in self.audit]
        else:
            out.append("No mixed-precision problems found.")
        if self.op_categories:
            out += ["", "| category | ops by dtype |", "|---|---|"]
            for cat, counts in self.op_categories.items():
                cells = ", ".join(f"{dt}: {n}" for dt, n in sorted(counts.items()))
                out.append(f"| {cat} | {cells} |")
        return "\n".join(out) + "\n"


def _s(value) -> str:
    return "" if value is None else str(value)


def _md(text: str) -> str:
    return str(text).replace("|", "\\|")
