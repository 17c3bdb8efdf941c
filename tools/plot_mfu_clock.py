#!/usr/bin/env python3
"""MFU against the SM clock the power cap allowed, over several GPU calls.

Usage: plot_mfu_clock.py CALL_DIR [CALL_DIR ...] [--out PNG] [--target PCT]

Each CALL_DIR is one call's folder of `gpu_session.sh bench-accum` output:
`clocks.txt` (lines "ours MODEL: ... SM clock median N MHz ...", from
clock_summary.py) and `bench_accum8_MODEL_SEQ.txt` (the bench table; the
regular row's "MFU P%"). Prints one markdown row per (call, model) and, per
model with two or more calls, the least-squares line MFU = a + b * clock and
the clock at which it reaches --target (default 50). With --out, plots the
points and lines (matplotlib). Why: under a 700 W cap the same binary's MFU
follows the clock the machine holds, so a target near the line is met on
one machine and missed on another; the plot shows where it lies."""
import argparse
import glob
import os
import re
import sys

CLOCK_RE = re.compile(r"^ours (\S+): .*SM clock median (\d+) MHz")
MFU_RE = re.compile(r"^\s*(\d+)\s+\S+\s+regular\s.*MFU\s+([\d.]+)%")


def read_call(folder):
    """{model: (clock_mhz, mfu_pct)} for the models of one call folder with both numbers."""
    clocks = {}
    path = os.path.join(folder, "clocks.txt")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                m = CLOCK_RE.match(line)
                if m:
                    clocks[m.group(1)] = float(m.group(2))
    out = {}
    for bench in sorted(glob.glob(os.path.join(folder, "bench_accum*_*.txt"))):
        name = os.path.basename(bench)
        if name.endswith("_pt.txt"):
            continue
        model = re.sub(r"^bench_accum\d+_", "", name[:-4]).rsplit("_", 1)[0]
        if model not in clocks:
            continue
        with open(bench) as f:
            for line in f:
                m = MFU_RE.match(line)
                if m:
                    out[model] = (clocks[model], float(m.group(2)))
                    break
    return out


def fit(points):
    """(a, b) of the least-squares line y = a + b x; None for fewer than two distinct x."""
    n = len(points)
    if n < 2:
        return None
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    if sxx == 0:
        return None
    b = sum((p[0] - mx) * (p[1] - my) for p in points) / sxx
    return my - b * mx, b


def main(argv):
    ap = argparse.ArgumentParser(description="MFU against the median SM clock over GPU calls")
    ap.add_argument("calls", nargs="+", help="call folders of gpu_session.sh bench-accum output")
    ap.add_argument("--out", help="write the plot here (PNG)")
    ap.add_argument("--target", type=float, default=50.0, help="MFU target in percent (default 50)")
    args = ap.parse_args(argv)
    per_model = {}
    print("| call | model | SM clock median (MHz) | MFU |")
    print("|---|---|---|---|")
    for folder in args.calls:
        label = "/".join(os.path.normpath(folder).split(os.sep)[-2:])  # gpu-runN/callM_...
        if not os.path.isdir(folder):
            print(f"plot_mfu_clock: {folder}: not a folder", file=sys.stderr)
            return 1
        for model, (clock, mfu) in sorted(read_call(folder).items()):
            per_model.setdefault(model, []).append((clock, mfu))
            print(f"| {label} | {model} | {clock:.0f} | {mfu:.1f}% |")
    if not per_model:
        print("plot_mfu_clock: no call folder had both clocks.txt and a bench table", file=sys.stderr)
        return 1
    lines = {}
    for model, pts in sorted(per_model.items()):
        line = fit(pts)
        if line:
            a, b = line
            lines[model] = line
            need = (args.target - a) / b if b > 0 else float("nan")
            print(f"{model}: MFU = {a:.2f} + {b * 100:.3f} per 100 MHz ({len(pts)} calls); "
                  f"{args.target:g}% at {need:.0f} MHz")
    if args.out:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for model, pts in sorted(per_model.items()):
            xs = [p[0] for p in pts]
            dots = ax.plot(xs, [p[1] for p in pts], "o", label=model)[0]
            if model in lines:
                a, b = lines[model]
                lo, hi = min(xs) - 20, max(xs) + 20
                ax.plot([lo, hi], [a + b * lo, a + b * hi], "-", color=dots.get_color(), alpha=0.5)
        ax.axhline(args.target, color="grey", ls="--", lw=1)
        ax.set_xlabel("our SM clock, median of busy samples (MHz)")
        ax.set_ylabel("MFU, regular step (%)")
        ax.set_title("MFU follows the clock under the power cap")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.out, dpi=110)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
