#!/usr/bin/env python3
"""Tokenize text or JSONL into centrifuge token shards.

Reads documents from plain-text or JSONL files (optionally .gz), tokenizes
them with a Hugging Face `tokenizer.json` (the `tokenizers` package), adds
EOS after each document (default) and/or BOS before it, and writes
llm.c-compatible token shards, the format `centrifuge train --data` reads
(src/io.h): a header of 256 little-endian int32 [20240520, version, count,
0, ...] followed by the tokens, uint16 (version 1) when the vocabulary has
at most 65536 ids, else uint32 (version 2).

Documents are split between a validation and a training set (--val-fraction,
decided per document by a seeded RNG; the first document always goes to
validation when the fraction is > 0, so the set is never empty). Each set is
cut into shards of at most --max-tokens-per-shard tokens (a document may span
two shards; the loader reads shards as one stream):

  OUT_DIR/PREFIX_val_000000.bin, OUT_DIR/PREFIX_train_000000.bin, ...
  OUT_DIR/PREFIX_manifest.json     (shards, counts, tokenizer, special ids)

Every file is written to a temporary name in OUT_DIR and moved into place
with os.replace, so a crash never leaves a truncated shard under its name.

Text input (--format text): --text-split picks what a document is: the
whole file (default), each line, paragraphs separated by blank lines, or the
pieces between a --delimiter string such as '<|endoftext|>'.
JSONL input (--format jsonl): one JSON object per line, the document in
--field (default "text").

The tokenizer's own post-processor (e.g. one that adds BOS) is not applied:
special tokens come only from --eos/--bos, so they are never doubled. Use
--prepend-bos for `centrifuge train --doc-mask` (a BOS starts a document).

Examples:
  python3 tools/prepare_data.py --tokenizer tok/tokenizer.json --out-dir data --name corpus \\
      --format jsonl --field text corpus.jsonl.gz
  python3 tools/prepare_data.py --tokenizer tok/ --out-dir data --text-split blank --prepend-bos a.txt b.txt
"""
import argparse
import array
import gzip
import io
import json
import os
import random
import sys
import tempfile
import time

TOKENS_MAGIC = 20240520
HEADER_INTS = 256
MAX_SHARD_TOKENS = 2**31 - 1          # the header's count is an int32
DEFAULT_SHARD_TOKENS = 100_000_000     # as llm.c's data scripts
EOS_GUESSES = ["<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]"]
BOS_GUESSES = ["<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[CLS]"]


class DataError(Exception):
    """A user-facing error: one line naming the file and the problem."""


# ---------------------------------------------------------------- tokenizer

def load_tokenizer(path):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError("the 'tokenizers' package is not installed (pip install tokenizers)")
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise DataError("%s: tokenizer file not found (give a tokenizer.json or the directory holding it)" % path)
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises its own Exception type
        raise DataError("%s: not a valid tokenizer.json: %s" % (path, str(e).splitlines()[0][:200]))
    return tok, path


def special_from_config(tok_path, key):
    """eos_token / bos_token from a tokenizer_config.json beside tokenizer.json."""
    cfg = os.path.join(os.path.dirname(os.path.abspath(tok_path)), "tokenizer_config.json")
    try:
        with open(cfg, encoding="utf-8") as f:
            val = json.load(f).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(val, dict):
        val = val.get("content")
    return val if isinstance(val, str) and val else None


def resolve_special(tok, tok_path, kind, token, token_id, guesses):
    """The id of the BOS or EOS token: --X-id, else --X-token, else the
    tokenizer_config.json beside the tokenizer, else a well-known name."""
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if token_id is not None:
        if not 0 <= token_id < vocab:
            raise DataError("--%s-id %d is outside the tokenizer's vocabulary [0, %d)" % (kind, token_id, vocab))
        return token_id, tok.id_to_token(token_id)
    if token is not None:
        i = tok.token_to_id(token)
        if i is None:
            raise DataError("%s: --%s-token %r is not in the tokenizer's vocabulary" % (tok_path, kind, token))
        return i, token
    name = special_from_config(tok_path, "%s_token" % kind)
    if name is not None and tok.token_to_id(name) is not None:
        return tok.token_to_id(name), name
    for name in guesses:
        if tok.token_to_id(name) is not None:
            return tok.token_to_id(name), name
    raise DataError("%s: cannot tell the %s token; give --%s-token or --%s-id%s"
                    % (tok_path, kind.upper(), kind, kind, " (or --no-eos)" if kind == "eos" else ""))


# ------------------------------------------------------------------- input

def open_text(path):
    if not os.path.isfile(path):
        raise DataError("%s: input file not found" % path)
    try:
        if path.endswith(".gz"):
            return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="strict")
        return open(path, "r", encoding="utf-8", errors="strict")
    except OSError as e:
        raise DataError("%s: cannot open: %s" % (path, e.strerror or e))


def guess_format(path):
    p = path[:-3] if path.endswith(".gz") else path
    return "jsonl" if p.endswith((".jsonl", ".json", ".ndjson")) else "text"


def iter_documents(path, args):
    """Yields (doc_text, where) for one input file."""
    fmt = args.format if args.format != "auto" else guess_format(path)
    f = open_text(path)
    try:
        if fmt == "jsonl":
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    if args.skip_bad:
                        args.stats["bad"] += 1
                        continue
                    raise DataError("%s:%d: not valid JSON (%s)" % (path, n, e))
                val = obj.get(args.field) if isinstance(obj, dict) else None
                if not isinstance(val, str):
                    if args.skip_bad:
                        args.stats["bad"] += 1
                        continue
                    what = "is not a JSON object" if not isinstance(obj, dict) else \
                        ("has no field %r" % args.field if args.field not in obj else
                         "field %r is %s, not a string" % (args.field, type(val).__name__))
                    raise DataError("%s:%d: %s (use --field, or --skip-bad)" % (path, n, what))
                yield val, "%s:%d" % (path, n)
        elif args.text_split == "file":
            yield f.read(), path
        elif args.text_split == "line":
            for n, line in enumerate(f, 1):
                line = line.rstrip("\r\n")
                if line.strip():
                    yield line, "%s:%d" % (path, n)
        elif args.text_split == "blank":
            buf, start = [], 1
            for n, line in enumerate(f, 1):
                if line.strip():
                    if not buf:
                        start = n
                    buf.append(line)
                elif buf:
                    yield "".join(buf).rstrip("\r\n"), "%s:%d" % (path, start)
                    buf = []
            if buf:
                yield "".join(buf).rstrip("\r\n"), "%s:%d" % (path, start)
        else:  # delimiter
            delim, rest = args.delimiter, ""
            while True:
                chunk = f.read(1 << 20)
                if not chunk:
                    break
                rest += chunk
                parts = rest.split(delim)
                rest = parts.pop()
                for p in parts:
                    yield p, path
            yield rest, path
    except UnicodeDecodeError as e:
        raise DataError("%s: not UTF-8 text (%s)" % (path, e.reason))
    except (OSError, EOFError) as e:
        raise DataError("%s: read error: %s" % (path, e))
    finally:
        f.close()


# ----------------------------------------------------------------- output

class ShardWriter:
    """Accumulates tokens of one split and writes full shards atomically."""

    def __init__(self, out_dir, prefix, split, width, max_tokens):
        self.out_dir, self.prefix, self.split = out_dir, prefix, split
        self.code = "H" if width == 2 else "I"   # array "I": 4 bytes on all common platforms
        self.version = 1 if width == 2 else 2
        self.max_tokens = max_tokens
        self.buf = array.array(self.code)
        self.shards = []  # (file name, token count)
        self.total = 0

    def add(self, ids):
        self.buf.extend(ids)
        self.total += len(ids)
        while len(self.buf) >= self.max_tokens:
            head = self.buf[: self.max_tokens]
            del self.buf[: self.max_tokens]
            self._write(head)

    def close(self):
        if len(self.buf):
            self._write(self.buf)
            self.buf = array.array(self.code)

    def _write(self, toks):
        name = "%s_%s_%06d.bin" % (self.prefix, self.split, len(self.shards))
        header = array.array("i", [0] * HEADER_INTS)
        header[0], header[1], header[2] = TOKENS_MAGIC, self.version, len(toks)
        body = toks
        if sys.byteorder != "little":
            header.byteswap()
            body = array.array(self.code, toks)
            body.byteswap()
        atomic_write(os.path.join(self.out_dir, name), [header.tobytes(), body.tobytes()])
        self.shards.append((name, len(toks)))


def atomic_write(path, chunks):
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# ------------------------------------------------------------------- main

def run(args):
    tok, tok_path = load_tokenizer(args.tokenizer)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if vocab < 1:
        raise DataError("%s: the tokenizer has an empty vocabulary" % tok_path)
    width = 2 if vocab <= 65536 else 4
    eos = bos = None
    if not args.no_eos:
        eos = resolve_special(tok, tok_path, "eos", args.eos_token, args.eos_id, EOS_GUESSES)
    if args.prepend_bos:
        bos = resolve_special(tok, tok_path, "bos", args.bos_token, args.bos_id, BOS_GUESSES)
    for p in args.inputs:
        if not os.path.isfile(p):
            raise DataError("%s: input file not found" % p)
    os.makedirs(args.out_dir, exist_ok=True)
    # Refuse to mix with shards of an earlier run under the same prefix.
    stale = [n for n in os.listdir(args.out_dir)
             if n.startswith(args.name + "_") and n.endswith(".bin") and ("_train_" in n or "_val_" in n)]
    if stale and not args.overwrite:
        raise DataError("%s: already holds shards named %s_*.bin (e.g. %s); use --overwrite or another --name"
                        % (args.out_dir, args.name, sorted(stale)[0]))
    for n in stale:
        os.unlink(os.path.join(args.out_dir, n))

    train = ShardWriter(args.out_dir, args.name, "train", width, args.max_tokens_per_shard)
    val = ShardWriter(args.out_dir, args.name, "val", width, args.max_tokens_per_shard)
    rng = random.Random(args.seed)
    args.stats = {"bad": 0, "empty": 0}
    ndocs = {"train": 0, "val": 0}
    t0 = time.time()
    last = t0

    def flush(batch):
        encs = tok.encode_batch(batch, add_special_tokens=False)
        for enc in encs:
            ids = list(enc.ids)
            if ids and max(ids) >= vocab:
                raise DataError("%s: the tokenizer produced id %d, beyond its vocabulary size %d"
                                % (tok_path, max(ids), vocab))
            if bos:
                ids.insert(0, bos[0])
            if eos:
                ids.append(eos[0])
            first = ndocs["train"] + ndocs["val"] == 0
            to_val = args.val_fraction > 0 and (first or rng.random() < args.val_fraction)
            (val if to_val else train).add(ids)
            ndocs["val" if to_val else "train"] += 1

    batch = []
    try:
        for path in args.inputs:
            for doc, where in iter_documents(path, args):
                if not doc.strip() and not args.keep_empty:
                    args.stats["empty"] += 1
                    continue
                batch.append(doc)
                if len(batch) >= args.batch_docs:
                    flush(batch)
                    batch = []
                    if not args.quiet and time.time() - last > 5:
                        last = time.time()
                        n = train.total + val.total
                        print("prepare_data: %d docs, %d tokens (%.0f tokens/s)"
                              % (ndocs["train"] + ndocs["val"], n, n / (last - t0)), file=sys.stderr)
        if batch:
            flush(batch)
        train.close()
        val.close()
        if train.total + val.total == 0:
            raise DataError("no tokens: every input document was empty")
    except BaseException:
        # no partial output: remove the shards this run already wrote
        for w in (train, val):
            for name, _ in w.shards:
                try:
                    os.unlink(os.path.join(args.out_dir, name))
                except OSError:
                    pass
        raise

    manifest = {
        "format": "centrifuge token shards (llm.c header, magic %d)" % TOKENS_MAGIC,
        "version": 1 if width == 2 else 2, "dtype": "uint16" if width == 2 else "uint32",
        "tokenizer": os.path.abspath(tok_path), "vocab_size": vocab,
        "eos": {"id": eos[0], "token": eos[1]} if eos else None,
        "bos": {"id": bos[0], "token": bos[1]} if bos else None,
        "inputs": [os.path.abspath(p) for p in args.inputs],
        "val_fraction": args.val_fraction, "seed": args.seed, "max_tokens_per_shard": args.max_tokens_per_shard,
        "documents": dict(ndocs), "skipped_empty": args.stats["empty"], "skipped_bad": args.stats["bad"],
        "train": {"tokens": train.total, "shards": [{"file": n, "tokens": c} for n, c in train.shards]},
        "val": {"tokens": val.total, "shards": [{"file": n, "tokens": c} for n, c in val.shards]},
    }
    atomic_write(os.path.join(args.out_dir, args.name + "_manifest.json"),
                 [json.dumps(manifest, indent=2).encode("utf-8"), b"\n"])
    if not args.quiet:
        dt = max(time.time() - t0, 1e-9)
        print("prepare_data: %d documents (%d train, %d val), %d tokens (%d train, %d val), vocab %d -> %s, "
              "%d + %d shards in %s, %.1fs"
              % (ndocs["train"] + ndocs["val"], ndocs["train"], ndocs["val"], train.total + val.total, train.total,
                 val.total, vocab, manifest["dtype"], len(train.shards), len(val.shards), args.out_dir, dt))
        if args.stats["empty"] or args.stats["bad"]:
            print("prepare_data: skipped %d empty and %d bad documents" % (args.stats["empty"], args.stats["bad"]))
        if train.total == 0:
            print("prepare_data: warning: the training set is empty (lower --val-fraction)", file=sys.stderr)
    return manifest


def build_parser():
    ap = argparse.ArgumentParser(
        description="Tokenize text or JSONL with a HF tokenizer.json into centrifuge token shards.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Output: OUT_DIR/NAME_val_000000.bin, NAME_train_000000.bin, ... and NAME_manifest.json.")
    ap.add_argument("inputs", nargs="+", help="input files (.txt, .jsonl; .gz is read too)")
    ap.add_argument("--tokenizer", required=True, help="tokenizer.json, or a directory holding one")
    ap.add_argument("--out-dir", required=True, help="output directory (created if missing)")
    ap.add_argument("--name", default="data", help="shard file prefix (default data)")
    ap.add_argument("--format", choices=["auto", "text", "jsonl"], default="auto",
                    help="input format (default auto: .jsonl/.json/.ndjson are JSONL, the rest text)")
    ap.add_argument("--field", default="text", help="JSONL field holding the document (default text)")
    ap.add_argument("--text-split", choices=["file", "line", "blank", "delimiter"], default="file",
                    help="text input: one document per file (default), per line, per blank-line-separated "
                         "paragraph, or between --delimiter strings")
    ap.add_argument("--delimiter", help="document separator for --text-split delimiter, e.g. '<|endoftext|>'")
    eg = ap.add_argument_group("special tokens")
    eg.add_argument("--no-eos", action="store_true", help="do not append EOS after each document")
    eg.add_argument("--eos-token", help="EOS token string (default: tokenizer_config.json beside the "
                    "tokenizer, else a well-known name such as <|endoftext|> or </s>)")
    eg.add_argument("--eos-id", type=int, help="EOS token id")
    eg.add_argument("--prepend-bos", action="store_true", help="prepend BOS to each document")
    eg.add_argument("--bos-token", help="BOS token string (default found like EOS)")
    eg.add_argument("--bos-id", type=int, help="BOS token id")
    ap.add_argument("--val-fraction", type=float, default=0.0,
                    help="fraction of documents for validation, in [0, 1) (default 0)")
    ap.add_argument("--max-tokens-per-shard", type=int, default=DEFAULT_SHARD_TOKENS,
                    help="tokens per shard at most (default %d, at most 2^31-1)" % DEFAULT_SHARD_TOKENS)
    ap.add_argument("--seed", type=int, default=1, help="seed of the train/val assignment (default 1)")
    ap.add_argument("--skip-bad", action="store_true", help="skip JSONL lines that are not JSON or lack --field")
    ap.add_argument("--keep-empty", action="store_true", help="keep empty documents (as a lone EOS/BOS)")
    ap.add_argument("--overwrite", action="store_true", help="first remove the shards of an earlier run with this --name "
                    "(without it such shards are an error, so two runs never mix)")
    ap.add_argument("--batch-docs", type=int, default=1000, help="documents per encode_batch call (default 1000)")
    ap.add_argument("--quiet", action="store_true", help="no progress or summary lines")
    return ap


def main(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    if not 0 <= args.val_fraction < 1:
        ap.error("--val-fraction must be in [0, 1)")
    if not 1 <= args.max_tokens_per_shard <= MAX_SHARD_TOKENS:
        ap.error("--max-tokens-per-shard must be in [1, %d] (the header's count is an int32)" % MAX_SHARD_TOKENS)
    if args.text_split == "delimiter" and not args.delimiter:
        ap.error("--text-split delimiter needs --delimiter")
    if args.delimiter and args.text_split != "delimiter":
        args.text_split = "delimiter"
    if args.batch_docs < 1:
        ap.error("--batch-docs must be >= 1")
    if os.path.sep in args.name or not args.name:
        ap.error("--name must be a plain file prefix")
    try:
        run(args)
    except DataError as e:
        print("prepare_data: error: %s" % e, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("prepare_data: interrupted; the shards of this run were removed", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
