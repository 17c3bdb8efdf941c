#!/usr/bin/env python3
"""Parity check: centrifuge's LoRA adapters against PEFT.

  1. transformers writes a small random Llama (or Qwen2) model directory;
  2. `centrifuge train --model BASE --lora-rank R ...` trains adapters on it
     (centrifuge mode: token filtering) and writes PEFT files in its checkpoint;
  3. PeftModel.from_pretrained(base, adapter_dir) must load them without a
     missing or unexpected key, and its per-token losses must equal
     `centrifuge eval --model BASE --adapter DIR --losses-out` window by window;
  4. PEFT's merge_and_unload() model must equal `centrifuge convert --merge-lora`'s
     merged model loaded by transformers;
  5. the other direction: an adapter made by PEFT (with a non-zero B) is loaded
     by `centrifuge eval --adapter`, and the losses agree.

Windows follow centrifuge's loader: window i, row b = tokens[i*B*S + b*S :
+ S + 1]. Needs torch, transformers and peft (CPU is enough); no network.

  python3 tools/peft_parity.py [--bin ./centrifuge] [--device cpu] [--tol 1e-4]
  python3 tools/peft_parity.py --bin ./centrifuge-cuda --device cuda --tol 2e-2
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

B, S, NB = 2, 32, 3


def write_shard(path, toks):
    hdr = [20240520, 2, len(toks)] + [0] * 253
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *hdr))
        f.write(struct.pack("<%dI" % len(toks), *toks))


def windows(toks):
    out = []
    for i in range(NB):
        base = i * B * S
        out.append([[toks[base + b * S + s] for s in range(S + 1)] for b in range(B)])
    return out


def losses_of(model, toks, torch):
    res = []
    with torch.no_grad():
        for w in windows(toks):
            x = torch.tensor(w, dtype=torch.long)
            logits = model(input_ids=x[:, :-1]).logits.double()
            lp = torch.log_softmax(logits, dim=-1)
            res += (-lp.gather(-1, x[:, 1:, None])[..., 0]).reshape(-1).tolist()
    return res


def cf_losses(args, extra, work, name):
    path = os.path.join(work, name + ".txt")
    cmd = [args.bin, "eval", "--data", os.path.join(work, "data.bin"), "--batch", str(B), "--seq", str(S),
           "--max-batches", str(NB), "--losses-out", path, "--device", args.device, "--quiet"] + extra
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return [float(l) for l in open(path)]


def worst(a, b):
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="./centrifuge")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--types", default="llama,qwen2")
    args = ap.parse_args()
    import torch
    import transformers
    import peft
    torch.manual_seed(0)
    failed = 0
    for typ in args.types.split(","):
        work = tempfile.mkdtemp(prefix="cf_peft_%s_" % typ)
        V = 200
        common = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, torch_dtype="float32")
        if typ == "llama":
            cfg = transformers.LlamaConfig(**common)
            model = transformers.LlamaForCausalLM(cfg)
        elif typ == "qwen2":
            cfg = transformers.Qwen2Config(**common)
            model = transformers.Qwen2ForCausalLM(cfg)
        else:
            sys.exit("unknown type " + typ)
        base = os.path.join(work, "base")
        model.save_pretrained(base, safe_serialization=True)
        g = torch.Generator().manual_seed(1)
        toks = torch.randint(0, V, (20000,), generator=g).tolist()
        write_shard(os.path.join(work, "data.bin"), toks)
        run = os.path.join(work, "run")
        subprocess.run([args.bin, "train", "--model", base, "--data", os.path.join(work, "data.bin"),
                        "--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q,k,v,o,gate,up,down",
                        "--mode", "centrifuge", "--keep", "0.5", "--steps", "12", "--lr", "1e-2", "--batch", "4",
                        "--seq", "32", "--out", run, "--device", args.device, "--quiet"], check=True)
        step = open(os.path.join(run, "latest")).read().strip()
        adapter = os.path.join(run, step)
        # 3. PEFT loads our files; same losses
        base_model = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
        pm = peft.PeftModel.from_pretrained(base_model, adapter)
        pm.eval()
        sd = pm.state_dict()
        nz = sum(float(v.abs().sum()) for k, v in sd.items() if "lora_B" in k)
        ref = losses_of(pm, toks, torch)
        ours = cf_losses(args, ["--model", base, "--adapter", adapter], work, "ours")
        base_ref = losses_of(transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32), toks, torch)
        d1 = worst(ours, ref)
        moved = worst(ref, base_ref)
        # 4. merged models agree
        merged_dir = os.path.join(work, "merged")
        subprocess.run([args.bin, "convert", "--model", base, "--adapter", adapter, "--merge-lora", "--out", merged_dir,
                        "--dtype", "float32"], check=True, stdout=subprocess.DEVNULL)
        ours_merged = losses_of(transformers.AutoModelForCausalLM.from_pretrained(merged_dir, torch_dtype=torch.float32),
                                toks, torch)
        peft_merged = losses_of(pm.merge_and_unload(), toks, torch)
        d2 = worst(ours_merged, peft_merged)
        # 5. an adapter PEFT made (random B) loads in centrifuge
        base_model = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
        lc = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
                             task_type="CAUSAL_LM", use_rslora=True)
        pm2 = peft.get_peft_model(base_model, lc)
        with torch.no_grad():
            for n, p in pm2.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05, generator=g)
        pdir = os.path.join(work, "peft_adapter")
        pm2.save_pretrained(pdir)
        pm2.eval()
        ref2 = losses_of(pm2, toks, torch)
        ours2 = cf_losses(args, ["--model", base, "--adapter", pdir], work, "ours2")
        d3 = worst(ours2, ref2)
        ok = d1 < args.tol and d2 < args.tol and d3 < args.tol and moved > 10 * args.tol and nz > 0
        failed += not ok
        print(f"{typ:6s} peft loads ours: max|diff| {d1:.2e} (adapters moved the losses by {moved:.2e}); "
              f"merged: {d2:.2e}; ours loads peft's (rslora, q,v,down): {d3:.2e}  {'ok' if ok else 'FAIL'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
