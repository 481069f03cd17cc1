#!/usr/bin/env python3
"""One engine (Tandem, vLLM or HF transformers) in its own process, for bench_peer_cpu.py.

    python bench/peer_worker.py ENGINE MODEL_DIR DTYPE RESULT_FD [options as JSON]

Reads one JSON command per line on stdin and writes one JSON result per line to the file descriptor
RESULT_FD (stdout is left to the engines' own logging). Imports only the engine it runs, so the same file
runs in Tandem's venv and in a vLLM venv.

Commands:
  {"op": "offline", "prompts": [[ids]], "max_tokens": N}  -> {"seconds": s, "tokens": [[ids]]}
  {"op": "single", "prompt": [ids], "max_tokens": N}     -> {"ttft_s": s, "ms_per_token": ms}
Greedy unless the options carry "sampling" ({"temperature": t, "top_p": p}: every engine samples with
those, from its own random stream); EOS ignored. "single" times one request alone: a 1-token generation
(prefill + first token), then a (1 + N)-token one; time per output token = (t(1 + N) - t(1)) / N.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class Tandem:
    def __init__(self, model_dir: str, dtype: str, opts: dict):
        sys.path.insert(0, str(REPO))
        from engine import LLM, SamplingParams

        self.params, self.sampling = SamplingParams, sampling(opts)
        self.llm = LLM(model_dir, device="cpu", dtype=dtype, enable_prefix_caching=False, seed=0,
                       cpu_kv_cache_bytes=int(opts["kv_gib"] * 1024**3), max_model_len=opts["max_model_len"])

    def generate(self, prompts, max_tokens):
        outs = self.llm.generate(prompts, self.params(max_tokens=max_tokens, ignore_eos=True, **self.sampling))
        return [o.token_ids for o in outs]


class VLLM:
    def __init__(self, model_dir: str, dtype: str, opts: dict):
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        self.params, self.prompt, self.sampling = SamplingParams, TokensPrompt, sampling(opts)
        self.llm = LLM(model_dir, dtype=dtype, seed=0, enable_prefix_caching=False,
                       max_model_len=opts["max_model_len"], enforce_eager=opts.get("vllm_eager", False))

    def generate(self, prompts, max_tokens):
        outs = self.llm.generate([self.prompt(prompt_token_ids=p) for p in prompts],
                                 self.params(max_tokens=max_tokens, ignore_eos=True, **self.sampling),
                                 use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


class HF:
    """generate_batch (continuous batching) for batches, generate for one request; the settings that
    bench_engine_cpu.py found fastest for this CPU (sdpa, page 32, 512 batch tokens, 24 requests a batch)."""

    def __init__(self, model_dir: str, dtype: str, opts: dict):
        import torch
        from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

        self.torch, self.gen_config_cls, self.cb_cls = torch, GenerationConfig, ContinuousBatchingConfig
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                          attn_implementation="sdpa").eval()
        self.sampling = sampling(opts)

    def generate(self, prompts, max_tokens):
        t = self.sampling
        cfg = self.gen_config_cls(max_new_tokens=max_tokens, do_sample=t["temperature"] > 0, eos_token_id=-1,
                                  pad_token_id=0, **(t if t["temperature"] > 0 else {}))
        if len(prompts) == 1:
            with self.torch.inference_mode():
                ids = self.torch.tensor(prompts)
                out = self.model.generate(ids, attention_mask=self.torch.ones_like(ids), generation_config=cfg)
            return [out[0, ids.shape[1]:].tolist()]
        page = 32
        blocks = (-(-(max(map(len, prompts)) + max_tokens) // page) + 1) * len(prompts)
        cb = self.cb_cls(page_size=page, max_batch_tokens=512, num_blocks=blocks, max_requests_per_batch=24,
                         allow_block_sharing=False, auto_switch_to_flash=False, seed=0)
        results = self.model.generate_batch(prompts, cfg, continuous_batching_config=cb)
        outputs = [r.generated_tokens for r in results.values()]  # in request order (bench_engine_cpu.py)
        assert len(outputs) == len(prompts), f"HF returned {len(outputs)} of {len(prompts)} requests"
        return outputs


def sampling(opts: dict) -> dict:
    """The run's sampling parameters: greedy (temperature 0) unless the options say otherwise."""
    return {"temperature": 0.0, "top_p": 1.0, **opts.get("sampling", {})}


ENGINES = {"tandem": Tandem, "vllm": VLLM, "hf": HF}


def main() -> None:
    name, model_dir, dtype, fd = sys.argv[1:5]
    opts = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    out = os.fdopen(int(fd), "w", buffering=1)
    engine = ENGINES[name](model_dir, dtype, opts)
    out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "offline":
            t0 = time.perf_counter()
            tokens = engine.generate(cmd["prompts"], cmd["max_tokens"])
            result = {"seconds": time.perf_counter() - t0, "tokens": tokens}
        elif cmd["op"] == "single":
            t0 = time.perf_counter()
            engine.generate([cmd["prompt"]], 1)
            t1 = time.perf_counter()
            engine.generate([cmd["prompt"]], 1 + cmd["max_tokens"])
            t2 = time.perf_counter()
            result = {"ttft_s": t1 - t0, "ms_per_token": ((t2 - t1) - (t1 - t0)) / cmd["max_tokens"] * 1e3}
        else:
            result = {"error": f"unknown op {cmd['op']!r}"}
        out.write(json.dumps(result) + "\n")


if __name__ == "__main__":  # vLLM's offline API spawns processes: the guard is required
    main()
