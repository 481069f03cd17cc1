"""Paged prefill attention on the CPU, per instruction-set level: the native kernel's builds
(engine/cpu/prefill_attention.cpp via cpu_native.load(isa)) against what CpuPagedAttention does without it
(gather the chunk's K/V out of the paged cache, then SDPA: TorchPagedAttention._prefill).

One whole prompt per call (all of it one chunk, causal), or with --chunk C as the engine's chunked prefill
does it (consecutive C-token chunks, one call each, every chunk after the first over the cached prefix: SDPA
then takes a boolean mask, built once per step outside the timing as the backend's prepare() does); K/V in
shuffled 16-token blocks; --windows adds sliding-window runs (Gemma 2 and 3's local layers: each query sees
its last W keys; SDPA takes the window as a boolean mask, as the backend builds it). Times are the best of
--reps calls after one warm-up, the columns taking turns (the least disturbed by other processes on a shared
machine; --median for the median); GFLOP/s counts the causal work only, 4 * H * D * the keys each query sees,
summed (n (n + 1) / 2 without a window), for q.k and p.v.

PyTorch's kernels run at ATEN_CPU_CAPABILITY, avx2 unless set otherwise (it must be set before torch is
imported, so this script sets it), so the SDPA column is torch's AVX2 code, the fallback an AVX2-only CPU
runs; Tandem's builds are chosen per column (--isas), whatever torch's level.

    python bench/bench_cpu_prefill_isa.py [--tokens 512 2000] [--isas avx2 avx512 default] [--reps 7] [--threads 1]
        [--chunk 1024] [--shapes Gemma-3-270M] [--windows 0 512]
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.attention import cpu_native  # noqa: E402
from engine.attention.torch_paged import TorchPagedAttention, _PrefillChunk  # noqa: E402

# (name, query heads, KV heads, head dim)
SHAPES = [("SmolLM2-135M", 9, 3, 64), ("Qwen2.5-1.5B", 12, 2, 128), ("Gemma-3-270M", 4, 1, 256)]
BLOCK = 16


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def time_ms(fns: dict, reps: int, median: bool) -> dict:
    """Each function's time in ms, the columns taking turns rep by rep, so a burst of load from another process
    falls on all of them rather than on one column's run."""
    for fn in fns.values():
        fn()  # warm-up: first-touch of the scratch buffers, thread pool start
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(t) if median else min(t)) * 1e3 for name, t in times.items()}


def case(n: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype):
    """One n-token prompt's q and paged caches (blocks shuffled in a pool twice the size), its table."""
    g = torch.Generator().manual_seed(0)
    nblocks = -(-n // BLOCK)
    pool = 2 * nblocks
    k_cache = torch.randn(pool, BLOCK, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(pool, BLOCK, kv_heads, dim, generator=g).to(dtype)
    blocks = torch.randperm(pool, generator=g)[:nblocks]
    q = torch.randn(n, heads, dim, generator=g).to(dtype)
    return q, k_cache, v_cache, blocks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2000])
    ap.add_argument("--isas", nargs="+", default=["avx2", "avx512"], help="Tandem builds to time (columns)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--median", action="store_true", help="report the median call, not the best")
    ap.add_argument("--chunk", type=int, default=0, help="prefill in chunks of this many tokens (0: whole)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--shapes", nargs="+", default=[name for name, *_ in SHAPES], choices=[n for n, *_ in SHAPES],
                    help="model attention shapes to time (rows)")
    ap.add_argument("--windows", type=int, nargs="+", default=[0], help="sliding windows to time (0: full)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    isas = [isa for isa in args.isas if isa in cpu_native.isas()]
    kernels = {isa: cpu_native.load(isa) for isa in isas}
    print(f"CPU: {cpu_model()}; {torch.get_num_threads()} threads; torch {torch.__version__} at "
          f"{torch.backends.cpu.get_cpu_capability()} (ATEN_CPU_CAPABILITY={os.environ['ATEN_CPU_CAPABILITY']}); "
          f"Tandem builds: {', '.join(isas)}")
    cols = ["SDPA"] + [f"kernel {isa}" for isa in isas]
    header = "| shape (H/Hkv/D) | window | dtype | tokens (chunk) | "
    header += " | ".join(f"{c} ms (GFLOP/s)" for c in cols)
    header += " | " + " | ".join(f"{isa} vs SDPA" for isa in isas) + " |"
    print(header)
    print("|" + "---|" * (4 + len(cols) + len(isas)))
    for name, heads, kv_heads, dim, window, dtype_name, n in (
            (*shape, window, dtype_name, n) for shape in SHAPES if shape[0] in args.shapes
            for window in args.windows for dtype_name in args.dtypes for n in args.tokens):
        dtype = getattr(torch, dtype_name)
        q, k_cache, v_cache, blocks = case(n, heads, kv_heads, dim, dtype)
        scale = dim ** -0.5
        keys = sum(min(p + 1, window) if window else p + 1 for p in range(n))
        flops = 4 * heads * dim * keys
        out = torch.empty_like(q)
        step = args.chunk if 0 < args.chunk < n else n
        spans = [(s0, min(n, s0 + step)) for s0 in range(0, n, step)]  # [start, end) of each chunk
        chunks = [_PrefillChunk(s0, s1 - s0, s1, blocks[:-(-s1 // BLOCK)],
                                TorchPagedAttention._chunk_mask(s1 - s0, s1, q.device, window or None))
                  for s0, s1 in spans]

        def sdpa():
            for c in chunks:
                out[c.token_start:c.token_start + c.num_tokens] = TorchPagedAttention._prefill(
                    q[c.token_start:c.token_start + c.num_tokens], k_cache, v_cache, c, scale, None)

        table = blocks.int()[None].contiguous()
        calls = [[torch.tensor([x], dtype=torch.int32) for x in (s0, s1 - s0, s1)] for s0, s1 in spans]

        def native(kernel):
            for lens in calls:
                kernel.paged_prefill(q, k_cache, v_cache, table, *lens, scale, window, 0.0, out)

        fns = {"SDPA": sdpa, **{f"kernel {isa}": functools.partial(native, k) for isa, k in kernels.items()}}
        ms = time_ms(fns, args.reps, args.median)
        sdpa()
        ref = out.float().clone()
        for isa, kernel in kernels.items():
            native(kernel)
            err = (out.float() - ref).abs().max().item()
            if err > (1e-3 if dtype == torch.float32 else 5e-2):
                print(f"warning: {isa} kernel differs from SDPA by {err:.3g}", file=sys.stderr)
        cells = [f"{ms[c]:.2f} ({flops / ms[c] / 1e6:.0f})" for c in cols]
        cells += [f"{ms['SDPA'] / ms[f'kernel {isa}']:.1f}x" for isa in isas]
        size = f"{n} ({step})" if step < n else f"{n}"
        print(f"| {name} ({heads}/{kv_heads}/{dim}) | {window or 'full'} | {dtype_name} | {size} | "
              + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
