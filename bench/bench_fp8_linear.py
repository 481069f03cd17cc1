#!/usr/bin/env python3
"""One FP8 linear on CPU at decode shapes: which way to multiply (engine/models/fp8_linear.py).

Per shape (M rows of x; K, N in 576 and 1536, SmolLM2-135M's widths) and activation dtype, median microseconds
of repeated calls (warm-up excluded), in one run:
- scaled_mm: x quantized per token to e4m3, then torch._scaled_mm with row-wise scales (W8A8);
- widened W8A8: Fp8Linear's CPU path: the same quantized x, both operands widened to fp32 by fp8_values, F.linear;
- widened W8A16: Fp8Linear weight-only (x as it is);
- naive dequant: w.float() * scale, then F.linear (torch's own e4m3 widening);
- dense: F.linear on the float weight the model would otherwise hold (4 or 2 bytes a weight).

    python bench/bench_fp8_linear.py              # one intra-op thread (a shared machine's cores stall a team)
    python bench/bench_fp8_linear.py --threads 2
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from engine.models.fp8_linear import E4M3, Fp8Linear, quantize_rows


def median_us(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"{cpu}, {args.threads} thread(s), torch {torch.__version__}, {platform.python_version()}")
    print("dtype     M     K     N  scaled_mm  widened-W8A8  widened-W8A16  naive-dequant  dense   (us)")
    for dtype in (torch.float32, torch.bfloat16):
        for k, n in ((576, 576), (576, 1536), (1536, 576), (1536, 1536)):
            w = torch.randn(n, k) * 0.05
            scale = w.abs().amax(dim=1) / 448
            q = (w / scale[:, None]).to(E4M3)
            w8a8 = Fp8Linear(q, scale, None, "token", dtype)
            w8a16 = Fp8Linear(q, scale, None, None, dtype)
            dense = w.to(dtype)
            for m in (1, 4, 16):
                x = torch.randn(m, k).to(dtype)

                def scaled_mm():
                    xq, xs = quantize_rows(x, None, None)
                    return torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=w8a8.weight_scale, out_dtype=dtype)

                times = [median_us(fn, args.repeats) for fn in (
                    scaled_mm, lambda: w8a8(x), lambda: w8a16(x),
                    lambda: F.linear(x, (q.float() * scale[:, None]).to(dtype)), lambda: F.linear(x, dense))]
                print(f"{str(dtype)[6:]:8s} {m:2d} {k:5d} {n:5d}" + "".join(f"{t:11.0f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
