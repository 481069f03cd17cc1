"""Pure-PyTorch paged attention: gather K/V pages by block table, then SDPA.

Runs anywhere; it is the CPU backend and the reference the GPU kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class _PrefillChunk:
    token_start: int
    num_tokens: int
    seq_len: int
    blocks: torch.Tensor  # [ceil(seq_len / block_size)] block ids
    mask: torch.Tensor | None  # [num_tokens, seq_len] bool, None = plain causal from position 0


@dataclass(slots=True)
class _Plan:
    decode_tokens: torch.Tensor  # [num_decodes] token indices of single-token chunks
    decode_blocks: torch.Tensor  # [num_decodes, max_blocks]
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, max_blocks * block_size] bool
    prefills: list[_PrefillChunk]


class TorchPagedAttention:
    """Decode rows are attended in one batched SDPA call; each multi-token chunk gets its own call."""

    name = "torch"
    supports_graphs = False  # plans each step from host lists

    def __init__(self, sliding_window: int | None = None):
        self.sliding_window = sliding_window
        # Reused gather targets for decode K/V: a fresh multi-MB tensor per layer per step costs page
        # faults on CPU. Only the thread running forwards touches them.
        self._scratch: dict[str, torch.Tensor] = {}

    def prepare(self, meta: AttentionMetadata) -> None:
        """Build the per-step plan once; every layer reuses it."""
        device = meta.block_tables.device
        bs = meta.block_size
        qsl = [0]
        for n in meta.query_lens_host:
            qsl.append(qsl[-1] + n)
        dec_rows, prefills = [], []
        for i, (n, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
            if n == 1:
                dec_rows.append(i)
                continue
            blocks = meta.block_tables[i, : -(-seq_len // bs)]
            prefills.append(_PrefillChunk(qsl[i], n, seq_len, blocks, self._chunk_mask(n, seq_len, device)))
        rows = torch.tensor(dec_rows, dtype=torch.long, device=device)
        dec_blocks = meta.block_tables.index_select(0, rows).long()
        lens = meta.seq_lens.index_select(0, rows).long()
        key_pos = torch.arange(dec_blocks.shape[1] * bs, device=device)
        valid = key_pos[None, :] < lens[:, None]
        if self.sliding_window is not None:
            valid &= key_pos[None, :] >= lens[:, None] - self.sliding_window
        dec_tokens = torch.tensor([qsl[i] for i in dec_rows], dtype=torch.long, device=device)
        meta.backend_data = _Plan(dec_tokens, dec_blocks, valid[:, None, None, :], prefills)

    def _chunk_mask(self, n: int, seq_len: int, device: torch.device) -> torch.Tensor | None:
        if seq_len == n and self.sliding_window is None:
            return None
        q_pos = torch.arange(seq_len - n, seq_len, device=device)[:, None]
        k_pos = torch.arange(seq_len, device=device)[None, :]
        mask = k_pos <= q_pos
        if self.sliding_window is not None:
            mask &= k_pos > q_pos - self.sliding_window
        return mask

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D]. Returns [T, H, D]."""
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        plan: _Plan = meta.backend_data
        out = torch.empty_like(q)
        if plan.decode_tokens.numel():
            out[plan.decode_tokens] = self._decode(q.index_select(0, plan.decode_tokens), k_cache, v_cache,
                                                   plan, scale)
        for c in plan.prefills:
            out[c.token_start:c.token_start + c.num_tokens] = self._prefill(
                q[c.token_start:c.token_start + c.num_tokens], k_cache, v_cache, c, scale)
        return out

    def _gather(self, cache: torch.Tensor, blocks: torch.Tensor, name: str) -> torch.Tensor:
        """cache[blocks] as [B, max_blocks * block_size, Hkv, D], written into a reused buffer."""
        flat = blocks.reshape(-1)
        buf = self._scratch.get(name)
        if buf is None or buf.shape[0] < flat.numel() or buf.dtype != cache.dtype or buf.device != cache.device:
            buf = torch.empty(flat.numel(), *cache.shape[1:], dtype=cache.dtype, device=cache.device)
            self._scratch[name] = buf
        out = torch.index_select(cache, 0, flat, out=buf[: flat.numel()])
        return out.view(blocks.shape[0], -1, *cache.shape[2:])

    def _decode(self, q, k_cache, v_cache, plan: _Plan, scale: float) -> torch.Tensor:
        b = q.shape[0]
        k = self._gather(k_cache, plan.decode_blocks, "k")  # [B, max_blocks * block_size, Hkv, D]
        v = self._gather(v_cache, plan.decode_blocks, "v")
        o = F.scaled_dot_product_attention(q.view(b, -1, 1, q.shape[-1]), k.transpose(1, 2),
                                           v.transpose(1, 2), attn_mask=plan.decode_mask, scale=scale,
                                           enable_gqa=True)
        return o.view(b, -1, q.shape[-1])  # [B, H, D]

    @staticmethod
    def _prefill(q, k_cache, v_cache, c: _PrefillChunk, scale: float) -> torch.Tensor:
        k = k_cache[c.blocks].flatten(0, 1)[: c.seq_len]  # [seq_len, Hkv, D]
        v = v_cache[c.blocks].flatten(0, 1)[: c.seq_len]
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=c.mask, is_causal=c.mask is None, scale=scale,
                                           enable_gqa=True)
        return o.transpose(0, 1)  # [n, H, D]


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write the step's new K/V rows into their paged slots (slot = block_id * block_size + offset)."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)
