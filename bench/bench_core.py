#!/usr/bin/env python3
"""The engine core's targets (issue "engine core in its own process") on the simulated H100. Every figure is
SIMULATED: the host work is real and measured on this machine, the device's time comes from the cost model.

    python bench/bench_core.py busy|length|all|compare|instructions|gc [--out bench/results] [--repeats 3]

busy    Qwen2.5-0.5B shape, the "streams" workload of bench_sim.py (n requests of 128-512 prompt and
        128-512 output tokens at once): device busy fraction and tok/s through `LLM.generate` at 256 streams,
        with this decoder's kernels and with a fused forward's 8 per layer; and through AsyncLLM with 32 and
        256 concurrent asyncio callers, the core on a thread of the caller's process ("async") and in a
        process of its own ("proc", as a Serve replica runs it). Median of --repeats runs.
length  one request of 16,000 output tokens, streamed (an output per commit), through the in-process engine:
        host time per step (the loop thread's CPU time) over its first and last 1,000 steps, and the same
        for a request whose 15,000-token prompt gives it that context from its first step: what grows with
        the context (KV block tables, the device model's attention) apart from what grows with the output; and
        the 16,000-token stream again with repetition and frequency penalties.
        Flat means a request's per-step cost does not grow with its length.

compare busy's variants run alternately from this checkout and from --base DIR (another checkout: a git
        worktree of the commit before a change), each run a fresh process, --repeats pairs: the busy fraction and
        host time per step of both, and CPU per 1,000 tokens of the caller's process and of a core process, pair
        by pair, with the host's speed probe at each run. On the project's VMs the host's speed moves by 2x within
        minutes, so only runs side by side compare. (The harness, bench_sim.py, is each checkout's own.)

depth   pipeline_depth 2 (Photon's two slots) against 3 (three slots: two steps queued on the device while the
        loop commits), alternately in this checkout, --repeats pairs, each run a fresh process: busy, tok/s, host
        time per step and CPU per 1,000 tokens, for `LLM.generate` and the core process at 256 streams (both
        kernel counts) and the core process at 32; `--variants latency` adds one stream's TTFT and inter-token
        time through the core process.

instructions  the same pair of checkouts (--base DIR), counted instead of timed: CPU instructions per step of
        `LLM.generate` at 256 streams under valgrind's cachegrind (the whole run, less a run that only builds the
        engine, over its steps). Independent of the host's speed, so a small change shows on a noisy VM; about
        12 minutes on 2 cores (valgrind runs Python some 20-50x slower).

gc      the loop thread's stalls: `LLM.generate` at 256 streams, --runs runs (default 4) after a warm-up, each
        garbage collection timed (gc.callbacks): per run the pauses' total and the longest, by generation; the
        time the scheduler took in the run's first two steps, which admit the 256 requests (their prompts
        cached by the run before); and the busy fraction. With --base DIR, alternating with that checkout,
        --repeats pairs.

outputs  one long output's cost per output in the frontend and the ingress, for 1k-16k one-token outputs: AsyncLLM's
        collector merging what a caller that fell behind has not taken, the ingress gathering a non-streamed
        response's text, and streaming a chat answer with tools on (flat per output when each costs O(new
        tokens)). With --base DIR, alternating with that checkout, --repeats pairs. Seconds.

penalties  `LLM.generate` at 256 streams with no repetition penalty and with Qwen2.5-Instruct's default (1.05,
        which every request of that model gets from its generation_config): busy and host time per step; and the
        CPU sampler alone with penalties at growing output lengths (ms a step). With --base DIR, alternating with
        that checkout, --repeats pairs.

phases  where the loop's host time goes: `LLM.generate` at 256 streams (busy's steady workload) with the engine
        loop's functions timed (a wrapper each: schedule and its decode passes, staging, sampling inputs, the
        commit and its outputs; us per step, the function's calls included), at pipeline_depth 2 and 3, two runs
        per process after a warm-up. With --base DIR, alternating with that checkout, --repeats pairs.

Writes core_<name>.json and .md under --out, with the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = Path(os.environ.get("TANDEM_BENCH_CODE", ROOT))  # compare's child: the checkout whose engine runs
sys.path.insert(0, str(CODE))
sys.path.insert(0, str(CODE / "bench"))

import bench_sim  # noqa: E402
from engine import EngineConfig, SamplingParams  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from gpu_models import machine  # noqa: E402
from harness import write_results  # noqa: E402

bench_sim.KERNELS.setdefault("fused8", 8)
MODEL = "qwen2.5-0.5b"
BUSY_VARIANTS = [("engine", "engine", 256), ("fused8", "engine", 256), ("engine", "async", 32),
                 ("engine", "proc", 32), ("engine", "async", 256), ("engine", "proc", 256),
                 ("fused8", "proc", 256)]
DEPTH_VARIANTS = ["engine/engine/256", "fused8/engine/256", "engine/proc/256", "fused8/proc/256", "engine/proc/32"]


def busy(args) -> list[dict]:
    rows = []
    for kernels, path, n in BUSY_VARIANTS:
        runs = sorted((bench_sim.stream_run(MODEL, kernels, 2, n, False, path, "steady")
                       for _ in range(args.repeats)), key=lambda r: r["busy"])
        row = runs[len(runs) // 2] | {"busy_runs": [r["busy"] for r in runs]}
        rows.append(row)
        print(f"{kernels:7} {path:6} {n:4} streams: busy {row['busy']:.3f} {row['busy_runs']} "
              f"{row['tok_s']:>7} tok/s  step {row['step_ms']} ms  host/step: "
              + " ".join(f"{k.removesuffix('_us')} {row[k]}" for k in ("schedule_us", "prepare_us", "commit_us",
                                                                        "finalize_us", "stream_us") if k in row),
              flush=True)
    return rows


def _stream_steps(prompt_len: int, n_out: int, **params) -> list[float]:
    """CPU time of the loop thread for each step of one streamed request (an output at every commit); `params`:
    more of its SamplingParams."""
    cfg = EngineConfig(model=bench_sim.model_dir(MODEL), device="sim", sim_gpu="h100",
                       max_model_len=16384 + 64, max_num_seqs=8)
    engine = LLMEngine(cfg)
    engine.add_request([10 + i % 3000 for i in range(prompt_len)],
                       SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0.7, **params), stream=True)
    times, tokens = [], 0
    while engine.has_unfinished():
        t0 = time.thread_time()  # CPU time of this thread: the host work, not the wait for the modelled device
        outs = engine.step()
        times.append(time.thread_time() - t0)
        tokens += sum(len(o.delta_token_ids) for o in outs)
    engine.shutdown()
    assert tokens == n_out, tokens
    return times


def length(args) -> list[dict]:
    window, us = 1000, lambda xs: round(1e6 * statistics.median(xs), 1)
    rows = []
    for _ in range(args.repeats):
        long_out = _stream_steps(32, 16000)
        long_ctx = _stream_steps(15000, window + 10)
        penalized = _stream_steps(32, 16000, repetition_penalty=1.05, frequency_penalty=0.2)
        rows.append({"device": "simulated h100", "model": MODEL,
                     "out16k_first_1000_us": us(long_out[10:10 + window]),
                     "out16k_last_1000_us": us(long_out[-window:]),
                     "ctx15k_first_1000_us": us(long_ctx[-window:]),
                     "penalized_first_1000_us": us(penalized[10:10 + window]),
                     "penalized_last_1000_us": us(penalized[-window:])})
        r = rows[-1]
        r["out16k_last_over_first"] = round(r["out16k_last_1000_us"] / r["out16k_first_1000_us"], 3)
        print(f"one 16,000-token stream, host CPU per step (median): first 1,000 steps {r['out16k_first_1000_us']} "
              f"us, last 1,000 {r['out16k_last_1000_us']} us (x{r['out16k_last_over_first']}); a 15,000-token "
              f"prompt's first 1,000 decode steps {r['ctx15k_first_1000_us']} us; with repetition 1.05 and "
              f"frequency 0.2 penalties {r['penalized_first_1000_us']} -> {r['penalized_last_1000_us']} us",
              flush=True)
    return rows


HOST_KEYS = ("schedule_us", "prepare_us", "commit_us", "finalize_us", "stream_us")


def compare(args) -> list[dict]:
    import subprocess

    if args.base is None:
        raise SystemExit("compare needs --base DIR (a checkout of the revision to compare with)")
    trees = {"base": Path(args.base).resolve(), "this": ROOT}
    revs = {name: subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True,
                                 text=True).stdout.strip() for name, tree in trees.items()}
    variants = [v for v in BUSY_VARIANTS if not args.variants or f"{v[0]}/{v[1]}/{v[2]}" in args.variants]
    rows = []
    for kernels, path, n in variants:
        for pair in range(args.repeats):
            for name in (("base", "this") if pair % 2 == 0 else ("this", "base")):  # who goes first alternates
                rows.append(_variant_run(trees[name], name, revs[name], pair, kernels, path, n))
    return rows


def _variant_run(tree: Path, name: str, rev: str, pair: int, kernels: str, path: str, n: int,
                 depth: int = 2) -> dict:
    """One busy variant in a fresh process of checkout `tree` (compare's and depth's child run), as a row."""
    import json
    import subprocess

    # (the depth only when not 2: a --base checkout from before it took one reads kernels/path/streams)
    cmd = [sys.executable, __file__, "one", "--variant", f"{kernels}/{path}/{n}" + (f"/{depth}" if depth != 2 else "")]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tree,
                         env=os.environ | {"TANDEM_BENCH_CODE": str(tree)})
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode or not lines:
        raise SystemExit(f"{name} run failed ({out.returncode}):\n{out.stderr[-2000:]}{out.stdout[-500:]}")
    r = json.loads(lines[-1])
    row = {"tree": name, "git": rev, "pair": pair, "kernels": kernels, "path": path, "streams": n, "depth": depth,
           "busy": r["busy"], "host_mops": r["host_mops"], "tok_s": r["tok_s"],
           "host_us": round(sum(r.get(k, 0) for k in HOST_KEYS), 1),
           "cpu_ms_per_1k": r.get("cpu_ms_per_1k"), "core_cpu_ms_per_1k": r.get("core_cpu_ms_per_1k")}
    print(f"{kernels:7} {path:6} {n:4} pair {pair} {name:4} ({rev}) depth {depth}: busy {row['busy']:.3f} "
          f"{row['tok_s']:>7} tok/s  host {row['host_us']:7.1f} us/step  CPU ms/1k tokens {row['cpu_ms_per_1k']} "
          f"(core process {row['core_cpu_ms_per_1k']})  probe {row['host_mops']} Mops", flush=True)
    return row


def _one_stream(depth: int, requests: int = 25, warm: int = 5) -> dict:
    """One stream through AsyncLLM with the core in its process (as a replica runs it): 200-token prompts, 32
    greedy tokens each, one request at a time; TTFT and inter-token time, medians over the requests after `warm`."""
    import asyncio

    from engine.async_engine import AsyncLLM

    cfg = EngineConfig(model=bench_sim.model_dir(MODEL), device="sim", sim_gpu="h100", pipeline_depth=depth,
                       max_num_seqs=256, max_model_len=2048, max_num_batched_tokens=2048)

    async def go() -> tuple[list[float], list[float]]:
        llm = AsyncLLM(cfg, core_process=True, core_own_cpu=True)
        ttft, itl = [], []
        try:
            for i in range(requests):
                prompt = [(7 * i + j) % 3000 + 10 for j in range(200)]
                t0 = last = time.perf_counter()
                first = True
                async for out in llm.generate(prompt, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)):
                    now = time.perf_counter()
                    if i >= warm:
                        if first:
                            ttft.append(now - t0)
                        else:
                            itl.append((now - last) / max(1, len(out.delta_token_ids)))
                    first, last = False, now
        finally:
            llm.shutdown()
        return ttft, itl

    ttft, itl = asyncio.run(go())
    return {"ttft_ms": round(1e3 * statistics.median(ttft), 2), "itl_ms": round(1e3 * statistics.median(itl), 3)}


def depth(args) -> list[dict]:
    """pipeline_depth 2 (two slots) against 3 (three slots) in this checkout, alternately, --repeats pairs;
    --variants: any kernels/path/streams (default DEPTH_VARIANTS)."""
    rev, rows = git_rev(), []
    variants = args.variants or DEPTH_VARIANTS
    if "latency" in variants:  # one stream: TTFT and inter-token time, depth 2 and 3 alternating
        for pair in range(args.repeats):
            for d in ((2, 3) if pair % 2 == 0 else (3, 2)):
                rows.append({"pair": pair, "depth": d, "git": rev, **_one_stream(d)})
                print(f"one stream, pair {pair}, depth {d}: TTFT p50 {rows[-1]['ttft_ms']} ms, inter-token p50 "
                      f"{rows[-1]['itl_ms']} ms", flush=True)
        variants = [v for v in variants if v != "latency"]
    for kernels, path, n in (v.split("/") for v in variants):
        for pair in range(args.repeats):
            for d in ((2, 3) if pair % 2 == 0 else (3, 2)):
                rows.append(_variant_run(ROOT, f"d{d}", rev, pair, kernels, path, int(n), depth=d))
    return rows


def instructions(args) -> list[dict]:
    import re
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    if args.base is None:
        raise SystemExit("instructions needs --base DIR (a checkout of the revision to compare with)")
    trees = {"base": Path(args.base).resolve(), "this": ROOT}

    def count(name: str, runs: int) -> tuple[int, int]:
        cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
               sys.executable, __file__, "one", "--variant", "engine/engine/256", "--runs", str(runs)]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=trees[name],
                             env=os.environ | {"TANDEM_BENCH_CODE": str(trees[name]), "PYTHONHASHSEED": "0"})
        refs = re.search(r"I\s+refs:\s+([\d,]+)", out.stderr)
        steps = re.search(r"^steps (\d+)$", out.stdout, re.M)
        if out.returncode or refs is None or steps is None:
            raise SystemExit(f"{name} under valgrind failed:\n{out.stderr[-2000:]}")
        return int(refs.group(1).replace(",", "")), int(steps.group(1))

    rows = []
    with ThreadPoolExecutor(2) as pool:  # both checkouts at once: the counts do not depend on the load
        for runs in (0, 2):
            done = dict(zip(trees, pool.map(lambda name: count(name, runs), trees)))
            rows += [{"tree": name, "runs": runs, "instructions": ir, "steps": st} for name, (ir, st) in done.items()]
    for name in trees:
        empty, full = (next(r for r in rows if r["tree"] == name and r["runs"] == k) for k in (0, 2))
        per_step = (full["instructions"] - empty["instructions"]) / full["steps"]
        full["instructions_per_step"] = round(per_step)
        print(f"{name}: {per_step / 1e6:.2f} M instructions per step over {full['steps']} steps", flush=True)
    return rows


def _alternate(args, cmd: list[str]):
    """Run the child `cmd` from this checkout and from --base (if given) alternately, --repeats pairs, each a
    fresh process of its own checkout; yield (pair, tree name, the JSON of the child's last line that is a
    list)."""
    import json
    import subprocess

    trees = {"this": ROOT} | ({"base": Path(args.base).resolve()} if args.base else {})
    for pair in range(args.repeats):
        for name in (list(trees) if pair % 2 == 0 else list(trees)[::-1]):
            out = subprocess.run([sys.executable, __file__, *cmd], capture_output=True, text=True, cwd=trees[name],
                                 env=os.environ | {"TANDEM_BENCH_CODE": str(trees[name])})
            lines = [x for x in out.stdout.splitlines() if x.startswith("[")]
            if out.returncode or not lines:
                raise SystemExit(f"{name} run failed ({out.returncode}):\n{out.stderr[-2000:]}{out.stdout[-500:]}")
            yield pair, name, git_rev(trees[name]), json.loads(lines[-1])


def gc_pauses(args) -> list[dict]:
    rows = []
    cmd = ["one", "--variant", "engine/engine/256", "--gc", str(args.runs or 4)]
    for pair, name, rev, runs in _alternate(args, cmd):
        for i, run in enumerate(runs):
            rows.append({"tree": name, "git": rev, "pair": pair, "run": i} | run)
            print(f"{name:4} pair {pair} run {i}: busy {run['busy']:.3f}  GC {run['gc_ms']:6.1f} ms in "
                  f"{run['collections']} collections (by generation), longest {run['gc_max_ms']:5.1f} ms; "
                  f"admitting steps' schedule {run['admit_ms']} ms", flush=True)
    return rows


OUTPUT_COUNTS = (1000, 4000, 16000)
OUTPUT_PARTS = {"collector": "AsyncLLM's collector, caller behind", "body": "non-streamed body (Accumulated)",
                "tools": "tool streamer, hermes, content"}


def outputs(args) -> list[dict]:
    rows = []
    for pair, name, rev, runs in _alternate(args, ["one", "--variant", "outputs"]):
        for part, k, seconds in runs:
            rows.append({"tree": name, "git": rev, "pair": pair, "part": part, "outputs": k,
                         "ms": round(1e3 * seconds, 2), "us_per_output": round(1e6 * seconds / k, 3)})
            print(f"{name:4} pair {pair}: {OUTPUT_PARTS[part]:36} {k:6} outputs {1e3 * seconds:9.2f} ms "
                  f"({1e6 * seconds / k:8.3f} us each)", flush=True)
    return rows


def _outputs_child() -> None:
    """outputs' child, this checkout's code: for k one-token outputs of one request, the wall time of
    - collector: AsyncLLM's collector (engine/async_engine.py) when the caller takes nothing while they arrive,
      then takes them as one (k puts, one get);
    - body: the ingress gathering a non-streamed response's text from k chunks (serve_app/responses.py);
    - tools: the ingress streaming a chat answer with tools on (hermes parser) whose k deltas are all content."""
    import asyncio
    import json

    from cluster.protocol import GenerateChunk
    from engine.async_engine import _Collector
    from engine.outputs import RequestOutput
    from serve_app.responses import Accumulated
    from serve_app.tool_parsers import HermesParser, ToolStreamer

    times = []
    for k in OUTPUT_COUNTS:
        loop = asyncio.new_event_loop()
        collector = _Collector(loop)
        outs = [RequestOutput("r", None, [1], [], "", delta_token_ids=[1000 + i % 30000], delta_text=" tok")
                for i in range(k)]
        t0 = time.perf_counter()
        for out in outs:
            collector.put(out)
        got = loop.run_until_complete(collector.get())
        times.append(("collector", k, time.perf_counter() - t0))
        loop.close()
        assert len(got) == 1 and len(got[0].delta_token_ids) == k and len(got[0].delta_text) == 4 * k

        chunks = [GenerateChunk("r", " tok", [1000 + i % 30000], None, i == k - 1, None, 8, i + 1, 0) for i in range(k)]
        acc = Accumulated()
        t0 = time.perf_counter()
        for chunk in chunks:
            acc.add(chunk)
        text = acc.text
        times.append(("body", k, time.perf_counter() - t0))
        assert len(text) == 4 * k

        streamer = ToolStreamer(HermesParser())
        t0 = time.perf_counter()
        deltas = [d for chunk in chunks for d in streamer.feed(chunk.delta_text)] + streamer.finish()
        times.append(("tools", k, time.perf_counter() - t0))
        assert "".join(d["content"] for d in deltas) == " tok" * k
    print(json.dumps(times), flush=True)


PENALTY_RUNS = (1.0, 1.05)  # repetition_penalty: none, and Qwen2.5-Instruct's default (its generation_config)


def penalties(args) -> list[dict]:
    rows = []
    for pair, name, rev, runs in _alternate(args, ["one", "--variant", "penalties"]):
        for run in runs:
            rows.append({"tree": name, "git": rev, "pair": pair} | run)
            if "cpu_sampler_rows" in run:
                print(f"{name:4} pair {pair}: CPU sampler, {run['cpu_sampler_rows']} rows with penalties, "
                      f"{run['output_tokens']} output tokens: {run['ms_per_step']} ms a step", flush=True)
                continue
            print(f"{name:4} pair {pair}: repetition_penalty {run['repetition_penalty']:4}: busy {run['busy']:.3f} "
                  f"{run['tok_s']:>7} tok/s  host/step: schedule {run['schedule_us']} prepare {run['prepare_us']} "
                  f"commit {run['commit_us']} finalize {run['finalize_us']} us; modelled launches "
                  f"{run['launch_us']} us", flush=True)
    return rows


# (module, class, function) the phases mode times; one a checkout lacks is left out of its figures
PHASE_FUNCS = (("engine.scheduler", "Scheduler", "schedule"), ("engine.scheduler", "Scheduler", "_split_running"),
               ("engine.scheduler", "Scheduler", "_schedule_decodes"),
               ("engine.scheduler", "Scheduler", "update_from_output"), ("engine.core", "EngineCore", "_outputs"),
               ("engine.step_runner", "StepRunner", "_stage"), ("engine.step_buffers", "StepBuffers", "stage_step"),
               ("engine.step_buffers", "StepBuffers", "_decode_rows"), ("engine.block_tables", "BlockTables", "rows"),
               ("engine.sampler", "SamplingBatch", "build"))


def _steady_llm(depth: int = 2, n: int = 256, kernels: str = "engine", warm: bool = True):
    """(LLM, requests) of busy's steady workload through `LLM.generate` on the simulated H100: the children that
    time or count the loop in-process (phases, penalties, gc, instructions) all run this engine."""
    import dataclasses

    from engine import LLM

    cfg = EngineConfig(model=bench_sim.model_dir(MODEL), device="sim", sim_gpu="h100", pipeline_depth=depth,
                       max_num_seqs=n, max_model_len=2048, max_num_batched_tokens=max(2048, n),
                       sim_kernels_per_layer=bench_sim.KERNELS[kernels])
    llm = LLM(**dataclasses.asdict(cfg))
    if warm:
        bench_sim.warm(llm)
    return llm, bench_sim.stream_requests(n, False, "steady")


def phases(args) -> list[dict]:
    rows = []
    for depth_ in (2, 3):
        for pair, name, rev, runs in _alternate(args, ["one", "--variant", f"phases/{depth_}"]):
            for i, run in enumerate(runs):
                rows.append({"tree": name, "git": rev, "pair": pair, "depth": depth_, "run": i} | run)
                us = "  ".join(f"{k} {v}" for k, v in run["us_per_step"].items())
                print(f"{name:4} depth {depth_} pair {pair} run {i}: busy {run['busy']:.3f}  us/step: {us}",
                      flush=True)
    return rows


def _phases_child(depth_: int) -> None:
    """phases' child: wrap each PHASE_FUNCS function with a timer, then two timed runs of the steady workload."""
    import collections
    import functools
    import importlib
    import json

    spent = collections.Counter()

    def timed(name, fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t0
        return wrapper

    for module, cls_name, name in PHASE_FUNCS:
        cls = getattr(importlib.import_module(module), cls_name, None)
        raw = cls.__dict__.get(name) if cls is not None else None
        if isinstance(raw, (staticmethod, classmethod)):
            setattr(cls, name, type(raw)(timed(name, raw.__func__)))
        elif raw is not None:
            setattr(cls, name, timed(name, raw))
    llm, reqs = _steady_llm(depth_)
    runs = []
    for _ in range(2):
        bench_sim.settle()
        spent.clear()
        before = llm.engine.stats()
        llm.generate([p for p, _ in reqs], [sp for _, sp in reqs])
        d = bench_sim.delta(llm.engine.stats(), before)
        steps = max(1, d["steps"])
        runs.append({"busy": round(bench_sim.busy_fraction(d), 4), "steps": d["steps"],
                     "host_mops": bench_sim.host_speed(),
                     "us_per_step": {k: round(1e6 * v / steps, 1) for k, v in spent.most_common()}})
    llm.shutdown()
    print(json.dumps(runs), flush=True)


def _penalties_child() -> None:
    """penalties' child: `LLM.generate` at 256 streams (busy's steady workload) with each PENALTY_RUNS value."""
    import dataclasses
    import json

    llm, reqs = _steady_llm()
    runs = []
    for penalty in PENALTY_RUNS:
        bench_sim.settle()
        before, t0 = llm.engine.stats(), time.perf_counter()
        outs = llm.generate([p for p, _ in reqs], [dataclasses.replace(sp, repetition_penalty=penalty)
                                                   for _, sp in reqs])
        wall = time.perf_counter() - t0
        d = bench_sim.delta(llm.engine.stats(), before)
        runs.append({"repetition_penalty": penalty, "busy": round(bench_sim.busy_fraction(d), 4),
                     **bench_sim.rates(sum(len(o.token_ids) for o in outs), wall, d), **bench_sim.host_per_step(d)})
    llm.shutdown()
    runs += _cpu_sampler_penalties()
    print(json.dumps(runs), flush=True)


def _cpu_sampler_penalties(rows: int = 16, vocab: int = 49152) -> list[dict]:
    """The CPU sampler with repetition 1.1 and frequency 0.3 penalties, greedy: a batch built and sampled per step
    for `rows` sequences of `vocab` tokens (SmolLM2's) with 500 / 2,000 / 8,000 output tokens each, one new token
    a row per step, as the engine's CPU runner does it (with its penalty pool where the checkout has one)."""
    import torch

    import engine.sampler as sampler
    from engine.sequence import Sequence

    out = []
    gen = torch.Generator().manual_seed(0)
    for length in (500, 2000, 8000):
        params = SamplingParams(max_tokens=20000, temperature=0.0, repetition_penalty=1.1, frequency_penalty=0.3)
        seqs = []
        for r in range(rows):
            seq = Sequence(f"r{r}", None, [i % vocab for i in range(200)], params, frozenset({0}), 40000, vocab)
            seq.token_ids.extend((i * 7919 + r) % vocab for i in range(length))
            seq.block_table = [1]
            seqs.append(seq)
        kw = {"penalty_pool": sampler.PenaltyPool(2 * rows, vocab, torch.device("cpu"))} \
            if hasattr(sampler, "PenaltyPool") else {}
        sample, logits = sampler.Sampler(0, torch.device("cpu")), torch.randn(rows, vocab, generator=gen)

        def step():
            for seq in seqs:
                seq.token_ids.append(int(torch.randint(vocab, (), generator=gen)))
            sample(logits, sampler.SamplingBatch.build(seqs, torch.device("cpu"), **kw))
        step()
        t0, n = time.perf_counter(), 20
        for _ in range(n):
            step()
        out.append({"cpu_sampler_rows": rows, "output_tokens": length,
                    "ms_per_step": round(1e3 * (time.perf_counter() - t0) / n, 2)})
    return out


def _gc_child(args) -> None:
    """gc_pauses' child: this checkout's engine, --gc runs of the 256-stream workload, each collection timed."""
    import gc
    import json

    llm, reqs = _steady_llm()
    bench_sim.settle()
    pauses, start = [], [0.0]

    def timed(phase, info):
        if phase == "start":
            start[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - start[0]))
    gc.callbacks.append(timed)
    scheduler, admit = llm.engine.core.scheduler, []
    schedule = scheduler.schedule

    def timed_schedule():
        t0 = time.perf_counter()
        try:
            return schedule()
        finally:
            if len(admit) < 2:
                admit.append(round(1e3 * (time.perf_counter() - t0), 2))
    scheduler.schedule = timed_schedule
    runs = []
    for _ in range(args.gc):
        pauses.clear()
        admit.clear()
        before = llm.engine.stats()
        llm.generate([p for p, _ in reqs], [sp for _, sp in reqs])
        d = bench_sim.delta(llm.engine.stats(), before)
        runs.append({"busy": round(bench_sim.busy_fraction(d), 3), "gc_ms": round(1e3 * sum(t for _, t in pauses), 1),
                     "gc_max_ms": round(1e3 * max((t for _, t in pauses), default=0.0), 1),
                     "collections": [sum(1 for g, _ in pauses if g == k) for k in range(3)],
                     "admit_ms": list(admit)})
    gc.callbacks.remove(timed)
    print(json.dumps(runs), flush=True)
    llm.shutdown()


def one(args) -> None:
    import json

    if args.gc:
        return _gc_child(args)
    if args.variant == "outputs":
        return _outputs_child()
    if args.variant == "penalties":
        return _penalties_child()
    if args.variant.startswith("phases/"):
        return _phases_child(int(args.variant.split("/")[1]))

    kernels, path, n, *rest = args.variant.split("/")
    if args.runs is None:
        d = int(rest[0]) if rest else 2  # pipeline_depth
        print(json.dumps(bench_sim.stream_run(MODEL, kernels, d, int(n), False, path, "steady")), flush=True)
        return
    # instructions' child: build the engine, then --runs runs of the workload (no warm-up: it counts, not times)
    llm, reqs = _steady_llm(n=int(n), kernels=kernels, warm=False)
    steps = 0
    for _ in range(args.runs):
        before = llm.engine.stats().steps
        llm.generate([p for p, _ in reqs], [sp for _, sp in reqs])
        steps += llm.engine.stats().steps - before
    print(f"steps {steps}", flush=True)
    llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["busy", "length", "all", "compare", "depth", "instructions", "gc", "outputs",
                                     "penalties", "phases", "one"])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--base", help="compare: the other checkout")
    ap.add_argument("--variants", nargs="*", help="compare: kernels/path/streams of busy's variants (default all)")
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # one: a single run, as JSON (compare's child)
    ap.add_argument("--runs", type=int, help="gc: runs per process (default 4)")  # also instructions' child
    ap.add_argument("--gc", type=int, help=argparse.SUPPRESS)  # one: gc's child, this many runs
    args = ap.parse_args()
    if args.what == "one":
        return one(args)
    info = machine("cpu") | {"device": "simulated h100 (host: " + machine("cpu")["device"] + ")",
                             "git": git_rev()}
    print(info, flush=True)
    for name, fn in (("length", length), ("busy", busy), ("compare", compare), ("depth", depth),
                     ("instructions", instructions),
                     ("gc", gc_pauses), ("outputs", outputs), ("penalties", penalties), ("phases", phases)):
        if args.what == name or (args.what == "all" and name in ("length", "busy")):
            rows = fn(args)
            write_results(args.out / f"core_{name}", f"engine core: {name} (SIMULATED h100)", rows, info)


def git_rev(tree: Path = ROOT) -> str:
    import subprocess

    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True,
                          text=True).stdout.strip()


if __name__ == "__main__":
    main()
