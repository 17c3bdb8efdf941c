#!/usr/bin/env python3
"""Summarise a tools/utility.sh run: loss curves (PNG) and Markdown tables.

WORKDIR is one run (WORKDIR/{mode}.jsonl from train --log, eval.jsonl from
math-eval --json, times.txt) or a multi-seed run (SEEDS=...: one such run per
WORKDIR/seed<s>/). Prints Markdown: one row per run (seed and mode), and with
several seeds the mean and spread (sample standard deviation, min..max) per
mode, and the share of loss-only's improvement over regular in held-out clean
loss that each mode recovers. Writes WORKDIR/utility_curves.png with every
seed's curves (one colour per mode, one line style per seed).
"""
import argparse
import json
import math
import os
import re
import sys

KNOWN = ["regular", "loss-only", "centrifuge", "centrifuge-kv", "strawman"]
FAMILIES = ["add", "sub", "mul", "twostep"]
NOT_MODES = {"eval", "ref"}


def read_jsonl(path):
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a line cut by a kill
    return rows


def dedupe_steps(rows):
    """A resumed run appends to its log: keep the last row of each step."""
    by = {}
    for r in rows:
        if "step" in r:
            by[r["step"]] = r
    return [by[s] for s in sorted(by)]


def smooth(xs, k=50):
    out, acc = [], []
    for x in xs:
        acc.append(x)
        if len(acc) > k:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def read_run(d):
    """One run directory: modes, logs, evals (last line per label), times."""
    names = [f[:-6] for f in os.listdir(d) if f.endswith(".jsonl") and f[:-6] not in NOT_MODES]
    modes = [m for m in KNOWN if m in names] + sorted(m for m in names if m not in KNOWN)
    logs = {m: dedupe_steps(read_jsonl(os.path.join(d, m + ".jsonl"))) for m in modes}
    evals = {}
    if os.path.exists(os.path.join(d, "eval.jsonl")):
        for r in read_jsonl(os.path.join(d, "eval.jsonl")):
            evals[r.get("label", "")] = r
    times = {}
    if os.path.exists(os.path.join(d, "times.txt")):
        for line in open(os.path.join(d, "times.txt")):
            p = line.split()
            if len(p) >= 2:
                t, rc = times.get(p[0], (0.0, ""))
                times[p[0]] = (t + float(p[1]), p[2] if len(p) > 2 else rc)
    seeds = open(os.path.join(d, "seeds.txt")).read().split() if os.path.exists(os.path.join(d, "seeds.txt")) else []
    return {"dir": d, "modes": modes, "logs": logs, "evals": evals, "times": times, "seeds": seeds}


def last_val(rows):
    v = [r["val_loss"] for r in rows if "val_loss" in r]
    return v[-1] if v else None


def final_train(rows):
    last = [r["loss"] for r in rows[-50:] if r.get("loss") is not None]
    return sum(last) / len(last) if last else None


def stats(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, sd, min(xs), max(xs), len(xs)


def fmt(st, scale=1.0, digits=4, unit=""):
    if st is None:
        return "-"
    m, sd, lo, hi, n = st
    if n == 1:
        return f"{m * scale:.{digits}f}{unit}"
    return f"{m * scale:.{digits}f}{unit} ± {sd * scale:.{digits}f} [{lo * scale:.{digits}f}, {hi * scale:.{digits}f}]"


def plot(runs, labels, png):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("<!-- matplotlib missing: no plot -->")
        return
    modes = []
    for r in runs:
        modes += [m for m in r["modes"] if m not in modes]
    colours = {m: f"C{i}" for i, m in enumerate(modes)}
    styles = ["-", "--", ":", "-."]
    fig, ax = plt.subplots(1, 3, figsize=(17, 4.4))
    for si, (r, lab) in enumerate(zip(runs, labels)):
        ls = styles[si % len(styles)]
        for m in r["modes"]:
            rows = r["logs"][m]
            steps = [x["step"] for x in rows if x.get("loss") is not None]
            loss = [x["loss"] for x in rows if x.get("loss") is not None]
            name = m if si == 0 else None
            ax[0].plot(steps, smooth(loss), color=colours[m], ls=ls, lw=1, label=name)
            vs = [(x["step"], x["val_loss"]) for x in rows if "val_loss" in x]
            if vs:
                ax[1].plot([s for s, _ in vs], [v for _, v in vs], color=colours[m], ls=ls, lw=1, marker=".", ms=3,
                           label=name)
    # final held-out clean loss (math-eval) per mode: one dot per seed, the mean as a bar
    for mi, m in enumerate(modes):
        vals = [r["evals"][m]["clean_loss"] for r in runs if m in r["evals"] and "clean_loss" in r["evals"][m]]
        if not vals:
            continue
        ax[2].scatter([mi] * len(vals), vals, color=colours[m], zorder=3)
        for v, lab in zip(vals, labels):
            if len(runs) > 1:
                ax[2].annotate(lab, (mi, v), textcoords="offset points", xytext=(6, -3), fontsize=7)
        mean = sum(vals) / len(vals)
        ax[2].hlines(mean, mi - 0.3, mi + 0.3, color=colours[m], lw=2)
    ax[2].set_xticks(range(len(modes)))
    ax[2].set_xticklabels(modes, rotation=20)
    ax[0].set_title("training loss (kept positions; 50-step mean)")
    ax[1].set_title("held-out clean loss (train --val)")
    ax[2].set_title("held-out clean loss (math-eval), per seed and mean")
    if len(runs) > 1:
        ax[0].text(0.98, 0.98, "line style = seed: " + ", ".join(f"{lab} {styles[i % len(styles)]}"
                                                                   for i, lab in enumerate(labels)),
                   transform=ax[0].transAxes, ha="right", va="top", fontsize=8)
    for x in ax[:2]:
        x.set_xlabel("step")
        x.legend()
    for x in ax:
        x.grid(alpha=0.3)
    # the held-out curves' interesting part is the end: zoom so every curve's end shows
    ends = [v for r in runs for m in r["modes"] for v in [last_val(r["logs"][m])] if v is not None]
    if ends:
        lo, hi = min(ends), max(ends)
        ax[1].set_ylim(lo - 0.05 * (hi - lo) - 0.01 * lo, hi + 0.6 * (hi - lo) + 0.03 * lo)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"<!-- wrote {png} -->")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workdir")
    ap.add_argument("--png", default=None, help="output plot (default WORKDIR/utility_curves.png)")
    a = ap.parse_args()
    W = a.workdir
    seed_dirs = sorted((d for d in os.listdir(W) if re.fullmatch(r"seed\d+", d) and os.path.isdir(os.path.join(W, d))),
                       key=lambda d: int(d[4:]))
    if seed_dirs:
        runs = [read_run(os.path.join(W, d)) for d in seed_dirs]
        labels = [d[4:] for d in seed_dirs]
    else:
        runs = [read_run(W)]
        labels = [""]
    runs_labels = [(r, lab) for r, lab in zip(runs, labels) if r["modes"] or r["evals"]]
    if not runs_labels:
        sys.exit(f"plot_utility: no <mode>.jsonl in {W}" + (" or its seed*/ directories" if seed_dirs else ""))
    runs, labels = [r for r, _ in runs_labels], [lab for _, lab in runs_labels]
    plot(runs, labels, a.png or os.path.join(W, "utility_curves.png"))

    multi = len(runs) > 1 or bool(seed_dirs)
    modes = []
    for r in runs:
        modes += [m for m in ["reference"] + r["modes"] if m not in modes]

    # one row per run
    print("| " + ("seed | " if multi else "") + "model | final train loss | held-out clean loss (train --val) | "
          "clean loss (math-eval) | " + " | ".join(FAMILIES) + " | accuracy | wall-clock s | exit |")
    print("|" + ("---|" if multi else "") + "---|---|---|---|" + "---|" * len(FAMILIES) + "---|---|---|")
    for m in modes:
        for r, lab in zip(runs, labels):
            if m not in r["evals"] and m not in r["logs"]:
                continue
            e = r["evals"].get(m, {})
            rows = r["logs"].get(m, [])
            tl, vl = final_train(rows), last_val(rows)
            cl = f"{e['clean_loss']:.4f}" if "clean_loss" in e else "-"
            fams = " | ".join(f"{100 * e['acc_' + f]:.0f}%" if "acc_" + f in e else "-" for f in FAMILIES)
            acc = f"{100 * e['accuracy']:.1f}%" if "accuracy" in e else "-"
            t, rc = r["times"].get(m, (None, ""))
            cells = ([lab] if multi else []) + [m, f"{tl:.4f}" if tl is not None else "-",
                                                f"{vl:.4f}" if vl is not None else "-", cl, fams, acc,
                                                f"{t:.1f}" if t is not None else "-", rc]
            print("| " + " | ".join(cells) + " |")
    if not multi:
        return

    # mean and spread per mode over the seeds
    def per_seed(m, key):
        return [r["evals"][m].get(key) if m in r["evals"] else None for r in runs]

    print()
    print(f"Over {len(runs)} seeds ({', '.join(labels)}): mean ± sample standard deviation [min, max].")
    print()
    print("| model | seeds | clean loss (math-eval) | held-out loss (train --val) | accuracy | "
          + " | ".join(FAMILIES) + " | recovered of loss-only's gain | wall-clock s |")
    print("|---|---|---|---|---|" + "---|" * len(FAMILIES) + "---|---|")
    reg = per_seed("regular", "clean_loss")
    lo = per_seed("loss-only", "clean_loss")
    for m in modes:
        cl = per_seed(m, "clean_loss")
        n = sum(x is not None for x in cl)
        if n == 0 and m not in [x for r in runs for x in r["logs"]]:
            continue
        vl = stats([last_val(r["logs"][m]) if m in r["logs"] else None for r in runs])
        acc = stats(per_seed(m, "accuracy"))
        fams = " | ".join(fmt(stats(per_seed(m, "acc_" + f)), 100, 0, "%").split(" [")[0] for f in FAMILIES)
        # (regular - mode) / (regular - loss-only), from the seed means, and per seed
        rec = "-"
        if m not in ("reference", "regular") and all(x is not None for x in reg + lo + cl):
            mr, ml, mm = (sum(v) / len(v) for v in (reg, lo, cl))
            if mr != ml:
                each = "/".join(f"{100 * (a - c) / (a - b):.0f}" for a, b, c in zip(reg, lo, cl) if a != b)
                rec = f"{100 * (mr - mm) / (mr - ml):.0f}% (per seed {each})"
        times = stats([r["times"][m][0] if m in r["times"] else None for r in runs])
        print(f"| {m} | {n} | {fmt(stats(cl))} | {fmt(vl)} | {fmt(acc, 100, 1, '%')} | {fams} | {rec} | "
              f"{fmt(times, 1, 1).split(' [')[0]} |")


if __name__ == "__main__":
    main()
