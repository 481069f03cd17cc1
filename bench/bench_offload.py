#!/usr/bin/env python3
"""KV memory hierarchy under pressure: offload to the host pool vs soft reset (recompute) vs no pressure.

    python bench/bench_offload.py --json bench/results/offload_cpu.json            # CPU
    python bench/bench_offload.py --device cuda --json bench/results/offload_h100.json

One model, one seeded workload (all requests arrive at once; greedy; EOS ignored), three engine settings
timed in interleaved repeats (median reported, warm-up excluded):
  unpressured  a device KV cache that holds the whole workload
  offload      a device KV cache of --kv-fraction of the workload's peak need, plus a host pool
  soft_reset   the same small device cache, no host pool: preempted requests are recomputed
Reported per setting: wall time, output tokens/s, TTFT and end-to-end latency p50/p99, the preemption
counters, blocks copied each way, KV positions recomputed, and whether the outputs equal the unpressured
run's. Then the measured bandwidth of the offload copy path itself (host<->device on CUDA with pinned
memory; a host memcpy on CPU), for the model's real block size.

The model is bench_engine_cpu.py's random-weight Llama (same flags); on CUDA pass a bigger one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine_cpu import QuietGate, build_checkpoint, engine_revision, machine_info, timed  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.kv_offload import KVOffloader  # noqa: E402
from engine.scheduler import SwapOp  # noqa: E402


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def workload(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [[rng.randrange(1, args.vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
            for _ in range(args.num_requests)]


def peak_blocks(prompts: list[list[int]], args) -> int:
    return sum(-(-(len(p) + args.max_new_tokens) // args.block_size) for p in prompts)


class Setting:
    def __init__(self, name: str, model_dir: Path, args, num_kv_blocks: int, num_cpu_blocks: int):
        self.name = name
        self.llm = LLM(str(model_dir), device=args.device, dtype=args.dtype, block_size=args.block_size,
                       num_kv_blocks=num_kv_blocks, num_cpu_blocks=num_cpu_blocks,
                       max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
                       seed=args.seed)
        self.params = SamplingParams(max_tokens=args.max_new_tokens, temperature=0, ignore_eos=True)

    def run(self, prompts):
        before = self.llm.stats()
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, self.params)
        wall = time.perf_counter() - t0
        after = self.llm.stats()
        counters = {k: getattr(after, k) - getattr(before, k) for k in ("num_preemptions", "num_offloads",
                                                        "num_swap_ins", "num_soft_resets", "blocks_swapped_out",
                                                        "blocks_swapped_in", "kv_tokens_discarded", "steps")}
        return wall, outs, counters


def latency(outs) -> dict:
    ttft = [1e3 * (o.first_token_time - o.arrival_time) for o in outs]
    e2e = [1e3 * (o.finish_time - o.arrival_time) for o in outs]
    q = lambda xs, p: statistics.quantiles(xs, n=100)[p - 1]  # noqa: E731
    return {"ttft_p50_ms": statistics.median(ttft), "ttft_p99_ms": q(ttft, 99),
            "e2e_p50_ms": statistics.median(e2e), "e2e_p99_ms": q(e2e, 99)}


def measure(settings, prompts, args) -> dict:
    gate = QuietGate(args.max_others, retries=2, wait_s=60)
    for s in settings:
        log(f"warm-up {s.name}: {s.run(prompts)[0]:.2f}s")
    runs = {s.name: [] for s in settings}
    for i in range(args.repeats):
        for s in settings:
            gate.wait()
            (wall, outs, counters), others = timed(s.run, prompts)
            runs[s.name].append((wall, outs, counters, others))
            log(f"repeat {i + 1} {s.name}: {wall:.2f}s, others used {others:.0%} of CPUs, {counters}")
    ref = runs["unpressured"][-1][1]
    report = {}
    for name, rs in runs.items():
        wall = statistics.median(r[0] for r in rs)
        median_run = min(rs, key=lambda r: abs(r[0] - wall))
        outs = median_run[1]
        tokens = sum(len(o.token_ids) for o in outs)
        report[name] = {"wall_s": wall, "walls_s": [r[0] for r in rs], "others_cpu_frac": [r[3] for r in rs],
                        "output_tok_s": tokens / wall, **latency(outs), **median_run[2],
                        "outputs_equal_unpressured": [o.token_ids for o in outs] == [o.token_ids for o in ref]}
    return report


def copy_bandwidth(llm: LLM, num_blocks: int, repeats: int) -> dict:
    """GB/s of KVOffloader swap-out and swap-in batches of `num_blocks` blocks on the engine's cache."""
    runner = llm.engine.runner
    num_blocks = min(num_blocks, runner.kv_cache.shape[2])
    off = KVOffloader(runner.kv_cache, num_blocks)
    ids = list(range(num_blocks))
    cuda = runner.kv_cache.device.type == "cuda"
    result = {}
    for direction in ("out", "in"):
        times = []
        for _ in range(repeats + 1):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            off.run([SwapOp(direction, ids, ids)])
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        t = statistics.median(times[1:])
        result[f"{'device_to_host' if direction == 'out' else 'host_to_device'}_GBps"] = \
            num_blocks * off.bytes_per_block / t / 1e9
    result.update(blocks=num_blocks, bytes_per_block=off.bytes_per_block, pinned=off.host.is_pinned())
    return result


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--max-position", type=int, default=2048)
    p.add_argument("--init-std", type=float, default=0.1)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--min-prompt", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=384)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--kv-fraction", type=float, default=0.35,
                   help="device KV blocks as a fraction of the workload's peak need (offload, soft_reset)")
    p.add_argument("--copy-blocks", type=int, default=256, help="blocks per batch in the bandwidth test")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-others", type=float, default=0.05)
    p.add_argument("--json", type=Path)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    prompts = workload(args)
    peak = peak_blocks(prompts, args)
    small = max(1, int(args.kv_fraction * peak))
    with tempfile.TemporaryDirectory(prefix="tandem-offload-") as tmp:
        model_dir = build_checkpoint(args, Path(tmp))
        settings = [Setting("unpressured", model_dir, args, peak, 0),
                    Setting("offload", model_dir, args, small, peak),
                    Setting("soft_reset", model_dir, args, small, 0)]
        results = measure(settings, prompts, args)
        bandwidth = copy_bandwidth(settings[0].llm, args.copy_blocks, args.repeats)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else machine_info()["cpu"]
    report = {"command": " ".join(["python"] + sys.argv), "engine_revision": engine_revision(),
              "device": device, "machine": machine_info(), "loadavg": os.getloadavg()[0],
              "workload": {"num_requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
                           "max_new_tokens": args.max_new_tokens, "peak_kv_blocks": peak,
                           "small_kv_blocks": small, "block_size": args.block_size},
              "model": {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "intermediate",
                                                      "vocab", "dtype")},
              "settings": results, "copy_bandwidth": bandwidth}
    print_table(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


def print_table(r: dict) -> None:
    w = r["workload"]
    print(f"\n=== KV pressure: offload vs soft reset, on {r['device']} ===")
    print(f"command : {r['command']} (engine {r['engine_revision']}, load avg {r['loadavg']:.2f})")
    print(f"workload: {w['num_requests']} requests, {w['prompt_tokens']} prompt tokens, {w['max_new_tokens']} new "
          f"each; peak need {w['peak_kv_blocks']} blocks of {w['block_size']}, pressured cache "
          f"{w['small_kv_blocks']}")
    print(f"{'setting':<13}{'wall s':>8}{'tok/s':>8}{'TTFT p50/p99 ms':>18}{'e2e p50/p99 ms':>18}"
          f"{'preempt':>8}{'offload':>8}{'swapin':>7}{'reset':>6}{'blk out/in':>12}{'recomp':>7}  same")
    for name, s in r["settings"].items():
        print(f"{name:<13}{s['wall_s']:>8.2f}{s['output_tok_s']:>8.1f}"
              f"{s['ttft_p50_ms']:>9.0f}/{s['ttft_p99_ms']:<8.0f}{s['e2e_p50_ms']:>9.0f}/{s['e2e_p99_ms']:<8.0f}"
              f"{s['num_preemptions']:>8}{s['num_offloads']:>8}{s['num_swap_ins']:>7}{s['num_soft_resets']:>6}"
              f"{s['blocks_swapped_out']:>6}/{s['blocks_swapped_in']:<5}{s['kv_tokens_discarded']:>7}  "
              f"{s['outputs_equal_unpressured']}")
    b = r["copy_bandwidth"]
    print(f"copy path: {b['blocks']} blocks of {b['bytes_per_block'] / 1024:.0f} KiB, pinned={b['pinned']}: "
          f"device->host {b['device_to_host_GBps']:.1f} GB/s, host->device {b['host_to_device_GBps']:.1f} GB/s")


if __name__ == "__main__":
    main()
