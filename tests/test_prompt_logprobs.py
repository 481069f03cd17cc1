"""Prompt logprobs and generated-token logprobs against Hugging Face's log_softmax on the same fp32 weights."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams

ATOL = 1e-4


def prompts(lengths=(23, 9, 41)) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] log_softmax of HF's logits for the whole sequence (row i predicts token i+1)."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def check_prompt(hf, prompt: list[int], got, k: int) -> None:
    lp = hf_logprobs(hf, prompt)
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        e, row = got[i], lp[i - 1]
        assert e.token_id == prompt[i]
        assert abs(e.logprob - row[prompt[i]].item()) < ATOL, (i, e.logprob, row[prompt[i]].item())
        assert e.rank == int((row > row[prompt[i]]).sum()) + 1
        if k:
            ref_lp = row.topk(k).values  # values, not ids: near-ties may order differently
            assert torch.allclose(torch.tensor([v for _, v in e.top]), ref_lp, atol=ATOL)
            assert all(abs(row[t].item() - v) < ATOL for t, v in e.top)
        else:
            assert e.top == []


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("k", [0, 5])
def test_prompt_logprobs_match_hf_chunked(tiny_model_factory, depth, k):
    """block_size 4 and a 16-token budget: every prompt spans several steps, so a chunk's last position
    scores the next chunk's first token."""
    path, hf = tiny_model_factory("llama")
    llm = LLM(str(path), pipeline_depth=depth, block_size=4, max_num_batched_tokens=16)
    ps = prompts()
    outs = llm.generate(ps, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=k))
    for p, o in zip(ps, outs):
        check_prompt(hf, p, o.prompt_logprobs, k)
    llm.check_integrity()


def test_prompt_logprobs_ignore_prefix_cache_and_leave_neighbours_alone(tiny_model_factory):
    path, hf = tiny_model_factory("llama")
    llm = LLM(str(path), block_size=4, max_num_batched_tokens=32, enable_prefix_caching=True)
    ps = prompts()
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate(ps, greedy)]  # now every prompt's blocks are cached
    mixed = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=3), greedy, greedy]
    outs = llm.generate(ps, mixed)
    check_prompt(hf, ps[0], outs[0].prompt_logprobs, 3)
    assert outs[0].num_cached_tokens == 0  # it computed every position
    assert outs[1].prompt_logprobs is None and outs[2].num_cached_tokens > 0
    assert [o.token_ids for o in outs] == alone
    llm.check_integrity()


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_generated_logprobs_match_hf_greedy(tiny_model_factory, depth):
    path, hf = tiny_model_factory("llama")
    llm = LLM(str(path), pipeline_depth=depth, block_size=4, max_num_batched_tokens=16)
    ps = prompts()
    outs = llm.generate(ps, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=4))
    for p, o in zip(ps, outs):
        lp = hf_logprobs(hf, p + o.token_ids)
        for j, (tok, e) in enumerate(zip(o.token_ids, o.logprobs)):
            row = lp[len(p) - 1 + j]
            assert e.token_id == tok and abs(e.logprob - row[tok].item()) < ATOL
            assert torch.allclose(torch.tensor([v for _, v in e.top]), row.topk(4).values, atol=ATOL)


def test_prompt_logprobs_validated():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def test_sim_and_pipeline_engines_reject_prompt_logprobs(tiny_model_factory):
    """They cannot score prompt positions: a clear ValueError naming the field (HTTP 400), not a silent None."""
    from engine.config import EngineConfig
    from engine.pipeline import LocalStageGroup, PipelineEngine
    from engine.sim import SIM_MODELS

    sim = LLM(str(SIM_MODELS / "qwen2.5-0.5b"), device="sim", max_model_len=256, max_num_seqs=4)
    path, _ = tiny_model_factory("llama", num_hidden_layers=4)
    pp = PipelineEngine(EngineConfig(model=str(path), block_size=4, pipeline_parallel_size=2), LocalStageGroup)
    try:
        for engine in (sim.engine, pp):
            with pytest.raises(ValueError, match="^prompt_logprobs"):
                engine.add_request([5, 6, 7], SamplingParams(max_tokens=2, prompt_logprobs=0))
    finally:
        sim.shutdown()
        pp.shutdown()
