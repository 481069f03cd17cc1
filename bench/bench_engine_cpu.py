#!/usr/bin/env python3
"""Offline CPU throughput: Tandem (pipeline_depth 1 and 2) vs HF transformers continuous batching.

One run, one model, one seeded workload. Each engine gets a warm-up run (excluded), then `--repeats`
timed runs interleaved across engines (HF, Tandem d1, Tandem d2, HF, ...) so slow drift hits all of
them alike; the median wall time is reported. Greedy fp32 on both sides, EOS ignored, prefix caching off
on both sides (the same prompts are replayed every repeat, so a prefix cache would skip the prefills).

    python bench/bench_engine_cpu.py --repeats 5 --json bench/results/engine_cpu.json

Model: a random-weight Llama (default hidden 512, 8 layers, 8 heads / 4 KV heads, intermediate 1408,
vocab 8192, fp32) saved with save_pretrained in a temp dir next to a byte-level BPE tokenizer built
in-process (the 256 byte symbols plus merged byte pairs up to the vocab size, so every model id decodes;
no hub). `--model DIR` benchmarks an existing checkpoint instead (e.g. engine/default_model).

HF settings (ContinuousBatchingConfig), tuned for this CPU workload: attn_implementation "sdpa" (flash is
CUDA-only; "paged|eager" materialises the scores), page_size 32, max_batch_tokens 512,
max_requests_per_batch 24, num_blocks sized for the whole workload (no eviction), block sharing off, a
persistent manager so the cache is allocated once (the warm-up pays for it, as LLM(...) does for Tandem).
HF's sdpa path attends every batch token to the whole batch's KV under a mask, so decode cost grows with
the square of the batch: on a 2-core EPYC (quiet) a sweep gave 25-27 s for 16-24 requests per batch vs
35 s for its default (all 64), and page_size 32-256 / max_batch_tokens 256-2048 within noise (~10%).
Tandem: max_num_seqs 256, max_num_batched_tokens 2048 (its defaults), no prefix caching.

On a shared machine each timed run starts in a quiet moment and is redone (up to --retries) when other
processes used more than --max-others of the CPUs meanwhile (/proc/stat minus our own CPU time); the share
is printed per run. The run is called quiet when no default-model trainer ran and that median share
stayed under --max-others.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (AutoConfig, AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig,
                          LlamaConfig, PreTrainedTokenizerFast)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from engine import LLM, SamplingParams  # noqa: E402

EOS = "<|endoftext|>"


# ---- model and workload -----------------------------------------------------------------------------------
def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE with exactly `vocab_size` ids: EOS, the 256 byte symbols, then byte-pair merges."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {EOS: 0, **{ch: i + 1 for i, ch in enumerate(alphabet)}}
    merges = []
    for a in alphabet:
        for b in alphabet:
            if len(vocab) >= vocab_size:
                break
            vocab[a + b] = len(vocab)
            merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)


def build_checkpoint(args, root: Path) -> Path:
    """Save a random-weight Llama + tokenizer under root; return the directory."""
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         vocab_size=args.vocab, max_position_embeddings=args.max_position,
                         initializer_range=args.init_std, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         eos_token_id=0, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(root)
    build_tokenizer(args.vocab).save_pretrained(root)
    return root


def model_shape(model_dir: Path) -> dict:
    c = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    return {"family": c.model_type, "hidden": c.hidden_size, "layers": c.num_hidden_layers,
            "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads or c.num_attention_heads,
            "intermediate": c.intermediate_size, "vocab": c.vocab_size}


def make_workload(args, vocab_size: int) -> list[list[int]]:
    """Seeded prompts of random lengths in [min_prompt, max_prompt] over random non-special ids."""
    rng = random.Random(args.seed)
    return [[rng.randrange(1, vocab_size) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
            for _ in range(args.num_requests)]


# ---- engines ----------------------------------------------------------------------------------------------
@dataclass
class Run:
    """One timed pass of one engine over the whole workload."""

    wall_s: float
    outputs: list[list[int]]
    steps: list[dict] = field(default_factory=list)  # Tandem only: last_step_timing after every commit
    others_cpu_frac: float = 0.0  # share of the machine's CPUs used by other processes during the run


class HFRunner:
    """transformers' generate_batch (continuous batching) on the same checkpoint."""

    name = "hf_generate_batch"

    def __init__(self, model_dir: Path, args, prompts: list[list[int]]):
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                          attn_implementation=args.hf_attn).eval()
        self.gen_config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False,
                                           eos_token_id=-1, pad_token_id=0)
        longest = max(len(p) for p in prompts) + args.max_new_tokens
        blocks_per_request = math.ceil(longest / args.hf_page_size) + 1
        self.cb_config = ContinuousBatchingConfig(
            page_size=args.hf_page_size, max_batch_tokens=args.hf_max_batch_tokens,
            num_blocks=args.hf_num_blocks or blocks_per_request * len(prompts),
            max_requests_per_batch=args.hf_max_requests or len(prompts),
            allow_block_sharing=False, auto_switch_to_flash=False, seed=args.seed)

    def settings(self) -> dict:
        return {"attn_implementation": self.model.config._attn_implementation,
                "page_size": self.cb_config.page_size, "max_batch_tokens": self.cb_config.max_batch_tokens,
                "num_blocks": self.cb_config.num_blocks,
                "max_requests_per_batch": self.cb_config.max_requests_per_batch,
                "allow_block_sharing": False,
                "persistent_manager": True}

    def run(self, prompts: list[list[int]]) -> Run:
        t0 = time.perf_counter()
        results = self.model.generate_batch(prompts, self.gen_config, continuous_batching_config=self.cb_config,
                                            persistent_manager=True)
        wall = time.perf_counter() - t0
        outputs = [r.generated_tokens for r in results.values()]
        assert len(outputs) == len(prompts), f"HF returned {len(outputs)} of {len(prompts)} requests"
        return Run(wall, outputs)


class TandemRunner:
    """Tandem's engine; the loop below is LLM.generate's, plus a read of last_step_timing per step."""

    def __init__(self, model_dir: Path, args, depth: int):
        self.name = f"tandem_depth{depth}"
        self.llm = LLM(str(model_dir), pipeline_depth=depth, dtype="float32", device="cpu",
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       enable_prefix_caching=False, seed=args.seed)
        self.params = SamplingParams(max_tokens=args.max_new_tokens, temperature=0, ignore_eos=True)

    def settings(self) -> dict:
        c = self.llm.engine.config  # the engine's: its token budget resolved
        return {"pipeline_depth": c.pipeline_depth, "max_num_seqs": c.max_num_seqs,
                "max_num_batched_tokens": c.max_num_batched_tokens, "block_size": c.block_size,
                "num_kv_blocks": self.llm.stats().kv_blocks_total, "enable_prefix_caching": False,
                "cpu_executor_thread": c.cpu_executor_thread}

    def run(self, prompts: list[list[int]]) -> Run:
        engine = self.llm.engine
        t0 = time.perf_counter()
        ids = [engine.add_request(p, self.params) for p in prompts]
        done, steps, last = {}, [], engine.last_step_timing
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
            if engine.last_step_timing is not last:  # a new dict per commit
                last = engine.last_step_timing
                steps.append(last)
        wall = time.perf_counter() - t0
        return Run(wall, [done[i] for i in ids], steps)


# ---- measurement ------------------------------------------------------------------------------------------
def _machine_busy_s() -> float:
    """CPU seconds spent busy by the whole machine since boot (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def timed(fn, *args) -> tuple[object, float]:
    """Run fn and return (its result, the fraction of the machine's CPUs other processes used meanwhile)."""
    machine0, own0, t0 = _machine_busy_s(), sum(os.times()[:2]), time.perf_counter()
    run = fn(*args)
    wall = time.perf_counter() - t0
    others = (_machine_busy_s() - machine0) - (sum(os.times()[:2]) - own0)
    return run, max(0.0, others) / (wall * os.cpu_count())


@dataclass
class QuietGate:
    """Timed runs start in a quiet moment and are redone when other processes took more than max_others."""

    max_others: float
    retries: int
    wait_s: float  # longest wait for a quiet moment before each attempt

    def wait(self) -> None:
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline and timed(time.sleep, 2.0)[1] > self.max_others:
            pass


def measure(runners: list, prompts: list[list[int]], repeats: int, gate: QuietGate) -> dict[str, list[Run]]:
    """Warm each runner up once, then time `repeats` interleaved rounds."""
    for r in runners:
        t = r.run(prompts).wall_s
        log(f"warm-up {r.name}: {t:.2f}s")
    runs: dict[str, list[Run]] = {r.name: [] for r in runners}
    for i in range(repeats):
        for r in runners:
            runs[r.name].append(quiet_run(r, prompts, gate))
            run = runs[r.name][-1]
            log(f"repeat {i + 1}/{repeats} {r.name}: {run.wall_s:.2f}s "
                f"(other processes used {run.others_cpu_frac:.0%} of CPUs)")
    return runs


def quiet_run(runner, prompts: list[list[int]], gate: QuietGate) -> Run:
    """The quietest of up to 1 + gate.retries attempts (stops at the first under the threshold)."""
    best = None
    for _ in range(1 + gate.retries):
        gate.wait()
        run, others = timed(runner.run, prompts)
        run.others_cpu_frac = others
        if best is None or others < best.others_cpu_frac:
            best = run
        if others <= gate.max_others:
            break
        log(f"{runner.name}: other processes used {others:.0%} of CPUs ({run.wall_s:.2f}s); redoing")
    return best


def summarize(runs: list[Run], prompt_tokens: int) -> dict:
    walls = [r.wall_s for r in runs]
    wall = statistics.median(walls)
    out_tokens = sum(len(o) for o in runs[0].outputs)
    return {"wall_s": wall, "walls_s": walls, "others_cpu_frac": [r.others_cpu_frac for r in runs],
            "output_tokens": out_tokens,
            "output_tok_s": out_tokens / wall, "total_tok_s": (out_tokens + prompt_tokens) / wall}


def _is_decode(step: dict) -> bool:
    return step["num_tokens"] == step["num_seqs"]


def step_stats(runs: list[Run]) -> dict | None:
    """Tandem's per-step medians (ms) over all timed runs, plus where one run's wall time went."""
    steps = [s for r in runs for s in r.steps]
    if not steps:
        return None
    result = {"steps_per_run": len(runs[-1].steps),
              "decode_steps_per_run": sum(map(_is_decode, runs[-1].steps))}
    for label, rows in (("all", steps), ("decode", [s for s in steps if _is_decode(s)])):
        for key in ("forward_s", "sample_s", "period_s"):
            result[f"{label}_{key[:-2]}_ms"] = 1e3 * statistics.median(s[key] for s in rows)
        result[f"{label}_seqs"] = statistics.median(s["num_seqs"] for s in rows)
    splits = [time_split(r) for r in runs]
    result["split_s"] = {k: statistics.median(sp[k] for sp in splits) for k in splits[0]}
    return result


def time_split(run: Run) -> dict:
    """Seconds of one run in prefill forwards, decode forwards, sampling, and everything else (host work,
    waits not covered by a forward or a sample; overlapped away at depth 2 when the pipeline works)."""
    prefill = sum(s["forward_s"] for s in run.steps if not _is_decode(s))
    decode = sum(s["forward_s"] for s in run.steps if _is_decode(s))
    sample = sum(s["sample_s"] for s in run.steps)
    return {"prefill_forward": prefill, "decode_forward": decode, "sample": sample,
            "other": run.wall_s - prefill - decode - sample, "wall": run.wall_s}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Fraction of requests with identical outputs, and mean fraction of tokens before the first mismatch."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        prefix.append(n / max(len(x), len(y), 1))
    return {"identical_frac": same / len(a), "mean_common_prefix_frac": sum(prefix) / len(prefix)}


# ---- machine and reporting --------------------------------------------------------------------------------
def machine_info() -> dict:
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "transformers": transformers.__version__, "python": sys.version.split()[0]}


def engine_revision(tree: Path = REPO) -> str:
    """The commit the engine code of checkout `tree` comes from, '+dirty' when its engine/ has uncommitted edits."""
    def git(*cmd: str) -> str:
        return subprocess.run(["git", "-C", str(tree), *cmd], capture_output=True, text=True).stdout.strip()
    return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "engine") else "")


def busy_processes() -> list[str]:
    """Known heavy jobs that would invalidate timings (the default-model trainer)."""
    out = subprocess.run(["pgrep", "-af", "train_default_model"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def print_table(report: dict) -> None:
    m, s, w = report["machine"], report["model"], report["workload"]
    print("\n=== Tandem vs HF generate_batch, CPU offline throughput ===")
    print(f"command : {report['command']}  (engine at {report['engine_revision']})")
    print(f"machine : {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads), "
          f"transformers {m['transformers']}")
    print(f"quiet   : {report['quiet']} (trainer running: {bool(report['busy_processes'])}; other processes used "
          f"{report['others_cpu_frac']:.0%} of the CPUs during timed runs, median; load avg "
          f"{report['loadavg_start']:.2f} -> {report['loadavg_end']:.2f})")
    print(f"model   : {s['family']} hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads / "
          f"{s['kv_heads']} kv, intermediate {s['intermediate']}, vocab {s['vocab']}, fp32, {s['source']}")
    print(f"workload: {w['num_requests']} requests, prompt {w['min_prompt']}-{w['max_prompt']} tokens "
          f"(total {w['prompt_tokens']}), {w['max_new_tokens']} new tokens each, greedy, ignore_eos, "
          f"seed {w['seed']}; warm-up + median of {w['repeats']}")
    _print_engines(report)
    _print_tandem_steps(report)
    for name, settings in report["settings"].items():
        print(f"{name} settings: {settings}")


def _print_engines(report: dict) -> None:
    hf = report["engines"].get("hf_generate_batch")
    print(f"\n{'engine':<20}{'wall s':>9}{'out tok/s':>11}{'total tok/s':>13}{'vs HF':>8}   runs s (others' CPU %)")
    for name, e in report["engines"].items():
        walls = ", ".join(f"{x:.2f} ({o:.0%})" for x, o in zip(e["walls_s"], e["others_cpu_frac"]))
        print(f"{name:<20}{e['wall_s']:>9.2f}{e['output_tok_s']:>11.1f}{e['total_tok_s']:>13.1f}"
              f"{hf['wall_s'] / e['wall_s'] if hf else float('nan'):>7.2f}x   {walls}")
    print(f"\ndepth-2 vs depth-1 speedup: {report['depth2_vs_depth1']:.3f}x")
    for pair, a in report["agreement"].items():
        print(f"identical outputs {pair}: {a['identical_frac']:.1%} "
              f"(mean common prefix {a['mean_common_prefix_frac']:.1%})")


def _print_tandem_steps(report: dict) -> None:
    for name, t in report["tandem_steps"].items():
        print(f"{name} per-step medians (ms), {t['steps_per_run']} steps/run ({t['decode_steps_per_run']} pure "
              f"decode): all forward {t['all_forward_ms']:.1f} sample {t['all_sample_ms']:.2f} period "
              f"{t['all_period_ms']:.1f} | decode forward {t['decode_forward_ms']:.1f} sample "
              f"{t['decode_sample_ms']:.2f} period {t['decode_period_ms']:.1f} ({t['decode_seqs']:.0f} seqs)")
        sp = t["split_s"]
        print(f"{name} wall split (s, median run): prefill forward {sp['prefill_forward']:.2f}, decode forward "
              f"{sp['decode_forward']:.2f}, sample {sp['sample']:.2f}, other {sp['other']:.2f} of {sp['wall']:.2f}")


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ---- main -------------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = p.add_argument_group("model")
    g.add_argument("--model", type=Path, help="existing HF checkpoint dir (default: build a random Llama)")
    g.add_argument("--hidden", type=int, default=512)
    g.add_argument("--layers", type=int, default=8)
    g.add_argument("--heads", type=int, default=8)
    g.add_argument("--kv-heads", type=int, default=4)
    g.add_argument("--intermediate", type=int, default=1408)
    g.add_argument("--vocab", type=int, default=8192)
    g.add_argument("--max-position", type=int, default=2048)
    g.add_argument("--init-std", type=float, default=0.1,
                   help="weight init std; larger than HF's 0.02 so greedy near-ties are rare")
    g = p.add_argument_group("workload")
    g.add_argument("--num-requests", type=int, default=64)
    g.add_argument("--min-prompt", type=int, default=32)
    g.add_argument("--max-prompt", type=int, default=256)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--repeats", type=int, default=3)
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("HF generate_batch")
    g.add_argument("--hf-attn", default="sdpa", choices=["sdpa", "paged|eager"])
    g.add_argument("--hf-page-size", type=int, default=32)
    g.add_argument("--hf-max-batch-tokens", type=int, default=512)
    g.add_argument("--hf-max-requests", type=int, default=24,
                   help="max_requests_per_batch; 0 = the number of requests (HF's own default)")
    g.add_argument("--hf-num-blocks", type=int, default=None, help="default: enough for the whole workload")
    g = p.add_argument_group("Tandem")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--engines", default="hf,tandem1,tandem2", help="subset to run (debugging)")
    g = p.add_argument_group("shared machine")
    g.add_argument("--max-others", type=float, default=0.05,
                   help="a timed run is redone when other processes used more than this share of the CPUs")
    g.add_argument("--retries", type=int, default=3, help="redo a noisy run at most this many times")
    g.add_argument("--quiet-wait", type=float, default=120.0,
                   help="before each attempt, wait up to this many seconds for a quiet 2 s window")
    p.add_argument("--json", type=Path, help="write the results here")
    return p.parse_args()


def build_runners(args, model_dir: Path, prompts: list[list[int]]) -> list:
    wanted = args.engines.split(",")
    runners = []
    if "hf" in wanted:
        runners.append(HFRunner(model_dir, args, prompts))
    for depth in (1, 2):
        if f"tandem{depth}" in wanted:
            runners.append(TandemRunner(model_dir, args, depth))
    return runners


def make_report(args, model_dir, source, prompts, runners, runs, busy_before, load0, revision) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    engines = {name: summarize(rs, prompt_tokens) for name, rs in runs.items()}
    busy = busy_before or busy_processes()
    others = statistics.median(r.others_cpu_frac for rs in runs.values() for r in rs)
    outs = {name: rs[-1].outputs for name, rs in runs.items()}
    pairs = [("hf_generate_batch", "tandem_depth1"), ("hf_generate_batch", "tandem_depth2"),
             ("tandem_depth1", "tandem_depth2")]
    d1, d2 = engines.get("tandem_depth1"), engines.get("tandem_depth2")
    return {
        "command": " ".join([sys.executable.split("/")[-1]] + sys.argv),
        "engine_revision": revision, "machine": machine_info(),
        "quiet": not busy and others <= args.max_others, "busy_processes": busy,
        "others_cpu_frac": others,
        "loadavg_start": load0, "loadavg_end": os.getloadavg()[0],
        "model": {**model_shape(model_dir), "source": source},
        "workload": {"num_requests": len(prompts), "min_prompt": args.min_prompt, "max_prompt": args.max_prompt,
                     "prompt_tokens": prompt_tokens, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
                     "repeats": args.repeats},
        "settings": {r.name: r.settings() for r in runners},
        "engines": engines,
        "tandem_vs_hf": {n: engines["hf_generate_batch"]["wall_s"] / e["wall_s"] for n, e in engines.items()
                         if n.startswith("tandem") and "hf_generate_batch" in engines},
        "depth2_vs_depth1": d1["wall_s"] / d2["wall_s"] if d1 and d2 else float("nan"),
        "agreement": {f"{a} vs {b}": agreement(outs[a], outs[b]) for a, b in pairs if a in outs and b in outs},
        "tandem_steps": {n: step_stats(rs) for n, rs in runs.items() if n.startswith("tandem")},
    }


def main() -> None:
    args = parse_args()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # "no psutil" noise: we size the cache
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    busy_before = busy_processes()
    if busy_before:
        log(f"WARNING: machine busy, timings not valid: {busy_before}")
    load0 = os.getloadavg()[0]
    revision = engine_revision()  # now, next to the engine import: later edits to engine/ are not what runs
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        model_dir = args.model or build_checkpoint(args, Path(tmp))
        source = str(args.model) if args.model else f"random init (std {args.init_std}, seed {args.seed})"
        prompts = make_workload(args, model_shape(model_dir)["vocab"])
        runners = build_runners(args, model_dir, prompts)
        gate = QuietGate(args.max_others, args.retries, args.quiet_wait)
        runs = measure(runners, prompts, args.repeats, gate)
        report = make_report(args, model_dir, source, prompts, runners, runs, busy_before, load0, revision)
        for r in runners:
            if isinstance(r, TandemRunner):
                r.llm.shutdown()
    print_table(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
