#!/usr/bin/env python3
"""Tests of tools/plot_mfu_clock.py. Run: python3 tools/test_plot_mfu_clock.py

A call folder's clock and regular-row MFU are paired by model (PyTorch's
tables and models without a clock line are left out), the line through the
points is the least-squares one, and a folder without data is an error."""
import io
import os
import shutil
import sys
import tempfile
import unittest
from contextlib import redirect_stderr, redirect_stdout

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import plot_mfu_clock  # noqa: E402

CLOCKS = ("ours tinyllama-1.1b: 272 busy of 472 samples: SM clock median 1650 MHz (1485-1965), power median 688 W\n"
          "PyTorch tinyllama-1.1b: 324 busy of 677 samples: SM clock median 1965 MHz (1935-1980)\n"
          "ours qwen2.5-1.5b: 189 busy of 477 samples: SM clock median 1635 MHz (1440-1965)\n")
OURS = ("   seq  keep mode            kept    fwd ms filter ms    bwd ms    opt ms   step ms  bwd/reg step/reg\n"
        "  4096  0.50 regular        32768    151.74     0.000    306.31      9.50    466.88    1.000    1.000"
        "     70185 tok/s MFU 51.9% peak 29.91 GiB\n"
        "  4096  0.50 centrifuge     16384    149.06     3.715    151.40     10.47    315.06    0.494    0.675"
        "    104006 tok/s MFU 76.9% peak 29.91 GiB\n")
PT = "  4096  1.00 regular      32768    240.50    465.93      8.37    714.71      45848     17.35  33.9%\n"


class PlotMfuClockTest(unittest.TestCase):
    def folder(self, files):
        d = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, d)
        for name, text in files.items():
            with open(os.path.join(d, name), "w") as f:
                f.write(text)
        return d

    def test_ours_regular_mfu_paired_with_ours_clock_by_model(self):
        d = self.folder({"clocks.txt": CLOCKS, "bench_accum8_tinyllama-1.1b_4096.txt": OURS,
                         "bench_accum8_tinyllama-1.1b_4096_pt.txt": PT,
                         "bench_accum8_llama3.2-3b_2048.txt": OURS})  # no clock line: left out
        self.assertEqual(plot_mfu_clock.read_call(d), {"tinyllama-1.1b": (1650.0, 51.9)})

    def test_least_squares_line(self):
        a, b = plot_mfu_clock.fit([(1500, 49.0), (1600, 51.0), (1700, 53.0)])
        self.assertAlmostEqual(b, 0.02)
        self.assertAlmostEqual(a + b * 1550, 50.0)
        self.assertIsNone(plot_mfu_clock.fit([(1500, 49.0)]))
        self.assertIsNone(plot_mfu_clock.fit([(1500, 49.0), (1500, 50.0)]))

    def test_folders_without_data_fail_with_one_line(self):
        d = self.folder({"clocks.txt": CLOCKS})
        err = io.StringIO()
        with redirect_stdout(io.StringIO()), redirect_stderr(err):
            self.assertEqual(plot_mfu_clock.main([d]), 1)
            self.assertEqual(plot_mfu_clock.main([os.path.join(d, "missing")]), 1)
        self.assertEqual(len(err.getvalue().strip().splitlines()), 2)


if __name__ == "__main__":
    unittest.main()
