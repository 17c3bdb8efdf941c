#!/usr/bin/env python3
"""A/B bars of `centrifuge bench --json` records: one stage time per model
and variant, the median over the variant's files (alternated repetitions).

Each input is LABEL=FILE; a label may be given several times (its files are
the repetitions). For every model found, one group of bars: the median of
--field (default backward_s, shown in ms per optimizer step) of the rows of
--mode (default centrifuge) in each label's files, with the single values
as dots. Labels keep their first-seen order. PNG (needs matplotlib).

Example (run 17, the MLP's weight-gradient pairs off and on):
  python3 tools/plot_ab.py off=docs/data/gpu-run17/call2_h100_tests_pairab/pair0_llama3.2-3b_r1.jsonl \\
      off=...pair0_llama3.2-3b_r2.jsonl on=...pair1_llama3.2-3b_r1.jsonl ... --png docs/gpu_run17_pairs.png
"""
import argparse
import json
import statistics
import sys

FIELDS = {"backward_s", "forward_s", "filter_s", "optimizer_s", "step_s"}


class PlotError(Exception):
    pass


def read_values(pairs, mode, field):
    """{model: {label: [value ms, ...]}} and the labels in first-seen order."""
    if field not in FIELDS:
        raise PlotError(f"--field {field}: one of {', '.join(sorted(FIELDS))}")
    data, labels = {}, []
    for arg in pairs:
        label, sep, path = arg.partition("=")
        if not sep or not label or not path:
            raise PlotError(f"{arg}: expected LABEL=FILE")
        if label not in labels:
            labels.append(label)
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError as e:
            raise PlotError(f"{path}: {e.strerror}")
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                raise PlotError(f"{path}:{n}: not a JSON record")
            if rec.get("mode") != mode:
                continue
            if not isinstance(rec.get(field), (int, float)) or "model" not in rec:
                raise PlotError(f"{path}:{n}: no numeric {field} or no model")
            data.setdefault(rec["model"], {}).setdefault(label, []).append(1e3 * rec[field])
    if not data:
        raise PlotError(f"no record of mode {mode} in the inputs")
    return data, labels


def medians(data, labels):
    """[(model, [median or None per label])]"""
    return [(model, [statistics.median(v[l]) if l in v else None for l in labels]) for model, v in data.items()]


def plot(data, labels, mode, field, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = medians(data, labels)
    fig, ax = plt.subplots(figsize=(1.6 + 1.9 * len(rows), 3.6))
    width = 0.8 / len(labels)
    for j, label in enumerate(labels):
        xs = [i + (j - (len(labels) - 1) / 2) * width for i in range(len(rows))]
        ys = [m[j] if m[j] is not None else 0 for _, m in rows]
        bars = ax.bar(xs, ys, width * 0.9, label=label)
        for x, y in zip(xs, ys):
            if y:
                ax.annotate(f"{y:.1f}", (x, y), ha="center", va="bottom", fontsize=8)
        for x, (model, _) in zip(xs, rows):
            vals = data[model].get(label, [])
            ax.plot([x] * len(vals), vals, "k.", markersize=3)
        del bars
    ax.set_xticks(range(len(rows)), [model for model, _ in rows])
    ax.set_ylabel(f"{field[:-2]} ms per step ({mode})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", help="LABEL=FILE (bench --json records)")
    ap.add_argument("--mode", default="centrifuge", help="rows of this mode (default centrifuge)")
    ap.add_argument("--field", default="backward_s", help="stage time field (default backward_s)")
    ap.add_argument("--png", required=True, help="output PNG")
    a = ap.parse_args(argv)
    try:
        data, labels = read_values(a.inputs, a.mode, a.field)
        for model, ms in medians(data, labels):
            print(f"{model:>20}  " + "  ".join(f"{l} {m:.2f}" if m is not None else f"{l} -" for l, m in zip(labels, ms)))
        plot(data, labels, a.mode, a.field, a.png)
    except PlotError as e:
        print(f"plot_ab: {e}", file=sys.stderr)
        return 1
    except ImportError:
        print("plot_ab: matplotlib is needed for the PNG", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
