#!/usr/bin/env python3
"""The engine's host path at GPU speed, on the simulated accelerator (engine/sim). Every figure is SIMULATED:
the host work is real and measured on this machine, the device's time comes from the cost model.

    python bench/bench_sim.py photon|streams|throughput|mixed|all [--out bench/results] [--quick]

photon      Photon's tables on photon-3090 and photon-b200 (moondream2's text decoder, a 740-token prompt,
            temperature sampling ending on EOS after ~110 tokens): 1, 8, 32 streams, blocking
            (pipeline_depth=1) vs pipelined (2): forward, sampling, period, GPU idle per step, the cost
            model's predicted speedup vs the observed one, beside Photon's own measured numbers.
streams     n concurrent streams on h100 (requests of 128-512 prompt and 128-512 output tokens, temperature 0.7 / top-p
            0.9): "steady" runs n requests at once (Photon's setup; 4 one after another for n = 1), "arrivals" runs 2n
            with at most n in flight, so new prompts keep joining decode steps. Device busy fraction (median of
            --repeats), tok/s, and the host time per step by phase (schedule / prepare / commit / finalize / stream) for
            Qwen2.5-0.5B and Llama-3.1-8B, with this engine's kernels and with a fused forward's; through the engine
            itself ("engine": LLM.generate) and through AsyncLLM with n asyncio callers: "async" with the core on a
            thread (its per-token hand-off to the callers' event loop shares the GIL), "proc" with the core in a process
            of its own, as a Serve replica runs it.
mixed       graphs for steps with prompt chunks (EngineConfig.cuda_graphs_mixed, engine/cuda_graphs.py): the
            "arrivals" workload through the engine at 32 and 256 streams, Qwen2.5-0.5B on h100, with those steps
            eager and replayed from graphs in alternation (--repeats pairs; this VM's speed drifts between
            minutes, so only runs side by side compare): busy, tok/s, host time per step, steps replayed.
throughput  the nano-vllm workload (256 sequences, prompt and output lengths uniform in [100, 1024],
            ignore_eos, temperature 0.6) on h100 for Qwen2.5-0.5B, Llama-3.2-1B and Llama-3.1-8B: tok/s against
            the simulated device's own ceiling (output tokens / device busy time) and the busy fraction.

"kernels": "engine" prices the decoder as the CUDA path builds it (the fused forward's 8 launches a layer for every
dense family it runs, else the eager layer's counted 38; engine/sim/cost_model.py); "fused" prices 10 a layer (as
vLLM's). Tables in bench/README.md from before the fused forward existed priced "engine" at 38.
Writes sim_<name>.json, .md and .png under --out. Seeded workloads; each run starts on a fresh engine after a
warm-up; the machine and its load are printed with the results.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine import LLM, AsyncLLM, EngineConfig, EngineStats, SamplingParams  # noqa: E402
from engine.core import HOST_PHASES  # noqa: E402
from engine.sim import SIM_MODELS  # noqa: E402
from engine.sim.cost_model import PHOTON_TABLE, PHOTON_WORKLOAD  # noqa: E402
from gpu_models import machine  # noqa: E402
from harness import drive, photon_rows, pyplot, write_results  # noqa: E402

KERNELS = {"engine": None, "fused": 10}
TARGETS = {"qwen2.5-0.5b": 0.95, "llama-3.1-8b": 0.98}  # device busy at depth 2 on h100 (the targets)
VOCAB = 4000  # prompt token ids are drawn below the stand-in tokenizer's 4,096
# Photon's second table (seed 000): streams -> (L, predicted speedup %, observed speedup %).
PHOTON_SPEEDUP = {"photon-3090": {1: (104, 5.7, 6.5), 8: (113, 7.6, 7.8), 32: (113, 11.1, 11.6)},
                  "photon-b200": {1: (115, 17.2, 17.6), 8: (115, 22.2, 21.9), 32: (104, 39.1, 35.4)}}


def model_dir(name: str) -> str:
    return str(SIM_MODELS / name)


def delta(after: EngineStats, before: EngineStats) -> dict:
    """The numeric stats' change between two snapshots of one engine (both report the same keys)."""
    a, b = after.as_dict(), before.as_dict()
    return {k: v - b[k] for k, v in a.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def host_per_step(d: dict) -> dict:
    steps = max(1, d["steps"])
    row = {f"{p}_us": round(1e6 * d[f"host_{p}_s"] / steps, 1) for p in HOST_PHASES if p != "wait"}
    row["launch_us"] = round(1e6 * d["host_launch_s"] / steps, 1)  # modelled CUDA launch cost, inside the above
    # The simulator's own work (pricing, drawing tokens), inside prepare and finalize but off the virtual clock
    row["emulation_us"] = round(1e6 * d["sim_emulation_s"] / steps, 1)
    return row


def rates(tokens: int, wall: float, d: dict) -> dict:
    """tok/s on the simulated device's clock (the run's wall time less the simulator's own work, which a GPU
    does on the device: engine/sim/device.py), and on the wall clock with that work included."""
    return {"tok_s": round(tokens / max(1e-9, wall - d["sim_emulation_s"])), "wall_tok_s": round(tokens / wall)}


def busy_fraction(d: dict) -> float:
    total = d["device_busy_s"] + d["device_idle_s"] + d["device_dep_wait_s"]
    return d["device_busy_s"] / total if total else 0.0


# ---- photon ------------------------------------------------------------------------------------------------
def photon(args) -> list[dict]:
    rows = []
    streams = [1, 8, 32]
    for gpu in PHOTON_TABLE:
        runs = {}
        for depth in (1, 2):
            llm = LLM(model_dir("moondream2-text"), device="sim", sim_gpu=gpu, pipeline_depth=depth,
                      max_num_seqs=max(streams), max_model_len=2048, sim_eos_rate=1 / 110)
            warm(llm)
            settle()
            runs[depth] = {}
            for n in streams:
                llm.engine.scheduler.max_num_seqs = n  # n concurrent streams
                runs[depth][n] = drive(llm, photon_requests(n, args.quick))
            llm.shutdown()
        for row in photon_rows(runs, streams, {"device": f"simulated {gpu}", "model": "moondream2-text"}):
            fwd, smp, period, block = PHOTON_TABLE[gpu][row["streams"]]
            length, predicted, observed = PHOTON_SPEEDUP[gpu][row["streams"]]
            row.update(photon_forward_ms=fwd, photon_sampling_ms=smp, photon_period_ms=period,
                       photon_block_ms=block, photon_idle_ms=round(period - fwd - smp, 3), photon_L=length,
                       photon_predicted_pct=predicted, photon_observed_pct=observed)
            rows.append(row)
            print(line(row, ["device", "streams", "forward_ms", "sampling_ms", "period_ms", "gpu_idle_ms",
                             "t_block_ms", "L", "predicted_speedup_pct", "observed_speedup_pct",
                             "photon_observed_pct"]), flush=True)
    return rows


def photon_requests(n: int, quick: bool) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(1000 + n)
    count = n * (2 if quick else 4) if n > 1 else (4 if quick else 10)
    return [([rng.randrange(VOCAB) for _ in range(PHOTON_WORKLOAD["prompt_tokens"])],
             SamplingParams(max_tokens=1024, temperature=1.0)) for _ in range(count)]


def warm(llm: LLM) -> None:
    llm.generate([[1, 2, 3, 4] * 8] * 4, SamplingParams(max_tokens=8, ignore_eos=True))


def host_speed() -> float:
    """Millions of simple Python operations per second on this host right now (a fixed loop of attribute
    reads, list appends and dict lookups, best of 3): this 2-core VM's per-core speed drifts by ~25% over
    a session, so every run records it beside its figures."""
    class Row:
        __slots__ = ("a", "b")

        def __init__(self):
            self.a, self.b = 1, 2
    rows, table, best = [Row() for _ in range(256)], {i: i for i in range(256)}, float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(200):
            out = []
            for r in rows:
                out.append(r.a + table[r.b])
        best = min(best, time.perf_counter() - t0)
    return round(200 * 256 * 4 / best / 1e6, 1)


def settle() -> None:
    """Before a measured run: collect the previous runs' garbage, and keep what lives on (engine, libraries)
    out of the cyclic GC's full collections, as the serving replica does (cluster/replica.py)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


# ---- streams -----------------------------------------------------------------------------------------------
# (model, kernels, depth, path, workload)
STREAM_VARIANTS = [("qwen2.5-0.5b", "fused", 2, "engine", "steady"), ("qwen2.5-0.5b", "fused", 1, "engine", "steady"),
                   ("qwen2.5-0.5b", "engine", 2, "engine", "steady"), ("qwen2.5-0.5b", "fused", 2, "async", "steady"),
                   ("qwen2.5-0.5b", "fused", 2, "engine", "arrivals"),
                   ("llama-3.1-8b", "fused", 2, "engine", "steady"), ("llama-3.1-8b", "engine", 2, "engine", "steady"),
                   ("llama-3.1-8b", "fused", 2, "async", "steady"), ("llama-3.1-8b", "fused", 2, "engine", "arrivals")]


def streams(args) -> list[dict]:
    rows = []
    counts = [1, 8, 32, 256]
    for model, kernels, depth, path, workload in STREAM_VARIANTS:
        for n in counts:
            runs = sorted((stream_run(model, kernels, depth, n, args.quick, path, workload)
                           for _ in range(args.repeats)), key=lambda r: r["busy"])
            rows.append(runs[len(runs) // 2] | {"busy_runs": [r["busy"] for r in runs]})  # the median run
            print(line(rows[-1], ["model", "kernels", "depth", "path", "workload", "streams", "busy", "busy_runs",
                                  "tok_s", "step_ms", "schedule_us", "prepare_us", "commit_us", "finalize_us",
                                  "stream_us", "launch_us", "host_mops"]), flush=True)
    return rows


def stream_requests(n: int, quick: bool, workload: str = "arrivals") -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(n)
    count = max(4, n if workload == "steady" else (1 if quick else 2) * n)
    return [([rng.randrange(VOCAB) for _ in range(rng.randint(128, 512))],
             SamplingParams(max_tokens=rng.randint(128, 512), temperature=0.7, top_p=0.9, ignore_eos=True))
            for _ in range(count)]


def stream_run(model: str, kernels: str, depth: int, n: int, quick: bool, path: str = "async",
               workload: str = "arrivals", **engine_args) -> dict:
    cfg = EngineConfig(model=model_dir(model), device="sim", sim_gpu="h100", pipeline_depth=depth,
                       max_num_seqs=n, max_model_len=2048, max_num_batched_tokens=max(2048, n),
                       sim_kernels_per_layer=KERNELS[kernels], **engine_args)
    reqs = stream_requests(n, quick, workload)

    def offline():
        llm = LLM(**dataclasses.asdict(cfg))
        try:
            warm(llm)
            settle()
            before, cpu = llm.engine.stats(), _CpuClock()
            t0 = time.perf_counter()
            outs = llm.generate([p for p, _ in reqs], [sp for _, sp in reqs])
            wall = time.perf_counter() - t0
            return sum(len(o.token_ids) for o in outs), wall, delta(llm.engine.stats(), before), cpu.read()
        finally:
            llm.shutdown()

    async def go():
        llm = AsyncLLM(cfg, core_process=path == "proc", core_own_cpu=True)  # as a Serve replica runs it
        try:
            await closed_loop(llm, [([1, 2, 3, 4] * 8, SamplingParams(max_tokens=8))] * 2, 2)  # warm-up
            settle()
            await asyncio.sleep(0.2)  # (a core process sends its idle snapshot when it goes idle)
            before, cpu = llm.stats(), _CpuClock()
            t0 = time.perf_counter()
            tokens = await closed_loop(llm, reqs, n)
            wall = time.perf_counter() - t0
            used = cpu.read()
            await asyncio.sleep(0.2)
            return tokens, wall, delta(llm.stats(), before), used
        finally:
            llm.shutdown()

    speed = host_speed()
    tokens, wall, d, (cpu_self, cpu_core) = asyncio.run(go()) if path in ("async", "proc") else offline()
    return {"host_mops": speed, "device": "simulated h100", "model": model, "kernels": kernels, "depth": depth,
            "path": path, "workload": workload, "streams": n,
            "requests": len(reqs), "busy": round(busy_fraction(d), 4), **rates(tokens, wall, d),
            "ceiling_tok_s": round(tokens / d["device_busy_s"]), "steps": d["steps"],
            "graph_steps": d["graph_steps"], "mixed_graph_steps": d["mixed_graph_steps"],
            "step_ms": round(1e3 * d["device_busy_s"] / max(1, d["steps"]), 3), **host_per_step(d),
            # CPU of this process (the caller: frontend, and the core too unless it has a process of its own) and
            # of the core process, per 1,000 output tokens
            "cpu_ms_per_1k": round(1e6 * cpu_self / tokens, 1),
            "core_cpu_ms_per_1k": round(1e6 * cpu_core / tokens, 1) if path == "proc" else None,
            "target": TARGETS.get(model) if depth == 2 else None}


class _CpuClock:
    """CPU time (user + system) of this process and of its child processes (a core process) since creation."""

    def __init__(self):
        import psutil

        self.me = psutil.Process()
        self.children = self.me.children(recursive=True)
        self.start = self._now()

    def _now(self) -> tuple[float, float]:
        def cpu(p) -> float:
            t = p.cpu_times()
            return t.user + t.system

        return cpu(self.me), sum(cpu(c) for c in self.children)

    def read(self) -> tuple[float, float]:
        now = self._now()
        return now[0] - self.start[0], now[1] - self.start[1]


async def closed_loop(llm: AsyncLLM, reqs, concurrency: int) -> int:
    """Run `reqs` keeping `concurrency` of them in flight; returns the output tokens received."""
    sem = asyncio.Semaphore(concurrency)

    async def one(prompt, params) -> int:
        async with sem:
            n = 0
            async for out in llm.generate(prompt, params):
                n += len(out.delta_token_ids)
            return n

    return sum(await asyncio.gather(*(one(p, sp) for p, sp in reqs)))


# ---- mixed-step graphs -------------------------------------------------------------------------------------
def mixed(args) -> list[dict]:
    rows = []
    for n in (32, 256):
        for i in range(args.repeats):
            for on in (False, True):
                row = stream_run("qwen2.5-0.5b", "engine", 2, n, args.quick, "engine", "arrivals",
                                 cuda_graphs_mixed=on) | {"mixed_graphs": on, "pair": i}
                rows.append(row)
                print(line(row, ["streams", "pair", "mixed_graphs", "busy", "tok_s", "steps", "graph_steps",
                                 "mixed_graph_steps", "schedule_us", "prepare_us", "commit_us", "finalize_us",
                                 "launch_us", "host_mops"]), flush=True)
    return rows


# ---- throughput --------------------------------------------------------------------------------------------
def throughput(args) -> list[dict]:
    rows = []
    rng = random.Random(0)
    num = 64 if args.quick else 256
    work = [([rng.randrange(VOCAB) for _ in range(rng.randint(100, 1024))], rng.randint(100, 1024))
            for _ in range(num)]
    reqs = [(p, SamplingParams(max_tokens=m, temperature=0.6, ignore_eos=True, seed=i))
            for i, (p, m) in enumerate(work)]
    out_tokens = sum(m for _, m in work)
    for model in ("qwen2.5-0.5b", "llama-3.2-1b", "llama-3.1-8b"):
        for kernels in KERNELS:
            llm = LLM(model_dir(model), device="sim", sim_gpu="h100", max_num_seqs=num, max_model_len=4096,
                      max_num_batched_tokens=8192, sim_kernels_per_layer=KERNELS[kernels])
            warm(llm)
            settle()
            speed = host_speed()
            before = llm.engine.stats()
            run = drive(llm, reqs)
            d = delta(llm.engine.stats(), before)
            llm.shutdown()
            assert sum(run.output_lens) == out_tokens, "every request must produce its full output"
            rows.append({"host_mops": speed, "device": "simulated h100", "model": model, "kernels": kernels,
                         "requests": num,
                         "output_tokens": out_tokens, "wall_s": round(run.wall_s, 2),
                         **rates(out_tokens, run.wall_s, d),
                         "ceiling_tok_s": round(out_tokens / d["device_busy_s"]),
                         "busy": round(busy_fraction(d), 4), "steps": d["steps"], **host_per_step(d)})
            print(line(rows[-1], ["model", "kernels", "tok_s", "ceiling_tok_s", "busy", "steps", "host_mops"]),
                  flush=True)
    return rows


# ---- output ------------------------------------------------------------------------------------------------
def line(row: dict, keys: list[str]) -> str:
    return "  " + "  ".join(f"{k}={row[k]}" for k in keys)


def write(out: Path, name: str, rows: list[dict], meta: dict) -> None:
    stem = out / f"sim_{name}"
    write_results(stem, f"{name} (SIMULATED device; host: {meta['host']})", rows, meta)
    plot(stem, name, rows)
    print(f"wrote {stem}.json / .md / .png", flush=True)


def plot(stem: Path, name: str, rows: list[dict]) -> None:
    plt = pyplot()
    if plt is None:
        return
    if name == "streams":
        fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
        for variant in STREAM_VARIANTS:
            rs = [r for r in rows if (r["model"], r["kernels"], r["depth"], r["path"], r["workload"]) == variant]
            a.plot([r["streams"] for r in rs], [r["busy"] for r in rs], marker="o", label=" ".join(map(str, variant)))
        a.set_xscale("log", base=2)
        a.set_xlabel("concurrent streams")
        a.set_ylabel("device busy fraction")
        a.axhline(0.95, color="grey", lw=0.5, ls="--")
        a.legend(fontsize=7)
        rs = [r for r in rows if (r["model"], r["kernels"], r["depth"], r["workload"]) ==
              ("qwen2.5-0.5b", "fused", 2, "steady")]
        bottom = [0.0] * len(rs)
        for phase in ("schedule", "prepare", "commit", "finalize", "stream"):
            vals = [r[f"{phase}_us"] for r in rs]
            b.bar(range(len(rs)), vals, bottom=bottom, label=phase)
            bottom = [x + v for x, v in zip(bottom, vals)]
        b.plot(range(len(rs)), [1e3 * r["step_ms"] for r in rs], "k_", ms=30, mew=2, label="device step")
        b.set_xticks(range(len(rs)), [f"{r['streams']}\n{r['path']}" for r in rs])
        b.set_ylabel("host us per step (qwen2.5-0.5b, fused, depth 2, steady)")
        b.legend(fontsize=7)
    elif name == "photon":
        fig, ax = plt.subplots(figsize=(9, 4.5))
        labels = [f"{r['device'].split()[-1]}\n{r['streams']} streams" for r in rows]
        x = range(len(rows))
        ax.bar([i - 0.27 for i in x], [r["predicted_speedup_pct"] for r in rows], 0.27, label="cost model")
        ax.bar(list(x), [r["observed_speedup_pct"] for r in rows], 0.27, label="observed (Tandem, simulated)")
        ax.bar([i + 0.27 for i in x], [r["photon_observed_pct"] for r in rows], 0.27, label="Photon (measured)")
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.set_ylabel("pipelined speedup over blocking, %")
        ax.legend(fontsize=8)
    elif name == "mixed":
        fig, ax = plt.subplots(figsize=(9, 4.5))
        x = range(len(rows))
        ax.bar(list(x), [r["busy"] for r in rows], color=["C1" if r["mixed_graphs"] else "C0" for r in rows])
        ax.set_xticks(list(x), [f"{r['streams']}\n{'graphs' if r['mixed_graphs'] else 'eager'}" for r in rows],
                      fontsize=7)
        ax.set_ylabel("device busy fraction (arrivals)")
    else:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["tok_s"] for r in rows], 0.4, label="Tandem tok/s")
        ax.bar([i + 0.2 for i in x], [r["ceiling_tok_s"] for r in rows], 0.4, label="device ceiling tok/s")
        ax.set_xticks(list(x), [f"{r['model']}\n{r['kernels']}" for r in rows], fontsize=8)
        ax.legend(fontsize=8)
    fig.suptitle(f"{name}: SIMULATED device, real host ({rows[0]['device']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)
    plt.close(fig)


SUBCOMMANDS = {"photon": photon, "streams": streams, "throughput": throughput, "mixed": mixed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=[*SUBCOMMANDS, "all"])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--quick", action="store_true", help="smaller workloads (a smoke run)")
    ap.add_argument("--repeats", type=int, default=3, help="streams: runs per setting (the median is reported)")
    args = ap.parse_args(argv)
    host = machine("cpu")
    meta = {"host": host["device"], "torch": host["torch"], "python": host["python"], "load_avg": host["load_avg"],
            "simulated": True, "quick": args.quick}
    print(f"host: {meta['host']}  load: {meta['load_avg']}  (device times are SIMULATED)", flush=True)
    for what in (SUBCOMMANDS if args.what == "all" else [args.what]):
        t0 = time.perf_counter()
        rows = SUBCOMMANDS[what](args)
        write(args.out, what, rows, meta | {"seconds": round(time.perf_counter() - t0, 1),
                                            "load_avg_end": machine("cpu")["load_avg"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
