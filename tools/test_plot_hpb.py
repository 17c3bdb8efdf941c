#!/usr/bin/env python3
"""Tests of tools/plot_hpb.py. Run: python3 tools/test_plot_hpb.py

A forced head count runs as the next lower divisor of the group, repeated
plans are averaged, times are relative to the fastest forced plan, the
centrifuge backward's times read apart from the full one's, the
refusals (no shape, a time before any shape, a bad shape, a shape with no
forced plan), and a PNG written (skipped without matplotlib)."""
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import plot_hpb  # noqa: E402
from tool_tests import temp_file  # noqa: E402

try:
    import matplotlib  # noqa: F401
except ImportError:
    matplotlib = None

SWEEP = """auto, S H Hkv D = 2048 24 8 128
  backward full             0.192 ms   297.2 TFLOP/s
  backward centrifuge       0.124 ms  0.578 x full
hpb 1 split 1, S H Hkv D = 2048 24 8 128
  backward full             0.212 ms   301.2 TFLOP/s
hpb 3 split 2, S H Hkv D = 2048 24 8 128
  backward full             0.190 ms   301.2 TFLOP/s
hpb 4 split 2, S H Hkv D = 2048 24 8 128
  backward full             0.194 ms   301.2 TFLOP/s
hpb 2 split 1, S H Hkv D = 2048 12 2 128 4
  backward full             0.400 ms   1 TFLOP/s
hpb 4 split 1, S H Hkv D = 2048 12 2 128 4
  backward full             0.300 ms   1 TFLOP/s
"""


class PlotHpbTest(unittest.TestCase):
    def test_forced_counts_run_as_divisors_and_repeats_average(self):
        d = plot_hpb.read_sweep(SWEEP)
        self.assertEqual(list(d), ["2048 24 8 128", "2048 12 2 128 4"])
        llama = d["2048 24 8 128"]
        self.assertEqual(sorted(llama), ["1 x 1", "3 x 2", "auto"])
        self.assertEqual(llama["3 x 2"], [0.190, 0.194])  # hpb 4 in a group of 3 is 3
        self.assertEqual(sorted(d["2048 12 2 128 4"]), ["2 x 1", "3 x 1"])  # 4 in a group of 6 is 3

    def test_times_are_relative_to_the_fastest_forced_plan(self):
        r = plot_hpb.relative(plot_hpb.read_sweep(SWEEP))
        self.assertAlmostEqual(r["2048 24 8 128"]["3 x 2"], 1.0)
        self.assertAlmostEqual(r["2048 24 8 128"]["1 x 1"], 0.212 / 0.192)
        self.assertAlmostEqual(r["2048 24 8 128"]["auto"], 0.192 / 0.192)
        self.assertAlmostEqual(r["2048 12 2 128 4"]["2 x 1"], 0.4 / 0.3)
        self.assertIn("0.212 ms", plot_hpb.table(plot_hpb.read_sweep(SWEEP)))

    def test_centrifuge_times_are_read_apart_from_the_full_ones(self):
        text = SWEEP + """hpb 1 split 2, S H Hkv D = 2048 24 8 128
  backward full             0.230 ms   1 TFLOP/s
  backward centrifuge       0.110 ms  0.5 x full
"""
        d = plot_hpb.read_sweep(text, "centrifuge")
        self.assertEqual(d, {"2048 24 8 128": {"auto": [0.124], "1 x 2": [0.110]}})
        self.assertEqual(plot_hpb.read_sweep(text)["2048 24 8 128"]["1 x 2"], [0.230])
        with self.assertRaises(plot_hpb.HpbError):
            plot_hpb.read_sweep("auto, S H Hkv D = 2048 12 2 128\n  backward full  0.1 ms\n", "centrifuge")

    def test_refusals(self):
        with self.assertRaises(plot_hpb.HpbError):
            plot_hpb.read_sweep("nothing here\n")
        with self.assertRaises(plot_hpb.HpbError):
            plot_hpb.read_sweep("  backward full   0.1 ms\n")
        with self.assertRaises(plot_hpb.HpbError):
            plot_hpb.read_sweep("auto, S H Hkv D = 2048 12 5 128\n  backward full  0.1 ms\n")
        with self.assertRaises(plot_hpb.HpbError):
            plot_hpb.relative(plot_hpb.read_sweep("auto, S H Hkv D = 2048 12 2 128\n  backward full  0.1 ms\n"))
        self.assertEqual(plot_hpb.main(["/nonexistent/attn_hpb.txt"]), 1)

    @unittest.skipIf(matplotlib is None, "no matplotlib")
    def test_png_is_written(self):
        src = temp_file(self, SWEEP, ".txt")
        png = temp_file(self, "", ".png")
        self.assertEqual(plot_hpb.main([src, "--png", png]), 0)
        with open(png, "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")


if __name__ == "__main__":
    unittest.main()
