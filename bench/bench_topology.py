#!/usr/bin/env python3
"""Serve topologies A/B on the SIMULATED H100 (Qwen2.5-0.5B shape: device time modelled, host work real).

Each setting (app args over the simulated engine's) is deployed in turn, `--rounds` times, interleaved, so a
noisy VM's slow spells fall on every setting alike. Per deployment: a warm-up, then `--streams` closed-loop
SSE streams of `--max-tokens` greedy tokens for `--seconds` (the load generator is a subprocess, so its CPU is
not the benchmark process's), the CPU each Serve process spent per 1,000 streamed tokens, and the median
one-stream TTFT over 30 requests (first 5 dropped).

    RAY_AUTH_MODE=disabled python bench/bench_topology.py                      # colocated against split
    RAY_AUTH_MODE=disabled python bench/bench_topology.py --settings '{"a": {}, "b": {"colocated": false}}'

Starts its own Ray cluster (loopback only) and shuts it down.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import ray
from ray import serve

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_serve as bs  # noqa: E402 - the Serve helpers (pids, CPU seconds, ports)

from serve_app import build_app  # noqa: E402
from serve_app.builder import apply_cluster_env  # noqa: E402

SETTINGS = {"colocated (default)": {},
            "split, core process": {"colocated": False, "engine_core_process": True},
            "split, core thread": {"colocated": False}}

LOAD = r'''
import asyncio, json, random, sys, time
import httpx
port, streams, tokens, seconds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
words = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river mountain cloud".split()
async def main():
    done, stop, rng = 0, time.perf_counter() + seconds, random.Random(0)
    body = {"model": "tandem-default", "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    async def worker(i):
        nonlocal done
        async with httpx.AsyncClient(timeout=300) as client:
            while time.perf_counter() < stop:
                prompt = " ".join(rng.choice(words) for _ in range(150)) + f" {i}"
                async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions",
                                         json={**body, "prompt": prompt}) as r:
                    if r.status_code != 200:
                        raise RuntimeError(f"HTTP {r.status_code}")
                    async for line in r.aiter_lines():
                        if line.startswith("data: {") and '"usage"' in line:
                            usage = json.loads(line[6:]).get("usage")
                            done += usage["completion_tokens"] if usage else 0
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(streams)))
    print(json.dumps({"tokens": done, "seconds": time.perf_counter() - t0}))
asyncio.run(main())
'''


async def one_stream_ttft(port: int, n: int = 30) -> float:
    body = {"model": "tandem-default", "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True}
    out = []
    async with httpx.AsyncClient(timeout=60) as client:
        for i in range(n):
            t0 = time.perf_counter()
            async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions",
                                     json={**body, "prompt": "alpha beta gamma " * 50 + str(i)}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                        out.append((time.perf_counter() - t0) * 1e3)
                        break
    return statistics.median(out[5:])


def load(port: int, args, seconds: float) -> dict:
    run = subprocess.run([sys.executable, "-c", LOAD, str(port), str(args.streams), str(args.max_tokens),
                          str(seconds)], capture_output=True, text=True, check=True)
    return json.loads(run.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default=None, help="JSON {name: app args}; default: colocated against split")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    settings = json.loads(args.settings) if args.settings else SETTINGS
    apply_cluster_env()
    ray.init(num_cpus=8, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="tdt"),
             namespace="tandem_topology", logging_level="ERROR")
    port = bs.free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = {"model": os.path.normpath(os.path.join(bs.SIM_MODEL, "qwen2.5-0.5b")), "device": "sim",
            "sim_gpu": "h100", "max_num_seqs": 256, "max_model_len": 2048, "max_num_batched_tokens": 2048,
            "served_model_name": "tandem-default"}
    print(f"machine: {bs.machine()}; SIMULATED h100 (qwen2.5-0.5b shape); {args.streams} streams of "
          f"{args.max_tokens} tokens, {args.seconds} s a run", flush=True)
    rows = []
    try:
        for rnd in range(args.rounds):
            for name, extra in settings.items():
                serve.run(build_app({**base, **extra}), name=bs.APP, route_prefix="/")
                load(port, args, 6)  # warm-up
                pids = bs.serve_pids(bs.APP)
                before = {r: bs.cpu_seconds(pid) for r, pid in pids.items()}
                measured = load(port, args, args.seconds)
                tokens = measured["tokens"] or 1
                cpu = {r: round((bs.cpu_seconds(pid) - before[r]) * 1e6 / tokens, 1) for r, pid in pids.items()}
                ttft = asyncio.run(one_stream_ttft(port))
                row = {"round": rnd, "setting": name, "app": extra,
                       "tok_s": round(tokens / measured["seconds"]), "ttft_1_stream_ms": round(ttft, 1),
                       "cpu_ms_per_1k_tokens": cpu, "load_avg_1m": os.getloadavg()[0]}
                rows.append(row)
                print(json.dumps(row), flush=True)
                serve.delete(bs.APP)
    finally:
        serve.shutdown()
        ray.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": bs.machine(), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
