#!/usr/bin/env python3
"""Parity check: centrifuge checkpoints against HF transformers.

For each model type this tool
  1. writes a token shard (ids below the model's vocabulary),
  2. trains a few steps with `centrifuge train` so that every weight has moved
     away from its initial value (norm weights off 1, biases off 0),
  3. runs `centrifuge eval --losses-out` on the checkpoint it wrote,
  4. loads the same checkpoint directory with
     `transformers.AutoModelForCausalLM.from_pretrained` (eager attention),
     failing on any missing, unexpected or mismatched weight,
  5. computes the per-token cross-entropy of the same windows in float32 and
     in float64 and compares it with centrifuge's, position by position,
  6. (unless --no-roundtrip) saves the loaded model again with transformers'
     save_pretrained and checks that `centrifuge eval` of that directory gives
     the same losses: the config.json transformers writes loads in centrifuge.
  7. (unless --no-generate) greedy decoding: `centrifuge generate --ids` from a
     prompt of the data against transformers' generate(do_sample=False), token
     by token, then again from a copy whose config.json lists two eos ids (one
     never produced, the other the 4th greedy token) and from a copy whose
     generation_config.json alone names that id: both sides must stop after it.
     A difference is accepted only where transformers' two best logits at that
     step are within --gen-tie of each other (a tie the two sums may break
     either way); the sequences are then compared up to that step.

A type passes when max |diff| < --tol (default 1e-4) in every dtype checked
(and in the round trip), and the greedy tokens agree.
The exit status is 0 when every type passes, 1 otherwise, 2 on bad usage.

Windows follow centrifuge's batch loader (src/train.c, cf_loader): batch i
starts at token i*B*S; row b of it is tokens[i*B*S + b*S : i*B*S + b*S + S + 1];
the first S are inputs, the last S the targets; losses are written row-major.

Needs torch and transformers (CPU is enough); no network.

Examples:
  python3 tools/hf_parity.py
  python3 tools/hf_parity.py --types llama,qwen3 --out-json parity.json
  python3 tools/hf_parity.py --bin ./centrifuge-cuda --device cuda --tol 5e-2
  python3 tools/hf_parity.py --bin ./centrifuge-cuda --device cuda --tol 5e-2 \
      --train-launch "torchrun --nproc_per_node 2 --no-python" --train-args "--tp 2"
      (a tensor-parallel run's gathered checkpoint, loaded by one GPU and by transformers)
"""
import argparse
import array
import json
import logging
import math
import os
import random
import re
import shutil
import shlex
import subprocess
import sys
import tempfile
import time
import warnings

TOKENS_MAGIC = 20240520
HEADER_INTS = 256

# --types name -> (centrifuge built-in config, vocab size, expected HF class).
# The tiny-* test configs cover each model_type's features (llama3 RoPE
# scaling, q/k/v biases, explicit head_dim with H*D != C and q/k norms);
# `tiny` is the demo config: byte vocabulary, tied embeddings, 4 layers.
CASES = {
    "llama": ("tiny-llama", 64, "LlamaForCausalLM"),
    "qwen2": ("tiny-qwen2", 64, "Qwen2ForCausalLM"),
    "mistral": ("tiny-mistral", 64, "MistralForCausalLM"),
    "qwen3": ("tiny-qwen3", 64, "Qwen3ForCausalLM"),
    "tiny": ("tiny", 320, "LlamaForCausalLM"),
}
DEFAULT_TYPES = "llama,qwen2,mistral,qwen3,tiny"
ARCH_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class ParityError(Exception):
    """A failure of one case, with a one-line reason."""


# ----------------------------------------------------------------- shards

def write_token_shard(path, tokens):
    """Writes tokens (ints) as an llm.c-style shard: 256 int32 header
    [magic, version, count, 0...], then uint16 (version 1) or uint32
    (version 2) little-endian tokens. Atomic (temp file + os.replace)."""
    width_code = "H" if max(tokens, default=0) < 65536 else "I"
    header = array.array("i", [0] * HEADER_INTS)
    header[0], header[1], header[2] = TOKENS_MAGIC, 1 if width_code == "H" else 2, len(tokens)
    body = array.array(width_code, tokens)
    if sys.byteorder != "little":
        header.byteswap()
        body.byteswap()
    tmp = path + ".tmp%d" % os.getpid()
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(body.tobytes())
    os.replace(tmp, path)


def read_token_shard(path):
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 * HEADER_INTS:
        raise ParityError("%s: too short for a token shard header" % path)
    header = array.array("i")
    header.frombytes(raw[: 4 * HEADER_INTS])
    if sys.byteorder != "little":
        header.byteswap()
    if header[0] != TOKENS_MAGIC or header[1] not in (1, 2):
        raise ParityError("%s: not a token shard (magic %d, version %d)" % (path, header[0], header[1]))
    body = array.array("H" if header[1] == 1 else "I")
    body.frombytes(raw[4 * HEADER_INTS:])
    if sys.byteorder != "little":
        body.byteswap()
    if len(body) != header[2]:
        raise ParityError("%s: header says %d tokens, file has %d" % (path, header[2], len(body)))
    return list(body)


def synthetic_tokens(n, vocab, seed):
    """A deterministic order-1 Markov stream: every token has a few likely
    successors, so a few training steps move the loss and the weights."""
    rng = random.Random(seed)
    succ = [[rng.randrange(vocab) for _ in range(4)] for _ in range(vocab)]
    out, t = [], rng.randrange(vocab)
    for _ in range(n):
        out.append(t)
        t = rng.choice(succ[t]) if rng.random() < 0.8 else rng.randrange(vocab)
    return out


# ------------------------------------------------------------- centrifuge

def run_cmd(cmd, timeout, what):
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    except FileNotFoundError:
        raise ParityError("%s: cannot run %s" % (what, cmd[0]))
    except subprocess.TimeoutExpired:
        raise ParityError("%s: timed out after %ds: %s" % (what, timeout, " ".join(cmd)))
    if p.returncode != 0:
        tail = " | ".join(l for l in p.stdout.strip().splitlines()[-3:])
        raise ParityError("%s failed (exit %d): %s" % (what, p.returncode, tail))
    return p.stdout


def latest_checkpoint(out_dir):
    latest = os.path.join(out_dir, "latest")
    try:
        with open(latest) as f:
            name = f.read().strip()
    except OSError:
        raise ParityError("%s: no 'latest' file after training" % out_dir)
    path = os.path.join(out_dir, name)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ParityError("%s: checkpoint has no config.json" % path)
    return path


def read_losses(path):
    vals = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                vals.append(float(line))
            except ValueError:
                raise ParityError("%s:%d: not a number: %r" % (path, i, line[:40]))
    return vals


# ------------------------------------------------------------------ HF side

class LogCapture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        msg = record.getMessage().strip().splitlines()
        if msg:
            self.messages.append(msg[0][:200])


def load_hf(ckpt, torch, transformers, hf_device):
    from transformers import AutoModelForCausalLM

    cap = LogCapture()
    tlog = logging.getLogger("transformers")
    tlog.addHandler(cap)
    kwargs = dict(attn_implementation="eager", output_loading_info=True)
    major = int(transformers.__version__.split(".")[0])
    # transformers 5 calls the argument dtype; 4.x torch_dtype.
    kwargs["dtype" if major >= 5 else "torch_dtype"] = torch.float32
    try:
        with warnings.catch_warnings(record=True) as wlist:
            warnings.simplefilter("always")
            model, info = AutoModelForCausalLM.from_pretrained(ckpt, **kwargs)
    except Exception as e:  # the exact rejection is the finding
        raise ParityError("transformers rejected %s: %s: %s" % (ckpt, type(e).__name__, str(e).splitlines()[0][:300]))
    finally:
        tlog.removeHandler(cap)
    notes = list(cap.messages) + [str(w.message).splitlines()[0][:200] for w in wlist]
    problems = []
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        vals = sorted(str(v) for v in (info.get(key) or []))
        if vals:
            problems.append("%s: %s" % (key, ", ".join(vals[:6]) + (" ..." if len(vals) > 6 else "")))
    if info.get("error_msgs"):
        problems.append("error_msgs: %s" % "; ".join(str(m) for m in info["error_msgs"][:3]))
    if problems:
        raise ParityError("weights do not match the HF model: " + " | ".join(problems))
    model.eval()
    model.to(hf_device)
    return model, notes


def hf_losses(model, windows, B, S, dtype, torch, hf_device):
    """Per-token CE for every window, in the given dtype, row-major per batch."""
    import torch.nn.functional as F

    model = model.to(dtype)
    out = []
    with torch.no_grad():
        for batch in windows:
            x = torch.tensor(batch, dtype=torch.long, device=hf_device).view(B, S + 1)
            logits = model(input_ids=x[:, :-1], use_cache=False).logits.to(dtype)
            loss = F.cross_entropy(logits.reshape(B * S, -1), x[:, 1:].reshape(-1), reduction="none")
            out.extend(loss.double().cpu().tolist())
    return out


def check_config(model, ckpt, expect_class):
    """Checks HF built the model the config.json describes."""
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    issues = []
    cls = type(model).__name__
    want = expect_class or ARCH_OF_MODEL_TYPE.get(cfg.get("model_type"))
    if want and cls != want:
        issues.append("HF built %s, expected %s" % (cls, want))
    tied_ptr = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    if bool(cfg.get("tie_word_embeddings")) != tied_ptr:
        issues.append("tie_word_embeddings=%s but HF lm_head %s the embedding"
                      % (cfg.get("tie_word_embeddings"), "shares" if tied_ptr else "does not share"))
    hd = getattr(model.config, "head_dim", None)
    if hd is not None and "head_dim" in cfg and hd != cfg["head_dim"]:
        issues.append("head_dim %s in HF, %s in config.json" % (hd, cfg["head_dim"]))
    if issues:
        raise ParityError("; ".join(issues))
    return cls, cfg


# -------------------------------------------------------------------- main

def stats(a, b):
    d = [abs(x - y) for x, y in zip(a, b)]
    nonfinite = sum(1 for x in d if not math.isfinite(x))
    if nonfinite:
        return float("inf"), float("inf"), nonfinite
    return max(d), sum(d) / len(d), 0


def run_case(name, args, work, torch, transformers, given_ckpt=None):
    """One parity case: a --types name, a config.json path, or (given_ckpt)
    an existing checkpoint directory, which is checked without training."""
    res = {"type": name, "status": "FAIL", "notes": []}
    try:
        if given_ckpt:
            with open(os.path.join(given_ckpt, "config.json")) as f:
                vocab = int(json.load(f)["vocab_size"])
            config, expect_class = "(checkpoint)", None
        elif name in CASES:
            config, vocab, expect_class = CASES[name]
        elif name.endswith(".json") and os.path.isfile(name):
            config, expect_class = name, None
            with open(name) as f:
                vocab = int(json.load(f)["vocab_size"])
        else:
            res["error"] = "unknown type '%s' (known: %s, or a config.json path)" % (name, ", ".join(CASES))
            return res
    except (OSError, ValueError, KeyError, TypeError) as e:
        res["error"] = "cannot read the vocab_size of %s: %s" % (given_ckpt or name, e)
        return res
    res["config"] = config
    case_dir = os.path.join(work, re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(name)))
    os.makedirs(case_dir, exist_ok=True)
    B, S, NB = args.batch, args.seq, args.max_batches
    try:
        # 1. data
        shard = args.data
        if not shard:
            shard = os.path.join(case_dir, "tokens.bin")
            if vocab >= 258 and not args.python_data:
                # byte tokens with BOS 256 / EOS 257 from the engine's own generator
                run_cmd([args.bin, "gen-data", "--source", "noisy", "--tokens", str(args.tokens),
                         "--seed", str(args.seed), "--out", shard], args.timeout, "gen-data")
                res["data"] = "gen-data noisy"
            else:
                write_token_shard(shard, synthetic_tokens(args.tokens, min(vocab, 65536), args.seed))
                res["data"] = "python markov (vocab %d)" % vocab
        else:
            res["data"] = shard
        tokens = read_token_shard(shard)
        if tokens and max(tokens) >= vocab:
            raise ParityError("%s: token id %d >= vocab %d" % (shard, max(tokens), vocab))

        # 2. train (unless a checkpoint was given)
        t0 = time.time()
        if given_ckpt:
            ckpt = given_ckpt
        else:
            out_dir = os.path.join(case_dir, "ckpt")
            shutil.rmtree(out_dir, ignore_errors=True)
            run_cmd(shlex.split(args.train_launch) +
                    [args.bin, "train", "--config", config, "--steps", str(args.steps), "--batch", str(B),
                     "--seq", str(S), "--data", shard, "--out", out_dir, "--lr", repr(args.lr),
                     "--seed", str(args.seed), "--device", args.device, "--quiet"] + shlex.split(args.train_args),
                    args.timeout, "centrifuge train")
            ckpt = latest_checkpoint(out_dir)
        res["checkpoint"] = ckpt
        res["sharded"] = os.path.isfile(os.path.join(ckpt, "model.safetensors.index.json"))

        # 3. eval
        losses_path = os.path.join(case_dir, "losses.txt")
        out = run_cmd([args.bin, "eval", "--model", ckpt, "--data", shard, "--batch", str(B), "--seq", str(S),
                       "--max-batches", str(NB), "--losses-out", losses_path, "--device", args.device],
                      args.timeout, "centrifuge eval")
        cf = read_losses(losses_path)
        m = re.search(r"loss ([0-9.eE+-]+|nan|inf)", out)
        res["centrifuge_mean_loss"] = float(m.group(1)) if m else None
        res["centrifuge_s"] = round(time.time() - t0, 2)

        avail = (len(tokens) - 1) // (B * S)
        nb = min(NB, avail) if NB > 0 else avail
        if len(cf) != nb * B * S:
            raise ParityError("eval wrote %d losses, expected %d batches x %d x %d = %d"
                              % (len(cf), nb, B, S, nb * B * S))
        windows = []
        for i in range(nb):
            base = i * B * S
            windows.append([tokens[base + b * S + s] for b in range(B) for s in range(S + 1)])
        res["positions"] = len(cf)

        # 4. load in transformers
        model, notes = load_hf(ckpt, torch, transformers, args.hf_device)
        res["notes"] = notes
        cls, _ = check_config(model, ckpt, expect_class)
        res["hf_class"] = cls

        # 5. compare
        ok = True
        for dt in args.dtypes:
            ref = hf_losses(model, windows, B, S, {"float32": torch.float32, "float64": torch.float64}[dt],
                            torch, args.hf_device)
            mx, mean, nonfinite = stats(cf, ref)
            res[dt] = {"max_abs_diff": mx, "mean_abs_diff": mean, "hf_mean_loss": sum(ref) / len(ref),
                       "nonfinite": nonfinite}
            ok = ok and mx < args.tol
        # 6. the other way: transformers' save_pretrained -> centrifuge eval
        if args.roundtrip:
            rt_dir = os.path.join(case_dir, "hf_saved")
            shutil.rmtree(rt_dir, ignore_errors=True)
            model.to(torch.float32).save_pretrained(rt_dir)
            rt_path = os.path.join(case_dir, "losses_hf_saved.txt")
            run_cmd([args.bin, "eval", "--model", rt_dir, "--data", shard, "--batch", str(B), "--seq", str(S),
                     "--max-batches", str(NB), "--losses-out", rt_path, "--device", args.device],
                    args.timeout, "centrifuge eval of the transformers-saved copy")
            rt = read_losses(rt_path)
            if len(rt) != len(cf):
                raise ParityError("eval of the transformers-saved copy wrote %d losses, expected %d"
                                  % (len(rt), len(cf)))
            mx, mean, _ = stats(cf, rt)
            res["hf_saved"] = {"max_abs_diff": mx, "mean_abs_diff": mean}
            ok = ok and mx < args.tol
        # 7. greedy generation and where it stops
        if args.generate:
            gok, res["generate"] = check_generation(args, model, ckpt, case_dir, windows[0][:args.gen_prompt],
                                                    vocab, torch, transformers)
            ok = ok and gok
        res["status"] = "PASS" if ok else "FAIL"
    except ParityError as e:
        res["error"] = str(e)
    return res


# ------------------------------------------------------------- generation

def cf_generate(args, ckpt, prompt, n):
    """New token ids of `centrifuge generate --ids` (greedy), the stop token included."""
    out = run_cmd([args.bin, "generate", "--model", ckpt, "--prompt-ids", ",".join(str(t) for t in prompt),
                   "--ids", "--max-new", str(n), "--device", args.device], args.timeout, "centrifuge generate")
    lines = [l for l in out.strip().splitlines() if l.strip()]
    try:
        return [int(v) for v in lines[-1].split(",")] if lines else []
    except ValueError:
        raise ParityError("centrifuge generate --ids printed %r, not a list of ids" % lines[-1][:200])


def hf_generate(model, prompt, n, torch, hf_device):
    """transformers' greedy continuation (float32, its generation config: eos ids from generation_config.json,
    else config.json), the stop token included, and the gap between the two best logits at each step."""
    model = model.to(torch.float32)
    x = torch.tensor([prompt], dtype=torch.long, device=hf_device)
    gc = model.generation_config
    eos = gc.eos_token_id
    pad = gc.pad_token_id if gc.pad_token_id is not None else (eos[0] if isinstance(eos, list) and eos else eos)
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=0,
                             do_sample=False, num_beams=1, pad_token_id=pad if pad is not None else 0,
                             output_scores=True, return_dict_in_generate=True)
    ids = out.sequences[0, len(prompt):].tolist()
    gaps = []
    for sc in out.scores:
        top = torch.topk(sc[0].double(), 2).values
        gaps.append(float(top[0] - top[1]))
    return ids[:len(gaps)], gaps


def compare_tokens(cf, hf, gaps, tie):
    """(ok, agreed, where): equal sequences (agreed = their length), or equal for the first `agreed` tokens up
    to a step where transformers' best two logits were within tie (where says so)."""
    for i in range(min(len(cf), len(hf))):
        if cf[i] != hf[i]:
            if gaps[i] < tie:
                return True, i, "tie at new token %d (gap %.2e): compared up to it" % (i, gaps[i])
            return False, i, "new token %d: centrifuge %d, transformers %d (their best two logits %.3g apart)" % (
                i, cf[i], hf[i], gaps[i])
    if len(cf) != len(hf):
        return False, min(len(cf), len(hf)), ("centrifuge made %d new tokens, transformers %d (the shorter "
                                              "stopped, the other did not)" % (len(cf), len(hf)))
    return True, len(hf), None


def eos_copy(ckpt, dst, cfg_eos, gen_eos):
    """A copy of the checkpoint whose config.json says eos_token_id = cfg_eos and whose generation_config.json
    (written only where gen_eos is not None) says gen_eos."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(ckpt, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["eos_token_id"] = cfg_eos
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    gpath = os.path.join(dst, "generation_config.json")
    if os.path.exists(gpath):
        os.remove(gpath)
    if gen_eos is not None:
        with open(gpath, "w") as f:
            json.dump({"eos_token_id": gen_eos, "bos_token_id": cfg.get("bos_token_id")}, f, indent=2)
    return dst


GEN_STOPS = ("config.json eos list", "generation_config.json eos")


def check_generation(args, model, ckpt, case_dir, prompt, vocab, torch, transformers):
    """Step 7, with the checkpoint's model already loaded. Returns (ok, a dict for the results)."""
    n = args.gen_new
    hf, gaps = hf_generate(model, prompt, n, torch, args.hf_device)
    cf = cf_generate(args, ckpt, prompt, n)
    ok, agreed, why = compare_tokens(cf, hf, gaps, args.gen_tie)
    res = {"prompt": prompt, "centrifuge": cf, "transformers": hf, "min_gap": min(gaps) if gaps else None,
           "ok": ok, "agreed": agreed, "note": why}
    if not ok or agreed < 4:
        if ok:
            res["eos"] = "skipped: %d tokens agree before %s" % (agreed, "a tie" if why else "the free run's stop")
        return ok, res
    # the stop: the 4th greedy token listed as the second of two eos ids (the first never produced), in
    # config.json; then named by generation_config.json alone (config.json's eos kept at the unused id)
    stop = hf[3]
    unused = next(t for t in range(vocab - 1, -1, -1) if t not in hf and t not in prompt)
    for label, cfg_eos, gen_eos in ((GEN_STOPS[0], [unused, stop], None), (GEN_STOPS[1], unused, [unused, stop])):
        d = eos_copy(ckpt, os.path.join(case_dir, "eos_" + label.split()[0].replace(".", "_")), cfg_eos, gen_eos)
        model, _ = load_hf(d, torch, transformers, args.hf_device)
        hf2, gaps2 = hf_generate(model, prompt, n, torch, args.hf_device)
        del model
        cf2 = cf_generate(args, d, prompt, n)
        want = hf[:hf.index(stop) + 1]
        ok2, _, why2 = compare_tokens(cf2, hf2, gaps2, args.gen_tie)
        if ok2 and not why2 and hf2 != want:
            ok2, why2 = False, "transformers did not stop at %d: %s" % (stop, hf2)
        res[label] = {"stop": stop, "centrifuge": cf2, "transformers": hf2, "ok": ok2, "note": why2}
        ok = ok and ok2
    return ok, res


def sharded_copy(results, args, work):
    """(dir, None): the largest passing checkpoint rewritten by `centrifuge convert` as float32 shards
    of at most 1 MB with an index, so the loading of sharded checkpoints is checked too (by centrifuge
    eval and by transformers); (None, why) where no case passed or its model fits in one shard."""
    passed = [r for r in results if r.get("status") == "PASS" and r.get("checkpoint")]
    if not passed:
        return None, "no sharded checkpoint was checked: no case passed to convert into shards"

    def size(r):
        f = os.path.join(r["checkpoint"], "model.safetensors")
        return os.path.getsize(f) if os.path.isfile(f) else 0
    src = max(passed, key=size)
    out = os.path.join(work, "sharded_ckpt")  # not "sharded": run_case works in work/<name>
    shutil.rmtree(out, ignore_errors=True)
    try:
        run_cmd([args.bin, "convert", "--model", src["checkpoint"], "--out", out, "--dtype", "float32",
                 "--max-shard-mb", "1"], args.timeout, "centrifuge convert --max-shard-mb 1")
    except ParityError as e:
        return None, str(e)
    if not os.path.isfile(os.path.join(out, "model.safetensors.index.json")):
        return None, ("no sharded checkpoint was checked: %s's model fits in one 1 MB shard; pass a larger "
                      "one with --checkpoint" % src["type"])
    return out, None


def fmt(x):
    if x is None:
        return "-"
    if isinstance(x, float):
        return "%.2e" % x if math.isfinite(x) else str(x)
    return str(x)


def print_table(results, dtypes, tol):
    cols = ["type", "config", "HF class", "pos"]
    for dt in dtypes:
        short = "f32" if dt == "float32" else "f64"
        cols += ["%s max|d|" % short, "%s mean|d|" % short]
    if any("hf_saved" in r for r in results):
        cols += ["HF-saved max|d|"]
    if any("generate" in r for r in results):
        cols += ["greedy"]
    cols += ["cf loss", "status"]
    rows = []
    for r in results:
        row = [r["type"] + (" [sharded]" if r.get("sharded") else ""), r.get("config", "-"), r.get("hf_class", "-"),
               fmt(r.get("positions"))]
        for dt in dtypes:
            d = r.get(dt) or {}
            row += [fmt(d.get("max_abs_diff")), fmt(d.get("mean_abs_diff"))]
        if "HF-saved max|d|" in cols:
            row.append(fmt((r.get("hf_saved") or {}).get("max_abs_diff")))
        if "greedy" in cols:
            row.append(gen_cell(r.get("generate")))
        cl = r.get("centrifuge_mean_loss")
        row += ["%.5f" % cl if isinstance(cl, float) else "-", r["status"]]
        rows.append(row)
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
    print(line)
    print("-" * len(line))
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
    for r in results:
        if r.get("error"):
            print("%s: %s: %s" % (r["type"], r["status"], r["error"]))
        g = r.get("generate") or {}
        for what, d in [("greedy", g)] + [(k, g[k]) for k in GEN_STOPS if k in g]:
            if isinstance(d, dict) and d.get("note"):
                print("%s: %s: %s" % (r["type"], what, d["note"]))
        if g.get("eos"):
            print("%s: eos: %s" % (r["type"], g["eos"]))
        for n in r.get("notes") or []:
            print("%s: transformers said: %s" % (r["type"], n))
    print("pass criterion: max |diff| < %g in %s%s%s" % (tol, " and ".join(dtypes),
          " and for the transformers-saved copy" if "HF-saved max|d|" in cols else "",
          "; greedy tokens equal (n/n new tokens, then the stop at an eos id of config.json's list and of "
          "generation_config.json: +2 stops)" if "greedy" in cols else ""))


def gen_cell(g):
    """The table's greedy column: new tokens that agree, and the two stop checks passed."""
    if not g:
        return "-"
    if not g.get("ok"):
        return "FAIL"
    n = len(g.get("transformers") or [])
    stops = sum(1 for k in GEN_STOPS if (g.get(k) or {}).get("ok"))
    return "%d/%d +%d stops%s" % (g.get("agreed", n), n, stops, " (tie)" if g.get("note") else "")


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Check that centrifuge checkpoints load in HF transformers and give the same "
                    "per-token losses as `centrifuge eval`.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="types: %s, or a path to a config.json (centrifuge --config FILE).\n"
               "The largest passing checkpoint is also rewritten as 1 MB shards with an index\n"
               "(centrifuge convert --max-shard-mb 1) and checked as a sharded checkpoint." % ", ".join(
                   "%s (%s)" % (k, v[0]) for k, v in CASES.items()))
    ap.add_argument("--bin", default="./centrifuge", help="centrifuge binary (default ./centrifuge)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="passed to centrifuge train and eval (default cpu). The CUDA backend "
                         "computes in bf16: raise --tol accordingly")
    ap.add_argument("--hf-device", default="cpu", help="torch device for the transformers side (default cpu)")
    ap.add_argument("--types", default=DEFAULT_TYPES, help="comma list (default %s)" % DEFAULT_TYPES)
    ap.add_argument("--dtypes", default="float32,float64",
                    help="HF compute dtypes to compare, comma list of float32,float64 (default both)")
    ap.add_argument("--tol", type=float, default=1e-4, help="pass if max |diff| < TOL (default 1e-4)")
    ap.add_argument("--steps", type=int, default=3, help="training steps before the check (default 3)")
    ap.add_argument("--lr", type=float, default=1e-2,
                    help="training learning rate (default 1e-2, so biases and norms move off their init)")
    ap.add_argument("--batch", type=int, default=2, help="B (default 2)")
    ap.add_argument("--seq", type=int, default=16, help="S (default 16)")
    ap.add_argument("--max-batches", type=int, default=4, help="eval batches compared (default 4)")
    ap.add_argument("--tokens", type=int, default=20000, help="tokens in the generated shard (default 20000)")
    ap.add_argument("--checkpoint", action="append", metavar="DIR",
                    help="also check this existing centrifuge checkpoint directory (no training; "
                         "repeatable), e.g. a sharded save")
    ap.add_argument("--train-launch", default="",
                    help="launcher before the train command, e.g. 'torchrun --nproc_per_node 2 --no-python' "
                         "(the checkpoint of a distributed run is checked)")
    ap.add_argument("--train-args", default="", help="extra train arguments, e.g. '--tp 2'")
    ap.add_argument("--data", help="use this token shard for every type instead of generating one")
    ap.add_argument("--python-data", action="store_true",
                    help="write the shard in Python even where gen-data's byte tokens would fit")
    ap.add_argument("--no-roundtrip", dest="roundtrip", action="store_false",
                    help="skip the reverse check (transformers save_pretrained, then centrifuge eval "
                         "of that directory, compared with the first eval)")
    ap.add_argument("--no-generate", dest="generate", action="store_false",
                    help="skip the greedy generation check (centrifuge generate against transformers' generate)")
    ap.add_argument("--gen-new", type=int, default=16, help="new tokens in the generation check (default 16)")
    ap.add_argument("--gen-prompt", type=int, default=8, help="prompt tokens, from the data (default 8)")
    ap.add_argument("--gen-tie", type=float, default=1e-3,
                    help="a differing greedy token is accepted where transformers' best two logits are closer "
                         "than this (default 1e-3; raise it for the bf16 CUDA backend)")
    ap.add_argument("--seed", type=int, default=1, help="seed for data and training (default 1)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per centrifuge command (default 600)")
    ap.add_argument("--workdir", help="keep all files here (default: a temp dir, removed afterwards)")
    ap.add_argument("--out-json", help="write the results as JSON here")
    args = ap.parse_args(argv)

    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in args.dtypes if d not in ("float32", "float64")]
    if bad or not args.dtypes:
        ap.error("--dtypes: use float32 and/or float64")
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    if not types and not args.checkpoint:
        ap.error("--types is empty (and no --checkpoint given)")
    for name, v in (("--batch", args.batch), ("--seq", args.seq), ("--steps", args.steps), ("--tokens", args.tokens)):
        if v < 1:
            ap.error("%s must be >= 1" % name)
    if args.tokens < args.batch * args.seq + 1:
        ap.error("--tokens must be at least batch*seq+1")
    if args.gen_new < 1 or not 1 <= args.gen_prompt <= args.batch * (args.seq + 1):
        ap.error("--gen-new must be >= 1 and --gen-prompt between 1 and batch*(seq+1)")
    if not (shutil.which(args.bin) or os.path.isfile(args.bin)):
        ap.error("--bin: %s not found (build it with `make centrifuge`)" % args.bin)
    args.bin = os.path.abspath(args.bin) if os.path.isfile(args.bin) else shutil.which(args.bin)
    if args.data and not os.path.isfile(args.data):
        ap.error("--data: %s not found" % args.data)
    for d in args.checkpoint or []:
        if not os.path.isfile(os.path.join(d, "config.json")):
            ap.error("--checkpoint: %s has no config.json" % d)

    try:
        import torch
        import transformers
    except ImportError as e:
        print("hf_parity: needs torch and transformers (%s)" % e, file=sys.stderr)
        return 2
    try:
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:
        pass
    torch.manual_seed(0)

    work = args.workdir or tempfile.mkdtemp(prefix="cf_parity_")
    os.makedirs(work, exist_ok=True)
    print("hf_parity: %s | torch %s | transformers %s | centrifuge device %s | HF device %s | B=%d S=%d "
          "batches=%d | work %s" % (args.bin, torch.__version__, transformers.__version__, args.device,
                                   args.hf_device, args.batch, args.seq, args.max_batches, work))
    results = []
    try:
        for t in types:
            results.append(run_case(t, args, work, torch, transformers))
        for i, d in enumerate(args.checkpoint or []):
            label = "ckpt%d:%s" % (i, os.path.basename(os.path.normpath(d)))
            results.append(run_case(label, args, work, torch, transformers, given_ckpt=d))
        if not any(r.get("sharded") for r in results):
            sharded, why = sharded_copy(results, args, work)
            if sharded:
                results.append(run_case("sharded", args, work, torch, transformers, given_ckpt=sharded))
            else:
                results.append({"type": "sharded", "status": "SKIP", "error": why})
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print_table(results, args.dtypes, args.tol)
    ok = all(r["status"] in ("PASS", "SKIP") for r in results)
    if args.out_json:
        doc = {"ok": ok, "tol": args.tol, "bin": args.bin, "device": args.device, "hf_device": args.hf_device,
               "torch": torch.__version__, "transformers": transformers.__version__,
               "batch": args.batch, "seq": args.seq, "max_batches": args.max_batches, "steps": args.steps,
               "results": results}
        tmp = args.out_json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=2, default=str)
            f.write("\n")
        os.replace(tmp, args.out_json)
    print("hf_parity: %s" % ("all passed" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
