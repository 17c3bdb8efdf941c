#!/usr/bin/env python3
"""Tests of tools/prepare_data.py. Run: python3 tools/test_prepare_data.py

Trains a small byte-level BPE tokenizer with the `tokenizers` package, runs
prepare_data on JSONL and text inputs, and checks that the shards read back
(header, dtype, token ids) and decode to the original documents. Skips, with
a message and exit status 0, when `tokenizers` is not installed.
"""
import array
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest


def load_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

try:
    import tokenizers  # noqa: F401
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
except ImportError:
    tokenizers = None

import prepare_data  # noqa: E402  (standard library only at import time)

DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "Centrifuge trains Llama-family models with token filtering.",
    "Line one of a document\nwith a second line, and unicode: naïve café – ok.",
    "2 + 3 = 5, 7 * 6 = 42; numbers and symbols {}[]()!",
    "Short.",
    "A longer document " + " ".join("word%d" % i for i in range(200)),
] + ["Document number %d says hello to the shards." % i for i in range(40)]


def read_shard(path):
    with open(path, "rb") as f:
        raw = f.read()
    header = array.array("i")
    header.frombytes(raw[:1024])
    if sys.byteorder != "little":
        header.byteswap()
    body = array.array("H" if header[1] == 1 else "I")
    body.frombytes(raw[1024:])
    if sys.byteorder != "little":
        body.byteswap()
    return list(header), list(body)


def train_bpe(path, vocab_size=300):
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(iter(DOCS * 3), trainer=trainer)
    tok.save(path)
    return tok


@unittest.skipIf(tokenizers is None, "tokenizers is not installed")
class PrepareDataTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="cf_prep_test_")
        self.tok_path = os.path.join(self.dir, "tokenizer.json")
        self.tok = train_bpe(self.tok_path)
        self.eos = self.tok.token_to_id("<|endoftext|>")
        self.bos = self.tok.token_to_id("<s>")
        self.jsonl = os.path.join(self.dir, "docs.jsonl")
        with open(self.jsonl, "w", encoding="utf-8") as f:
            for d in DOCS:
                f.write(json.dumps({"id": 1, "text": d}) + "\n")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def run_tool(self, *argv):
        return prepare_data.main(["--quiet", *argv])

    def all_tokens(self, out, name, split):
        man = load_json(os.path.join(out, name + "_manifest.json"))
        toks = []
        for sh in man[split]["shards"]:
            header, body = read_shard(os.path.join(out, sh["file"]))
            self.assertEqual(header[0], 20240520)
            self.assertEqual(header[2], len(body))
            self.assertEqual(header[2], sh["tokens"])
            self.assertTrue(all(h == 0 for h in header[3:]))
            toks += body
        self.assertEqual(len(toks), man[split]["tokens"])
        return man, toks

    def split_docs(self, toks, sep):
        docs, cur = [], []
        for t in toks:
            if t == sep:
                docs.append(cur)
                cur = []
            else:
                cur.append(t)
        self.assertEqual(cur, [], "stream must end with the separator")
        return docs

    def test_jsonl_roundtrip_with_eos(self):
        out = os.path.join(self.dir, "out")
        self.assertEqual(self.run_tool("--tokenizer", self.tok_path, "--out-dir", out, "--name", "c", self.jsonl), 0)
        man, toks = self.all_tokens(out, "c", "train")
        self.assertEqual(man["dtype"], "uint16")
        self.assertEqual(man["eos"]["id"], self.eos)
        header, _ = read_shard(os.path.join(out, "c_train_000000.bin"))
        self.assertEqual(header[1], 1)
        docs = self.split_docs(toks, self.eos)
        self.assertEqual([self.tok.decode(d) for d in docs], DOCS)
        self.assertEqual(man["val"]["shards"], [])
        self.assertFalse([n for n in os.listdir(out) if n.endswith(".tmp")])

    def test_bos_and_no_eos(self):
        out = os.path.join(self.dir, "out")
        self.assertEqual(self.run_tool("--tokenizer", self.dir, "--out-dir", out, "--prepend-bos", "--no-eos",
                                       "--bos-token", "<s>", self.jsonl), 0)
        _, toks = self.all_tokens(out, "data", "train")
        self.assertEqual(toks[0], self.bos)
        self.assertNotIn(self.eos, toks)
        docs = [d for d in self.split_docs(toks[1:] + [self.bos], self.bos)]
        self.assertEqual([self.tok.decode(d) for d in docs], DOCS)

    def test_val_split_and_shard_limit(self):
        out = os.path.join(self.dir, "out")
        self.assertEqual(self.run_tool("--tokenizer", self.tok_path, "--out-dir", out, "--val-fraction", "0.3",
                                       "--max-tokens-per-shard", "97", "--seed", "5", self.jsonl), 0)
        man, train = self.all_tokens(out, "data", "train")
        _, val = self.all_tokens(out, "data", "val")
        self.assertGreater(len(man["train"]["shards"]), 1)
        for split in ("train", "val"):
            counts = [s["tokens"] for s in man[split]["shards"]]
            self.assertTrue(all(c == 97 for c in counts[:-1]) and 0 < counts[-1] <= 97, counts)
        tdocs = [self.tok.decode(d) for d in self.split_docs(train, self.eos)]
        vdocs = [self.tok.decode(d) for d in self.split_docs(val, self.eos)]
        self.assertEqual(vdocs[0], DOCS[0])  # the first document always goes to val
        self.assertEqual(sorted(tdocs + vdocs), sorted(DOCS))
        self.assertEqual(len(tdocs), man["documents"]["train"])
        self.assertTrue(0 < len(vdocs) < len(DOCS))
        # same seed, same split
        out2 = os.path.join(self.dir, "out2")
        self.run_tool("--tokenizer", self.tok_path, "--out-dir", out2, "--val-fraction", "0.3",
                      "--max-tokens-per-shard", "97", "--seed", "5", self.jsonl)
        self.assertEqual(self.all_tokens(out2, "data", "val")[1], val)

    def test_text_splits_and_gzip(self):
        txt = os.path.join(self.dir, "a.txt.gz")
        with gzip.open(txt, "wt", encoding="utf-8") as f:
            f.write("para one line a\npara one line b\n\n\npara two\n")
        out = os.path.join(self.dir, "blank")
        self.assertEqual(self.run_tool("--tokenizer", self.tok_path, "--out-dir", out, "--text-split", "blank", txt), 0)
        _, toks = self.all_tokens(out, "data", "train")
        self.assertEqual([self.tok.decode(d) for d in self.split_docs(toks, self.eos)],
                         ["para one line a\npara one line b", "para two"])
        out = os.path.join(self.dir, "line")
        self.assertEqual(self.run_tool("--tokenizer", self.tok_path, "--out-dir", out, "--text-split", "line", txt), 0)
        _, toks = self.all_tokens(out, "data", "train")
        self.assertEqual(len(self.split_docs(toks, self.eos)), 3)
        delim = os.path.join(self.dir, "d.txt")
        with open(delim, "w", encoding="utf-8") as f:
            f.write("first doc<|endoftext|>second doc<|endoftext|>")
        out = os.path.join(self.dir, "delim")
        self.assertEqual(self.run_tool("--tokenizer", self.tok_path, "--out-dir", out,
                                       "--delimiter", "<|endoftext|>", delim), 0)
        _, toks = self.all_tokens(out, "data", "train")
        self.assertEqual([self.tok.decode(d) for d in self.split_docs(toks, self.eos)], ["first doc", "second doc"])

    def test_uint32_for_large_vocab(self):
        vocab = {"[UNK]": 0, "<|endoftext|>": 1}
        for i in range(70000):
            vocab["w%d" % i] = len(vocab)
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        path = os.path.join(self.dir, "big.json")
        tok.save(path)
        src = os.path.join(self.dir, "big.jsonl")
        with open(src, "w") as f:
            f.write(json.dumps({"body": "w0 w69999 w65535 w65536"}) + "\n")
        out = os.path.join(self.dir, "big")
        self.assertEqual(self.run_tool("--tokenizer", path, "--out-dir", out, "--field", "body", src), 0)
        man, toks = self.all_tokens(out, "data", "train")
        self.assertEqual(man["dtype"], "uint32")
        header, _ = read_shard(os.path.join(out, "data_train_000000.bin"))
        self.assertEqual(header[1], 2)
        self.assertEqual(toks, [2, 70001, 65537, 65538, 1])

    def test_errors(self):
        out = os.path.join(self.dir, "err")

        def listing():
            return sorted(os.listdir(out)) if os.path.isdir(out) else []

        def fails(*argv, expect, usage=False):
            before = listing()
            proc = subprocess.run([sys.executable, os.path.join(HERE, "prepare_data.py"), *argv],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self.assertNotEqual(proc.returncode, 0, argv)
            lines = proc.stderr.strip().splitlines()
            self.assertIn(expect, lines[-1] if lines else "")
            if not usage:  # a data error is one line; argparse's come after the usage text
                self.assertEqual(len(lines), 1, proc.stderr)
            self.assertEqual(listing(), before, "a failed run must leave the output as it was")

        fails("--tokenizer", os.path.join(self.dir, "nope.json"), "--out-dir", out, self.jsonl,
              expect="tokenizer file not found")
        bad = os.path.join(self.dir, "bad.json")
        with open(bad, "w") as f:
            f.write("{not json")
        fails("--tokenizer", bad, "--out-dir", out, self.jsonl, expect="not a valid tokenizer.json")
        fails("--tokenizer", self.tok_path, "--out-dir", out, os.path.join(self.dir, "missing.jsonl"),
              expect="input file not found")
        broken = os.path.join(self.dir, "broken.jsonl")
        with open(broken, "w") as f:
            f.write('{"text": "ok"}\n{"text": \n')
        fails("--tokenizer", self.tok_path, "--out-dir", out, broken, expect="broken.jsonl:2: not valid JSON")
        fails("--tokenizer", self.tok_path, "--out-dir", out, "--field", "body", self.jsonl,
              expect="has no field 'body'")
        fails("--tokenizer", self.tok_path, "--out-dir", out, "--eos-token", "<nope>", self.jsonl,
              expect="is not in the tokenizer's vocabulary")
        fails("--tokenizer", self.tok_path, "--out-dir", out, "--val-fraction", "1.5", self.jsonl,
              expect="--val-fraction", usage=True)
        latin = os.path.join(self.dir, "latin1.txt")
        with open(latin, "wb") as f:
            f.write(b"caf\xe9\n")
        fails("--tokenizer", self.tok_path, "--out-dir", out, latin, expect="not UTF-8")
        # an error after full shards were written removes them again
        late = os.path.join(self.dir, "late.jsonl")
        with open(late, "w") as f:
            for d in DOCS:
                f.write(json.dumps({"text": d}) + "\n")
            f.write("oops\n")
        fails("--tokenizer", self.tok_path, "--out-dir", out, "--max-tokens-per-shard", "10", "--batch-docs", "2",
              late, expect="late.jsonl:%d: not valid JSON" % (len(DOCS) + 1))
        # --skip-bad turns the bad lines into a count
        self.assertEqual(self.run_tool("--tokenizer", self.tok_path, "--out-dir", out, "--skip-bad", broken), 0)
        man = load_json(os.path.join(out, "data_manifest.json"))
        self.assertEqual((man["skipped_bad"], man["documents"]["train"]), (1, 1))
        # an existing set of shards is not mixed into
        fails("--tokenizer", self.tok_path, "--out-dir", out, self.jsonl, expect="--overwrite")
        self.assertEqual(self.run_tool("--tokenizer", self.tok_path, "--out-dir", out, "--overwrite", self.jsonl), 0)
        self.assertFalse([n for n in os.listdir(out) if n.endswith(".tmp")])

    def test_centrifuge_reads_the_shard(self):
        """If the engine is built, `centrifuge eval` accepts the shard."""
        binary = os.path.join(os.path.dirname(HERE), "centrifuge")
        if not os.access(binary, os.X_OK):
            self.skipTest("centrifuge is not built")
        out = os.path.join(self.dir, "out")
        self.run_tool("--tokenizer", self.tok_path, "--out-dir", out, self.jsonl)
        shard = os.path.join(out, "data_train_000000.bin")
        # config `tiny` has vocab 320 >= this tokenizer's 300
        proc = subprocess.run([binary, "eval", "--config", "tiny", "--data", shard, "--batch", "1", "--seq", "32",
                               "--max-batches", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.assertEqual(proc.returncode, 0, proc.stdout)
        self.assertIn("eval: 64 tokens", proc.stdout)


if __name__ == "__main__":
    if tokenizers is None:
        print("test_prepare_data: skipped: the 'tokenizers' package is not installed (pip install tokenizers)")
        sys.exit(0)
    unittest.main(verbosity=2)
