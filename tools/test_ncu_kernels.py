#!/usr/bin/env python3
"""Tests of tools/ncu_kernels.py. Run: python3 tools/test_ncu_kernels.py

Kernel names lose return type and arguments but keep template arguments;
the table sums launches, time and DRAM bytes per name, skips ncu's log
lines, and refuses a file without kernel rows; --batch groups a kernel's
launches in launch order."""
import os
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import ncu_kernels  # noqa: E402
from tool_tests import temp_file  # noqa: E402

HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
        '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n')


def row(i, kernel, metric, value):
    return (f'"{i}","1","c","h","{kernel}","1","7","(256,1,1)","(8,1,1)","0","9.0","Command line profiler metrics",'
            f'"{metric}","x","{value}"\n')


class NcuKernelsTest(unittest.TestCase):
    def write(self, text):
        return temp_file(self, text, ".csv")

    def test_names_keep_templates_and_drop_arguments(self):
        self.assertEqual(ncu_kernels.short_name("void norm_kernel<true, (int)8>(bf16 *, int)"),
                         "norm_kernel<true, (int)8>")
        self.assertEqual(ncu_kernels.short_name("sm90_xmma_gemm_bf16_tn"), "sm90_xmma_gemm_bf16_tn")

    def test_launches_time_and_bytes_are_summed_per_name(self):
        k = "void k<true>(int)"
        path = self.write("==PROF== Connected\nbench: log line\n" + HEAD +
                          row(0, k, "gpu__time_duration.sum", "2000") + row(0, k, "dram__bytes_read.sum", "3,000,000") +
                          row(0, k, "dram__bytes_write.sum", "1000000") + row(1, k, "gpu__time_duration.sum", "4000") +
                          row(2, "gemm", "gpu__time_duration.sum", "10000"))
        rows = ncu_kernels.read(path)
        self.assertEqual(len(rows), 3)
        out = subprocess.run([sys.executable, os.path.join(HERE, "ncu_kernels.py"), path],
                             capture_output=True, text=True, check=True).stdout
        lines = out.splitlines()
        self.assertIn("3 launches, 0.016 ms", lines[0])
        self.assertTrue(lines[2].startswith("gemm"))   # largest time first
        kline = lines[3].split()
        self.assertEqual(kline[:3], ["k<true>", "2", "0.006"])
        self.assertEqual(kline[5], "4.0")              # MB read + written
        self.assertEqual(kline[6], "667")              # GB/s over its 6 us

    def test_batch_groups_a_kernels_launches_in_launch_order(self):
        # k at launches 8, 9, 11, 12 (numeric order: 10 after 9, not after 1), gemm at 10; groups of 2:
        # k [0] is launches 8 and 9, k [1] launches 11 and 12, whatever the file's row order
        k = "void k<true>(int)"
        path = self.write(HEAD + row(12, k, "gpu__time_duration.sum", "8000") + row(8, k, "gpu__time_duration.sum", "1000") +
                          row(9, k, "gpu__time_duration.sum", "1000") + row(10, "gemm", "gpu__time_duration.sum", "500") +
                          row(11, k, "gpu__time_duration.sum", "8000"))
        out = subprocess.run([sys.executable, os.path.join(HERE, "ncu_kernels.py"), path, "--batch", "2"],
                             capture_output=True, text=True, check=True).stdout
        got = {" ".join(l.split()[:2]): l.split()[2:4] for l in out.splitlines()[2:]}
        self.assertEqual(got["k<true> [1]"], ["2", "0.016"])
        self.assertEqual(got["k<true> [0]"], ["2", "0.002"])
        self.assertEqual(got["gemm [0]"], ["1", "0.001"])

    def test_a_file_without_kernel_rows_is_refused(self):
        path = self.write("==PROF== Connected\nno table here\n")
        r = subprocess.run([sys.executable, os.path.join(HERE, "ncu_kernels.py"), path], capture_output=True, text=True)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("no kernel rows", r.stderr)


if __name__ == "__main__":
    unittest.main()
