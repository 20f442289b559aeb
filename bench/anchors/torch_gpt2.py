#!/usr/bin/env python3
"""GPT-2 small train step in PyTorch: the anchor bench/gpu_step.lua is read against (not a test).

    python3 bench/anchors/torch_gpt2.py [--mode eager|compile|both] [--steps 10] [--warmup 3]
        [--batch 8] [--peak-tflops X] [--json FILE] [--warm-only]
        [--layers 12 --d 768 --heads 12 --vocab 50304 --ctx 1024] [--device cuda]

The same model and step as bench/gpu_step.lua: GPT-2 small (12 layers, d 768, 12 heads, vocab
50304, ctx 1024, pre-LayerNorm blocks with biases, tanh GELU, the head tied to the token
embedding), f32 parameters under bf16 autocast (PyTorch's form of the f32-master / bf16-compute
policy), F.scaled_dot_product_attention (causal), fused AdamW (lr 6e-4, weight decay 0.1), random
tokens, batch 8 x 1024. Modes: eager, and torch.compile of the whole model (the warm-up steps
include the compilation: their time is printed apart).

Prints for each mode what gpu_step.lua prints: median step time (each step ends reading the loss,
which waits for the GPU), tokens/s, TFLOP/s with 6 N + 12 L d T FLOPs per token (N the
parameters but the position embedding, the tied head counted once; attention over the full T x T,
PaLM's convention), MFU over --peak-tflops (bench/cuda/gemm_peak's figure, from the same
scripts/gpu-check run) or else over a bf16 8192^3 torch.matmul measured here, and the peak of
torch.cuda.max_memory_allocated over the timed steps; then one JSON line per mode (also appended
to --json). --warm-only compiles and runs two steps, nothing else: scripts/gpu-check runs it
while the project builds, so that the timed run finds torch.compile's caches warm.
"""
import argparse
import json
import math
import statistics
import sys
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_proj = nn.Linear(4 * d, d)

    def attention(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        sdpa = getattr(F, "scaled_dot_product_attention", None)
        if sdpa is not None:
            y = sdpa(q, k, v, is_causal=True)
        else:  # PyTorch before 2.0 (a cpu dry run only): the same math, spelled out
            att = (q @ k.transpose(-2, -1)) / math.sqrt(k.shape[-1])
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            y = att.masked_fill(mask, float("-inf")).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, ctx, d, layers, heads):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as nn.GPT{tie = true}
        for name, p in self.named_parameters():  # GPT-2's initialisation, as nn.GPT
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.view(-1))


def matmul_peak(device, n=8192, reps=10):
    """bf16 n^3 products through torch.matmul (cuBLAS), random data: TFLOP/s."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - t0) / 1e12


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_mode(mode, args, device, peak, peak_source):
    torch.manual_seed(0)
    model = GPT(args.vocab, args.ctx, args.d, args.layers, args.heads).to(device)
    params = sum(p.numel() for p in model.parameters())  # the tied matrix once
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, **fused)
    step_model = torch.compile(model) if mode == "compile" else model
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.ctx + 1), generator=g).to(device)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    amp = torch.autocast(device.type, dtype=torch.bfloat16)

    def step():
        with amp:
            loss = step_model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()  # waits for the GPU

    losses, times = [], []
    warmup = 2 if args.warm_only else args.warmup
    t_warm = time.perf_counter()
    for _ in range(warmup):
        losses.append(step())
    t_warm = time.perf_counter() - t_warm
    if args.warm_only:
        print(f"torch_gpt2 {mode}: {warmup} warm-up steps in {t_warm:.1f} s (caches warm)")
        return None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t_all = time.perf_counter()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - t_all > args.time_limit:
            break
    dt = statistics.median(times)
    tokens = args.batch * args.ctx
    flops = (6 * (params - args.ctx * args.d) + 12 * args.layers * args.d * args.ctx) * tokens
    tflops = flops / dt / 1e12
    mem = torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else 0.0
    r = {
        "what": "gpu_step", "impl": f"pytorch {mode}", "torch": torch.__version__,
        "mode": "bf16 autocast, f32 parameters", "device": str(device), "params": params,
        "batch": args.batch, "ctx": args.ctx, "steps": len(times), "warmup_s": t_warm,
        "step_ms": 1000 * dt, "tokens_per_s": tokens / dt, "tflops": tflops,
        "peak_tflops": peak, "peak_source": peak_source, "mfu": tflops / peak,
        "peak_mem_gib": mem, "loss_first": losses[0], "loss_last": losses[-1],
    }
    print(f"torch_gpt2 {mode}: GPT {args.layers}L d{args.d} h{args.heads} vocab {args.vocab} "
          f"({params / 1e6:.1f}M parameters), batch {args.batch} x {args.ctx}, {r['mode']}, "
          f"torch {torch.__version__}")
    print(f"  {warmup} warm-up steps in {t_warm:.1f} s; {len(times)} timed steps: median "
          f"{r['step_ms']:.1f} ms, {r['tokens_per_s']:.0f} tokens/s")
    print(f"  {tflops:.1f} TFLOP/s (6N + 12LdT per token), MFU {100 * r['mfu']:.1f}% of "
          f"{peak:.1f} TFLOP/s ({peak_source})")
    print(f"  peak memory (torch.cuda.max_memory_allocated) {mem:.2f} GiB; loss "
          f"{r['loss_first']:.4f} -> {r['loss_last']:.4f}")
    line = json.dumps(r, sort_keys=True)
    print(line, flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(line + "\n")
    del step_model, model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["eager", "compile", "both"], default="both")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--peak-n", type=int, default=8192)
    ap.add_argument("--time-limit", type=float, default=60.0,
                    help="seconds for the timed steps of one mode: stop early past it")
    ap.add_argument("--json", default=None)
    ap.add_argument("--warm-only", action="store_true")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("torch_gpt2: no CUDA device: torch.cuda.is_available() is False")
        return 77
    modes = ["eager", "compile"] if args.mode == "both" else [args.mode]
    if args.warm_only:
        modes = ["compile"]
    peak, source = args.peak_tflops, "gemm_peak (cuBLASLt)"
    if peak is None and not args.warm_only:
        peak, source = matmul_peak(device, args.peak_n), f"torch.matmul bf16 {args.peak_n}^3"
    failed = 0
    for mode in modes:  # a mode that fails (a compiler error, say) leaves the others' figures
        try:
            run_mode(mode, args, device, peak or 1.0, source)
        except Exception:
            traceback.print_exc()
            print(f"torch_gpt2 {mode}: FAILED", flush=True)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
