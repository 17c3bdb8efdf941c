#!/usr/bin/env python3
"""Tests of tools/gpu_session.sh's argument handling (no GPU needed).
Run: python3 tools/test_gpu_session.py

An unknown part is refused before anything runs or is written; a part named
twice in one invocation writes its second run's files under PART_2/; every
invocation packs its files into one results archive."""
import os
import shutil
import subprocess
import tarfile
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "gpu_session.sh")


def run(out, *parts):
    """the script from an empty working directory (no carried binaries), with
    a stand-in nvidia-smi first on PATH"""
    work = tempfile.mkdtemp()
    try:
        bindir = os.path.join(work, "bin")
        os.makedirs(bindir)
        smi = os.path.join(bindir, "nvidia-smi")
        with open(smi, "w") as f:
            f.write("#!/bin/sh\necho 'Test GPU, 1 MiB, 0.0'\n")
        os.chmod(smi, 0o755)
        env = dict(os.environ, OUT=out, PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
        env.pop("ATTN_ENV_VAR", None)
        env.pop("ATTN_ENV_VALUES", None)
        return subprocess.run(["bash", SCRIPT, *parts], cwd=work, env=env, capture_output=True, text=True)
    finally:
        shutil.rmtree(work)


class GpuSessionTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.out = os.path.join(self.tmp, "out")

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def test_an_unknown_part_is_refused_before_anything_runs(self):
        r = run(self.out, "attn-env", "atn-env")
        self.assertEqual(r.returncode, 2)
        self.assertIn("unknown part 'atn-env'", r.stderr)
        self.assertNotIn("=== attn-env", r.stdout)  # the valid part before it did not run
        self.assertFalse(os.path.exists(self.out))  # nothing written

    def test_a_part_named_twice_writes_its_second_run_apart(self):
        # attn-env without its settings only prints why it skips: a part that needs no GPU
        r = run(self.out, "attn-env", "attn-env")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("=== attn-env", r.stdout)
        self.assertIn("(again: files under attn-env_2/)", r.stdout)
        self.assertEqual(r.stdout.count("attn-env: set ATTN_ENV_VAR"), 2)
        archives = [f for f in os.listdir(self.out) if f.startswith("results_")]
        self.assertEqual(archives, ["results_attn-env_attn-env.tgz"])
        with tarfile.open(os.path.join(self.out, archives[0])) as t:
            names = t.getnames()
        self.assertIn("./gpu.txt", names)
        self.assertIn("./attn-env_2", names)

    def test_every_part_in_the_header_list_exists(self):
        with open(SCRIPT) as f:
            text = f.read()
        header = []
        for line in text.splitlines()[:20]:
            if line.startswith("#   parts:") or (header and line.startswith("#          ")):
                header += line.replace("#   parts:", "").lstrip("#").split()
        self.assertGreater(len(header), 50)
        for part in header:
            self.assertIn(f"\n    {part})", text, part)


if __name__ == "__main__":
    unittest.main()
