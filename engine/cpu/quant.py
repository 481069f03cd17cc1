"""Weight-only quantized linears and embeddings for the CPU path, in a GGUF file's own block layout.

A QuantWeight is a [N, K] weight as ggml's blocks of 32 weights along K, the bytes exactly as the file holds
them ([N, K / 32 * block bytes] uint8): Q8_0 (34-byte blocks: fp16 scale, 32 int8) and Q4_1 (20-byte blocks:
fp16 scale and min, 32 nibbles). Nothing is unpacked at load, so the model's resident weights are the file's
size. engine/cpu/gemm_quant.cpp multiplies by it at every instruction-set level; where the extension does not
build (or TANDEM_CPU_GEMM=0 / TANDEM_CPU_KERNELS=0) the fallback dequantizes the whole weight with torch ops on
every call: correct, slow, and no more resident memory.

Activations (TANDEM_QUANT_ACTIVATIONS): "int8" (the default) is llama.cpp's arithmetic: x quantized per call to
ggml's Q8_0 blocks (gguf.quants' quantizer bit for bit) and integer dot products with the weights' quants, a
block's scales applied in fp32; "fp32" is the exact path: x as it is, times the dequantized weights. The fallback
follows the same switch (it quantizes x with torch ops), so a model's outputs do not depend on whether the
kernels built.

Dequantization (here and in the kernel) is exactly the `gguf` package's: d * q (+ m) in fp32, where d * q is
exact, so the weights are bit for bit the ones transformers' GGUF loader gives.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from engine.cpu import kernels as cpu_native

BLOCK = 32  # weights a block, along K
BLOCK_BYTES = {"Q8_0": 34, "Q4_1": 20}
GGML_TYPE_IDS = {"Q8_0": 8, "Q4_1": 3}  # gguf.GGMLQuantizationType's values, what gemm_q_linear takes
QUANT_TYPES = tuple(BLOCK_BYTES)
ACTIVATIONS = ("int8", "fp32")  # TANDEM_QUANT_ACTIVATIONS' values, the default first


def quant_kernels():
    """The kernel module when quantized linears go through gemm_quant.cpp here, else None (the torch fallback)."""
    if os.environ.get("TANDEM_CPU_GEMM", "1") == "0":
        return None
    kernels = cpu_native.load()
    return kernels if hasattr(kernels, "gemm_q_linear") else None


def int8_activations() -> bool:
    """Whether quantized linears quantize x to int8 blocks (TANDEM_QUANT_ACTIVATIONS, default "int8") or keep it
    fp32 (the exact path)."""
    value = os.environ.get("TANDEM_QUANT_ACTIVATIONS", ACTIVATIONS[0])
    if value not in ACTIVATIONS:
        raise ValueError(f"TANDEM_QUANT_ACTIVATIONS={value!r} is not valid; valid: {', '.join(ACTIVATIONS)}")
    return value == "int8"


def q8_0_round_trip(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] float32 quantized to ggml's Q8_0 blocks and dequantized back, as gguf.quants does it (and the
    kernel's int8 path): d = max |x| / 127 and q = x * (1 / d) rounded half away from zero, in fp32, d to fp16."""
    blocks = x.reshape(-1, BLOCK)  # [blocks, 32]
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    v = blocks * torch.where(d == 0, 0.0, 1 / d)
    a = v.abs()
    q = torch.sign(v) * (a.floor() + (2 * (a - a.floor())).floor())  # gguf's np_roundf
    return (q * d.half().float()).view(x.shape)


class QuantWeight:
    """A [out_features, in_features] weight in ggml blocks of `qtype`; `data` uint8 [N, K / 32 * block bytes].
    Callable as a packed head (engine/cpu/linear.py's packed_linear): `w(x, bias)` is x @ W^T (+ bias)."""

    def __init__(self, qtype: str, data: torch.Tensor, in_features: int):
        if qtype not in BLOCK_BYTES:
            raise ValueError(f"quantized type {qtype!r} is not supported; valid: {', '.join(QUANT_TYPES)}")
        if in_features % BLOCK:
            raise ValueError(f"a {qtype} weight needs in_features divisible by {BLOCK}, got {in_features}")
        row = in_features // BLOCK * BLOCK_BYTES[qtype]
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != row:
            raise ValueError(f"a {qtype} weight of {in_features} features is uint8 [N, {row}]; got "
                             f"{data.dtype} {tuple(data.shape)}")
        self.qtype, self.data, self.in_features = qtype, data.contiguous(), in_features

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 weight [N, K] (or only `rows`, for an embedding lookup), as gguf.quants.dequantize gives it."""
        data = self.data if rows is None else self.data.index_select(0, rows.reshape(-1))
        blocks = data.view(data.shape[0], -1, BLOCK_BYTES[self.qtype])  # [n, K / 32, bytes]
        d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [n, K / 32, 1]
        if self.qtype == "Q8_0":
            w = blocks[..., 2:].contiguous().view(torch.int8).float() * d
        else:
            m = blocks[..., 2:4].contiguous().view(torch.float16).float()
            qs = blocks[..., 4:]
            w = torch.cat((qs & 0x0F, qs >> 4), dim=-1).float() * d + m  # low nibbles are weights 0-15
        return w.reshape(data.shape[0], self.in_features)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        kernels, int8 = quant_kernels(), int8_activations()
        if kernels is None:
            return F.linear(q8_0_round_trip(x) if int8 else x, self.dequantize(), bias)
        return kernels.gemm_q_linear(x, self.data, GGML_TYPE_IDS[self.qtype], bias, int8)

    def __repr__(self) -> str:
        return f"QuantWeight({self.qtype}, [{self.out_features}, {self.in_features}])"


def concat_rows(weights: list[QuantWeight]) -> list[QuantWeight]:
    """Weights stacked along N (q, k, v into qkv_proj; gate, up into gate_up_proj): neighbours of one type
    become one weight (their rows simply follow each other); a change of type starts another part."""
    parts: list[QuantWeight] = []
    for w in weights:
        if parts and parts[-1].qtype == w.qtype and parts[-1].in_features == w.in_features:
            parts[-1] = QuantWeight(w.qtype, torch.cat((parts[-1].data, w.data)), w.in_features)
        else:
            parts.append(w)
    return parts


class QuantLinear(nn.Module):
    """An inference-only linear whose weight is one or more QuantWeights stacked along the outputs, plus an
    optional fp32 bias. Its tensors are plain attributes, not parameters or buffers: model-wide
    `to_empty` / `.to(dtype)` leave the quantized bytes alone."""

    def __init__(self, parts: list[QuantWeight], bias: torch.Tensor | None = None):
        super().__init__()
        if not parts or len({p.in_features for p in parts}) != 1:
            raise ValueError("a QuantLinear needs one or more weights of the same in_features")
        self.parts = concat_rows(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"bias of shape {tuple(bias.shape)} for {self.out_features} outputs")
        int8_activations()  # a bad TANDEM_QUANT_ACTIVATIONS is refused at load, not at the first forward
        self.qbias = None if bias is None else bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.parts) == 1:
            return self.parts[0](x, self.qbias)
        y = torch.cat([p(x) for p in self.parts], dim=-1)
        return y if self.qbias is None else y + self.qbias

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts) + (0 if self.qbias is None else self.qbias.nbytes)

    def extra_repr(self) -> str:
        kinds = "+".join(p.qtype for p in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, {kinds}"


class QuantEmbedding(nn.Module):
    """A token embedding kept quantized: a lookup dequantizes only the rows it reads (exactly)."""

    def __init__(self, weight: QuantWeight):
        super().__init__()
        self.qweight = weight
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight.dequantize(ids).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.qweight.qtype}"


def quantized_bytes(module: nn.Module) -> int:
    """Bytes of the quantized tensors under `module` (which parameters and buffers do not count): these blocks
    and FP8 linears (engine/models/fp8_linear.py)."""
    from engine.models.fp8_linear import Fp8Linear

    total = 0
    for m in module.modules():
        if isinstance(m, (QuantLinear, Fp8Linear)):
            total += m.nbytes
        elif isinstance(m, QuantEmbedding):
            total += m.qweight.nbytes
    return total
