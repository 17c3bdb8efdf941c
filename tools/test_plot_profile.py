#!/usr/bin/env python3
"""Tests of tools/plot_profile.py. Run: python3 tools/test_plot_profile.py

The reader on bench --profile text (also with gpu_session's "old "/"new "
prefix), its refusals, and a PNG written (skipped without matplotlib)."""
import os
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import plot_profile  # noqa: E402
from tool_tests import temp_file  # noqa: E402

try:
    import matplotlib  # noqa: F401
except ImportError:
    matplotlib = None

TEXT = """bench: qwen2.5-1.5b, 1543.7M params, device cuda
  2048  0.50 regular        16384    112.36     0.000    269.95     21.86    404.22    1.000    1.000
      profile regular     gemm 8.23/16.62 attention 1.26/4.86 rope 0.27/0.28  (ms fwd/bwd, one micro-batch)
new       profile centrifuge  gemm 8.19/10.04 attention 1.25/3.53 rope 0.28/0.23  (ms fwd/bwd, one micro-batch)
"""


class PlotProfileTest(unittest.TestCase):
    def write(self, text):
        return temp_file(self, text, ".txt")

    def test_reads_every_mode_and_category_with_or_without_a_prefix(self):
        rows = plot_profile.parse(self.write(TEXT))
        self.assertEqual([m for m, _ in rows], ["regular", "centrifuge"])
        self.assertEqual(rows[0][1]["attention"], (1.26, 4.86))
        self.assertEqual(rows[1][1]["gemm"], (8.19, 10.04))
        self.assertEqual(set(rows[1][1]), {"gemm", "attention", "rope"})

    def test_refuses_a_file_without_profile_lines(self):
        with self.assertRaises(ValueError):
            plot_profile.parse(self.write("bench: nothing profiled\n"))

    def test_bad_argument_and_missing_file_exit_nonzero(self):
        with self.assertRaises(SystemExit):
            plot_profile.main(["no-equals-sign", "--png", "/tmp/x.png"])
        self.assertEqual(plot_profile.main(["a=/nonexistent/file", "--png", "/tmp/x.png"]), 1)

    @unittest.skipIf(matplotlib is None, "matplotlib not installed")
    def test_writes_a_png(self):
        png = os.path.join(tempfile.mkdtemp(), "p.png")
        self.assertEqual(plot_profile.main([f"q={self.write(TEXT)}", "--png", png, "--phase", "fwd"]), 0)
        with open(png, "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")


    @unittest.skipIf(matplotlib is None, "matplotlib not installed")
    def test_an_unwritable_target_fails_with_one_line_and_leaves_nothing(self):
        d = tempfile.mkdtemp()
        png = os.path.join(d, "missing-dir", "p.png")
        self.assertEqual(plot_profile.main([f"q={self.write(TEXT)}", "--png", png]), 1)
        self.assertFalse(os.path.exists(os.path.join(d, "missing-dir")))


if __name__ == "__main__":
    unittest.main()
