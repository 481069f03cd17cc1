"""The CUDA runtime end to end: graphs, streams and events, on tiny random checkpoints (skipped without CUDA).

- fp32 greedy on the GPU (Triton kernels, CUDA graphs, pipelined) equals Hugging Face on the same weights.
- A captured decode graph computes what the same forward computes eagerly on the same buffers; a captured
  mixed-step graph (a prompt chunk beside decodes, padded) computes what the eager step computes unpadded.
- Pipelined (depth 2) and three slots (depth 3) equal blocking (depth 1) token for token, greedy, seeded and
  penalized sampling, in bf16 (at depth 3 penalized rows are finalized on an uncommitted input token, which the
  sampling counts on the device).
- Steady-state steps never synchronize the host with the device except through the commit's event wait
  (torch's sync debug mode turns any other synchronizing call into an error).
The kernel-level comparisons with the PyTorch reference are in test_attention_kernels.py (cuda params).
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.scheduler import ScheduledChunk
from engine.slot import Step
from test_runtime_paths import staged_seq
from test_correctness_hf import assert_matches_hf, make_prompts
from tiny_models import EXTRA_FAMILIES, FAMILIES

pytestmark = pytest.mark.gpu

NEW = 16


def cuda_llm(path, **kw) -> LLM:
    cfg = dict(device="cuda", block_size=16, max_num_batched_tokens=64, max_num_seqs=16, num_kv_blocks=256)
    return LLM(str(path), **{**cfg, **kw})


def greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_fp32_greedy_matches_hf(tiny_model_factory, family, graphs):
    path, hf = tiny_model_factory(family)
    llm = cuda_llm(path, dtype="float32", cuda_graphs=graphs, block_size=4, max_num_batched_tokens=16)
    prompts = make_prompts(seed=1)
    outs = llm.generate(prompts, greedy())
    for prompt, out in zip(prompts, outs):
        assert_matches_hf(hf, prompt, out.token_ids)
    stats = llm.stats()
    assert stats["attention_backend"] == "triton"
    assert (stats["graph_steps"] > 0) == graphs
    assert (stats["mixed_graph_steps"] > 0) == graphs  # steps with prompt chunks replay graphs too
    llm.check_integrity()


@pytest.mark.parametrize("family", list(EXTRA_FAMILIES))
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "layers"])
def test_fp32_greedy_matches_hf_gemma_phi(tiny_model_factory, family, fused):
    """Gemma 2/3's and Phi-3's features (soft-caps, sandwich norms, windows, partial and LongRoPE) on CUDA,
    through the fused forward and through the layers, token for token against HF (near-ties excepted).
    LongRoPE's factor is fixed per engine (test_model_families.test_phi3_longrope_short_and_long_factors):
    the short one, as HF picks for these prompts, under max_model_len 64."""
    path, hf = tiny_model_factory(family)
    longrope = family == "phi3_longrope"
    llm = cuda_llm(path, dtype="float32", cuda_graphs=False, block_size=4, max_num_batched_tokens=16,
                   fused_forward=fused, attention_backend="triton", **({"max_model_len": 64} if longrope else {}))
    prompts = make_prompts(seed=1, lengths=(3, 9, 17, 33, 40) if longrope else (3, 9, 17, 33, 40, 70))
    outs = llm.generate(prompts, greedy())
    for prompt, out in zip(prompts, outs):
        assert_matches_hf(hf, prompt, out.token_ids)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_graph_replay_equals_eager_forward(tiny_model_factory, dtype, tol):
    """Same slot buffers, same padded size: replaying the captured graph reproduces the eager forward."""
    path, _ = tiny_model_factory("qwen2")
    llm = cuda_llm(path, dtype=dtype)
    llm.generate(make_prompts(seed=4, lengths=(20, 35, 50)), greedy())  # leaves real KV in the cache
    runner = llm.engine.runner
    slot, size = runner.slots[0], runner.graphs.padded_size(3)
    assert size == 4
    # Three decode rows over blocks 0..3; slot -1 so neither run writes KV and both read the same cache.
    seqs = [staged_seq([5] * 19 + [5], [0, 1]), staged_seq([3] * 40 + [77], [2, 3, 0]),
            staged_seq([4] * 9 + [300], [1])]
    chunks = [ScheduledChunk(q, len(q.token_ids) - 1, 1, True) for q in seqs]
    slot.inputs.stage_step(chunks, runner.tables, runner.block_size, pad_to=size)
    slot.inputs.np["slot_mapping"][:3] = -1
    stream = runner.executor.compute_stream
    with torch.cuda.stream(stream), torch.inference_mode():
        slot.inputs.upload()
        slot.inputs.apply_tables(runner.device_tables, full_width=True)
        runner._decode_forward(slot, size, slot.inputs.metadata(runner.block_size, full_width=True))
        eager = slot.logits[:3].clone()
        slot.logits.zero_()
        runner.graphs.replay(slot, size)
        stream.synchronize()
    replayed = slot.logits[:3]
    assert ((replayed - eager).norm() / eager.norm()).item() <= tol
    assert torch.equal(replayed.argmax(-1), eager.argmax(-1))


@pytest.mark.parametrize("family,dtype,tol", [("qwen2", "float32", 1e-5), ("qwen2", "bfloat16", 2e-2),
                                              ("llama", "float32", 1e-5)])
def test_mixed_graph_replay_equals_the_eager_step(tiny_model_factory, family, dtype, tol):
    """Two decodes and a 13-token prompt chunk (its KV not written: slot -1, so both runs read the same cache):
    the eager step unpadded, against the mixed-step graph replayed with the step padded to its shape. (Families
    without sliding-window KV groups: these hand-made sequences have no window pages. Gemma's windows go through
    mixed graphs in the fused forward's HF test with graphs.)"""
    path, _ = tiny_model_factory(family)
    llm = cuda_llm(path, dtype=dtype, block_size=4, max_num_batched_tokens=64, num_kv_blocks=64)
    llm.generate(make_prompts(seed=4, lengths=(20, 35, 50)), greedy())  # leaves real KV in the cache
    runner = llm.engine.runner
    seqs = [staged_seq([5] * 19 + [5], [0, 1, 2, 3, 4]), staged_seq([3] * 10 + [77], [5, 6, 7]),
            staged_seq(list(range(40, 53)), [8, 9, 10, 11])]
    chunks = [ScheduledChunk(seqs[0], 19, 1, True), ScheduledChunk(seqs[1], 10, 1, True),
              ScheduledChunk(seqs[2], 0, 13, True)]
    tokens, seqs_padded = runner.graphs.plan.for_step(Step(0, runner.slots[0], chunks, chunks, 15, 0.0))
    assert (tokens, seqs_padded) == (16, 4)
    slot, stream, b = runner.slots[0], runner.executor.compute_stream, runner.slots[0].inputs
    runs = []
    for pad in (False, True):
        b.stage_step(chunks, runner.tables, runner.block_size, *((tokens, (), seqs_padded) if pad else ()))
        b.np["slot_mapping"][:15] = -1
        with torch.cuda.stream(stream), torch.inference_mode():
            b.upload()
            b.apply_tables(runner.device_tables, full_width=pad)
            slot.logits.zero_()
            if pad:
                runner.graphs.replay(slot, tokens, seqs_padded)
            else:
                runner._eager_forward(slot)
            stream.synchronize()
        runs.append(slot.logits[:3].clone())
    eager, replayed = runs
    assert ((replayed - eager).norm() / eager.norm()).item() <= tol
    assert torch.equal(replayed.argmax(-1), eager.argmax(-1))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_pipelined_equals_blocking_bf16(tiny_model_factory, family):
    path, _ = tiny_model_factory(family)
    prompts = make_prompts(seed=2, lengths=(3, 9, 17, 33, 40, 70, 5, 12))
    params = [greedy(24) if i % 2 else SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=i,
                                                      ignore_eos=True) for i in range(len(prompts))]
    params[3] = SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.3, frequency_penalty=0.4,
                               ignore_eos=True)
    runs = {}
    for depth in (1, 2, 3):
        llm = cuda_llm(path, dtype="bfloat16", pipeline_depth=depth)
        runs[depth] = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.stats()["graph_steps"] > 0
        llm.check_integrity()
    assert runs[1] == runs[2] == runs[3]


@pytest.mark.parametrize("depth", [None, 3], ids=["depth-default", "depth-3"])
def test_steady_state_never_synchronizes(tiny_model_factory, depth):
    """Launch, commit and finalize with torch.cuda.set_sync_debug_mode('error'): any .item(), blocking copy or
    synchronize in the loop raises. Mixed prefill/decode, graphs and eager steps, penalties, logprobs,
    min_tokens, per-request seeds. The commit's wait is an event synchronize, which the mode allows. At depth 3
    the penalized rows' uncommitted input tokens are counted on the device, with no sync either."""
    path, _ = tiny_model_factory("llama")
    llm = cuda_llm(path, dtype="bfloat16", pipeline_depth=depth)
    prompts = make_prompts(seed=3, lengths=(5, 40, 17, 9, 70))
    params = [greedy(20), SamplingParams(max_tokens=20, temperature=0.7, top_k=20, seed=1, logprobs=3),
              SamplingParams(max_tokens=20, temperature=1.0, min_p=0.05, repetition_penalty=1.2,
                             presence_penalty=0.3, frequency_penalty=0.2, min_tokens=5),
              SamplingParams(max_tokens=20, temperature=0.9, top_p=0.8, logprobs=0), greedy(7)]
    llm.generate(prompts, params)  # warm-up: Triton compiles, caching allocators fill
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = llm.generate(prompts, params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [len(o.token_ids) for o in outs] == [20, 20, 20, 20, 7]
    assert llm.stats()["graph_steps"] > 0
