"""int4 weight-only GEMM in Triton: y = x @ W^T (+ bias) for GPTQ / AWQ linears on CUDA, the int4 codes turned
into weights in registers inside the K loop.

A checkpoint's linear (engine/models/int4_loader.py unpacks either format to codes q [N, K], zero points z and
fp16 scales s [G, N], one per `group` inputs: w[n, k] = s[k // group, n] * (q[n, k] - z[k // group, n])) is
repacked once at load by `pack`:

    qweight  int32 [K' / 8, N], K' = K rounded up to CHUNK = 128 (the tail codes 0). Chunk c of 128 inputs is
             rows 16c .. 16c + 15; nibble j (bits 4j) of row 16c + r holds q[n, 128c + 16j + r]
    zeros    uint8 [G, N]   z as it is (0..16: GPTQ v1 can store a zero point of 16)
    scales   fp16 [G, N]    the checkpoint's, as they are

Why this layout: a [16, BLOCK_N] tile of words (one coalesced load, N contiguous) holds one chunk, and its
nibble j is an exact [16, BLOCK_N] operand for the 16 contiguous inputs 128c + 16j .. + 15 (`plane` j), with
shifts and masks only: no gather, no reshape, no repeated loads of a word. q - z is a small integer, exact in
bf16 and fp16, so each plane is one tensor-core dot of x's 16 columns against it with fp32 accumulation; the
scale multiplies the dot's fp32 result (per chunk when a chunk lies in one group, per plane for groups of 32
or 64). No weight is ever rounded: the result is the fp32 matmul of the checkpoint's exact weights, up to
summation order.

Decode (M up to 64) is bandwidth-bound on the weights: BLOCK_M 16 (tl.dot's minimum) and split-K over chunks
until about two waves of programs cover an H100/H200 (132 SMs); the splits' fp32 partials are summed in a
fixed order by a second kernel (deterministic, no atomics), which adds the bias and rounds once. Tiles depend
on M, N and K only (no autotuning), so a shape always compiles to the same kernel, and launches need no host
synchronisation: CUDA graphs capture them. On CPU tensors the kernels run under Triton's interpreter
(TRITON_INTERPRET=1 before import), which is how the CPU tests check them; scripts/compile_kernels.py compiles
them for sm_90.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.attention.triton_paged import AVAILABLE, INTERPRETED, tl, triton, usable_on

CHUNK = 128  # inputs per row block of qweight: 8 planes of PLANE
PLANE = 16  # inputs per nibble plane: tl.dot's smallest K
WAVE_PROGRAMS = 2 * 132  # split-K aims at two waves of programs on an H100 / H200
MAX_SPLITS = 16

if AVAILABLE:
    from engine.attention.triton_paged import safe_dot
    from engine.models.fused_kernels import _round

    @triton.jit
    def _plane(x_rows, words, k0, K, m_ok, z, J: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        """x[:, k0 : k0 + 16] @ (q - z) of nibble plane J of a chunk's words [16, BN] -> [BM, BN] fp32."""
        k = k0 + tl.arange(0, 16)
        a = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)  # [BM, 16]
        # [16, BN], small integers: exact in any float type; through fp32 because the interpreter's int32 ->
        # bf16 cast reinterprets bits (triton 3.9)
        w = (((words >> (4 * J)) & 0xF) - z[None, :]).to(tl.float32).to(a.dtype)
        return safe_dot(a, w, PRECISION, UPCAST)

    @triton.jit
    def _group(z_ptr, s_ptr, g, N, offs_n, n_ok):
        """Group g's zero points (int32) and scales (fp32) of columns offs_n."""
        z = tl.load(z_ptr + g * N + offs_n, mask=n_ok, other=0).to(tl.int32)
        s = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        return z, s

    @triton.jit
    def _int4_gemm_kernel(x_ptr, qw_ptr, z_ptr, s_ptr, b_ptr, out_ptr, M, N, K, G, group, num_chunks,
                          chunks_per_split, stride_xm, stride_om,
                          ALIGNED: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                          UPCAST: tl.constexpr):
        """Program (BLOCK_M rows, BLOCK_N columns, split s): chunks [s * chunks_per_split, ...) of x [M, K] @
        W^T. ALIGNED: every chunk lies in one group (group a multiple of 128), so its planes share z and s.
        SPLIT: the fp32 sum goes to partials [splits, M, N] (out_ptr); else bias, one rounding, out [M, N]."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = offs_n < N
        x_rows = x_ptr + offs_m[:, None] * stride_xm
        rows = tl.arange(0, 16)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        c0 = pid_k * chunks_per_split
        for c in range(c0, tl.minimum(c0 + chunks_per_split, num_chunks)):
            words = tl.load(qw_ptr + (c * 16 + rows)[:, None] * N + offs_n[None, :], mask=n_ok[None, :],
                            other=0)  # [16, BN] int32
            k0 = c * 128
            if ALIGNED:
                z, s = _group(z_ptr, s_ptr, tl.minimum(k0 // group, G - 1), N, offs_n, n_ok)
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for j in tl.static_range(8):
                    part += _plane(x_rows, words, k0 + 16 * j, K, m_ok, z, j, PRECISION, UPCAST)
                acc += part * s[None, :]
            else:  # groups of 32 or 64 (or one group of K not a multiple of 128): z and s per plane
                for j in tl.static_range(8):
                    z, s = _group(z_ptr, s_ptr, tl.minimum((k0 + 16 * j) // group, G - 1), N, offs_n, n_ok)
                    acc += _plane(x_rows, words, k0 + 16 * j, K, m_ok, z, j, PRECISION, UPCAST) * s[None, :]
        ok = m_ok[:, None] & n_ok[None, :]
        if SPLIT:
            tl.store(out_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=ok)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            dtype = out_ptr.dtype.element_ty
            tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], _round(acc, dtype).to(dtype), mask=ok)

    @triton.jit
    def _sum_splits_kernel(part_ptr, b_ptr, out_ptr, M, N, stride_om, SPLITS: tl.constexpr,
                           HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
        """Program (row, column block): the splits' partials [SPLITS, M, N] summed in order, plus the bias,
        rounded once into out [M, N]."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = cols < N
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            acc += tl.load(part_ptr + (s * M + row) * N + cols, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        tl.store(out_ptr + row * stride_om + cols, _round(acc, dtype).to(dtype), mask=ok)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Int4Weight:
    """One linear's int4 weight in the kernel's layout (the module docstring), on one device."""

    qweight: torch.Tensor  # int32 [K' / 8, N]
    zeros: torch.Tensor  # uint8 [G, N]
    scales: torch.Tensor  # fp16 [G, N]
    in_features: int  # K
    group: int  # inputs per group (K for one group)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.zeros, self.scales))

    @property
    def aligned(self) -> bool:
        """Whether every 128-input chunk lies in one group (its planes then share a zero point and scale)."""
        return self.group % CHUNK == 0 or self.scales.shape[0] == 1


def pack(q: torch.Tensor, z: torch.Tensor, scales: torch.Tensor, group: int | None,
         device: torch.device | str = "cpu") -> Int4Weight:
    """Codes q [N, K] (0..15), zero points z [G, N] and scales [G, N] (int4_loader.unpack's) in the kernel's
    layout on `device`; `group` None = one group of K. ValueError when the shapes do not agree."""
    n, k = q.shape
    group = group or k
    if group % PLANE or scales.shape != (_cdiv(k, group), n) or z.shape != scales.shape:
        raise ValueError(f"int4 tensors do not agree: {n} x {k} weights in groups of {group} (a multiple of "
                         f"{PLANE}) need scales and zeros of {(_cdiv(k, group), n)}; got {tuple(scales.shape)} and "
                         f"{tuple(z.shape)}")
    chunks = _cdiv(k, CHUNK)
    codes = torch.zeros(n, chunks * CHUNK, dtype=torch.uint8)
    codes[:, :k] = q
    planes = codes.view(n, chunks, 8, PLANE).permute(1, 3, 0, 2)  # [chunk, r, N, j] = q[n, 128c + 16j + r]
    # nibbles 2i and 2i + 1 are byte i of the little-endian word
    words = (planes[..., 0::2] | (planes[..., 1::2] << 4)).contiguous().view(torch.int32)  # [chunk, 16, N, 1]
    return Int4Weight(words.view(chunks * PLANE, n).to(device), z.to(torch.uint8).contiguous().to(device),
                      scales.to(torch.float16).contiguous().to(device), k, group)


def tiles(m: int, n: int, num_chunks: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, splits, num_warps) for M rows: 16 rows up to 16 (decode), 32 up to 32, else 64 with
    128 columns; below two waves of programs, K is split (at most MAX_SPLITS ways, each split 1+ chunks)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if m <= 32 else 128
    programs = _cdiv(m, block_m) * _cdiv(n, block_n)
    splits = max(1, min(MAX_SPLITS, num_chunks, WAVE_PROGRAMS // programs))
    splits = _cdiv(num_chunks, _cdiv(num_chunks, splits))  # no split left without a chunk
    return block_m, block_n, splits, 8 if block_m == 64 else 4


def int4_matmul(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (fp32, bf16 or fp16) @ W^T (+ bias [N]) -> [M, N] in x's dtype, summed in fp32 and rounded once.
    Runs on CUDA, or on CPU tensors under Triton's interpreter."""
    if not usable_on(x.device):
        raise RuntimeError(f"the int4 GEMM is a Triton kernel: it runs on cuda (or on cpu under TRITON_INTERPRET=1), "
                           f"not {x.device.type}")
    m, k = x.shape
    if k != w.in_features:
        raise ValueError(f"int4_matmul: x has {k} features, the weight {w.in_features}")
    x = x if x.stride(1) == 1 else x.contiguous()
    n, num_chunks = w.out_features, w.qweight.shape[0] // PLANE
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n, splits, warps = tiles(m, n, num_chunks)
    per = triton.cdiv(num_chunks, splits)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else out
    _int4_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n), splits)](
        x, w.qweight, w.zeros, w.scales, bias if bias is not None else w.scales, part, m, n, k,
        w.scales.shape[0], w.group, num_chunks, per, x.stride(0), out.stride(0),
        ALIGNED=w.aligned, SPLIT=splits > 1, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION="ieee" if x.dtype == torch.float32 else None,  # fp32: no TF32 rounding
        UPCAST=INTERPRETED and x.dtype != torch.float32, num_warps=warps)
    if splits > 1:
        block = min(1024, triton.next_power_of_2(n))
        _sum_splits_kernel[(m, triton.cdiv(n, block))](part, bias if bias is not None else part, out, m, n,
                                                       out.stride(0), SPLITS=splits, HAS_BIAS=bias is not None,
                                                       BLOCK_N=block)
    return out


class Int4Linear(nn.Module):
    """An inference-only int4 linear running the Triton GEMM: one Int4Weight (q/k/v or gate/up stacked along
    N at load) and an optional fp32 bias. Plain attributes, not parameters or buffers, so the model-wide
    `to_empty` / `.to(dtype)` leave them alone (engine/cpu/quant.QuantLinear's reason too)."""

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None = None):
        super().__init__()
        if bias is not None and bias.shape != (weight.out_features,):
            raise ValueError(f"bias of shape {tuple(bias.shape)} for {weight.out_features} outputs")
        self.weight4 = weight
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.bias = None if bias is None else bias.detach().float().to(weight.scales.device).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int4_matmul(x.reshape(-1, self.in_features), self.weight4, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        return self.weight4.nbytes + (0 if self.bias is None else self.bias.nbytes)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group {self.weight4.group}"
