#!/usr/bin/env python3
"""What exporting metrics costs the engine: throughput and TTFT with the replica's metrics exporter
(cluster.metrics.EngineMetrics on real Ray metrics) attached vs not, in the same run, alternating.

    RAY_AUTH_MODE=disabled python bench/bench_metrics.py [--requests 32 --max-tokens 64 --repeats 5]
    RAY_AUTH_MODE=disabled python bench/bench_metrics.py --recording [--tokens 20000 --tokens-per-output 8]

Each setting runs inside a Ray actor (Ray metrics need a worker process), on an engine.AsyncLLM built the
same way the replica builds it, and feeds the exporter exactly what the replica feeds it (every output,
plus the arrival). Seeded prompts, greedy, EOS ignored; one warm-up pass per actor is excluded. Also
reports the flush thread's own time per flush. Starts its own Ray cluster (own temp dir, no dashboard)
and shuts it down.

`--recording`: what recording costs per 1,000 generated tokens, inside a Serve replica (where the metrics get
Serve's labels), with no engine: the exporter fed a synthetic GPU-rate stream (`--tokens` tokens in outputs of
`--tokens-per-output`, one step record per `--rows-per-step` tokens, requests of `--tokens-per-request`), applied
and flushed as the flush thread does, through cluster.metrics' histograms (cluster.metrics.BucketedHistogram)
and through Ray's own Histogram (one call per observation, what the exporter used before), alternating; the
flush thread's CPU time per 1,000 tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
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


def recording_cost(args) -> dict[str, list[float]]:
    """CPU ms per 1,000 tokens of EngineMetrics' flush thread, for each histogram kind (see --recording)."""
    from ray import serve

    @serve.deployment
    class Recorder:
        def run(self, kind: str) -> float:
            from ray.serve import metrics as serve_metrics

            from cluster.metrics import EngineMetrics, ray_metric
            from engine.outputs import RequestOutput, StepRecord

            class RayHistogram:  # the exporter before BucketedHistogram: Ray's Histogram, one call per observation,
                # and the buffer's exact running sum by label set for the `_total` companion
                def __init__(self, spec):
                    self.h = serve_metrics.Histogram(spec.name + "_rayh", spec.description, list(spec.buckets),
                                                     spec.labels or None)
                    self.total, self.sums = ray_metric(spec.sum_spec), {}

                def observe(self, value, tags=None, count=1):
                    for _ in range(count):
                        self.h.observe(value, tags)
                    key = tuple(sorted((tags or {}).items()))
                    self.sums[key] = self.sums.get(key, 0.0) + value * count

                def publish(self):
                    for key, total in self.sums.items():
                        self.total.set(total, dict(key) or None)

            def factory(spec):  # (the Ray Histogram's name apart: its _bucket series would be the gauges')
                return RayHistogram(spec) if kind == "ray" and spec.kind == "histogram" else ray_metric(spec)

            llm = _FakeLLM()
            em = EngineMetrics(llm, period_s=3600.0, factory=factory)
            k, t0 = args.tokens_per_output, time.thread_time()
            for i in range(args.tokens // k):  # outputs of k tokens, each request's last one finishing it
                at = 100.0 + i * 1e-3
                end = (i + 1) * k % args.tokens_per_request == 0
                out = RequestOutput("r", None, [1], [7] * k, "", finished=end, delta_token_ids=[7] * k,
                                    arrival_time=99.0, first_scheduled_time=99.1, first_token_time=99.2,
                                    finish_time=at if end else None, output_time=at)
                em.output(out, at - 0.01)
                if i % (args.rows_per_step // k or 1) == 0:
                    llm.records.append(StepRecord(args.rows_per_step, args.rows_per_step, 0.002, 0.0002, 0.0025))
                if i % 2000 == 0:
                    em.buffer.flush()
            em.buffer.flush()
            spent = time.thread_time() - t0
            em.stop()
            return spent * 1e6 / args.tokens  # ms per 1,000 tokens

    handle = serve.run(Recorder.bind(), name="bench_metrics_recording", route_prefix=None)
    results: dict[str, list[float]] = {"ray": [], "bucketed": []}
    for _ in range(args.repeats):
        for kind in results:
            results[kind].append(handle.run.remote(kind).result())
    serve.shutdown()
    return results


class _FakeLLM:
    """What EngineMetrics reads from the engine: idle stats and the step records the benchmark appends."""

    def __init__(self):
        from engine.stats import EngineStats

        self.records = []
        self._stats = EngineStats(**{f.name: 0 for f in dataclasses.fields(EngineStats)})

    def stats(self):
        return self._stats

    def drain_step_records(self):
        out, self.records = self.records, []
        return out


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 4000) for _ in range(rng.randrange(16, 64))] for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--recording", action="store_true", help="the recording cost alone (see the docstring)")
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--tokens-per-output", type=int, default=8)
    ap.add_argument("--rows-per-step", type=int, default=64)
    ap.add_argument("--tokens-per-request", type=int, default=128)
    ap.add_argument("--json", default=None, help="--recording: write the figures here too")
    args = ap.parse_args()
    temp_dir = tempfile.mkdtemp(prefix="tdb", dir="/tmp")
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    try:
        if args.recording:
            results = recording_cost(args)
            report_recording(args, results)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"machine": f"{cpu_name()}, {os.cpu_count()} cores, ray {ray.__version__}",
                               "args": vars(args), "flush_cpu_ms_per_1k_tokens": results}, f, indent=2)
            return
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


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.machine())


def report_recording(args, results: dict[str, list[float]]) -> None:
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores, ray {ray.__version__}, load avg {os.getloadavg()[0]:.2f}")
    print(f"workload: {args.tokens} tokens in outputs of {args.tokens_per_output}, a step record per "
          f"{args.rows_per_step} tokens, requests of {args.tokens_per_request}; {args.repeats} repeats, alternating")
    names = {"ray": "Ray's Histogram (a call per observation)", "bucketed": "BucketedHistogram"}
    for kind, ms in results.items():
        print(f"  {names[kind]:42s} flush thread CPU per 1,000 tokens: median {statistics.median(ms):6.2f} ms "
              f"(runs: {', '.join(f'{x:.2f}' for x in ms)})")


if __name__ == "__main__":
    main()
