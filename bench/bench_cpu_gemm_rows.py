#!/usr/bin/env python3
"""Tandem's CPU GEMM at the row counts of small-batch decode and of a speculative verify step (1-16 rows),
this checkout's kernels against another checkout's, interleaved in one process.

    python bench/bench_cpu_gemm_rows.py --base ../before [--isa avx2] [--json bench/results/gemm_rows.json]

Both checkouts' kernels are built for the same instruction-set level (default: PyTorch's for this CPU) and
loaded side by side (each build is named after its sources and their paths). Shapes are SmolLM2-135M's (qkv,
gate_up, down, LM head); each weight is cycled among 8 copies so it is read from DRAM as in a decode step;
per row count and shape, the best of --repeats interleaved passes, ms per call, fp32 and bf16, 2 threads (the
project's VMs). Prints the CPU it ran on.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16)


def kernels_of(tree: Path, name: str, isa: str | None):
    spec = importlib.util.spec_from_file_location(f"tandem_kernels_{name}", tree / "engine" / "cpu" / "kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    built = module.load(isa)
    if built is None:
        raise SystemExit(f"the CPU kernels of {tree} did not build")
    return built


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, type=Path, help="the other checkout (a worktree of the commit before)")
    ap.add_argument("--isa", default=None, help="instruction-set level (default: PyTorch's for this CPU)")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    mods = {"base": kernels_of(args.base.resolve(), "base", args.isa), "this": kernels_of(ROOT, "this", args.isa)}
    machine = {"cpu": cpu_name(), "cores": os.cpu_count(), "isa": mods["this"].isa,
               "avx512": "avx512f" in open("/proc/cpuinfo").read(), "torch": torch.__version__}
    print(f"machine: {machine}")
    rows = []
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        if str(dtype).removeprefix("torch.") not in getattr(mods["this"], "gemm_dtypes", ()):
            continue
        for shape, (n, k) in SHAPES.items():
            weights = [torch.randn(n, k, generator=gen).to(dtype) for _ in range(8)]
            packs = {name: [m.gemm_pack(w) for w in weights] for name, m in mods.items()}
            best = {(name, m): float("inf") for name in mods for m in ROWS}
            for _ in range(args.repeats):
                for m in ROWS:
                    x = torch.randn(m, k, generator=gen).to(dtype)
                    for name, mod in mods.items():
                        for p in packs[name]:  # warm: the same calls, not timed
                            mod.gemm_linear(x, p, None, n)
                        t = time.perf_counter()
                        for p in packs[name]:
                            mod.gemm_linear(x, p, None, n)
                        best[(name, m)] = min(best[(name, m)], (time.perf_counter() - t) / len(packs[name]))
            for m in ROWS:
                row = {"dtype": str(dtype).removeprefix("torch."), "shape": shape, "n": n, "k": k, "rows": m,
                       "base_ms": round(best[("base", m)] * 1e3, 4), "this_ms": round(best[("this", m)] * 1e3, 4)}
                rows.append(row)
            print(f"{row['dtype']:8} {shape:8} " + "  ".join(
                f"{m}:{best[('base', m)] * 1e3:.3f}->{best[('this', m)] * 1e3:.3f}" for m in ROWS), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "unit": "ms per call, best of interleaved passes",
                                               "results": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
