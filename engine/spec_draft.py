"""The draft model of speculative decoding (engine/spec_decode.py, method "draft_model"): a smaller checkpoint of
the target's vocabulary, run greedily at schedule time to propose up to K tokens for every speculating sequence.

It is built with the engine's own model code (engine/models) on the target's device and dtype. Its KV cache is a
tensor of its own, [draft layers, 2, num_pages, block_size, kv heads, head_dim], with as many pages as the target's
cache and read through the same block ids: each sequence's `block_table` (group 0 of a sliding-window target's KV
groups, one page per logical block; engine/kv_groups.py). So it needs no block accounting: every position it
writes lies in a block the sequence holds, below its computed length (the catch-up) or at a draft position (the
scheduler allocates those before proposing). Content it did not compute for a sequence is never read:
`Sequence.num_draft_computed` says how far it is valid, and the catch-up starts there.

A proposal is K forwards for the whole batch: the catch-up (each sequence's committed tokens past its
draft-computed length; more forwards when they pass max_num_batched_tokens; the last position's argmax is draft 1),
then K - 1 one-token steps, each feeding the previous step's argmax back on the device. The draft tokens come to
the host once, at the end. The forwards are eager (no CUDA graphs) and run through the target runner's executor
(`call`): after the target's forward and sampling in flight, on the compute stream on CUDA and on the forward
thread on CPU (inline where there is none), so the two models never run beside each other or share a buffer.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from engine.attention import AttentionMetadata, get_backend, resolve_backend
from engine.config import EngineConfig
from engine.models import build_model, load_hf_config, model_spec
from engine.models.decoder import ModelSpec
from engine.sequence import Sequence

logger = logging.getLogger(__name__)


class DraftModel:
    """The draft model's weights, its KV cache (allocate) and the scheduler's Propose (propose)."""

    def __init__(self, model_dir: str, config: EngineConfig, target: ModelSpec, device: torch.device,
                 dtype: torch.dtype, max_model_len: int):
        hf_config = load_hf_config(model_dir)
        spec = model_spec(hf_config)  # ValueError naming a family engine/models does not run
        if spec.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config model {model_dir!r}: the draft's vocab_size ({spec.vocab_size}) "
                             f"differs from the target's ({target.vocab_size}); a draft model must share the "
                             f"target's tokenizer")
        self.spec, self.device, self.dtype, self.model_dir = spec, device, dtype, model_dir
        self.block_size = config.block_size
        self.max_tokens = config.max_num_batched_tokens  # tokens in one draft forward, as in one target step
        name = resolve_backend(config.attention_backend, device, config.block_size,
                               softcap=spec.attn_softcap is not None)
        self.backend = get_backend(name, sliding_window=spec.sliding_window)  # its own: backends keep scratch
        self.model = build_model(model_dir, hf_config, spec, max_model_len, self.backend, dtype, device,
                                 cpu_onednn=config.cpu_onednn)
        self.kv_cache: torch.Tensor | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.executor = None

    @property
    def kv_bytes_per_page(self) -> int:
        """What the draft's cache adds to each page of the target's (the memory profile sizes both together)."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        s = self.spec
        return 2 * s.num_layers * self.block_size * s.num_kv_heads * s.head_dim * elem

    def allocate(self, num_pages: int, executor) -> None:
        """Its KV cache, as many pages as the target's; `executor`: the target runner's (its forwards queue there)."""
        s = self.spec
        shape = (s.num_layers, 2, num_pages, self.block_size, s.num_kv_heads, s.head_dim)
        try:
            self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        except RuntimeError as exc:  # torch.OutOfMemoryError, or the host allocator's failure
            raise ValueError(f"speculative_config model {self.model_dir!r}: its KV cache ({num_pages} pages, "
                             f"{num_pages * self.kv_bytes_per_page / 2**30:.2f} GiB) cannot be allocated on "
                             f"{self.device}: {exc}") from exc
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(s.num_layers)]
        self.executor = executor
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        logger.info("draft model %s: %d layers, weights %.1f MiB, KV cache %.1f MiB (%d pages)", self.model_dir,
                    s.num_layers, weights / 2**20, self.kv_cache.numel() * self.kv_cache.element_size() / 2**20,
                    num_pages)

    def propose(self, seqs: list[Sequence], rooms: list[int]) -> list[list[int]]:
        """engine.spec_decode.Propose: `rooms[i]` greedy draft tokens for each sequence, whose last token is
        committed and whose blocks hold every draft position."""
        return self.executor.call(self._propose, seqs, rooms)

    @torch.inference_mode()
    def _propose(self, seqs: list[Sequence], rooms: list[int]) -> list[list[int]]:
        drafts = torch.zeros(len(seqs), max(rooms), dtype=torch.long, device=self.device)  # [seqs, K]
        tables, dev_tables = self._tables(seqs, rooms)
        self._catch_up(seqs, tables, dev_tables, drafts)
        for j in range(1, max(rooms)):  # draft j + 1 from draft j, at position len(token_ids) + j - 1
            rows = [(i, len(s.token_ids) + j - 1, 1) for i, s in enumerate(seqs) if rooms[i] > j]
            self._forward(seqs, rows, [True] * len(rows), tables, dev_tables, drafts, j)
        host = drafts.tolist()  # sync-ok: the proposal's one wait for the device (the scheduler stages the ids)
        for seq, room in zip(seqs, rooms):
            seq.num_draft_computed = len(seq.token_ids) + room - 1  # KV of the last draft is never written
        return [row[:room] for row, room in zip(host, rooms)]

    def _tables(self, seqs: list[Sequence], rooms: list[int]) -> tuple[np.ndarray, torch.Tensor]:
        """The sequences' block tables as far as the proposal writes, [seqs, width] int32, on the host and device."""
        bs = self.block_size
        width = max(-(-(len(s.token_ids) + room - 1) // bs) for s, room in zip(seqs, rooms))
        tables = np.zeros((len(seqs), width), dtype=np.int32)
        for i, seq in enumerate(seqs):
            row = seq.block_table[:width]
            tables[i, :len(row)] = row
        return tables, self._upload(tables)

    def _catch_up(self, seqs: list[Sequence], tables: np.ndarray, dev_tables: torch.Tensor,
                  drafts: torch.Tensor) -> None:
        """Every sequence's committed tokens from its draft-computed length on, at most max_tokens a forward; the
        forward that reaches a sequence's last token gives its first draft."""
        todo = {i: min(s.num_draft_computed, len(s.token_ids) - 1) for i, s in enumerate(seqs)}  # next position
        while todo:
            rows, left = [], self.max_tokens
            for i, start in todo.items():
                n = min(len(seqs[i].token_ids) - start, left)
                if n < 1:
                    break
                rows.append((i, start, n))
                left -= n
            ends = [start + n == len(seqs[i].token_ids) for i, start, n in rows]
            self._forward(seqs, rows, ends, tables, dev_tables, drafts, 0)
            for (i, start, n), done in zip(rows, ends):
                if done:
                    del todo[i]
                else:
                    todo[i] = start + n

    def _forward(self, seqs: list[Sequence], rows: list[tuple[int, int, int]], samples: list[bool],
                 tables: np.ndarray, dev_tables: torch.Tensor, drafts: torch.Tensor, col: int) -> None:
        """One draft forward over `rows` ((sequence index, first position, positions)), writing its KV; each row
        that `samples` puts the argmax at its last position into drafts[i, col]. Column 0 reads the committed
        tokens, column j the drafts of column j - 1."""
        bs = self.block_size
        idx = np.array([i for i, _, _ in rows], dtype=np.int64)
        starts = np.array([p for _, p, _ in rows], dtype=np.int64)
        lens = np.array([n for _, _, n in rows], dtype=np.int64)
        ends = np.cumsum(lens)
        positions = np.arange(ends[-1], dtype=np.int64) + np.repeat(starts - (ends - lens), lens)
        slots = tables[np.repeat(idx, lens), positions // bs].astype(np.int64) * bs + positions % bs
        sampled = np.flatnonzero(samples)
        parts = [positions, slots, np.concatenate(([0], ends)), starts + lens, idx, ends[sampled] - 1, idx[sampled]]
        if col == 0:
            parts.append(np.concatenate([seqs[i].token_ids[p:p + n] for i, p, n in rows]).astype(np.int64))
        dev = self._upload_parts(parts)
        positions_d, slots_d, qsl_d, seq_lens_d, idx_d, sampled_d, sampled_seqs_d = dev[:7]
        ids = dev[7] if col == 0 else drafts[idx_d, col - 1]
        meta = AttentionMetadata(slot_mapping=slots_d, query_start_loc=qsl_d.int(), seq_lens=seq_lens_d.int(),
                                 block_tables=dev_tables.index_select(0, idx_d), block_size=bs,
                                 query_lens_host=lens.tolist(), seq_lens_host=(starts + lens).tolist())  # host memory
        self.backend.prepare(meta)
        hidden = self.model.sampled_hidden(ids, positions_d, self.kv_caches, meta, sampled_d)
        drafts[sampled_seqs_d, col] = self.model.logits(hidden).argmax(-1)

    def _upload_parts(self, parts: list[np.ndarray]) -> list[torch.Tensor]:
        """int64 arrays to the device in one copy; views of it in the same order."""
        flat = self._upload(np.concatenate(parts))
        return list(torch.split(flat, [len(p) for p in parts]))

    def _upload(self, values: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(values)
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)  # queued on the compute stream, no wait
