#!/usr/bin/env python3
"""Tandem's CPU GEMM (engine/cpu/gemm.cpp) at one instruction-set level against oneDNN's packed matmul
and plain F.linear at the same level, on SmolLM2-135M's linear shapes.

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python bench/bench_cpu_gemm_isa.py --isa avx2

(--isa avx2 or default sets those two variables itself when they are unset, before torch loads, so PyTorch's and
oneDNN's kernels run at the level Tandem's build is compiled for; ONEDNN_MAX_CPU_ISA=AVX2 leaves oneDNN without
any bf16 matmul, so its column is fp32 only.)

Methods, each y = x @ W^T without bias:
- tandem: gemm_linear on the weight packed by gemm_pack, the kernels of `--isa` (cpu_native.load(isa));
- onednn: torch.ops.mkldnn._linear_pointwise on the weight packed by _reorder_linear_weight (batch hint 64, as
  engine/cpu/linear.py packs it); fp32 only below AVX-512;
- F.linear: torch.nn.functional.linear on the plain weight (MKL sgemm for fp32, its bf16 path for bf16).

Each weight is read from DRAM as in a forward: enough copies of it to exceed the L3 cache are cycled through,
one a call (the 576 x 49,152 LM head is one copy, 113 MB fp32). Figures: GFLOP/s (2 M N K / median time), and
at M = 1 also GB/s of weight streamed (N K bytes-per-element / time). The best of `--reps` timed calls (fewer
for calls over a second) after one warm-up call: on a shared 2-core machine a call whose thread loses its core
for a time slice takes milliseconds longer, so the median measures the neighbours (`--median` reports it). The
fp32 FMA peak at AVX2 width is measured by a small C program (12 independent 8-lane FMA chains a thread, as many
threads as torch uses; the best of 3 rounds), when gcc is there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = [  # name, K (in), N (out): SmolLM2-135M
    ("qkv", 576, 960), ("o_proj", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576), ("lm_head", 576, 49152)]
ROWS = [1, 16, 256, 2048]
L3_BYTES = 64 << 20  # copies of a weight cycled through: at least this many bytes (over a 32 MB L3)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isa", default="avx2", choices=["avx512", "avx2", "default"])
    ap.add_argument("--rows", type=int, nargs="+", default=ROWS)
    ap.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--methods", nargs="+", default=["tandem", "onednn", "F.linear"])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--median", action="store_true", help="the median call instead of the best")
    ap.add_argument("--no-peak", action="store_true", help="skip the FMA peak measurement")
    return ap.parse_args()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        return "?"


PEAK_C = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#define CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
int main(void) {
  const long iters = 100000000L;
  double best = 0;
  for (int round = 0; round < 3; ++round) {
    double t0 = omp_get_wtime();
    float total = 0.f;
    #pragma omp parallel reduction(+ : total)
    {
      const __m256 b = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
  #define DECL(i) __m256 a##i = _mm256_set1_ps((float)i);
      CHAINS(DECL)
      for (long n = 0; n < iters; ++n) {
  #define STEP(i) a##i = _mm256_fmadd_ps(a##i, b, c);
        CHAINS(STEP)
        __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5));
      }
      __m256 s = _mm256_setzero_ps();
  #define SUM(i) s = _mm256_add_ps(s, a##i);
      CHAINS(SUM)
      total += s[0];
    }
    const double t = omp_get_wtime() - t0, gflops = 2.0 * 8 * 12 * iters * omp_get_max_threads() / t / 1e9;
    if (gflops > best) best = gflops;
    if (total == 1234.5f) printf("!");
  }
  printf("%d %.1f\n", omp_get_max_threads(), best);
  return 0;
}
"""


def fma_peak(threads: int) -> str:
    """GFLOP/s of 8-lane fp32 FMAs on `threads` threads (2 flops a lane), or why not."""
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.c", Path(tmp) / "peak"
        src.write_text(PEAK_C)
        try:
            subprocess.run(["gcc", "-O2", "-mavx2", "-mfma", "-fopenmp", str(src), "-o", str(exe)], check=True,
                           capture_output=True)
            out = subprocess.run([str(exe)], check=True, capture_output=True, text=True,
                                 env={**os.environ, "OMP_NUM_THREADS": str(threads)}).stdout.split()
        except (OSError, subprocess.CalledProcessError) as exc:
            return f"unavailable ({type(exc).__name__})"
    return (f"{float(out[1]):.0f} GFLOP/s on {out[0]} threads ({float(out[1]) / int(out[0]):.0f} a thread; "
            f"the best of 3 rounds)")


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def call_time(fn, args_cycle, reps: int, median: bool) -> float:
    fn(*args_cycle[0])  # warm-up (also faults in the output's pages)
    times = []
    for i in range(reps):
        args = args_cycle[(i + 1) % len(args_cycle)]
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
        if sum(times) > 3.0 and len(times) >= 2:  # slow calls (F.linear bf16 below AVX-512, the LM head)
            break
    return statistics.median(times) if median else min(times)


def main() -> None:
    args = parse_args()
    if args.isa in ("avx2", "default"):  # before torch loads: PyTorch's and oneDNN's kernels at the same level
        os.environ.setdefault("ATEN_CPU_CAPABILITY", args.isa)
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2" if args.isa == "avx2" else "SSE41")
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from engine.attention import cpu_native

    kernels = cpu_native.load(args.isa)
    threads = torch.get_num_threads()
    print(f"CPU: {cpu_model()} ({os.cpu_count()} CPUs), torch {torch.__version__}, {threads} threads")
    print(f"levels this CPU runs: {', '.join(cpu_native.isas())}; tandem kernels: {kernels.isa} "
          f"(gemm_dtypes {kernels.gemm_dtypes}); torch capability {torch.backends.cpu.get_cpu_capability()}; "
          f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '(unset)')}")
    if not args.no_peak:
        print(f"fp32 FMA peak at AVX2 width: {fma_peak(threads)}")
    print(f"load average at start: {load_average()}")

    gen = torch.Generator().manual_seed(0)
    print(f"\n{'shape':>8} {'K':>5} {'N':>6} {'dtype':>8} {'M':>5} | "
          + " | ".join(f"{m:>17}" for m in args.methods) + " | tandem/onednn")
    for name, K, N in SHAPES:
        if name not in args.shapes:
            continue
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            wbytes = N * K * dtype.itemsize
            copies = max(1, -(-L3_BYTES // wbytes))
            weights = [torch.randn(N, K, generator=gen).mul_(0.05).to(dtype) for _ in range(copies)]
            packs = {}
            if "tandem" in args.methods and dtype_name in kernels.gemm_dtypes:
                packs["tandem"] = [kernels.gemm_pack(w) for w in weights]
            if "onednn" in args.methods:
                try:
                    packs["onednn"] = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
                    torch.ops.mkldnn._linear_pointwise(torch.randn(1, K).to(dtype), packs["onednn"][0], None,
                                                       "none", [], "")
                except RuntimeError as exc:
                    packs.pop("onednn", None)
                    print(f"  (onednn {dtype_name}: {str(exc).splitlines()[0][:90]})")
            if "F.linear" in args.methods:
                packs["F.linear"] = weights
            for M in args.rows:
                x = torch.randn(M, K, generator=gen).to(dtype)
                calls = {
                    "tandem": lambda p, x=x, N=N: kernels.gemm_linear(x, p, None, N),
                    "onednn": lambda p, x=x: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""),
                    "F.linear": lambda w, x=x: F.linear(x, w),
                }
                cells, gflops = [], {}
                for method in args.methods:
                    if method not in packs:
                        cells.append(f"{'n/a':>17}")
                        continue
                    t = call_time(calls[method], [(p,) for p in packs[method]], args.reps, args.median)
                    gflops[method] = 2 * M * N * K / t / 1e9
                    cell = f"{gflops[method]:6.1f} GF" + (f" {wbytes / t / 1e9:5.1f}GB/s" if M == 1 else " " * 10)
                    cells.append(f"{cell:>17}")
                ratio = (f"{gflops['tandem'] / gflops['onednn']:.2f}x" if "tandem" in gflops and "onednn" in gflops
                         else "")
                print(f"{name:>8} {K:>5} {N:>6} {dtype_name:>8} {M:>5} | " + " | ".join(cells) + f" | {ratio}",
                      flush=True)
            del weights, packs
    print(f"\nload average at end: {load_average()}")


if __name__ == "__main__":
    main()
