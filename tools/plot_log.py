#!/usr/bin/env python3
"""Plots of `centrifuge train --log` files: loss and throughput, as PNG.

    python3 tools/plot_log.py runs/regular.jsonl runs/cf.jsonl --out plots
      -> plots/loss.png        training loss (and validation loss, as markers)
         plots/throughput.png  tokens per second, and step time per stage

Each log is one line per step (JSON objects with step, loss, tokens_per_s,
forward_s, filter_s, backward_s, optimizer_s, step_s and, on validation
steps, val_loss). Several logs go into the same figures, labelled by file
name (or --labels). A resumed run appends to its log; when a step appears
twice the later line wins. Steps that were skipped (non-finite loss) are
left out of the loss curve. Needs matplotlib.
"""
import argparse
import json
import math
import os
import re
import sys

# C's printf writes non-finite numbers as nan / -nan / inf, which JSON lacks
_NONFINITE = re.compile(r'(:\s*)(-?)(nan|inf(?:inity)?)\b', re.IGNORECASE)


class LogError(Exception):
    pass


def _fix_nonfinite(line):
    def sub(m):
        word = m.group(3).lower()
        if word == "nan":
            return m.group(1) + "NaN"
        return m.group(1) + ("-Infinity" if m.group(2) else "Infinity")
    return _NONFINITE.sub(sub, line)


def read_log(path):
    """Returns the log's steps in order, one dict per step (later lines for
    the same step replace earlier ones)."""
    by_step = {}
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise LogError("%s: cannot open: %s" % (path, e.strerror))
    with f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(_fix_nonfinite(line))
            except ValueError:
                raise LogError("%s:%d: not a JSON object (is this a centrifuge train --log file?)" % (path, n))
            if not isinstance(rec, dict) or "step" not in rec:
                raise LogError("%s:%d: a log line needs a \"step\" field" % (path, n))
            by_step[int(rec["step"])] = rec
    if not by_step:
        raise LogError("%s: no steps in the file" % path)
    return [by_step[k] for k in sorted(by_step)]


def smooth(values, window):
    """Trailing moving average over `window` points (NaNs skipped)."""
    if window <= 1:
        return list(values)
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > window:
            acc.pop(0)
        good = [a for a in acc if a is not None and math.isfinite(a)]
        out.append(sum(good) / len(good) if good else float("nan"))
    return out


def x_values(recs, axis):
    if axis == "step":
        return [r["step"] for r in recs]
    total, xs = 0, []
    for r in recs:
        total += r.get("tokens", 0)
        xs.append(total)
    return xs


def plot(logs, labels, out_dir, axis="step", window=1, title=None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    xlabel = "step" if axis == "step" else "tokens"
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for recs, label in zip(logs, labels):
        xs = x_values(recs, axis)
        train = [(x, r.get("loss")) for x, r in zip(xs, recs)
                 if not r.get("skipped") and isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"])]
        if train:
            line, = ax.plot([p[0] for p in train], smooth([p[1] for p in train], window), label=label + " (train)")
            colour = line.get_color()
        else:
            colour = None
        val = [(x, r["val_loss"]) for x, r in zip(xs, recs)
               if isinstance(r.get("val_loss"), (int, float)) and math.isfinite(r["val_loss"])]
        if val:
            ax.plot([p[0] for p in val], [p[1] for p in val], "o--", color=colour, markersize=4,
                    label=label + " (validation)")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("loss (mean over counted tokens)")
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, "loss.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for recs, label in zip(logs, labels):
        xs = x_values(recs, axis)
        tps = [r.get("tokens_per_s", float("nan")) for r in recs]
        ax1.plot(xs, smooth(tps, window), label=label)
    ax1.set_xlabel(xlabel)
    ax1.set_ylabel("tokens / s")
    ax1.set_title("throughput")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    stages = [("forward_s", "forward"), ("filter_s", "filter"), ("backward_s", "backward"),
              ("optimizer_s", "optimizer")]
    width = 0.8 / max(1, len(logs))
    for i, (recs, label) in enumerate(zip(logs, labels)):
        # median over the steps after the first few (allocation, warm-up)
        body = recs[3:] if len(recs) > 10 else recs
        bottom = 0.0
        for k, (key, name) in enumerate(stages):
            vals = sorted(r[key] for r in body if isinstance(r.get(key), (int, float)) and math.isfinite(r[key]))
            med = vals[len(vals) // 2] * 1e3 if vals else 0.0
            ax2.bar(i, med, width=0.6, bottom=bottom, color="C%d" % k, label=name if i == 0 else None)
            bottom += med
    ax2.set_xticks(range(len(logs)))
    ax2.set_xticklabels(labels, fontsize=8)
    ax2.set_ylabel("ms per step (median)")
    ax2.set_title("step time by stage")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, "throughput.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)
    return written


def main(argv=None):
    ap = argparse.ArgumentParser(description="Loss and throughput plots (PNG) of centrifuge train --log files.")
    ap.add_argument("logs", nargs="+", help="JSON-lines files written by centrifuge train --log")
    ap.add_argument("--out", default=None, help="output directory (default: the first log's directory)")
    ap.add_argument("--labels", default=None, help="comma list, one label per log (default: file names)")
    ap.add_argument("--x", choices=["step", "tokens"], default="step", help="x axis (default step)")
    ap.add_argument("--smooth", type=int, default=1, help="moving average over N steps (default 1: none)")
    ap.add_argument("--title", default=None, help="title of the loss plot")
    a = ap.parse_args(argv)
    labels = a.labels.split(",") if a.labels else [os.path.splitext(os.path.basename(p))[0] for p in a.logs]
    if len(labels) != len(a.logs):
        print("plot_log: error: --labels has %d names for %d logs" % (len(labels), len(a.logs)), file=sys.stderr)
        return 2
    if a.smooth < 1:
        print("plot_log: error: --smooth must be >= 1", file=sys.stderr)
        return 2
    try:
        logs = [read_log(p) for p in a.logs]
    except LogError as e:
        print("plot_log: error: %s" % e, file=sys.stderr)
        return 1
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_log: error: needs matplotlib (python3 -m pip install matplotlib)", file=sys.stderr)
        return 1
    out = a.out or (os.path.dirname(os.path.abspath(a.logs[0])))
    for path in plot(logs, labels, out, axis=a.x, window=a.smooth, title=a.title):
        print("plot_log: wrote %s" % path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
