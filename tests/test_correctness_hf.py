"""fp32 greedy outputs equal Hugging Face transformers' generate on the same weights, token for token.

A divergence is tolerated only where HF's own top-2 logits at that step are within TIE_GAP (a near-tie a
correct kernel may flip); that is asserted, not assumed.
"""

from __future__ import annotations

import random
import weakref

import pytest
import torch

from engine import LLM, SamplingParams
from tiny_models import FAMILIES

TIE_GAP = 1e-3
MAX_NEW = 16
# HF model -> {(prompt, n, generate kwargs): (tokens, logits)}, held weakly: keyed by id(model), a model built
# and dropped by one test could hand its references to a later model that got the same id
_ref_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def make_prompts(seed: int, lengths=(3, 9, 17, 33, 40, 70)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def hf_greedy(model, prompt: list[int], n: int = MAX_NEW, **gen_kwargs) -> tuple[list[int], torch.Tensor]:
    """HF's greedy continuation and the raw logits it chose from at each step ([n, vocab])."""
    refs = _ref_cache.setdefault(model, {})
    key = (tuple(prompt), n, tuple(sorted(gen_kwargs.items())))
    if key not in refs:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True, **gen_kwargs)
        tokens = out.sequences[0, len(prompt):].tolist()
        refs[key] = (tokens, torch.cat(out.logits).float())
    return refs[key]


def assert_matches_hf(model, prompt: list[int], ours: list[int], n: int = MAX_NEW) -> None:
    ref, logits = hf_greedy(model, prompt, n)
    assert len(ours) == len(ref) == n
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a == b:
            continue
        top2 = logits[i].topk(2).values
        gap = (top2[0] - top2[1]).item()
        assert gap < TIE_GAP, f"token {i}: engine {a} vs HF {b}, HF top-2 gap {gap:.2e} is not a tie"
        return  # after a genuine near-tie flip the two continuations legitimately differ


def run(llm: LLM, prompts, **params) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, **params))
    llm.check_integrity()
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], "blocks leaked after all requests finished"
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("scheduler", ["fifo", "prefill_first"])
def test_greedy_matches_hf_mixed_batch_chunked_prefill(tiny_model_factory, family, depth, scheduler):
    """Mixed prompt lengths, block_size 4 and a 16-token budget: long prompts are chunked and interleave
    with other requests' decodes."""
    path, hf = tiny_model_factory(family)
    llm = LLM(str(path), pipeline_depth=depth, scheduler=scheduler, block_size=4, max_num_batched_tokens=16)
    prompts = make_prompts(seed=1)
    for prompt, ours in zip(prompts, run(llm, prompts)):
        assert_matches_hf(hf, prompt, ours)
    assert llm.stats()["steps"] > MAX_NEW  # the budget forced more steps than an unchunked run needs


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_prefix_cache_hits_keep_outputs_exact(tiny_model_factory, depth):
    path, hf = tiny_model_factory("qwen3")
    llm = LLM(str(path), pipeline_depth=depth, block_size=4, max_num_batched_tokens=32)
    shared = make_prompts(seed=2, lengths=(23,))[0]
    prompts = [shared + tail for tail in make_prompts(seed=3, lengths=(1, 5, 9, 14))]
    first = run(llm, prompts[:1])
    hits_before = llm.stats()["prefix_cache_hit_tokens"]
    rest = run(llm, prompts[1:])
    hits = llm.stats()["prefix_cache_hit_tokens"] - hits_before
    assert hits >= 3 * 20, f"expected the 5 shared full blocks to be reused by 3 requests, got {hits} tokens"
    for prompt, ours in zip(prompts, first + rest):
        assert_matches_hf(hf, prompt, ours)
    again = run(llm, prompts)  # identical prompts: everything but the last block comes from cache
    assert again == first + rest


def test_prefix_cache_disabled_gives_no_hits(tiny_model_factory):
    path, hf = tiny_model_factory("llama")
    llm = LLM(str(path), block_size=4, enable_prefix_caching=False)
    prompt = make_prompts(seed=4, lengths=(30,))[0]
    a, b = run(llm, [prompt]), run(llm, [prompt])
    assert a == b and llm.stats()["prefix_cache_hit_tokens"] == 0
    assert_matches_hf(hf, prompt, a[0])


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_stop_token_mid_batch_zombies_are_skipped(tiny_model_factory, depth):
    """Requests end at different steps on a stop token; under depth 2 each rides one extra step as a zombie
    whose token is discarded (up to two under depth 3). Outputs are HF's greedy output cut at the stop token."""
    path, hf = tiny_model_factory("llama")
    llm = LLM(str(path), pipeline_depth=depth, block_size=4)
    prompts = make_prompts(seed=5)
    params, expected = [], []
    for i, prompt in enumerate(prompts):
        ref, _ = hf_greedy(hf, prompt)
        stop = ref[2 + i % 5]
        params.append(SamplingParams(max_tokens=MAX_NEW, temperature=0, stop_token_ids=[stop]))
        expected.append(ref[: ref.index(stop) + 1])
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "stop" for o in outs)
    llm.check_integrity()
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]
    if depth >= 2:
        assert llm.stats()["zombie_rows"] > 0
    else:
        assert llm.stats()["zombie_rows"] == 0


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_preemption_soft_reset_keeps_outputs_exact(tiny_model_factory, depth):
    """Too few KV blocks for the batch: sequences are preempted (soft reset) and recomputed later, and
    greedy outputs are unchanged."""
    path, hf = tiny_model_factory("qwen2")
    llm = LLM(str(path), pipeline_depth=depth, block_size=4, num_kv_blocks=14, admission_margin=0.0)
    prompts = make_prompts(seed=6, lengths=(10, 11, 12, 13))
    for prompt, ours in zip(prompts, run(llm, prompts)):
        assert_matches_hf(hf, prompt, ours)
    assert llm.stats()["num_preemptions"] > 0


def test_max_model_len_caps_generation(tiny_model_factory):
    path, hf = tiny_model_factory("llama")
    llm = LLM(str(path), max_model_len=24)
    prompt = make_prompts(seed=7, lengths=(20,))[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert out.token_ids == hf_greedy(hf, prompt)[0][:4]


def test_request_outgrowing_the_kv_cache_ends_with_length_and_others_finish(tiny_model_factory):
    path, hf = tiny_model_factory("llama")
    llm = LLM(str(path), block_size=4, num_kv_blocks=3, admission_margin=0.0)
    prompt = make_prompts(seed=8, lengths=(10,))[0]
    big, small = llm.generate([prompt, [7, 8]], [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                                                 SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)])
    # 12 KV positions: the prompt's 10, then 2 generated tokens' KV; the third token needs position 12.
    assert big.finish_reason == "length" and "KV cache" in big.error
    assert big.token_ids == hf_greedy(hf, prompt)[0][:3]
    assert small.finish_reason == "length" and len(small.token_ids) == 3
    llm.check_integrity()


def test_sharded_checkpoint_loads_like_a_single_file(tiny_model_factory, tmp_path):
    """A checkpoint saved in several safetensors shards (with its index) gives HF's output too."""
    from tiny_models import tokenizer

    path, hf = tiny_model_factory("qwen3")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    tokenizer().save_pretrained(tmp_path)
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").exists()
    prompts = make_prompts(seed=9, lengths=(5, 21))
    for prompt, ours in zip(prompts, run(LLM(str(tmp_path), block_size=4), prompts)):
        assert_matches_hf(hf, prompt, ours)


@pytest.mark.parametrize("family,dtype", [("llama", torch.float32), ("llama", torch.bfloat16),
                                          ("qwen3", torch.float32), ("gemma2", torch.float32)],
                         ids=["llama-fp32", "llama-bf16", "qwen3-fp32", "gemma2-fp32"])
def test_last_layer_on_sampled_rows_only(tiny_model_factory, family, dtype):
    """DecoderLM.forward's `keep` (the engine passes a step's sampled rows): the last layer caches every row's
    K/V but goes past its attention on the kept rows alone. The kept rows equal HF's final hidden states at
    those positions, and the full forward's; the cache is the full forward's bit for bit; repeats keep their
    order; an empty keep (a mid-prompt chunk) returns no rows. Llama and Qwen3 run the CPU fused-norm path in
    fp32 (and bf16), Gemma 2 the sandwich norms."""
    from engine.attention import AttentionMetadata, get_backend
    from engine.models import model_spec
    from engine.models.loader import build_model, load_hf_config

    path, hf = tiny_model_factory(family)
    config = load_hf_config(str(path))
    spec = model_spec(config)
    model = build_model(str(path), config, spec, 128, get_backend("cpu", sliding_window=spec.sliding_window),
                        dtype, torch.device("cpu"))
    prompts = make_prompts(seed=5, lengths=(7, 19))
    bs, blocks = 4, 16
    ids = torch.tensor(prompts[0] + prompts[1])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    tables = [list(range(0, 2)), list(range(2, 7))]  # 7 and 19 positions in blocks of 4
    slots = [tables[s][p // bs] * bs + p % bs for s, prompt in enumerate(prompts) for p in range(len(prompt))]

    def forward(keep):
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor([0, 7, 26], dtype=torch.int32),
            seq_lens=torch.tensor([7, 19], dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (5 - len(t)) for t in tables], dtype=torch.int32),
            block_size=bs, query_lens_host=[7, 19], seq_lens_host=[7, 19])
        model.layers[0].self_attn.backend.prepare(meta)
        caches = [(torch.zeros(blocks, bs, spec.num_kv_heads, spec.head_dim, dtype=dtype),
                   torch.zeros(blocks, bs, spec.num_kv_heads, spec.head_dim, dtype=dtype)) for _ in model.layers]
        with torch.inference_mode():
            return model(ids, positions, caches, meta, keep=keep), caches

    full, full_caches = forward(None)
    keep = torch.tensor([25, 6, 25])
    kept, kept_caches = forward(keep)
    assert kept.shape == (3, spec.hidden_size)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(kept, full.index_select(0, keep), **tol)
    assert torch.equal(kept[0], kept[2])
    for (k1, v1), (k2, v2) in zip(full_caches, kept_caches):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    with torch.no_grad():  # HF's final hidden states (after its final norm) at each prompt's last position
        ref = [hf(torch.tensor([p]), output_hidden_states=True).hidden_states[-1][0, -1] for p in prompts]
    torch.testing.assert_close(kept[:2].float(), torch.stack([ref[1], ref[0]]).float(), **tol)
    empty, empty_caches = forward(torch.tensor([], dtype=torch.long))
    assert empty.shape == (0, spec.hidden_size)
    assert all(torch.equal(k1, k2) for (k1, _), (k2, _) in zip(full_caches, empty_caches))
