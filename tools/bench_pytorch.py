#!/usr/bin/env python3
"""PyTorch + transformers baseline for `centrifuge bench`.

Training-step mode (default): builds the model of a centrifuge built-in
config with random weights, micro-batch 1 (--batch), and times one training
step = forward + loss, backward, AdamW (fused) with CUDA events; with
--grad-accum N a step is N micro-batches (forward + loss and backward each,
the loss scaled by 1/N) and one optimizer update, the forward and backward
times summed over its micro-batches, as `centrifuge bench --grad-accum`:

  regular    loss = mean CE over all S positions
  loss-only  loss = mean CE over a random --keep fraction of each row's
             positions (the other positions stay in the forward and get
             gradients through attention): token filtering as PyTorch does it

--warmup untimed steps, then the median of --steps timed ones per stage.
Reported: forward (incl. the loss), backward, optimizer (incl. grad-norm
clipping when --grad-clip > 0, and zero_grad), step, tokens/s and peak memory
(torch.cuda.max_memory_allocated), and MFU against --peak-tflops (default
989 on a GPU, H100/H200 dense bf16; on the CPU only when given) with the
FLOPs per token of `centrifuge bench`: 6N + 6*L*S*H (N: every parameter but
the input embedding, the LM head counted once; L layers, S sequence length,
H hidden size), counted for every token of the step, so for loss-only it is
a dense-equivalent MFU. Rows can be written as JSON lines in the
same schema as `centrifuge bench --json` (plus "engine": "pytorch"), so
tools/plot_bench.py reads both; --centrifuge-json prints centrifuge/pytorch
tokens/s ratios.

LoRA (--lora-rank R --lora-alpha A --lora-targets q,k,v,o): PEFT adapters on
the frozen bf16 base, as `centrifuge bench --lora-rank`; only the adapters are
in the optimizer (MFU still counts the FLOPs of full fine-tuning, as there).

Attention mode (--sdpa-attention): times torch's scaled_dot_product_attention
(causal) forward and backward alone at B=1 and the given H, Hkv, S, D, and
prints TFLOP/s with FLOPs(fwd) = 4*B*H*S^2*D / 2 (causal), FLOPs(bwd) = 2.5 x fwd.

Needs torch and transformers; runs offline (the model is built from a config,
nothing is downloaded). A CUDA GPU is the target; --device cpu exists for smoke
tests only (wall-clock timing, no peak memory).

Examples:
  python3 tools/bench_pytorch.py --config tinyllama-1.1b --seq 4096 --json pt.jsonl
  python3 tools/bench_pytorch.py --config tinyllama-1.1b --seq 4096 --grad-accum 8 --json pt_accum8.jsonl
  python3 tools/bench_pytorch.py --config qwen2.5-1.5b --seq 2048 --keep 0.5,0.4 \\
      --centrifuge-json cf.jsonl
  python3 tools/bench_pytorch.py --sdpa-attention --config tinyllama-1.1b --seq 1024,2048,4096
  python3 tools/bench_pytorch.py --sdpa-attention --heads 32 --kv-heads 4 --head-dim 64 --seq 4096
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import time

# The built-in table of src/config.c (values of each model's published HF
# config.json). Columns: model_type, vocab, hidden, ffn, layers, heads, kv
# heads, head_dim, max positions, rms eps, rope theta, tied, llama3 rope
# scaling (factor, low, high, original max positions) or None, bos, eos.
BUILTINS = {
    "tiny": ("llama", 320, 128, 384, 4, 4, 2, 32, 1024, 1e-5, 1e4, True, None, 256, 257),
    "cpu-20m": ("llama", 8192, 512, 1536, 6, 8, 2, 64, 2048, 1e-5, 1e4, True, None, None, None),
    "tinyllama-1.1b": ("llama", 32000, 2048, 5632, 22, 32, 4, 64, 2048, 1e-5, 1e4, False, None, 1, 2),
    "qwen2.5-1.5b": ("qwen2", 151936, 1536, 8960, 28, 12, 2, 128, 32768, 1e-6, 1e6, True, None, 151643, 151643),
    "llama3.2-3b": ("llama", 128256, 3072, 8192, 28, 24, 8, 128, 131072, 1e-5, 5e5, True, (32.0, 1.0, 4.0, 8192),
                    128000, 128001),
    "qwen2.5-7b": ("qwen2", 152064, 3584, 18944, 28, 28, 4, 128, 32768, 1e-6, 1e6, False, None, 151643, 151643),
    "llama3.1-8b": ("llama", 128256, 4096, 14336, 32, 32, 8, 128, 131072, 1e-5, 5e5, False, (8.0, 1.0, 4.0, 8192),
                    128000, 128001),
}


def config_dict(name):
    """A HF config.json dict for a built-in name, or the contents of a
    config.json path."""
    if name not in BUILTINS:
        if os.path.isfile(name):
            with open(name) as f:
                return json.load(f)
        raise SystemExit("bench_pytorch: unknown config '%s' (built-in: %s, or a config.json path)"
                         % (name, ", ".join(BUILTINS)))
    mt, V, C, F, L, H, Hkv, D, maxpos, eps, theta, tied, llama3, bos, eos = BUILTINS[name]
    d = {
        "model_type": mt, "vocab_size": V, "hidden_size": C, "intermediate_size": F, "num_hidden_layers": L,
        "num_attention_heads": H, "num_key_value_heads": Hkv, "head_dim": D, "max_position_embeddings": maxpos,
        "rms_norm_eps": eps, "rope_theta": theta, "tie_word_embeddings": tied, "hidden_act": "silu",
        "attention_dropout": 0.0, "bos_token_id": bos, "eos_token_id": eos, "use_cache": False,
    }
    if llama3:
        factor, low, high, orig = llama3
        d["rope_scaling"] = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                             "high_freq_factor": high, "original_max_position_embeddings": orig}
    if mt == "qwen2":
        d["use_sliding_window"] = False
        d["sliding_window"] = None
    return d


def flops_per_token(n_nonembed, layers, seq, hidden):
    """Model FLOPs per token of a dense training step (forward + backward),
    as centrifuge's cf_config_train_flops_per_token (src/engine/flops.c):
    6N (a multiply-add per weight forward, two backward) + 6*L*S*H (causal
    attention: QK^T and PV, 4*S*H per token and layer over all keys, half of
    it under the mask, times 3 with the backward). N = every parameter but
    the input embedding, with the LM head counted once even when tied."""
    return 6.0 * n_nonembed + 6.0 * layers * seq * hidden


def nonembed_params(model, cfg):
    """N of flops_per_token: parameters() lists a tied LM head once (it is
    the embedding), so only an untied model drops the embedding table."""
    n = sum(p.numel() for p in model.parameters())
    if not getattr(cfg, "tie_word_embeddings", False):
        n -= model.get_input_embeddings().weight.numel()
    return n


def build_model(cfgd, dtype, device, torch):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(cfgd)
    mt = kw.pop("model_type")
    cfg = AutoConfig.for_model(mt, **kw)
    cfg.use_cache = False
    major = int(__import__("transformers").__version__.split(".")[0])
    dkw = {"dtype" if major >= 5 else "torch_dtype": dtype}
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", **dkw)
    model.to(device=device, dtype=dtype)
    model.train()
    return model, cfg


LORA_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj",
                "up": "up_proj", "down": "down_proj"}


def lora_wrap(model, args):
    """PEFT LoRA adapters as `centrifuge bench --lora-rank` trains them: rank
    r, alpha, the listed modules (centrifuge's short names, PEFT's *_proj
    names or "all"), no dropout, no bias; the base frozen. PEFT's defaults
    otherwise (adapter weights in fp32 over a bf16 base: autocast_adapter_dtype)."""
    from peft import LoraConfig, get_peft_model
    names = []
    for t in args.lora_targets.split(","):
        t = t.strip()
        if t == "all":
            names += list(LORA_MODULES.values())
        elif t in LORA_MODULES:
            names.append(LORA_MODULES[t])
        elif t in LORA_MODULES.values():
            names.append(t)
        else:
            raise SystemExit("bench_pytorch: --lora-targets: unknown module '%s' (%s, all)"
                             % (t, ",".join(LORA_MODULES)))
    alpha = args.lora_alpha if args.lora_alpha is not None else args.lora_rank
    cfg = LoraConfig(r=args.lora_rank, lora_alpha=alpha, target_modules=sorted(set(names)), lora_dropout=0.0,
                     bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


class Timer:
    """CUDA events on a GPU, perf_counter (after a sync) elsewhere."""

    def __init__(self, torch, cuda):
        self.torch, self.cuda = torch, cuda

    def mark(self):
        if self.cuda:
            e = self.torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b):
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()


def bench_training(args, torch):
    import torch.nn.functional as F

    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16
    amp = args.precision == "amp"
    cfgd = config_dict(args.config)
    model, cfg = build_model(cfgd, torch.float32 if amp else dtype, args.device, torch)
    nparams = sum(p.numel() for p in model.parameters())
    n_flops = nonembed_params(model, cfg)  # with LoRA still the FLOPs of full fine-tuning, as centrifuge bench
    if args.lora_rank:
        model = lora_wrap(model, args)
    params = [p for p in model.parameters() if p.requires_grad]
    V = cfg.vocab_size
    try:
        opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
        fused = True
    except (RuntimeError, TypeError, ValueError) as e:
        if cuda:
            raise
        print("bench_pytorch: fused AdamW unavailable on %s (%s); using foreach" % (args.device, e))
        opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True)
        fused = False
    timer = Timer(torch, cuda)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    rows = []
    A = args.grad_accum
    peak_tflops = args.peak_tflops if args.peak_tflops is not None else (989.0 if cuda else 0.0)
    print("bench_pytorch: %s (%s), %.1fM params, %s, %s, sdpa attention, %s AdamW, grad clip %s, batch %d, "
          "median of %d steps after %d warm-up | torch %s, transformers %s" % (
              args.config, cfg.model_type, nparams / 1e6, torch.cuda.get_device_name() if cuda else args.device,
              "fp32 weights + bf16 autocast" if amp else "bf16 weights", "fused" if fused else "foreach",
              args.grad_clip or "off", args.batch, args.steps, args.warmup, torch.__version__,
              __import__("transformers").__version__))
    if args.lora_rank:
        print("       PEFT %s LoRA: rank %d, alpha %g, targets %s; %.1fM trainable parameters, the base frozen" % (
            __import__("peft").__version__, args.lora_rank,
            args.lora_alpha if args.lora_alpha is not None else args.lora_rank, args.lora_targets,
            sum(p.numel() for p in params) / 1e6))
    if A > 1:
        print("       grad-accum %d: a step is %d micro-batches of %d sequences and one optimizer update; "
              "fwd and bwd summed over them" % (A, A, args.batch))
    if peak_tflops > 0:
        print("       MFU against %g TFLOP/s, FLOPs per token 6N + 6*L*S*H (N = %.1fM); dense-equivalent "
              "for loss-only" % (peak_tflops, n_flops / 1e6))
    print("%6s %5s %-10s %7s %9s %9s %9s %9s %10s %9s%s" % ("seq", "keep", "mode", "kept", "fwd ms", "bwd ms",
                                                             "opt ms", "step ms", "tokens/s", "peak GiB",
                                                             " %6s" % "MFU" if peak_tflops > 0 else ""))
    for S in args.seq:
        B = args.batch
        T = B * S           # tokens per micro-batch
        TS = A * T          # tokens per optimizer step
        fpt = flops_per_token(n_flops, cfg.num_hidden_layers, S, cfg.hidden_size)
        for keep in args.keep:
            for mode in args.modes:
                if mode == "regular" and keep != args.keep[0]:
                    continue  # regular does not depend on keep: once per seq
                k = max(1, int(round(keep * S))) if mode == "loss-only" else S
                micro = [torch.randint(0, V, (B, S + 1), generator=gen).to(args.device) for _ in range(A)]
                times = {"fwd": [], "bwd": [], "opt": [], "step": []}
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                for it in range(args.warmup + args.steps):
                    masks = [None] * A
                    if mode == "loss-only":
                        # exactly k random positions per row, as centrifuge's per-sequence selection;
                        # made before the timed region (centrifuge's selection is not in its times either)
                        for mi in range(A):
                            idx = torch.rand(B, S, generator=gen).argsort(dim=1)[:, :k]
                            masks[mi] = torch.zeros(B, S).scatter_(1, idx, 1.0).view(-1).to(args.device)
                    timer.sync()
                    marks = []  # (start, after forward + loss, after backward) per micro-batch
                    for tokens, mask in zip(micro, masks):
                        x, y = tokens[:, :-1], tokens[:, 1:].reshape(-1)
                        t0 = timer.mark()
                        with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=dtype, enabled=amp):
                            logits = model(input_ids=x).logits
                        # as transformers' own loss: CE on fp32 logits
                        per_tok = F.cross_entropy(logits.float().view(T, -1), y, reduction="none")
                        # a float mask keeps the loss free of host syncs (boolean indexing would sync)
                        loss = per_tok.mean() if mask is None else (per_tok * mask).sum() / mask.sum()
                        if A > 1:
                            loss = loss / A  # the step's loss is the mean over its micro-batches
                        t1 = timer.mark()
                        loss.backward()
                        t2 = timer.mark()
                        marks.append((t0, t1, t2))
                        del logits, per_tok, loss
                    if args.grad_clip > 0:
                        torch.nn.utils.clip_grad_norm_(params, args.grad_clip, foreach=True)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    t3 = timer.mark()
                    timer.sync()
                    if it >= args.warmup:
                        times["fwd"].append(sum(timer.ms(a, b) for a, b, _ in marks))
                        times["bwd"].append(sum(timer.ms(b, c) for _, b, c in marks))
                        times["opt"].append(timer.ms(marks[-1][2], t3))
                        times["step"].append(timer.ms(marks[0][0], t3))
                med = {key: statistics.median(v) for key, v in times.items()}
                peak = torch.cuda.max_memory_allocated() if cuda else None
                tps = TS / (med["step"] / 1e3)
                kept = A * B * k
                model_tflops = fpt * tps / 1e12  # a dense step's FLOPs on the same tokens
                mfu = model_tflops / peak_tflops if peak_tflops > 0 else 0.0
                print("%6d %5.2f %-10s %7d %9.2f %9.2f %9.2f %9.2f %10.0f %9s%s" % (
                    S, keep if mode != "regular" else 1.0, mode, kept, med["fwd"], med["bwd"], med["opt"],
                    med["step"], tps, "%.2f" % (peak / 2**30) if peak is not None else "-",
                    " %5.1f%%" % (100 * mfu) if peak_tflops > 0 else ""))
                sys.stdout.flush()
                rows.append({
                    "engine": "pytorch", "model": args.config, "params": nparams, "device": args.device,
                    "gpu": torch.cuda.get_device_name() if cuda else None, "batch": B, "seq": S,
                    "keep": round(keep if mode != "regular" else 1.0, 4), "mode": mode, "kept": kept,
                    "forward_s": med["fwd"] / 1e3, "filter_s": 0.0, "backward_s": med["bwd"] / 1e3,
                    "optimizer_s": med["opt"] / 1e3, "step_s": med["step"] / 1e3, "tokens_per_s": round(tps, 1),
                    "s_per_1M_tokens": med["step"] / 1e3 / TS * 1e6, "layers": cfg.num_hidden_layers,
                    "steps": args.steps, "peak_mem_bytes": peak, "precision": args.precision,
                    "attn_implementation": "sdpa", "optimizer": "adamw-fused" if fused else "adamw-foreach",
                    "grad_clip": args.grad_clip, "torch": torch.__version__,
                    "transformers": __import__("transformers").__version__,
                    "grad_accum": A, "tokens_per_step": TS, "flops_per_token": fpt,
                    "model_tflops": model_tflops, "peak_tflops": peak_tflops, "mfu": mfu,
                    "mfu_kind": "dense" if mode == "regular" else "dense-equivalent",
                    "lora_rank": args.lora_rank or 0, "lora_targets": args.lora_targets if args.lora_rank else None,
                })
    return rows


def bench_ddp(args, torch):
    """PyTorch's own data parallel under torchrun: DDP + ZeroRedundancyOptimizer
    (AdamW state sharded, as centrifuge's ZeRO-1), micro-batch --batch,
    --grad-accum micro-batches per step (no_sync on all but the last),
    regular and loss-only (keep per sequence). Rank 0 prints tokens/s of all
    ranks; median over --steps after --warmup."""
    import os
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = "cuda:%d" % local
    cfgd = config_dict(args.config)
    model, cfg = build_model(cfgd, torch.bfloat16, dev, torch)
    model = DDP(model, device_ids=[local])
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=args.lr,
                                  betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    V, B, A = cfg.vocab_size, args.batch, args.grad_accum
    n_flops = nonembed_params(model.module, cfg)
    peak_tflops = args.peak_tflops if args.peak_tflops is not None else 989.0
    gen = torch.Generator(device="cpu").manual_seed(args.seed + rank)
    rows = []
    for S in args.seq:
        for mode in args.modes:
            k = max(1, int(round(args.keep[0] * S))) if mode == "loss-only" else S
            times = []
            for it in range(args.warmup + args.steps):
                batches = []
                for _ in range(A):
                    tok = torch.randint(0, V, (B, S + 1), generator=gen).to(dev)
                    mask = None
                    if mode == "loss-only":
                        idx = torch.rand(B, S, generator=gen).argsort(dim=1)[:, :k]
                        mask = torch.zeros(B, S).scatter_(1, idx, 1.0).view(-1).to(dev)
                    batches.append((tok, mask))
                torch.cuda.synchronize()
                dist.barrier()
                t0 = time.perf_counter()
                for mi, (tok, mask) in enumerate(batches):
                    ctx = model.no_sync() if mi < A - 1 else contextlib.nullcontext()
                    with ctx:
                        logits = model(input_ids=tok[:, :-1]).logits
                        per_tok = F.cross_entropy(logits.float().view(B * S, -1), tok[:, 1:].reshape(-1),
                                                  reduction="none")
                        loss = per_tok.mean() if mask is None else (per_tok * mask).sum() / mask.sum()
                        (loss / A).backward()
                    del logits, per_tok, loss
                if args.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip, foreach=True)
                opt.step()
                opt.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                if it >= args.warmup:
                    times.append(time.perf_counter() - t0)
            step = statistics.median(times)
            tps = world * A * B * S / step
            fpt = flops_per_token(n_flops, cfg.num_hidden_layers, S, cfg.hidden_size)
            mfu = fpt * tps / world / (peak_tflops * 1e12) if peak_tflops > 0 else 0.0  # per GPU
            if rank == 0:
                print("ddp %-16s seq %5d %-10s world %d  step %8.1f ms  %10.0f tok/s  peak %.1f GiB%s" % (
                    args.config, S, mode, world, step * 1e3, tps, torch.cuda.max_memory_allocated() / 2**30,
                    "  MFU %.1f%%" % (100 * mfu) if peak_tflops > 0 else ""))
                sys.stdout.flush()
            rows.append({"engine": "pytorch-ddp-zero", "model": args.config, "seq": S, "mode": mode, "world": world,
                         "grad_accum": A, "step_s": step, "tokens_per_s": round(tps, 1), "batch": B,
                         "tokens_per_step": world * A * B * S, "flops_per_token": fpt, "peak_tflops": peak_tflops,
                         "mfu": mfu, "mfu_kind": "dense" if mode == "regular" else "dense-equivalent"})
    dist.destroy_process_group()
    return rows if rank == 0 else []


def sdpa_flops(B, H, S, D):
    fwd = 4.0 * B * H * S * S * D / 2.0  # causal: half of the S x S scores
    return fwd, 2.5 * fwd


def bench_attention(args, torch):
    import torch.nn.functional as F

    cuda = args.device.startswith("cuda")
    H = Hkv = D = None
    if args.config:
        cfgd = config_dict(args.config)
        H = cfgd["num_attention_heads"]
        Hkv = cfgd.get("num_key_value_heads") or H
        D = cfgd.get("head_dim") or cfgd["hidden_size"] // H
    # explicit values win over the config's
    H = args.heads or H
    Hkv = args.kv_heads or (Hkv if not args.heads else None) or H
    D = args.head_dim or D
    if not (H and D):
        raise SystemExit("bench_pytorch: --sdpa-attention needs --config or --heads and --head-dim")
    if H % Hkv:
        raise SystemExit("bench_pytorch: heads %d is not a multiple of kv heads %d" % (H, Hkv))
    B = args.batch
    dtype = torch.bfloat16
    timer = Timer(torch, cuda)
    backend_ctx = None
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                    "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
        if args.sdpa_backend != "auto":
            backend_ctx = lambda: sdpa_kernel(backends[args.sdpa_backend])  # noqa: E731
    except ImportError:
        if args.sdpa_backend != "auto":
            raise SystemExit("bench_pytorch: this torch has no torch.nn.attention.sdpa_kernel; use --sdpa-backend auto")
    import contextlib

    rows = []
    queued = cuda and args.timing == "queued"
    print("bench_pytorch sdpa: B=%d H=%d Hkv=%d D=%d causal, bf16, layout %s, GQA by %s, backend %s, %s, "
          "median of %d after %d warm-up, timing %s" % (B, H, Hkv, D, args.layout, args.gqa, args.sdpa_backend,
                                                       torch.cuda.get_device_name() if cuda else args.device,
                                                       args.steps, args.warmup, "queued" if queued else "sync"))
    print("%6s %9s %9s %10s %10s" % ("seq", "fwd ms", "bwd ms", "fwd TF/s", "bwd TF/s"))
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    for S in args.seq:
        def make(h):
            if args.layout == "bshd":  # token-major storage, as centrifuge and HF's projections produce it
                t = torch.randn(B, S, h, D, generator=g, dtype=torch.float32).to(args.device, dtype)
                return t.transpose(1, 2)
            return torch.randn(B, h, S, D, generator=g, dtype=torch.float32).to(args.device, dtype)

        q = make(H).requires_grad_(True)
        k0, v0 = make(Hkv), make(Hkv)
        kw = {"is_causal": True}
        if Hkv != H and args.gqa == "expand":
            # expanded outside the timed region: the kernel alone is measured
            k = k0.repeat_interleave(H // Hkv, dim=1).detach().requires_grad_(True)
            v = v0.repeat_interleave(H // Hkv, dim=1).detach().requires_grad_(True)
        else:
            k, v = k0.detach().requires_grad_(True), v0.detach().requires_grad_(True)
            if Hkv != H:
                kw["enable_gqa"] = True
        dout = torch.randn(B, H, S, D, generator=g, dtype=torch.float32).to(args.device, dtype)
        fwd_t, bwd_t, marks = [], [], []
        ctx = backend_ctx() if backend_ctx else contextlib.nullcontext()
        try:
            with ctx:
                for it in range(args.warmup + args.steps):
                    if not queued or it == args.warmup:
                        timer.sync()
                    t0 = timer.mark()
                    out = F.scaled_dot_product_attention(q, k, v, **kw)
                    t1 = timer.mark()
                    torch.autograd.grad(out, (q, k, v), dout)
                    t2 = timer.mark()
                    if not queued:
                        timer.sync()
                    if it >= args.warmup:
                        marks.append((t0, t1, t2))
                    del out
                timer.sync()
                for t0, t1, t2 in marks:
                    fwd_t.append(timer.ms(t0, t1))
                    bwd_t.append(timer.ms(t1, t2))
        except RuntimeError as e:
            print("%6d  failed: %s" % (S, str(e).splitlines()[0][:200]))
            rows.append({"engine": "pytorch", "kind": "sdpa_attention", "seq": S, "error": str(e).splitlines()[0]})
            continue
        f_ms, b_ms = statistics.median(fwd_t), statistics.median(bwd_t)
        ff, bf = sdpa_flops(B, H, S, D)
        print("%6d %9.3f %9.3f %10.3g %10.3g" % (S, f_ms, b_ms, ff / f_ms / 1e9, bf / b_ms / 1e9))
        sys.stdout.flush()
        rows.append({"engine": "pytorch", "kind": "sdpa_attention", "batch": B, "heads": H, "kv_heads": Hkv,
                     "head_dim": D, "seq": S, "causal": True, "layout": args.layout, "gqa": args.gqa,
                     "sdpa_backend": args.sdpa_backend, "forward_s": f_ms / 1e3, "backward_s": b_ms / 1e3,
                     "forward_tflops": ff / f_ms / 1e9, "backward_tflops": bf / b_ms / 1e9,
                     "device": args.device, "gpu": torch.cuda.get_device_name() if cuda else None,
                     "steps": args.steps, "torch": torch.__version__})
    return rows


def compare_centrifuge(path, rows):
    """Prints centrifuge tokens/s / pytorch tokens/s for matching rows."""
    cf = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                cf.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise SystemExit("bench_pytorch: %s:%d: not JSON (%s)" % (path, n, e))
    cf = [r for r in cf if r.get("engine", "centrifuge") == "centrifuge" and "tokens_per_s" in r]
    if not cf:
        print("compare: %s has no centrifuge bench rows" % path)
        return
    models = sorted({r.get("model") for r in cf})
    pt_model = rows[0]["model"] if rows else None
    if pt_model not in models:
        print("compare: note: centrifuge rows are for %s, pytorch for %s" % (", ".join(map(str, models)), pt_model))

    def find(mode, seq, keep):
        """tokens/s of the matching centrifuge rows (regular is repeated at
        every keep of a sweep: the mean of those), or None."""
        hits = [r["tokens_per_s"] for r in cf
                if r.get("mode") == mode and r.get("seq") == seq and r.get("batch", 1) == rows[0]["batch"] and
                r.get("grad_accum", 1) == rows[0].get("grad_accum", 1) and
                (mode == "regular" or abs(r.get("keep", -1) - keep) < 1e-6)]
        return sum(hits) / len(hits) if hits else None

    print("\ncentrifuge / pytorch tokens/s (same seq, batch, grad-accum%s):" % (", keep" if len(rows) > 1 else ""))
    print("%6s %5s %-24s %12s %12s %7s" % ("seq", "keep", "centrifuge vs pytorch", "cf tok/s", "pt tok/s", "ratio"))
    for pr in rows:
        pairs = [(pr["mode"], pr["mode"])]
        if pr["mode"] == "loss-only":  # filtering in PyTorch vs filtering in centrifuge
            pairs.append(("centrifuge", "loss-only"))
        for cmode, pmode in pairs:
            c = find(cmode, pr["seq"], pr["keep"])
            if not c:
                continue
            print("%6d %5.2f %-24s %12.0f %12.0f %7.3f" % (
                pr["seq"], pr["keep"], "%s vs %s" % (cmode, pmode), c, pr["tokens_per_s"], c / pr["tokens_per_s"]))


def parse_list(s, conv, what):
    try:
        vals = [conv(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError("%s: bad list '%s'" % (what, s))
    if not vals:
        raise argparse.ArgumentTypeError("%s: empty list" % what)
    return vals


def tree_commit():
    """The short commit of the checkout this script is in, or None."""
    import subprocess
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="PyTorch + transformers (SDPA, bf16, fused AdamW) baseline for `centrifuge bench`.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="built-in configs: %s (the table of src/config.c), or a config.json path." % ", ".join(BUILTINS))
    ap.add_argument("--config", default=None,
                    help="model: built-in name or config.json (default tinyllama-1.1b; optional with "
                         "--sdpa-attention when --heads/--head-dim are given)")
    ap.add_argument("--seq", default="4096", help="comma list of sequence lengths (default 4096)")
    ap.add_argument("--batch", type=int, default=1, help="micro-batch (default 1)")
    ap.add_argument("--modes", default="regular,loss-only", help="comma list of regular, loss-only "
                    "(default both)")
    ap.add_argument("--keep", default="0.5", help="comma list of kept fractions for loss-only (default 0.5)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps, the median is reported (default 10)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    ap.add_argument("--precision", choices=["bf16", "amp"], default="bf16",
                    help="bf16: bf16 weights, grads and AdamW state (default); amp: fp32 weights and "
                         "optimizer state with bf16 autocast (what centrifuge's CUDA backend keeps)")
    ap.add_argument("--grad-clip", type=float, default=1.0,
                    help="global grad-norm clip in the optimizer stage, 0 = off (default 1.0, as centrifuge)")
    ap.add_argument("--lr", type=float, default=1e-5, help="AdamW lr (default 1e-5; timing only)")
    ap.add_argument("--device", default=None, help="torch device (default cuda if available, else cpu)")
    ap.add_argument("--seed", type=int, default=1, help="seed (default 1)")
    ap.add_argument("--ddp", action="store_true", help="PyTorch data parallel (DDP + ZeroRedundancyOptimizer) "
                    "under torchrun; with --grad-accum")
    ap.add_argument("--grad-accum", type=int, default=1,
                    help="micro-batches per optimizer step (default 1); times are per step, forward and "
                         "backward summed over its micro-batches")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="peak TFLOP/s for MFU (default 989 on a GPU: H100/H200 dense bf16; on the CPU MFU only "
                         "with this flag; 0: no MFU). FLOPs per token 6N + 6*L*S*H for every token of the step: "
                         "dense-equivalent MFU for loss-only")
    ap.add_argument("--lora-rank", type=int, default=0, help="PEFT LoRA adapters of this rank, base frozen "
                    "(needs peft; default 0: full fine-tuning)")
    ap.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: the rank)")
    ap.add_argument("--lora-targets", default="q,k,v,o", help="LoRA modules: q,k,v,o,gate,up,down or all "
                    "(default q,k,v,o)")
    ap.add_argument("--json", help="write JSON lines here (centrifuge bench schema + engine, peak_mem_bytes)")
    ap.add_argument("--centrifuge-json", help="JSON lines of `centrifuge bench --json`: print tokens/s ratios")
    g = ap.add_argument_group("attention only (--sdpa-attention)")
    g.add_argument("--sdpa-attention", action="store_true",
                   help="time SDPA causal attention forward and backward alone, with TFLOP/s")
    g.add_argument("--heads", type=int, help="H (default from --config)")
    g.add_argument("--kv-heads", type=int, help="Hkv (default from --config, or H)")
    g.add_argument("--head-dim", type=int, help="D (default from --config)")
    g.add_argument("--gqa", choices=["enable_gqa", "expand"], default="enable_gqa",
                   help="GQA via SDPA's enable_gqa=True (default) or K/V expanded with repeat_interleave "
                        "before timing")
    g.add_argument("--layout", choices=["bshd", "bhsd"], default="bshd",
                   help="storage of q/k/v: bshd = token-major [B,S,H,D] viewed as [B,H,S,D] (as in HF and "
                        "centrifuge; default) or contiguous bhsd")
    g.add_argument("--sdpa-backend", choices=["flash", "efficient", "cudnn", "math", "auto"], default="flash",
                   help="SDPA backend forced with sdpa_kernel (default flash)")
    g.add_argument("--timing", choices=["queued", "sync"], default="queued",
                   help="queued (default): every iteration enqueued without waiting, one CUDA event pair per "
                        "pass, so the GPU runs them back to back and no host launch latency is timed (as "
                        "triton's do_bench, and as in a training step); sync: the device synchronized before "
                        "each iteration (the launch latency of the first kernel is inside the forward's time)")
    args = ap.parse_args(argv)

    try:
        args.seq = parse_list(args.seq, int, "--seq")
        args.keep = parse_list(args.keep, float, "--keep")
        args.modes = parse_list(args.modes, str.strip, "--modes")
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    for m in args.modes:
        if m not in ("regular", "loss-only"):
            ap.error("--modes: unknown mode '%s' (regular, loss-only)" % m)
    if any(not (0 < k <= 1) for k in args.keep):
        ap.error("--keep values must be in (0, 1]")
    if any(s < 1 for s in args.seq) or args.batch < 1 or args.steps < 1 or args.warmup < 0:
        ap.error("--seq, --batch and --steps must be >= 1, --warmup >= 0")
    if args.grad_accum < 1:
        ap.error("--grad-accum must be >= 1, got %d" % args.grad_accum)
    if args.peak_tflops is not None and not args.peak_tflops >= 0:
        ap.error("--peak-tflops must be >= 0, got %g" % args.peak_tflops)
    if not args.sdpa_attention and args.config is None:
        args.config = "tinyllama-1.1b"
    if args.config and args.config not in BUILTINS and not os.path.isfile(args.config):
        ap.error("--config: unknown built-in '%s' and no such file (built-in: %s)"
                 % (args.config, ", ".join(BUILTINS)))

    try:
        import torch
    except ImportError as e:
        print("bench_pytorch: needs torch (%s)" % e, file=sys.stderr)
        return 2
    if not args.sdpa_attention:
        try:
            import transformers  # noqa: F401
        except ImportError as e:
            print("bench_pytorch: needs transformers (%s)" % e, file=sys.stderr)
            return 2
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_pytorch: --device %s but torch sees no CUDA GPU" % args.device, file=sys.stderr)
        return 2
    if not args.device.startswith("cuda"):
        print("bench_pytorch: note: running on %s: a smoke test, not a baseline" % args.device)
    torch.manual_seed(args.seed)

    if args.lora_rank and (args.ddp or args.sdpa_attention):
        raise SystemExit("bench_pytorch: --lora-rank is for the one-GPU training step (not with --ddp or "
                         "--sdpa-attention)")
    rows = (bench_attention(args, torch) if args.sdpa_attention else bench_ddp(args, torch) if args.ddp
            else bench_training(args, torch))
    # every record names the tree that ran it (CF_COMMIT from tools/gpu_session.sh, whose copy
    # of the tree has no .git; else git), one process, no tensor parallelism
    commit = os.environ.get("CF_COMMIT") or tree_commit()
    for r in rows:
        r.setdefault("commit", commit)
        r.setdefault("world_size", 1)
        r.setdefault("tp", 1)
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, args.json)
    if args.centrifuge_json and not args.sdpa_attention:
        compare_centrifuge(args.centrifuge_json, rows)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
