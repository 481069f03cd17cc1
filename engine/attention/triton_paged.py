"""Paged attention in Triton: a store kernel (new K/V into their paged slots) and one attention kernel for
decode and for prefill over a cached prefix, reading K/V through block tables.

Hand-written because no installable library does this job here: flash-attn has no wheels and needs
block_size % 256 == 0, FlashInfer JIT-compiles with nvcc at first use, and torch's paged FlexAttention is
private and synchronizes in its bookkeeping. The kernels follow the usual flash-attention recipe (online
softmax over key tiles; flash-decoding splits of the key range for small decode batches).

A cache in another dtype than the model's (EngineConfig.kv_cache_dtype, engine/kv_dtype.py) is converted as it
is written and read: bf16 rounded to nearest even; fp8 (e4m3) stored as x / scale rounded to nearest even and
saturated at +-448, read as stored * scale in fp32 and then in q's dtype for the dots, as vLLM's Triton
attention does. The scales are the layer's k_scale / v_scale tensors.

Every per-step value the kernels read comes from tensors (slot_mapping, query_start_loc, seq_lens,
block_tables, the fp8 scales) and the launch grids depend only on static shapes (tokens, sequences, heads),
so a decode step can be captured in a CUDA graph. They run on CUDA, and on CPU tensors under the Triton interpreter
(TRITON_INTERPRET=1 set before this module is imported), which is how the CPU test suite checks them
against the PyTorch reference. Importing this module never needs Triton: without it `AVAILABLE` is False.
"""

from __future__ import annotations

import functools
import os

import torch

from engine.attention.metadata import AttentionMetadata, LayerAttention
from engine.kv_dtype import FP8_MAX, KV_CAST, KV_FP8, kv_mode

try:  # the CPU torch build ships without Triton; the GPU runtime treats it as optional too
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised by a subprocess test that hides triton
    triton = None
    tl = None

AVAILABLE = triton is not None
INTERPRETED = AVAILABLE and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
MAX_SPLITS = 16


def usable_on(device: torch.device) -> bool:
    """Triton kernels run on CUDA, or anywhere under the interpreter."""
    return AVAILABLE and (device.type == "cuda" or INTERPRETED)


if AVAILABLE:
    # (jit code reads globals only as constexprs)
    _FP8_MAX, _KV_CAST, _KV_FP8 = tl.constexpr(FP8_MAX), tl.constexpr(KV_CAST), tl.constexpr(KV_FP8)

    @triton.jit
    def _round_e4m3(x):
        """fp32 `x` rounded to the nearest e4m3 value (ties to even), saturated at +-FP8_MAX, kept in fp32: the
        cast that follows is then exact. By its bits, because the interpreter's fp32 -> fp8e4nv cast (triton
        3.9) goes wrong where the rounding carries into the exponent (it halves the value it should give)."""
        bits = x.to(tl.uint32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        ax = tl.abs(x)
        # below 2^-6 (e4m3's smallest normal) the values are the multiples of 2^-9: round x * 2^9 to an
        # integer by adding and removing 1.5 * 2^23
        sub = ((ax * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
        out = tl.where(ax < 0.015625, tl.where(x < 0, -sub, sub), normal)
        return tl.minimum(tl.maximum(out, -_FP8_MAX), _FP8_MAX)

    @triton.jit
    def cache_value(x, scale_ptr, cache_ptr, KV: tl.constexpr):
        """`x` as the cache at `cache_ptr` stores it (KV: engine/kv_dtype.kv_mode): as is; cast (bf16 rounded to
        nearest even by its bits, the interpreter's cast truncates); or fp8: x / scale, rounded, saturated."""
        if KV == _KV_FP8:
            out = _round_e4m3(x.to(tl.float32) / tl.load(scale_ptr).to(tl.float32))
            out = out.to(cache_ptr.dtype.element_ty)
        elif KV == _KV_CAST:
            out = x.to(tl.float32)
            if cache_ptr.dtype.element_ty == tl.bfloat16:
                bits = out.to(tl.uint32, bitcast=True)
                out = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
            out = out.to(cache_ptr.dtype.element_ty)
        else:
            out = x
        return out

    @triton.jit
    def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
                         stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                         NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, KV: tl.constexpr):
        """One program per token: its K and V rows ([Hkv, D]) to slot_mapping[t] in the cache's dtype (cache_value);
        -1 = padding."""
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        blk = tl.maximum(slot, 0) // BLOCK_SIZE
        off = tl.maximum(slot, 0) % BLOCK_SIZE
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        # (h * 0 + slot) broadcasts the scalar first: the interpreter rejects `block & scalar` masks.
        mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM) & ((h * 0 + slot) >= 0)
        k = cache_value(tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask), k_scale_ptr, kc_ptr, KV)
        tl.store(kc_ptr + blk * stride_kcb + off * stride_kcs + h * stride_kch + d, k, mask=mask)
        v = cache_value(tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask), v_scale_ptr, vc_ptr, KV)
        tl.store(vc_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d, v, mask=mask)

    @triton.jit
    def safe_dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        # The interpreter's 16-bit float dot is wrong (triton 3.9): there, multiply in fp32 instead. Shared
        # with the fused-MoE kernels (engine/models/moe_triton.py).
        if UPCAST:
            out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            out = tl.dot(a, b, input_precision=PRECISION)
        return out

    @triton.jit
    def _find_seq(qsl_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
        """The sequence owning query tile `tile`: sequence i's tiles start at qsl[i] // BLOCK_Q + i."""
        lo: tl.int32 = 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
            if start <= tile:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    @triton.jit
    def _paged_attention_kernel(
            q_ptr, kc_ptr, vc_ptr, out_ptr, part_acc_ptr, part_ml_ptr, ticket_ptr, k_scale_ptr, v_scale_ptr,
            qsl_ptr, seq_lens_ptr, bt_ptr, num_seqs, scale, window, softcap,
            stride_qt, stride_qh, stride_ot, stride_oh,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
            NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            NUM_SPLITS: tl.constexpr, DECODE: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
            PRECISION: tl.constexpr, UPCAST: tl.constexpr, MERGE_HERE: tl.constexpr = False,
            KV: tl.constexpr = 0):
        """Program (tile, kv head, split): BLOCK_Q query tokens of one sequence times the GROUP query heads
        sharing kv head `kvh` (BLOCK_M rows), attending keys [0, own position] (or the sliding window) of
        its sequence; split `split` of NUM_SPLITS covers one slice of that key range. MERGE_HERE: the last
        split of a (tile, kv head) to finish merges the partials itself (no second launch). KV
        (engine/kv_dtype.kv_mode): K/V tiles read as stored, converted to q's dtype, or fp8 dequantized
        (stored * scale in fp32, then q's dtype)."""
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        if DECODE:  # every chunk is one token: tile i is sequence i
            seq = tile
            q_start = tl.load(qsl_ptr + seq)
            q_len = tl.load(qsl_ptr + seq + 1) - q_start
            q_tile = 0
        else:
            seq = _find_seq(qsl_ptr, tile, num_seqs, BLOCK_Q)
            q_start = tl.load(qsl_ptr + seq)
            q_len = tl.load(qsl_ptr + seq + 1) - q_start
            q_tile = tile - (q_start // BLOCK_Q + seq)
        ctx = tl.load(seq_lens_ptr + seq) - q_len  # positions cached before this chunk

        offs_m = tl.arange(0, BLOCK_M)
        tok = q_tile * BLOCK_Q + offs_m // GROUP  # token index within the chunk
        head = kvh * GROUP + offs_m % GROUP
        row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
        pos = ctx + tok
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        q = tl.load(q_ptr + (q_start + tok)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh
                    + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        # Keys this tile needs: up to its last query's position; split into NUM_SPLITS BLOCK_N-aligned slices.
        key_hi = ctx + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q)
        key_hi = tl.where(q_tile * BLOCK_Q < q_len, key_hi, 0)  # surplus prefill tiles: no rows, no keys
        key_lo = 0
        if SLIDING:
            key_lo = tl.maximum(ctx + q_tile * BLOCK_Q - window + 1, 0)
        per_split = tl.cdiv(tl.cdiv(tl.maximum(key_hi - key_lo, 0), NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = key_lo + split * per_split
        hi = tl.minimum(key_hi, lo + per_split)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        k_scale = 1.0
        v_scale = 1.0
        if KV == _KV_FP8:
            k_scale = tl.load(k_scale_ptr).to(tl.float32)
            v_scale = tl.load(v_scale_ptr).to(tl.float32)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < hi
            blk = tl.load(bt_ptr + seq * stride_bt + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
            in_blk = offs_n % BLOCK_SIZE
            k = tl.load(kc_ptr + (blk * stride_kb + in_blk * stride_ks + kvh * stride_kh)[None, :]
                        + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [D, N]
            if KV == _KV_FP8:
                k = (k.to(tl.float32) * k_scale).to(q.dtype)
            elif KV == _KV_CAST:
                k = k.to(q.dtype)
            s = safe_dot(q, k, PRECISION, UPCAST) * scale  # [M, N] fp32
            if SOFTCAP:  # cap * tanh(s / cap), tanh through exp (tl has no tanh); saturates to +-cap
                s = softcap - 2.0 * softcap / (tl.exp(2.0 * s / softcap) + 1.0)
            ok = n_ok[None, :] & (offs_n[None, :] <= pos[:, None])
            if SLIDING:
                ok = ok & (offs_n[None, :] > pos[:, None] - window)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked rows stay at p = 0
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(vc_ptr + (blk * stride_vb + in_blk * stride_vs + kvh * stride_vh)[:, None]
                        + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [N, D]
            if KV == _KV_FP8:
                v = (v.to(tl.float32) * v_scale).to(q.dtype)
            elif KV == _KV_CAST:
                v = v.to(q.dtype)
            acc = acc * alpha[:, None] + safe_dot(p.to(v.dtype), v, PRECISION, UPCAST)
            m_i = m_new

        row = (q_start + tok).to(tl.int64)
        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l == 0 only on padding rows (seq_len 0)
            tl.store(out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        else:  # unnormalised partials, merged by _merge_splits_kernel
            part = (row * NUM_HEADS + head) * NUM_SPLITS + split  # [BLOCK_M]
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                     mask=row_ok[:, None] & d_ok[None, :])
            tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
            tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
            if MERGE_HERE:
                _merge_if_last(part_acc_ptr, part_ml_ptr, ticket_ptr + tile * tl.num_programs(1) + kvh, out_ptr,
                               row, head, row_ok, offs_d, d_ok, stride_ot, stride_oh, NUM_HEADS, HEAD_DIM,
                               NUM_SPLITS)

    @triton.jit
    def _merge_if_last(part_acc_ptr, part_ml_ptr, ticket_ptr, out_ptr, row, head, row_ok, offs_d, d_ok,
                       stride_ot, stride_oh, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       NUM_SPLITS: tl.constexpr):
        """Split-K without a second launch (the "last block merges" of split-K GEMMs): every split takes a
        ticket after its partials are stored; the one drawing NUM_SPLITS - 1 saw all others' stores (the
        barrier orders this program's stores before its ticket, the acq_rel atomic orders the programs),
        merges the rows of this (tile, kv head), and resets the ticket to 0 for the next launch. Partials
        are read through L2 (.cg), never a stale L1 line."""
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
        if ticket == NUM_SPLITS - 1:
            tl.debug_barrier()
            tl.atomic_xchg(ticket_ptr, 0, sem="relaxed")
            base = (row * NUM_HEADS + head) * NUM_SPLITS  # [BLOCK_M]
            m_max = tl.full(row.shape, float("-inf"), tl.float32)
            for s in tl.static_range(NUM_SPLITS):
                m_max = tl.maximum(m_max, tl.load(part_ml_ptr + (base + s) * 2, mask=row_ok, other=float("-inf"),
                                                  cache_modifier=".cg"))
            m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
            total = tl.zeros(row.shape, tl.float32)
            acc = tl.zeros((row.shape[0], offs_d.shape[0]), tl.float32)
            for s in tl.static_range(NUM_SPLITS):
                m = tl.load(part_ml_ptr + (base + s) * 2, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
                w = tl.exp(m - m_safe)  # empty splits (m = -inf) weigh 0
                total += w * tl.load(part_ml_ptr + (base + s) * 2 + 1, mask=row_ok, other=0.0, cache_modifier=".cg")
                acc += w[:, None] * tl.load(part_acc_ptr + (base + s)[:, None] * HEAD_DIM + offs_d[None, :],
                                            mask=row_ok[:, None] & d_ok[None, :], other=0.0, cache_modifier=".cg")
            out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
            tl.store(out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _merge_splits_kernel(part_acc_ptr, part_ml_ptr, out_ptr, stride_ot, stride_oh,
                             NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                             NUM_SPLITS: tl.constexpr):
        """One program per (token, head): rescale the splits' partial sums to a common max and normalise."""
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs_s = tl.arange(0, NUM_SPLITS)
        part = (t * NUM_HEADS + h) * NUM_SPLITS + offs_s
        m = tl.load(part_ml_ptr + part * 2)
        l = tl.load(part_ml_ptr + part * 2 + 1)
        m_max = tl.max(m, 0)
        w = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # [S]; empty splits weigh 0
        total = tl.sum(l * w, 0)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        out = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
        tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _dim(n: int) -> int:
    """A power-of-two tile dimension >= 16 (tl.dot's minimum on GPUs) covering n."""
    return max(16, _pow2(n))


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def kv_scale_args(kv: int, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                  placeholder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale tensors a kernel reads in mode `kv` (kv_mode); `placeholder` (never read) when not fp8."""
    if kv != KV_FP8:
        return placeholder, placeholder
    if k_scale is None or v_scale is None:
        raise ValueError("an fp8 KV cache needs the layer's k_scale and v_scale tensors")
    return k_scale, v_scale


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    """k/v [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D] at slot_mapping [T] (-1 = skip), in the
    caches' dtype (fp8: quantized with the scalar scale tensors k_scale / v_scale)."""
    t, hkv, d = k.shape
    if t == 0:
        return
    kv = kv_mode(k.dtype, k_cache.dtype)
    ks, vs = kv_scale_args(kv, k_scale, v_scale, slot_mapping)
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping, ks, vs, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=hkv, HEAD_DIM=d, BLOCK_H=_pow2(hkv), BLOCK_D=_pow2(d), BLOCK_SIZE=k_cache.shape[1], KV=kv)


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                           block_n: int | None = None, num_splits: int | None = None,
                           out: torch.Tensor | None = None, softcap: float | None = None,
                           merge_in_kernel: bool = False, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D] over caches [num_blocks, block_size, Hkv, D]; returns [T, H, D].
    Caches in another dtype than q's are converted as they are read; fp8 ones dequantized with the scalar
    scale tensors k_scale / v_scale (required then).

    A step whose chunks are all single tokens (T == number of sequences) runs in decode mode: one tile per
    sequence and, when that leaves the GPU underused, the key range split across programs (flash-decoding).
    `softcap` (Gemma 2) caps the scaled scores at +-softcap through tanh before the softmax.
    `merge_in_kernel`: a split key range is merged by its last split program (one launch instead of two;
    the fused forward's choice), through per-(tile, kv head) tickets kept at zero between launches.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = meta.seq_lens.shape[0]
    hkv = k_cache.shape[2]
    group = num_heads // hkv
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0:
        return out
    decode = num_tokens == num_seqs
    if decode:
        block_q, block_m = 1, _dim(group)
        num_tiles = num_seqs
        splits = num_splits or _auto_splits(q.device, num_seqs * hkv)
    else:
        block_m = prefill_block_m(group, head_dim)
        block_q = block_m // group
        num_tiles = num_tokens // block_q + num_seqs  # upper bound; surplus tiles find no rows
        splits = num_splits or 1
    splits = _pow2(min(splits, MAX_SPLITS))
    part_acc = part_ml = out  # unused placeholders when not split
    merge_here = merge_in_kernel and splits > 1
    tickets = _tickets(q.device, num_tiles * hkv) if merge_here else meta.seq_lens
    if splits > 1:
        part_acc = torch.empty(num_tokens, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_tokens, num_heads, splits, 2, dtype=torch.float32, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else None  # fp32: no TF32 rounding (exact-ish vs torch)
    kv = kv_mode(q.dtype, k_cache.dtype)
    default_n, num_warps = launch_config(head_dim, decode, fp8=kv == KV_FP8)
    ks, vs = kv_scale_args(kv, k_scale, v_scale, meta.seq_lens)
    _paged_attention_kernel[(num_tiles, hkv, splits)](
        q, k_cache, v_cache, out, part_acc, part_ml, tickets, ks, vs, meta.query_start_loc, meta.seq_lens,
        meta.block_tables,
        num_seqs, scale, sliding_window or 0, softcap or 0.0, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), meta.block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=_dim(head_dim),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n or default_n,
        NUM_SPLITS=splits, DECODE=decode, SLIDING=sliding_window is not None, SOFTCAP=softcap is not None,
        PRECISION=precision,
        UPCAST=INTERPRETED and q.dtype != torch.float32, MERGE_HERE=merge_here, KV=kv, num_warps=num_warps)
    if splits > 1 and not merge_here:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_acc, part_ml, out, out.stride(0), out.stride(1), NUM_HEADS=num_heads, HEAD_DIM=head_dim,
            BLOCK_D=_pow2(head_dim), NUM_SPLITS=splits)
    return out


_TICKETS: dict[torch.device, torch.Tensor] = {}


def _tickets(device: torch.device, n: int) -> torch.Tensor:
    """At least n int32 split tickets on `device`, zero between launches (the merging program resets its
    own). Allocated, zeroed, once per device and size class: the first (largest-first) graph warm-up grows
    it before any capture, so a replay never allocates."""
    buf = _TICKETS.get(device)
    if buf is None or buf.numel() < n:
        buf = _TICKETS[device] = torch.zeros(max(4096, _pow2(n)), dtype=torch.int32, device=device)
    return buf


def prefill_block_m(group: int, head_dim: int) -> int:
    """Query rows (tokens x the group's heads) per prefill program: 64, or 32 past head_dim 128 (Gemma's 256),
    where a [64, 256] fp32 accumulator plus the q tile spill registers to the stack on sm_90."""
    return max(32 if head_dim > 128 else 64, _pow2(group))


def launch_config(head_dim: int, decode: bool, fp8: bool = False) -> tuple[int, int]:
    """(BLOCK_N, num_warps). Chosen from sm_90 compiles (scripts/compile_kernels.py) to stay clear of
    register spills and stack frames: 64-key tiles spill at head_dim 128 (the per-key block gather keeps
    64-bit addresses live); prefill runs 32-key tiles with 8 warps; decode runs 4 warps, since at head_dim
    128 with 8 warps and no key split (Llama-3.1-8B at 33+ rows on an H100) ptxas caps the kernel at 128
    registers with a 24-byte stack frame, while 4 warps need 146 and none. Past head_dim 128 (Gemma's 256)
    prefill runs 32-row tiles (prefill_block_m), also with 8 warps: 64 rows spilled 120-144 bytes to the
    stack with 16- or 32-key tiles, and 32 rows with 4 warps sat at 247-254 registers under Triton 3.9 and
    spilled 56-72 bytes under Triton 3.6 (the H200 image's), where 8 warps need 211-239 and no stack. With an
    fp8 KV cache (`fp8`) the dequantized [256, 32] key tile on top of that spilled 16 bytes at 255 registers
    under Triton 3.6, so that prefill takes 16-key tiles. Not yet tuned by timing on a GPU."""
    if fp8 and not decode and head_dim > 128:
        return 16, 8
    return 32, (4 if decode else 8)


def _auto_splits(device: torch.device, programs: int) -> int:
    """Enough key-range splits that a small decode batch still fills about two waves of the GPU."""
    if device.type != "cuda":
        return 1
    return max(1, min(MAX_SPLITS, -(-2 * _num_sms(device.index or 0) // programs)))


class TritonPagedAttention:
    """The CUDA backend: Triton kernels for the cache write and for attention (decode and prefill alike).

    Reads only tensors from the metadata (no host lists), so it can run inside a captured CUDA graph.
    """

    name = "triton"
    supports_graphs = True
    # Prompt chunks too: the prefill path's grid comes from the padded shapes (tokens // BLOCK_Q + sequences
    # tiles, the surplus finding no rows), so a mixed step is captured whole (engine/cuda_graphs.py).
    supports_mixed_graphs = True

    def __init__(self, sliding_window: int | None = None, block_n: int | None = None,
                 num_splits: int | None = None):
        if not AVAILABLE:
            raise ValueError("attention backend 'triton' needs the triton package (pip install triton)")
        self.sliding_window = sliding_window
        self.block_n = block_n
        self.num_splits = num_splits

    def prepare(self, meta: AttentionMetadata) -> None:
        """Nothing to precompute on the host: the kernels read the metadata tensors directly."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                layer: LayerAttention | None = None, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D]. Returns [T, H, D].
        `layer` None: the backend's own sliding window, no soft-cap (both are kernel arguments per call).
        k_scale / v_scale: the layer's fp8 scales (read only for an fp8 cache)."""
        store_kv_triton(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        layer = layer or LayerAttention(self.sliding_window)
        return paged_attention_triton(q, k_cache, v_cache, meta, scale, layer.sliding_window, self.block_n,
                                      self.num_splits, softcap=layer.softcap, k_scale=k_scale, v_scale=v_scale)
