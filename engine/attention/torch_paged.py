"""Pure-PyTorch paged attention: gather K/V pages by block table, then SDPA.

Runs anywhere; it is the CPU backend and the reference the GPU kernels are tested against. Each call may
name its layer's sliding window and score soft-cap (LayerAttention); soft-capped layers (Gemma 2) go through
explicit matmul + tanh + softmax, since SDPA has no soft-cap. A cache in another dtype than the model's
(EngineConfig.kv_cache_dtype) is written converted (fp8: quantized with the layer's k_scale / v_scale) and read
back in the model's dtype after the gather (engine/kv_dtype.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from engine.cpu import kernels as cpu_native
from engine.attention.metadata import AttentionMetadata, LayerAttention
from engine.kv_dtype import bytes_view, from_cache, to_cache

KVScales = tuple[torch.Tensor | None, torch.Tensor | None]  # a layer's (k_scale, v_scale); fp8 caches only


@dataclass(slots=True)
class _PrefillChunk:
    token_start: int
    num_tokens: int
    seq_len: int
    blocks: torch.Tensor  # [ceil(seq_len / block_size)] block ids
    mask: torch.Tensor | None  # [num_tokens, seq_len] bool, None = plain causal from position 0


@dataclass(slots=True)
class _DecodeGroup:
    """Single-token chunks of similar length, attended in one batched SDPA call."""

    tokens: torch.Tensor  # [b] token indices in the step
    blocks: torch.Tensor  # [b, max_blocks] block ids, padded with 0
    mask: torch.Tensor  # [b, 1, 1, max_blocks * block_size] bool


@dataclass(slots=True)
class _Layout:
    """The step's chunks, from the host lists: what every window's attention units are built from."""

    meta: AttentionMetadata
    qsl: list[int]  # query start of each row
    dec_rows: list[tuple[int, int]]  # (num_blocks, row) of the one-token rows
    chunks: list[tuple[int, int, int]]  # (row, num_tokens, seq_len) of the multi-token rows


@dataclass(slots=True)
class _Plan:
    """Units for the backend's own window, built in prepare(); other windows' (a model with sliding and global
    layers) built when a layer first asks for them in this step, then reused by the later layers."""

    decodes: list
    prefills: list[_PrefillChunk] | None  # None: CpuPagedAttention builds them when a layer falls back to SDPA
    layout: _Layout
    other_windows: dict[int | None, tuple[list, list[_PrefillChunk]]]
    native_prefill: object = None  # CpuPagedAttention: every multi-token chunk as one native kernel call


# Decode rows are grouped by length so the K/V gather (the bulk of CPU decode time, memory-bound) copies
# little padding: a row starts a new group when it needs fewer than GROUP_SPLIT of the group's longest
# row's blocks, once the group has GROUP_MIN_ROWS rows (fewer, larger SDPA calls beat many small ones).
GROUP_SPLIT = 0.75
GROUP_MIN_ROWS = 8


class TorchPagedAttention:
    """Decode rows are attended in a few batched SDPA calls (grouped by length); each multi-token chunk
    gets its own call."""

    name = "torch"
    supports_graphs = False  # plans each step from host lists
    supports_mixed_graphs = False

    def __init__(self, sliding_window: int | None = None):
        self.sliding_window = sliding_window
        # Reused gather targets for decode K/V: a fresh multi-MB tensor per layer per step costs page
        # faults on CPU. Only the thread running forwards touches them.
        self._scratch: dict[str, torch.Tensor] = {}

    def prepare(self, meta: AttentionMetadata) -> None:
        """Build the per-step plan once; every layer reuses it."""
        qsl = [0]
        for n in meta.query_lens_host:
            qsl.append(qsl[-1] + n)
        dec_rows, chunks = [], []
        for i, (n, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
            if n == 1:
                dec_rows.append((-(-seq_len // meta.block_size), i))
            else:
                chunks.append((i, n, seq_len))
        layout = _Layout(meta, qsl, dec_rows, chunks)
        meta.backend_data = _Plan(*self._units(layout, self.sliding_window), layout, {})

    def _units(self, layout: _Layout, window: int | None) -> tuple[list, list[_PrefillChunk]]:
        """The decode units and prefill chunks that attend with `window`."""
        meta, bs = layout.meta, layout.meta.block_size
        device = meta.block_tables.device
        prefills = [_PrefillChunk(layout.qsl[i], n, seq_len, meta.block_tables[i, : -(-seq_len // bs)],
                                  self._chunk_mask(n, seq_len, device, window))
                    for i, n, seq_len in layout.chunks]
        return self._decode_plan(layout.dec_rows, meta, layout.qsl, window), prefills

    def _units_for(self, plan: _Plan, window: int | None) -> tuple[list, list[_PrefillChunk]]:
        if window == self.sliding_window:
            return plan.decodes, plan.prefills
        units = plan.other_windows.get(window)
        if units is None:
            units = plan.other_windows[window] = self._units(plan.layout, window)
        return units

    def _decode_plan(self, rows: list[tuple[int, int]], meta: AttentionMetadata, qsl: list[int],
                     window: int | None) -> list:
        """The step's one-token rows, (num_blocks, row) pairs, as the units `_decode` attends."""
        return [self._decode_group(g, meta, qsl, window) for g in _group_by_length(rows)]

    @staticmethod
    def _decode_group(rows: list[tuple[int, int]], meta: AttentionMetadata, qsl: list[int],
                      window: int | None) -> _DecodeGroup:
        device, bs = meta.block_tables.device, meta.block_size
        idx = [i for _, i in rows]
        blocks = meta.block_tables[torch.tensor(idx, device=device), : rows[0][0]].long()
        lens = torch.tensor([meta.seq_lens_host[i] for i in idx], device=device)
        key_pos = torch.arange(rows[0][0] * bs, device=device)
        valid = key_pos[None, :] < lens[:, None]
        if window is not None:
            valid &= key_pos[None, :] >= lens[:, None] - window
        tokens = torch.tensor([qsl[i] for i in idx], dtype=torch.long, device=device)
        return _DecodeGroup(tokens, blocks, valid[:, None, None, :])

    @staticmethod
    def _chunk_mask(n: int, seq_len: int, device: torch.device, window: int | None) -> torch.Tensor | None:
        if seq_len == n and window is None:
            return None
        q_pos = torch.arange(seq_len - n, seq_len, device=device)[:, None]
        k_pos = torch.arange(seq_len, device=device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        return mask

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                layer: LayerAttention | None = None, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D]. Returns [T, H, D].
        `layer` None: the backend's own sliding window, no soft-cap. k_scale / v_scale: the layer's fp8 scales
        (scalar fp32 tensors; None = 1.0), read only for an fp8 cache."""
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        window = self.sliding_window if layer is None else layer.sliding_window
        softcap = None if layer is None else layer.softcap
        decodes, prefills = self._units_for(meta.backend_data, window)
        out = torch.empty_like(q)
        scales = (k_scale, v_scale)
        for g in decodes:
            out[g.tokens] = self._decode(q.index_select(0, g.tokens), k_cache, v_cache, g, scale, window, softcap,
                                         scales)
        if meta.backend_data.layout.chunks:
            self._attend_prefills(q, k_cache, v_cache, meta.backend_data, prefills, out, scale, window, softcap,
                                  scales)
        return out

    def _attend_prefills(self, q, k_cache, v_cache, plan: _Plan, prefills: list[_PrefillChunk], out: torch.Tensor,
                         scale: float, window: int | None, softcap: float | None, scales: KVScales) -> None:
        """Writes the multi-token chunks' rows of `out`."""
        for c in prefills:
            out[c.token_start:c.token_start + c.num_tokens] = self._prefill(
                q[c.token_start:c.token_start + c.num_tokens], k_cache, v_cache, c, scale, softcap, scales)

    def _gather(self, cache: torch.Tensor, blocks: torch.Tensor, name: str) -> torch.Tensor:
        """cache[blocks] as [B, max_blocks * block_size, Hkv, D], written into a reused buffer."""
        flat = blocks.reshape(-1)
        buf = self._scratch.get(name)
        if buf is None or buf.shape[0] < flat.numel() or buf.dtype != cache.dtype or buf.device != cache.device:
            buf = torch.empty(flat.numel(), *cache.shape[1:], dtype=cache.dtype, device=cache.device)
            self._scratch[name] = buf
        out = torch.index_select(cache, 0, flat, out=buf[: flat.numel()])
        return out.view(blocks.shape[0], -1, *cache.shape[2:])

    def _decode(self, q, k_cache, v_cache, g: _DecodeGroup, scale: float, window: int | None,
                softcap: float | None, scales: KVScales) -> torch.Tensor:
        b = q.shape[0]
        k = from_cache(self._gather(k_cache, g.blocks, "k"), q.dtype, scales[0])  # [B, max_blocks * bs, Hkv, D]
        v = from_cache(self._gather(v_cache, g.blocks, "v"), q.dtype, scales[1])
        o = attend(q.view(b, -1, 1, q.shape[-1]), k.transpose(1, 2), v.transpose(1, 2), g.mask, scale, softcap)
        return o.view(b, -1, q.shape[-1])  # [B, H, D]

    @staticmethod
    def _prefill(q, k_cache, v_cache, c: _PrefillChunk, scale: float, softcap: float | None,
                 scales: KVScales) -> torch.Tensor:
        k = from_cache(k_cache[c.blocks].flatten(0, 1)[: c.seq_len], q.dtype, scales[0])  # [seq_len, Hkv, D]
        v = from_cache(v_cache[c.blocks].flatten(0, 1)[: c.seq_len], q.dtype, scales[1])
        # 4-D with a batch of one: torch's CPU flash kernel takes only 4-D inputs (3-D falls back to the
        # slower math path; docs/engine.md#attention-backends).
        o = attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], c.mask, scale,
                   softcap)
        return o[0].transpose(0, 1)  # [n, H, D]


class CpuPagedAttention(TorchPagedAttention):
    """The CPU default: decode rows through the native kernel (decode_attention.cpp), which reads K/V straight
    from the paged cache, each row once, instead of gathering every context into a dense copy for SDPA.
    Multi-token chunks go through the native prefill kernel (prefill_attention.cpp: all of a step's chunks in one
    call, K/V from the cache, instead of a gather and an SDPA call per chunk) where it supports the dtype and
    head size (fp32 and bf16 at every instruction-set level: AVX-512 intrinsics, or the portable path in the
    avx2 and default builds; head size 64, 128 or 256), else through the torch backend's SDPA. Both kernels also
    read a bf16 cache under fp32 queries (kv_cache_dtype="bfloat16" with a float32 model), widening K/V to fp32 as
    they read them. What both kernels gain over SDPA is in docs/engine.md#attention-backends."""

    name = "cpu"

    def __init__(self, sliding_window: int | None = None):
        super().__init__(sliding_window)
        self.kernel = cpu_native.load()
        if self.kernel is None:
            raise ValueError("attention_backend 'cpu' needs the CPU decode kernel, which did not build here "
                             "(see the warning above); use 'torch'")
        self.prefill_dtypes = {getattr(torch, name) for name in getattr(self.kernel, "prefill_dtypes", ())}
        self.prefill_head_sizes = set(getattr(self.kernel, "prefill_head_sizes", ()))

    def prepare(self, meta: AttentionMetadata) -> None:
        super().prepare(meta)
        plan = meta.backend_data
        chunks = plan.layout.chunks
        if chunks and self.prefill_dtypes:  # window-free: every layer's window is a kernel argument
            device, bs = meta.block_tables.device, meta.block_size
            idx = torch.tensor([i for i, _, _ in chunks], device=device)
            width = max(-(-seq_len // bs) for _, _, seq_len in chunks)
            plan.native_prefill = _NativePrefill(
                meta.block_tables.index_select(0, idx)[:, :width].int().contiguous(),
                torch.tensor([plan.layout.qsl[i] for i, _, _ in chunks], dtype=torch.int32, device=device),
                torch.tensor([n for _, n, _ in chunks], dtype=torch.int32, device=device),
                torch.tensor([seq_len for _, _, seq_len in chunks], dtype=torch.int32, device=device))

    def _attend_prefills(self, q, k_cache, v_cache, plan: _Plan, prefills: list[_PrefillChunk], out: torch.Tensor,
                         scale: float, window: int | None, softcap: float | None, scales: KVScales) -> None:
        unit = plan.native_prefill
        if unit is None or q.dtype not in self.prefill_dtypes or q.shape[-1] not in self.prefill_head_sizes \
                or not native_reads(q.dtype, k_cache.dtype):
            units = plan.other_windows.get(window)
            if units is None:  # SDPA's chunks: built once per step and window, on first use
                chunks_only = replace(plan.layout, dec_rows=[])
                units = plan.other_windows[window] = (plan.decodes, super()._units(chunks_only, window)[1])
            return super()._attend_prefills(q, k_cache, v_cache, plan, units[1], out, scale, window, softcap, scales)
        if q.stride(-1) != 1 or q.stride(1) != q.shape[-1]:  # rows may be strided; each row's heads may not
            q = q.contiguous()
        self.kernel.paged_prefill(q, k_cache, v_cache, unit.blocks, unit.q_start, unit.q_len, unit.seq_len, scale,
                                  window or 0, softcap or 0.0, out)

    def _decode_plan(self, rows: list[tuple[int, int]], meta: AttentionMetadata, qsl: list[int],
                     window: int | None) -> list:
        """All one-token rows in one kernel call (it walks each row's own length: no grouping, no padding;
        the window is a kernel argument, so this unit serves every window)."""
        if not rows:
            return []
        device = meta.block_tables.device
        idx = torch.tensor([i for _, i in rows], device=device)
        return [_NativeDecode(torch.tensor([qsl[i] for _, i in rows], device=device),
                              meta.block_tables.index_select(0, idx)[:, :max(nb for nb, _ in rows)].contiguous(),
                              meta.seq_lens.index_select(0, idx).int())]

    def _units(self, layout: _Layout, window: int | None) -> tuple[list, None]:
        """The native decode unit; SDPA's prefill chunks (and their masks) are built only for a layer the prefill
        kernel cannot serve (`_attend_prefills`)."""
        return self._decode_plan(layout.dec_rows, layout.meta, layout.qsl, window), None

    def _units_for(self, plan: _Plan, window: int | None) -> tuple[list, None]:
        return plan.decodes, None  # both native units take the window as a kernel argument

    @staticmethod
    def decode_unit(meta: AttentionMetadata) -> _NativeDecode | None:
        """The step's one native decode unit when every row is a one-token decode (prepared by `prepare`), else
        None: the condition for a step taken from qkv in one call (decode_qkv; engine/cpu/decode_stack.py)."""
        plan = meta.backend_data
        if plan is None or plan.layout.chunks or len(plan.decodes) != 1:
            return None
        return plan.decodes[0]

    def decode_qkv(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, layer: LayerAttention | None,
                   heads: int, kv_heads: int) -> torch.Tensor | None:
        """A decode-only step's attention for one layer straight from its qkv projection [T, (H + 2 Hkv) D], in one
        kernel call (decode_attention.cpp's decode_attend: q and k rotated in place with `rope`'s tables unless it
        is None, K/V stored, paged decode): [T, H * D], what Attention.attend's eager path computes, bit for bit.
        None, with nothing done, where that path is needed: a step with a multi-token chunk, or a cache in another
        dtype than qkv's."""
        g = self.decode_unit(meta)
        if g is None or qkv.dtype != k_cache.dtype or qkv.stride(1) != 1:
            return None
        window = self.sliding_window if layer is None else layer.sliding_window
        softcap = None if layer is None else layer.softcap
        cos, sin = rope if rope is not None else (None, None)
        return self.kernel.decode_attend(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, g.blocks, g.lens, heads,
                                         kv_heads, scale, window or 0, softcap or 0.0)

    def _decode(self, q, k_cache, v_cache, g: _NativeDecode, scale: float, window: int | None,
                softcap: float | None, scales: KVScales) -> torch.Tensor:
        """(A CPU cache is never fp8, so `scales` are not read: engine/kv_dtype.py refuses fp8 on cpu.)"""
        return self.kernel.paged_decode(q.contiguous(), k_cache, v_cache, g.blocks, g.lens, scale, window or 0,
                                        softcap or 0.0)


@dataclass(slots=True)
class _NativePrefill:
    blocks: torch.Tensor  # [chunks, max_blocks] int32 block table rows
    q_start: torch.Tensor  # [chunks] int32: each chunk's first row in the step
    q_len: torch.Tensor  # [chunks] int32
    seq_len: torch.Tensor  # [chunks] int32: its context after the step (the chunk's own tokens included)


@dataclass(slots=True)
class _NativeDecode:
    tokens: torch.Tensor  # [b] token indices in the step
    blocks: torch.Tensor  # [b, max_blocks] int32 block table rows
    lens: torch.Tensor  # [b] int32


def _group_by_length(rows: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """(num_blocks, row) pairs, longest first, split into groups of similar length."""
    groups: list[list[tuple[int, int]]] = []
    for nb, row in sorted(rows, reverse=True):
        if not groups or (len(groups[-1]) >= GROUP_MIN_ROWS and nb < GROUP_SPLIT * groups[-1][0][0]):
            groups.append([])
        groups[-1].append((nb, row))
    return groups


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           softcap: float | None) -> torch.Tensor:
    """q [B, H, Lq, D] over k/v [B, Hkv, Lk, D] (query head i reads kv head i // (H / Hkv)); `mask` is a bool
    mask broadcastable to [B, 1, Lq, Lk] (True = attend), None = causal with Lq == Lk. Returns [B, H, Lq, D].
    Without a soft-cap this is SDPA; with one, HF Gemma 2's eager order: scores * scale, cap * tanh(s / cap),
    then the mask and an fp32 softmax."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=True)
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    scores = torch.matmul(q.reshape(b, hkv, h // hkv * lq, d), k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(b, hkv, h // hkv, lq, lk)  # [B, Hkv, G, Lq, Lk]
    if mask is None:
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
    elif mask.dim() == 4:
        mask = mask.unsqueeze(2)  # [B, 1, 1, Lq, Lk]
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs.view(b, hkv, -1, lk), v).view(b, h, lq, d)


def native_reads(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the CPU kernels read a cache of `cache_dtype` with queries of `q_dtype`: one dtype (fp32 or bf16),
    or fp32 queries over a bf16 cache (kv_cache_dtype="bfloat16" with a float32 model)."""
    return cache_dtype == q_dtype or (q_dtype == torch.float32 and cache_dtype == torch.bfloat16)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Write the step's new K/V rows into their paged slots (slot = block_id * block_size + offset), in the
    cache's dtype (fp8: x / scale, rounded and saturated; engine/kv_dtype.py)."""
    for x, cache, s in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        rows = bytes_view(cache.view(-1, *cache.shape[2:]))  # fp8 as bytes: CPU index_copy_ has no fp8 kernel
        rows.index_copy_(0, slot_mapping, bytes_view(to_cache(x, cache.dtype, s)))
