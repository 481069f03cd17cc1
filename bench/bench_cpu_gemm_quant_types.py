#!/usr/bin/env python3
"""gemm_q_linear (engine/cpu/gemm_quant.cpp) per GGUF type on Gemma 3 270M's quantized linear shapes, every type at
every shape so the new ones (Q5_0, Q4_K, Q6_K) sit beside Q8_0 and Q4_1 in one run (issue 49).

    python bench/bench_cpu_gemm_quant_types.py                    # this CPU's level, 1 and 2 threads
    python bench/bench_cpu_gemm_quant_types.py --isa avx2 --exact # the AVX2 build, fp32 activations too

Shapes (K in, N out): 640 x 2048 (gate / up; the Q4_K_M file's linears of K = 640 are Q5_0), 2048 x 640 (down:
Q4_K or Q6_K), 1024 x 640 (o_proj: Q4_K). Weights: Q8_0, Q4_1 and Q5_0 quantized by gguf from Gaussian values; Q4_K and
Q6_K random bytes with fp16 scales near 2^-8 (the kernels' time does not depend on the values). Each call reads
its weight from DRAM, as a decode step does: a round calls it once on each of enough copies to exceed --cache-mb
(--hot: 50 calls on one copy, in cache). K-quants need K a multiple of 256 ("-" at 640). Figure: microseconds
per call, the best of --reps rounds (a round's mean; the best, as the machine may be shared) after a warm-up
round.
"""

from __future__ import annotations

import argparse
import platform
import time

import gguf
import numpy as np
import torch

SHAPES = [(640, 2048), (2048, 640), (1024, 640)]
TYPES = ("Q8_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K")
QK = {"Q8_0": 32, "Q4_1": 32, "Q5_0": 32, "Q4_K": 256, "Q6_K": 256}  # weights a block: K's multiple


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isa", choices=["avx512", "avx2", "default"], help="default: the CPU's best")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--types", nargs="+", default=list(TYPES), choices=TYPES)
    ap.add_argument("--exact", action="store_true", help="also fp32 activations (the exact path)")
    ap.add_argument("--hot", action="store_true", help="one copy of each weight, in cache")
    ap.add_argument("--cache-mb", type=int, default=128)
    ap.add_argument("--reps", type=int, default=9)
    return ap.parse_args()


def weight(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, k / QK * block bytes] of `qtype`."""
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype in ("Q8_0", "Q4_1", "Q5_0"):
        return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), kind)
    blocks = n * k // 256
    d = (rng.uniform(0.5, 2.0, (blocks, 2)) * 2.0 ** -8).astype(np.float16).view(np.uint8)
    if qtype == "Q4_K":  # d, dmin, scales, qs
        return np.concatenate((d, rng.integers(0, 256, (blocks, 140), dtype=np.uint8)), axis=1).reshape(n, -1)
    return np.concatenate((rng.integers(0, 256, (blocks, 208), dtype=np.uint8), d[:, :2]), axis=1).reshape(n, -1)


def per_call_us(module, copies, qtype_id: int, x: torch.Tensor, int8: bool, reps: int) -> float:
    best, calls = float("inf"), max(len(copies), 50 if len(copies) == 1 else 0)
    for rep in range(reps + 1):
        start = time.perf_counter()
        for i in range(calls):
            module.gemm_q_linear(x, copies[i % len(copies)], qtype_id, None, int8)
        if rep:  # the first round warms up
            best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main() -> None:
    args = parse_args()
    from engine.cpu import kernels as cpu_native

    module = cpu_native.load(args.isa)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"# {cpu}; kernels {module.isa}; torch {torch.__version__}; "
          f"{'hot (in cache)' if args.hot else f'weights cycled over {args.cache_mb} MB'}; best of {args.reps}")
    rng = np.random.default_rng(0)
    modes = [("int8", True)] + ([("fp32", False)] if args.exact else [])
    print("| x | K x N | M | threads | " + " | ".join(args.types) + " |")
    print("|---|---|---|---|" + "---|" * len(args.types))
    for k, n in SHAPES:
        data = {t: torch.from_numpy(weight(t, n, k, rng)) for t in args.types if k % QK[t] == 0}
        copies = {t: [w] if args.hot else [w.clone() for _ in range(max(1, (args.cache_mb << 20) // w.numel()))]
                  for t, w in data.items()}
        for mode, int8 in modes:
            for m in args.rows:
                x = torch.randn(m, k)
                for threads in args.threads:
                    torch.set_num_threads(threads)
                    us = [f"{per_call_us(module, copies[t], int(gguf.GGMLQuantizationType[t]), x, int8, args.reps):.1f}"
                          if t in data else "-" for t in args.types]
                    print(f"| {mode} | {k} x {n} | {m} | {threads} | " + " | ".join(us) + " |", flush=True)


if __name__ == "__main__":
    main()
