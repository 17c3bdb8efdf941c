#!/usr/bin/env python3
"""Which pipes a kernel keeps busy and why its warps wait, from ncu's raw page.

Usage: ncu ... --section SpeedOfLight --section ComputeWorkloadAnalysis \\
           --section WarpStateStats --page raw --csv PROGRAM > K.csv
       python3 tools/ncu_pipes.py K.csv [--top N]

Prints, per profiled kernel launch: its duration and SM clock; the
utilisation of each pipe (ncu's sm__inst_executed_pipe_* and
sm__pipe_*_cycles_active metrics, as % of their peak over the active
cycles), largest first; and the stall reasons (warps per issued
instruction stalled for each reason, smsp__average_warps_issue_stalled_*),
largest first. The tensor pipe's line and the special-function unit's
(xu: ex2, rcp, ...) are the two to compare in an attention kernel.
"""
import argparse
import csv
import re
import sys


def as_float(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def launches(path):
    """(header, units, rows) of the raw CSV: one row per launch"""
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    rows = list(csv.reader(lines))
    if len(rows) < 3:
        return None, None, []
    return rows[0], rows[1], rows[2:]


PIPE = re.compile(r"^sm__(inst_executed_pipe_|pipe_)(\w+?)(_cycles_active)?\.avg\.pct_of_peak_sustained_active$")
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    head, units, rows = launches(args.csv)
    if not rows:
        print(f"{args.csv}: no launch in the CSV (see the .err file beside it)")
        return 1
    col = {name: i for i, name in enumerate(head)}
    for row in rows:
        get = lambda name: as_float(row[col[name]]) if name in col else None
        name = row[col["Kernel Name"]] if "Kernel Name" in col else "?"
        dur = get("gpu__time_duration.sum")
        clk = get("sm__cycles_elapsed.avg.per_second")
        print(f"{name[:90]}")
        line = []
        if dur is not None:
            line.append(f"duration {dur / 1000:.1f} us" if units[col["gpu__time_duration.sum"]] == "ns" else f"duration {dur}")
        if clk is not None:
            line.append(f"SM clock {clk / 1e6 if clk > 1e5 else clk:.0f} MHz")
        for key, label in (("sm__throughput.avg.pct_of_peak_sustained_elapsed", "SM throughput"),
                           ("smsp__issue_active.avg.pct_of_peak_sustained_active", "issue active")):
            v = get(key)
            if v is not None:
                line.append(f"{label} {v:.1f}%")
        print("  " + ", ".join(line))
        pipes = []
        for name_, i in col.items():
            m = PIPE.match(name_)
            v = as_float(row[i])
            if m and v is not None and v > 0.05:
                pipes.append((v, ("inst " if m.group(1) == "inst_executed_pipe_" else "cycles ") + m.group(2)))
        pipes.sort(reverse=True)
        print("  pipes (% of peak, active cycles): " + ", ".join(f"{n} {v:.1f}" for v, n in pipes[: args.top]))
        stalls = []
        for name_, i in col.items():
            m = STALL.match(name_)
            v = as_float(row[i])
            if m and v is not None and v > 0.005 and not m.group(1).endswith("_not_issued"):
                stalls.append((v, m.group(1)))
        stalls.sort(reverse=True)
        total = sum(v for v, _ in stalls)
        print(f"  stalls (warps per issue, total {total:.2f}): " +
              ", ".join(f"{n} {v:.2f}" for v, n in stalls[: args.top]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
