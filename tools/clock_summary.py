#!/usr/bin/env python3
"""Summarises the SM clock and power that nvidia-smi sampled during a run.

Usage: clock_summary.py SAMPLES.csv[.gz] [LABEL]

SAMPLES.csv: lines of
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,
             clocks_throttle_reasons.active --format=csv,noheader -lms 50
One line out: the number of samples, then over the busy ones (power above a
quarter of the largest sample: the run itself, not the start and the exit)
the median, lowest and highest SM clock, the median power and temperature,
and the share of busy samples with each active throttle reason (REASONS:
nvidia-smi's bits; sw-power-cap is the usual one under load)."""
import gzip
import statistics
import sys

# nvidia-smi -q's "Clocks Event Reasons" bits (nvmlClocksEventReason*)
REASONS = {0x1: "idle", 0x2: "app-clocks", 0x4: "sw-power-cap", 0x8: "hw-slowdown", 0x10: "sync-boost",
           0x20: "sw-thermal", 0x40: "hw-thermal", 0x80: "hw-power-brake", 0x100: "display-clocks"}


def number(field):
    """The number at the start of '1980 MHz' or '650.12 W'; None for '[N/A]'."""
    try:
        return float(field.strip().split()[0])
    except (ValueError, IndexError):
        return None


def parse(lines):
    """(sm_mhz, power_w, temp_c, reasons) per sample line; lines that are not samples are skipped."""
    out = []
    for line in lines:
        f = [x.strip() for x in line.split(",")]
        if len(f) < 6:
            continue
        sm, pw, tc = number(f[1]), number(f[3]), number(f[4])
        try:
            rs = int(f[5], 16)
        except ValueError:
            rs = 0
        if sm is None or pw is None:
            continue
        out.append((sm, pw, tc, rs))
    return out


def summary(samples):
    """A dict of the busy samples' statistics (see the module's text); None without samples."""
    if not samples:
        return None
    top = max(s[1] for s in samples)
    busy = [s for s in samples if s[1] >= 0.25 * top]
    clocks = [s[0] for s in busy]
    temps = [s[2] for s in busy if s[2] is not None]
    shares = {}
    for bit, name in REASONS.items():
        n = sum(1 for s in busy if s[3] & bit)
        if n:
            shares[name] = n / len(busy)
    return {"samples": len(samples), "busy": len(busy), "sm_median": statistics.median(clocks),
            "sm_min": min(clocks), "sm_max": max(clocks), "power_median": statistics.median(s[1] for s in busy),
            "temp_median": statistics.median(temps) if temps else None, "reasons": shares}


def line(label, s):
    if s is None:
        return f"{label}: no samples"
    r = " ".join(f"{k} {v:.0%}" for k, v in sorted(s["reasons"].items())) or "none"
    t = f"{s['temp_median']:.0f} C" if s["temp_median"] is not None else "n/a"
    return (f"{label}: {s['busy']} busy of {s['samples']} samples: SM clock median {s['sm_median']:.0f} MHz "
            f"({s['sm_min']:.0f}-{s['sm_max']:.0f}), power median {s['power_median']:.0f} W, {t}; throttle: {r}")


def main(argv):
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    try:
        with (gzip.open(argv[1], "rt") if argv[1].endswith(".gz") else open(argv[1])) as f:
            s = summary(parse(f))
    except OSError as e:
        print(f"clock_summary: {e}", file=sys.stderr)
        return 1
    print(line(argv[2] if len(argv) > 2 else argv[1], s))
    return 0 if s else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
