"""Gemma 2, Gemma 3 (text) and Phi-3 through the one decoder: fp32 greedy equals Hugging Face transformers'
generate on the same tiny random weights, token for token, under the engine's hard paths (which the
mixture-of-experts families run here too: ENGINE_PATH_FAMILIES).

The tiny checkpoints (tests/tiny_models.py EXTRA_FAMILIES) make every family switch change the output:
sliding and global layers alternate with a 12-token window (prompts reach 70 tokens), Gemma 2 soft-caps
scores at 4 and logits at 1, Gemma 3's local layers use their own RoPE while its global ones are linearly
scaled, Phi-3 slides every layer over 24 tokens, and the LongRoPE variant rotates 3/4 of each head. Norm
weights and biases are random. The HF helpers (near-tie tolerance included) are test_correctness_hf's.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil

import pytest
import torch

import tiny_models
from engine import LLM, EngineConfig, SamplingParams
from engine.models import model_spec
from engine.models.decoder import RMSNorm, rounded
from engine.pipeline import LocalStageGroup, PipelineEngine
from test_correctness_hf import MAX_NEW, assert_matches_hf, hf_greedy, make_prompts, run
from test_pipeline_parallel import GREEDY, run_engine

FAMILIES = ["gemma2", "gemma3_text", "phi3"]
# The engine-path tests below (chunked prefill, prefix hits, KV pressure, pipeline stages) also run the
# mixture-of-experts families; their own tests (routing, expert layouts, kernels) are tests/test_moe.py.
ENGINE_PATH_FAMILIES = FAMILIES + list(tiny_models.MOE_FAMILIES)
DEPTHS = [1, 2]


@pytest.mark.parametrize("family", ENGINE_PATH_FAMILIES)
@pytest.mark.parametrize("depth", DEPTHS)
def test_greedy_matches_hf_with_chunked_prefill(tiny_model_factory, family, depth):
    """Prompt lengths 3..70 around the window, block_size 4, a 16-token budget: long prompts are chunked
    and share steps (and so, for MoE, expert groups) with other requests' decodes."""
    path, hf = tiny_model_factory(family)
    llm = LLM(str(path), pipeline_depth=depth, block_size=4, max_num_batched_tokens=16)
    prompts = make_prompts(seed=1)
    for prompt, ours in zip(prompts, run(llm, prompts)):
        assert_matches_hf(hf, prompt, ours)
    assert llm.stats()["steps"] > MAX_NEW  # the budget forced more steps than an unchunked run needs


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_gemma_head_size_256_prefills_through_the_native_kernel(tmp_path, family, monkeypatch):
    """Gemma's real head size (256; the tiny checkpoints' is 16, which the CPU prefill kernel leaves to gather +
    SDPA): every multi-token chunk of the sliding, global and (Gemma 2) soft-capped layers goes through
    paged_prefill, with none left to SDPA, and fp32 greedy still equals HF's."""
    from engine.attention import cpu_native
    from engine.attention.torch_paged import TorchPagedAttention

    kernel = cpu_native.load()
    assert kernel is not None
    dims, sdpa = [], []
    real = kernel.paged_prefill
    monkeypatch.setattr(kernel, "paged_prefill", lambda q, *a, **kw: dims.append(q.shape[-1]) or real(q, *a, **kw))
    monkeypatch.setattr(TorchPagedAttention, "_prefill", staticmethod(lambda *a: sdpa.append(1)))
    path, hf = tiny_models.build(family, tmp_path, head_dim=256)
    llm = LLM(str(path), block_size=4, max_num_batched_tokens=16)
    prompts = make_prompts(seed=1, lengths=(3, 17, 40))
    for prompt, ours in zip(prompts, run(llm, prompts)):
        assert_matches_hf(hf, prompt, ours)
    assert dims and set(dims) == {256} and not sdpa


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gemma2_on_the_other_attention_backends(tiny_model_factory, backend):
    """The soft-capped, alternating-window layers through the PyTorch reference and the Triton kernels
    (interpreted on CPU) too; the default CPU backend (native decode kernel) is the test above."""
    from engine.attention import triton_paged

    if backend == "triton" and not triton_paged.usable_on(torch.device("cpu")):
        pytest.skip("triton is not importable here, or not interpreted on CPU")
    path, hf = tiny_model_factory("gemma2")
    llm = LLM(str(path), block_size=4, max_num_batched_tokens=16, attention_backend=backend)
    prompts = make_prompts(seed=11, lengths=(5, 30, 41))
    for prompt, ours in zip(prompts, run(llm, prompts)):
        assert_matches_hf(hf, prompt, ours)


@pytest.mark.parametrize("family", ENGINE_PATH_FAMILIES)
@pytest.mark.parametrize("depth", DEPTHS)
def test_prefix_cache_hit_keeps_outputs_exact(tiny_model_factory, family, depth):
    """The same prompt twice: the second run reads its full blocks from the cache (past the window, so
    sliding layers read cached keys they must partly ignore) and gives the same tokens as HF."""
    path, hf = tiny_model_factory(family)
    llm = LLM(str(path), pipeline_depth=depth, block_size=4, max_num_batched_tokens=32)
    prompt = make_prompts(seed=2, lengths=(31,))[0]
    first = run(llm, [prompt])
    second = run(llm, [prompt, prompt[:25] + [7, 8, 9]])
    assert llm.stats()["prefix_cache_hit_tokens"] >= 28 + 24  # 7 full blocks, then 6 of the shared prefix
    assert second[0] == first[0]
    assert_matches_hf(hf, prompt, first[0])
    assert_matches_hf(hf, prompt[:25] + [7, 8, 9], second[1])


@pytest.mark.parametrize("family", ENGINE_PATH_FAMILIES)
@pytest.mark.parametrize("depth,cpu_blocks", [(1, 0), (1, 64), (2, 0), (2, 64)])
def test_kv_pressure_preempts_and_keeps_outputs_exact(tiny_model_factory, family, depth, cpu_blocks):
    """Too few KV blocks for the batch: sequences are preempted (soft reset and recompute, or offload to
    the CPU pool and swap back) and greedy outputs are unchanged."""
    path, hf = tiny_model_factory(family)
    llm = LLM(str(path), pipeline_depth=depth, block_size=4, num_kv_blocks=14, admission_margin=0.0,
              num_cpu_blocks=cpu_blocks)
    prompts = make_prompts(seed=6, lengths=(10, 11, 12, 13))
    for prompt, ours in zip(prompts, run(llm, prompts)):
        assert_matches_hf(hf, prompt, ours)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert (stats["num_offloads"] > 0) == (cpu_blocks > 0)


@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_match_hf(tiny_model_factory, family):
    """Greedy picks cannot see Gemma 2's final soft-cap (tanh is monotonic); the logprobs can: the chosen
    token's and the top-5's equal HF's log-softmax of the logits it chose from."""
    path, hf = tiny_model_factory(family)
    prompt = make_prompts(seed=12, lengths=(26,))[0]
    out = LLM(str(path), block_size=4).generate(
        [prompt], SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, logprobs=5))[0]
    ref, logits = hf_greedy(hf, prompt)
    assert out.token_ids == ref
    ref_lp = logits.log_softmax(-1)
    for i, lp in enumerate(out.logprobs):
        assert lp.logprob == pytest.approx(ref_lp[i, lp.token_id].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == ref_lp[i].topk(5).indices.tolist()
        for t, v in lp.top:
            assert v == pytest.approx(ref_lp[i, t].item(), abs=1e-4)


def test_phi3_longrope_short_and_long_factors(tiny_model_factory):
    """LongRoPE's factor is fixed per engine (engine/models/loader.py rope_tables): the long factor when
    max_model_len exceeds original_max_position_embeddings (64 here), the short one otherwise. HF picks
    per sequence length, so both agree for prompts past 64 tokens under the default max_model_len (512),
    and for anything under max_model_len=64. Partial rotary (3/4 of each head) runs in both."""
    path, hf = tiny_model_factory("phi3_longrope")
    long_prompts = make_prompts(seed=13, lengths=(66, 90))
    for prompt, ours in zip(long_prompts, run(LLM(str(path), block_size=4, max_num_batched_tokens=32),
                                             long_prompts)):
        assert_matches_hf(hf, prompt, ours)
    short_prompts = make_prompts(seed=14, lengths=(5, 30, 48))
    for prompt, ours in zip(short_prompts, run(LLM(str(path), block_size=4, max_model_len=64), short_prompts)):
        assert_matches_hf(hf, prompt, ours)


@pytest.mark.parametrize("family", ENGINE_PATH_FAMILIES)
def test_two_pipeline_stages_match_hf(tiny_model_factory, family):
    """4 layers over 2 in-process stages: each stage holds its own layers' windows (Gemma's alternation
    continues across the split), the tied head lives on the last stage, and each stage builds routed or
    dense MLPs by global layer index (Qwen3-MoE's layers 1 and 3 route: one of each per stage)."""
    path, hf = tiny_model_factory(family, num_hidden_layers=4)
    prompts = make_prompts(seed=1, lengths=(3, 17, 40))
    cfg = EngineConfig(model=str(path), block_size=4, max_num_batched_tokens=16, pipeline_parallel_size=2)
    outs = run_engine(PipelineEngine(cfg, LocalStageGroup), prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert_matches_hf(hf, prompt, out.token_ids)


def test_generation_config_eos_list_stops_on_any(tiny_model_factory, tmp_path):
    """Gemma's generation_config.json lists several EOS ids; generation stops on whichever comes first."""
    path, hf = tiny_model_factory("gemma3_text")
    ckpt = tmp_path / "gemma3_eos"
    shutil.copytree(path, ckpt)
    prompt = make_prompts(seed=15, lengths=(9,))[0]
    ref, _ = hf_greedy(hf, prompt)
    stop = ref[5]
    gen = json.loads((ckpt / "generation_config.json").read_text())
    gen["eos_token_id"] = [0, stop]
    (ckpt / "generation_config.json").write_text(json.dumps(gen))
    out = LLM(str(ckpt), block_size=4).generate([prompt], SamplingParams(max_tokens=MAX_NEW, temperature=0))[0]
    assert out.finish_reason == "stop" and out.token_ids == ref[: ref.index(stop) + 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gemma_norm_and_embedding_scale_are_bitwise_hf(tiny_model_factory, dtype):
    """The (1 + w) RMSNorm and the sqrt(hidden)-scaled embedding equal HF's modules bit for bit, in bf16
    too (where HF rounds the scale to 55.5-style bf16 values and normalises in fp32)."""
    _, hf = tiny_model_factory("gemma2")
    hf_norm = hf.model.layers[0].post_feedforward_layernorm
    norm = RMSNorm(hf_norm.weight.shape[0], hf_norm.eps, unit_offset=True)
    norm.weight.data.copy_(hf_norm.weight)
    x = torch.randn(7, hf_norm.weight.shape[0], generator=torch.Generator().manual_seed(0)) * 3
    # Copies: `.to` casts a module in place, and a bf16 round trip would leave the session-cached fp32 reference
    # rounded for every later test that compares against it.
    hf_norm = copy.deepcopy(hf_norm).to(dtype)
    with torch.no_grad():
        assert torch.equal(norm.to(dtype)(x.to(dtype)), hf_norm(x.to(dtype)))
        ids = torch.tensor([1, 5, 300, 511])
        hf_embed = copy.deepcopy(hf.model.embed_tokens).to(dtype)
        ours = hf_embed.weight[ids] * rounded(hf.config.hidden_size ** 0.5, dtype)
        assert torch.equal(ours, hf_embed(ids))
    assert rounded(3072 ** 0.5, torch.bfloat16) == 55.5


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_loaded_model_scales_embeddings_like_hf_in_bf16(tmp_path, family):
    """The engine's own model (loader + DecoderLM.embed, not the arithmetic restated) embeds as HF's scaled
    embedding in bf16. hidden_size 96: sqrt(96) = 9.798 is 9.8125 in bf16, so an unrounded constant differs
    (the tiny default of 64 has the exact sqrt 8 and could not tell them apart)."""
    import tiny_models
    from engine.attention import get_backend
    from engine.models.loader import build_model, load_hf_config

    path, hf = tiny_models.build(family, tmp_path, hidden_size=96)
    config = load_hf_config(str(path))
    model = build_model(str(path), config, model_spec(config), 64, get_backend("torch"), torch.bfloat16,
                        torch.device("cpu"), cpu_onednn=False)
    ids = torch.arange(0, tiny_models.VOCAB, 3)
    with torch.no_grad():
        ref = hf.model.embed_tokens.to(torch.bfloat16)(ids)
        assert torch.equal(model.embed(ids), ref)
        assert not torch.equal(model.embed_tokens(ids) * 96 ** 0.5, ref)  # the check can tell the two apart


def test_engines_tell_resolve_backend_whether_scores_are_soft_capped(tiny_model_factory, monkeypatch):
    """The single-process runner and each pipeline stage pass the model's soft-cap to resolve_backend, which
    keeps a soft-capped model off a flash-attn that cannot cap (tests/test_attention_kernels.py)."""
    import engine.model_runner
    import engine.pipeline.stage

    seen = []
    for module in (engine.model_runner, engine.pipeline.stage):
        real = module.resolve_backend
        monkeypatch.setattr(module, "resolve_backend",
                            lambda *a, real=real, **kw: seen.append(kw.get("softcap")) or real(*a, **kw))
    for family in ("gemma2", "phi3"):
        LLM(str(tiny_model_factory(family)[0]), block_size=4)
    assert seen == [True, False]
    path = tiny_model_factory("gemma2", num_hidden_layers=4)[0]
    PipelineEngine(EngineConfig(model=str(path), block_size=4, pipeline_parallel_size=2), LocalStageGroup)
    assert seen == [True, False, True, True]


def test_unsupported_family_settings_are_rejected(tiny_model_factory):
    from transformers import Gemma3TextConfig, Phi3Config

    _, hf = tiny_model_factory("gemma3_text")
    bidirectional = Gemma3TextConfig(**{**hf.config.to_dict(), "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        model_spec(bidirectional)
    _, phi = tiny_model_factory("phi3")
    odd = Phi3Config(**{**phi.config.to_dict(), "partial_rotary_factor": 0.3125,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.3125}})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        model_spec(odd)
    with pytest.raises(ValueError, match="layer types \\['chunked_attention'\\] are not supported"):
        dataclasses.replace(model_spec(hf.config), layer_types=("chunked_attention", "full_attention"))


def test_qwen2_window_only_on_its_sliding_layers(tmp_path):
    """config.layer_types decides which layers slide for every family (Qwen2's use_sliding_window with
    max_window_layers: here layer 0 global, layer 1 sliding over 12 tokens), as in HF."""
    import tiny_models

    path, hf = tiny_models.build("qwen2", tmp_path, use_sliding_window=True, sliding_window=12,
                                 max_window_layers=1, layer_types=["full_attention", "sliding_attention"])
    prompts = make_prompts(seed=16, lengths=(8, 40))
    for prompt, ours in zip(prompts, run(LLM(str(path), block_size=4, max_num_batched_tokens=16), prompts)):
        assert_matches_hf(hf, prompt, ours)
