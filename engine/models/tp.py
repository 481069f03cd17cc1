"""Tensor-parallel sharding of the one decoder (engine/models/decoder.py), Megatron-style.

Each of N ranks builds the same DecoderLM from a *local* ModelSpec (`local_spec`: its share of the attention
heads, KV heads and MLP width, and of the vocabulary) and reads only its slice of every checkpoint tensor
(`read_shard`, through safetensors' `get_slice`, so no rank loads a whole tensor it does not keep):

- column-parallel: q/k/v and gate/up (rows of the fused qkv_proj / gate_up_proj; their biases likewise). Rank r
  holds query heads [r*H/N, (r+1)*H/N) and KV heads [r*Hkv/N, ...); with fewer KV heads than ranks (N a multiple
  of Hkv) each KV head is replicated on the N/Hkv ranks whose query heads read it, so every rank's attention is
  a plain GQA over its own heads and the paged KV cache holds only the local KV heads.
- row-parallel: o_proj and down_proj take their input columns; the partial products are summed over the ranks
  by an all-reduce, and the bias (whole on every rank) is added once, after it (`RowParallelLinear`).
- vocabulary-parallel embedding: rank r holds rows [r*Vs, (r+1)*Vs) (Vs = ceil(V/N), the last shard padded with
  zero rows); a token outside the shard looks up zeros and the all-reduce sums in the one rank that has it,
  bit-exact (every other addend is +0).
- vocabulary-parallel LM head (tied or not): each rank computes its Vs columns of the sampling rows' logits and
  they are gathered to rank 0 (`VocabGather`), which samples; the padded columns are cut off there.

Norms, RoPE tables and q/k norms (per head_dim) are replicated. Everything outside the model (scheduler, block
manager, sampler, detokenizer) runs once, on rank 0 (engine/tp).

Quantized weights (GGUF blocks, int4 as Q4_1 blocks, FP8) shard the same way (`take_shard`): rows are whole rows of
blocks; a row-parallel K split must fall on block boundaries (a block's weights share a scale and cannot be cut:
32 weights, 256 for the K-quants), else `check_block_aligned` refuses it naming the tensor; a quantized embedding
is `QuantVocabParallelEmbedding` (zero blocks pad it: they dequantize to 0), and a tied head reads its blocks.

The collectives go through `comm` (engine/tp/comm.py): all_reduce(t) in place, and gather_to_root(t, out_list).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from engine.cpu.quant import QuantEmbedding, QuantWeight
from engine.models.decoder import MLP, DecoderLM, ModelSpec


WHOLE = -1  # shard index of a checkpoint tensor that fills a fused parameter entirely (Phi-3's qkv_proj)


@dataclasses.dataclass(frozen=True, slots=True)
class TPShard:
    """This rank's place in the group, the full model's spec (for checkpoint offsets) and the collectives."""

    rank: int
    size: int
    full: ModelSpec
    comm: object

    @property
    def vocab_shard(self) -> int:
        return -(-self.full.vocab_size // self.size)

    @property
    def kv_head_start(self) -> int:
        """First KV head this rank holds: its own share, or the one its query heads read when replicated."""
        return self.rank * self.full.num_kv_heads // self.size


def check_shardable(spec: ModelSpec, size: int) -> None:
    """ValueError naming what does not divide by `size` ranks (or a model it cannot shard at all)."""
    if spec.moe is not None and size > 1:
        raise ValueError(f"tensor_parallel_size={size}: mixture-of-experts models ({spec.family}) are not sharded "
                         "yet (their experts would split along the expert width); use pipeline_parallel_size")
    problems = []
    if spec.num_heads % size:
        problems.append(f"num_attention_heads {spec.num_heads}")
    kv = spec.num_kv_heads
    if kv % size and size % kv:
        problems.append(f"num_key_value_heads {kv} (nor does {size} divide by it, so they cannot be replicated)")
    if spec.intermediate_size % size:
        problems.append(f"intermediate_size {spec.intermediate_size}")
    if problems:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's {', '.join(problems)}")


def local_spec(spec: ModelSpec, size: int) -> ModelSpec:
    """The spec one rank builds its DecoderLM from: its share of heads, KV heads, MLP width and vocabulary."""
    check_shardable(spec, size)
    return dataclasses.replace(spec, num_heads=spec.num_heads // size,
                               num_kv_heads=max(1, spec.num_kv_heads // size),
                               intermediate_size=spec.intermediate_size // size,
                               vocab_size=-(-spec.vocab_size // size))


# ---- loading: each rank reads its slice of a checkpoint tensor -------------------------------------------------
def read_shard(f, name: str, pname: str, shard: int, tp: TPShard) -> torch.Tensor:
    """This rank's part of checkpoint tensor `name`, which loader._map_name mapped to parameter `pname`
    (`shard`: 0/1/2 for q/k/v or gate/up inside the fused parameter, WHOLE (-1) for one already fused
    in the checkpoint, as Phi-3's)."""
    return take_shard(f.get_slice(name), pname, shard, tp)


def take_shard(sl, pname: str, shard: int, tp: TPShard, qtype: str | None = None, name: str = ""):
    """This rank's part of `sl`, anything sliced like a 2-D array (a safetensors slice, a tensor), for parameter
    `pname` (read_shard's `shard`). With `qtype`, `sl` is a quantized weight's block bytes [N, K / QK * block
    bytes] (engine/cpu/quant.py): rows are whole rows of blocks either way, and a row-parallel weight's inputs are
    split on block boundaries, or refused naming tensor `name` (check_block_aligned)."""
    rows = _row_ranges(pname, shard, tp)
    if rows is not None:
        parts = [sl[start:start + length] for start, length in rows]
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    cols = _input_columns(pname, tp)
    if cols is not None:
        start, length = cols
        if qtype is not None:
            qk, nbytes = check_block_aligned(name or pname, qtype, length * tp.size, tp.size)
            start, length = start // qk * nbytes, length // qk * nbytes
        return sl[:, start:start + length]
    if pname in ("embed_tokens.weight", "lm_head.weight"):
        return _vocab_rows(sl, tp)
    return sl[:]  # norms, row-parallel biases (added once after the all-reduce): whole on every rank


def check_block_aligned(name: str, qtype: str, k: int, size: int) -> tuple[int, int]:
    """(weights, bytes) of a `qtype` block, after checking that `size` ranks split the K = `k` inputs of quantized
    tensor `name` on block boundaries (a quantized row is a run of blocks along K: a block cannot be cut);
    ValueError naming the tensor, its type, K and the size otherwise."""
    from engine.cpu.quant import BLOCK_BYTES, BLOCK_WEIGHTS

    qk = BLOCK_WEIGHTS[qtype]
    if k % size or (k // size) % qk:
        raise ValueError(f"tensor_parallel_size={size} cannot split {name} ({qtype}, K={k}) on its block boundaries: "
                         f"a row-parallel shard of {k / size:g} inputs is not a whole number of {qtype} blocks "
                         f"({qk} weights each)")
    return qk, BLOCK_BYTES[qtype]


def _row_ranges(pname: str, shard: int, tp: TPShard) -> list[tuple[int, int]] | None:
    """(start, length) row ranges of a column-parallel tensor (q/k/v, gate/up, their biases) this rank keeps, in
    order; None for any other."""
    full, d = tp.full, tp.full.head_dim
    q_rows = (tp.rank * full.num_heads // tp.size * d, full.num_heads // tp.size * d)  # (start, length)
    kv_rows = (tp.kv_head_start * d, max(1, full.num_kv_heads // tp.size) * d)
    inter = full.intermediate_size // tp.size
    mlp_rows = (tp.rank * inter, inter)
    if "qkv_proj" in pname:
        if shard >= 0:
            return [q_rows if shard == 0 else kv_rows]
        q, kv = full.num_heads * d, full.num_kv_heads * d  # fused: q, then k, then v sections
        return [q_rows, (q + kv_rows[0], kv_rows[1]), (q + kv + kv_rows[0], kv_rows[1])]
    if "gate_up_proj" in pname:
        if shard >= 0:
            return [mlp_rows]
        return [mlp_rows, (full.intermediate_size + mlp_rows[0], inter)]
    return None


def _input_columns(pname: str, tp: TPShard) -> tuple[int, int] | None:
    """(start, length) of the input columns of a row-parallel weight (o_proj, down_proj) this rank keeps."""
    full = tp.full
    if pname.endswith("o_proj.weight"):
        per_rank = full.num_heads // tp.size * full.head_dim
    elif pname.endswith("down_proj.weight"):
        per_rank = full.intermediate_size // tp.size
    else:
        return None
    return tp.rank * per_rank, per_rank


def _vocab_rows(sl, tp: TPShard) -> torch.Tensor:
    """Rows [r*Vs, (r+1)*Vs) of the embedding / head, zero-padded past the real vocabulary (for quantized block
    bytes a zero row is zero blocks, whose scales are 0: every weight dequantizes to 0)."""
    vs, vocab = tp.vocab_shard, tp.full.vocab_size
    start = min(tp.rank * vs, vocab)
    part = sl[start:min(start + vs, vocab)]
    if part.shape[0] == vs:
        return part
    return torch.cat([part, part.new_zeros(vs - part.shape[0], *part.shape[1:])])


# ---- the collectives inside the forward ----------------------------------------------------------------------
class VocabParallelEmbedding(nn.Module):
    """An nn.Embedding over this rank's vocabulary rows; the lookup is summed over the ranks (an all-reduce).
    Keeps the name `weight` so a tied LM head reads the same shard (DecoderLM._head_weight)."""

    def __init__(self, weight: torch.Tensor, start: int, comm):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start
        self.comm = comm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        x.masked_fill_(outside.unsqueeze(-1), 0.0)
        self.comm.all_reduce(x)
        return x


class QuantVocabParallelEmbedding(QuantEmbedding):
    """VocabParallelEmbedding over quantized rows (a GGUF file's token_embd): this rank's vocabulary rows in their
    blocks (zero blocks past the vocabulary), a lookup dequantizing only the rows it reads, summed over the ranks.
    Keeps `qweight`, so a tied LM head reads the same shard's blocks."""

    def __init__(self, weight: QuantWeight, start: int, comm):
        super().__init__(weight)
        self.start = start
        self.comm = comm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = super().forward(local.masked_fill(outside, 0))  # [T, hidden] fp32
        x.masked_fill_(outside.unsqueeze(-1), 0.0)
        self.comm.all_reduce(x)
        return x


class RowParallelLinear(nn.Module):
    """Input-sharded linear: this rank's partial product, summed over the ranks, then the bias once.
    The inner linear (an nn.Linear, or a quantized QuantLinear / Fp8Linear holding its K slice) has no bias, so
    engine/cpu/linear.pack_linears packs a float one like any other."""

    def __init__(self, linear: nn.Module, comm):
        super().__init__()
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        linear.bias = None
        self.linear = linear
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        self.comm.all_reduce(y)
        return y if self.bias is None else y.add_(self.bias)


class VocabGather:
    """The LM head's vocabulary shards of the logits gathered to rank 0 (DecoderLM.vocab_gather): rank 0
    gets all `vocab` columns (into `out` when given), the others take part and get None."""

    def __init__(self, vocab: int, tp: TPShard):
        self.vocab, self.rank, self.size, self.comm = vocab, tp.rank, tp.size, tp.comm

    def __call__(self, logits: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor | None:
        logits = logits.contiguous()  # [rows, Vs]
        if self.rank:
            self.comm.gather_to_root(logits, None)
            return None
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        self.comm.gather_to_root(logits, parts)
        full = torch.cat(parts, dim=1)[:, :self.vocab]  # [rows, V]: the padding columns cut off
        return full.float() if out is None else out.copy_(full)


def parallelize(model: DecoderLM, tp: TPShard) -> None:
    """Swap in the collectives after the rank's shards are loaded (and before pack_for_cpu packs the linears)."""
    comm, embed, start = tp.comm, model.embed_tokens, tp.rank * tp.vocab_shard
    if isinstance(embed, QuantEmbedding):
        model.embed_tokens = QuantVocabParallelEmbedding(embed.qweight, start, comm)
    elif embed is not None:
        model.embed_tokens = VocabParallelEmbedding(embed.weight.data, start, comm)
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj = RowParallelLinear(attn.o_proj, comm)
        if not isinstance(mlp, MLP):
            raise ValueError(f"tensor parallelism shards dense MLPs only; layer {i} has a {type(mlp).__name__}")
        mlp.down_proj = RowParallelLinear(mlp.down_proj, comm)
    if model.is_last:
        model.vocab_gather = VocabGather(tp.full.vocab_size, tp)
