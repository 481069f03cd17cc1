"""A linear whose weight stays float8 e4m3 [N, K] with fp32 per-output-channel scales (FP8 checkpoints,
engine/models/fp8_loader.py): the model holds about the checkpoint's bytes.

    w[n, k] = weight_scale[n] * q[n, k]          (a per-tensor scale is that scalar on every row: exact)

Activations, as the checkpoint's scheme says:
- none (weight-only, W8A16): x as it is;
- dynamic per token (W8A8): each row of x quantized to e4m3 with s = max |x_row| / 448 (at most
  activation_scale_ub / 448 where the checkpoint sets one), q = e4m3(clamp(x / s, +-448)): compressed-tensors'
  definition, computed in fp32;
- static per tensor (W8A8): s = the checkpoint's input_scale, one per fused part (q, k and v each keep theirs).

Arithmetic. Both operands are e4m3 values (or x and e4m3 values), their products summed in fp32 and the scales
applied to the [M, N] output, as torch._scaled_mm does. On CUDA a W8A8 linear goes through torch._scaled_mm
(row-wise scales, bf16 out; it needs compute capability 8.9+, K and N multiples of 16, and bf16 output for
row-wise scales: anything else takes the path below). Elsewhere the e4m3 codes are widened to floats
(fp8_values: exact, through fp16 bits, since torch widens e4m3 element by element on CPU) and multiplied by
F.linear, in fp32 on CPU (the output is then cast to the model dtype) and in the model dtype on CUDA. On CPU
that is the default for W8A8 too: torch._scaled_mm runs there but measured slower (docs/features.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
VALUE_SHIFT = 2.0**8  # fp8_values gives the e4m3 values divided by this (exact: a power of two)


def fp8_values(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The e4m3 values of `q` times 2^-8, exactly, as `dtype`. An e4m3 byte s eeee mmm shifted into an fp16's
    bits is s 0eeee mmm0000000, the same value times 2^(7 - 15) (e4m3 subnormals become fp16 subnormals), and
    fp16 -> fp32 / bf16 is exact for numbers of 4 significant bits."""
    bits = (q.view(torch.int8).to(torch.int16) * 128) & ~0x4000  # sign-extended byte << 7, bit 14 cleared
    return bits.view(torch.float16).to(dtype)


def quantize_rows(x: torch.Tensor, scale: torch.Tensor | None, scale_ub: float | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, 1] or the static scalar): per row when `scale` is None."""
    x32 = x.float()
    if scale is None:
        amax = x32.abs().amax(dim=-1, keepdim=True)
        if scale_ub is not None:
            amax = amax.clamp(max=scale_ub)
        scale = (amax / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)  # a zero row: any scale gives 0
    return (x32 / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) for W in e4m3 with per-output-channel scales, optionally with e4m3 activations. Its
    tensors are plain attributes, not parameters: model-wide `to_empty` / `.to(dtype)` leave them alone.

    `input_scales`: static activation scales, one per part of `part_sizes` (q, k, v of a fused qkv_proj);
    None with `activations` "token" (dynamic) or None (weight-only)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 activations: str | None, dtype: torch.dtype, input_scales: list[float] | None = None,
                 part_sizes: list[int] | None = None, scale_ub: float | None = None):
        super().__init__()
        n, k = weight.shape
        if weight.dtype != E4M3 or scale.shape != (n,) or (bias is not None and bias.shape != (n,)):
            raise ValueError(f"an FP8 linear is e4m3 [N, K] with scales and bias [N]; got {weight.dtype} "
                             f"{tuple(weight.shape)}, scales {tuple(scale.shape)}")
        self.in_features, self.out_features = k, n
        self.activations, self.scale_ub = activations, scale_ub
        self.weight = weight.contiguous()
        self.weight_scale = scale.float().view(1, n).contiguous()  # [1, N]
        self.bias = None if bias is None else bias.to(dtype)
        sizes = part_sizes or [n]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        if input_scales is None:
            self.parts = [(0, n, None)]
        else:  # neighbours with one static scale are one GEMM
            merged: list[list] = []
            for start, size, s in zip(starts, sizes, input_scales):
                if merged and merged[-1][2] == s:
                    merged[-1][1] += size
                else:
                    merged.append([start, size, s])
            self.parts = [(a, b, torch.tensor(s, dtype=torch.float32, device=weight.device)) for a, b, s in merged]
        self.scaled_mm = activations is not None and _scaled_mm_runs(weight.device, dtype, k,
                                                                     [size for _, size, _ in self.parts])

    @property
    def nbytes(self) -> int:
        held = [self.weight, self.weight_scale] + ([] if self.bias is None else [self.bias])
        return sum(t.numel() * t.element_size() for t in held)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        ys = [self._part(x2, start, size, s) for start, size, s in self.parts]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def _part(self, x: torch.Tensor, start: int, size: int, static: torch.Tensor | None) -> torch.Tensor:
        """Output columns start:start + size, in fp32 (forward casts them) or, from torch._scaled_mm, bf16."""
        w, ws = self.weight.narrow(0, start, size), self.weight_scale.narrow(1, start, size)
        dtype = torch.float32 if x.device.type == "cpu" else x.dtype
        if self.activations is None:
            return _widened_mm(x.to(dtype), None, w, ws, dtype)
        xq, xs = quantize_rows(x, static, self.scale_ub)
        if self.scaled_mm:
            xs = xs.expand(x.shape[0], 1).contiguous()  # row-wise needs [M, 1] (a static scale is a scalar)
            return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws, out_dtype=x.dtype)
        return _widened_mm(xq, xs, w, ws, dtype)

    def extra_repr(self) -> str:
        acts = {None: "weight-only", "token": "dynamic per-token e4m3", "tensor": "static e4m3"}[self.activations]
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3, {acts}"


def _widened_mm(a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """a @ w^T in `dtype` with w (and a, when it is e4m3 with `a_scale`) widened by fp8_values, then the fp32
    scales applied to the [M, N] output."""
    y = F.linear(a if a_scale is None else fp8_values(a, dtype), fp8_values(w, dtype))
    scale = w_scale * VALUE_SHIFT if a_scale is None else (a_scale * VALUE_SHIFT) * (w_scale * VALUE_SHIFT)
    return y * scale  # fp32 scales: a bf16 / fp16 GEMM's output is scaled in fp32, not rounded twice


def _scaled_mm_runs(device: torch.device, dtype: torch.dtype, k: int, sizes: list[int]) -> bool:
    """Whether torch._scaled_mm takes this linear with row-wise scales (CUDA only: on CPU the widened GEMM
    is the faster one, see the module docstring)."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False  # row-wise scaling gives bf16 out only
    return torch.cuda.get_device_capability(device) >= (8, 9) and k % 16 == 0 and all(s % 16 == 0 for s in sizes)
