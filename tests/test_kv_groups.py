"""Sliding-window KV groups (engine/kv_groups.py): sliding layers keep only their window's pages.

Oracles: Hugging Face transformers' fp32 greedy output on the same tiny Gemma weights (token for token, near-ties
excepted as in test_correctness_hf), the same engine with every layer's KV kept for the whole context
(disable_hybrid_kv_cache_manager=True), and page counts worked out here from the window and block size.
"""

from __future__ import annotations

import dataclasses

import pytest

from engine import LLM, SamplingParams
from engine.block_manager import BlockManager
from engine.core import RequestLimits
from engine.kv_groups import KVLayout
from engine.models.decoder import ModelSpec
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from test_correctness_hf import assert_matches_hf, make_prompts
from test_scheduler import commit

WINDOW = 12  # tiny_models' Gemma window
# 4 sliding : 2 full layers, as Gemma 3's 5 : 1 pattern scaled down: two sliding groups of two layers each.
PATTERN = ["sliding_attention", "sliding_attention", "full_attention"]


def _spec(layer_types, window=512) -> ModelSpec:
    return ModelSpec("gemma3_text", 256, 64, 128, len(layer_types), 4, 1, 16, 1e-6, False, False, False, True, True,
                     window, 4096, "gelu_pytorch_tanh", layer_types=tuple(layer_types))


def test_layout_groups_layers_as_gemma_needs():
    gemma3_270m = _spec((["sliding_attention"] * 5 + ["full_attention"]) * 3)
    layout = KVLayout.of(gemma3_270m)
    assert (layout.layers_per_page, layout.num_window_groups, layout.window) == (3, 5, 512)
    assert [layout.layer_group[i] for i in (5, 11, 17)] == [0, 0, 0]
    assert [layout.layer_slot[i] for i in (5, 11, 17)] == [0, 1, 2]
    sliding = [i for i in range(18) if i % 6 != 5]
    # every sliding layer has its own (group, slot); groups 1..5 hold three each
    assert sorted((layout.layer_group[i], layout.layer_slot[i]) for i in sliding) == \
        [(g, s) for g in range(1, 6) for s in range(3)]
    # Gemma 3 1B's 26 layers: 4 full, 22 sliding -> 6 sliding groups of 4, the last one padded
    one_b = KVLayout.of(_spec([("full_attention" if i % 6 == 5 else "sliding_attention") for i in range(26)]))
    assert (one_b.layers_per_page, one_b.num_window_groups) == (4, 6)
    # one group where nothing slides, everything slides, or the manager is off
    for layout in (KVLayout.of(_spec(["full_attention"] * 4)), KVLayout.of(_spec(["sliding_attention"] * 4)),
                   KVLayout.of(gemma3_270m, enabled=False)):
        assert layout.num_window_groups == 0 and layout.window is None
        assert layout.layer_group == (0,) * layout.num_layers and layout.layer_slot == tuple(range(layout.num_layers))


def _seq(n: int, rid: str = "r", max_tokens: int = 1000) -> Sequence:
    return Sequence(rid, None, list(range(3, 3 + n)), SamplingParams(max_tokens=max_tokens), frozenset(), 10_000, 512)


def test_a_growing_sequence_keeps_exactly_its_windows_pages():
    """Decode one position at a time: the live window pages are those of the blocks a query at the next position
    reads, worked out here from the window, and the pool accounting stays exact."""
    bs, window, k = 4, 10, 2
    bm = BlockManager(200, bs, window_groups=k, window=window)
    seq = _seq(1)
    for pos in range(60):
        bm.allocate(seq, pos + 1, start=pos)
        seq.num_computed = pos + 1
        first = max(0, pos - window + 1) // bs  # keys > pos - window
        assert seq.window_base == first
        live_blocks = len(seq.block_table) - first
        assert bm.num_free == 200 - len(seq.block_table) - k * live_blocks
        bm.check_integrity([seq])
    bm.free(seq)
    assert bm.num_free == 200
    bm.check_integrity()


def test_past_the_window_a_new_block_needs_only_its_full_page():
    """A decoding sequence grows (and slides) at block boundaries: the slide there gives back the window pages of
    the blocks that left the window since the last boundary as the new block takes a page in every group. Past
    the window one block leaves per boundary, so the growth takes one page net. With exactly that page free,
    allocate takes it (counted a page in every group, it would need 1 + k)."""
    bs, window, k = 4, 10, 2
    boundary = 24  # past the window: one block leaves it at every boundary from window + bs - 1 on
    # Held before it: blocks 0..5 in the full group, and in each sliding group the blocks from the first one the
    # query at the previous boundary (20, where the last slide ran) reads, (20 - 9) // 4 = 2, to 5.
    held = boundary // bs + k * (boundary // bs - (boundary - bs - window + 1) // bs)
    bm = BlockManager(held + 1, bs, window_groups=k, window=window)
    seq = _seq(1)
    for pos in range(0, boundary + 1, bs):
        left = max(0, pos - window + 1) // bs - max(0, pos - bs - window + 1) // bs  # blocks leaving the window
        assert left == (1 if pos >= window + bs - 1 else 0)
        assert bm.blocks_needed(seq, pos + 1, start=pos) == 1 + k - k * left
        assert bm.allocate(seq, pos + 1, start=pos)
        seq.num_computed = pos + bs  # the block's positions are decoded before the next boundary
        bm.check_integrity([seq])
    assert bm.num_free == 0 and seq.window_base == (boundary - window + 1) // bs


def test_a_prompt_the_size_check_admits_runs_alone_in_exactly_that_many_pages():
    """RequestLimits.check admits a prompt whose full pages plus one query's window pages fit the cache. In a cache
    of exactly that many pages the prompt runs (its chunks shrink to fit as the window slides) and decodes a token:
    the scheduler's counts are net of what the slide gives back, or it would stall with pages to spare."""
    bs, window, k, length = 4, 10, 2, 40
    blocks = -(-(length + 1) // bs)  # the prompt's positions and the first generated token's
    window_blocks = -(-(window - 1) // bs) + 1  # keys > p - window, the block of p among them
    pages = blocks + k * min(blocks, window_blocks)
    limits = RequestLimits(512, 10_000, pages, bs, 1, "test", True, True, k, window_blocks)
    seq = _seq(length, max_tokens=2)
    limits.check(seq.token_ids, seq.params)
    with pytest.raises(ValueError, match="more than the KV cache holds"):
        dataclasses.replace(limits, num_kv_blocks=pages - 1).check(seq.token_ids, seq.params)
    bm = BlockManager(pages, bs, window_groups=k, window=window)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=64, admission_margin=0.0)
    sched.add(seq)
    while sched.has_work():
        out = sched.schedule()
        assert out, "stalled with nothing in flight"
        commit(sched, out)
        bm.check_integrity([seq] if seq.block_table else [])
    assert len(seq.token_ids) == length + 2 and bm.num_free == pages


def test_prefix_hit_needs_the_window_pages_of_the_first_uncached_query():
    bs, window, k = 4, 10, 2
    bm = BlockManager(200, bs, window_groups=k, window=window)
    a = _seq(41, "a")
    bm.allocate(a, 41)
    a.num_computed = 41
    bm.cache_full_blocks(a, 41)
    bm.slide(a, 40)  # a decoded on: blocks before (40 - 9) // 4 = 7 left its window (their pages stay cached)
    b = _seq(41, "b")
    hits, hashes = bm.cached_prefix(b.token_ids)
    assert len(hits) == 10  # positions 0..39: the last token is never served from the cache
    bm.admit(b, hits, hashes)
    assert b.window_base == (40 - window + 1) // bs
    bm.check_integrity([a, b])
    bm.free(a), bm.free(b)
    # evict one window page of block 8 (needed by the query at 40): the hit must stop short of it
    victim = bm.hash_to_window[hashes[8]][1]
    bm.free_queue.move_to_end(victim, last=False)
    bm._pop_free()
    bm.ref_counts[victim] = 0
    bm.free_queue[victim] = None
    c = _seq(41, "c")
    hits, hashes = bm.cached_prefix(c.token_ids)
    n = len(hits)
    assert n < 10
    need = set(range(max(0, n * bs - window + 1) // bs, n))
    assert all(hashes[i] in bm.hash_to_window for i in need)
    bm.check_integrity()


def test_fork_and_copy_on_write_copy_every_group():
    bs, window, k = 4, 10, 2
    bm = BlockManager(100, bs, window_groups=k, window=window)
    a, b = _seq(6, "a"), _seq(6, "b")
    bm.allocate(a, 6)
    a.num_computed = 6
    bm.fork(a, b)
    pairs = bm.copy_on_write(b, 1)  # its partial last block: the full page and both window pages
    assert len(pairs) == 1 + k
    assert [src for src, _ in pairs] == [a.block_table[1], *a.window_table[k:2 * k]]
    assert b.block_table[1] != a.block_table[1] and b.window_table[k:] != a.window_table[k:]
    bm.check_integrity([a, b])


def _engine(path, **kw) -> LLM:
    return LLM(str(path), block_size=4, max_num_batched_tokens=16, **kw)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import tiny_models

    return tiny_models.build("gemma3_text", tmp_path_factory.mktemp("kv_groups"), num_hidden_layers=6,
                             layer_types=PATTERN)


def test_greedy_equals_hf_and_the_whole_context_layout(model):
    """Prompts around and past the window, decoded well past it: the same tokens as HF and as the engine that
    keeps every layer's KV."""
    path, hf = model
    prompts = make_prompts(seed=5, lengths=(3, 11, 13, 30, 47, 70))
    grouped, whole = _engine(path), _engine(path, disable_hybrid_kv_cache_manager=True)
    assert grouped.engine.core.kv_layout.num_window_groups == 2
    outs = grouped.generate(prompts, _greedy(40))
    ref = whole.generate(prompts, _greedy(40))
    for prompt, o, r in zip(prompts, outs, ref):
        assert o.token_ids == r.token_ids
        assert_matches_hf(hf, prompt, o.token_ids[:16])
    grouped.check_integrity()
    stats = grouped.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    # K and V of one position in one layer: 2 KV heads of 16, fp32 = 256 bytes; 2 full and 4 sliding layers
    assert (stats.kv_bytes_per_token_full, stats.kv_bytes_per_token_sliding) == (2 * 256, 4 * 256)
    assert whole.stats().kv_bytes_per_token_full == 6 * 256 and whole.stats().kv_bytes_per_token_sliding == 0
    pages = stats.kv_blocks_total
    assert (stats.kv_capacity_tokens, stats.kv_capacity_tokens_past_window) == (pages * 4 // 3, pages * 4)
    half = _engine(path, kv_cache_dtype="bfloat16", num_kv_blocks=30).stats()
    assert (half.kv_bytes_per_token_full, half.kv_bytes_per_token_sliding, half.kv_cache_dtype) == \
        (256, 512, "bfloat16")


@pytest.mark.parametrize("cpu_blocks", [0, 64], ids=["soft_reset", "offload"])
@pytest.mark.parametrize("depth", [1, 2])
def test_preemption_keeps_outputs_exact(model, cpu_blocks, depth):
    """Too few pages for the batch: sequences are preempted (recomputed, or offloaded with their live window
    pages and swapped back in) and the greedy tokens are still those of the whole-context engine."""
    path, hf = model
    prompts = make_prompts(seed=6, lengths=(20, 25, 30, 35))
    llm = _engine(path, num_kv_blocks=90, admission_margin=0.0, num_cpu_blocks=cpu_blocks, pipeline_depth=depth)
    whole = _engine(path, disable_hybrid_kv_cache_manager=True)
    outs = llm.generate(prompts, _greedy(40))
    for o, r in zip(outs, whole.generate(prompts, _greedy(40))):
        assert o.token_ids == r.token_ids
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    if cpu_blocks:
        assert stats["num_offloads"] > 0 and stats["num_swap_ins"] > 0
    llm.check_integrity()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_prefix_hits_forks_and_speculation_keep_outputs_exact(model):
    """A prompt served from the cache past the window, n = 2 siblings sharing (and copying on write) every group's
    pages, and n-gram drafts verified over window pages: all give the whole-context engine's greedy tokens."""
    path, hf = model
    prompt = make_prompts(seed=9, lengths=(45,))[0]
    whole = _engine(path, disable_hybrid_kv_cache_manager=True)
    ref = whole.generate([prompt], _greedy(30))[0].token_ids
    llm = _engine(path)
    assert llm.generate([prompt], _greedy(30))[0].token_ids == ref
    again = llm.generate([prompt], _greedy(30))[0]
    assert again.token_ids == ref and llm.stats()["prefix_cache_hit_tokens"] >= 40
    pair = llm.generate([prompt[:-3]], SamplingParams(n=2, max_tokens=30, temperature=0, ignore_eos=True))
    single = whole.generate([prompt[:-3]], _greedy(30))[0].token_ids
    assert [o.token_ids for o in pair] == [single, single]
    assert llm.stats()["num_cow_copies"] > 0
    llm.check_integrity()
    spec = _engine(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    repeat = (prompt[:10] * 5)[:48]  # repeated text: drafts are proposed and accepted
    out = spec.generate([repeat], _greedy(30))[0].token_ids
    assert out == whole.generate([repeat], _greedy(30))[0].token_ids
    assert spec.stats()["spec_accepted_tokens"] > 0
    spec.check_integrity()


def _preempts(path, num_seqs: int, prompts, params, **kw) -> bool:
    """Whether running `num_seqs` of the requests at once runs out of KV (any preemption)."""
    llm = _engine(path, max_num_seqs=num_seqs, admission_margin=0.0, **kw)
    for o in llm.generate(prompts, params):
        assert len(o.token_ids) == params.max_tokens
    llm.check_integrity()
    return llm.stats()["num_preemptions"] > 0


def test_capacity_for_long_requests_grows_as_the_window_allows(model):
    """The same KV bytes; requests of 96 tokens (prompt 56, 40 generated). Whole context: a request holds 24 blocks
    of 6 layers, so 60 blocks run 2 at once and a third preempts. Grouped: 24 pages of the 2 full layers, plus the
    window's pages in the 2 sliding groups (12-position window over blocks of 4: 4 blocks, up to 8 while a
    16-token prefill chunk is written): at most 24 + 2 * 8 = 40 pages of 2 layers, so 180 pages (the same bytes)
    run 4 at once without preempting anyone."""
    path, _ = model
    prompts = make_prompts(seed=3, lengths=(56,) * 6)
    params = _greedy(40)
    whole = dict(disable_hybrid_kv_cache_manager=True, num_kv_blocks=60)
    grouped = dict(num_kv_blocks=180)
    assert _engine(path, **grouped).engine.core.runner.kv_cache.nbytes == \
        _engine(path, **whole).engine.core.runner.kv_cache.nbytes
    assert not _preempts(path, 2, prompts, params, **whole) and _preempts(path, 3, prompts, params, **whole)
    assert not _preempts(path, 4, prompts, params, **grouped)


def test_sequences_that_fit_net_of_the_slide_run_without_preemption(model):
    """Four 8-token prompts, prefilled in one step, decode 40 tokens each in step. Past the window a sequence at a
    block boundary holds its full pages plus 4 window blocks (a 12-position window over blocks of 4: keys > p - 12,
    from block (p - 11) // 4 to p // 4) in each of the 2 sliding groups. The last boundary is position 44 (the last
    position computed is 46): 12 + 2 * 4 = 20 pages each, 80 for the four, and the pool holds exactly 80. The last
    of the four to cross it finds 80 - 3 * 20 - (11 + 2 * 4) = 1 page free and needs 1, as the block leaving the
    window gives its 2 window pages back (counted a page in every group, it would need 3 and preempt one). All four
    run at once without preemption, with the whole-context engine's and HF's greedy tokens."""
    path, hf = model
    prompts = make_prompts(seed=11, lengths=(8,) * 4)
    llm = LLM(str(path), block_size=4, max_num_batched_tokens=32, max_num_seqs=4, num_kv_blocks=80,
              admission_margin=0.0)
    outs = llm.generate(prompts, _greedy(40))
    assert llm.stats()["num_preemptions"] == 0
    whole = _engine(path, disable_hybrid_kv_cache_manager=True)
    for prompt, o, r in zip(prompts, outs, whole.generate(prompts, _greedy(40))):
        assert o.token_ids == r.token_ids
        assert_matches_hf(hf, prompt, o.token_ids[:16])
    llm.check_integrity()
    assert llm.stats()["kv_blocks_free"] == 80
