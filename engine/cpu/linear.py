"""Packed linears for the CPU path: weights reordered once at load into a layout made for the machine.

Where the CPU kernels build (every instruction-set level; `gemm_dtypes` names the dtypes: both, but fp32 only
on AVX-512 without AVX512-BF16, where oneDNN's bf16 runs): Tandem's own GEMM (engine/cpu/gemm.cpp,
column panels of 48), faster than oneDNN's packed matmul at the row counts of decode and level with it at
prefill's; below AVX-512 oneDNN has no bf16 matmul at all (bench/README.md has the figures at each level).
TANDEM_CPU_GEMM=0 (or TANDEM_CPU_KERNELS=0) keeps oneDNN, for the dtypes oneDNN runs on this CPU (`available`).

A decoder MLP's gate_up_proj becomes a FusedGateUp there: its GEMM computes SiLU(gate) * up in the epilogue
(gemm.cpp's gemm_silu_mul), so the 2x wider gate/up output never goes through memory.

Otherwise: oneDNN's matmul over a weight pre-packed for this machine's ISA
(AVX-512, AVX512-BF16/AMX for bf16). torch's `F.linear` on CPU goes through MKL sgemm with the weight
transposed on every call; oneDNN's packed path runs the same GEMMs faster, the one-row LM head most of all
(docs/engine.md#gemm-cpu_gemmcpp-cpu_linearpy). vLLM's CPU build does the same (its `onednn_mm` with
prepacked weights). The packed tensor is opaque: only `_linear_pointwise` reads it.

Either way the plain weight is dropped to save the memory; a tied LM head keeps the embedding (the lookup
needs it) and gets its own packed copy. fp32 results differ from MKL's in rounding only (max |err| ~1e-4 on
O(10) outputs); greedy equality with Hugging Face is what the real-model and tiny-model tests check.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from engine.cpu import kernels as cpu_native
from engine.cpu.quant import QuantWeight

# The batch-size hint oneDNN packs for; measured 1-2048 rows with packs made for 1, 64 and 2048: the 64- and
# 2048-row packs are within noise of each other at every size, the 1-row pack is slower past one row.
_PACK_HINT = 64
DTYPES = (torch.float32, torch.bfloat16)


def available(dtype: torch.dtype) -> bool:
    """Whether linears of `dtype` can be packed here: by Tandem's GEMM, or by oneDNN where it runs the dtype on
    this CPU (its bf16 matmul needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT; elsewhere it refuses at packing, so
    the plain weights and F.linear stay)."""
    if dtype not in DTYPES:
        return False
    return tandem_gemm(dtype) is not None or onednn_runs(dtype)


def onednn_runs(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def tandem_gemm(dtype: torch.dtype):
    """The kernel module when linears of `dtype` go through Tandem's GEMM (gemm.cpp) here, else None."""
    if os.environ.get("TANDEM_CPU_GEMM", "1") == "0":
        return None
    kernels = cpu_native.load()
    dtypes = getattr(kernels, "gemm_dtypes", ())
    return kernels if str(dtype).removeprefix("torch.") in dtypes else None


class Panels:
    """A weight packed for gemm.cpp's gemm_linear (its 48-column panels) and its N."""

    def __init__(self, weight: torch.Tensor, kernels):
        self.kernels, self.out_features = kernels, weight.shape[0]
        self.panels = kernels.gemm_pack(self.order(weight.detach()))

    def order(self, t: torch.Tensor) -> torch.Tensor:
        """The weight's rows (or the bias's values) in the order the pack holds them: as they are."""
        return t

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """bias: float32, in `order` (PackedLinear converts it once)."""
        return self.kernels.gemm_linear(x, self.panels, bias, self.out_features)


def pack_weight(weight: torch.Tensor) -> torch.Tensor | Panels:
    """The weight packed for Tandem's GEMM, else for oneDNN; the loader packs only where `available` says one
    of them runs the dtype, so this refuses (naming why) rather than handing oneDNN a packing it cannot run."""
    if (kernels := tandem_gemm(weight.dtype)) is not None:
        return Panels(weight, kernels)
    if not onednn_runs(weight.dtype):
        raise ValueError(f"cannot pack a {weight.dtype} linear here: Tandem's CPU GEMM is off or unavailable "
                         f"(TANDEM_CPU_GEMM, TANDEM_CPU_KERNELS) and oneDNN does not run {weight.dtype} on this "
                         "CPU; keep the plain nn.Linear (cpu_linear.available() says when)")
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor | Panels | QuantWeight,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ W.T (+ bias) with W packed by `pack_weight`, or a GGUF model's QuantWeight
    (engine/cpu/quant.py: its LM head)."""
    if isinstance(packed, (Panels, QuantWeight)):
        return packed(x, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


_HALF_PANEL = 24  # gemm.cpp's kHalf: gate (and up) columns a panel


class GateUpPanels(Panels):
    """A gate/up weight [2 I, K] ([gate; up] rows, the decoder's gate_up_proj) packed for gemm.cpp's
    gemm_silu_mul: panel p holds gate rows [24 p, 24 p + 24) then the matching up rows (zero rows past I), so
    one 8 x 48 block of sums is 24 gates and their 24 ups, turned into SiLU(gate) * up before it leaves L1."""

    def __init__(self, weight: torch.Tensor, kernels):
        self.inter = weight.shape[0] // 2
        super().__init__(weight, kernels)

    def order(self, t: torch.Tensor) -> torch.Tensor:
        """[2 I, ...] gate rows then up rows -> the pack's row order, [48 * panels, ...]."""
        half, blocks = _HALF_PANEL, -(-self.inter // _HALF_PANEL)
        gate, up = (torch.nn.functional.pad(part, (0, 0) * (t.dim() - 1) + (0, blocks * half - self.inter))
                    for part in t.view(2, self.inter, *t.shape[1:]).unbind(0))
        return torch.stack((gate.view(blocks, half, *t.shape[1:]), up.view(blocks, half, *t.shape[1:])), 1) \
            .reshape(blocks * 2 * half, *t.shape[1:])

    def silu_mul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """SiLU(gate) * up [..., I]; bias: float32, in `order`."""
        return self.kernels.gemm_silu_mul(x, self.panels, bias, self.inter)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The plain [..., 2 I] gate/up output (gate columns, then up), for whoever needs both halves (a LoRA
        wrapper adds its deltas to them): the panels' interleaved columns put back in order."""
        blocks, lead = self.panels.shape[0], x.shape[:-1]
        y = self.kernels.gemm_linear(x, self.panels, bias, blocks * 2 * _HALF_PANEL)
        y = y.view(*lead, blocks, 2, _HALF_PANEL).transpose(-3, -2).reshape(*lead, 2, blocks * _HALF_PANEL)
        return y[..., :self.inter].reshape(*lead, self.out_features)


class PackedLinear(nn.Module):
    """Drop-in for an inference-only nn.Linear on CPU."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = self.pack(linear.weight)
        self.bias = None if linear.bias is None else linear.bias.detach()
        if self.bias is not None and isinstance(self.packed, Panels):
            # gemm_linear adds it to its fp32 sums: converted (and ordered as the panels) once, not every call
            self.bias = self.packed.order(self.bias.float())

    def pack(self, weight: torch.Tensor) -> torch.Tensor | Panels:
        return pack_weight(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        kind = "tandem gemm" if isinstance(self.packed, Panels) else "onednn"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind} packed"


class FusedGateUp(PackedLinear):
    """A decoder MLP's gate_up_proj packed as GateUpPanels: `silu_mul(x)` is SiLU(gate) * up in one GEMM pass
    (MLP.forward takes it when the layer runs the CPU kernels), `forward(x)` the plain [gate, up] output."""

    def pack(self, weight: torch.Tensor) -> GateUpPanels:
        return GateUpPanels(weight, tandem_gemm(weight.dtype))

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed.silu_mul(x, self.bias)


def fused_gate_up(linear: nn.Linear) -> FusedGateUp | None:
    """`linear` (a gate_up_proj followed by SiLU(gate) * up) as a FusedGateUp where Tandem's GEMM runs its dtype
    and the extension has gemm_silu_mul; else None."""
    kernels = tandem_gemm(linear.weight.dtype)
    if kernels is None or not getattr(kernels, "gemm_silu", False) or linear.out_features % 2:
        return None
    return FusedGateUp(linear)


def pack_linears(module: nn.Module) -> int:
    """Replace every nn.Linear under `module` by a PackedLinear; returns how many were replaced."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child))
            count += 1
        else:
            count += pack_linears(child)
    return count
