#!/usr/bin/env python3
"""GPU runtime benchmarks on random-weight models with real shapes (Qwen2.5-0.5B, Llama-3.2-1B, Qwen2.5-1.5B).

    python bench/bench_gpu.py photon|graphs|mixed|throughput|bs1|kernels|all [--device cuda|cpu] [--tiny]
                              [--models ...]
                              [--out bench/results]

photon      Photon's tables: per-step forward, sampling and period (steady-state medians, device timeline) at
            1, 8 and 32 streams; blocking (pipeline_depth=1) vs pipelined (2) step times, L, the cost model's
            predicted speedup T_block / T_pipe x (1 - z) vs the observed one; GPU idle per step.
            Requests sample (temperature 1) and end on EOS after ~110 tokens on average (EOS is a set of
            vocab/110 ids), so finished requests ride one more step as zombies, as in Photon.
graphs      pegainfer's view: per decode step, kernel time vs gap (step period minus kernel time), with and
            without CUDA graphs, from torch.profiler's device activity.
mixed       one step carrying a prompt chunk beside decodes (128-token contexts), as new requests join running
            ones: host time to launch it and device time, run eagerly against replayed from the mixed-step graph it
            pads to (engine/cuda_graphs.py), and how far their logits differ. CPU: the eager step alone (graphs are
            CUDA's).
throughput  the nano-vllm workload (256 sequences, prompt and output lengths uniform in [100, 1024], EOS
            ignored) through Tandem and through transformers' continuous batching (generate_batch's manager,
            given each request's own max_new_tokens) on the same weights, in the same run.
bs1         one sequence decoding: time per token vs the weight-bandwidth floor (weight bytes / measured
            device memory bandwidth), GB/s beside tok/s, with transformers' generate as the peer.
kernels     the fused forward's gate/up GEMM at each model's shape and the decode batch sizes: its shipped
            tiles, the fastest of a grid of tiles, cuBLAS + act_mul as the peer, the weights' bandwidth floor.

Every figure is printed with the device name; each subcommand writes <name>_<device>.json and .md (and a
PNG when matplotlib is installed) under --out. Warm-up runs are excluded; step figures are medians.
`--device cpu --tiny` runs the same code on toy-sized models of the same families (a smoke run; CPU numbers
say nothing about the GPU targets).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from gpu_models import MODEL_NAMES, Checkpoint, build_checkpoint, machine, memory_bandwidth  # noqa: E402
from harness import Run, decode_pairs, drive, med, ms, pyplot, write_results  # noqa: E402
from harness import photon_rows as table_rows  # noqa: E402

TARGETS = {"period_vs_fwd_smp": "period within 5% of forward + sampling",
           "speedup_vs_model": "pipelined speedup within +-3 points of the cost model",
           "throughput_vs_hf": "throughput at least 1.5x transformers' continuous batching",
           "bs1_vs_floor": "bs=1 time per token within 1.5x the weight-bandwidth floor"}


# ---- settings ---------------------------------------------------------------------------------------------
@dataclass
class Settings:
    device: str
    tiny: bool
    models: list[str]
    out: Path
    streams: list[int] = field(default_factory=lambda: [1, 8, 32])
    seed: int = 0
    # graphs: the forwards to compare (None: the engine's default; True: the fused forward; False: the layers)
    # and the graph modes (True: CUDA graphs; False: eager steps, timed under the profiler, the slow part).
    forwards: list[bool | None] = field(default_factory=lambda: [None])
    graph_modes: list[bool] = field(default_factory=lambda: [True, False])
    hf_tokens: int = 512  # bs1: tokens transformers' generate decodes to time the peer

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device == "cuda" else torch.float32

    def scaled(self, gpu: int, cpu: int) -> int:
        """A workload size: the GPU figure, or a small one for CPU smoke runs."""
        return gpu if self.device == "cuda" and not self.tiny else cpu


_checkpoints: dict[str, Checkpoint] = {}
_tmp = tempfile.TemporaryDirectory(prefix="tandem_bench_")


def checkpoint(name: str, s: Settings) -> Checkpoint:
    if name not in _checkpoints:
        _checkpoints.clear()  # one model's weights on the device at a time
        release()
        t0 = time.perf_counter()
        _checkpoints[name] = build_checkpoint(name, Path(_tmp.name), s.device, s.dtype, s.tiny)
        print(f"[{name}] random weights written in {time.perf_counter() - t0:.1f} s", flush=True)
    return _checkpoints[name]


def make_llm(ck: Checkpoint, s: Settings, **kw) -> LLM:
    cfg = dict(device=s.device, dtype=str(s.dtype).removeprefix("torch."), block_size=16,
               max_model_len=s.scaled(4096, 1024))
    return LLM(str(ck.path), **{**cfg, **kw})


def release() -> None:
    """Return freed engines' device memory (call once no reference to them is left)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def with_llm(ck: Checkpoint, s: Settings, fn, **kw):
    """fn(llm) on a fresh engine that is gone (device memory returned) when this returns."""
    llm = make_llm(ck, s, **kw)
    try:
        warm_up(llm, ck.vocab_size)
        return fn(llm)
    finally:
        llm.shutdown()
        del llm
        release()


# ---- driving the engine one tick at a time (bench/harness.py) -----------------------------------------------
def warm_up(llm: LLM, vocab: int, n: int = 4) -> None:
    rng = random.Random(123)
    llm.generate([[rng.randrange(vocab) for _ in range(40)] for _ in range(n)],
                 SamplingParams(max_tokens=8, ignore_eos=True))


# ---- photon -----------------------------------------------------------------------------------------------
def stream_requests(ck: Checkpoint, s: Settings, streams: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(s.seed * 1000 + streams)
    n = streams * s.scaled(4 if streams > 1 else 10, 3)
    plen = s.scaled(64, 16)
    return [([rng.randrange(ck.vocab_size) for _ in range(plen)],
             SamplingParams(max_tokens=s.scaled(1024, 200), temperature=1.0, seed=i)) for i in range(n)]


def photon(s: Settings) -> list[dict]:
    rows = []
    for name in s.models:
        ck = checkpoint(name, s)
        runs = {depth: with_llm(ck, s, lambda llm: _stream_runs(llm, ck, s), pipeline_depth=depth,
                                max_num_seqs=max(s.streams)) for depth in (1, 2)}
        rows += photon_rows(ck, s, runs)
    return rows


def _stream_runs(llm: LLM, ck: Checkpoint, s: Settings) -> dict[int, Run]:
    runs = {}
    for n in s.streams:
        llm.engine.scheduler.max_num_seqs = n  # n concurrent streams; the engine's buffers fit the largest
        runs[n] = drive(llm, stream_requests(ck, s, n))
    return runs


def photon_rows(ck: Checkpoint, s: Settings, runs: dict[int, dict[int, Run]]) -> list[dict]:
    rows = table_rows(runs, s.streams, {"device": machine(s.device)["device"], "model": ck.name})
    for row in rows:
        print(_line(row, ["streams", "forward_ms", "sampling_ms", "period_ms", "gpu_idle_ms", "t_block_ms",
                          "L", "z", "predicted_speedup_pct", "observed_speedup_pct"]), flush=True)
    return rows


# ---- graphs (kernel time vs gap) ----------------------------------------------------------------------------
def graphs(s: Settings) -> list[dict]:
    rows = []
    modes = s.graph_modes if s.device == "cuda" else [False]
    for name in s.models:
        ck = checkpoint(name, s)
        for fused in s.forwards:
            for use_graphs in modes:
                # CPU: depth 1 keeps the ops on this thread, the one torch.profiler records. A variant that
                # fails is recorded as such and the others still run (a device call is short and costly).
                try:
                    rows += with_llm(ck, s, lambda llm: [kernel_vs_gap(llm, ck, s, n, use_graphs)
                                                         for n in s.streams],
                                     cuda_graphs=use_graphs, max_num_seqs=max(s.streams), fused_forward=fused,
                                     pipeline_depth=2 if s.device == "cuda" else 1)
                except Exception as e:  # noqa: BLE001 - reported in the results, not hidden
                    print(f"  [{name}] fused_forward={fused} graphs={use_graphs} failed: {e!r}", flush=True)
                    rows.append({"device": machine(s.device)["device"], "model": ck.name, "graphs": use_graphs,
                                 "forward": next(k for k, v in FORWARDS.items() if v is fused),
                                 "error": repr(e)[:300]})
                    release()
    return rows


# --forward's names: EngineConfig.fused_forward's values (None: the engine's default for the device).
FORWARDS = {"default": None, "fused": True, "layers": False}


def forward_kind(llm: LLM) -> str:
    """Which decoder forward the engine runs: "fused" (engine/models/fused_forward.py) or "layers"."""
    model = getattr(llm.engine.runner, "model", None)
    return "fused" if getattr(model, "fused", None) is not None else "layers"


def kernel_vs_gap(llm: LLM, ck: Checkpoint, s: Settings, batch: int, use_graphs: bool) -> dict:
    """Profile `window` steady decode steps of `batch` sequences; kernel time from the device activity."""
    llm.engine.scheduler.max_num_seqs = batch
    window, warm = s.scaled(30, 8), s.scaled(20, 4)
    rng = random.Random(batch)
    reqs = [([rng.randrange(ck.vocab_size) for _ in range(s.scaled(128, 16))],
             SamplingParams(max_tokens=warm + window + 10, temperature=0, ignore_eos=True)) for _ in range(batch)]
    prof = _Profiler(s.device)
    first_decode = 2 + -(-batch * s.scaled(128, 16) // llm.engine.config.max_num_batched_tokens)
    run = drive(llm, reqs, on_step=lambda i: prof.step(i, first_decode + warm, window))
    steps = [t for t in run.timings[first_decode + warm:first_decode + warm + window]]
    period = med(t["device_period_s"] for t in steps[1:])
    # The same batch's period before the profiler starts (it slows the host, so its gap is an upper bound).
    before = run.timings[first_decode + 1:first_decode + warm]
    plain = med(t["device_period_s"] for t in before if t["num_seqs"] == batch == t["num_tokens"])
    kernel = prof.kernel_s / max(1, prof.steps)
    row = {"device": machine(s.device)["device"], "model": ck.name, "batch": batch, "graphs": use_graphs,
           "forward": forward_kind(llm), "step_ms": ms(period), "step_ms_unprofiled": ms(plain),
           "kernel_ms": ms(kernel), "gap_ms": ms(period - kernel),
           "gap_pct": round(100 * (period - kernel) / period, 2) if period else None,
           "kernels_per_step": round(prof.kernels / max(1, prof.steps), 1), "profiled_steps": prof.steps,
           "graph_steps": run.counters["graph_steps"],
           "window_all_decode": all(t["num_seqs"] == batch == t["num_tokens"] for t in steps),
           "kernel_source": "CUDA kernels (torch.profiler)" if s.device == "cuda" else "aten op self CPU time",
           "top_kernels": prof.top}
    print(_line(row, ["model", "forward", "batch", "graphs", "step_ms", "step_ms_unprofiled", "kernel_ms", "gap_ms",
                      "gap_pct", "kernels_per_step"]), flush=True)
    for k in prof.top:
        print(f"      {k['us_per_step']:8.1f} us  x{k['per_step']:<5}  {k['kernel']}", flush=True)
    return row


class _Profiler:
    """torch.profiler over a window of committed steps; sums device kernel time (CPU: aten self time)."""

    def __init__(self, device: str):
        self.device = device
        self.prof = None
        self.kernel_s = 0.0
        self.kernels = 0
        self.steps = 0
        self.top: list[dict] = []

    def step(self, committed: int, start: int, window: int) -> None:
        from torch.profiler import ProfilerActivity, profile
        if committed == start:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
            self.prof = profile(activities=acts)
            self.prof.__enter__()
        elif committed == start + window and self.prof is not None:
            if self.device == "cuda":
                torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            self.steps = window
            self.kernel_s, self.kernels, self.top = self._kernel_time(window)
            self.prof = None

    def _kernel_time(self, steps: int, top: int = 12) -> tuple[float, int, list[dict]]:
        """(kernel seconds, kernels, the `top` heaviest kernels per step) over the window. CUDA: the device's
        kernels, copies and memsets left out of the first two (the list keeps them); CPU: aten self time."""
        if self.device != "cuda":
            rows = [r for r in self.prof.key_averages() if r.key.startswith("aten::")]
            return sum(r.self_cpu_time_total for r in rows) / 1e6, sum(r.count for r in rows), []
        by_name: dict[str, list[float]] = {}
        for e in self.prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                t = by_name.setdefault(e.name, [0.0, 0])
                t[0] += e.time_range.elapsed_us()
                t[1] += 1
        kernels = [t for name, t in by_name.items()
                   if not any(k in name for k in ("Memcpy", "Memset", "memcpy", "memset"))]
        heavy = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
        return (sum(us for us, _ in kernels) / 1e6, sum(c for _, c in kernels),
                [{"kernel": name[:90], "us_per_step": round(us / steps, 1), "per_step": round(c / steps, 1)}
                 for name, (us, c) in heavy])


# ---- mixed: a step with a prompt chunk, eager against its graph ---------------------------------------------------
MIXED_SHAPES = [(7, 128), (31, 512), (63, 1024)]  # (decodes, prompt chunk tokens) beside each other in one step


def mixed(s: Settings) -> list[dict]:
    rows = []
    for name in s.models:
        ck = checkpoint(name, s)
        rows += with_llm(ck, s, lambda llm: [mixed_step(llm, ck, s, d, c) for d, c in MIXED_SHAPES],
                         max_num_seqs=64, num_kv_blocks=s.scaled(4096, 512))
    return rows


def mixed_step(llm: LLM, ck: Checkpoint, s: Settings, decodes: int, chunk: int) -> dict:
    """`decodes` decode rows over contexts of 128 and a prompt chunk of `chunk` tokens in one step, its KV not
    written on CUDA (slot -1: every run reads the same cache): the host's time to enqueue it and the device's
    time to run it (CUDA events), medians of 10, eager and replayed from its graph."""
    from engine.scheduler import ScheduledChunk
    from engine.sequence import Sequence
    from engine.slot import Step

    runner, bs = llm.engine.runner, llm.engine.config.block_size
    decodes, chunk, ctx = s.scaled(decodes, 3), s.scaled(chunk, 24), s.scaled(128, 16)
    rng = random.Random(decodes)
    chunks, block = [], 1
    for length, start, n in [(ctx + 1, ctx, 1)] * decodes + [(chunk, 0, chunk)]:
        seq = Sequence("bench", None, [rng.randrange(ck.vocab_size) for _ in range(length)], SamplingParams(),
                       frozenset(), 1 << 20, ck.vocab_size)
        seq.block_table = list(range(block, block + -(-length // bs)))
        block += len(seq.block_table)
        chunks.append(ScheduledChunk(seq, start, n, True))
    slot = runner.slots[0]
    step, b = Step(0, slot, chunks, chunks, decodes + chunk, 0.0), slot.inputs
    key = runner.graphs.plan.for_step(step) if getattr(runner, "graphs", None) is not None else None
    row = {"device": machine(s.device)["device"], "model": ck.name, "forward": forward_kind(llm), "decodes": decodes,
           "chunk": chunk, "tokens": decodes + chunk, "graph_shape": key}
    cuda = s.device == "cuda"
    stream = runner.executor.compute_stream if cuda else None
    logits = {}
    for variant in ("eager", "graph") if key is not None else ("eager",):
        graph = variant == "graph"
        b.stage_step(chunks, runner.tables, bs, *((key[0], (), key[1]) if graph else ()))
        if cuda:  # (the CPU backends' stores take no -1: there each run rewrites the same KV)
            b.np["slot_mapping"][:b.num_tokens] = -1
            if b.window_groups:
                b.np["window_slots"][:, :b.num_tokens] = -1
        host, dev = [], []
        for i in range(13):  # 3 warm-up runs, then 10 timed
            _sync(runner.device)
            t0 = time.perf_counter()
            with torch.cuda.stream(stream) if cuda else contextlib.nullcontext(), torch.inference_mode():
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(stream)
                b.upload()
                b.apply_tables(runner.device_tables, full_width=graph)
                if graph:
                    runner.graphs.replay(slot, *key)
                else:
                    runner._eager_forward(slot)
                if cuda:
                    end.record(stream)
            enqueued = time.perf_counter()
            _sync(runner.device)
            if i >= 3:
                host.append(enqueued - t0)
                dev.append(start.elapsed_time(end) / 1e3 if cuda else time.perf_counter() - t0)
        logits[variant] = slot.logits[:len(chunks)].float().clone()
        row |= {f"{variant}_host_ms": ms(med(host)), f"{variant}_device_ms": ms(med(dev))}
    for c in chunks:  # their block-table rows may be reused by the next shape's
        c.seq.released = True
    if "graph" in logits:
        e, g = logits["eager"], logits["graph"]
        row["logits_rel_diff"] = float((g - e).norm() / e.norm())
    print(_line(row, ["model", "decodes", "chunk", "graph_shape", *[k for k in row if k.endswith("_ms")]]
                + (["logits_rel_diff"] if "graph" in logits else [])), flush=True)
    return row


# ---- throughput vs transformers ---------------------------------------------------------------------------
def nano_vllm_workload(ck: Checkpoint, s: Settings) -> list[tuple[list[int], int]]:
    rng = random.Random(s.seed)
    num, lo, hi = s.scaled(256, 16), s.scaled(100, 16), s.scaled(1024, 64)
    return [([rng.randrange(ck.vocab_size) for _ in range(rng.randint(lo, hi))], rng.randint(lo, hi))
            for _ in range(num)]


def throughput(s: Settings) -> list[dict]:
    rows = []
    for name in s.models:
        ck = checkpoint(name, s)
        work = nano_vllm_workload(ck, s)
        out_tokens = sum(n for _, n in work)
        reqs = [(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)) for p, n in work]
        run = with_llm(ck, s, lambda llm: drive(llm, reqs), max_num_seqs=len(work),
                       max_num_batched_tokens=s.scaled(8192, 512), max_model_len=s.scaled(2048 + 64, 256))
        assert sum(run.output_lens) == out_tokens, "every request must produce its full output"
        hf_s = hf_continuous_batching(ck, work, s)
        ours_tps, hf_tps = out_tokens / run.wall_s, out_tokens / hf_s
        rows.append({"device": machine(s.device)["device"], "model": ck.name, "requests": len(work),
                     "output_tokens": out_tokens, "tandem_s": round(run.wall_s, 2), "tandem_tok_s": round(ours_tps),
                     "hf_s": round(hf_s, 2), "hf_tok_s": round(hf_tps), "ratio": round(ours_tps / hf_tps, 2),
                     "tandem_steps": run.counters["steps"], "tandem_graph_steps": run.counters["graph_steps"],
                     "tandem_weight_GB_s": round(run.counters["steps"] * ck.weight_bytes / run.wall_s / 1e9, 1)})
        print(_line(rows[-1], ["model", "tandem_tok_s", "hf_tok_s", "ratio", "tandem_weight_GB_s"]), flush=True)
    return rows


def hf_continuous_batching(ck: Checkpoint, work: list[tuple[list[int], int]], s: Settings) -> float:
    """Seconds for transformers' continuous batching (the manager behind generate_batch) to finish `work`,
    each request with its own max_new_tokens and EOS disabled. Its warm-up (graph capture) is excluded."""
    from transformers import GenerationConfig
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
        hints = WorkloadHints(max_prompt_length=max(len(p) for p, _ in work),
                              max_generated_length=max(n for _, n in work), num_requests=len(work))
    except ImportError:
        hints = None
    gen = GenerationConfig(max_new_tokens=max(n for _, n in work), do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    model = ck.hf
    with model.continuous_batching_context_manager(generation_config=gen, block=True, timeout=60,
                                                   workload_hints=hints) as manager:
        t0 = time.perf_counter()
        for i, (prompt, n) in enumerate(work):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        done, tokens = 0, 0
        while done < len(work):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done += 1
                tokens += len(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped early")
        wall = time.perf_counter() - t0
    if tokens != sum(n for _, n in work):
        print(f"  note: transformers produced {tokens} tokens, expected {sum(n for _, n in work)}")
    return wall


# ---- bs=1 vs the bandwidth floor --------------------------------------------------------------------------
def bs1(s: Settings) -> list[dict]:
    rows = []
    bandwidth = memory_bandwidth(s.device, nbytes=s.scaled(1 << 31, 1 << 28))
    for name in s.models:
        ck = checkpoint(name, s)
        n_new, plen = s.scaled(512, 64), s.scaled(128, 32)
        prompt = [random.Random(1).randrange(ck.vocab_size) for _ in range(plen)]
        req = [(prompt, SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True))]
        kind, run = with_llm(ck, s, lambda llm: (forward_kind(llm), drive(llm, req)), max_num_seqs=8)
        per_tok = med(p for _, p in decode_pairs(run.timings, 1))
        floor = ck.weight_bytes / bandwidth
        hf_per_tok = hf_generate_per_token(ck, prompt, min(n_new, s.hf_tokens))
        rows.append({"device": machine(s.device)["device"], "model": ck.name, "forward": kind,
                     "weight_GB": round(ck.weight_bytes / 1e9, 3), "bandwidth_GB_s": round(bandwidth / 1e9),
                     "floor_ms": ms(floor), "tandem_ms_per_tok": ms(per_tok),
                     "tandem_tok_s": round(1 / per_tok, 1), "tandem_GB_s": round(ck.weight_bytes / per_tok / 1e9, 1),
                     "over_floor": round(per_tok / floor, 2),
                     "tandem_wall_ms_per_tok": ms(run.wall_s / n_new), "hf_ms_per_tok": ms(hf_per_tok),
                     "hf_GB_s": round(ck.weight_bytes / hf_per_tok / 1e9, 1),
                     "graph_steps": run.counters["graph_steps"]})
        print(_line(rows[-1], ["model", "forward", "floor_ms", "tandem_ms_per_tok", "tandem_tok_s", "tandem_GB_s",
                               "over_floor", "hf_ms_per_tok"]), flush=True)
    return rows


def hf_generate_per_token(ck: Checkpoint, prompt: list[int], n_new: int) -> float:
    """transformers' generate at batch 1 (its default cache): seconds per token after the first."""
    ids = torch.tensor([prompt], device=ck.hf.device)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        ck.hf.generate(ids, max_new_tokens=8, min_new_tokens=8, **kw)  # warm-up
        times = []
        for n in (1, n_new):
            _sync(ck.hf.device)
            t0 = time.perf_counter()
            ck.hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
            _sync(ck.hf.device)
            times.append(time.perf_counter() - t0)
    return (times[1] - times[0]) / (n_new - 1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ---- kernels: the gate/up GEMM's tiles at decode sizes ---------------------------------------------------------
# (BLOCK_N, BLOCK_K, num_warps, num_stages); BLOCK_M is gemm_tiles' (16 rows up to 16, else 64). Configurations
# that do not fit the GPU's shared memory or registers are recorded as failed.
# 18 tilings, each compiled for two BLOCK_Ms: about a minute of compiles on the H200 machine.
TILE_GRID = [(bn, bk, w, st) for bn in (16, 32, 64) for bk in (64, 128, 256) for w, st in ((4, 4), (8, 3))]


def kernels(s: Settings) -> list[dict]:
    """The fused forward's gate/up GEMM with act(gate) * up in its epilogue (engine/models/fused_kernels
    .gate_up_act) at each model's real shape and the decode batch sizes: the tiles it ships with, the fastest of
    TILE_GRID that computes the same values, and cuBLAS's GEMM followed by the act_mul kernel (one launch more) as
    the peer; against the weights' bytes at the measured bandwidth. Each call is timed alone with the L2 cache
    flushed before it (triton.testing.do_bench), as a layer's weights are not in L2 during a real step."""
    from engine.models import fused_kernels as fk
    from gpu_models import REAL
    bandwidth = memory_bandwidth(s.device, nbytes=s.scaled(1 << 31, 1 << 24))
    rows = []
    for name in s.models:
        cfg = REAL[name][1]
        hidden, inter = (128, 256) if s.tiny else (cfg["hidden_size"], cfg["intermediate_size"])
        gen = torch.Generator(device=s.device).manual_seed(0)
        w = (0.02 * torch.randn(2 * inter, hidden, device=s.device, generator=gen)).to(s.dtype)
        floor = w.numel() * w.element_size() / bandwidth
        for m in s.streams:
            x = torch.randn(m, hidden, device=s.device, generator=gen).to(s.dtype)
            ref = fk.gate_up_act(x, w, None, "silu").float()
            shipped = _time(lambda: fk.gate_up_act(x, w, None, "silu"), s)
            cublas = _time(lambda: fk.act_mul(torch.nn.functional.linear(x, w), "silu"), s)
            shipped_tiles = fk.gemm_tiles(m, inter, hidden, s.dtype == torch.float32)
            grid = []
            for bn, bk, warps, stages in (TILE_GRID if not s.tiny else TILE_GRID[:2]):
                tiles = (shipped_tiles[0], bn, bk, warps, stages)
                try:
                    out = fk.gate_up_act(x, w, None, "silu", tiles=tiles).float()
                    same = bool(torch.allclose(out, ref, rtol=2e-2, atol=1e-2))  # bf16: sums reordered
                    grid.append({"tiles": tiles, "us": round(1e6 * _time(
                        lambda: fk.gate_up_act(x, w, None, "silu", tiles=tiles), s), 2), "same": same})
                except Exception as e:  # noqa: BLE001 - out of shared memory or registers: recorded
                    grid.append({"tiles": tiles, "error": type(e).__name__})
            good = [g for g in grid if g.get("same")]
            best = min(good, key=lambda g: g["us"]) if good else None
            rows.append({"device": machine(s.device)["device"], "model": name, "M": m, "N": inter, "K": hidden,
                         "floor_us": round(1e6 * floor, 2), "shipped_tiles": shipped_tiles,
                         "shipped_us": round(1e6 * shipped, 2), "best_tiles": best and best["tiles"],
                         "best_us": best and best["us"], "cublas_act_us": round(1e6 * cublas, 2),
                         "programs_shipped": -(-m // shipped_tiles[0]) * -(-inter // shipped_tiles[1]),
                         "grid": grid})
            print(_line(rows[-1], ["model", "M", "floor_us", "shipped_us", "best_us", "best_tiles",
                                   "cublas_act_us"]), flush=True)
            for g in sorted(good, key=lambda g: g["us"])[:4]:  # in the log too, should the part be cut off
                print(f"      {g['us']:8.2f} us  tiles {g['tiles']}", flush=True)
    return rows


def _time(fn, s: Settings) -> float:
    """Seconds one call takes: on CUDA the median of do_bench's event-timed calls, each after an L2 flush."""
    if s.device == "cuda":
        import triton
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    fn()
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - t0) / 3


# ---- output -----------------------------------------------------------------------------------------------
def _line(row: dict, keys: list[str]) -> str:
    return f"  [{row['device']}] " + "  ".join(f"{k}={row[k]}" for k in keys)


def write(s: Settings, name: str, rows: list[dict], meta: dict) -> None:
    stem = s.out / f"{name}_{s.device}{'_tiny' if s.tiny else ''}"
    write_results(stem, f"{name} on {meta['device']}", rows, meta)
    _plot(stem, name, rows)
    print(f"wrote {stem}.json / .md", flush=True)


def _plot(stem: Path, name: str, rows: list[dict]) -> None:
    plt = pyplot()
    if plt is None:
        return
    series = {"photon": ("streams", ["forward_ms", "sampling_ms", "gpu_idle_ms"]),
              "graphs": ("batch", ["kernel_ms", "gap_ms"]), "throughput": ("model", ["tandem_tok_s", "hf_tok_s"]),
              "bs1": ("model", ["floor_ms", "tandem_ms_per_tok"])}.get(name)
    rows = [r for r in rows if "error" not in r]  # a variant that failed has no figures
    if not series or not rows:
        return
    x, ys = series
    labels = [f"{r['model']}\n{x}={r[x]}" + (f"\ngraphs={r['graphs']}" if "graphs" in r else "")
              + (f"\n{r['forward']}" if "forward" in r else "") for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 1.2), 4))
    bottom = [0.0] * len(rows)
    for y in ys:
        vals = [float(r[y] or 0) for r in rows]
        stacked = name in ("photon", "graphs")
        ax.bar(range(len(rows)), vals, bottom=bottom if stacked else None, label=y,
               alpha=1.0 if stacked else 0.6)
        bottom = [b + v for b, v in zip(bottom, vals)] if stacked else bottom
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_title(f"{name} on {rows[0]['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=120)
    plt.close(fig)


SUBCOMMANDS = {"photon": photon, "graphs": graphs, "mixed": mixed, "throughput": throughput, "bs1": bs1,
               "kernels": kernels}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=[*SUBCOMMANDS, "all"])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="toy-sized models of the same families")
    ap.add_argument("--models", nargs="+", choices=MODEL_NAMES, default=list(MODEL_NAMES))
    ap.add_argument("--streams", nargs="+", type=int, default=None, help="photon/graphs batch sizes")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--forward", nargs="+", choices=list(FORWARDS), default=["default"],
                    help="graphs: the decoder forwards to compare (fused: engine/models/fused_forward.py)")
    ap.add_argument("--no-eager", action="store_true", help="graphs: CUDA-graph steps only (skip eager steps)")
    ap.add_argument("--hf-tokens", type=int, default=512, help="bs1: tokens transformers' generate decodes")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU runs: torch threads (1: no OpenMP stalls on a shared, loaded machine)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (use --device cpu --tiny)")
    s = Settings(args.device, args.tiny, args.models, args.out,
                 forwards=[FORWARDS[f] for f in args.forward],
                 graph_modes=[True] if args.no_eager else [True, False], hf_tokens=args.hf_tokens)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    if args.streams:
        s.streams = sorted(args.streams)
    elif args.device == "cpu":
        s.streams = [1, 4, 8]
    meta = machine(s.device) | {"dtype": str(s.dtype), "tiny": s.tiny, "torch_threads": torch.get_num_threads(),
                                "targets": TARGETS}
    print(f"device: {meta['device']}  load: {meta['load_avg']}  torch {meta['torch']}  triton {meta['triton']}",
          flush=True)
    for what in (SUBCOMMANDS if args.what == "all" else [args.what]):
        t0 = time.perf_counter()
        rows = SUBCOMMANDS[what](s)
        write(s, what, rows, meta | {"seconds": round(time.perf_counter() - t0, 1),
                                     "load_avg_end": machine(s.device)["load_avg"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
