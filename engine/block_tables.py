"""Persistent block tables: one row per sequence that holds device blocks, mirrored host -> device by deltas.

A step's attention reads every row's block table. Staging each row every step cost per-row Python on the
engine thread and uploaded [rows, max_blocks] every step (8 MB at 128k context and 256 rows). Here a
sequence keeps one row of a persistent table while it holds blocks: the engine thread writes only the
entries added since the row was last staged into a numpy mirror (a decoding sequence adds one block every
block_size steps) and hands them to the step as deltas (flat index, block id). In stream order before the
forward, the device scatters the deltas into its copy of the table and gathers the step's rows into the
slot's fixed block-table buffer (engine/step_buffers.py), so a captured graph reads them at a fixed address.

Row lifetime. A row mirrors one `Sequence.block_table` list object. BlockManager.free and admit and the
scheduler's swap-in replace that list (never mutate a freed one), so a replaced list means a rewritten row.
A row is reclaimed only once its sequence can no longer be read by an in-flight step (released, or holding
no blocks with nothing in flight): the device copy of a row some launched step still reads is never
overwritten, and appended entries lie past what such a step reads.

Window groups (engine/kv_groups.py): a row then holds one table per KV group side by side, [rows, groups,
max_blocks] flattened: the full group's from `Sequence.block_table`, each sliding group's from its pages in
`Sequence.window_table`. They grow together (a new logical block gets a page in every group); the entries of
blocks that left the window stay as they are (stale: no query reads them).
"""

from __future__ import annotations

import numpy as np

from engine.sequence import Sequence


class BlockTables:
    """Host side of the persistent tables (pure numpy; the device copy is the runner's)."""

    def __init__(self, num_rows: int, max_blocks: int, window_groups: int = 0):
        self.num_rows = num_rows
        self.max_blocks = max_blocks
        self.window_groups = window_groups
        self.row_width = (1 + window_groups) * max_blocks  # one table per group, side by side
        self.host = np.zeros((num_rows, self.row_width), dtype=np.int32)
        self.width = [0] * num_rows  # entries of each row already handed out as deltas
        self._lists: list[list[int] | None] = [None] * num_rows
        self._owner: list[Sequence | None] = [None] * num_rows
        self._free = list(range(num_rows - 1, -1, -1))
        # Deltas not yet taken: runs of `count` flat indices from `first`; `_delta_len` is the counts' sum
        self._delta_first: list[int] = []
        self._delta_count: list[int] = []
        self._delta_len = 0

    def row(self, seq: Sequence) -> int:
        """`seq`'s row, current: entries it gained since it was last staged become deltas."""
        r = seq.table_row
        if r is None or self._owner[r] is not seq:
            r = self._allocate(seq)
        table = seq.block_table
        if self._lists[r] is not table:  # a new table (admission, swap-in, after a reset): rewrite the row
            self._lists[r] = table
            self.width[r] = 0
        old, new = self.width[r], len(table)
        if new > old:
            if new == old + 1:  # a decode step's new block: a scalar store (a slice assigned from a list is dearer)
                self.host[r, old] = table[old]
            else:
                self.host[r, old:new] = table[old:new]
            flat = r * self.row_width
            self._add_delta(flat + old, new - old)
            k, m = self.window_groups, self.max_blocks
            for g in range(k):  # group g + 1's pages of blocks old..new-1
                self.host[r, (1 + g) * m + old:(1 + g) * m + new] = seq.window_table[old * k + g:new * k:k]
                self._add_delta(flat + (1 + g) * m + old, new - old)
            self.width[r] = new
        return r

    def rows(self, seqs: list[Sequence]) -> list[int]:
        """row() of each sequence, in order; the common case (a row already current) checked inline."""
        owner, lists, width, out = self._owner, self._lists, self.width, []
        for seq in seqs:
            r, table = seq.table_row, seq.block_table
            if r is None or owner[r] is not seq or lists[r] is not table or width[r] != len(table):
                r = self.row(seq)
            out.append(r)
        return out

    def _add_delta(self, first: int, count: int) -> None:
        self._delta_first.append(first)
        self._delta_count.append(count)
        self._delta_len += count

    def take_deltas(self, idx: np.ndarray, val: np.ndarray) -> int:
        """Write the pending deltas as flat indices into the table and their block ids; return how many."""
        firsts, k = self._delta_first, self._delta_len
        if not k:
            return 0
        if k == len(firsts):  # one entry each (a decode step adds one block to many rows): no runs to expand
            idx[:k] = firsts
        else:
            counts = np.array(self._delta_count, dtype=np.int64)
            ends = np.cumsum(counts)
            idx[:k] = np.repeat(np.array(firsts, dtype=np.int64) - (ends - counts), counts) + np.arange(k)
        val[:k] = self.host.reshape(-1)[idx[:k]]
        firsts.clear()
        self._delta_count.clear()
        self._delta_len = 0
        return k

    def _allocate(self, seq: Sequence) -> int:
        if not self._free:
            self._reclaim()
        if not self._free:
            raise RuntimeError(f"all {self.num_rows} block-table rows are held by sequences still on the device")
        r = self._free.pop()
        self._owner[r] = seq
        self._lists[r] = None
        self.width[r] = 0
        seq.table_row = r
        return r

    def _reclaim(self) -> None:
        """Free the rows no launched step can read any more."""
        for r, seq in enumerate(self._owner):
            if seq is None:
                continue
            done = seq.released or (not seq.block_table and not seq.inflight_refs)
            if done or seq.table_row != r:
                self._owner[r] = None
                self._lists[r] = None
                if seq.table_row == r:
                    seq.table_row = None
                self._free.append(r)
