#!/usr/bin/env python3
"""GPT train step on the CPU in PyTorch: the anchor bench/gpt_step.lua is read against (not a test).

    python3 bench/anchors/torch_cpu_gpt.py [--steps 5] [--warmup 1] [--only L4] [--mp bf16]
        [--world 2] [--threads N] [--sgemm-s 1] [--layers L --d D --heads H]
        [--batch 8] [--ctx 256] [--vocab 256]

The same models, batch and step as bench/gpt_step.lua: GPT L=4 d=256, L=6 d=384, L=12 d=768
(heads d/64), vocab 256, ctx 256, batch 8, pre-LayerNorm blocks with biases (eps 1e-5), tanh
GELU, F.scaled_dot_product_attention (causal), the head tied to the token embedding, GPT-2's
initialisation, AdamW (lr 3e-4, PyTorch's defaults otherwise: the same as fsdp.optim.AdamW's),
random tokens. Forward, backward and optimizer step are timed together; the step time is the
slowest process's, the median of --steps steps after --warmup untimed ones.

  --world 1 (default): one process with torch's default thread count (or --threads).
  --world N: N processes on this machine (spawned here, gloo over 127.0.0.1), each with
      max(1, cores / N) threads (or --threads), FSDP2: fully_shard on every Block, then on the
      root; each process runs its B/N rows of the same global batch.
  --mp bf16: one process under torch.autocast("cpu", bfloat16); N processes with FSDP2's
      MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=f32, output_dtype=f32), as
      fsdp.wrap{mp = "bf16"}.

FLOPs, counted as bench/gpt_step.lua counts them (docs/PERFORMANCE.md): per token 6 x the
non-embedding parameters (every parameter but wte and wpe; the tied head's GEMM not counted) +
6 x L x T x d for causal attention. The same-run sgemm rate is torch.mm in f32 at the MLP's shape
on each process, (B/N x T, d) @ (d, 4d), with the process's threads, all processes at once,
summed; "ratio" is the step's GFLOP/s over it.

Prints a table for people and, per model, one JSON line (it starts with "{") with the keys of
bench/gpt_step.lua's; "info" holds torch's CPU settings instead of fsdp.info().

Requires PyTorch >= 2.6 for --world > 1 (FSDP2 as torch.distributed.fsdp.fully_shard; 2.4-2.5
keep it under torch.distributed._composable.fsdp, also tried). To make an environment for it
(pip's torch wheel for Linux brings CUDA libraries too; they are not used here):

    python3 -m venv ~/venv-torch
    ~/venv-torch/bin/pip install torch numpy
    ~/venv-torch/bin/python bench/anchors/torch_cpu_gpt.py --only L4

Nothing under the build or the tests needs Python; bench/run_cpu_compare.sh runs this script
with $PYTHON interleaved with fsdprun.
"""
import argparse
import json
import math
import os
import socket
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIGS = [("L4-d256", 4, 256, 4), ("L6-d384", 6, 384, 6), ("L12-d768", 12, 768, 12)]
FLOPS_CONVENTION = ("6 x non-embedding params (all but wte, wpe) x tokens"
                    " + 6 x L x T x d per token (causal attention)")


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d, eps=1e-5)
        self.qkv = nn.Linear(d, 3 * d)
        self.attn_proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d, eps=1e-5)
        self.fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        sdpa = getattr(F, "scaled_dot_product_attention", None)
        if sdpa is not None:
            y = sdpa(q, k, v, is_causal=True)
        else:  # PyTorch before 2.0 (a dry run only): the same math, spelled out
            att = (q @ k.transpose(-2, -1)) / math.sqrt(k.shape[-1])
            mask = torch.ones(T, T, dtype=torch.bool).triu(1)
            y = att.masked_fill(mask, float("-inf")).softmax(-1) @ v
        x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, ctx, d, layers, heads):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d, eps=1e-5)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as nn.GPT{tie = true}
        for name, p in self.named_parameters():  # GPT-2's initialisation, as nn.GPT
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def fully_shard_api():
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
        except ImportError:
            sys.exit(f"torch {torch.__version__} has no FSDP2 (fully_shard): --world > 1 needs "
                     "PyTorch >= 2.4")
    return fully_shard, MixedPrecisionPolicy


def sgemm_gflops(m, n, k, seconds, windows=5):
    """f32 c (m, n) = a (m, k) @ b (n, k)^T, as fsdprun's core.sgemm_gflops: GFLOP/s of the
    fastest of `windows` equal windows over at least `seconds` (another tenant's work only ever
    lowers a measured rate)."""
    a = (torch.arange(m * k, dtype=torch.float32) % 7 * 0.1).view(m, k)
    b = (torch.arange(n * k, dtype=torch.float32) % 5 * 0.1).view(n, k)
    c = torch.empty(m, n)
    torch.mm(a, b.t(), out=c)
    best = 0.0
    for _ in range(windows):
        iters, t0 = 0, time.perf_counter()
        while True:
            torch.mm(a, b.t(), out=c)
            iters += 1
            t = time.perf_counter() - t0
            if t >= seconds / windows:
                break
        best = max(best, 2.0 * m * n * k * iters / t / 1e9)
    return best


def torch_info():
    info = {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(),
            "mkl": torch.backends.mkl.is_available(),
            "mkldnn": torch.backends.mkldnn.is_available()}
    try:
        info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        pass
    for line in torch.__config__.show().splitlines():
        line = line.strip()
        if line.startswith("- BLAS_INFO") or line.startswith("BLAS_INFO"):
            info["blas"] = line.split("=", 1)[-1].strip().rstrip(",")
    return info


def loadavg():
    try:
        return [float(x) for x in open("/proc/loadavg").read().split()[:3]]
    except OSError:
        return None


def run(rank, world, args, port):
    threads = args.threads or (max(1, (os.cpu_count() or 1) // world) if world > 1 else None)
    if threads:
        torch.set_num_threads(threads)
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        fully_shard, MixedPrecisionPolicy = fully_shard_api()

    def reduce(x, op):
        if world == 1:
            return x
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=op)
        return t.item()

    def barrier():
        if world > 1:
            dist.barrier()

    say = print if rank == 0 else (lambda *a, **k: None)
    B, T, V = args.batch, args.ctx, args.vocab
    if B % world:
        sys.exit(f"batch {B} does not split over {world} processes")
    configs = CONFIGS
    if args.layers is not None or args.d is not None or args.heads is not None:
        c = (args.layers if args.layers is not None else 4, args.d or 256, args.heads or 4)
        configs = [(f"L{c[0]}-d{c[1]}",) + c]
    precision = args.mp or "f32"
    mode = "fsdp2 full" if world > 1 else "plain"
    sum_op = dist.ReduceOp.SUM if world > 1 else None
    max_op = dist.ReduceOp.MAX if world > 1 else None
    say(f"torch {torch.__version__}, {torch.get_num_threads()} threads per process, "
        f"{json.dumps(torch_info(), sort_keys=True)}")
    say(f"GPT train step, batch {B} x ctx {T}, vocab {V}, tied head, {precision}, {world} "
        f"process(es) ({mode}), median of {args.steps} steps after {args.warmup} warm-up")
    say(f"FLOPs: {FLOPS_CONVENTION}")
    say(f"{'model':9} {'params':>8} {'step s':>9} {'tokens/s':>9} {'GFLOP/s':>9} "
        f"{'sgemm GF/s':>10} {'ratio':>7}")
    g = torch.Generator().manual_seed(1)
    for name, L, d, heads in configs:
        if args.only and args.only not in name:
            continue
        torch.manual_seed(0)
        model = GPT(V, T, d, L, heads)
        params = sum(p.numel() for p in model.parameters())  # the tied matrix once
        nonemb = params - V * d - T * d
        autocast = None
        if world > 1:
            kw, kw_root = {}, {}
            if args.mp:
                half = {"bf16": torch.bfloat16, "f16": torch.float16}[args.mp]
                kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=half,
                                                        reduce_dtype=torch.float32)}
                # the model's output in f32, as fsdp.wrap's mp (the blocks' stay half)
                kw_root = {"mp_policy": MixedPrecisionPolicy(param_dtype=half,
                           reduce_dtype=torch.float32, output_dtype=torch.float32)}
            for b in model.blocks:
                fully_shard(b, **kw)
            fully_shard(model, **kw_root)
        elif args.mp:
            autocast = torch.autocast("cpu", dtype={"bf16": torch.bfloat16,
                                                    "f16": torch.float16}[args.mp])
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        ids = torch.randint(0, V, (B, T + 1), generator=g)
        Bl = B // world  # this process's rows of the global batch
        mine = ids[rank * Bl:(rank + 1) * Bl]
        x, y = mine[:, :-1].contiguous(), mine[:, 1:].contiguous()

        def step():
            if autocast is not None:
                with autocast:
                    logits = model(x)
            else:
                logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, V), y.view(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss.item()

        times, losses = [], []
        for s in range(args.warmup + args.steps):
            barrier()
            t0 = time.perf_counter()
            loss = step()
            dt = reduce(time.perf_counter() - t0, max_op)  # the slowest process sets the pace
            losses.append(reduce(loss, sum_op) / world)
            if s >= args.warmup:
                times.append(dt)
        dt = statistics.median(times)
        r = {
            "bench": "gpt_step", "impl": "pytorch", "version": torch.__version__, "model": name,
            "layers": L, "d": d, "heads": heads, "vocab": V, "ctx": T, "batch": B, "tied": True,
            "ranks": world, "mode": mode, "precision": precision,
            "threads": torch.get_num_threads(), "params": params, "params_nonemb": nonemb,
            "tokens": B * T, "steps": args.steps, "warmup": args.warmup, "step_s": dt,
            "step_min_s": min(times), "step_max_s": max(times), "loss_first": losses[0],
            "loss_last": losses[-1], "flops_convention": FLOPS_CONVENTION, "info": torch_info(),
            "loadavg": loadavg(),
        }
        r["tokens_per_s"] = r["tokens"] / dt
        r["flops_per_step"] = (6 * nonemb + 6 * L * T * d) * r["tokens"]
        r["gflops"] = r["flops_per_step"] / dt / 1e9
        barrier()
        r["sgemm_shape"] = [Bl * T, d, 4 * d]  # M, K, N: (M, K) @ (K, N)
        r["sgemm_gflops"] = reduce(sgemm_gflops(Bl * T, 4 * d, d, args.sgemm_s), sum_op)
        r["ratio"] = r["gflops"] / r["sgemm_gflops"]
        say(f"{name:9} {params / 1e6:7.2f}M {dt:9.3f} {r['tokens_per_s']:9.0f} "
            f"{r['gflops']:9.1f} {r['sgemm_gflops']:10.1f} {r['ratio']:7.2f}")
        say(json.dumps(r, sort_keys=True), flush=True)
        del model, opt
    if world > 1:
        dist.destroy_process_group()
        # gloo's threads sometimes abort in C++ teardown after everything was printed
        # ("terminate called without an active exception"): leave without the destructors
        sys.stdout.flush()
        os._exit(0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--only", default=None, help="models whose name (L4-d256, ...) contains it")
    ap.add_argument("--mp", choices=["bf16", "f16"], default=None)
    ap.add_argument("--world", type=int, default=1, help="processes (FSDP2 over gloo when > 1)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--sgemm-s", type=float, default=1.0)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--d", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=256)
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.world < 1 or args.sgemm_s <= 0:
        ap.error("--steps >= 1, --warmup >= 0, --world >= 1 and --sgemm-s > 0")
    if args.world == 1:
        run(0, 1, args, None)
        return
    with socket.socket() as s:  # a free port on the loopback for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import torch.multiprocessing as mp
    mp.spawn(run, args=(args.world, args, port), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
