#!/usr/bin/env python3
"""Tests of tools/plot_ab.py. Run: python3 tools/test_plot_ab.py

The medians per model and label over repeated files, the refusals (no
label, a missing file, a broken record, an unknown field, no row of the
mode), and a PNG written (skipped without matplotlib)."""
import json
import os
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import plot_ab  # noqa: E402
from tool_tests import temp_file  # noqa: E402

try:
    import matplotlib  # noqa: F401
except ImportError:
    matplotlib = None


def rec(model, mode, bwd):
    return json.dumps({"model": model, "mode": mode, "backward_s": bwd, "step_s": 2 * bwd})


class PlotAbTest(unittest.TestCase):
    def write(self, lines):
        return temp_file(self, "\n".join(lines) + "\n", ".jsonl")

    def test_medians_per_model_and_label_over_repetitions(self):
        a1 = self.write([rec("m1", "regular", 0.5), rec("m1", "centrifuge", 0.262), rec("m2", "centrifuge", 0.148)])
        a2 = self.write([rec("m1", "centrifuge", 0.264), rec("m2", "centrifuge", 0.146)])
        a3 = self.write([rec("m1", "centrifuge", 0.300)])
        b1 = self.write([rec("m1", "centrifuge", 0.247)])
        data, labels = plot_ab.read_values([f"off={a1}", f"on={b1}", f"off={a2}", f"off={a3}"], "centrifuge",
                                           "backward_s")
        self.assertEqual(labels, ["off", "on"])
        got = dict(plot_ab.medians(data, labels))
        self.assertAlmostEqual(got["m1"][0], 264.0)
        self.assertAlmostEqual(got["m1"][1], 247.0)
        self.assertAlmostEqual(got["m2"][0], 147.0)
        self.assertIsNone(got["m2"][1])

    def test_refusals(self):
        good = self.write([rec("m", "centrifuge", 0.1)])
        bad = self.write(["{not json"])
        nofield = self.write([json.dumps({"model": "m", "mode": "centrifuge"})])
        for args, field, mode, msg in [
            ([good], "backward_s", "centrifuge", "LABEL=FILE"),
            ([f"a={good}.missing"], "backward_s", "centrifuge", "missing"),
            ([f"a={bad}"], "backward_s", "centrifuge", "not a JSON record"),
            ([f"a={nofield}"], "backward_s", "centrifuge", "no numeric backward_s"),
            ([f"a={good}"], "tokens", "centrifuge", "--field tokens"),
            ([f"a={good}"], "backward_s", "regular", "no record of mode regular"),
        ]:
            with self.assertRaises(plot_ab.PlotError) as cm:
                plot_ab.read_values(args, mode, field)
            self.assertIn(msg, str(cm.exception))

    @unittest.skipIf(matplotlib is None, "matplotlib is not installed")
    def test_png_is_written(self):
        a = self.write([rec("m1", "centrifuge", 0.262)])
        b = self.write([rec("m1", "centrifuge", 0.247)])
        out = tempfile.NamedTemporaryFile(suffix=".png", delete=False).name
        self.addCleanup(os.unlink, out)
        self.assertEqual(plot_ab.main([f"off={a}", f"on={b}", "--png", out]), 0)
        with open(out, "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")


if __name__ == "__main__":
    unittest.main()
