#!/usr/bin/env python3
"""Tests of tools/plot_log.py. Run: python3 tools/test_plot_log.py

Writes tiny `train --log` files (two runs, validation lines, a resumed run
that repeats steps, a skipped step with a non-finite loss as C prints it),
plots them, and checks the PNGs. The plotting tests skip, with a message,
when matplotlib is not installed; the reader tests always run.
"""
import io
import json
import os
import shutil
import sys
import tempfile
import unittest
from contextlib import redirect_stderr, redirect_stdout

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import plot_log  # noqa: E402

try:
    import matplotlib  # noqa: F401
except ImportError:
    matplotlib = None

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def step_line(step, loss, val=None, skipped=0, tps=5000.0):
    rec = {"step": step, "loss": loss, "kept": 32, "tokens": 64, "lr": 1e-3, "grad_norm": 1.0,
           "tokens_per_s": tps, "forward_s": 0.01, "filter_s": 0.0005, "backward_s": 0.02,
           "optimizer_s": 0.005, "step_s": 0.036, "skipped": skipped}
    if val is not None:
        rec["val_loss"] = val
    return json.dumps(rec)


class PlotLogTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="cf_plot_log_")
        self.a = os.path.join(self.dir, "regular.jsonl")
        self.b = os.path.join(self.dir, "centrifuge.jsonl")
        with open(self.a, "w") as f:
            for s in range(1, 21):
                f.write(step_line(s, 5.0 - 0.1 * s, val=(4.0 - 0.05 * s) if s % 5 == 0 else None) + "\n")
        with open(self.b, "w") as f:
            for s in range(1, 13):
                f.write(step_line(s, 5.0 - 0.12 * s, tps=8000.0) + "\n")
            # a non-finite step, as printf writes it, then a resume from step 10
            f.write(step_line(13, 0.0).replace('"loss": 0.0', '"loss": -nan').replace('"skipped": 0', '"skipped": 1') + "\n")
            for s in range(10, 21):
                f.write(step_line(s, 4.0 - 0.1 * s, tps=8000.0) + "\n")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def test_reader_keeps_the_last_line_of_a_step_and_reads_nan(self):
        recs = plot_log.read_log(self.b)
        self.assertEqual([r["step"] for r in recs], list(range(1, 21)))
        self.assertAlmostEqual(recs[9]["loss"], 4.0 - 1.0)   # step 10 from the resumed run
        b = plot_log.read_log(self.b)
        self.assertTrue(all(r["step"] != 13 or r["skipped"] == 0 for r in b))  # step 13 rewritten

    def test_bad_lines_name_the_file_and_line(self):
        bad = os.path.join(self.dir, "bad.jsonl")
        with open(bad, "w") as f:
            f.write(step_line(1, 3.0) + "\nthis is not json\n")
        with self.assertRaises(plot_log.LogError) as cm:
            plot_log.read_log(bad)
        self.assertIn("bad.jsonl:2", str(cm.exception))
        empty = os.path.join(self.dir, "empty.jsonl")
        open(empty, "w").close()
        err = io.StringIO()
        with redirect_stderr(err):
            self.assertEqual(plot_log.main([empty, "--out", self.dir]), 1)
        self.assertIn("no steps", err.getvalue())
        with redirect_stderr(io.StringIO()):
            self.assertEqual(plot_log.main([self.a, "--labels", "x,y", "--out", self.dir]), 2)

    @unittest.skipIf(matplotlib is None, "matplotlib not installed")
    def test_writes_loss_and_throughput_pngs(self):
        out = os.path.join(self.dir, "plots")
        buf = io.StringIO()
        with redirect_stdout(buf):
            rc = plot_log.main([self.a, self.b, "--out", out, "--smooth", "3"])
        self.assertEqual(rc, 0)
        for name in ("loss.png", "throughput.png"):
            path = os.path.join(out, name)
            self.assertTrue(os.path.exists(path), path)
            with open(path, "rb") as f:
                head = f.read(8)
            self.assertEqual(head, PNG_MAGIC)
            self.assertGreater(os.path.getsize(path), 5000)
            self.assertIn(path, buf.getvalue())

    @unittest.skipIf(matplotlib is None, "matplotlib not installed")
    def test_tokens_axis_and_default_out_dir(self):
        with redirect_stdout(io.StringIO()):
            self.assertEqual(plot_log.main([self.a, "--x", "tokens"]), 0)
        self.assertTrue(os.path.exists(os.path.join(self.dir, "loss.png")))


if __name__ == "__main__":
    if matplotlib is None:
        print("test_plot_log: matplotlib not installed; the plotting tests are skipped")
    unittest.main()
