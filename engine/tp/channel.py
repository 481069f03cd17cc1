"""A step's inputs from rank 0 to the other ranks of a tensor-parallel group, once per step.

What goes over (gloo broadcasts from rank 0): a fixed header of sizes (op, tokens, sequences, sampling rows,
table deltas, table width, payload bytes, one caller-defined count), then the used bytes of the step region of
rank 0's StepBuffers (engine/step_buffers.py: token ids, positions, slot mapping, query starts, sequence
lengths, block-table rows and deltas, logits rows), exactly as rank 0's forward reads them. The receiver
writes them into its own StepBuffers' device region and applies the table deltas to its copy of the
persistent block table (steps arrive in order, so the copies stay equal). Whatever else a step needs (the
tensor-parallel engine's copy-on-write pairs, a pipeline stage's incoming hidden states) the caller broadcasts
right after, sized by the header's last field.
"""

from __future__ import annotations

import torch

from engine.step_buffers import StepBuffers

STEP, STOP = 1, 2
_HEADER = 8  # op, num_tokens, num_seqs, num_rows, num_deltas, width, payload bytes, extra


class StepChannel:
    def __init__(self, comm):
        self.comm = comm
        self._header = torch.zeros(_HEADER, dtype=torch.long)
        self._np = self._header.numpy()  # host views: written in place each step

    def send(self, b: StepBuffers, extra: int = 0) -> None:
        """Rank 0: the staged, uploaded step in `b` to every rank."""
        nbytes = b.step.offsets["table_deltas"][0] + 8 * b.num_deltas  # the used part of the step region
        self._np[:] = (STEP, b.num_tokens, b.num_seqs, b.num_rows, b.num_deltas, b.width, nbytes, extra)
        self.comm.broadcast(self._header)
        self.comm.broadcast(b.step.dev_bytes[:nbytes])

    def stop(self) -> None:
        self._np[:] = (STOP,) + (0,) * (_HEADER - 1)
        self.comm.broadcast(self._header)

    def receive(self, b: StepBuffers, tables: torch.Tensor) -> int | None:
        """Another rank: wait (without a limit: the group may be idle) for rank 0's next step, load it into `b`
        with its table deltas applied to `tables`; returns the header's extra count, None on STOP."""
        self.comm.broadcast(self._header, idle=True)
        op, t, s, rows, deltas, width, nbytes, extra = self._np.tolist()  # host memory
        if op == STOP:
            return None
        self.comm.broadcast(b.step.dev_bytes[:nbytes])
        b.num_tokens, b.num_seqs, b.num_rows, b.num_deltas, b.width = t, s, rows, deltas, width
        b.num_gather = 0  # rank 0 gathered any pending tokens into input_ids before sending
        b.query_lens_host = b.dev["query_start_loc"][:s + 1].diff().tolist()  # host memory (cpu only)
        b.seq_lens_host = b.dev["seq_lens"][:s].tolist()  # host memory (cpu only)
        b.apply_tables(tables, full_width=False)
        return extra
