#!/usr/bin/env python3
"""ncu_kernels.py: per-kernel totals from an Nsight Compute CSV.

Reads the CSV that `ncu --csv --print-units base --metrics
gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum` writes
(one row per kernel and metric) and prints, per kernel name (template
arguments cut), the launches, total time, share of the whole, and the DRAM
traffic and bandwidth it reached: which kernels to look at, and how far
from the memory floor each one runs.

  python3 tools/ncu_kernels.py ncu.csv [--top 40] [--bw 3.35e12] [--batch N]

--batch N: a kernel's launches in groups of N, in launch order ("name [i]"
for the i-th group): bench_attention runs each mode 23 times in turn, so
with 23 the main backward kernel's groups 0, 1, 2 are the full, centrifuge
and strawman backwards.
"""
import argparse
import csv
import re
import sys
from collections import defaultdict


def short_name(name):
    """The kernel's name without return type and argument list (template
    arguments kept: they tell variants apart)."""
    name = name.strip()
    depth, cut = 0, len(name)
    for i, ch in enumerate(name):   # the argument list: the first '(' outside <...>
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            cut = i
            break
    name = name[:cut]
    return name[5:] if name.startswith("void ") else name


def read(path):
    """{launch id: {"name": ..., metric: value}} from the CSV."""
    rows = {}
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]   # ncu prints log lines before the table
    for r in csv.DictReader(lines):
        try:
            v = float(r["Metric Value"].replace(",", ""))
        except (KeyError, ValueError):
            continue
        k = rows.setdefault(r["ID"], {"name": short_name(r["Kernel Name"])})
        k[r["Metric Name"]] = v
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--bw", type=float, default=3.35e12, help="peak DRAM bytes/s for the floor column")
    ap.add_argument("--batch", type=int, default=0, help="a kernel's launches in groups of N, in launch order")
    a = ap.parse_args()
    rows = read(a.csv)
    if not rows:
        sys.exit(f"{a.csv}: no kernel rows (not an ncu --csv file?)")
    agg = defaultdict(lambda: [0, 0.0, 0.0])
    seen = defaultdict(int)
    for _, k in sorted(rows.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0):
        name = k["name"]
        if a.batch > 0:
            name = f"{name} [{seen[k['name']] // a.batch}]"
            seen[k["name"]] += 1
        g = agg[name]
        g[0] += 1
        g[1] += k.get("gpu__time_duration.sum", 0.0)
        g[2] += k.get("dram__bytes_read.sum", 0.0) + k.get("dram__bytes_write.sum", 0.0)
    total = sum(g[1] for g in agg.values())
    print(f"{len(rows)} launches, {total / 1e6:.3f} ms of kernel time")
    print(f"{'kernel':70s} {'n':>6s} {'ms':>9s} {'%':>6s} {'us/launch':>10s} {'MB':>9s} {'GB/s':>8s} {'floor ms':>9s}")
    for name, (n, ns, by) in sorted(agg.items(), key=lambda kv: -kv[1][1])[: a.top]:
        gbs = by / ns if ns else 0.0
        print(f"{name[:70]:70s} {n:6d} {ns / 1e6:9.3f} {100 * ns / total:6.1f} {ns / n / 1e3:10.2f} "
              f"{by / 1e6:9.1f} {gbs:8.0f} {by / a.bw * 1e3:9.3f}")


if __name__ == "__main__":
    main()
