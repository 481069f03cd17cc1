#!/usr/bin/env python3
"""What exporting metrics costs the engine: throughput and TTFT with the replica's metrics exporter
(cluster.metrics.EngineMetrics on real Ray metrics) attached vs not, in the same run, alternating.

    RAY_AUTH_MODE=disabled python bench/bench_metrics.py [--requests 32 --max-tokens 64 --repeats 5]

Each setting runs inside a Ray actor (Ray metrics need a worker process), on an engine.AsyncLLM built the
same way the replica builds it, and feeds the exporter exactly what the replica feeds it (every output,
plus the arrival). Seeded prompts, greedy, EOS ignored; one warm-up pass per actor is excluded. Also
reports the flush thread's own time per flush. Starts its own Ray cluster (own temp dir, no dashboard)
and shuts it down.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import shutil
import statistics
import tempfile
import time

import ray
import torch


@ray.remote(num_cpus=0)
class Runner:
    def __init__(self, with_metrics: bool):
        from cluster.metrics import EngineMetrics
        from engine import AsyncLLM

        self.llm = AsyncLLM()
        self.metrics = EngineMetrics(self.llm) if with_metrics else None
        self.flush_s: list[float] = []
        if self.metrics is not None:
            flush = self.metrics.buffer.flush

            def timed_flush():
                t0 = time.perf_counter()
                flush()
                self.flush_s.append(time.perf_counter() - t0)
            self.metrics.buffer.flush = timed_flush  # the flush thread looks it up on the instance

    async def run(self, prompts: list[list[int]], max_tokens: int) -> dict:
        from engine import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        ttfts = await asyncio.gather(*(self._one(p, params, start) for p in prompts))
        wall = time.perf_counter() - start
        return {"tok_s": len(prompts) * max_tokens / wall, "ttft_p50_ms": 1e3 * statistics.median(ttfts)}

    async def _one(self, prompt, params, start: float) -> float:
        if self.metrics is not None:
            self.metrics.request_arrived(time.time())
        ttft, last = None, None
        async for out in self.llm.generate(prompt, params):
            if ttft is None:
                ttft = time.perf_counter() - start
            if self.metrics is not None:
                last = self.metrics.output(out, last)
        return ttft

    def flush_stats(self) -> dict:
        s = sorted(self.flush_s) or [0.0]
        return {"flushes": len(self.flush_s), "flush_p50_ms": 1e3 * s[len(s) // 2], "flush_max_ms": 1e3 * s[-1]}


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 4000) for _ in range(rng.randrange(16, 64))] for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    temp_dir = tempfile.mkdtemp(prefix="tdb", dir="/tmp")
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    try:
        runners = {name: Runner.remote(name == "metrics") for name in ("no-metrics", "metrics")}
        for r in runners.values():  # warm-up, excluded
            ray.get(r.run.remote(prompts(8, seed=999), 8))
        results: dict[str, list[dict]] = {name: [] for name in runners}
        for i in range(args.repeats):  # alternate, so load changes hit both settings alike
            for name, r in runners.items():
                results[name].append(ray.get(r.run.remote(prompts(args.requests, seed=i), args.max_tokens)))
        report(args, results, ray.get(runners["metrics"].flush_stats.remote()))
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def report(args, results: dict[str, list[dict]], flush: dict) -> None:
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}, load avg {os.getloadavg()[0]:.2f} (other work shares these cores)")
    print(f"workload: {args.requests} concurrent requests x {args.max_tokens} tokens, embedded model, CPU, "
          f"{args.repeats} repeats, medians")
    for name, runs in results.items():
        tok_s = [r["tok_s"] for r in runs]
        print(f"  {name:11s} output tok/s {statistics.median(tok_s):8.1f}  (min {min(tok_s):.1f}, "
              f"max {max(tok_s):.1f})  TTFT p50 {statistics.median(r['ttft_p50_ms'] for r in runs):7.1f} ms")
    print(f"  flush thread: {flush['flushes']} flushes, p50 {flush['flush_p50_ms']:.2f} ms, "
          f"max {flush['flush_max_ms']:.2f} ms")


if __name__ == "__main__":
    main()
