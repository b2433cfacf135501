"""Do the alignment checker's high-severity findings cost time? fp16 Linear layers, aligned vs misaligned.

For each shape the script (1) runs the checker on an ``nn.Linear`` of that shape (on the meta device:
no memory, no GPU needed) and (2) on a CUDA GPU times the layer's forward and backward pass in float16
(three GEMMs: forward, input-gradient, weight-gradient) with CUDA events, and reports time per FLOP
relative to the aligned shape of the same size. The claim checked: shapes with a ``high`` finding are
the slow ones (slowdown above ``--threshold``), shapes without one are not. On a machine without CUDA it
says so, takes no timings, and still prints what the checker finds.

Run:
    python benchmarks/alignment_gemm.py                 # default shapes
    python benchmarks/alignment_gemm.py --size 8192 --json out.json --strict
    python benchmarks/alignment_gemm.py --quick        # 64 features, 2 timed passes: checks it runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from _quick import parse_args

from lossscale_callbacks.torch._alignment import check_alignment


def shapes(size: int) -> list[tuple[str, int, int, int]]:
    """``(label, in_features, out_features, tokens)``: an aligned baseline and one change at a time."""
    return [
        ("aligned", size, size, 2 * size),
        ("in+8 (aligned)", size + 8, size, 2 * size),
        ("in-1", size - 1, size, 2 * size),
        ("in+4 (mult. of 4)", size + 4, size, 2 * size),
        ("out-1", size, size - 1, 2 * size),
        ("out+2", size, size + 2, 2 * size),
        ("tokens-1", size, size, 2 * size - 1),
        ("in-1,out-1", size - 1, size - 1, 2 * size),
    ]


def check(n_in: int, n_out: int, tokens: int, target: str | None) -> tuple[str, list[str]]:
    """Worst severity (or ``"none"``) and the findings, from the checker on the meta device."""
    with torch.device("meta"):
        layer = torch.nn.Linear(n_in, n_out)
        sample = torch.empty(tokens, n_in)
    report = check_alignment(layer, sample, dtype="float16", target=target)
    found = [f"{f.dimension}={f.value}:{f.severity}" for f in report.findings]
    worst = report.findings[0].severity if report.findings else "none"
    return worst, found


def time_linear(n_in: int, n_out: int, tokens: int, iters: int, warmup: int) -> float:
    """Median milliseconds of one float16 forward+backward of ``nn.Linear`` on the current CUDA device."""
    layer = torch.nn.Linear(n_in, n_out, device="cuda", dtype=torch.float16)
    x = torch.randn(tokens, n_in, device="cuda", dtype=torch.float16, requires_grad=True)
    grad = torch.randn(tokens, n_out, device="cuda", dtype=torch.float16)
    times = []
    for i in range(warmup + iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        layer(x).backward(grad)
        end.record()
        torch.cuda.synchronize()  # host sync per iteration: this is a benchmark, not a training step
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096, help="baseline features (default 4096)")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threshold", type=float, default=1.10,
                        help="time-per-FLOP ratio above which a shape counts as slow (default 1.10)")
    parser.add_argument("--target", default=None, help="GPU target for the checker (a100, h100...)")
    parser.add_argument("--json", default=None, help="write the rows to this JSON file")
    parser.add_argument("--strict", action="store_true", help="exit 1 when checker and timings disagree")
    args = parse_args(parser, argv, size=64, iters=2, warmup=1)

    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.cuda.get_device_name()
        print(f"device: {device}; torch {torch.__version__}; cuBLAS via torch; fp16 forward+backward")
    else:
        device = "cpu"
        print("Tensor Core timings need a CUDA GPU: none here, so no timings are taken and no numbers are "
              "reported. The checker part runs below.")
    rows = []
    base_per_flop = None
    for label, n_in, n_out, tokens in shapes(args.size):
        worst, found = check(n_in, n_out, tokens, args.target)
        row = {"shape": label, "in": n_in, "out": n_out, "tokens": tokens, "worst": worst, "findings": found}
        if cuda:
            ms = time_linear(n_in, n_out, tokens, args.iters, args.warmup)
            flops = 3 * 2 * n_in * n_out * tokens
            per_flop = ms / flops
            base_per_flop = base_per_flop or per_flop  # the first shape is the aligned baseline
            row.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1),
                       slowdown=round(per_flop / base_per_flop, 3))
        rows.append(row)

    header = f"{'shape':<20} {'in':>6} {'out':>6} {'tokens':>6}  {'checker':<7}"
    print(header + ("  {:>8} {:>7} {:>8}".format("ms", "TFLOPS", "slowdown") if cuda else "  findings"))
    for r in rows:
        line = f"{r['shape']:<20} {r['in']:>6} {r['out']:>6} {r['tokens']:>6}  {r['worst']:<7}"
        if cuda:
            line += f"  {r['ms']:>8.3f} {r['tflops']:>7.1f} {r['slowdown']:>8.2f}"
        else:
            line += "  " + (", ".join(r["findings"]) or "-")
        print(line)

    agree = None
    if cuda:
        verdicts = [(r["worst"] == "high") == (r["slowdown"] > args.threshold) for r in rows]
        agree = all(verdicts)
        print(f"checker 'high' <=> slowdown > {args.threshold}: {sum(verdicts)}/{len(verdicts)} shapes agree")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": device, "size": args.size, "threshold": args.threshold, "rows": rows,
                       "agree": agree}, fh, indent=2)
    return 1 if (args.strict and agree is False) else 0


if __name__ == "__main__":
    sys.exit(main())
