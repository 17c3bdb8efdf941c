#!/usr/bin/env python3
"""Summarise a tools/utility.sh run: loss curves (PNG) and a Markdown table.

Reads WORKDIR/{mode}.jsonl (train --log), WORKDIR/eval.jsonl (math-eval --json)
and WORKDIR/times.txt; writes WORKDIR/utility_curves.png and prints Markdown.
"""
import argparse
import json
import os
import sys

MODES = ["regular", "loss-only", "centrifuge", "strawman"]
FAMILIES = ["add", "sub", "mul", "twostep"]


def read_jsonl(path):
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    return rows


def smooth(xs, k=50):
    out, acc = [], []
    for x in xs:
        acc.append(x)
        if len(acc) > k:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("workdir")
    ap.add_argument("--png", default=None, help="output plot (default WORKDIR/utility_curves.png)")
    a = ap.parse_args()
    W = a.workdir
    logs = {m: read_jsonl(os.path.join(W, m + ".jsonl")) for m in MODES if os.path.exists(os.path.join(W, m + ".jsonl"))}
    if not logs:
        sys.exit(f"plot_utility: no <mode>.jsonl in {W}")
    evals = {r["label"]: r for r in read_jsonl(os.path.join(W, "eval.jsonl"))} if os.path.exists(os.path.join(W, "eval.jsonl")) else {}
    times = {}
    if os.path.exists(os.path.join(W, "times.txt")):
        for line in open(os.path.join(W, "times.txt")):
            p = line.split()
            if len(p) >= 2:
                times[p[0]] = (float(p[1]), p[2] if len(p) > 2 else "")
    png = a.png or os.path.join(W, "utility_curves.png")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(12, 4.2))
        for m, rows in logs.items():
            steps = [r["step"] for r in rows if r.get("loss") is not None]
            loss = [r["loss"] for r in rows if r.get("loss") is not None]
            ax[0].plot(steps, smooth(loss), label=m)
            vs = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
            if vs:
                ax[1].plot([s for s, _ in vs], [v for _, v in vs], marker=".", label=m)
        ax[0].set_title("training loss (kept positions; 50-step mean)")
        ax[1].set_title("held-out clean loss (all positions)")
        for x in ax:
            x.set_xlabel("step")
            x.grid(alpha=0.3)
            x.legend()
        ax[1].set_ylabel("loss")
        fig.tight_layout()
        fig.savefig(png, dpi=110)
        print(f"<!-- wrote {png} -->")
    except ImportError:
        print("<!-- matplotlib missing: no plot -->")
    print("| model | final train loss | held-out clean loss | " + " | ".join(FAMILIES) + " | accuracy | wall-clock s | exit |")
    print("|---|---|---|" + "---|" * len(FAMILIES) + "---|---|---|")
    for m in ["reference"] + MODES:
        if m not in evals and m not in logs:
            continue
        e = evals.get(m, {})
        rows = logs.get(m, [])
        last = [r["loss"] for r in rows[-50:] if r.get("loss") is not None]
        tl = f"{sum(last) / len(last):.4f}" if last else "-"
        cl = f"{e['clean_loss']:.4f}" if "clean_loss" in e else "-"
        fams = " | ".join(f"{100 * e['acc_' + f]:.1f}%" if "acc_" + f in e else "-" for f in FAMILIES)
        acc = f"{100 * e['accuracy']:.1f}%" if "accuracy" in e else "-"
        t, rc = times.get(m, (None, ""))
        print(f"| {m} | {tl} | {cl} | {fams} | {acc} | {t if t is not None else '-'} | {rc} |")


if __name__ == "__main__":
    main()
