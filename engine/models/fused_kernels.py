"""Triton kernels of the fused CUDA forward (engine/models/fused_forward.py): the elementwise work of a decoder
layer folded into the few kernels that read the data anyway.

    add_rms_norm    residual add + RMSNorm in one pass over each row: norm(x + residual) and the new residual
                    stream; Gemma's sandwich form (residual + norm_a(x), then norm_b of that) in the same pass
    rope_store      per (token, head) of the q/k/v GEMM's output: the optional per-head q/k RMSNorm (Qwen3,
                    Gemma 3), RoPE (rotate-half, partial rotary passes the tail through), q into its own
                    buffer, k and v straight into their paged cache slots (slot -1 = padding, skipped), in
                    the cache's dtype (kv_cache_dtype: converted, or fp8 quantized with the layer's scales)
    gate_up_act     the gate/up GEMM with act(gate) * up in its epilogue (SiLU, or Gemma's tanh GELU)
    act_mul         act(gate) * up alone, for a gate/up linear the GEMM cannot replace (a LoRA wrapper)

The roundings follow the eager PyTorch path (engine/models/decoder.py, itself HF's order): a bf16 residual sum
is rounded before it is normed, Llama's norm rounds x * rstd before the weight multiplies it, Gemma's scales by
(1 + w) in fp32; RoPE rounds each product to the model dtype before the sum. So bf16 results differ from the
eager path only where a row's fp32 sum of squares (summed in another order) tips a rounding, and gate_up_act,
which keeps gate and up in fp32 where eager rounds them, is closer to the exact value than eager is.

Grids depend only on static shapes and every per-step value comes from tensors, so these run inside CUDA
graphs. Importing this module never needs Triton (`AVAILABLE` False without it); on CPU tensors they run under
Triton's interpreter (TRITON_INTERPRET=1 before import), which is how the CPU tests check them.
"""

from __future__ import annotations

import torch

from engine.attention.triton_paged import AVAILABLE, INTERPRETED, kv_scale_args, tl, triton
from engine.kv_dtype import kv_mode

ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # the MLP activations the epilogues compute

if AVAILABLE:
    from engine.attention.triton_paged import cache_value, safe_dot

    @triton.jit
    def _round(x, OUT: tl.constexpr):
        """fp32 `x` rounded to OUT (to nearest, ties to even), kept in fp32. bf16 by its bits, because the
        interpreter's fp32 -> bf16 cast truncates (triton 3.9); a value rounded here then converts exactly."""
        if OUT == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            out = bits.to(tl.float32, bitcast=True)
        else:
            out = x.to(OUT).to(tl.float32)
        return out

    @triton.jit
    def _rstd(x, n, eps):
        """1 / sqrt(mean(x^2) + eps) of fp32 row `x` (its masked tail zero)."""
        return 1.0 / tl.sqrt(tl.sum(x * x, 0) / n + eps)

    @triton.jit
    def _scaled(y, w, UNIT_OFFSET: tl.constexpr, OUT: tl.constexpr):
        """y = x * rstd times the norm weight, rounded to OUT as the eager path rounds it: Llama's norm rounds
        y, then multiplies by the weight and rounds again; Gemma's multiplies by (1 + w) in fp32, rounds once."""
        if UNIT_OFFSET:
            out = _round(y * (1.0 + w.to(tl.float32)), OUT)
        else:
            out = _round(_round(y, OUT) * w.to(tl.float32), OUT)
        return out

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, pre_w_ptr, w_ptr, out_ptr, stream_ptr, n, eps,
                             stride_x, stride_r, stride_o, stride_s,
                             HAS_RESIDUAL: tl.constexpr, PRE_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr,
                             BLOCK_N: tl.constexpr):
        """One program per row: s = residual + (PRE_NORM ? norm_pre(x) : x) rounded to the dtype (s = x
        without a residual), stored as the new stream when HAS_RESIDUAL; out = norm(s)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_N)
        ok = cols < n
        dtype = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        if PRE_NORM:
            pre_w = tl.load(pre_w_ptr + cols, mask=ok, other=0.0)
            x = _scaled(x * _rstd(x, n, eps), pre_w, UNIT_OFFSET, dtype)
        if HAS_RESIDUAL:
            res = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
            x = _round(x + res, dtype)
            tl.store(stream_ptr + row * stride_s + cols, x.to(dtype), mask=ok)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        tl.store(out_ptr + row * stride_o + cols, _scaled(x * _rstd(x, n, eps), w, UNIT_OFFSET, dtype).to(dtype),
                 mask=ok)

    @triton.jit
    def _rope_store_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, q_ptr, kc_ptr, vc_ptr, slot_ptr,
                           k_scale_ptr, v_scale_ptr, eps, stride_t, stride_qt, stride_qh,
                           stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                           NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                           HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                           QK_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr, KV: tl.constexpr):
        """Program (token t, head h) over qkv [T, (H + 2 Hkv) * D]: heads h < H are query heads, written
        rotated to q [T, H, D]; the others are key heads, written rotated to the K cache with the matching
        value head copied to the V cache, at slot_mapping[t] (-1: skipped), in the cache's dtype (KV:
        engine/kv_dtype.kv_mode). Dims d < 2 * HALF rotate (d pairs with d +- HALF), the rest pass through
        (partial rotary)."""
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        dtype = q_ptr.dtype.element_ty
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        rot = d < 2 * HALF
        first = d < HALF
        partner = tl.where(first, d + HALF, d - HALF)
        p_ok = d_ok & rot
        row = qkv_ptr + t * stride_t + h * HEAD_DIM
        x = tl.load(row + d, mask=d_ok, other=0.0).to(tl.float32)
        xp = tl.load(row + partner, mask=p_ok, other=0.0).to(tl.float32)
        if QK_NORM:  # the head's RMSNorm (q_norm or k_norm), on the row and on its partner view of it
            if h < NUM_HEADS:
                w = tl.load(qn_ptr + d, mask=d_ok, other=0.0)
                wp = tl.load(qn_ptr + partner, mask=p_ok, other=0.0)
            else:
                w = tl.load(kn_ptr + d, mask=d_ok, other=0.0)
                wp = tl.load(kn_ptr + partner, mask=p_ok, other=0.0)
            rstd = _rstd(x, HEAD_DIM, eps)
            x = _scaled(x * rstd, w, UNIT_OFFSET, dtype)
            xp = _scaled(xp * rstd, wp, UNIT_OFFSET, dtype)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        j = tl.where(first, d, d - HALF)
        cos = _round(tl.load(cos_ptr + pos * HALF + j, mask=p_ok, other=0.0).to(tl.float32), dtype)
        sin = _round(tl.load(sin_ptr + pos * HALF + j, mask=p_ok, other=0.0).to(tl.float32), dtype)
        # x1 * cos - x2 * sin and x2 * cos + x1 * sin, each product rounded to the dtype as eager's are
        a = _round(x * cos, dtype)
        b = _round(xp * sin, dtype)
        out = _round(tl.where(rot, tl.where(first, a - b, a + b), x), dtype).to(dtype)
        if h < NUM_HEADS:
            tl.store(q_ptr + t * stride_qt + h * stride_qh + d, out, mask=d_ok)
        else:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            blk = tl.maximum(slot, 0) // BLOCK_SIZE
            off = tl.maximum(slot, 0) % BLOCK_SIZE
            kvh = h - NUM_HEADS
            keep = d_ok & ((d * 0 + slot) >= 0)  # a broadcast scalar mask: the interpreter rejects `block & scalar`
            tl.store(kc_ptr + blk * stride_kcb + off * stride_kcs + kvh * stride_kch + d,
                     cache_value(out, k_scale_ptr, kc_ptr, KV), mask=keep)
            v = cache_value(tl.load(row + NUM_KV_HEADS * HEAD_DIM + d, mask=d_ok, other=0.0), v_scale_ptr, vc_ptr, KV)
            tl.store(vc_ptr + blk * stride_vcb + off * stride_vcs + kvh * stride_vch + d, v, mask=keep)

    @triton.jit
    def _act(g, ACT: tl.constexpr):
        """SiLU (ACT 0) or tanh-approximated GELU (ACT 1) of fp32 `g`; tanh through exp (tl has no tanh)."""
        if ACT == 0:
            out = g / (1.0 + tl.exp(-g))
        else:
            u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            out = 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))
        return out

    @triton.jit
    def _gate_up_act_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                            HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                            UPCAST: tl.constexpr):
        """Program (BLOCK_M rows, BLOCK_N columns): x [M, K] against W [2N, K] (gate rows, then up rows),
        act(gate) * up accumulated and computed in fp32, rounded once into out [M, N]."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        m_ok = offs_m < M
        n_ok = offs_n < N
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0)  # [BM, BK]
            w_mask = k_ok[:, None] & n_ok[None, :]
            w_gate = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
            gate += safe_dot(a, w_gate, PRECISION, UPCAST)
            w_up = tl.load(w_ptr + (offs_n[None, :] + N) * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
            up += safe_dot(a, w_up, PRECISION, UPCAST)
        if HAS_BIAS:
            gate += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            up += tl.load(b_ptr + N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = _round(_act(gate, ACT) * up, out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _act_mul_kernel(gu_ptr, out_ptr, N, stride_g, stride_o, ACT: tl.constexpr, BLOCK_N: tl.constexpr):
        """Program (row, column block): act(gate) * up of a [M, 2N] gate/up output, in fp32, rounded once."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = cols < N
        g = tl.load(gu_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * stride_g + N + cols, mask=ok, other=0.0).to(tl.float32)
        out = _round(_act(g, ACT) * u, out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _need_triton() -> None:
    if not AVAILABLE:
        raise RuntimeError("the fused forward's kernels need the triton package")


def _row_warps(block: int) -> int:
    """Warps for a one-row-per-program kernel: 4, or 8 past 2048 columns (16 fp32 values a thread)."""
    return 8 if block > 2048 else 4


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 unit_offset: bool = False, pre_weight: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(s), s) for rows x [T, N], where s = residual + x, or residual + norm_pre(x) when `pre_weight` is
    given (Gemma's post-norm of a sublayer's output), or x itself when `residual` is None. `unit_offset`:
    Gemma's (1 + weight) norms, both of them."""
    _need_triton()
    t, n = x.shape
    out = torch.empty_like(x)
    stream = torch.empty_like(x) if residual is not None else x
    if t == 0:
        return out, stream
    if pre_weight is not None and residual is None:
        raise ValueError("add_rms_norm: a pre-norm needs a residual to add its output to")
    res = residual if residual is not None else x
    block = _pow2(n)
    _add_rms_norm_kernel[(t,)](
        x, res, pre_weight if pre_weight is not None else weight, weight, out, stream, n, eps,
        x.stride(0), res.stride(0), out.stride(0), stream.stride(0),
        HAS_RESIDUAL=residual is not None, PRE_NORM=pre_weight is not None, UNIT_OFFSET=unit_offset,
        BLOCK_N=block, num_warps=_row_warps(block))
    return out, stream


def rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               num_heads: int, num_kv_heads: int, head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
               slot_mapping: torch.Tensor, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
               eps: float = 0.0, unit_offset: bool = False, k_scale: torch.Tensor | None = None,
               v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [T, (H + 2 Hkv) * D] (q heads, k heads, v heads; rows may be strided) -> rotated q [T, H, D]; the
    rotated k and the v rows written into caches [num_blocks, block_size, Hkv, D] at slot_mapping [T]
    (-1 = skip), in the caches' dtype (fp8: quantized with the scalar scale tensors k_scale / v_scale).
    cos/sin: the fp32 tables [max_positions, rotary_dim / 2] (RotaryEmbedding's), read at `positions` [T] and
    rounded to qkv's dtype as eager's tables are. q_norm / k_norm: per-head RMSNorm weights applied before the
    rotation (both or neither)."""
    _need_triton()
    t = qkv.shape[0]
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or qkv.stride(1) != 1:
        raise ValueError(f"rope_store: qkv {tuple(qkv.shape)} is not [T, (H + 2 Hkv) * D] with unit column "
                         f"stride for H={num_heads}, Hkv={num_kv_heads}, D={head_dim}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("rope_store: q_norm and k_norm go together")
    half = cos.shape[1]
    if 2 * half > head_dim or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"rope_store: tables of width {half} (contiguous) must rotate at most head_dim "
                         f"{head_dim}")
    q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    norm = q_norm is not None
    kv = kv_mode(qkv.dtype, k_cache.dtype)
    ks, vs = kv_scale_args(kv, k_scale, v_scale, cos)
    _rope_store_kernel[(t, num_heads + num_kv_heads)](
        qkv, positions, cos, sin, q_norm if norm else cos, k_norm if norm else cos, q, k_cache, v_cache,
        slot_mapping, ks, vs, eps, qkv.stride(0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half, BLOCK_D=_pow2(head_dim),
        BLOCK_SIZE=k_cache.shape[1], QK_NORM=norm, UNIT_OFFSET=unit_offset, KV=kv,
        num_warps=1 if head_dim <= 128 else 2)
    return q


def gemm_tiles(m: int, n: int, k: int, fp32: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) of gate_up_act: 16 rows for decode batches up to 16, else 64;
    BLOCK_N up to 64 and BLOCK_K up to 32 with 4 warps, 8 for 64-row tiles and fp32: the fused-MoE GEMM's
    tiles (engine/models/moe_triton.tile_config), which carry the same two accumulators."""
    block_m = 16 if m <= 16 else 64
    warps = 8 if block_m >= 64 or fp32 else 4
    return block_m, min(64, max(16, _pow2(n))), min(32, max(16, _pow2(k))), warps


def gate_up_act(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: str,
                tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """act(x W_gate^T + b_gate) * (x W_up^T + b_up) for x [M, K] and the stacked weight [2N, K] (gate rows,
    then up rows; bias [2N] or None) -> [M, N] in x's dtype. `tiles` (BLOCK_M, BLOCK_N, BLOCK_K, num_warps,
    num_stages) replaces gemm_tiles' choice (bench/bench_gpu.py kernels sweeps them)."""
    _need_triton()
    if act not in ACTIVATIONS:
        raise ValueError(f"gate_up_act: activation {act!r} is not supported; valid: {', '.join(ACTIVATIONS)}")
    m, k = x.shape
    if weight.shape[1] != k or weight.shape[0] % 2 or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"gate_up_act: weight {tuple(weight.shape)} is not [2N, {k}] (unit column strides)")
    n = weight.shape[0] // 2
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if tiles is None:
        block_m, block_n, block_k, warps = gemm_tiles(m, n, k, x.dtype == torch.float32)
        stages = {}  # Triton's default
    else:
        block_m, block_n, block_k, warps, num_stages = tiles
        stages = {"num_stages": num_stages}
    _gate_up_act_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, ACT=ACTIVATIONS[act], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else None,  # fp32: no TF32 rounding
        UPCAST=INTERPRETED and x.dtype != torch.float32, num_warps=warps, **stages)
    return out


def act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up for gate_up [M, 2N] (gate columns, then up) -> [M, N]."""
    _need_triton()
    if act not in ACTIVATIONS:
        raise ValueError(f"act_mul: activation {act!r} is not supported; valid: {', '.join(ACTIVATIONS)}")
    m, n2 = gate_up.shape
    if n2 % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"act_mul: gate_up {tuple(gate_up.shape)} needs an even width and unit column stride")
    out = torch.empty(m, n2 // 2, dtype=gate_up.dtype, device=gate_up.device)
    if m == 0:
        return out
    block = min(1024, _pow2(n2 // 2))
    _act_mul_kernel[(m, triton.cdiv(n2 // 2, block))](gate_up, out, n2 // 2, gate_up.stride(0), out.stride(0),
                                                      ACT=ACTIVATIONS[act], BLOCK_N=block)
    return out
