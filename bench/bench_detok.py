#!/usr/bin/env python3
"""The frontend's detokenizer per token, against tokenizers' own DecodeStream in the same run.

    python bench/bench_detok.py [--out bench/results] [--code DIR] [--repeats 5]

For each tokenizer (the SmolLM2 GGUF's 49k-token byte-level BPE, and the 4k-token one of the simulated
Qwen2.5-0.5B shape) and each kind of output (English prose; Japanese, Korean and emoji, where characters
split over tokens; uniform draws from the ordinary vocabulary, as the simulated device emits), the CPU time
per token of:
  extend   IncrementalDetokenizer.extend over a whole output at once (an offline request's one report),
  add      IncrementalDetokenizer.add token by token (a request with stop strings, or a streamed one),
  stream   tokenizers.decoders.DecodeStream.step token by token (the library's incremental decoder: the peer).
Every run checks that the texts are DecodeStream's (the tokenizer's decode of the ids, less a character the
output ends inside of). Median of --repeats.
--code DIR imports the engine from another checkout (a worktree of the commit before a change).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ENGLISH = ("The committee met on Tuesday to review the budget for the coming year. After a long discussion about "
           "maintenance costs, staffing and the new library wing, members agreed to postpone the final vote until "
           "the auditors had finished their report, which is expected early next month. ")
CJK_EMOJI = ("東京の天気は晴れのち曇り、午後から雨が降るでしょう。 서울은 오늘 맑고 따뜻합니다. "
             "今日は🍣と🍜を食べました🎉👩\u200d👩\u200d👧 家族で出かけるのが楽しみです。 ")
TOKENS = 300  # per output
OUTPUTS = 100


def outputs(tok, kind: str, rng: random.Random) -> list[list[int]]:
    if kind == "uniform":
        added = tok.get_added_tokens_decoder()  # special and other added tokens: never drawn
        ordinary = [t for t in range(tok.get_vocab_size(with_added_tokens=True)) if t not in added]
        return [[rng.choice(ordinary) for _ in range(TOKENS)] for _ in range(OUTPUTS)]
    ids = tok.encode((ENGLISH if kind == "english" else CJK_EMOJI) * 40, add_special_tokens=False).ids
    return [ids[a:a + TOKENS] for a in (rng.randrange(len(ids) - TOKENS) for _ in range(OUTPUTS))]


def _streamed(tok, decode_stream, ids: list[int]) -> str:
    s, parts = decode_stream(ids=[], skip_special_tokens=True), []
    for t in ids:
        parts.append(s.step(tok, t) or "")
    return "".join(parts)


def time_per_token(fn, outs) -> tuple[float, list[str]]:
    """(CPU us per token of fn over every output, the texts it returned)."""
    t0 = time.thread_time()
    texts = [fn(ids) for ids in outs]
    return (time.thread_time() - t0) / sum(map(len, outs)) * 1e6, texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--code", default=str(ROOT), help="the checkout whose engine/detokenizer.py runs")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--name", default=None, help="results file: detok_<name>.json/.md (default: none written)")
    args = ap.parse_args()
    sys.path.insert(0, args.code)
    sys.path.insert(0, str(ROOT / "bench"))
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream

    from engine.detokenizer import IncrementalDetokenizer  # (before bench_sim, which puts this checkout first)
    from engine.models.from_gguf import smollm2_dir
    from engine.sampling_params import SamplingParams

    import bench_sim
    from gpu_models import device_name
    from harness import write_results

    params = SamplingParams()
    prompt = [1, 2, 3]
    rows = []
    for name, path in [("SmolLM2-135M (49k)", Path(smollm2_dir()) / "tokenizer.json"),
                       ("sim Qwen2.5-0.5B (4k)", Path(bench_sim.model_dir("qwen2.5-0.5b")) / "tokenizer.json")]:
        tok = Tokenizer.from_file(str(path))
        IncrementalDetokenizer(tok, prompt, params)  # the tables, built once per tokenizer (not timed)
        for kind in ("english", "cjk_emoji", "uniform"):
            outs = outputs(tok, kind, random.Random(0))
            expected = [_streamed(tok, DecodeStream, ids) for ids in outs]

            def extend(ids):
                d = IncrementalDetokenizer(tok, prompt, params)
                d.extend(ids)
                return d.text

            def add(ids):
                d = IncrementalDetokenizer(tok, prompt, params)
                for t in ids:
                    d.add(t)
                return d.text

            def stream(ids):
                return _streamed(tok, DecodeStream, ids)

            row = {"tokenizer": name, "output": kind}
            for label, fn in (("extend", extend), ("add", add), ("stream", stream)):
                runs = []
                for _ in range(args.repeats):
                    us, texts = time_per_token(fn, outs)
                    runs.append(us)
                    if texts != expected:
                        raise SystemExit(f"{label} on {name} / {kind}: text differs from DecodeStream's")
                row[f"{label}_us_per_token"] = round(statistics.median(runs), 3)
            row["partial_char_tokens"] = round(sum(tok.decode([t]).count("\ufffd") > 0 for ids in outs for t in ids)
                                               / sum(map(len, outs)), 3)
            rows.append(row)
            print(row, flush=True)
    code = Path(sys.modules[IncrementalDetokenizer.__module__].__file__).parents[1]  # the checkout that ran
    meta = {"machine": device_name("cpu"), "code": str(code), "repeats": args.repeats, "tokens_per_output": TOKENS,
            "outputs": OUTPUTS}
    print(meta)
    if args.name:
        write_results(Path(args.out) / f"detok_{args.name}", "Detokenizer per token against DecodeStream", rows,
                      meta)


if __name__ == "__main__":
    main()
