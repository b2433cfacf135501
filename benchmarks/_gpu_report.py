"""The GPU command's markdown file: the device, one line per part, then each part's figures and logs.

Each part's section is built from what the part wrote (its JSON file) and printed (its tables); a
part whose figures cannot be read says so and points at its log below, and the other sections are
still written. The file is rewritten after every part, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOG_TAIL_LINES = 60
SMALL_STEP_MS = 5.0
LARGE_PARAMETERS = 300e6


@dataclass
class Result:
    """One part of the run: its command, what became of it, what it printed, where its JSON is."""

    name: str
    title: str
    command: list[str] = field(default_factory=list)
    status: str = "not run"
    ok: bool = False  # finished with exit status 0 (or skipped for a stated reason)
    seconds: float = 0.0
    output: str = ""
    json_path: Path | None = None

    def data(self) -> Any:
        """The part's JSON, or None when it wrote none."""
        if self.json_path is None or not self.json_path.exists():
            return None
        return json.loads(self.json_path.read_text())


@dataclass
class Meta:
    """The run as a whole: when, what checkout, which budget."""

    started: str
    checkout: str
    budget_s: int
    command: str


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def _fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


# ------------------------------------------------------------------------------- sections


def machine_section(result: Result | None) -> tuple[list[str], str]:
    """The machine table and the device's name (for the title)."""
    data = result.data() if result is not None else None
    if not data:
        return ["The machine could not be described (see the `environment` log below)."], "unknown device"
    dev, ver = data["device"], data["versions"]
    if not dev.get("cuda"):
        return ["torch saw no CUDA device."], "no CUDA device"
    rows = [
        ["device", f"{dev['name']} x{dev['count']} (compute {dev['capability']}, {dev['sms']} SMs, "
                   f"{dev['memory_gib']} GiB)"],
        ["peak memory bandwidth", f"{_fmt(dev['peak_bandwidth_gbs'], 0)} GB/s (memory clock x 2 x bus width, "
                                  "from `torch.cuda.get_device_properties`)"],
        ["driver / CUDA (torch) / cuDNN", f"{dev['driver']} / {dev['torch_cuda']} / {dev['cudnn']}"],
        ["JAX backend", str(data.get("jax_backend"))],
        ["packages", ", ".join(f"{k} {v}" for k, v in ver.items() if v is not None)],
        ["not installed", ", ".join(k for k, v in ver.items() if v is None) or "-"],
        ["platform", data["platform"]],
    ]
    return _table(["", ""], rows), dev["name"]


def tests_section(result: Result) -> tuple[list[str], str]:
    """pytest's closing line, the CUDA line of tests/conftest.py and the failures."""
    lines = result.output.splitlines()
    closing = [ln for ln in lines if re.search(r"\d+ (passed|failed|skipped|errors?)\b.* in [\d.]+s", ln)]
    cuda = [ln for ln in lines if ln.startswith("CUDA tests:")]
    failures = [ln for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
    figure = closing[-1].strip("= ") if closing else "no closing line (see the log)"
    body = [f"pytest: **{figure}**", "", *cuda[-1:]]
    if failures:
        body += ["", "Failed:", "", *(f"- `{ln}`" for ln in failures)]
    return body, figure


def torch_section(result: Result, large: bool) -> tuple[list[str], str]:
    """The script's own table, and whether the model is the size the part is for."""
    data = result.data()
    printed = [ln for ln in result.output.splitlines() if ln.startswith(("|", "device ", "copy bandwidth"))]
    if not data:
        return printed or ["No figures (see the log below)."], "no figures"
    optimizers = data["optimizers"]
    checks = []
    for kind, row in optimizers.items():
        step_ms = row["median_step_s"]["torch"] * 1e3
        if large:
            fits = row["parameters"] >= LARGE_PARAMETERS
            checks.append(f"{kind}: {row['parameters'] / 1e6:.0f}M parameters "
                          f"({'>=' if fits else 'below'} {LARGE_PARAMETERS / 1e6:.0f}M)")
        else:
            fits = step_ms <= SMALL_STEP_MS
            checks.append(f"{kind}: GradScaler's step {step_ms:.2f} ms "
                          f"({'<=' if fits else 'above'} {SMALL_STEP_MS:g} ms)")
    figure = ", ".join(f"{kind} {row['median_ratio']:.4f}" for kind, row in optimizers.items())
    body = [*printed, "", "Size: " + "; ".join(checks) + ".",
            "Median ratio: the median over alternating rounds of (step with LossScaler) / (step with "
            "GradScaler)."]
    return body, "ours/GradScaler " + figure


def bandwidth_section(results: dict[str, Result]) -> list[str]:
    """The unscale-and-check pass against the memory-bandwidth floor, from the torch parts' JSON."""
    env = results.get("environment")
    peak = ((env.data() or {}).get("device", {}).get("peak_bandwidth_gbs") if env else None)
    rows = []
    for name in ("torch-small", "torch-large"):
        data = results[name].data() if name in results else None
        for kind, row in (data or {}).get("optimizers", {}).items():
            bw = row["bandwidth"]
            moved = 2 * bw["grad_bytes"]  # read every gradient, write it back unscaled
            achieved = {who: moved / seconds / 1e9 for who, seconds in row["unscale_s"].items()}
            rows.append([name, kind, f"{bw['grad_bytes'] / 2**20:.0f}",
                         _fmt(row["unscale_s"]["ours"] * 1e3, 3), _fmt(row["unscale_s"]["torch"] * 1e3, 3),
                         _fmt(achieved["ours"], 0),
                         _fmt(bw["copy_bandwidth_gbs"], 0), _fmt(peak, 0),
                         _fmt(achieved["ours"] / peak * 100 if peak else None, 0)])
    if not rows:
        return ["No torch_overhead.py figures to compare (see those parts)."]
    header = ["part", "optimizer", "gradients (MiB)", "unscale ours (ms)", "unscale GradScaler (ms)",
              "ours GB/s", "copy_ GB/s", "peak GB/s", "ours % of peak"]
    return [*_table(header, rows), "",
            "Bytes moved = 2 x gradient bytes (read and written once); GB/s = bytes moved / the median time "
            "of `unscale_` (host-timed, synchronised: launch overhead included, which dominates small "
            "models). `copy_` GB/s: a plain device copy of as many bytes in the same run."]


def alignment_section(result: Result) -> tuple[list[str], str]:
    """The GEMM timings beside the checker's verdicts."""
    data = result.data()
    if not data:
        return ["No figures (see the log below)."], "no figures"
    rows = [[r["shape"], r["in"], r["out"], r["tokens"], r["worst"],
             *(r.get(key, "n/a") for key in ("ms", "tflops", "slowdown"))] for r in data["rows"]]
    verdicts = {True: "agree on every shape", False: "DISAGREE on some shape", None: "no timings"}
    verdict = verdicts[data["agree"]]
    body = [*_table(["shape", "in", "out", "tokens", "checker", "ms", "TFLOPS", "slowdown"], rows), "",
            f"Checker 'high' <=> slowdown > {data['threshold']}: {verdict}."]
    return body, f"checker and timings {verdict}"


def keras_section(result: Result) -> tuple[list[str], str]:
    """The script's printed tables, as they are."""
    lines = result.output.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("Keras ")), None)
    if start is None:
        return ["No figures (see the log below)."], "no figures"
    end = next((i for i, ln in enumerate(lines) if ln.startswith("per-round")), len(lines))
    ratio = next((ln for ln in lines if ln.startswith("ours / keras LossScaleOptimizer")), "")
    figure = "ours/Keras (wall, CPU) " + " ".join(ratio.split()[4:6]) if ratio else "no ratio printed"
    return ["```", *lines[start:end], "```"], figure


SECTIONS: dict[str, Callable[[Result], tuple[list[str], str]]] = {
    "cuda-tests": tests_section,
    "torch-small": lambda r: torch_section(r, large=False),
    "torch-large": lambda r: torch_section(r, large=True),
    "alignment": alignment_section,
    "keras-torch": keras_section,
    "keras-jax": keras_section,
}


def _guarded(build: Callable[..., tuple[list[str], str]], *args: Any,
             fallback: str = "unreadable") -> tuple[list[str], str]:
    """``build(*args)``, or a line saying why the figures could not be read (a renamed JSON key...)."""
    try:
        return build(*args)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        return [f"The figures could not be read ({type(exc).__name__}: {exc}); see the log below."], fallback


def _section(result: Result) -> tuple[list[str], str]:
    build = SECTIONS.get(result.name)
    if build is None or not result.output:
        return [], ""
    return _guarded(build, result)


def render(meta: Meta, results: list[Result]) -> str:
    """The whole markdown file."""
    by_name = {r.name: r for r in results}
    machine, device = _guarded(machine_section, by_name.get("environment"), fallback="unknown device")
    sections, summary = [], []
    for result in results:
        body, figure = _section(result)
        summary.append([result.title, result.status, f"{result.seconds:.0f}", figure or "-"])
        if body:
            sections += [f"## {result.title}", "", f"`{' '.join(result.command)}`", "", *body, ""]
    if {"torch-small", "torch-large"} & set(by_name):
        bandwidth, _ = _guarded(lambda: (bandwidth_section(by_name), ""))
        sections += ["## Unscale pass against the memory-bandwidth floor", "", *bandwidth, ""]
    spent = sum(r.seconds for r in results)
    lines = [f"# GPU figures: {device}", "",
             f"`{meta.command}` on {meta.started}, checkout {meta.checkout}; {spent:.0f} s of a "
             f"{meta.budget_s} s budget.", "", *machine, "", "## Parts", "",
             *_table(["part", "status", "seconds", "figure"], summary), "", *sections, "## Logs", ""]
    for result in results:
        tail = result.output.splitlines()[-LOG_TAIL_LINES:]
        lines += [f"<details><summary>{result.name}: {result.status}</summary>", "", "```",
                  "$ " + " ".join(result.command), *tail, "```", "</details>", ""]
    return "\n".join(lines)
