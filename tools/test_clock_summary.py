#!/usr/bin/env python3
"""Tests of tools/clock_summary.py. Run: python3 tools/test_clock_summary.py

Samples are parsed from nvidia-smi's CSV (units and [N/A] fields
tolerated), idle samples at the start and end are left out by power, and
the throttle reasons are counted per bit."""
import gzip
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import clock_summary  # noqa: E402
from tool_tests import temp_file  # noqa: E402


def smi(sm, pw, reasons="0x0000000000000000", temp="50"):
    return f"2026/11/24 08:30:01.123, {sm} MHz, 2619 MHz, {pw} W, {temp}, {reasons}\n"


class ClockSummaryTest(unittest.TestCase):
    def test_busy_samples_only_and_their_median_clock(self):
        text = smi(345, 70.1, "0x1") + smi(1980, 650.0, "0x4") + smi(1755, 700.0, "0x6") + smi(1830, 690.5, "0x4") \
            + smi(345, 80.0, "0x1")
        s = clock_summary.summary(clock_summary.parse(text.splitlines()))
        self.assertEqual((s["samples"], s["busy"]), (5, 3))
        self.assertEqual((s["sm_median"], s["sm_min"], s["sm_max"]), (1830, 1755, 1980))
        self.assertEqual(s["power_median"], 690.5)
        self.assertAlmostEqual(s["reasons"]["app-clocks"], 1 / 3)
        self.assertEqual(s["reasons"]["sw-power-cap"], 1.0)
        self.assertNotIn("idle", s["reasons"])

    def test_lines_that_are_not_samples_and_na_fields_are_skipped(self):
        text = "garbage\n" + smi(1980, "[N/A]") + smi(1500, 400.0)
        s = clock_summary.summary(clock_summary.parse(text.splitlines()))
        self.assertEqual((s["samples"], s["sm_median"]), (1, 1500))

    def test_the_command_prints_one_line_and_fails_without_samples(self):
        good = temp_file(self, smi(1980, 600.0), ".csv")
        empty = temp_file(self, "nothing here\n", ".csv")
        self.assertEqual(clock_summary.main(["x", good, "attn"]), 0)
        self.assertEqual(clock_summary.main(["x", empty]), 1)
        self.assertEqual(clock_summary.main(["x"]), 2)
        gz = good + ".gz"
        with gzip.open(gz, "wt") as f:
            f.write(smi(1980, 600.0))
        self.addCleanup(os.unlink, gz)
        self.assertEqual(clock_summary.main(["x", gz, "gz"]), 0)
        self.assertIn("SM clock median 1980 MHz", clock_summary.line("a", clock_summary.summary(
            clock_summary.parse([smi(1980, 600.0)]))))


if __name__ == "__main__":
    unittest.main()
