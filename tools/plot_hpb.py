#!/usr/bin/env python3
"""The Hopper attention backward's launch plans from `gpu_session.sh attn-hpb`
output: per shape, the full (or, with --backward centrifuge, the centrifuge)
backward of every plan the sweep forced (heads per block x query parts) and
of the plan the engine chose ("auto"), as bars relative to the fastest
forced plan of that shape. PNG (needs matplotlib); --table prints the same
as text.

A forced head count that does not divide the GQA group runs as the next
lower divisor (bwd_sm90.cu), so "hpb 4" in a group of 3 is plan 3 x s; the
bars are per plan actually run, the mean of its timings.

Example (run 24):
  python3 tools/plot_hpb.py docs/data/gpu-run24/call5_plan_sweep/attn_hpb.txt \\
      --png docs/gpu_run24_plans.png
  python3 tools/plot_hpb.py --backward centrifuge \
      docs/data/gpu-run34/call2_h200_hpb_sweep_cfplan_0b6fde5/log.txt --png docs/gpu_run34_cf_plans.png
"""
import argparse
import re
import statistics
import sys

HEAD = re.compile(r"^(auto|hpb (\d+) split (\d+)), S H Hkv D = ([\d ]+)$")


def time_line(backward):
    return re.compile(r"^\s*backward " + re.escape(backward) + r"\s+([\d.]+) ms")


class HpbError(Exception):
    pass


def effective_hpb(hpb, group):
    while hpb > 1 and group % hpb:
        hpb -= 1
    return hpb


def read_sweep(text, backward="full"):
    """{shape: {plan: [ms, ...]}} of the `backward` line ("full" or
    "centrifuge"), shapes in first-seen order; a shape is "S H Hkv D" or
    "S H Hkv D B", a plan "auto" or "h x s" as run."""
    TIME = time_line(backward)
    data, order = {}, []
    cur = None
    for n, line in enumerate(text.splitlines(), 1):
        m = HEAD.match(line.strip())
        if m:
            shape = " ".join(m.group(4).split())
            nums = [int(x) for x in shape.split()]
            if len(nums) not in (4, 5) or min(nums) < 1 or nums[1] % nums[2]:
                raise HpbError(f"line {n}: bad shape '{shape}'")
            if m.group(1) == "auto":
                plan = "auto"
            else:
                plan = f"{effective_hpb(int(m.group(2)), nums[1] // nums[2])} x {m.group(3)}"
            if shape not in data:
                data[shape] = {}
                order.append(shape)
            cur = (shape, plan)
            continue
        t = TIME.match(line)
        if t:
            if cur is None:
                raise HpbError(f"line {n}: a time before any shape line")
            data[cur[0]].setdefault(cur[1], []).append(float(t.group(1)))
            cur = None
    if not any(data.values()):
        raise HpbError(f"no shape with a {backward}-backward time")
    data = {s: p for s, p in data.items() if p}
    order = [s for s in order if s in data]
    return {s: data[s] for s in order}


def relative(data):
    """{shape: {plan: mean / best forced mean}} (a shape needs a forced plan)."""
    out = {}
    for shape, plans in data.items():
        forced = [statistics.mean(v) for p, v in plans.items() if p != "auto"]
        if not forced:
            raise HpbError(f"shape {shape}: no forced plan to compare with")
        best = min(forced)
        out[shape] = {p: statistics.mean(v) / best for p, v in plans.items()}
    return out


def table(data):
    rows = []
    for shape, rel in relative(data).items():
        for plan, r in sorted(rel.items(), key=lambda kv: kv[1]):
            ms = statistics.mean(data[shape][plan])
            rows.append(f"{shape:>18}  {plan:>6}  {ms:.3f} ms  {r:.3f}")
    return "\n".join(rows)


def plot(data, png, title, backward="full"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rel = relative(data)
    shapes = list(rel)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(shapes)), 4))
    for i, shape in enumerate(shapes):
        plans = sorted((p for p in rel[shape] if p != "auto"), key=lambda p: rel[shape][p])
        w = 0.8 / (len(plans) + 1)
        for k, p in enumerate(plans):
            x = i - 0.4 + w * (k + 0.5)
            ax.bar(x, rel[shape][p], w, color="0.75", edgecolor="0.4")
            ax.text(x, rel[shape][p] + 0.01, p, rotation=90, ha="center", va="bottom", fontsize=6)
        if "auto" in rel[shape]:
            x = i - 0.4 + w * (len(plans) + 0.5)
            ax.bar(x, rel[shape]["auto"], w, color="tab:blue", label="the engine's plan" if i == 0 else None)
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels([s.replace(" ", "\n", 0) for s in shapes], fontsize=7)
    ax.set_xlabel("S H Hkv D [B]")
    ax.set_ylabel(f"{backward} backward / fastest forced plan")
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep", help="attn_hpb.txt of gpu_session.sh attn-hpb")
    ap.add_argument("--png", help="write the bars here")
    ap.add_argument("--table", action="store_true", help="print plan, ms and ratio per shape")
    ap.add_argument("--backward", choices=("full", "centrifuge"), default="full", help="which backward's times")
    ap.add_argument("--title", default="Hopper attention backward: launch plans (heads per block x parts)")
    a = ap.parse_args(argv)
    try:
        with open(a.sweep) as f:
            data = read_sweep(f.read(), a.backward)
        if a.table or not a.png:
            print(table(data))
        if a.png:
            plot(data, a.png, a.title, a.backward)
    except (OSError, HpbError) as e:
        print(f"plot_hpb: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
