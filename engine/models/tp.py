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

The collectives go through `comm` (engine/tp/comm.py): all_reduce(t) in place, and gather_to_root(t, out_list).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.decoder import DecoderLM, ModelSpec


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
    (`shard`: 0/1/2 for q/k/v or gate/up inside the fused parameter, loader.WHOLE (-1) for one already fused
    in the checkpoint, as Phi-3's)."""
    sl = f.get_slice(name)
    full, d = tp.full, tp.full.head_dim
    q_rows = (tp.rank * full.num_heads // tp.size * d, full.num_heads // tp.size * d)  # (start, length)
    kv_rows = (tp.kv_head_start * d, max(1, full.num_kv_heads // tp.size) * d)
    inter = full.intermediate_size // tp.size
    mlp_rows = (tp.rank * inter, inter)
    if "qkv_proj" in pname:
        if shard >= 0:
            return _rows(sl, *(q_rows if shard == 0 else kv_rows))
        q, kv = full.num_heads * d, full.num_kv_heads * d  # fused: q, then k, then v sections
        return torch.cat([_rows(sl, q_rows[0], q_rows[1]), _rows(sl, q + kv_rows[0], kv_rows[1]),
                          _rows(sl, q + kv + kv_rows[0], kv_rows[1])])
    if "gate_up_proj" in pname:
        if shard >= 0:
            return _rows(sl, *mlp_rows)
        return torch.cat([_rows(sl, *mlp_rows), _rows(sl, full.intermediate_size + mlp_rows[0], inter)])
    if pname.endswith("o_proj.weight"):
        return sl[:, q_rows[0]:q_rows[0] + q_rows[1]]
    if pname.endswith("down_proj.weight"):
        return sl[:, mlp_rows[0]:mlp_rows[0] + inter]
    if pname in ("embed_tokens.weight", "lm_head.weight"):
        return _vocab_rows(sl, tp)
    return sl[:]  # norms, row-parallel biases (added once after the all-reduce): whole on every rank


def _rows(sl, start: int, length: int) -> torch.Tensor:
    return sl[start:start + length]


def _vocab_rows(sl, tp: TPShard) -> torch.Tensor:
    """Rows [r*Vs, (r+1)*Vs) of the embedding / head, zero-padded past the real vocabulary."""
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


class RowParallelLinear(nn.Module):
    """Input-sharded linear: this rank's partial product, summed over the ranks, then the bias once.
    The inner nn.Linear has no bias, so engine/cpu/linear.pack_linears packs it like any other."""

    def __init__(self, linear: nn.Linear, comm):
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
    comm = tp.comm
    if model.embed_tokens is not None:
        model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight.data, tp.rank * tp.vocab_shard, comm)
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj = RowParallelLinear(attn.o_proj, comm)
        if not isinstance(getattr(mlp, "down_proj", None), nn.Linear):
            raise ValueError(f"tensor parallelism shards dense MLPs only; layer {i} has a {type(mlp).__name__}")
        mlp.down_proj = RowParallelLinear(mlp.down_proj, comm)
    if model.is_last:
        model.vocab_gather = VocabGather(tp.full.vocab_size, tp)
