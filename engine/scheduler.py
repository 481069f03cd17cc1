"""Continuous-batching scheduler: token and KV budgets, chunked prefill, FIFO and prefill-first policies.

Pure CPU Python. `schedule()` plans the next step and advances each planned sequence's `num_computed`
(and `num_pending` for chunks that sample) as if the step had run: the pipeline launches it before the
previous step is committed, so planning must not wait for results.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import SCHEDULER_POLICIES
from engine.sequence import Sequence, SeqStatus


@dataclass(slots=True)
class ScheduledChunk:
    """`num_tokens` positions of `seq` starting at `start`; `samples` when the chunk reaches its end."""

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    num_tokens: int = 0

    @property
    def num_decodes(self) -> int:
        return sum(1 for c in self.chunks if c.num_tokens == 1 and c.samples)

    def __bool__(self) -> bool:
        return bool(self.chunks)


class Scheduler:
    """Plans each step. Policies: "fifo" (running decodes, then running prefills, then new requests in
    arrival order) and "prefill_first" (running prefills, then new requests, then decodes)."""

    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "fifo", admission_margin: float = 0.05):
        if policy not in SCHEDULER_POLICIES:
            raise ValueError(f"scheduler must be one of {', '.join(SCHEDULER_POLICIES)}; got {policy!r}")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.margin_blocks = math.ceil(admission_margin * block_manager.num_blocks)
        self._starved = False  # a running sequence could not get blocks in this pass
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ---- queue management ----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(self._schedulable(s) for s in self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a finalized sequence out of the queues (its blocks are released separately)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def release_if_idle(self, seq: Sequence) -> None:
        """Called whenever a sequence may have no in-flight step left: free or soft-reset it then."""
        if seq.inflight_refs or seq.released:
            return
        if seq.finalized:
            self.bm.free(seq)
            seq.released = True
        elif seq.preempted:
            self._soft_reset(seq)

    # ---- planning ------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = [self.max_num_batched_tokens]
        self._starved = False
        running = [s for s in self.running if self._schedulable(s)]
        decodes = [s for s in running if s.is_decoding]
        prefills = [s for s in running if not s.is_decoding]
        if self.policy == "fifo":
            self._schedule_running(decodes, out, budget)
            self._schedule_running(prefills, out, budget)
            self._admit_waiting(out, budget)
        else:
            self._schedule_running(prefills, out, budget)
            self._admit_waiting(out, budget)
            self._schedule_running(decodes, out, budget)
        return out

    def _schedulable(self, seq: Sequence) -> bool:
        # A sequence whose pending token reaches its length cap is done once that token commits: skip the
        # step that would only compute KV nobody reads (no zombie for length-capped requests).
        return not (seq.finalized or seq.preempted) and seq.num_total < seq.max_total_len

    def _schedule_running(self, seqs: list[Sequence], out: SchedulerOutput, budget: list[int]) -> None:
        for seq in seqs:
            if budget[0] == 0:
                return
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this same pass
                continue
            n = self._fit(seq, min(seq.num_uncomputed, budget[0]))
            if n:
                self._plan(seq, n, out, budget)

    def _admit_waiting(self, out: SchedulerOutput, budget: list[int]) -> None:
        # A running sequence waiting for a victim's blocks must get them: admit nobody meanwhile.
        while (self.waiting and budget[0] > 0 and len(self.running) < self.max_num_seqs
               and not self._starved):
            seq = self.waiting[0]
            hits, hashes = self.bm.cached_prefix(seq.token_ids)
            computed = len(hits) * self.bm.block_size
            n = min(seq.num_total - computed, budget[0])
            # Cached hits sitting in the free queue are taken back out of it, so they count as needed.
            reused_free = sum(1 for b in hits if self.bm.ref_counts[b] == 0)
            needed = max(0, -(-(computed + n) // self.bm.block_size) - len(hits)) + reused_free
            margin = self.margin_blocks if self.running else 0
            if needed + margin > self.bm.num_free:
                return
            self.waiting.popleft()
            self.bm.admit(seq, hits, hashes)
            ok = self.bm.allocate(seq, computed + n)
            assert ok, "admission checked the free blocks"
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._plan(seq, n, out, budget)

    def _plan(self, seq: Sequence, n: int, out: SchedulerOutput, budget: list[int]) -> None:
        start = seq.num_computed
        samples = start + n == seq.num_total
        out.chunks.append(ScheduledChunk(seq, start, n, samples))
        out.num_tokens += n
        budget[0] -= n
        seq.num_computed += n
        seq.inflight_refs += 1
        if samples:
            seq.num_pending += 1
        self.bm.cache_full_blocks(seq, min(seq.num_computed, len(seq.token_ids)))

    # ---- preemption (soft reset; the KV-offload path builds on this) -----------------------------------
    def _fit(self, seq: Sequence, n: int) -> int:
        """Grow `seq` for a chunk of up to `n` positions; return the chunk size it got (0: wait a step).

        When blocks run out, the newest other running sequences are preempted. A victim still referenced
        by an in-flight step gives its blocks back only after that step commits; `seq` then waits one
        step rather than preempting more than it needs. With nobody left to preempt, a prefill chunk
        shrinks to what the free blocks hold.
        """
        needed = self.bm.blocks_needed(seq, seq.num_computed + n)
        releasing = 0
        while needed > self.bm.num_free:
            if needed <= self.bm.num_free + releasing:
                self._starved = True
                return 0
            victim = self._pick_victim(seq)
            if victim is None:
                break
            held = sum(1 for b in victim.block_table if self.bm.ref_counts[b] == 1)
            self._preempt(victim)
            if victim.preempted:  # reset deferred until its in-flight step drains
                releasing += held
        capacity = (len(seq.block_table) + self.bm.num_free) * self.bm.block_size - seq.num_computed
        n = min(n, capacity)
        if n <= 0:
            self._starved = True
            return 0
        ok = self.bm.allocate(seq, seq.num_computed + n)
        assert ok, "capacity was computed from the free blocks"
        return n

    def stuck(self) -> list[Sequence]:
        """Running sequences that can never get a block: nothing in flight, nothing schedulable fits.

        The engine calls this only when a tick launched nothing and no step is in flight; the KV cache
        is then wholly held by these sequences, so the oldest must end (its KV budget is exhausted)."""
        return [s for s in self.running if self._schedulable(s)]

    def _pick_victim(self, requester: Sequence) -> Sequence | None:
        """Newest running sequence other than the requester (never the last one running)."""
        for seq in reversed(self.running):
            if seq is not requester and not seq.finalized:
                return seq
        return None

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(seq)
        seq.preempted = True
        seq.status = SeqStatus.WAITING
        self.release_if_idle(seq)

    def _soft_reset(self, seq: Sequence) -> None:
        """Free the blocks and requeue at the front; the generated tokens are now part of what to
        recompute, and the sequence keeps its sampler and detokenizer state, so its output continues."""
        self.bm.free(seq)
        seq.num_computed = seq.num_cached = 0
        seq.preempted = False
        self.waiting.appendleft(seq)
