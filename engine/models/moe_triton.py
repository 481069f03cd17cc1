"""Fused mixture-of-experts in Triton: the routed experts of a batch as two grouped GEMMs over the
(token, expert) pairs sorted by expert, in the manner of vLLM's fused_moe.

    align       the T * k pairs sorted by expert, each expert's run padded to a multiple of BLOCK_M
                (`sorted_pairs`, padding slots hold the sentinel T * k), and per BLOCK_M-row block the
                expert it belongs to (`block_experts`) plus the padded total (`num_padded`)
    gate_up     per block: rows x[pair // k] @ gate_up[e].T, gate and up columns accumulated side by side,
                SiLU(gate) * up written per pair -> [T * k, I]
    down        per block: those rows @ down[e].T, times the pair's routing weight -> [T * k, H]
    sum         the k rows of each token added -> [T, H]

The alignment is torch ops with no host synchronisation (no bincount, no count read back), and the launch
grids depend only on static shapes (T, k, E): blocks past `num_padded` return at once. A decode step with
MoE therefore stays capturable in a CUDA graph. Each expert's weights are read once per block of its tokens
rather than once per token, which is what makes MoE decode bandwidth-bound on the active experts only.

Runs on CUDA, and on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1 before import), which is
how the CPU tests check it against engine/models/moe.py's grouped path. Importing this module never needs
Triton: without it `AVAILABLE` is False. scripts/compile_kernels.py compiles the kernels for sm_90.
"""

from __future__ import annotations

import torch

# Triton is optional (the CPU torch build ships without it): the attention kernels' module owns the import,
# whether the interpreter runs it, and the dot product that works around the interpreter's bf16 bug.
from engine.attention.triton_paged import AVAILABLE, INTERPRETED, tl, triton

if AVAILABLE:
    from engine.attention.triton_paged import safe_dot

    @triton.jit
    def _moe_gemm_kernel(a_ptr, w_ptr, c_ptr, weights_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
                         num_pairs, N, K, stride_am, stride_we, stride_wn, stride_cm,
                         TOP_K: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        """One program per (BLOCK_M pairs of one expert, BLOCK_N output columns).

        Row r of the block is pair p = sorted[r]; it reads A row p // TOP_K and writes C row p. W is
        [E, rows, K]: GATED reads rows n (gate) and N + n (up) and stores SiLU(gate) * up; WEIGHTED scales
        by weights[p]. Padding rows (p == num_pairs) load zeros and store nothing."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + offs_m)  # [BM]
        row_ok = pair < num_pairs
        a_row = (pair // TOP_K).to(tl.int64)
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        w_base = w_ptr + expert * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            a = tl.load(a_ptr + a_row[:, None] * stride_am + offs_k[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
            w_mask = k_ok[:, None] & n_ok[None, :]
            w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)  # [BK, BN]
            acc += safe_dot(a, w, PRECISION, UPCAST)
            if GATED:
                w_up = tl.load(w_base + (offs_n[None, :] + N) * stride_wn + offs_k[:, None], mask=w_mask,
                               other=0.0)
                acc_up += safe_dot(a, w_up, PRECISION, UPCAST)
        if GATED:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # SiLU(gate) * up, in fp32
        if WEIGHTED:
            acc = acc * tl.load(weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        c = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])



def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Rows per block: 16 when experts get a few pairs each (decode), 64 once they average 64 or more."""
    return 64 if num_pairs >= 64 * num_experts else 16


def tile_config(n: int, k: int, block_m: int, fp32: bool) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): tiles of powers of two >= 16 (tl.dot's minimum), N up to 64 and K up
    to 32, 8 warps for 64-row blocks and fp32. Chosen from sm_90 compiles (scripts/compile_kernels.py):
    BLOCK_K 64 or 4 warps there spill the gated kernel's two accumulators and [K, N] pointer tiles."""
    warps = 8 if block_m >= 64 or fp32 else 4
    return min(64, max(16, _pow2(n))), min(32, max(16, _pow2(k))), warps


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert ids [T, k] -> (sorted_pairs [P_max] int32, block_experts [P_max / BLOCK_M] int32, num_padded [1]
    int32), with no host synchronisation. P_max bounds the padded length from the static shapes: each of at
    most min(E, T * k) non-empty experts adds fewer than BLOCK_M padding slots."""
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount without its host-side size check
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    first = counts.cumsum(0) - counts  # where each expert's pairs start in the unpadded sorted order
    order = torch.argsort(flat, stable=True)
    expert_of = flat.index_select(0, order)
    rank = torch.arange(num_pairs, device=device) - first.index_select(0, expert_of)
    dest = (padded_end - padded).index_select(0, expert_of) + rank
    max_padded = min(num_pairs + num_experts * (block_m - 1), num_pairs * block_m)
    max_padded = (max_padded + block_m - 1) // block_m * block_m
    sorted_pairs = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(0, max_padded, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, starts, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, block_experts.to(torch.int32), padded_end[-1:].to(torch.int32)


def _launch(a, w, c, weights, sorted_pairs, block_experts, num_padded, num_pairs: int, n: int, top_k: int,
            gated: bool, block_m: int) -> None:
    k = a.shape[1]
    block_n, block_k, num_warps = tile_config(n, k, block_m, a.dtype == torch.float32)
    grid = (block_experts.shape[0], triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a, w, c, weights, sorted_pairs, block_experts, num_padded, num_pairs, n, k,
        a.stride(0), w.stride(0), w.stride(1), c.stride(0),
        TOP_K=top_k, GATED=gated, WEIGHTED=not gated, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if a.dtype == torch.float32 else None,  # fp32: no TF32 rounding
        UPCAST=INTERPRETED and a.dtype != torch.float32, num_warps=num_warps)


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """The same sum as engine.models.moe.grouped_experts (SiLU experts): x [T, H], gate_up [E, 2I, H],
    down [E, H, I], weights / ids [T, k] -> [T, H] in x's dtype."""
    if not AVAILABLE:
        raise RuntimeError("the fused-MoE kernels need the triton package")
    num_tokens, hidden = x.shape
    num_experts, inter = gate_up.shape[0], down.shape[2]
    top_k = ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_tokens == 0:
        return torch.zeros_like(x)
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    block_m = block_m_for(num_pairs, num_experts)
    sorted_pairs, block_experts, num_padded = align(ids, num_experts, block_m)
    pair_weights = weights.reshape(-1).contiguous()
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # SiLU(gate) * up per pair
    _launch(x, gate_up, act, pair_weights, sorted_pairs, block_experts, num_padded, num_pairs, inter, top_k,
            True, block_m)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)  # weighted expert output per pair
    _launch(act, down, out, pair_weights, sorted_pairs, block_experts, num_padded, num_pairs, hidden, 1,
            False, block_m)
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
