"""Fixed-address inputs of one slot's forward and sampling (pegainfer's "DecodeMeta").

Everything a step reads that changes from step to step — token ids, positions, slot mapping, query starts,
sequence lengths, block tables, logits rows, the pending-token gather indices and the sampling parameters —
lives in device tensors allocated once per slot. The engine thread writes a step's values into host staging
tensors (pinned on CUDA) and the step copies them over in stream order, so a CUDA graph captured on these
buffers replays with new values and nothing in the step is a Python scalar that a capture would freeze.

The CPU runs the same path: staging and device tensors are both host tensors and the upload is a plain copy.
Hazards: staging is rewritten only when its slot is free again, i.e. after the commit that read the slot,
which comes after the step's uploads completed (they precede its forward in stream order).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.metadata import AttentionMetadata

# name -> (dtype, dimension it is sized by)
_FIELDS = {
    "input_ids": (torch.long, "tokens"), "positions": (torch.long, "tokens"),
    "slot_mapping": (torch.long, "tokens"),
    "seq_lens": (torch.int32, "seqs"), "query_start_loc": (torch.int32, "seqs+1"),
    "logits_indices": (torch.long, "seqs"), "gather_dst": (torch.long, "seqs"), "gather_src": (torch.long, "seqs"),
    # sampling parameters, one per sampling row (see engine/sampler.py SamplingBatch)
    "temperature": (torch.float32, "seqs"), "greedy": (torch.bool, "seqs"), "top_k": (torch.long, "seqs"),
    "top_p": (torch.float32, "seqs"), "min_p": (torch.float32, "seqs"),
}


@dataclass(frozen=True, slots=True)
class BufferLimits:
    max_tokens: int  # tokens in one step (token budget, at least max_num_seqs for padded decode graphs)
    max_seqs: int  # sequences (= sampling rows) in one step
    max_blocks: int  # block-table width: ceil(max_model_len / block_size)


class StepBuffers:
    """Device tensors a step reads, their host staging, and the sizes of the step staged last."""

    def __init__(self, limits: BufferLimits, device: torch.device, transfer=None):
        """transfer: None to copy staging into device tensors; or a callable(nbytes, copies) that is told
        what each upload would move instead (a simulated device prices it; no device tensors exist)."""
        self.limits = limits
        self.transfer = transfer
        pin = device.type == "cuda"
        sizes = {"tokens": limits.max_tokens, "seqs": limits.max_seqs, "seqs+1": limits.max_seqs + 1}
        self.dev: dict[str, torch.Tensor] = {}
        self.host: dict[str, torch.Tensor] = {}
        for name, (dtype, dim) in _FIELDS.items():
            self._add(name, (sizes[dim],), dtype, device, pin)
        self._add("block_tables", (limits.max_seqs, limits.max_blocks), torch.int32, device, pin)
        self.np = {name: t.numpy() for name, t in self.host.items()}  # host views written by stage()
        self._row_bytes = {name: t[0].numel() * t.element_size() for name, t in self.host.items()}
        self.gathered = torch.zeros(limits.max_seqs, dtype=torch.long, device=device) if transfer is None else None
        self.num_tokens = self.num_seqs = self.num_rows = self.num_gather = self.width = 0

    def _add(self, name: str, shape: tuple, dtype: torch.dtype, device: torch.device, pin: bool) -> None:
        self.host[name] = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        if self.transfer is None:
            self.dev[name] = torch.zeros(shape, dtype=dtype, device=device)

    # ---- host side (engine thread) ----------------------------------------------------------------------
    def stage(self, h, pad_to: int | None = None) -> None:
        """Write a step's host inputs (engine.slot.HostInputs) into staging.

        pad_to: a CUDA-graph batch size; the rows past the real ones become empty sequences (slot -1,
        seq_len 0) that write no KV and attend to nothing."""
        t, s = len(h.input_ids), len(h.seq_lens)
        lim = self.limits
        if t > lim.max_tokens or s > lim.max_seqs or (pad_to or 0) > min(lim.max_tokens, lim.max_seqs):
            raise ValueError(f"step of {t} tokens / {s} sequences exceeds the slot buffers {lim}")
        n = self.np
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "logits_indices",
                     "gather_dst", "gather_src"):
            values = getattr(h, name)
            n[name][:len(values)] = values
        n["query_start_loc"][0] = 0
        np.cumsum(h.query_lens, out=n["query_start_loc"][1:s + 1])
        width = 0
        for row, table in enumerate(h.block_tables):
            n["block_tables"][row, :len(table)] = table
            width = max(width, len(table))
        self.num_tokens, self.num_seqs, self.width = t, s, width
        self.num_rows, self.num_gather = len(h.logits_indices), len(h.gather_dst)
        if pad_to is not None and pad_to > s:
            self._pad(t, s, pad_to)

    def _pad(self, t: int, s: int, size: int) -> None:
        n = self.np
        n["input_ids"][t:size] = 0
        n["positions"][t:size] = 0
        n["slot_mapping"][t:size] = -1
        n["seq_lens"][s:size] = 0
        n["query_start_loc"][s + 1:size + 1] = np.arange(t + 1, t + 1 + size - s)
        self.num_tokens, self.num_seqs = t + size - s, size

    # ---- device side (in stream order, before the forward) -------------------------------------------------
    def upload(self) -> None:
        """Copy the staged step to the device buffers (non-blocking from pinned memory on CUDA)."""
        t, s = self.num_tokens, self.num_seqs
        counts = {"input_ids": t, "positions": t, "slot_mapping": t, "seq_lens": s, "query_start_loc": s + 1,
                  "block_tables": s, "logits_indices": self.num_rows, "gather_dst": self.num_gather,
                  "gather_src": self.num_gather}
        if self.transfer is not None:
            used = [(name, c) for name, c in counts.items() if c]
            self.transfer(sum(c * self._row_bytes[name] for name, c in used), len(used))
            return
        for name, count in counts.items():
            if count:
                self.dev[name][:count].copy_(self.host[name][:count], non_blocking=True)

    def gather_pending(self, prev_sampled: torch.Tensor) -> None:
        """input_ids[dst] = prev_sampled[src]: tokens the previous step sampled, read on the device."""
        g = self.num_gather
        if g:
            d = self.dev
            torch.index_select(prev_sampled, 0, d["gather_src"][:g], out=self.gathered[:g])
            d["input_ids"].index_copy_(0, d["gather_dst"][:g], self.gathered[:g])

    def metadata(self, block_size: int, h=None, full_width: bool = False) -> AttentionMetadata:
        """Views of the device buffers for the staged step. The host lists are given only to eager steps
        (the torch backend plans with them); a graph step gets none, so nothing can depend on them."""
        t, s, d = self.num_tokens, self.num_seqs, self.dev
        width = self.limits.max_blocks if full_width else max(self.width, 1)
        return AttentionMetadata(
            slot_mapping=d["slot_mapping"][:t], query_start_loc=d["query_start_loc"][:s + 1],
            seq_lens=d["seq_lens"][:s], block_tables=d["block_tables"][:s, :width], block_size=block_size,
            query_lens_host=list(h.query_lens) if h is not None else [],
            seq_lens_host=list(h.seq_lens) if h is not None else [])

    # ---- sampling parameters ---------------------------------------------------------------------------------
    def put(self, name: str, values: list) -> torch.Tensor:
        """Stage one per-row sampling field and enqueue its upload now; returns the device view."""
        k = len(values)
        self.np[name][:k] = values
        if self.transfer is not None:
            self.transfer(k * self._row_bytes[name], 1)
            return self.host[name][:k]
        dev = self.dev[name][:k]
        dev.copy_(self.host[name][:k], non_blocking=True)
        return dev
