#!/usr/bin/env python3
"""Plots of `centrifuge bench --json` results.

Reads JSON lines from `centrifuge bench --json` (and, optionally, from
tools/bench_pytorch.py --json, whose rows carry "engine": "pytorch") and
writes two figures:

  PREFIX_seq.(svg|png)   backward time and step time vs sequence length,
                         one line per mode, at one keep fraction (--keep,
                         default the one closest to 0.5)
  PREFIX_drop.(svg|png)  speed-up regular/mode of the backward and of the
                         whole step vs drop rate (1 - keep), one line per
                         filtered mode, at one sequence length (--seq, default
                         the longest swept over several keeps); the dashed
                         line is the backward's limit 1/keep

Rows of different engines, models, devices or micro-batches are kept apart
(the label names them when there is more than one). matplotlib draws the
figures when it is installed (and PNG needs it); otherwise a plain SVG is
written by this script.

Examples:
  python3 tools/plot_bench.py bench.jsonl --out docs/bench
  python3 tools/plot_bench.py cf.jsonl pt.jsonl --out cmp --format png --keep 0.5 --seq 4096
"""
import argparse
import html
import json
import math
import os
import sys

FILTERED_MODES = ["centrifuge", "loss-only", "strawman"]
MODE_ORDER = ["regular", "loss-only", "centrifuge", "strawman"]
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
          "#bcbd22", "#17becf"]


class PlotError(Exception):
    pass


# ---------------------------------------------------------------- reading

def read_rows(paths):
    rows = []
    for path in paths:
        try:
            f = open(path, encoding="utf-8")
        except OSError as e:
            raise PlotError("%s: cannot open: %s" % (path, e.strerror or e))
        with f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    r = json.loads(line)
                except ValueError as e:
                    raise PlotError("%s:%d: not JSON (%s)" % (path, n, e))
                if not isinstance(r, dict) or r.get("kind") == "sdpa_attention" or "error" in r:
                    continue
                missing = [k for k in ("mode", "seq", "keep", "backward_s", "step_s") if k not in r]
                if missing:
                    raise PlotError("%s:%d: not a bench row (no %s)" % (path, n, ", ".join(missing)))
                r["engine"] = r.get("engine", "centrifuge")
                rows.append(r)
    if not rows:
        raise PlotError("no bench rows in %s" % ", ".join(paths))
    return rows


def group_key(r):
    return (r["engine"], str(r.get("model", "?")), str(r.get("device", "?")), int(r.get("batch", 1)))


def series_label(key, keys, mode):
    """Names only what differs between the groups present."""
    parts = []
    for i, name in enumerate(("engine", "model", "device", "batch")):
        if len({k[i] for k in keys}) > 1:
            parts.append(("batch %d" % key[i]) if name == "batch" else str(key[i]))
    return ("[%s] %s" % (" ".join(parts), mode)) if parts else mode


def mean(xs):
    return sum(xs) / len(xs)


# ---------------------------------------------------------------- figures

def figure_seq(rows, keep_opt):
    keeps = sorted({round(r["keep"], 4) for r in rows if r["mode"] != "regular"})
    keep = keep_opt if keep_opt is not None else (min(keeps, key=lambda k: (abs(k - 0.5), -k)) if keeps else None)
    keys = sorted({group_key(r) for r in rows})
    bwd_panel = {"title": "backward", "xlabel": "sequence length", "ylabel": "ms", "series": []}
    step_panel = {"title": "step", "xlabel": "sequence length", "ylabel": "ms", "series": []}
    for key in keys:
        g = [r for r in rows if group_key(r) == key]
        for mode in sorted({r["mode"] for r in g}, key=lambda m: (MODE_ORDER + [m]).index(m)):
            pts = {}
            for r in g:
                if r["mode"] != mode:
                    continue
                if mode != "regular" and keep is not None and abs(r["keep"] - keep) > 1e-6:
                    continue
                pts.setdefault(r["seq"], []).append(r)
            if not pts:
                continue
            xs = sorted(pts)
            lab = series_label(key, keys, mode)
            bwd_panel["series"].append({"label": lab, "x": xs, "y": [mean([p["backward_s"] for p in pts[x]]) * 1e3
                                                                       for x in xs]})
            step_panel["series"].append({"label": lab, "x": xs, "y": [mean([p["step_s"] for p in pts[x]]) * 1e3
                                                                        for x in xs]})
    if not bwd_panel["series"] or all(len(s["x"]) < 1 for s in bwd_panel["series"]):
        return None, keep
    title = "time vs sequence length" + (" (keep %.2f, drop rate %.2f)" % (keep, 1 - keep) if keep is not None else "")
    return {"title": title, "panels": [bwd_panel, step_panel]}, keep


def figure_drop(rows, seq_opt):
    keys = sorted({group_key(r) for r in rows})
    # sequence lengths that have a regular row and filtered rows at >= 2 keeps
    def usable(seq):
        for key in keys:
            g = [r for r in rows if group_key(r) == key and r["seq"] == seq]
            if any(r["mode"] == "regular" for r in g) and \
                    len({round(r["keep"], 4) for r in g if r["mode"] in FILTERED_MODES}) >= 1:
                return len({round(r["keep"], 4) for r in g if r["mode"] in FILTERED_MODES})
        return 0

    seqs = sorted({r["seq"] for r in rows})
    if seq_opt is not None:
        seq = seq_opt
    else:
        cands = [s for s in seqs if usable(s) >= 2] or [s for s in seqs if usable(s) >= 1]
        seq = max(cands) if cands else None
    if seq is None:
        return None, None, []
    bwd_panel = {"title": "backward speed-up", "xlabel": "drop rate (1 - keep)", "ylabel": "regular / mode",
                 "series": []}
    step_panel = {"title": "step speed-up", "xlabel": "drop rate (1 - keep)", "ylabel": "regular / mode",
                  "series": []}
    table = []
    all_drops = set()
    for key in keys:
        g = [r for r in rows if group_key(r) == key and r["seq"] == seq]
        reg = [r for r in g if r["mode"] == "regular"]
        if not reg:
            continue
        reg_b, reg_s = mean([r["backward_s"] for r in reg]), mean([r["step_s"] for r in reg])
        for mode in [m for m in FILTERED_MODES if any(r["mode"] == m for r in g)]:
            pts = {}
            for r in g:
                if r["mode"] == mode:
                    pts.setdefault(round(1 - r["keep"], 4), []).append(r)
            xs = sorted(pts)
            all_drops.update(xs)
            sb = [reg_b / mean([p["backward_s"] for p in pts[x]]) for x in xs]
            ss = [reg_s / mean([p["step_s"] for p in pts[x]]) for x in xs]
            lab = series_label(key, keys, mode)
            bwd_panel["series"].append({"label": lab, "x": xs, "y": sb})
            step_panel["series"].append({"label": lab, "x": xs, "y": ss})
            for x, b, s in zip(xs, sb, ss):
                table.append((lab, x, b, s))
    if not bwd_panel["series"]:
        return None, seq, []
    drops = sorted(all_drops)
    if drops and max(drops) < 1:
        lo, hi = min(drops), max(drops)
        xs = [lo + (hi - lo) * i / 20 for i in range(21)] if hi > lo else [lo]
        bwd_panel["series"].append({"label": "limit 1/keep", "x": xs, "y": [1 / (1 - x) for x in xs], "dash": True})
    return {"title": "speed-up vs drop rate (seq %d)" % seq, "panels": [bwd_panel, step_panel]}, seq, table


# -------------------------------------------------------------- rendering

def render_matplotlib(fig_spec, path, fmt):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = fig_spec["panels"]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2))
    if len(panels) == 1:
        axes = [axes]
    for ax, p in zip(axes, panels):
        for i, s in enumerate(p["series"]):
            style = dict(color="#444444", linestyle="--", linewidth=1) if s.get("dash") else \
                dict(color=COLORS[i % len(COLORS)], marker="o", markersize=4)
            ax.plot(s["x"], s["y"], label=s["label"], **style)
        ax.set_title(p["title"])
        ax.set_xlabel(p["xlabel"])
        ax.set_ylabel(p["ylabel"])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        if p["ylabel"] == "ms":
            ax.set_ylim(bottom=0)
    fig.suptitle(fig_spec["title"])
    fig.tight_layout()
    fig.savefig(path, format=fmt, dpi=120)
    plt.close(fig)


def nice_ticks(lo, hi, n=5):
    if hi <= lo:
        hi = lo + (abs(lo) if lo else 1.0)
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=10 * mag)
    start = math.floor(lo / step) * step
    ticks, t = [], start
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 10))
        t += step
    if ticks[-1] < hi:
        ticks.append(round(ticks[-1] + step, 10))
    return ticks


def fmt_tick(v):
    if v == int(v) and abs(v) < 1e6:
        return str(int(v))
    return ("%.3g" % v)


def render_svg(fig_spec, path):
    """A plain SVG line chart per panel, side by side; no dependencies."""
    pw, ph = 460, 360
    ml, mr, mt, mb = 60, 15, 40, 120
    panels = fig_spec["panels"]
    W, H = pw * len(panels), ph + 30
    out = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" '
           'font-family="sans-serif" font-size="11">' % (W, H, W, H),
           '<rect width="100%" height="100%" fill="white"/>',
           '<text x="%d" y="18" text-anchor="middle" font-size="14">%s</text>' % (W // 2, html.escape(fig_spec["title"]))]
    for pi, p in enumerate(panels):
        ox, oy = pi * pw, 30
        xs = [x for s in p["series"] for x in s["x"]]
        ys = [y for s in p["series"] for y in s["y"] if math.isfinite(y)]
        if not xs or not ys:
            continue
        xt = nice_ticks(min(xs), max(xs))
        ylo = 0.0 if p["ylabel"] == "ms" else min(ys)
        yt = nice_ticks(min(ylo, min(ys)), max(ys))
        x0, x1, y0, y1 = xt[0], xt[-1], yt[0], yt[-1]
        left, top, right, bottom = ox + ml, oy + mt - 20, ox + pw - mr, oy + ph - mb

        def X(v):
            return left + (v - x0) / ((x1 - x0) or 1) * (right - left)

        def Y(v):
            return bottom - (v - y0) / ((y1 - y0) or 1) * (bottom - top)

        out.append('<text x="%d" y="%d" text-anchor="middle" font-size="12">%s</text>'
                   % ((left + right) // 2, top - 6, html.escape(p["title"])))
        for t in xt:
            out.append('<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#e5e5e5"/>' % (X(t), top, X(t), bottom))
            out.append('<text x="%.1f" y="%d" text-anchor="middle">%s</text>' % (X(t), bottom + 14, fmt_tick(t)))
        for t in yt:
            out.append('<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#e5e5e5"/>' % (left, Y(t), right, Y(t)))
            out.append('<text x="%d" y="%.1f" text-anchor="end">%s</text>' % (left - 4, Y(t) + 4, fmt_tick(t)))
        out.append('<rect x="%d" y="%d" width="%d" height="%d" fill="none" stroke="#333"/>'
                   % (left, top, right - left, bottom - top))
        out.append('<text x="%d" y="%d" text-anchor="middle">%s</text>'
                   % ((left + right) // 2, bottom + 30, html.escape(p["xlabel"])))
        out.append('<text x="%d" y="%d" text-anchor="middle" transform="rotate(-90 %d %d)">%s</text>'
                   % (ox + 14, (top + bottom) // 2, ox + 14, (top + bottom) // 2, html.escape(p["ylabel"])))
        for i, s in enumerate(p["series"]):
            pts = [(X(x), Y(y)) for x, y in zip(s["x"], s["y"]) if math.isfinite(y)]
            color = "#444444" if s.get("dash") else COLORS[i % len(COLORS)]
            dash = ' stroke-dasharray="5,4"' if s.get("dash") else ""
            if len(pts) > 1:
                out.append('<polyline fill="none" stroke="%s" stroke-width="1.8"%s points="%s"/>'
                           % (color, dash, " ".join("%.1f,%.1f" % q for q in pts)))
            if not s.get("dash"):
                for q in pts:
                    out.append('<circle cx="%.1f" cy="%.1f" r="3" fill="%s"/>' % (q[0], q[1], color))
            ly = bottom + 48 + 14 * i
            out.append('<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="2"%s/>'
                       % (left, ly - 4, left + 22, ly - 4, color, dash))
            out.append('<text x="%d" y="%d">%s</text>' % (left + 28, ly, html.escape(s["label"])))
    out.append("</svg>")
    H_needed = 30 + ph - mb + 48 + 14 * max(len(p["series"]) for p in panels) + 10
    svg = "\n".join(out)
    if H_needed > H:
        svg = svg.replace('height="%d" viewBox="0 0 %d %d"' % (H, W, H),
                          'height="%d" viewBox="0 0 %d %d"' % (H_needed, W, H_needed), 1)
    with open(path, "w", encoding="utf-8") as f:
        f.write(svg + "\n")


def write_figure(spec, path, fmt, use_mpl):
    tmp = path + ".tmp." + fmt
    if use_mpl:
        render_matplotlib(spec, tmp, fmt)
    else:
        render_svg(spec, tmp)
    os.replace(tmp, path)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Plot `centrifuge bench --json` results: time vs sequence length, speed-up vs drop rate.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Writes PREFIX_seq.FMT and PREFIX_drop.FMT (a figure is skipped, with a note, when the data "
               "has no sweep for it).")
    ap.add_argument("inputs", nargs="+", help="JSON-lines files (centrifuge bench --json, bench_pytorch.py --json)")
    ap.add_argument("--out", default="bench", help="output prefix (default ./bench)")
    ap.add_argument("--format", choices=["svg", "png"], default="svg", help="svg (default) or png (needs matplotlib)")
    ap.add_argument("--keep", type=float, help="keep fraction of the seq figure (default: closest to 0.5)")
    ap.add_argument("--seq", type=int, help="sequence length of the drop-rate figure (default: longest swept)")
    ap.add_argument("--model", help="only rows of this model")
    ap.add_argument("--no-matplotlib", action="store_true", help="write the plain SVG even if matplotlib is there")
    args = ap.parse_args(argv)

    use_mpl = False
    if not args.no_matplotlib:
        try:
            import matplotlib  # noqa: F401
            use_mpl = True
        except ImportError:
            pass
    if args.format == "png" and not use_mpl:
        print("plot_bench: error: PNG needs matplotlib (pip install matplotlib), or use --format svg", file=sys.stderr)
        return 2
    try:
        rows = read_rows(args.inputs)
        if args.model:
            rows = [r for r in rows if str(r.get("model")) == args.model]
            if not rows:
                raise PlotError("no rows of model %s" % args.model)
        d = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(d):
            raise PlotError("%s: output directory does not exist" % d)
        written = []
        spec, keep = figure_seq(rows, args.keep)
        if spec:
            path = "%s_seq.%s" % (args.out, args.format)
            write_figure(spec, path, args.format, use_mpl)
            written.append(path)
        else:
            print("plot_bench: note: no rows for the time-vs-seq figure%s"
                  % (" at keep %.2f" % keep if keep is not None else ""))
        spec, seq, table = figure_drop(rows, args.seq)
        if spec:
            path = "%s_drop.%s" % (args.out, args.format)
            write_figure(spec, path, args.format, use_mpl)
            written.append(path)
            print("speed-up over regular at seq %d:" % seq)
            print("  %-32s %6s %9s %9s" % ("series", "drop", "backward", "step"))
            for lab, x, b, s in table:
                print("  %-32s %6.2f %9.3f %9.3f" % (lab, x, b, s))
        else:
            print("plot_bench: note: no regular + filtered rows at one seq%s: no speed-up figure"
                  % (" (seq %d)" % seq if seq else ""))
    except PlotError as e:
        print("plot_bench: error: %s" % e, file=sys.stderr)
        return 1
    if not written:
        print("plot_bench: error: nothing to plot", file=sys.stderr)
        return 1
    print("plot_bench: wrote %s (%s)" % (", ".join(written), "matplotlib" if use_mpl else "plain SVG"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
