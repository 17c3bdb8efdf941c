#!/usr/bin/env python3
"""Where a kernel's warps wait, from ncu's source page.

Usage: ncu -i REPORT.ncu-rep --page source --csv --print-source sass > K.csv
       python3 tools/ncu_stalls.py K.csv [--top N]

ncu samples each warp's program counter at a fixed interval and records
why it did not issue. The source page lists, per SASS instruction, the
samples taken there. This tool sums them per instruction kind (the opcode
without its last modifiers: BAR.SYNC, SYNCS.PHASECHK, WARPGROUP.DEPBAR,
HGMMA, ...) and lists the N instructions with the most samples, so the
share of time spent waiting at each barrier or wgmma wait can be read off.
"""
import argparse
import csv
import re
import sys

SAMPLE_COLUMNS = ("Warp Stall Sampling (All Samples)", "Warp Stall Sampling (All Cycles)")


def opcode_kind(sass):
    """'@!P0 BAR.SYNC.DEFER_BLOCKING R3, R4 ;' -> 'BAR.SYNC'"""
    text = sass.strip()
    text = re.sub(r"^@!?U?P[T0-9]+\s+", "", text)
    op = text.split(None, 1)[0] if text else ""
    parts = op.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else op


def number(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return 0.0


def read_rows(path):
    """The rows of the source table: dicts with 'address', 'sass', 'samples'."""
    with open(path, newline="") as f:
        lines = [l for l in f if l.strip() and not l.startswith("==")]
    reader = csv.reader(lines)
    header = None
    rows = []
    for rec in reader:
        if header is None:
            if "Source" in rec and any(c in rec for c in SAMPLE_COLUMNS):
                header = rec
                src = rec.index("Source")
                smp = next(rec.index(c) for c in SAMPLE_COLUMNS if c in rec)
                addr = rec.index("Address") if "Address" in rec else (rec.index("# Address") if "# Address" in rec else None)
            continue
        if len(rec) <= max(src, smp):
            continue
        rows.append({"address": rec[addr] if addr is not None else "", "sass": rec[src], "samples": number(rec[smp])})
    if header is None:
        raise ValueError(f"{path}: no source table with a warp-stall sampling column")
    return rows


def summarize(rows, top):
    total = sum(r["samples"] for r in rows)
    if total <= 0:
        raise ValueError("no samples")
    kinds = {}
    for r in rows:
        k = opcode_kind(r["sass"])
        kinds[k] = kinds.get(k, 0.0) + r["samples"]
    out = [f"{int(total)} samples over {len(rows)} instructions", "", "per instruction kind:"]
    for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])[:top]:
        out.append(f"  {100 * v / total:5.1f}%  {k}")
    out += ["", f"the {top} instructions with the most samples:"]
    for r in sorted(rows, key=lambda r: -r["samples"])[:top]:
        out.append(f"  {100 * r['samples'] / total:5.1f}%  {r['address']:>8}  {r['sass'].strip()[:90]}")
    return "\n".join(out)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args(argv)
    try:
        print(summarize(read_rows(args.csv), args.top))
    except (OSError, ValueError) as e:
        print(f"ncu_stalls: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
