#!/usr/bin/env python3
"""Tests of tools/hf_parity.py's parts that need neither torch nor a model.
Run: python3 tools/test_hf_parity.py

The greedy comparison: equal sequences pass; a differing token fails unless
transformers' two best logits were within the tie bound there, and then only
the tokens before it count; a run that stops where the other goes on fails.
The greedy column names the tokens that agreed and the stops that passed.
The eos copy rewrites config.json's eos and writes or removes
generation_config.json."""
import json
import os
import shutil
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import hf_parity  # noqa: E402


class CompareTokens(unittest.TestCase):
    def test_equal_sequences_pass_with_every_token_agreed(self):
        self.assertEqual(hf_parity.compare_tokens([1, 2, 3], [1, 2, 3], [1.0, 1.0, 1.0], 1e-3), (True, 3, None))

    def test_a_differing_token_with_a_clear_gap_fails_naming_it(self):
        ok, agreed, why = hf_parity.compare_tokens([1, 2, 9], [1, 2, 3], [1.0, 1.0, 0.5], 1e-3)
        self.assertFalse(ok)
        self.assertEqual(agreed, 2)
        self.assertIn("new token 2: centrifuge 9, transformers 3", why)

    def test_a_differing_token_at_a_tie_passes_up_to_it(self):
        ok, agreed, why = hf_parity.compare_tokens([1, 7, 8, 8], [1, 2, 3, 4], [1.0, 5e-4, 1.0, 1.0], 1e-3)
        self.assertTrue(ok)
        self.assertEqual(agreed, 1)
        self.assertIn("tie at new token 1", why)

    def test_the_tie_bound_is_strict(self):
        ok, _, _ = hf_parity.compare_tokens([5], [6], [1e-3], 1e-3)
        self.assertFalse(ok)

    def test_one_side_stopping_early_fails(self):
        ok, agreed, why = hf_parity.compare_tokens([1, 2], [1, 2, 3], [1.0, 1.0, 1.0], 1e-3)
        self.assertFalse(ok)
        self.assertEqual(agreed, 2)
        self.assertIn("centrifuge made 2 new tokens, transformers 3", why)


class GenCell(unittest.TestCase):
    def test_full_pass_tie_and_failure(self):
        full = {"ok": True, "transformers": list(range(16)), "agreed": 16, "note": None,
                hf_parity.GEN_STOPS[0]: {"ok": True}, hf_parity.GEN_STOPS[1]: {"ok": True}}
        self.assertEqual(hf_parity.gen_cell(full), "16/16 +2 stops")
        tie = {"ok": True, "transformers": list(range(16)), "agreed": 15, "note": "tie at new token 15",
               hf_parity.GEN_STOPS[0]: {"ok": True}, hf_parity.GEN_STOPS[1]: {"ok": False}}
        self.assertEqual(hf_parity.gen_cell(tie), "15/16 +1 stops (tie)")
        self.assertEqual(hf_parity.gen_cell({"ok": False}), "FAIL")
        self.assertEqual(hf_parity.gen_cell(None), "-")


class EosCopy(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="cf_test_hf_parity_")
        self.src = os.path.join(self.dir, "ckpt")
        os.makedirs(self.src)
        with open(os.path.join(self.src, "config.json"), "w") as f:
            json.dump({"eos_token_id": 2, "bos_token_id": 1, "vocab_size": 64}, f)
        with open(os.path.join(self.src, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": 2}, f)

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def read(self, d, name):
        with open(os.path.join(d, name)) as f:
            return json.load(f)

    def test_config_list_and_no_generation_config(self):
        d = hf_parity.eos_copy(self.src, os.path.join(self.dir, "a"), [63, 7], None)
        self.assertEqual(self.read(d, "config.json")["eos_token_id"], [63, 7])
        self.assertEqual(self.read(d, "config.json")["vocab_size"], 64)
        self.assertFalse(os.path.exists(os.path.join(d, "generation_config.json")))
        self.assertEqual(self.read(self.src, "config.json")["eos_token_id"], 2)   # the source is untouched

    def test_generation_config_alone_names_the_stop(self):
        d = hf_parity.eos_copy(self.src, os.path.join(self.dir, "b"), 63, [63, 7])
        self.assertEqual(self.read(d, "config.json")["eos_token_id"], 63)
        self.assertEqual(self.read(d, "generation_config.json")["eos_token_id"], [63, 7])


if __name__ == "__main__":
    unittest.main()
