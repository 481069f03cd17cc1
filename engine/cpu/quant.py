"""Weight-only quantized linears and embeddings for the CPU path, in a GGUF file's own block layout.

A QuantWeight is a [N, K] weight as ggml's blocks along K, the bytes exactly as the file holds them
([N, K / QK * block bytes] uint8, QK the weights a block):
  Q8_0  32 weights in 34 bytes: fp16 scale d, 32 int8 q;                              w = d * q
  Q4_1  32 in 20: fp16 d and min m, 16 bytes of nibbles (weight j the low nibble of byte j, 16 + j its high one);
        w = d * q + m
  Q5_0  32 in 22: fp16 d, 32 high bits (uint32), 16 bytes of low nibbles as Q4_1's;  w = d * (q - 16)
  Q4_K  256 in 144: fp16 d and dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of nibbles (sub-block
        2c the low nibbles of bytes 32c..32c+31, 2c + 1 their high ones);              w = (d sc_j) q - dmin m_j
  Q6_K  256 in 210: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one per 16 weights), fp16 d;
        w = (d sc_i) (q - 32)
Nothing is unpacked at load, so the model's resident weights are the file's size (Q8_0 and Q4_1 on AVX-512 VNNI
are repacked at load into the packed layout, `pack_rows`: the same bytes, 16 rows' blocks interleaved, so that one
integer dot instruction serves 16 outputs; a decode step's linears then stream at memory speed instead of compute
speed). engine/cpu/gemm_quant.cpp
multiplies by it at every instruction-set level, for the types its build lists (`gemm_q_types`); otherwise (a
type that build lacks, or no extension: it does not build, or TANDEM_CPU_GEMM=0 / TANDEM_CPU_KERNELS=0 when the
weight is made, at load) the fallback dequantizes the whole weight with torch ops on every call: correct, slow,
and no more resident memory.

Activations (TANDEM_QUANT_ACTIVATIONS): "int8" (the default) is llama.cpp's arithmetic: x quantized per call to
ggml's Q8_0 blocks (gguf.quants' quantizer bit for bit) and integer dot products with the weights' quants, a
block's scales applied in fp32; "fp32" is the exact path: x as it is, times the dequantized weights. The fallback
follows the same switch (it quantizes x with torch ops), so a model's outputs do not depend on whether the
kernels built.

Dequantization (here and in the kernel) is exactly the `gguf` package's, in fp32: d * q, (d sc) and (d sc) q are
exact (at most 11 + 6 + 6 significant bits), so each weight is rounded at most once (Q4_1's + m, Q4_K's - dmin m),
as numpy rounds it: the weights are bit for bit the ones transformers' GGUF loader gives.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from engine.cpu import kernels as cpu_native

BLOCK = 32  # weights a block along K (Q8_0, Q4_1, Q5_0, and x's blocks in the int8 path); a K-quant's sub-block
BLOCK_WEIGHTS = {"Q8_0": 32, "Q4_1": 32, "Q5_0": 32, "Q4_K": 256, "Q6_K": 256}
BLOCK_BYTES = {"Q8_0": 34, "Q4_1": 20, "Q5_0": 22, "Q4_K": 144, "Q6_K": 210}
GGML_TYPE_IDS = {"Q8_0": 8, "Q4_1": 3, "Q5_0": 6, "Q4_K": 12, "Q6_K": 14}  # gguf.GGMLQuantizationType's values
QUANT_TYPES = tuple(BLOCK_BYTES)
ACTIVATIONS = ("int8", "fp32")  # TANDEM_QUANT_ACTIVATIONS' values, the default first


def quant_kernels(qtype: str):
    """The kernel module when `qtype`'s linears go through gemm_quant.cpp here, else None (the torch fallback)."""
    if os.environ.get("TANDEM_CPU_GEMM", "1") == "0":
        return None
    kernels = cpu_native.load()
    return kernels if qtype in getattr(kernels, "gemm_q_types", ()) else None


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
    """A [out_features, in_features] weight in ggml blocks of `qtype`; `data` uint8 [N, K / 32 * block bytes], the
    file's layout. Callable as a packed head (engine/cpu/linear.py's packed_linear): `w(x, bias)` is x @ W^T (+ bias).

    Held as given, or, where this build has packed kernels for the type (`gemm_q_packed_types`: Q8_0 and Q4_1 with
    AVX-512 VNNI), in the packed layout (`pack_rows`: the same bytes, plus at most 15 rows of padding), which both
    activation paths run on; `data` then unpacks a copy."""

    def __init__(self, qtype: str, data: torch.Tensor, in_features: int):
        if qtype not in BLOCK_BYTES:
            raise ValueError(f"quantized type {qtype!r} is not supported; valid: {', '.join(QUANT_TYPES)}")
        qk = BLOCK_WEIGHTS[qtype]
        if in_features % qk:
            raise ValueError(f"a {qtype} weight needs in_features divisible by {qk}, got {in_features}")
        row = in_features // qk * BLOCK_BYTES[qtype]
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != row:
            raise ValueError(f"a {qtype} weight of {in_features} features is uint8 [N, {row}]; got "
                             f"{data.dtype} {tuple(data.shape)}")
        self.qtype, self.in_features, self.rows = qtype, in_features, data.shape[0]
        # the kernels are chosen once, at load (as the float linears' CPU GEMM is): looking them up took ~3 us a
        # call, ~5% of a SmolLM2 decode step; the activation switch is still read at every call
        self.kernels = quant_kernels(qtype)
        self.packed = self.kernels is not None and self.rows > 0 and qtype in getattr(self.kernels,
                                                                                         "gemm_q_packed_types", ())
        self._store = pack_rows(qtype, data) if self.packed else data.contiguous()

    @property
    def data(self) -> torch.Tensor:
        """The blocks in the file's layout, [N, K / QK * block bytes] (a copy when the weight is packed)."""
        return self._file_rows(None)

    def _file_rows(self, rows: torch.Tensor | None) -> torch.Tensor:
        """The file-layout blocks of `rows` (any shape, flattened), or of every row; a packed weight's through the
        kernel's packed_rows."""
        if self.packed:
            ids = torch.arange(self.rows) if rows is None else rows.reshape(-1)
            return self.kernels.packed_rows(self._store, GGML_TYPE_IDS[self.qtype], ids)
        return self._store if rows is None else self._store.index_select(0, rows.reshape(-1))

    @property
    def out_features(self) -> int:
        return self.rows

    @property
    def nbytes(self) -> int:
        return self._store.numel()

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 weight [N, K] (or only `rows`, for an embedding lookup), as gguf.quants.dequantize gives it."""
        data = self._file_rows(rows)
        blocks = data.view(data.shape[0], -1, BLOCK_BYTES[self.qtype])  # [n, K / QK, bytes]
        return _DEQUANTIZE[self.qtype](blocks).reshape(data.shape[0], self.in_features)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        int8 = int8_activations()
        if self.kernels is None:
            return F.linear(q8_0_round_trip(x) if int8 else x, self.dequantize(), bias)
        if self.packed:
            return self.kernels.gemm_q_packed(x, self._store, GGML_TYPE_IDS[self.qtype], bias, self.rows, int8)
        return self.kernels.gemm_q_linear(x, self._store, GGML_TYPE_IDS[self.qtype], bias, int8)

    def __repr__(self) -> str:
        packed = ", packed" if self.packed else ""
        return f"QuantWeight({self.qtype}, [{self.out_features}, {self.in_features}]{packed})"


GROUP_ROWS = 16  # weight rows a group of the packed layout


def pack_rows(qtype: str, data: torch.Tensor) -> torch.Tensor:
    """[N, blocks * bytes] file blocks (Q8_0 or Q4_1) -> the packed layout, [ceil(N / 16), blocks * 16 * bytes]: the
    rows padded with zero blocks to a multiple of 16; per group of 16 rows and block j (16 * bytes together): dword k
    of the block's quants of each of the 16 rows (64 bytes a k, row order), then the 16 rows' fp16 d, then (Q4_1)
    their m. Q8_0's quants are stored + 128 (unsigned). gemm_quant_int8.cpp's tile_packed reads it; the kernel's
    packed_rows gives rows of it back in the file's layout."""
    dwords, scales = {"Q4_1": (4, 4), "Q8_0": (8, 2)}[qtype]  # quant dwords a block; bytes of fp16 scales first
    n, nbytes = data.shape[0], BLOCK_BYTES[qtype]
    groups = -(-n // GROUP_ROWS)
    padded = torch.zeros(groups * GROUP_ROWS, data.shape[1], dtype=torch.uint8)
    padded[:n] = data
    blocks = padded.view(groups, GROUP_ROWS, -1, nbytes)  # [G, 16, B, bytes]
    qs = blocks[..., scales:]
    if qtype == "Q8_0":
        qs = qs ^ 0x80
    qs = qs.reshape(groups, GROUP_ROWS, -1, dwords, 4).permute(0, 2, 3, 1, 4)  # [G, B, k, 16, 4]
    parts = [qs.reshape(groups, -1, dwords * 64)]
    for s in range(0, scales, 2):  # d (and m): [G, B, 16, 2]
        parts.append(blocks[..., s:s + 2].permute(0, 2, 1, 3).reshape(groups, -1, 32))
    return torch.cat(parts, dim=-1).reshape(groups, -1).contiguous()


def _half(b: torch.Tensor) -> torch.Tensor:
    """Bytes [..., 2] as their fp16 value in fp32, [..., 1]."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes [..., 16] as 32 nibbles: the low ones first (weights 0-15), then the high ones."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[..., 2:].contiguous().view(torch.int8).float() * _half(b[..., 0:2])


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _nibbles(b[..., 4:]).float() * _half(b[..., 0:2]) + _half(b[..., 2:4])


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    high = b[..., 2:6].contiguous().view(torch.int32).to(torch.int64) >> torch.arange(32) & 1  # [..., 32]
    q = (_nibbles(b[..., 6:]) | (high.to(torch.uint8) << 4)).to(torch.int8) - 16
    return _half(b[..., 0:2]) * q.float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    s = b[..., 4:16].unflatten(-1, (3, 4))  # bytes 0-3: 6-bit scales 0-3, 4-7: mins 0-3, 8-11: the rest's low bits
    sc = torch.cat((s[..., 0, :] & 0x3F, (s[..., 2, :] & 0x0F) | ((s[..., 0, :] >> 2) & 0x30)), dim=-1)
    mn = torch.cat((s[..., 1, :] & 0x3F, (s[..., 2, :] >> 4) | ((s[..., 1, :] >> 2) & 0x30)), dim=-1)
    d = (_half(b[..., 0:2]) * sc.float()).unsqueeze(-1)  # [..., 8, 1]: exact
    dm = (_half(b[..., 2:4]) * mn.float()).unsqueeze(-1)
    qs = b[..., 16:].unflatten(-1, (4, 1, 32)) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
    return (d * (qs & 0x0F).flatten(-3, -2).float() - dm).flatten(-2)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = b[..., :128].unflatten(-1, (2, 1, 64)) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
    ql = (ql & 0x0F).flatten(-3).unflatten(-1, (8, 32))  # [..., 8, 32]: per half, low nibbles then high ones
    qh = b[..., 128:192].unflatten(-1, (2, 1, 32)) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
    qh = (qh & 0x03).flatten(-3, -2)  # [..., 8, 32]
    q = ((ql | (qh << 4)).to(torch.int8) - 32).unflatten(-1, (2, 16)).flatten(-3, -2)  # [..., 16, 16]
    d = _half(b[..., 208:210]) * b[..., 192:208].contiguous().view(torch.int8).float()  # [..., 16]: exact
    return (d.unsqueeze(-1) * q.float()).flatten(-2)


# Each type's blocks [..., bytes] as their weights [..., QK] in fp32, as gguf.quants.dequantize gives them.
_DEQUANTIZE = {"Q8_0": _q8_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q4_K": _q4_k, "Q6_K": _q6_k}


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
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.parts) == 1:
            return self.parts[0](x, self.bias)
        y = torch.cat([p(x) for p in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts) + (0 if self.bias is None else self.bias.nbytes)

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
