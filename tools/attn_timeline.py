#!/usr/bin/env python3
"""attn_timeline.py: where an attention backward's SM time goes, block by block.

Reads the per-block records of a trace build (src/backend/cuda/attention/
trace.cuh; CF_ATTN_TRACE_FILE) and, for each traced backward, accounts
for every SM over the span of its big kernels (the main kernel and
centrifuge part 2, one block per SM each):

  steps      the blocks' step loops (first step's operands in -> loop done)
  prologue   entry -> the first step's operands in shared memory
  epilogue   loop done -> exit (dk, dv out; the pairs' exchange)
  handoff    an SM idle between one big block's exit and the next one's entry
  head       an SM idle from the span's start to its first big block
  tail       an SM idle from its last big block to the span's end

These six add up to SMs x span. The prep and finish launches (small
blocks, several per SM) are reported by their own spans only. A block's
cycles are turned into time at its own clock, its cycles over its global
time (the SM clock moves with power: run 32 saw 1.75 GHz in part 1 and
1.97 in part 2 of one backward); blocks too short for the global timer's
resolution take the median clock of their kernel.

  python3 tools/attn_timeline.py trace.txt [--plot gantt.png --call N]

File format (launch.cu: trace_end): a header line per backward,
  # call N mode M B b S s H h Hkv k D d kept n sms m records r lost l
then a line per block record,
  kernel block smid steps g0 g1 c0 c1 c2 c3
kernel 1 prep, 2 main, 3 part 2, 4 finish; g in ns of the global timer,
c in the SM's cycles (entry, first step's operands in, loop done, exit).
Traces of b38c112 left c2 at c0 where a finish block made mark 1 but not
2; such a c2 < c1 reads as c2 = c1 (no loop).
"""
import argparse
import statistics
import sys

KERNELS = {1: "prep", 2: "main", 3: "part 2", 4: "finish"}
BIG = (2, 3)
PHASES = ("steps", "prologue", "epilogue", "handoff", "head", "tail")


def read(path):
    """[(header dict, [record dict])] in file order."""
    calls = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            if line.startswith("#"):
                w = line[1:].split()
                if len(w) % 2:
                    raise ValueError(f"{path}:{n}: header is not name/value pairs")
                h = dict(zip(w[0::2], w[1::2]))
                for k in h:
                    if k != "mode":
                        h[k] = int(h[k])
                calls.append((h, []))
                continue
            if not calls:
                raise ValueError(f"{path}:{n}: a record before any header")
            v = line.split()
            if len(v) != 10:
                raise ValueError(f"{path}:{n}: {len(v)} fields, want 10")
            k, blk, sm, st, g0, g1, c0, c1, c2, c3 = map(int, v)
            if k not in BIG and c0 <= c2 < c1:
                c2 = c1
            if not (g0 <= g1 and c0 <= c1 <= c2 <= c3):
                raise ValueError(f"{path}:{n}: times out of order")
            calls[-1][1].append(dict(kernel=k, block=blk, sm=sm, steps=st, g0=g0, g1=g1, c0=c0, c1=c1, c2=c2, c3=c3))
    return calls


LONG_NS = 2000  # a block this long has a clock of its own (the global timer ticks every 32 ns or so)


def clock_ghz(recs):
    """Cycles per ns: the median over the blocks that ran at least LONG_NS
    (over all blocks that took any time where none did)."""
    long = [(r["c3"] - r["c0"]) / (r["g1"] - r["g0"]) for r in recs if r["g1"] - r["g0"] >= LONG_NS]
    if not long:
        long = [(r["c3"] - r["c0"]) / (r["g1"] - r["g0"]) for r in recs if r["g1"] > r["g0"]]
    if not long:
        raise ValueError("no record spans any time: cannot tell the clock")
    return statistics.median(long)


def block_clocks(recs):
    """{id(record): cycles per ns} for every record: its own where it is
    long enough, else its kernel's median."""
    per_kernel = {}
    for k in {r["kernel"] for r in recs}:
        rs = [r for r in recs if r["kernel"] == k]
        try:
            per_kernel[k] = clock_ghz(rs)
        except ValueError:
            per_kernel[k] = None
    fallback = clock_ghz(recs)
    out = {}
    for r in recs:
        if r["g1"] - r["g0"] >= LONG_NS and r["c3"] > r["c0"]:
            out[id(r)] = (r["c3"] - r["c0"]) / (r["g1"] - r["g0"])
        else:
            out[id(r)] = per_kernel[r["kernel"]] or fallback
    return out


def account(header, recs):
    """The SM-time accounting of one backward (module docstring), in us,
    plus per-kernel figures."""
    ghz = clock_ghz(recs)
    clk = block_clocks(recs)
    big = [r for r in recs if r["kernel"] in BIG]
    if not big:
        raise ValueError("no main-kernel or part-2 record")
    t0 = min(r["g0"] for r in big)
    t1 = max(r["g1"] for r in big)
    sms = header.get("sms", 0) or (max(r["sm"] for r in recs) + 1)
    acc = dict.fromkeys(PHASES, 0.0)

    def us(r, a, b):  # cycles from mark a to mark b of record r, in us at its clock
        return (r[b] - r[a]) / clk[id(r)] / 1e3

    per_sm = {}
    for r in big:
        per_sm.setdefault(r["sm"], []).append(r)
        acc["steps"] += us(r, "c1", "c2")
        acc["prologue"] += us(r, "c0", "c1")
        acc["epilogue"] += us(r, "c2", "c3")
    for sm in range(sms):
        rs = sorted(per_sm.get(sm, []), key=lambda r: r["g0"])
        if not rs:
            acc["head"] += (t1 - t0) / 1e3
            continue
        acc["head"] += (rs[0]["g0"] - t0) / 1e3
        acc["tail"] += (t1 - max(r["g1"] for r in rs)) / 1e3
        end = rs[0]["g1"]
        for r in rs[1:]:
            acc["handoff"] += max(0, r["g0"] - end) / 1e3
            end = max(end, r["g1"])
    kernels = {}
    for k in sorted({r["kernel"] for r in recs}):
        rs = [r for r in recs if r["kernel"] == k]
        worked = [r for r in rs if r["steps"] > 0]
        steps = sum(r["steps"] for r in worked)
        kernels[k] = dict(
            blocks=len(rs),
            start=(min(r["g0"] for r in rs) - t0) / 1e3,
            end=(max(r["g1"] for r in rs) - t0) / 1e3,
            prologue=statistics.median([us(r, "c0", "c1") for r in worked]) if worked else 0.0,
            step=sum(us(r, "c1", "c2") for r in worked) / steps if steps else 0.0,
            epilogue=statistics.median([us(r, "c2", "c3") for r in worked]) if worked else 0.0,
            steps=steps,
            ghz=statistics.median([clk[id(r)] for r in rs]),
        )
    return dict(ghz=ghz, span=(t1 - t0) / 1e3, sms=sms, acc=acc, kernels=kernels)


def describe(header):
    return (f"call {header.get('call', '?')}: {header.get('mode', '?')}, B {header.get('B')} S {header.get('S')} "
            f"H {header.get('H')} Hkv {header.get('Hkv')} D {header.get('D')}, kept {header.get('kept')}")


def report(calls, out=sys.stdout):
    for h, recs in calls:
        if not recs:
            print(f"{describe(h)}: no records", file=out)
            continue
        a = account(h, recs)
        total = a["sms"] * a["span"]
        print(f"{describe(h)}: big kernels' span {a['span']:.1f} us on {a['sms']} SMs, median clock {a['ghz']:.3f} GHz"
              + (f", {h['lost']} records lost" if h.get("lost") else ""), file=out)
        print("  SM time: " + ", ".join(f"{p} {a['acc'][p] / total * 100:.1f}%" for p in PHASES)
              + f" (of {total:.0f} SM-us)", file=out)
        print(f"  {'kernel':<8}{'blocks':>7}{'from us':>9}{'to us':>8}{'steps':>7}{'prologue':>10}"
              f"{'us/step':>9}{'epilogue':>10}{'GHz':>7}", file=out)
        for k, s in a["kernels"].items():
            print(f"  {KERNELS.get(k, str(k)):<8}{s['blocks']:>7}{s['start']:>9.1f}{s['end']:>8.1f}{s['steps']:>7}"
                  f"{s['prologue']:>10.2f}{s['step']:>9.3f}{s['epilogue']:>10.2f}{s['ghz']:>7.2f}", file=out)


def plot(calls, index, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    match = [c for c in calls if c[0].get("call") == index]
    if not match:
        raise ValueError(f"no call {index} in the file")
    h, recs = match[0]
    clk = block_clocks(recs)
    t0 = min(r["g0"] for r in recs if r["kernel"] in BIG)
    colors = {1: "tab:gray", 2: "tab:blue", 3: "tab:orange", 4: "tab:green"}
    fig, ax = plt.subplots(figsize=(10, 6))
    for r in recs:
        if r["kernel"] not in BIG:
            continue
        x0 = (r["g0"] - t0) / 1e3
        pro = (r["c1"] - r["c0"]) / clk[id(r)] / 1e3
        loop = (r["c2"] - r["c1"]) / clk[id(r)] / 1e3
        epi = (r["g1"] - r["g0"]) / 1e3 - pro - loop
        ax.broken_barh([(x0, pro)], (r["sm"], 0.8), color="tab:red")
        ax.broken_barh([(x0 + pro, loop)], (r["sm"], 0.8), color=colors[r["kernel"]])
        ax.broken_barh([(x0 + pro + loop, max(epi, 0))], (r["sm"], 0.8), color="black")
    ax.set_xlabel("us from the first big block's start")
    ax.set_ylabel("SM")
    ax.set_title(f"{describe(h)}\nblue: main kernel steps, orange: part 2 steps, red: prologue, black: epilogue",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--plot", help="a Gantt chart of one call's big blocks, per SM (PNG)")
    ap.add_argument("--call", type=int, help="the call to plot (its header's number)")
    args = ap.parse_args(argv)
    try:
        calls = read(args.trace)
        if not calls:
            raise ValueError(f"{args.trace}: no traced backward")
        report(calls)
        if args.plot:
            if args.call is None:
                raise ValueError("--plot needs --call")
            plot(calls, args.call, args.plot)
    except (OSError, ValueError) as e:
        print(f"attn_timeline.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
