#!/usr/bin/env python3
"""Tests of tools/ncu_stalls.py. Run: python3 tools/test_ncu_stalls.py

Opcodes lose predicates and their last modifiers; samples are summed per
kind and shared out of the total; ncu's log lines are skipped; a file
without the source table or without samples is refused."""
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import ncu_stalls  # noqa: E402
from tool_tests import temp_file  # noqa: E402

HEAD = '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"\n'


class NcuStallsTest(unittest.TestCase):
    def write(self, text):
        return temp_file(self, text, ".csv")

    def test_opcode_kind_drops_predicate_and_trailing_modifiers(self):
        self.assertEqual(ncu_stalls.opcode_kind("@!P0 BAR.SYNC.DEFER_BLOCKING R3, R4 ;"), "BAR.SYNC")
        self.assertEqual(ncu_stalls.opcode_kind("  HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;"), "HGMMA.64x64x16")
        self.assertEqual(ncu_stalls.opcode_kind("@UP1 EXIT ;"), "EXIT")
        self.assertEqual(ncu_stalls.opcode_kind("FADD R1, R2, R3 ;"), "FADD")

    def test_samples_are_summed_per_kind_as_shares_of_the_total(self):
        path = self.write("==PROF== log line\n" + HEAD +
                          '"0x10","BAR.SYNC.DEFER_BLOCKING 0x1, 0x120 ;","30","30"\n'
                          '"0x20","@P0 BAR.SYNC.DEFER_BLOCKING 0x3, 0x120 ;","20","20"\n'
                          '"0x30","FFMA R1, R2, R3, R4 ;","1,000","10"\n'
                          '"0x40","FFMA R5, R2, R3, R4 ;","-","0"\n')
        rows = ncu_stalls.read_rows(path)
        self.assertEqual([r["samples"] for r in rows], [30, 20, 1000, 0])
        text = ncu_stalls.summarize(rows, 5)
        self.assertIn("1050 samples over 4 instructions", text)
        self.assertIn(" 95.2%  FFMA", text)
        self.assertIn("  4.8%  BAR.SYNC", text)
        self.assertLess(text.index("FFMA"), text.index("BAR.SYNC"))

    def test_a_file_without_the_table_or_without_samples_is_refused(self):
        with self.assertRaises(ValueError):
            ncu_stalls.read_rows(self.write('"ID","Kernel Name"\n"1","k"\n'))
        rows = ncu_stalls.read_rows(self.write(HEAD + '"0x10","NOP ;","0","0"\n'))
        with self.assertRaises(ValueError):
            ncu_stalls.summarize(rows, 5)
        self.assertEqual(ncu_stalls.main([self.write("nothing\n")]), 1)


if __name__ == "__main__":
    unittest.main()
