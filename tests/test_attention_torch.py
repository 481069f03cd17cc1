"""The pure-PyTorch paged attention (the CPU backend, and the reference for GPU kernels) against dense
per-sequence attention computed from scratch: ragged decode rows (grouped by length inside the backend),
prefill chunks over a cached prefix, GQA, sliding window, and per-call layer settings (a window other than
the backend's own, Gemma 2's score soft-cap)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention import AttentionMetadata, LayerAttention, cpu_native, get_backend
from engine.attention.torch_paged import GROUP_MIN_ROWS, _group_by_length


def dense_reference(q, k, v, q_pos, scale, window=None, softcap=None):
    """q [n, H, D] at absolute positions q_pos; k/v [L, Hkv, D] for positions 0..L-1."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k.double()) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    kpos = torch.arange(k.shape[0])
    allowed = kpos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= kpos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v.double()).float()


# (backend's own window, LayerAttention passed per call or None): the per-call settings override the backend's.
LAYERS = {"full": (None, None), "window": (37, None), "call_window_over_full": (None, LayerAttention(37)),
          "call_full_over_window": (37, LayerAttention(None)), "softcap": (None, LayerAttention(None, 2.0)),
          "softcap_window": (37, LayerAttention(11, 2.0))}


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
@pytest.mark.parametrize("layers", list(LAYERS))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("num_decodes", [20, 3])
def test_paged_attention_equals_dense_per_sequence(heads, kv_heads, layers, backend_name, num_decodes):
    own_window, layer = LAYERS[layers]
    window = own_window if layer is None else layer.sliding_window
    softcap = None if layer is None else layer.softcap
    rng = random.Random(0)
    torch.manual_seed(0)
    bs, dim, num_blocks = 4, 16, 1000
    # Decode rows of very different lengths (20: several length groups, and the native kernel's one work
    # item per sequence; 3: its item per (sequence, KV head)) and two prefill chunks, one continuing a
    # cached prefix.
    chunks = [(rng.randint(1, 150), 1) for _ in range(num_decodes)] + [(40, 13), (9, 9)]
    free = list(range(num_blocks))
    rng.shuffle(free)
    k_cache = torch.randn(num_blocks, bs, kv_heads, dim)
    v_cache = torch.randn(num_blocks, bs, kv_heads, dim)
    tables, qs, ks, vs, slots, dense = [], [], [], [], [], []
    for seq_len, n in chunks:
        table = [free.pop() for _ in range(-(-seq_len // bs))]
        tables.append(table)
        k_all = torch.randn(seq_len, kv_heads, dim)
        v_all = torch.randn(seq_len, kv_heads, dim)
        for p in range(seq_len - n):  # the cached part, already in the pages
            k_cache[table[p // bs], p % bs] = k_all[p]
            v_cache[table[p // bs], p % bs] = v_all[p]
        q = torch.randn(n, heads, dim)
        qs.append(q)
        ks.append(k_all[seq_len - n:])
        vs.append(v_all[seq_len - n:])
        slots += [table[p // bs] * bs + p % bs for p in range(seq_len - n, seq_len)]
        dense.append(dense_reference(q, k_all, v_all, torch.arange(seq_len - n, seq_len), dim ** -0.5, window,
                                     softcap))
    width = max(map(len, tables))
    qsl = [0]
    for _, n in chunks:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor([s for s, _ in chunks], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        block_size=bs, query_lens_host=[n for _, n in chunks], seq_lens_host=[s for s, _ in chunks])
    backend = get_backend(backend_name, sliding_window=own_window)
    backend.prepare(meta)
    if backend_name == "torch" and num_decodes == 20:
        assert len(meta.backend_data.decodes) > 1, "the decode rows should span several length groups"
    out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta, dim ** -0.5, layer)
    torch.testing.assert_close(out, torch.cat(dense), atol=1e-5, rtol=1e-5)


def test_decode_rows_are_grouped_by_length_longest_first():
    rows = [(nb, i) for i, nb in enumerate([40, 3, 39, 38, 20, 19, 2, 37, 36, 35, 34, 33, 18, 17, 16, 15])]
    groups = _group_by_length(rows)
    assert [r for g in groups for r in g] == sorted(rows, reverse=True)  # every row once, longest first
    for g in groups[:-1]:
        assert len(g) >= GROUP_MIN_ROWS
    assert [g[0][0] for g in groups] == [40, 20]  # 20 < 0.75 * 40 once 8 rows are in the first group


def test_cpu_decode_kernel_builds_here():
    """The machines this project runs on have g++; a build failure must not hide behind the fallback."""
    assert cpu_native.load() is not None


@pytest.mark.parametrize("dim", [64, 128, 48])  # 64 / 128: AVX512-BF16 dot products (scores and values) where
@pytest.mark.parametrize("softcap", [None, 2.0])  # the CPU has them; 48: the per-row loops
@pytest.mark.parametrize("window,bs", [(0, 16), (37, 16), (0, 32)])  # 37: runs starting at odd positions
def test_cpu_decode_kernel_bf16_within_tolerance(softcap, dim, window, bs):
    """bf16 cache and queries, fp32 accumulation (soft-capped scores too; odd run lengths and starts, so the
    value path's pairs of rows end in a lone row): within bf16 rounding of the fp64 dense reference."""
    torch.manual_seed(1)
    heads, kv_heads, nblocks = 9, 3, 64
    lens = [1, 17, 300, 512, 45]
    k_cache, v_cache = torch.randn(nblocks, bs, kv_heads, dim), torch.randn(nblocks, bs, kv_heads, dim)
    width = -(-max(lens) // bs)
    tables = torch.stack([torch.randperm(nblocks)[:width] for _ in lens]).int()
    q = torch.randn(len(lens), heads, dim)
    kernel = cpu_native.load()
    out = kernel.paged_decode(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), tables,
                              torch.tensor(lens, dtype=torch.int32), dim ** -0.5, window, softcap or 0.0).float()
    for b, n in enumerate(lens):
        rows = tables[b].long()
        k = k_cache[rows].bfloat16().float().flatten(0, 1)[:n]
        v = v_cache[rows].bfloat16().float().flatten(0, 1)[:n]
        ref = dense_reference(q[b:b + 1].bfloat16().float(), k, v, torch.tensor([n - 1]), dim ** -0.5,
                              window or None, softcap)
        torch.testing.assert_close(out[b:b + 1], ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dim", [64, 128, 48])  # 64 / 128: the kernel's AVX-512 block path; 48: per-row loops
@pytest.mark.parametrize("bs", [16, 32])  # 32: runs longer than the 16-row score tiles
@pytest.mark.parametrize("num_seqs", [5, 24])  # a work item per (sequence, KV head), or per sequence
@pytest.mark.parametrize("window,softcap", [(0, None), (37, None), (0, 3.0)])
def test_cpu_decode_kernel_fp32_equals_dense(dim, bs, num_seqs, window, softcap):
    torch.manual_seed(2)
    heads, kv_heads, nblocks = 6, 2, 400
    lens = [random.Random(i).choice([1, 15, 16, 17, 33, 130, 301]) for i in range(num_seqs)]
    k_cache, v_cache = torch.randn(nblocks, bs, kv_heads, dim), torch.randn(nblocks, bs, kv_heads, dim)
    width = -(-max(lens) // bs)
    tables = torch.stack([torch.randperm(nblocks)[:width] for _ in lens]).int()
    q = torch.randn(len(lens), heads, dim)
    out = cpu_native.load().paged_decode(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32),
                                         dim ** -0.5, window, softcap or 0.0)
    for b, n in enumerate(lens):
        rows = tables[b].long()
        k, v = k_cache[rows].flatten(0, 1)[:n], v_cache[rows].flatten(0, 1)[:n]
        ref = dense_reference(q[b:b + 1], k, v, torch.tensor([n - 1]), dim ** -0.5, window or None, softcap)
        torch.testing.assert_close(out[b:b + 1], ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim,half", [(64, 32), (128, 64), (64, 16)])  # (64, 16): partial rotary
@pytest.mark.parametrize("window,softcap", [(0, None), (37, 3.0)])
@pytest.mark.parametrize("rotate", [True, False])
def test_decode_attend_is_rope_store_and_paged_decode_bit_for_bit(dtype, dim, half, window, softcap, rotate):
    """decode_attend (a decode step's attention from the qkv projection in one call) against the calls it replaces:
    rope_ on q and k in place, the K/V rows into their slots (one slot -1: not stored), paged_decode of the q heads."""
    torch.manual_seed(3)
    heads, kv_heads, bs, nblocks = 9, 3, 16, 64
    lens = [1, 17, 300, 45]
    kernel = cpu_native.load()
    k_cache = torch.randn(nblocks, bs, kv_heads, dim).to(dtype)
    v_cache = torch.randn(nblocks, bs, kv_heads, dim).to(dtype)
    tables = torch.stack([torch.randperm(nblocks)[:-(-max(lens) // bs)] for _ in lens]).int()
    slots = torch.tensor([int(tables[b, (n - 1) // bs]) * bs + (n - 1) % bs for b, n in enumerate(lens)])
    slots[2] = -1
    width = (heads + 2 * kv_heads) * dim
    qkv = torch.randn(len(lens), width + 8).to(dtype)[:, :width]  # strided rows, as a fused projection's slice
    cos, sin = torch.randn(len(lens), 1, half).to(dtype), torch.randn(len(lens), 1, half).to(dtype)
    rope = (cos, sin) if rotate else (None, None)

    want_qkv, want_k, want_v = qkv.clone(), k_cache.clone(), v_cache.clone()
    if rotate:
        kernel.rope_(want_qkv, cos[:, 0], sin[:, 0], heads + kv_heads, dim)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k.view(-1, kv_heads, dim)[slot] = want_qkv[t, heads * dim:(heads + kv_heads) * dim].view(kv_heads, dim)
            want_v.view(-1, kv_heads, dim)[slot] = want_qkv[t, (heads + kv_heads) * dim:].view(kv_heads, dim)
    lens32 = torch.tensor(lens, dtype=torch.int32)
    want = kernel.paged_decode(want_qkv[:, :heads * dim].contiguous().view(-1, heads, dim), want_k, want_v, tables,
                               lens32, dim ** -0.5, window, softcap or 0.0)

    got = kernel.decode_attend(qkv, *rope, k_cache, v_cache, slots, tables, lens32, heads, kv_heads, dim ** -0.5,
                               window, softcap or 0.0)
    assert got.shape == (len(lens), heads * dim) and got.dtype == dtype
    assert torch.equal(got, want.view(len(lens), -1))
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v) and torch.equal(qkv, want_qkv)


def test_decode_attend_refuses_what_it_cannot_run():
    kernel = cpu_native.load()
    qkv, cache = torch.randn(2, 5 * 64), torch.randn(8, 16, 1, 64)
    args = (torch.tensor([3, 4]), torch.zeros(2, 1, dtype=torch.int32), torch.tensor([4, 5], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="caches must be contiguous, in qkv's dtype"):
        kernel.decode_attend(qkv, None, None, cache.bfloat16(), cache.bfloat16(), *args, 3, 1, 0.125, 0, 0.0)
    with pytest.raises(RuntimeError, match=r"qkv must be \[tokens, \(heads \+ 2 kv_heads\) head_dim\]"):
        kernel.decode_attend(qkv, None, None, cache, cache, *args, 2, 1, 0.125, 0, 0.0)
    with pytest.raises(RuntimeError, match="slot 200 is past the cache's 128"):
        kernel.decode_attend(qkv, None, None, cache, cache, torch.tensor([3, 200]), *args[1:], 3, 1, 0.125, 0, 0.0)


def test_cpu_backend_takes_decode_steps_from_qkv_and_leaves_mixed_steps():
    """CpuPagedAttention.decode_qkv runs a decode-only step and declines (None, nothing written) a step with a
    prefill chunk or a cache of another dtype, which the eager path then serves."""
    backend = get_backend("cpu")
    heads, kv_heads, dim, bs = 4, 2, 64, 16
    caches = torch.zeros(8, bs, kv_heads, dim), torch.zeros(8, bs, kv_heads, dim)
    tables = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)

    def meta(query_lens, seq_lens):
        slots = [int(tables[i, (n - q + j) // bs]) * bs + (n - q + j) % bs
                 for i, (q, n) in enumerate(zip(query_lens, seq_lens)) for j in range(q)]
        starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0).int()
        m = AttentionMetadata(slot_mapping=torch.tensor(slots), query_start_loc=starts, block_tables=tables,
                              seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_size=bs,
                              query_lens_host=query_lens, seq_lens_host=seq_lens)
        backend.prepare(m)
        return m

    qkv = torch.randn(2, (heads + 2 * kv_heads) * dim)
    out = backend.decode_qkv(qkv, None, *caches, meta([1, 1], [5, 20]), 0.125, None, heads, kv_heads)
    assert out.shape == (2, heads * dim) and caches[0].abs().sum() > 0
    mixed = torch.randn(4, (heads + 2 * kv_heads) * dim)
    before = caches[0].clone()
    assert backend.decode_qkv(mixed, None, *caches, meta([1, 3], [6, 3]), 0.125, None, heads, kv_heads) is None
    assert backend.decode_qkv(qkv.bfloat16(), None, *caches, meta([1, 1], [6, 21]), 0.125, None, heads,
                              kv_heads) is None
    assert torch.equal(caches[0], before)


# A step's multi-token chunks for the prefill kernel (query tokens, seq_len): whole prompts, chunks continuing a
# context (queries at positions seq_len - n .. seq_len - 1, keys past the 256-key chunks of the online softmax)
# and a 2-token chunk.
PREFILL_CHUNKS = [(125, 125), (7, 40), (300, 700), (2, 2), (64, 511)]

# Every instruction-set level this CPU runs (cpu_native.isas()): each build's own prefill path (AVX-512
# intrinsics; the portable GCC-vector path compiled for AVX2 + FMA or for SSE2) against the same oracle.
ISAS = pytest.mark.parametrize("isa", cpu_native.isas(), ids=list(cpu_native.isas()))


def prefill_kernel(isa):
    kernel = cpu_native.load(isa)
    assert kernel is not None, f"the {isa} build of the CPU kernels did not build"
    return kernel


def prefill_case(isa, dtype, dim, heads, kv_heads, bs, seed):
    """The CPU kernels built for `isa` and one step's inputs in `dtype` over PREFILL_CHUNKS: q with a row before
    the chunks and two after them (the step's decode rows, which the kernel must leave alone), paged caches in
    shuffled blocks, the per-chunk tables and q_start, then q_len, seq_len."""
    kernel = prefill_kernel(isa)
    torch.manual_seed(seed)
    nblocks, chunks = 200, PREFILL_CHUNKS
    k_cache, v_cache = torch.randn(nblocks, bs, kv_heads, dim), torch.randn(nblocks, bs, kv_heads, dim)
    width = -(-max(n for _, n in chunks) // bs)
    tables = torch.stack([torch.randperm(nblocks)[:width] for _ in chunks]).int()
    starts = [1 + sum(n for n, _ in chunks[:i]) for i in range(len(chunks))]
    q = torch.randn(starts[-1] + chunks[-1][0] + 2, heads, dim)
    lens = [torch.tensor(x, dtype=torch.int32) for x in zip(*chunks)]
    return kernel, (q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), tables,
                    torch.tensor(starts, dtype=torch.int32), *lens)


@ISAS
def test_cpu_prefill_kernel_serves_fp32_and_bf16_at_every_level(isa):
    """No level leaves a dtype to the gather + SDPA fallback: builds without AVX-512 (and bf16 without
    AVX512-BF16) take the portable path."""
    kernel = prefill_kernel(isa)
    assert set(kernel.prefill_dtypes) == {"float32", "bfloat16"}
    assert set(kernel.prefill_head_sizes) == {64, 128, 256}  # Gemma 2 and 3: 256
    # bf16-rounded probabilities (VDPBF16PS) only where the build has AVX512-BF16; the portable path keeps fp32
    assert kernel.prefill_bf16_probs == (isa == "avx512" and "avx512_bf16" in cpu_native._cpu_flags())


# (head size, query heads, KV heads, block size): three head layouts at 64 and 128; at 256 (Gemma 2 and 3, whose
# value micro-kernel takes two passes over V) Gemma 3 270M's 4 heads over 1 and a group of 4 over 2 KV heads.
PREFILL_SHAPES = [(dim, *heads) for dim in (64, 128) for heads in [(9, 3, 16), (4, 4, 32), (8, 1, 16)]]
PREFILL_SHAPES += [(256, 4, 1, 16), (256, 8, 2, 32)]


@ISAS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dim,heads,kv_heads,bs", PREFILL_SHAPES)
@pytest.mark.parametrize("window,softcap", [(0, None), (37, None), (300, None), (0, 2.0), (37, 2.0)])
def test_cpu_prefill_kernel_matches_dense(isa, dtype, dim, heads, kv_heads, bs, window, softcap):
    """All of a step's multi-token chunks in one call (PREFILL_CHUNKS); rows not in a chunk (the step's decode
    rows) are left alone. Against the fp64 dense reference on the same (bf16-valued) inputs:
    - fp32, every path: within 2e-5 (fp32 sums, a ~1-ulp exp);
    - bf16 on the portable path (fp32 probabilities and sums, the output rounded to nearest even): the fp32
      bound plus the rounding of the result to bf16, at most half an ulp: 2^-8 of the value (bf16 keeps 8
      significant bits);
    - bf16 on the AVX512-BF16 path: the probabilities are rounded to bf16 too, within 2e-2."""
    kernel, args = prefill_case(isa, dtype, dim, heads, kv_heads, bs, seed=3)
    q, k_cache, v_cache, tables, starts = args[:5]
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    kernel.paged_prefill(*args, dim ** -0.5, window, softcap or 0.0, out)
    assert out[0].isnan().all() and out[-2:].isnan().all()
    if dtype == torch.float32:
        atol = rtol = 2e-5
    elif kernel.prefill_bf16_probs:
        atol = rtol = 2e-2
    else:
        atol, rtol = 2e-5, 2e-5 + 2 ** -8
    for c, ((n, seq_len), start) in enumerate(zip(PREFILL_CHUNKS, starts.tolist())):
        rows = tables[c].long()
        k = k_cache[rows].double().flatten(0, 1)[:seq_len]
        v = v_cache[rows].double().flatten(0, 1)[:seq_len]
        ref = dense_reference(q[start:start + n].double(), k, v, torch.arange(seq_len - n, seq_len),
                              dim ** -0.5, window or None, softcap)
        torch.testing.assert_close(out[start:start + n].float(), ref, atol=atol, rtol=rtol)


@ISAS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("dim,heads,kv_heads", [(64, 9, 3), (256, 4, 1)])
def test_cpu_prefill_kernel_same_result_however_k_is_packed(isa, dtype, window, dim, heads, kv_heads):
    """The kernel transposes each chunk's K once ahead of its work items, in groups of chunks up to
    k_pack_bytes, and packs a chunk too large for that per item instead. The arithmetic is the same either way,
    so every budget gives the same bits: the default (all chunks in one group), 0 (every chunk per item), and
    200 KB, where chunks 0 and 1 share a group, 2 (540 KB of K) and 4 (384 KB) go per item and 3 is a group of
    its own (9 heads over 3 KV heads of 64 fp32 dims; the portable path packs bf16 K widened to fp32 too; 1 KV
    head of 256 dims, 1 KB a key, splits the same way)."""
    kernel, args = prefill_case(isa, dtype, dim, heads, kv_heads, 16, seed=4)
    outs = []
    for budget in (8 << 20, 0, 200_000):
        out = torch.full(args[0].shape, float("nan"), dtype=dtype)
        kernel.paged_prefill(*args, dim ** -0.5, window, 0.0, out, k_pack_bytes=budget)
        outs.append(out)
    assert not outs[0][1:-2].isnan().any()  # the chunks' rows; the decode rows around them stay NaN
    for out in outs:
        assert out[0].isnan().all() and out[-2:].isnan().all() and torch.equal(out[1:-2], outs[0][1:-2])


def test_cpu_kernels_run_without_the_gil():
    """Every op of the CPU extension (paged_prefill, paged_decode, the GEMMs, RMSNorm, SiLU * up, RoPE) releases
    the GIL for the call, as PyTorch's own ops do, so another Python thread (an engine replica's Serve loop
    shipping chunks) runs meanwhile. With the switch interval at 100 s, the only way the ticking thread can get
    the GIL while this thread is in a call is the call releasing it: an op that holds it leaves the count
    exactly as it was before the call."""
    import sys
    import threading
    import time

    kernel = cpu_native.load()
    torch.manual_seed(0)
    bs, heads, kv_heads, dim, seq = 16, 8, 8, 64, 2048
    k_cache, v_cache = torch.randn(seq // bs * 4, bs, kv_heads, dim), torch.randn(seq // bs * 4, bs, kv_heads, dim)
    one_table = torch.arange(seq // bs, dtype=torch.int32)
    # Every argument is made here: PyTorch's ops release the GIL, so making one inside the timed span would let
    # the ticker in whatever the kernel does.
    decode_args = (torch.randn(64, heads, dim), k_cache, v_cache, one_table.repeat(64, 1),  # 64 x 2,048 tokens
                   torch.full((64,), seq, dtype=torch.int32), dim ** -0.5)
    calls = {"decode": lambda: kernel.paged_decode(*decode_args)}
    if "float32" in kernel.prefill_dtypes:
        q = torch.randn(seq, heads, dim)  # one whole 2,048-token prompt
        prefill_args = (q, k_cache, v_cache, one_table[None], *(torch.tensor([x], dtype=torch.int32)
                                                                for x in (0, seq, seq)),
                        dim ** -0.5, 0, 0.0, torch.empty_like(q))
        calls["prefill"] = lambda: kernel.paged_prefill(*prefill_args)
    if "float32" in kernel.gemm_dtypes:  # a prefill step's MLP shapes (SmolLM2-135M)
        x, gate_up = torch.randn(seq, 576), kernel.gemm_pack(torch.randn(3072, 576))
        calls["gemm_linear"] = lambda: kernel.gemm_linear(x, gate_up, None, 3072)
        if kernel.gemm_silu:
            calls["gemm_silu_mul"] = lambda: kernel.gemm_silu_mul(x, gate_up, None, 1536)
    rows, residual, w = torch.randn(8 * seq, 576), torch.randn(8 * seq, 576), torch.randn(576)
    wide, qkv = torch.randn(seq, 2 * 1536), torch.randn(seq, 15 * 64)
    cos, sin = torch.randn(seq, 32), torch.randn(seq, 32)
    rows16, residual16, w16 = rows.bfloat16(), residual.bfloat16(), w.bfloat16()
    calls.update(rms_norm=lambda: kernel.rms_norm(rows16, residual16, w16, 1e-5),  # bf16's
                 rms_norm_f32=lambda: kernel.rms_norm_f32(rows, residual, w, 1e-5, 8),  # any lane count
                 silu_mul=lambda: kernel.silu_mul(wide), rope_=lambda: kernel.rope_(qkv, cos, sin, 12, 64))
    # Calls in a row, so each span lasts >= ~20 ms on the dev VM (rope_ takes 0.4 ms there, silu_mul 1.5,
    # rms_norm 3): a released GIL is taken only once the ticker's sleep ends and the scheduler runs it, which a
    # call shorter than that can miss. Between the calls this thread keeps the GIL (switch interval 100 s).
    repeats = {"rope_": 50, "silu_mul": 15, "rms_norm": 8}
    ticks, stop = [0], threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.0002)  # releases the GIL; taking it back needs this thread's holder to let go

    old = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    ticker = threading.Thread(target=tick, daemon=True)
    try:
        ticker.start()
        during = {}
        for name, call in calls.items():
            for _ in range(3):
                before = ticks[0]
                kept = [call() for _ in range(repeats.get(name, 1))]
                during.setdefault(name, []).append(ticks[0] - before)
                del kept  # after the count: freeing a tensor releases the GIL, whatever the op that made it
    finally:
        stop.set()
        sys.setswitchinterval(old)
        ticker.join(timeout=5)
    assert all(max(n) > 0 for n in during.values()), f"ticks during each call: {during}"
