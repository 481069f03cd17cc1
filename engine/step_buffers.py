"""Fixed-address inputs of one slot's forward and sampling (pegainfer's "DecodeMeta").

Everything a step reads that changes from step to step — token ids, positions, slot mapping, query starts,
sequence lengths, the step's block-table rows, logits rows, the pending-token gather indices and the
sampling parameters — lives in device tensors allocated once per slot. The engine thread writes a step's
values into host staging arrays (pinned on CUDA) with a few vectorized numpy operations (`stage_step`), and
the step copies them over in stream order, so a CUDA graph captured on these buffers replays with new
values and nothing in the step is a Python scalar that a capture would freeze.

Block tables are persistent (engine/block_tables.py): a step stages its sequences' row ids and the table
entries added since they were last staged; on the device those deltas are scattered into the runner's
table and the step's rows gathered into this slot's `block_tables` buffer (`apply_tables`).

The CPU runs the same path: staging and device tensors are both host tensors and the upload is a plain copy.
Hazards: staging is rewritten only when its slot is free again, i.e. after the commit that read the slot,
which comes after the step's uploads completed (they precede its forward in stream order).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from engine.attention.metadata import AttentionMetadata
from engine.block_tables import BlockTables

# Two packed regions, each one host staging buffer (pinned on CUDA) and one device buffer with the same layout,
# so each goes over in a single copy: the step's inputs (uploaded before the forward), and the sampling
# parameters (uploaded at finalize). name -> (dtype, dimension it is sized by). The table deltas come last:
# their region is copied only as far as the step used it.
_STEP_FIELDS = {
    "seq_lens": (torch.int32, "seqs"), "query_start_loc": (torch.int32, "seqs+1"),
    "table_rows": (torch.int32, "seqs"),  # the step's rows of the persistent block table
    "logits_indices": (torch.long, "seqs"), "gather_dst": (torch.long, "seqs"), "gather_src": (torch.long, "seqs"),
    "input_ids": (torch.long, "tokens"), "positions": (torch.long, "tokens"), "slot_mapping": (torch.long, "tokens"),
    "table_deltas": (torch.int32, "deltas"),  # [entries, 2]: flat index into the table, block id
}
# With LoRA (engine/lora): each token's adapter slot (0 = none), read by every LoRA linear of the forward. Only
# engines with enable_lora have the field, so it costs the others nothing.
_LORA_FIELD = {"lora_slots": (torch.int32, "tokens")}
# With sliding-window KV groups: each token's slot in every sliding group, [window_groups, max_tokens] flattened.
_WINDOW_FIELD = {"window_slots": (torch.long, "window_tokens")}
_SAMPLING_FIELDS = {  # one per sampling row (see engine/sampler.py SamplingBatch)
    "temperature": (torch.float32, "seqs"), "greedy": (torch.bool, "seqs"), "top_k": (torch.long, "seqs"),
    "top_p": (torch.float32, "seqs"), "min_p": (torch.float32, "seqs"),
}
_ALIGN = 64


def _step_fields(lora: bool, window: bool = False) -> dict:
    """The step region's fields; the LoRA and window slots go before the table deltas, which must stay last."""
    if not lora and not window:
        return _STEP_FIELDS
    fields = {k: v for k, v in _STEP_FIELDS.items() if k != "table_deltas"}
    return {**fields, **(_LORA_FIELD if lora else {}), **(_WINDOW_FIELD if window else {}),
            "table_deltas": _STEP_FIELDS["table_deltas"]}


class _Region:
    """Typed views into one byte buffer on the host (staging) and one on the device, at the same offsets."""

    def __init__(self, fields: dict, sizes: dict, device: torch.device, pin: bool, with_device: bool):
        offsets, end = {}, 0
        for name, (dtype, dim) in fields.items():
            shape = (sizes[dim], 2) if dim == "deltas" else (sizes[dim],)
            nbytes = int(torch.tensor([], dtype=dtype).element_size() * torch.Size(shape).numel())
            offsets[name] = (end, dtype, shape, nbytes)
            end += -(-nbytes // _ALIGN) * _ALIGN
        self.nbytes = end
        self.host_bytes = torch.zeros(end, dtype=torch.uint8, pin_memory=pin)
        self.dev_bytes = torch.zeros(end, dtype=torch.uint8, device=device) if with_device else None
        self.offsets = offsets
        self.host = {n: self._view(self.host_bytes, *o) for n, o in offsets.items()}
        self.dev = {n: self._view(self.dev_bytes, *o) for n, o in offsets.items()} if with_device else {}

    @staticmethod
    def _view(buf: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple, nbytes: int) -> torch.Tensor:
        return buf[offset:offset + nbytes].view(dtype).view(shape)

    def upload(self, nbytes: int) -> None:
        """Copy the first `nbytes` of staging to the device: one copy (non-blocking from pinned memory)."""
        self.dev_bytes[:nbytes].copy_(self.host_bytes[:nbytes], non_blocking=True)


@dataclass(frozen=True, slots=True)
class BufferLimits:
    max_tokens: int  # tokens in one step (token budget, at least max_num_seqs for padded decode graphs)
    max_seqs: int  # sequences (= sampling rows) in one step
    max_blocks: int  # block-table width: ceil(max_model_len / block_size)
    lora: bool = False  # steps carry each token's LoRA adapter slot (the lora_slots field)
    # Sliding-window KV groups (engine/kv_groups.py): a row holds 1 + window_groups tables, and every token a
    # slot in each sliding group (the window_slots field) besides slot_mapping's in the full group.
    window_groups: int = 0
    slots: int = 2  # step slots: how many steps may be in flight at once (EngineConfig.pipeline_depth)

    @property
    def table_rows(self) -> int:
        """Rows of the persistent block table: the running sequences, plus those the other in-flight steps still
        read after they left (finished or preempted), plus one row that padding rows point at."""
        return self.slots * self.max_seqs + 1


@dataclass(slots=True)
class StagedStep:
    """A staged step as plain arrays (what a pipeline stage receives): each field's used prefix, plus the
    per-row lengths the CPU attention backend plans with."""

    arrays: dict[str, np.ndarray]
    num_tokens: int
    num_seqs: int
    num_rows: int
    num_gather: int
    num_deltas: int
    width: int


class StepBuffers:
    """Device tensors a step reads, their host staging, and the sizes of the step staged last."""

    def __init__(self, limits: BufferLimits, device: torch.device, transfer=None):
        """transfer: None to copy staging into device tensors; or a callable(nbytes, copies) that is told
        what each upload would move instead (a simulated device prices it; no device tensors exist)."""
        self.limits = limits
        self.transfer = transfer
        pin, real = device.type == "cuda", transfer is None
        kw = limits.window_groups
        groups = 1 + kw
        sizes = {"tokens": limits.max_tokens, "seqs": limits.max_seqs, "seqs+1": limits.max_seqs + 1,
                 "deltas": limits.max_seqs * limits.max_blocks * groups, "window_tokens": kw * limits.max_tokens}
        self.lora = limits.lora
        self.window_groups = kw
        self.lora_active = False  # the staged step has a token under an adapter (set by stage_step)
        self.step = _Region(_step_fields(limits.lora, kw > 0), sizes, device, pin, real)
        self.sampling = _Region(_SAMPLING_FIELDS, sizes, device, pin, real)
        self.host = {**self.step.host, **self.sampling.host}
        self.dev = {**self.step.dev, **self.sampling.dev}
        self._deltas_at = self.step.offsets["table_deltas"][0]  # the step region's used part ends in them
        # The step's block-table rows, gathered on the device from the persistent table (apply_tables).
        self.block_tables = torch.zeros(limits.max_seqs, groups * limits.max_blocks, dtype=torch.int32,
                                        device=device) if real else None
        self.np = {name: t.numpy() for name, t in self.host.items()}  # host views written by stage_step()
        if kw:  # [group, token] views
            self.np["window_slots"] = self.np["window_slots"].reshape(kw, limits.max_tokens)
            if real:
                self.dev["window_slots"] = self.dev["window_slots"].view(kw, limits.max_tokens)
        self.gathered = torch.zeros(limits.max_seqs, dtype=torch.long, device=device) if real else None
        self.num_tokens = self.num_seqs = self.num_rows = self.num_gather = self.num_deltas = self.width = 0
        self.query_lens_host: list[int] = []
        self.seq_lens_host: list[int] = []
        self._views: dict[tuple[str, int], torch.Tensor] = {}  # put()'s device (or host) views, by field and rows
        self._arange = np.arange(limits.max_seqs + 1, dtype=np.int64)  # a decode step's query_start_loc

    # ---- host side (engine thread) ----------------------------------------------------------------------
    def stage_step(self, chunks, tables: BlockTables, block_size: int, pad_to: int | None = None,
                   forks=(), pad_seqs: int | None = None, decode: bool | None = None) -> None:
        """Stage a step's chunks (engine.scheduler.ScheduledChunk): what only the sequences know (their table
        rows, known token ids, pending tokens) gathered in Python (list comprehensions for a decode step, a loop
        over the chunks for any other), numpy for the rest. A chunk's last position may be a token an earlier
        step sampled that is still on the device: it is gathered there (gather_dst/src) from the sequence's
        `pending_src` (that step's slot and row).

        pad_to: a CUDA-graph batch size; the rows past the real ones become empty sequences (slot -1,
        seq_len 0) that write no KV and attend to nothing. With pad_seqs, a mixed-step graph's token count and
        pad_seqs its sequence count (_pad).
        forks: sampling rows that compute nothing (n > 1 siblings, engine.scheduler.Scheduler._fork): each
        reads the logits of its parent chunk's last position, after the chunks' own rows.
        decode: whether every chunk is one position that samples, with no forks (the caller knows from its step's
        counts; None: found here)."""
        n, lim = self.np, self.limits
        s = len(chunks)
        seqs = [c.seq for c in chunks]
        rows = tables.rows(seqs)
        if decode is None:
            decode = not forks and False not in [c.samples and c.num_tokens == 1 for c in chunks]
        if decode:  # decodes only: numpy per field
            lens, t = [1] * s, s
            starts, ids, logits, gdst, gsrc = self._decode_rows(chunks, seqs)
        else:
            lens = [c.num_tokens for c in chunks]
            t = sum(lens)
            starts, ids, logits, gdst, gsrc = self._chunk_rows(chunks, forks)
        if t > lim.max_tokens or len(logits) > lim.max_seqs or (pad_to or 0) > lim.max_tokens \
                or (pad_seqs or pad_to or 0) > lim.max_seqs:
            raise ValueError(f"step of {t} tokens / {s} sequences exceeds the slot buffers {lim}")
        if self.lora:
            slots = np.fromiter((c.seq.lora_slot for c in chunks), np.int32, s)
            n["lora_slots"][:t] = np.repeat(slots, lens)
            self.lora_active = bool(slots.any())  # host memory: no row uses an adapter -> eager steps skip LoRA
        # (A decode step, the common one, takes the fewest numpy calls: each costs microseconds on a busy loop.)
        starts_a = np.asarray(starts, dtype=np.int64)  # (a decode step's is an array already)
        rows_a = np.array(rows, dtype=np.int64)
        if t == s:  # one token per sequence (decode): its position is the chunk's start
            positions, tok_rows = starts_a, rows_a
            seq_lens = starts_a + 1
            n["query_start_loc"][:s + 1] = self._arange[:s + 1]
        else:
            lens_a = np.array(lens, dtype=np.int64)
            qsl = np.cumsum(lens_a)
            positions = np.arange(t, dtype=np.int64) + np.repeat(starts_a - (qsl - lens_a), lens_a)
            tok_rows = np.repeat(rows_a, lens_a)
            seq_lens = starts_a + lens_a
            n["query_start_loc"][0] = 0
            n["query_start_loc"][1:s + 1] = qsl
        n["input_ids"][:t] = ids
        n["positions"][:t] = positions
        col, offset = np.divmod(positions, block_size)
        n["slot_mapping"][:t] = tables.host[tok_rows, col] * block_size + offset
        if self.window_groups:
            m = self.limits.max_blocks
            cols = (1 + np.arange(self.window_groups))[:, None] * m + col[None, :]
            n["window_slots"][:, :t] = tables.host[tok_rows[None, :], cols] * block_size + offset[None, :]
        n["seq_lens"][:s] = seq_lens
        n["table_rows"][:s] = rows_a
        n["logits_indices"][:len(logits)] = logits
        n["gather_dst"][:len(gdst)] = gdst
        n["gather_src"][:len(gsrc)] = gsrc
        deltas = n["table_deltas"]
        self.num_deltas = tables.take_deltas(deltas[:, 0], deltas[:, 1])
        self.num_tokens, self.num_seqs, self.num_rows, self.num_gather = t, s, len(logits), len(gdst)
        self.width = int(-(-seq_lens.max() // block_size)) if s else 0
        self.query_lens_host, self.seq_lens_host = lens, seq_lens.tolist()  # host memory
        if pad_to is not None and (pad_seqs is not None or pad_to > s):
            self._pad(t, s, pad_to, pad_to if pad_seqs is None else pad_seqs)

    @staticmethod
    def _decode_rows(chunks, seqs) -> tuple:
        """(starts, input ids, logits rows, gather dst, gather src) of a step of one-token sampling chunks: a
        few list comprehensions and numpy instead of a Python loop body per row. A row's token is known on the
        host, or still on the device (sampled by the previous step: gathered there)."""
        s = len(chunks)
        starts = np.array([c.start for c in chunks], dtype=np.int64)
        on_device = starts >= np.array([len(q.token_ids) for q in seqs], dtype=np.int64)
        ids = np.zeros(s, dtype=np.int64)
        if on_device.all():  # the usual decode step of a pipelined loop: every row's token is the last step's
            every = np.arange(s)
            return starts, ids, every, every, [q.pending_src for q in seqs]
        gdst = np.flatnonzero(on_device)
        known = np.flatnonzero(~on_device).tolist()  # host memory
        ids[known] = [seqs[i].token_ids[chunks[i].start] for i in known]
        gsrc = [seqs[i].pending_src for i in gdst.tolist()]  # host memory
        return starts, ids, np.arange(s), gdst, gsrc

    @staticmethod
    def _chunk_rows(chunks, forks) -> tuple:
        """_decode_rows for any step: prompt chunks, chunks verifying drafts, n > 1 forks."""
        starts, ids, gdst, gsrc, logits = [], [], [], [], []
        t = 0
        parent_rows = {}  # id(chunk) -> its logits row, for forks
        for c in chunks:
            seq, start, k = c.seq, c.start, c.num_tokens
            starts.append(start)
            known = len(seq.token_ids)
            end = start + k
            if c.draft:  # its committed last token, then the drafts; every position is a sampling row
                ids.append(seq.token_ids[start])
                ids.extend(c.draft)
                logits.extend(range(t, t + k))
                t += k
                continue
            if end <= known:
                if k == 1:
                    ids.append(seq.token_ids[start])
                else:
                    ids.extend(seq.token_ids[start:end])
            else:  # the last position is a token an uncommitted step sampled, still on the device (with three
                # slots the token before it may be one too, committed or not: the chunk then starts at the last)
                if k > 1:
                    ids.extend(seq.token_ids[start:end - 1])
                ids.append(0)
                gdst.append(t + k - 1)
                gsrc.append(seq.pending_src)
            t += k
            if c.samples:
                if forks:
                    parent_rows[id(c)] = len(logits)
                logits.append(t - 1)
        if forks:
            logits += [logits[parent_rows[id(f.parent)]] for f in forks]
        return starts, ids, logits, gdst, gsrc

    def stage_dummy(self, num_tokens: int, num_seqs: int, block_size: int) -> None:
        """A synthetic step for the memory profiling pass (engine/memory.py): `num_seqs` sequences sharing
        `num_tokens`, every one sampled, all writing and reading block 0 (the runner's one-block scratch
        cache: the spare table row is all zeros)."""
        per = max(1, num_tokens // num_seqs)
        t, s, n = per * num_seqs, num_seqs, self.np
        n["input_ids"][:t] = 0
        n["positions"][:t] = np.tile(np.arange(per), s)
        n["slot_mapping"][:t] = n["positions"][:t] % block_size
        if self.window_groups:
            n["window_slots"][:, :t] = n["slot_mapping"][:t]
        n["seq_lens"][:s] = per
        n["query_start_loc"][:s + 1] = np.arange(s + 1) * per
        n["table_rows"][:s] = self.limits.table_rows - 1
        n["logits_indices"][:s] = np.arange(1, s + 1) * per - 1
        if self.lora:
            n["lora_slots"][:t] = 0
            self.lora_active = True  # the profile measures the LoRA path
        self.num_tokens, self.num_seqs, self.num_rows, self.num_gather, self.num_deltas = t, s, s, 0, 0
        self.width = -(-per // block_size)
        self.query_lens_host, self.seq_lens_host = [per] * s, [per] * s

    def stage_padding(self, size: int, tokens: int | None = None) -> None:
        """A step of padding only (graph capture: writes no KV, attends to nothing): `size` one-token rows, or
        with `tokens` (a mixed-step graph) `size` empty sequences and `tokens` positions of none."""
        self.num_tokens = self.num_seqs = self.num_rows = self.num_gather = self.num_deltas = self.width = 0
        self.query_lens_host, self.seq_lens_host = [], []
        self.np["query_start_loc"][0] = 0
        self._pad(0, 0, size if tokens is None else tokens, size)

    def _pad(self, t: int, s: int, tokens: int, seqs: int) -> None:
        """Pad a staged step of t tokens and s sequences to a graph's `tokens` and `seqs` (engine/cuda_graphs.py).
        The padding positions write no KV. A decode graph (tokens == seqs): each padding row is a sequence of one
        token and no context. A mixed-step graph: the padding positions belong to no sequence (the attention
        kernel computes no row for them; what the layers make of their rows is never read), the padding
        sequences have no tokens and no context, and the logits rows past the step's own read position 0."""
        n = self.np
        n["input_ids"][t:tokens] = 0
        n["positions"][t:tokens] = 0
        n["slot_mapping"][t:tokens] = -1
        if self.window_groups:
            n["window_slots"][:, t:tokens] = -1
        if self.lora:
            n["lora_slots"][t:tokens] = 0
        n["seq_lens"][s:seqs] = 0
        n["table_rows"][s:seqs] = self.limits.table_rows - 1  # the spare row: never written, never read
        if tokens == seqs:
            n["query_start_loc"][s + 1:seqs + 1] = np.arange(t + 1, t + 1 + seqs - s)
        else:
            n["query_start_loc"][s + 1:seqs + 1] = t
            n["logits_indices"][self.num_rows:seqs] = 0
        self.num_tokens, self.num_seqs = tokens, seqs

    def snapshot(self) -> StagedStep:
        """The staged step as arrays (copies of the used prefixes), to send to a pipeline stage or a TP rank."""
        arrays = {name: self.np[name][:c].copy() for name, c in self._counts().items()}
        if self.window_groups:
            arrays["window_slots"] = self.np["window_slots"][:, :self.num_tokens].copy()
        return StagedStep(arrays, self.num_tokens, self.num_seqs, self.num_rows, self.num_gather, self.num_deltas,
                          self.width)

    def load(self, step: StagedStep) -> None:
        """Stage what another process staged (a pipeline stage receiving the driver's StagedStep)."""
        for name, values in step.arrays.items():
            if name == "window_slots":
                self.np[name][:, :values.shape[1]] = values
            else:
                self.np[name][:len(values)] = values
        self.num_tokens, self.num_seqs, self.num_rows = step.num_tokens, step.num_seqs, step.num_rows
        self.num_gather, self.num_deltas, self.width = step.num_gather, step.num_deltas, step.width
        qsl = step.arrays["query_start_loc"]
        self.query_lens_host = np.diff(qsl).tolist()  # host memory
        self.seq_lens_host = step.arrays["seq_lens"].tolist()  # host memory

    def _counts(self) -> dict[str, int]:
        t, s = self.num_tokens, self.num_seqs
        counts = {"input_ids": t, "positions": t, "slot_mapping": t, "seq_lens": s, "query_start_loc": s + 1,
                  "logits_indices": self.num_rows, "gather_dst": self.num_gather, "gather_src": self.num_gather,
                  "table_rows": s, "table_deltas": self.num_deltas}
        if self.lora:
            counts["lora_slots"] = t
        return counts

    # ---- device side (in stream order, before the forward) -------------------------------------------------
    def upload(self) -> None:
        """Copy the staged step to the device buffers: one copy, non-blocking from pinned memory on CUDA,
        of the step region up to the last table delta used."""
        nbytes = self._deltas_at + 8 * self.num_deltas
        if self.transfer is not None:
            self.transfer(nbytes, 1)
        else:
            self.step.upload(nbytes)

    def apply_tables(self, table: torch.Tensor, full_width: bool) -> None:
        """Scatter the step's table deltas into the persistent device `table` [rows, max_blocks], then gather
        the step's rows into `block_tables`: all columns for a graph replay (its kernels were captured on
        the full buffer), else only as many as the step's longest sequence needs."""
        d, k, s = self.dev, self.num_deltas, self.num_seqs
        if k:
            deltas = d["table_deltas"][:k]
            table.view(-1).index_put_((deltas[:, 0],), deltas[:, 1])
        if not s:
            return
        if full_width:
            torch.index_select(table, 0, d["table_rows"][:s], out=self.block_tables[:s])
        else:
            w, g = max(self.width, 1), 1 + self.window_groups
            if g == 1:
                torch.index_select(table[:, :w], 0, d["table_rows"][:s],
                                   out=self.block_tables.view(-1)[:s * w].view(s, w))
            else:  # each group's first w entries: [s, groups, w]
                torch.index_select(table.view(table.shape[0], g, -1)[:, :, :w], 0, d["table_rows"][:s],
                                   out=self.block_tables.view(-1)[:s * g * w].view(s, g, w))

    def gather_pending(self, sampled: torch.Tensor) -> None:
        """input_ids[dst] = sampled[src]: tokens earlier steps sampled, read on the device (`sampled`: every slot's
        sampled rows, slot after slot; a source is slot index * max_seqs + row, Sequence.pending_src)."""
        g = self.num_gather
        if g:
            d = self.dev
            torch.index_select(sampled, 0, d["gather_src"][:g], out=self.gathered[:g])
            d["input_ids"].index_copy_(0, d["gather_dst"][:g], self.gathered[:g])

    def metadata(self, block_size: int, full_width: bool = False, host_lists: bool = True) -> AttentionMetadata:
        """Views of the device buffers for the staged step. Eager steps get the per-row lengths as host lists
        (the torch backend plans with them); a graph step gets none, so nothing can depend on them."""
        t, s, d = self.num_tokens, self.num_seqs, self.dev
        g = 1 + self.window_groups
        if full_width:
            tables = self.block_tables[:s].view(s, g, -1)
        else:
            w = max(self.width, 1)
            tables = self.block_tables.view(-1)[:s * g * w].view(s, g, w)
        meta = AttentionMetadata(
            slot_mapping=d["slot_mapping"][:t], query_start_loc=d["query_start_loc"][:s + 1],
            seq_lens=d["seq_lens"][:s], block_tables=tables[:, 0], block_size=block_size,
            query_lens_host=list(self.query_lens_host) if host_lists else [],
            seq_lens_host=list(self.seq_lens_host) if host_lists else [])
        if g > 1:  # one view per sliding group: its table column and its slots, the rest shared
            meta.groups = [meta] + [replace(meta, slot_mapping=d["window_slots"][i, :t], block_tables=tables[:, 1 + i])
                                    for i in range(self.window_groups)]
        return meta

    # ---- sampling parameters ---------------------------------------------------------------------------------
    def put(self, name: str, values, k: int) -> torch.Tensor:
        """Stage one per-row sampling field (k values, or one scalar for all k rows); returns the device view
        (a host view on a simulated device), valid once upload_sampling() has been enqueued."""
        self.np[name][:k] = values
        view = self._views.get((name, k))
        if view is None:  # made once per field and row count: a torch slice costs tens of us on a busy loop
            view = self._views[name, k] = (self.host if self.transfer is not None else self.dev)[name][:k]
        return view

    def upload_sampling(self) -> None:
        """Copy the staged sampling parameters to the device (one copy; enqueue before the sampling)."""
        if self.transfer is not None:
            self.transfer(self.sampling.nbytes, 1)
        else:
            self.sampling.upload(self.sampling.nbytes)
