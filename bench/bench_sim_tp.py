#!/usr/bin/env python3
"""Tensor parallelism on the simulated accelerator: modelled step times for TP = 1, 2, 4, 8 (SIMULATED).

Nothing here runs on a GPU. Per TP size, the cost model (engine/sim/cost_model.py) prices one rank's share of
the step (weights, KV and heads split Megatron-style) plus the collectives over the profile's GPU link (a ring
all-reduce of the [tokens, hidden] activations after the embedding and after every o_proj and down_proj, and
the logits' vocabulary shards gathered to rank 0). Printed: decode steps at 1, 64 and 256 rows (1,000 tokens of
context each, graphs) and a 2,048-token prefill chunk, each with the collectives' share; then the real engine
(host side real, device time modelled) generating the same requests at each TP size: tokens per modelled
device second and the device busy fraction. Use it to reason about where TP pays on a given GPU (compute-
or bandwidth-bound steps split; the fixed ~8 us per all-reduce does not), not as a GPU measurement.

    python bench/bench_sim_tp.py [--gpu h100] [--model engine/sim/models/llama-3.1-8b] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine import LLM, SamplingParams  # noqa: E402
from engine.models import load_hf_config, model_spec  # noqa: E402
from engine.sim import PROFILES, SIM_MODELS, CostModel, StepShape  # noqa: E402

SHAPES = {"decode x1": StepShape([1], [1000], 1), "decode x64": StepShape([1] * 64, [1000] * 64, 64),
          "decode x256": StepShape([1] * 256, [1000] * 256, 256), "prefill 2048": StepShape([2048], [2048], 1)}


def modelled(spec, gpu: str, tp: int) -> dict:
    cost = CostModel(spec, 2, PROFILES[gpu], tp=tp)
    out = {}
    for name, shape in SHAPES.items():
        graph = name.startswith("decode")
        fwd = cost.forward_s(shape, graph)
        out[name] = {"forward_ms": fwd * 1e3, "collectives_ms": cost.tp_comm_s(shape) * 1e3}
    return out


def engine_run(model: str, gpu: str, tp: int, requests: int, tokens: int) -> dict:
    llm = LLM(model, device="sim", sim_gpu=gpu, tensor_parallel_size=tp, max_model_len=4096, max_num_seqs=256)
    llm.generate(["hello"] * 4, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    before = llm.stats().device_busy_s
    outs = llm.generate(["tell me a story"] * requests, SamplingParams(max_tokens=tokens, ignore_eos=True))
    s = llm.stats()
    llm.shutdown()
    busy = s.device_busy_s - before
    return {"output_tokens": sum(len(o.token_ids) for o in outs), "device_s": busy,
            "tok_per_device_s": sum(len(o.token_ids) for o in outs) / busy,
            "tok_per_gpu_s": sum(len(o.token_ids) for o in outs) / busy / tp,
            "device_busy_fraction": s.device_busy_fraction, "kv_blocks_per_rank": s.kv_blocks_total}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpu", default="h100", choices=sorted(PROFILES))
    p.add_argument("--model", default=str(SIM_MODELS / "llama-3.1-8b"))
    p.add_argument("--tp", default="1,2,4,8")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    spec = model_spec(load_hf_config(args.model))
    report = {"simulated": True, "gpu": args.gpu, "model": Path(args.model).name, "tp": {}}
    print(f"SIMULATED {args.gpu} (modelled, not measured): {report['model']}, bf16")
    for tp in [int(x) for x in args.tp.split(",")]:
        try:
            rows = modelled(spec, args.gpu, tp)
        except ValueError as exc:
            print(f"  TP={tp}: {exc}")
            continue
        run = engine_run(args.model, args.gpu, tp, args.requests, args.tokens)
        report["tp"][tp] = {"steps": rows, "engine": run}
        cells = "  ".join(f"{k} {v['forward_ms']:.2f} ms ({100 * v['collectives_ms'] / v['forward_ms']:.0f}% comm)"
                          for k, v in rows.items())
        print(f"  TP={tp}: {cells}")
        print(f"         engine: {run['tok_per_device_s']:.0f} tok per device-second ({run['tok_per_gpu_s']:.0f} "
              f"per GPU), busy {run['device_busy_fraction']:.2f}, {run['kv_blocks_per_rank']} KV blocks per rank")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
