#!/usr/bin/env python3
"""Tests of tools/attn_timeline.py. Run: python3 tools/test_attn_timeline.py

A hand-counted trace of two SMs: the six parts of the SM time add up to
SMs x span and each has the value counted by hand; the clock comes from
the long blocks; malformed files are refused with one line and rc 1."""
import io
import os
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import attn_timeline  # noqa: E402
from tool_tests import temp_file  # noqa: E402

# 2 GHz: cycles = 2 x ns. SM 0: a main block (1 us prologue, 8 us of 4
# steps, 1 us epilogue) from 0 to 10 us, idle 1 us, a part-2 block (0.5,
# 3, 0.5) to 15 us. SM 1: idle 2 us, a main block (1, 10, 1) to 14 us,
# idle 1 us. A prep block and a finish block outside the big kernels.
TRACE = """# call 7 mode centrifuge B 1 S 4096 H 32 Hkv 4 D 64 kept 2048 sms 2 records 5 lost 0
1 0 0 0 0 500 0 0 0 1000
2 0 0 4 0 10000 0 2000 18000 20000
3 5 0 2 11000 15000 100 1100 7100 8100
2 1 1 5 2000 14000 40 2040 22040 24040
4 0 1 0 15000 16000 0 0 0 2000
"""


class AttnTimelineTest(unittest.TestCase):
    def write(self, text):
        return temp_file(self, text, ".txt")

    def test_sm_time_parts_are_the_hand_counted_ones_and_add_up(self):
        (h, recs), = attn_timeline.read(self.write(TRACE))
        a = attn_timeline.account(h, recs)
        self.assertAlmostEqual(a["ghz"], 2.0)
        self.assertAlmostEqual(a["span"], 15.0)
        want = dict(steps=21.0, prologue=2.5, epilogue=2.5, handoff=1.0, head=2.0, tail=1.0)
        for k, v in want.items():
            self.assertAlmostEqual(a["acc"][k], v, msg=k)
        self.assertAlmostEqual(sum(a["acc"].values()), a["sms"] * a["span"])

    def test_each_block_runs_at_its_own_clock(self):
        # SM 1's main block at 1 GHz instead of 2: the same 1 + 10 + 1 us
        slow = TRACE.replace("2 1 1 5 2000 14000 40 2040 22040 24040", "2 1 1 5 2000 14000 40 1040 11040 12040")
        (h, recs), = attn_timeline.read(self.write(slow))
        a = attn_timeline.account(h, recs)
        self.assertAlmostEqual(a["acc"]["steps"], 21.0)
        self.assertAlmostEqual(a["acc"]["prologue"], 2.5)
        self.assertAlmostEqual(sum(a["acc"].values()), a["sms"] * a["span"])
        self.assertAlmostEqual(a["kernels"][2]["ghz"], 1.5)   # the median of 2 and 1

    def test_per_kernel_figures(self):
        (h, recs), = attn_timeline.read(self.write(TRACE))
        k = attn_timeline.account(h, recs)["kernels"]
        self.assertEqual(k[2]["blocks"], 2)
        self.assertEqual(k[2]["steps"], 9)
        self.assertAlmostEqual(k[2]["step"], 18.0 / 9)      # 8 + 10 us over 9 steps
        self.assertAlmostEqual(k[3]["step"], 1.5)
        self.assertAlmostEqual(k[4]["start"], 15.0)         # from the big kernels' start
        self.assertAlmostEqual(k[1]["end"], 0.5)

    def test_report_names_the_call_and_the_parts(self):
        out = io.StringIO()
        attn_timeline.report(attn_timeline.read(self.write(TRACE)), out)
        text = out.getvalue()
        self.assertIn("call 7: centrifuge", text)
        self.assertIn("steps 70.0%", text)   # 21 of 30 SM-us
        self.assertIn("handoff 3.3%", text)

    def test_malformed_files_are_refused_with_one_line(self):
        bad = {
            "record before header": "2 0 0 4 0 10 0 1 2 3\n",
            "short record": TRACE + "2 0 0 4 0 10\n",
            "times out of order": TRACE + "2 0 0 4 0 10 0 5 2 3\n",
            "empty": "",
        }
        for name, text in bad.items():
            r = subprocess.run([sys.executable, os.path.join(HERE, "attn_timeline.py"), self.write(text)],
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 1, name)
            self.assertEqual(len(r.stderr.strip().splitlines()), 1, name)
            self.assertTrue(r.stderr.startswith("attn_timeline.py: "), name)

    def test_plot_writes_a_png(self):
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            self.skipTest("no matplotlib")
        png = temp_file(self, "", ".png")
        self.assertEqual(attn_timeline.main([self.write(TRACE), "--plot", png, "--call", "7"]), 0)
        with open(png, "rb") as f:
            self.assertEqual(f.read(4), b"\x89PNG")


if __name__ == "__main__":
    unittest.main()
