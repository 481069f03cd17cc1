#!/usr/bin/env python3
"""Serve overhead and routing: TTFT and throughput through HTTP vs the engine called directly,
1 vs 2 replicas, prefix-aware routing vs Serve's power-of-two-choices, on a shared-prefix workload, and the
TTFT floor of Ray Serve itself (an app of the same shape with no engine) to split the overhead.

    RAY_AUTH_MODE=disabled python bench/bench_serve.py --json bench/results/serve_cpu.json
    RAY_AUTH_MODE=disabled python bench/bench_serve.py --mode path --device sim --json bench/results/serve_path_sim.json

`--mode path` is the data-path benchmark: one engine replica behind HTTP vs the same engine called directly,
at each of `--levels` concurrencies, beside Ray Serve's floor (a no-engine app of the same shape) at each
level, with the CPU seconds that the proxy, ingress and engine replica processes spent per 1,000 streamed
tokens, and those of this process (`client`, the load generator on the same cores) and of the whole machine.
`--device sim` runs the simulated H100 (Qwen2.5-0.5B shape: the device time is MODELLED, the host work is
real), so the engine is not the bottleneck and what is left is the serving path. Tandem's app runs
as built by default ("http"; on CPU that is the colocated app, one replica with the engine inside, unless
`--app '{"colocated": false}'`), with the engine_transport its default does not pick for the device (grpc on
the simulated one, ray on CPU; split app only), and with the replicas' code where the app does not put it for
the device (serve_app.builder.serve_env: Serve's thread defaults on CPU, Serve's loop elsewhere); the cluster runs
serve_app.builder.CLUSTER_ENV (Serve's proxy on gRPC) unless the environment says otherwise
(RAY_SERVE_PROXY_USE_GRPC=0: Serve's own proxy transport for the whole run; `--direct-ingress`: Serve's direct
ingress for the whole run, the ingress replica serving HTTP on a port of its own with no proxy hop). The settings
run one after
another; `--rounds N` runs them N times, reversing their order every other round, so that a VM's slow spell
does not always fall on the last; `--settings` picks some of them.

One run, one model (default: the embedded model), one seeded workload: `--groups` system prompts of
`--prefix-len` tokens shared by `--requests` requests, each with a unique `--suffix-len`-token tail,
`--max-tokens` greedy tokens, EOS ignored. Streams are read as SSE with httpx; TTFT is the time to the
first content chunk. "direct" runs the same workload through engine.AsyncLLM in this process (no Ray, no
HTTP). Each setting gets a warm-up pass (excluded) on different prompts. Prefix-cache hit rate is read
from every engine replica's routing stats. Starts its own Ray cluster (own temp dir, loopback only) and
shuts it down.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import tempfile
import time
from dataclasses import asdict, dataclass

import httpx
import ray
import torch
from fastapi import FastAPI, Request  # module level: FastAPI resolves the (string) annotations from here
from fastapi.responses import StreamingResponse
from ray import serve

from engine import LLM, AsyncLLM, SamplingParams
from serve_app import build_app
from serve_app.builder import (COLOCATED_DEPLOYMENT, SERVE_ENV, SERVE_ENV_ACCELERATOR, app_core_process,
                               app_is_colocated, apply_cluster_env, engine_transport, serve_env)

APP = "tandem_bench"


@dataclass
class Result:
    setting: str
    requests: int
    concurrency: int
    wall_s: float
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    e2e_p50_ms: float
    prefix_hit_rate: float | None = None
    tokens_per_event: float | None = None  # streamed tokens per content event (HTTP): how much was coalesced


def workload(tokenizer, args, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = [w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 3][:2000]

    def text(n_tokens: int) -> str:
        ids: list[int] = []
        out = ""
        while len(ids) < n_tokens:
            out += " " + rng.choice(words)
            ids = tokenizer.encode(out)
        return out

    prefixes = [text(args.prefix_len) for _ in range(args.groups)]
    return [rng.choice(prefixes) + text(args.suffix_len) for _ in range(args.requests)]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def run_http(port: int, prompts: list[str], args, concurrency: int,
                   rate: float | None = None) -> tuple[float, list, list, int, int]:
    """Closed loop (`concurrency` streams at a time), or open loop with `rate`: Poisson arrivals at that many
    requests a second (seeded), however many are in flight."""
    if rate:
        rng, at, delays = random.Random(args.seed), 0.0, []
        for _ in prompts:
            delays.append(at)
            at += rng.expovariate(rate)
        concurrency = len(prompts)
    else:
        delays = [0.0] * len(prompts)
    sem = asyncio.Semaphore(concurrency)
    ttfts, e2es, tokens = [], [], 0
    events = 0
    body = {"model": "tandem-default", "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}

    url = f"http://127.0.0.1:{port}/v1/completions"

    async def httpx_lines(client: httpx.AsyncClient, payload: dict):
        """One stream's data lines, without the [DONE] one."""
        async with client.stream("POST", url, json=payload) as r:
            if r.status_code != 200:  # a failed request must not count as a fast one
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield line

    async def aiohttp_lines(session, payload: dict):  # the same on aiohttp's C HTTP parser (bytes)
        async with session.post(url, json=payload) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.read())[:300]!r}")
            async for line in r.content:
                if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                    yield line

    async def one(lines, client, prompt: str, delay: float) -> None:
        nonlocal tokens, events
        await asyncio.sleep(delay)
        async with sem:
            t0 = time.perf_counter()
            first = None
            async for line in lines(client, {**body, "prompt": prompt}):
                chunk = json.loads(line[6:])
                events += bool(chunk["choices"])
                if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                    first = time.perf_counter()
                if chunk.get("usage"):
                    tokens += chunk["usage"]["completion_tokens"]
            end = time.perf_counter()
            ttfts.append(((first or end) - t0) * 1e3)
            e2es.append((end - t0) * 1e3)

    if args.client == "aiohttp":
        import aiohttp

        lines, client = aiohttp_lines, aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency + 8),
                                                             timeout=aiohttp.ClientTimeout(total=300))
    else:
        lines, client = httpx_lines, httpx.AsyncClient(timeout=300,
                                                       limits=httpx.Limits(max_connections=concurrency + 8))
    async with client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(lines, client, p, d) for p, d in zip(prompts, delays)))
        return time.perf_counter() - t0, ttfts, e2es, tokens, events


async def run_direct(llm: AsyncLLM, prompts: list[str], args, concurrency: int):
    sem = asyncio.Semaphore(concurrency)
    ttfts, e2es, tokens = [], [], 0
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)

    async def one(prompt: str) -> None:
        nonlocal tokens
        async with sem:
            t0 = time.perf_counter()
            first = None
            async for out in llm.generate(prompt, params):
                if first is None and out.delta_text:
                    first = time.perf_counter()
                if out.finished:
                    tokens += len(out.token_ids)
            end = time.perf_counter()
            ttfts.append(((first or end) - t0) * 1e3)
            e2es.append((end - t0) * 1e3)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - t0, ttfts, e2es, tokens


def run_offline(args, prompts: list[str], concurrency: int):
    """LLM.generate over `prompts` with `concurrency` sequences at a time (max_num_seqs): the engine's own rate,
    no asyncio, no streaming. TTFT counts from the batch's start (every request arrives at once)."""
    llm = LLM(**{**engine_args(args), "max_num_seqs": concurrency})
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    try:
        llm.generate(prompts[:concurrency], params)  # warm-up
        t0, start = time.perf_counter(), time.monotonic()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
    finally:
        llm.shutdown()
    ttfts = [((o.first_token_time or start) - start) * 1e3 for o in outs]
    e2es = [((o.finish_time or start) - start) * 1e3 for o in outs]
    return wall, ttfts, e2es, sum(len(o.token_ids) for o in outs)


def summarize(setting: str, prompts, concurrency: int, measured, hit_rate=None) -> Result:
    wall, ttfts, e2es, tokens, *events = measured
    return Result(setting, len(prompts), concurrency, round(wall, 3), round(tokens / wall, 1),
                  round(percentile(ttfts, 0.5), 2), round(percentile(ttfts, 0.99), 2),
                  round(percentile(e2es, 0.5), 2), hit_rate,
                  round(tokens / events[0], 2) if events and events[0] else None)


def replica_stats() -> list[dict]:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if f"{APP}#EngineReplica" in a["name"]]
    return ray.get([ray.get_actor(n, namespace="serve").record_routing_stats.remote() for n in names])


def hit_rate(before: list[dict], after: list[dict]) -> float:
    hit = sum(s["prefix_cache_hit_tokens"] for s in after) - sum(s["prefix_cache_hit_tokens"] for s in before)
    asked = (sum(s["prefix_cache_queried_tokens"] for s in after)
             - sum(s["prefix_cache_queried_tokens"] for s in before))
    return round(hit / asked, 3) if asked else 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def direct_ingress_port(path: str = "/v1/models", answers=lambda r: r.status_code in (200, 401, 404),
                        timeout_s: float = 60.0) -> int:
    """The port of the app's ingress replica under Serve's direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS=1):
    Serve's controller hands each new ingress replica a port from RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT up,
    keeping a released one out of use for a while, so the port moves from app to app. Found by asking the first
    ports of the range for `path` until a response `answers` (by default any HTTP answer: one app runs at a time
    here, and the floor app has no model list). tests/test_direct_ingress.py asks for Tandem's /health."""
    low = int(os.environ.get("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "30000"))
    high = min(int(os.environ.get("RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT", "31000")), low + 31)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for port in range(low, high + 1):
            try:
                if answers(httpx.get(f"http://127.0.0.1:{port}{path}", timeout=1)):
                    return port
            except httpx.HTTPError:
                continue
        time.sleep(0.5)
    raise RuntimeError(f"no direct-ingress replica answered on ports {low}-{high} within {timeout_s:.0f} s")


def bench_serve(setting: str, app_args: dict, port: int, warm, prompts, args) -> list[Result]:
    serve.run(build_app(app_args), name=APP, route_prefix="/")
    asyncio.run(run_http(port, warm, args, args.concurrency))
    results = []
    for concurrency in (1, args.concurrency):
        subset = prompts[: args.ttft_requests] if concurrency == 1 else prompts
        before = replica_stats()
        measured = asyncio.run(run_http(port, subset, args, concurrency))
        results.append(summarize(setting, subset, concurrency, measured, hit_rate(before, replica_stats())))
    serve.delete(APP)
    return results


def floor_app(max_tokens: int):
    """Ray Serve alone, shaped like Tandem's path (HTTP proxy -> FastAPI ingress -> streaming handle call to
    a second deployment -> SSE), with no engine and no tokenizer: each "token" is yielded at once. Its TTFT
    is the part of Tandem's HTTP overhead that Serve itself costs on this machine."""
    api = FastAPI()

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
    class EchoEngine:
        async def generate(self, n: int):
            for i in range(n):
                yield i

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
    @serve.ingress(api)
    class EchoIngress:
        def __init__(self, engine):
            self.engine = engine.options(stream=True)

        @api.post("/v1/completions")
        async def completions(self, request: Request):
            body = await Request.json(request)  # names Request, so cloudpickle ships it for the annotation
            stream = self.engine.generate.remote(body["max_tokens"])

            async def sse():
                async for i in stream:
                    yield "data: " + json.dumps({"choices": [{"text": f" t{i}", "finish_reason": None}]}) + "\n\n"
                usage = {"completion_tokens": body["max_tokens"]}
                yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\ndata: [DONE]\n\n"
            return StreamingResponse(sse(), media_type="text/event-stream")

    return EchoIngress.bind(EchoEngine.bind())


def bench_floor(port: int, warm, prompts, args) -> list[Result]:
    serve.run(floor_app(args.max_tokens), name=APP, route_prefix="/")
    asyncio.run(run_http(port, warm, args, args.concurrency))
    subset = prompts[: args.ttft_requests]
    result = summarize("Serve floor (no engine)", subset, 1, asyncio.run(run_http(port, subset, args, 1)))
    result.output_tok_s = float("nan")  # nothing is generated: only its TTFT means something
    serve.delete(APP)
    return [result]


def bench_direct(warm, prompts, args) -> list[Result]:
    llm = AsyncLLM(**args.engine)
    asyncio.run(run_direct(llm, warm, args, args.concurrency))
    results = []
    for concurrency in (1, args.concurrency):
        subset = prompts[: args.ttft_requests] if concurrency == 1 else prompts
        s0 = llm.stats()
        measured = asyncio.run(run_direct(llm, subset, args, concurrency))
        s1 = llm.stats()
        asked = s1.prefix_cache_queried_tokens - s0.prefix_cache_queried_tokens
        rate = round((s1.prefix_cache_hit_tokens - s0.prefix_cache_hit_tokens) / asked, 3)
        results.append(summarize("direct (AsyncLLM, 1 engine)", subset, concurrency, measured, rate))
    llm.shutdown()
    return results


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line), "?")
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"ray {ray.__version__}, python {platform.python_version()}")


# ---- --mode path: the serving path at engine speeds it cannot hide behind -----------------------------------
SERVE_DEFAULTS = "http, Serve's thread defaults"  # Tandem with Serve's own user-code thread and router loop
SERVE_LOOP = "http, replica code on Serve's loop"  # SERVE_ENV where the app keeps Serve's thread (off CPU)
OTHER_TRANSPORT = "http, the other engine_transport"  # grpc on the simulated device, ray on CPU (auto's other)
CORE_SHARES_CPUS = "http, core process shares CPUs"  # engine_core_own_cpu=False
CORE_IN_REPLICA = "http, core on a replica thread"  # engine_core_process=False: the engine loop in the replica
SETTING_KEYS = {"Serve floor": "floor", "http": "http", SERVE_DEFAULTS: "serve-threads", SERVE_LOOP: "serve-loop",
                OTHER_TRANSPORT: "transport", CORE_SHARES_CPUS: "shares-cpus",
                CORE_IN_REPLICA: "core-thread"}  # --settings' names
SIM_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "engine", "sim", "models")


def engine_args(args) -> dict:
    if args.device == "sim":
        return {"model": os.path.normpath(os.path.join(SIM_MODEL, args.sim_model)), "device": "sim",
                "sim_gpu": args.sim_gpu, "max_num_seqs": max(256, *args.levels), "max_model_len": 2048,
                "max_num_batched_tokens": max(2048, *args.levels)}
    return {"device": "cpu"}


def actor_pids(title_part: str) -> list[int]:
    """pids of the Ray actor processes whose title (`ray::ServeReplica:APP:DEPLOYMENT`, `ray::ProxyActor`)
    contains `title_part`."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace")
        except (OSError, ValueError):
            continue  # not a process, or gone meanwhile
        if title.startswith("ray::") and title_part in title:
            pids.append(int(entry))
    return pids


def serve_pids(app: str) -> dict[str, int]:
    """pid of the HTTP proxy, the ingress replica and the engine replica (one of each in this benchmark); the
    colocated app's one replica is both, reported as "ingress+engine". "core": the engine core process the
    replica runs (engine/core_proc.py), where it runs one."""
    roles = {"ProxyActor": "proxy", f"{app}:OpenAIIngress": "ingress", f"{app}:EchoIngress": "ingress",
             f"{app}:EngineReplica": "engine", f"{app}:EchoEngine": "engine",
             f"{app}:{COLOCATED_DEPLOYMENT}": "ingress+engine"}
    pids = {role: pids[0] for key, role in roles.items() if (pids := actor_pids(key))}
    core = core_pids()
    if core:
        pids["core"] = core[0]
    return pids


def core_pids() -> list[int]:
    """pids of engine core processes (`python -m engine.core_proc ...`)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"engine.core_proc" in argv[:4]:
            found.append(int(entry))
    return found


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def machine_cpu_seconds() -> float:
    """CPU seconds every process on this machine has spent (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def measure_http(port: int, app: str, prompts, args, concurrency: int, rate: float | None = None):
    """The run's figures, and CPU ms per 1,000 streamed tokens: of each Serve process, of "client" (this process:
    the load generator, on the same cores) and of "machine" (every process, Ray's own among them)."""
    pids = serve_pids(app)
    before = {r: cpu_seconds(p) for r, p in pids.items()}
    client0, machine0 = time.process_time(), machine_cpu_seconds()
    measured = asyncio.run(run_http(port, prompts, args, concurrency, rate))
    tokens = measured[3] or 1
    cpu = {r: round((cpu_seconds(p) - before[r]) * 1000 / tokens, 3) for r, p in pids.items()}
    cpu["client"] = round((time.process_time() - client0) * 1000 / tokens, 3)
    cpu["machine"] = round((machine_cpu_seconds() - machine0) * 1000 / tokens, 3)
    return measured, cpu


def level_prompts(prompts: list[str], concurrency: int, args) -> list[str]:
    n = max(args.min_requests, args.requests_per_stream * concurrency)
    return [prompts[i % len(prompts)] + f" {i}" for i in range(n)]


def other_transport(args) -> str:
    """The engine_transport that "auto" does not pick for this device."""
    return "ray" if engine_transport("auto", args.device) == "grpc" else "grpc"


def bench_path(args, prompts, warm) -> list[dict]:
    rows = []
    llm = AsyncLLM(**engine_args(args))
    asyncio.run(run_direct(llm, warm, args, max(args.levels)))
    for c in args.levels:
        subset = level_prompts(prompts, c, args)
        cpu0 = time.process_time()
        measured = asyncio.run(run_direct(llm, subset, args, c))
        cpu = {"engine": round((time.process_time() - cpu0) * 1000 / (measured[3] or 1), 3)}
        rows.append({"setting": "direct", **asdict(summarize("direct", subset, c, measured)),
                     "cpu_s_per_1k_tokens": cpu})
    llm.shutdown()
    for c in args.levels:  # the engine's own offline rate: LLM.generate with c sequences at a time
        subset = level_prompts(prompts, c, args)
        rows.append({"setting": "offline", **asdict(summarize("offline", subset, c, run_offline(args, subset, c)))})
    ray.init(num_cpus=8, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="tdb"),
             namespace="tandem_bench", logging_level="ERROR")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        tandem = {**engine_args(args), "served_model_name": "tandem-default", **args.app}
        settings = [("Serve floor", floor_app(args.max_tokens)), ("http", build_app(tandem)),
                    (CORE_IN_REPLICA, build_app({**tandem, "engine_core_process": False}))]
        if app_core_process(tandem):  # the replica off the core's CPU (the default), or sharing it
            settings.append((CORE_SHARES_CPUS, build_app({**tandem, "engine_core_own_cpu": False})))
        if not app_is_colocated(tandem):  # colocated (one CPU replica by default): no engine hop to transport
            settings.append((OTHER_TRANSPORT, build_app({**tandem, "engine_transport": other_transport(args)})))
        # the replicas' code where the app does not put it for this device (serve_app.builder.serve_env)
        other_env = (SERVE_DEFAULTS, SERVE_ENV_ACCELERATOR) if serve_env(args.device) == SERVE_ENV else \
            (SERVE_LOOP, SERVE_ENV)
        settings.append((other_env[0], build_app({**tandem, "replica_env": other_env[1]})))
        if args.settings:  # --settings: only the named ones, in their usual order
            settings = [(name, app) for name, app in settings if SETTING_KEYS[name] in args.settings]
        # --rounds N: every setting N times, the order reversed every other round, so a VM's slow spell does not
        # fall on the settings that come last
        for rnd in range(args.rounds):
            for setting, app in settings if rnd % 2 == 0 else settings[::-1]:
                serve.run(app, name=APP, route_prefix="/")
                if args.direct_ingress:
                    port = direct_ingress_port()
                asyncio.run(run_http(port, warm, args, max(args.levels)))
                for c in args.levels:
                    subset = level_prompts(prompts, c, args)
                    measured, cpu = measure_http(port, APP, subset, args, c)
                    rows.append({"setting": setting, **asdict(summarize(setting, subset, c, measured)),
                                 "cpu_s_per_1k_tokens": cpu, "round": rnd})
                for rate in args.rates if setting != "Serve floor" and rnd == 0 else ():
                    subset = [prompts[i % len(prompts)] + f" r{i}" for i in range(int(rate * args.open_loop_s))]
                    measured, cpu = measure_http(port, APP, subset, args, 0, rate)
                    rows.append({"setting": setting, **asdict(summarize(setting, subset, 0, measured)),
                                 "rate_per_s": rate, "cpu_s_per_1k_tokens": cpu})
                serve.delete(APP)
    finally:
        serve.shutdown()
        ray.shutdown()
    return rows


def report_path(rows: list[dict], args) -> None:
    label = (f"SIMULATED {args.sim_gpu} ({args.sim_model} shape; device time modelled, host real)"
             if args.device == "sim" else "CPU engine, embedded model")
    print(f"machine: {machine()}")
    print(f"engine: {label}; {args.max_tokens} greedy tokens per request, EOS ignored; app args {args.app}"
          + ("; Serve's direct ingress (no proxy hop)" if args.direct_ingress else ""))
    print(f"{'setting':30} {'conc':>5} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'tok/event':>9}   "
          "CPU ms per 1k tokens")
    for r in rows:
        cpu = r.get("cpu_s_per_1k_tokens")
        cpu_text = " ".join(f"{k} {v * 1000:.0f}" for k, v in sorted(cpu.items())) if cpu else ""
        name = r["setting"] + (f" #{r['round'] + 1}" if args.rounds > 1 and "round" in r else "")
        print(f"{name:30} {r['concurrency']:>5} {r['output_tok_s']:>9.0f} {r['ttft_p50_ms']:>8.1f}m "
              f"{r['ttft_p99_ms']:>8.1f}m {r['tokens_per_event'] or 0:>9.2f}   {cpu_text}")
    for r in rows:
        if r.get("rate_per_s"):
            print(f"open loop {r['rate_per_s']:g} req/s, {r['setting']}: {r['output_tok_s']:.0f} tok/s, TTFT p50 / p99 "
                  f"{r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} ms, e2e p50 {r['e2e_p50_ms']:.0f} ms, "
                  f"{r['tokens_per_event']} tokens per event")
    if args.rounds > 1:
        for c in args.levels:
            for s in dict.fromkeys(r["setting"] for r in rows if "round" in r):
                mine = [r for r in rows if r["setting"] == s and r["concurrency"] == c and "round" in r]
                print(f"c={c} {s}, rounds 1-{args.rounds}: tok/s "
                      + " / ".join(f"{r['output_tok_s']:.0f}" for r in mine) + ", TTFT p50 ms "
                      + " / ".join(f"{r['ttft_p50_ms']:.1f}" for r in mine))
    for c in args.levels:
        d, o = (next(r for r in rows if r["setting"] == s and r["concurrency"] == c) for s in ("direct", "offline"))
        for s in dict.fromkeys(r["setting"] for r in rows if "round" in r):
            h = next(r for r in rows if r["setting"] == s and r["concurrency"] == c)
            print(f"c={c} {s} (round 1): tok/s {h['output_tok_s'] / o['output_tok_s']:.2f}x offline, "
                  f"{h['output_tok_s'] / d['output_tok_s']:.2f}x direct; TTFT p50 "
                  f"{h['ttft_p50_ms'] - d['ttft_p50_ms']:+.1f} ms over direct")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "engine": label,
                       "args": {k: v for k, v in vars(args).items() if k != "engine"}, "results": rows}, f, indent=2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["routing", "path"], default="routing")
    p.add_argument("--device", choices=["cpu", "sim"], default="cpu", help="path mode: the engine")
    p.add_argument("--sim-gpu", default="h100")
    p.add_argument("--sim-model", default="qwen2.5-0.5b")
    p.add_argument("--levels", default="1,16,64,256", help="path mode: concurrencies")
    p.add_argument("--requests-per-stream", type=int, default=2, help="path mode: requests per concurrency slot")
    p.add_argument("--min-requests", type=int, default=24)
    p.add_argument("--app", default="{}", help="path mode: extra app args as JSON")
    p.add_argument("--rounds", type=int, default=1,
                   help="path mode: run the HTTP settings this many times, alternating their order")
    p.add_argument("--settings", default="",
                   help="path mode: only these HTTP settings, comma-separated from " + ",".join(SETTING_KEYS.values()))
    p.add_argument("--client", choices=["aiohttp", "httpx"], default="aiohttp",
                   help="the load generator's HTTP client (its CPU shares the cores: see the client column); "
                        "records before 2026-12-02 used httpx")
    p.add_argument("--rates", default="", help="path mode: open-loop arrival rates (requests/s), comma-separated")
    p.add_argument("--open-loop-s", type=float, default=20.0, help="path mode: seconds of arrivals per rate")
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--ttft-requests", type=int, default=24, help="requests for the concurrency-1 TTFT run")
    p.add_argument("--groups", type=int, default=6)
    p.add_argument("--prefix-len", type=int, default=192)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--direct-ingress", action="store_true",
                   help="path mode: Serve's direct ingress for the whole run (no proxy hop; docs/serving.md)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    args.engine = {"device": "cpu"}
    args.levels = [int(x) for x in args.levels.split(",") if x]
    args.rates = [float(x) for x in args.rates.split(",") if x]
    args.app = json.loads(args.app)
    args.settings = [x for x in args.settings.split(",") if x]
    unknown = set(args.settings) - set(SETTING_KEYS.values())
    if unknown:
        p.error(f"--settings: unknown {sorted(unknown)}; choose from {sorted(SETTING_KEYS.values())}")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    apply_cluster_env()  # the cluster scripts/serve.sh starts
    if args.direct_ingress:
        if args.mode != "path":
            p.error("--direct-ingress: path mode only")
        os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "1"  # read by every Serve process of the cluster

    probe = AsyncLLM(device="cpu")
    tokenizer = probe.tokenizer
    probe.shutdown()
    prompts, warm = workload(tokenizer, args, args.seed), workload(tokenizer, args, args.seed + 1)
    if args.mode == "path":
        report_path(bench_path(args, prompts, warm), args)
        return

    results = bench_direct(warm, prompts, args)
    ray.init(num_cpus=8, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="tdb"),
             namespace="tandem_bench", logging_level="ERROR")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        results += bench_floor(port, warm, prompts, args)
        # the split app throughout (colocated: false), so that 1 and 2 replicas differ in replicas alone
        for setting, app_args in [("http, 1 replica", {"num_replicas": 1, "colocated": False}),
                                  ("http, 2 replicas, prefix_aware", {"num_replicas": 2, "router": "prefix_aware"}),
                                  ("http, 2 replicas, pow2", {"num_replicas": 2, "router": "pow2"})]:
            results += bench_serve(setting, {**app_args, "device": "cpu"}, port, warm, prompts, args)
    finally:
        serve.shutdown()
        ray.shutdown()
    report(results, args)


def report(results: list[Result], args) -> None:
    print(f"machine: {machine()}")
    print(f"workload: {args.requests} requests, {args.groups} shared prefixes x {args.prefix_len} tokens + "
          f"{args.suffix_len} unique, {args.max_tokens} greedy tokens each, embedded model, CPU")
    head = f"{'setting':34} {'conc':>4} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'e2e p50':>8} {'hit':>6}"
    print(head)
    for r in results:
        hit = "-" if r.prefix_hit_rate is None else f"{r.prefix_hit_rate:.2f}"
        print(f"{r.setting:34} {r.concurrency:>4} {r.output_tok_s:>8.1f} {r.ttft_p50_ms:>8.1f}m "
              f"{r.ttft_p99_ms:>8.1f}m {r.e2e_p50_ms:>7.1f}m {hit:>6}")
    direct1 = next(r for r in results if r.setting.startswith("direct") and r.concurrency == 1)
    http1 = next(r for r in results if r.setting == "http, 1 replica" and r.concurrency == 1)
    direct_c = next(r for r in results if r.setting.startswith("direct") and r.concurrency > 1)
    http_c = next(r for r in results if r.setting == "http, 1 replica" and r.concurrency > 1)
    floor = next((r for r in results if r.setting.startswith("Serve floor")), None)
    print(f"Serve TTFT overhead at concurrency 1: {http1.ttft_p50_ms - direct1.ttft_p50_ms:+.1f} ms (p50); "
          f"throughput http/direct at concurrency {args.concurrency}: "
          f"{http_c.output_tok_s / direct_c.output_tok_s:.2f}")
    if floor is not None:
        print(f"of which Ray Serve alone (a no-engine app of the same shape): {floor.ttft_p50_ms:.1f} ms (p50); "
              f"Tandem's own HTTP-side work: {http1.ttft_p50_ms - direct1.ttft_p50_ms - floor.ttft_p50_ms:+.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "args": {k: v for k, v in vars(args).items() if k != "engine"},
                       "results": [asdict(r) for r in results]}, f, indent=2)


if __name__ == "__main__":
    main()
