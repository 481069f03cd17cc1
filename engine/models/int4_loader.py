"""GPTQ and AWQ int4 checkpoints, served quantized: on CPU their groups become the Q4_1 blocks of
engine/cpu/quant.py; on CUDA the Triton int4 GEMM (engine/models/int4_triton.py) runs their codes, zero points
and scales, repacked.

A checkpoint directory whose config.json carries a `quantization_config` (as transformers reads it) with
quant_method "gptq" or "awq" and 4 bits keeps, per quantized linear, `qweight` (int32, eight 4-bit weights
each), `qzeros` (int32, eight 4-bit zero points each) and `scales` (fp16), one scale and zero point per
`group_size` weights along K (the input features) and output n:

    w[n, k] = scales[k // g, n] * (q[n, k] - z[k // g, n])

- GPTQ (AutoGPTQ / optimum's layout): qweight [K / 8, N], weight k in bits 4 * (k % 8) of row k // 8; qzeros
  [K / g, N / 8], zero point n in bits 4 * (n % 8). checkpoint_format "gptq" (v1, the common one) stores each
  zero point minus one, so z is the stored value + 1; "gptq_v2" stores z. Act-order checkpoints (desc_act: a
  permuted g_idx) are refused: their groups are not runs of K.
- AWQ (AutoAWQ's GEMM layout): qweight [K, N / 8] and qzeros [K / g, N / 8], packed along N in the order
  0, 2, 4, 6, 1, 3, 5, 7 (nibble i of word c holds output 8c + ORDER[i]); z as stored.

Why Q4_1 on CPU: a Q4_1 block is 32 weights along K with one fp16 scale d and one fp16 min m, w = d * q + m, and
a group of g (a multiple of 32) is g / 32 such blocks with d = scale and m = -scale * z. So the CPU's quantized
GEMM (gemm_quant.cpp, every ISA level) runs these checkpoints with no kernel of their own, at 20 bytes per 32
weights (the checkpoint's 16 + 2 scale bytes per 128, plus the mins). d is the checkpoint's scale exactly; m is
-scale * z rounded to fp16, which is exact where z is a power of two (symmetric GPTQ: z = 8) and otherwise off
by at most half an fp16 ulp of m (AWQ, asymmetric GPTQ): the weights then differ from the checkpoint's own
dequantization by that much (docs/features.md says so; tests/test_int4_checkpoint.py bounds it). The CUDA
kernel computes scale * (q - z) exactly, for both formats.

On CPU it runs with float32 activations, on CUDA in the model's dtype. On CPU a pipeline stage places only its
own layers' linears, and LoRA adapters wrap the Q4_1 linears as any other (engine/lora/layers.py); on CUDA (the
Triton int4 GEMM) pipeline stages and LoRA are refused by EngineConfig. Linears a checkpoint keeps in float (the
LM head, `modules_to_not_convert`) stay float.
Tensor parallelism (CPU) shards the Q4_1 blocks: each linear is converted whole, one at a time, and the rank keeps
its rows (q/k/v, gate/up) or K blocks (o, down) of it. A group of g becomes g / 32 blocks each carrying the
group's scale, so a K split needs only K / tp to be a multiple of 32 (refused at load, naming the tensor,
otherwise), whatever the group size. The Triton int4 weights are not sharded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.cpu.quant import BLOCK, BLOCK_BYTES, QuantLinear, QuantWeight
from engine.models.decoder import DecoderLM
from engine.models.int4_triton import CHUNK, Int4Linear, Int4Weight, pack
from engine.models.quantized_checkpoint import Checkpoint, in_stage
from engine.models.tp import TPShard, take_shard

INT4_METHODS = ("gptq", "awq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds output 8c + AWQ_ORDER[i]
AWQ_NIBBLE_OF = [AWQ_ORDER.index(j) for j in range(8)]  # output 8c + j sits in nibble AWQ_NIBBLE_OF[j]


@dataclass(frozen=True)
class Int4Scheme:
    """A checkpoint's int4 quantization, validated: the method, the group size along K (None: one group, the
    whole row), and what is added to a stored zero point to get z."""

    method: str  # "gptq" | "awq"
    group_size: int | None
    zero_offset: int  # 1 for GPTQ v1 (zero points stored minus one), else 0

    def linear_bytes(self, n: int, k: int) -> int:
        """Bytes an [n, k] linear holds on a GPU (the Triton GEMM's layout, engine/models/int4_triton.pack):
        the codes at half a byte, K rounded up to a 128-input chunk, and per group and output a uint8 zero
        point and an fp16 scale. The simulated device prices int4 linears with it."""
        groups = 1 if self.group_size is None else -(-k // self.group_size)
        return n * (-(-k // CHUNK) * CHUNK) // 2 + 3 * n * groups


def int4_scheme(qc: dict) -> Int4Scheme:
    """The scheme of a quantization_config; ValueError naming what Tandem does not run."""
    method = str(qc.get("quant_method", "")).lower()
    if method not in INT4_METHODS:
        raise ValueError(f"quantization_config quant_method={qc.get('quant_method')!r} is not supported; Tandem "
                         "serves 'gptq' and 'awq' int4 checkpoints (and GGUF files) quantized on CPU")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{method} with bits={bits!r} is not supported: 4-bit only")
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if not isinstance(group, int) or not (group == -1 or (group > 0 and group % BLOCK == 0)):
        raise ValueError(f"{method} group_size={group!r} is not supported: -1 or a multiple of {BLOCK}")
    if method == "gptq":
        if qc.get("desc_act"):
            raise ValueError("gptq with desc_act=true (act-order) is not supported: its groups are not runs of "
                             "the input features")
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq checkpoint_format={fmt!r} is not supported: 'gptq' or 'gptq_v2'")
        offset = 1 if fmt == "gptq" else 0
    else:
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq version={qc.get('version')!r} is not supported: the GEMM layout ('gemm') only")
        if qc.get("zero_point", True) is False:
            raise ValueError("awq with zero_point=false is not supported")
        offset = 0
    return Int4Scheme(method, None if group == -1 else group, offset)


def _nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their eight 4-bit values (uint8), lowest bits first, expanded along `dim`."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    words = packed.to(torch.int32).unsqueeze(-1)  # [..., 1]
    vals = ((words >> shifts) & 0xF).to(torch.uint8)  # [..., 8]
    if dim == 0:  # packed along rows: [R, C, 8] -> [R, 8, C] -> [8R, C]
        return vals.permute(0, 2, 1).reshape(-1, packed.shape[1])
    return vals.reshape(packed.shape[0], -1)  # along columns: [R, C * 8]


def unpack(scheme: Int4Scheme, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K] uint8, z [G, N] int32 with the offset applied, scales [G, N] fp16) of one linear."""
    if scheme.method == "gptq":
        q = _nibbles(qweight, 0).t()  # [K, N] -> [N, K]
        z = _nibbles(qzeros, 1)
    else:
        q = _awq_nibbles(qweight).t()
        z = _awq_nibbles(qzeros)
    return q.contiguous(), z.to(torch.int32) + scheme.zero_offset, scales.to(torch.float16)


def _awq_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """AWQ words [R, C] -> their values [R, 8C] in output order (AWQ_ORDER undone)."""
    vals = _nibbles(packed, 1).view(packed.shape[0], -1, 8)  # [R, C, 8] in nibble order
    return vals[:, :, AWQ_NIBBLE_OF].reshape(packed.shape[0], -1)


def to_q4_1(scheme: Int4Scheme, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> QuantWeight:
    """One linear's int4 groups as a Q4_1 QuantWeight (the module docstring: d = scale, m = -scale * z in fp16)."""
    blocks = q4_1_blocks(scheme, qweight, qzeros, scales)
    return QuantWeight("Q4_1", blocks, blocks.shape[1] // BLOCK_BYTES["Q4_1"] * BLOCK)


def q4_1_blocks(scheme: Int4Scheme, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
                ) -> torch.Tensor:
    """One linear's int4 groups as Q4_1 block bytes, uint8 [N, K / 32 * 20], the file layout a QuantWeight is
    made from (and a tensor-parallel rank slices first)."""
    q, z, s = unpack(scheme, qweight, qzeros, scales)
    n, k = q.shape
    group = scheme.group_size or k  # the last group may be short, as GPTQ makes it when K is not a multiple
    if k % BLOCK or s.shape != (-(-k // group), n) or z.shape != s.shape:
        raise ValueError(f"int4 tensors do not agree: {n} x {k} weights in groups of {group} need scales and zeros "
                         f"of {(-(-k // group), n)}; got {tuple(s.shape)} and {tuple(z.shape)}")
    of_block = torch.arange(0, k, BLOCK) // group  # each Q4_1 block's group (groups are whole blocks)
    d = s.t()[:, of_block]  # [N, K / 32] fp16, the checkpoint's scale as it is
    m = (-(s.float() * z.float())).to(torch.float16).t()[:, of_block]
    qs = q.view(n, k // BLOCK, BLOCK)
    packed = qs[..., :16] | (qs[..., 16:] << 4)  # Q4_1: weights 0-15 in the low nibbles, 16-31 in the high
    blocks = torch.cat((d.unsqueeze(-1).view(torch.uint8), m.unsqueeze(-1).view(torch.uint8), packed), dim=-1)
    return blocks.reshape(n, -1)


def place_int4_linears(model: DecoderLM, model_dir: str, scheme: Int4Scheme, dtype: torch.dtype,
                       device: torch.device, gpu: bool, tp: TPShard | None = None) -> None:
    """Replace the quantized linears of `model` (a DecoderLM on the meta device, before to_empty; one pipeline
    stage's layers when built so, which reads only their tensors) by modules
    holding their bytes: with `gpu`, Int4Linears on `device` running the Triton int4 GEMM (CUDA, or CPU tensors
    under the interpreter); else Q4_1 QuantLinears (CPU, float32). engine/models/loader.py's build_model calls it;
    its load_weights then fills every float parameter left: embeddings, norms, the LM head, linears the
    checkpoint kept in float. Refuses what it does not run, and a quantized tensor it did not place (a quantized
    LM head, an unknown module). With `tp`, the rank's shard of every Q4_1 linear (module docstring)."""
    if gpu and tp is not None:
        raise ValueError(f"a {scheme.method} int4 model shards for tensor parallelism on the CPU's Q4_1 path only "
                         "(the Triton int4 GEMM's weights are not sharded)")
    if not gpu and (device.type != "cpu" or dtype != torch.float32):
        raise ValueError(f"a {scheme.method} int4 model runs quantized on CPU in float32 only, not {device.type} "
                         f"{dtype} (on CUDA the Triton int4 GEMM runs it in the model's dtype)")
    spec = model.spec
    if spec.moe is not None:
        raise ValueError(f"a {scheme.method} int4 mixture-of-experts model is not supported")
    ckpt = Checkpoint(model_dir)
    placed: set[str] = set()
    first, end = model.layer_range
    for i, layer in zip(range(first, end), model.layers):
        pre = f"model.layers.{i}"
        attn = [f"{pre}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
        for owner, attr, names in ((layer.self_attn, "qkv_proj", attn),
                                   (layer.self_attn, "o_proj", [f"{pre}.self_attn.o_proj"]),
                                   (layer.mlp, "gate_up_proj", [f"{pre}.mlp.gate_proj", f"{pre}.mlp.up_proj"]),
                                   (layer.mlp, "down_proj", [f"{pre}.mlp.down_proj"])):
            placed.update(_place_linear(ckpt, scheme, owner, attr, names, device if gpu else None, tp))
    unplaced = sorted(n for n in ckpt.where if n.endswith(".qweight") and n not in placed
                      and in_stage(n, first, end))
    if unplaced:
        raise ValueError(f"checkpoint {model_dir!r} quantizes tensors Tandem runs only in float: {unplaced[:8]}")


def _place_linear(ckpt: Checkpoint, scheme: Int4Scheme, owner: nn.Module, attr: str, names: list[str],
                  device: torch.device | None, tp: TPShard | None = None) -> list[str]:
    """owner.attr := the quantized linear of the rows of `names` stacked, when the checkpoint quantized them (a
    float linear is left for load_weights): an Int4Linear on `device`, or with None a Q4_1 QuantLinear (with
    `tp`, of this rank's rows or K blocks). Biases (Qwen2's q/k/v) stay fp32. Returns the qweight names placed."""
    quantized = [f"{n}.qweight" in ckpt for n in names]
    if not any(quantized):
        return []
    if not all(quantized):
        raise ValueError(f"the checkpoint quantizes some of {names} and not the others")
    tensors = [(ckpt.get(f"{n}.qweight"), ckpt.get(f"{n}.qzeros"), ckpt.get(f"{n}.scales")) for n in names]
    biases = [ckpt.get(f"{n}.bias") for n in names if f"{n}.bias" in ckpt]
    if tp is not None:  # column-parallel biases are sliced with their rows; a row-parallel one stays whole
        biases = [take_shard(b, f"{attr}.bias", i, tp) for i, b in enumerate(biases)]
    bias = torch.cat(biases).float() if biases else None
    if device is None and tp is not None:
        linear = QuantLinear([_q4_1_shard(scheme, t, attr, i, n, tp) for i, (t, n) in enumerate(zip(tensors, names))],
                             bias)
    elif device is None:
        linear = QuantLinear([to_q4_1(scheme, *t) for t in tensors], bias)
    else:
        linear = Int4Linear(_stacked_int4(scheme, tensors, device), bias)
    for n, (qweight, _, _) in zip(names, tensors):  # against the checkpoint's whole K (a rank's may be a slice)
        if f"{n}.g_idx" in ckpt:
            _check_g_idx(ckpt.get(f"{n}.g_idx"), scheme, qweight.shape[0] * (8 if scheme.method == "gptq" else 1), n)
    setattr(owner, attr, linear)
    return [f"{n}.qweight" for n in names]


def _q4_1_shard(scheme: Int4Scheme, tensors: tuple[torch.Tensor, ...], attr: str, shard: int, name: str,
                tp: TPShard) -> QuantWeight:
    """This rank's rows (q/k/v, gate/up) or K blocks (o, down) of one linear's Q4_1 blocks, copied out of the whole
    (made here one linear at a time), so the rank holds only its part. Groups become Q4_1 blocks of 32 weights,
    each with its group's scale, so a K split needs only 32-alignment, whatever the group size."""
    blocks = q4_1_blocks(scheme, *tensors)
    part = take_shard(blocks, f"{attr}.weight", shard, tp, "Q4_1", f"{name}.qweight")
    part = part.clone(memory_format=torch.contiguous_format)
    return QuantWeight("Q4_1", part, part.shape[1] // BLOCK_BYTES["Q4_1"] * BLOCK)


def _stacked_int4(scheme: Int4Scheme, tensors: list[tuple[torch.Tensor, ...]], device: torch.device) -> Int4Weight:
    """The linears' (qweight, qzeros, scales) unpacked and stacked along N (q/k/v, gate/up): exact, as they
    share K and the group size, so each group spans the same inputs in every part; packed for the Triton GEMM."""
    parts = [unpack(scheme, *t) for t in tensors]  # (q [N, K], z [G, N], scales [G, N]) each
    q, z, s = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts], 1), torch.cat([p[2] for p in parts], 1)
    return pack(q, z, s, scheme.group_size, device)


def _check_g_idx(g_idx: torch.Tensor, scheme: Int4Scheme, in_features: int, name: str) -> None:
    """A GPTQ g_idx must be the plain k // group_size (no act-order permutation): refuse it otherwise."""
    group = scheme.group_size or in_features
    if not torch.equal(g_idx.to(torch.int64), torch.arange(in_features) // group):
        raise ValueError(f"{name}.g_idx is not k // group_size: act-order GPTQ checkpoints are not supported")
