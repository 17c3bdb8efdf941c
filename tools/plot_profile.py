#!/usr/bin/env python3
"""plot_profile.py — stacked bars of `centrifuge bench --profile` output: the
time per op category of one micro-batch, forward or backward, for every
(file, mode) found.

    python3 tools/plot_profile.py LABEL=FILE [LABEL=FILE ...] --png out.png [--phase bwd|fwd]

Each FILE is the text `bench --profile` printed (one "profile <mode> <cat>
<fwd>/<bwd> ..." line per mode); LABEL names it in the plot (e.g. "qwen old").
"""
import argparse
import os
import re
import sys

LINE = re.compile(r"^\s*(?:\S+\s+)?profile\s+(\S+)\s+(.*?)\s+\(ms fwd/bwd")
PAIR = re.compile(r"(\S+)\s+([0-9.]+)/([0-9.]+)")


def parse(path):
    """[(mode, {category: (fwd, bwd)})] in file order."""
    out = []
    with open(path) as f:
        for line in f:
            m = LINE.match(line)
            if not m:
                continue
            cats = {c: (float(a), float(b)) for c, a, b in PAIR.findall(m.group(2))}
            if not cats:
                raise ValueError(f"{path}: a profile line without categories: {line.strip()}")
            out.append((m.group(1), cats))
    if not out:
        raise ValueError(f"{path}: no 'profile' lines (was bench run with --profile?)")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("inputs", nargs="+", help="LABEL=FILE")
    ap.add_argument("--png", required=True)
    ap.add_argument("--phase", choices=("fwd", "bwd"), default="bwd")
    ap.add_argument("--title", default=None)
    a = ap.parse_args(argv)
    bars = []   # (label, {cat: ms})
    for item in a.inputs:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            ap.error(f"expected LABEL=FILE, got '{item}'")
        try:
            rows = parse(path)
        except (OSError, ValueError) as e:
            print(f"plot_profile: {e}", file=sys.stderr)
            return 1
        k = 0 if a.phase == "fwd" else 1
        for mode, cats in rows:
            bars.append((f"{label}\n{mode}", {c: v[k] for c, v in cats.items()}))
    cats = []
    for _, d in bars:
        cats += [c for c in d if c not in cats]
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(1.3 * len(bars) + 2, 4.5))
    bottom = [0.0] * len(bars)
    for c in cats:
        h = [d.get(c, 0.0) for _, d in bars]
        ax.bar(range(len(bars)), h, bottom=bottom, label=c)
        bottom = [x + y for x, y in zip(bottom, h)]
    for i, tot in enumerate(bottom):
        ax.text(i, tot, f"{tot:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    ax.set_ylabel(f"ms per micro-batch ({'forward' if a.phase == 'fwd' else 'backward'})")
    ax.set_title(a.title or "time per op category (bench --profile)")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    # written whole or not at all: a temporary file, then renamed over the target
    tmp = a.png + ".tmp.png"
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, a.png)
    except OSError as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        print(f"plot_profile: {a.png}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"wrote {a.png}: {len(bars)} bars, {len(cats)} categories")
    return 0


if __name__ == "__main__":
    sys.exit(main())
