"""Continuous-batching scheduler: token and KV budgets, chunked prefill, FIFO and prefill-first policies,
preemption with KV offload to a host pool (or soft reset when there is none).

Pure CPU Python. `schedule()` plans the next step and advances each planned sequence's `num_computed`
(and `num_pending` for chunks that sample) as if the step had run: the pipeline launches it before the
previous step is committed, so planning must not wait for results. Block copies it decides on (swap-out
of a preempted sequence, swap-in of a resumed one) travel with the next planned step as `SwapOp`s; the
runner executes them, in order, before that step's forward.

`update_from_output(step, result)` is the one place a step's results change request state: it appends each
sampled token, decides the finishes the core knows of (EOS, stop token ids, length, a grammar's end) and
releases what drained. Stop strings are the frontend's (they need text): it ends a request through the
engine core's finish().
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec

from engine import prompt_logprobs
from engine.block_manager import BlockManager
from engine.config import SCHEDULER_POLICIES
from engine.cpu.block_pool import CpuBlockPool
from engine.outputs import TokenLogprob
from engine.sequence import Sequence, SeqStatus
from engine.spec_decode import DEFAULT_BATCH_LIMIT, Propose, SpeculativeConfig, ngram_proposer

logger = logging.getLogger(__name__)


class ScheduledChunk(msgspec.Struct, gc=False):
    """`num_tokens` positions of `seq` starting at `start`; `samples` when the chunk reaches its end.

    A fork (SchedulerOutput.forks) computes nothing (num_tokens 0): it samples `seq`'s first token from the
    logits row of `parent`, its sibling's chunk that ends the shared prompt.

    A msgspec Struct, not a dataclass: a step makes one per row, and a Struct is built in C (half the time);
    untracked by the garbage collector (gc=False: it refers to its sequence and parent chunk, neither of which
    refers back, so it is never in a cycle), so the chunks of a step of 256 rows do not bring the next
    collection 256 allocations closer."""

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool
    parent: ScheduledChunk | None = None
    # Speculative decoding (engine/spec_decode.py): the draft tokens this chunk verifies after its first position;
    # each of its num_tokens = 1 + len(draft) positions is a sampling row.
    draft: list[int] | None = None

    @property
    def num_rows(self) -> int:
        """Sampling rows the chunk has."""
        return (1 + len(self.draft) if self.draft else 1) if self.samples else 0


@dataclass(slots=True)
class SwapOp:
    """Copy KV blocks between the device cache and the host pool: "out" is device -> host."""

    direction: str  # "out" | "in"
    device_blocks: list[int]
    cpu_blocks: list[int]


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    num_tokens: int = 0
    swaps: list[SwapOp] = field(default_factory=list)  # run in order before this step's forward
    # Samples 1..n-1 of n > 1 requests whose prompt this step ends: sampling rows only, after the chunks' rows.
    forks: list[ScheduledChunk] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks, before the forward
    lora_loads: list = field(default_factory=list)  # engine.lora.slots.LoadOp: adapters to copy into slots first
    # A chunk scores prompt tokens (SamplingParams.prompt_logprobs): set where prefill chunks are planned, so
    # the runner looks at the chunks only then (decode chunks never score the prompt).
    prompt_logprobs: bool = False
    # Draft tokens the step's chunks verify (speculative decoding): the runner looks for them only when there are.
    num_draft_tokens: int = 0
    # Chunks that sample: all of them in a decode step, which the runner then stages without a pass over the chunks
    # to find its sampling rows.
    num_samples: int = 0

    def __bool__(self) -> bool:
        return bool(self.chunks)


def sampling_waits_for_commit(seq: Sequence) -> bool:
    """Whether sampling a sequence's next token reads state only its commits update, on the host: a grammar's or
    allowed_token_ids' matcher (advanced at commit), or a min_tokens ban (decided by the committed count). With
    three slots such a sequence never rides in two steps that are both uncommitted when the later one is
    finalized. (Penalties do not wait: the sampling counts an uncommitted input token on the device,
    engine/sampler.py PenaltyRows.pending.) Decided once per request: Sequence.reads_commits_below."""
    return len(seq.token_ids) < seq.reads_commits_below


def can_speculate(seq: Sequence) -> bool:
    """Whether a sequence's decode may carry drafts (engine/spec_decode.py): not under a grammar or
    allowed_token_ids (their matcher advances a token at a time, at commit) or a min_tokens still to reach (its
    ban is decided per step, and a row after a draft would not see that draft). Penalties speculate: each row
    counts the drafts before it (slot.Step.drafts)."""
    return len(seq.token_ids) >= seq.reads_commits_below  # not sampling_waits_for_commit(seq)


class Scheduler:
    """Plans each step. Policies: "fifo" (running decodes, then running prefills, then swapped-out
    sequences, then new requests in arrival order) and "prefill_first" (running prefills, swapped, new
    requests, then decodes).

    n > 1: a request's first sequence is admitted alone, its siblings hanging on it (Sequence.forks), but
    with seats for all of them (max_num_seqs). The step that ends its prompt also forks them: they share
    its blocks (reference counts) and sample their first tokens from its logits row; from then on each is an
    ordinary running sequence. The shared last block, when partial, is copied by each sequence that writes
    into it while it is still shared (copy-on-write: the copy rides with the step, before its forward).

    Preemption: when a running sequence needs a block and none is free, the newest other running sequence
    is the victim (the least KV to move or recompute, and arrival order stays fair: the oldest requests
    keep running); the last running sequence is never preempted. Once its in-flight steps drain, a victim
    is offloaded: its blocks are copied to the host pool (a full block whose content the pool already
    holds, a prefix shared with another offloaded sequence, is referenced, not copied again) and its
    device references dropped (blocks shared with running sequences stay with them). Swapped sequences
    come back, oldest first, before any new request is admitted, once their blocks fit with the admission
    margin kept free (so a swap-in does not trigger the next preemption at once); blocks whose content is
    still in the device prefix cache are taken from there, the rest copied back: nothing is recomputed.
    Without a host pool, or when it lacks room, the victim is soft-reset instead: its blocks are freed
    and it is requeued first in line to recompute prompt + generated tokens, its sampling and
    output state untouched.
    """

    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "fifo", admission_margin: float = 0.05, cpu_pool: CpuBlockPool | None = None,
                 one_step_per_seq: bool = False, lora_slots=None, caching: bool | None = None,
                 speculative: SpeculativeConfig | None = None, propose: Propose | None = None,
                 three_slots: bool = False):
        if policy not in SCHEDULER_POLICIES:
            raise ValueError(f"scheduler must be one of {', '.join(SCHEDULER_POLICIES)}; got {policy!r}")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        # Pipeline parallelism: a sequence rides in at most one step at a time, so the steps in flight are
        # disjoint microbatches and a step never reads a token that is not committed yet.
        self.one_step_per_seq = one_step_per_seq
        # EngineConfig.pipeline_depth=3: a step may be finalized while the step launched before it is still
        # uncommitted, so a sequence whose sampling reads its committed tokens on the host (sampling_waits_for_commit)
        # is not planned into a step while it rides in that uncommitted one, `latest_step` (its id, set by the core
        # before each plan; -1 when the newest in-flight step commits before the step planned now is finalized).
        # `commit_readers`: the last plan saw a running request with a grammar, allowed_token_ids or a min_tokens
        # it has not reached (committed); the core then keeps to two slots, so such a request rides in every step
        # as with pipeline_depth=2. A min_tokens request past its minimum reads no commit any more.
        self.three_slots = three_slots
        self.latest_step = -1
        self.commit_readers = False
        self.margin_blocks = math.ceil(admission_margin * block_manager.num_blocks)
        self._starved = False  # a running sequence could not get blocks in this pass
        self.cpu_pool = cpu_pool if cpu_pool is not None and cpu_pool.num_blocks else None
        # engine.lora.slots.AdapterSlots when LoRA is enabled: a sequence holds its adapter's device slot while
        # it runs (from admission or swap-in until it is released or preempted); None costs nothing.
        self.lora_slots = lora_slots
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []  # offloaded to the host pool, in preemption order
        self._swaps: list[SwapOp] = []  # decided, not yet handed to a step
        self._copies: list[tuple[int, int]] = []  # copy-on-write block copies, likewise
        self._unforked = 0  # siblings of running sequences not forked yet: their seats are taken
        self.num_preemptions = 0
        self.num_offloads = 0
        self.num_swap_ins = 0
        self.num_soft_resets = 0
        self.kv_tokens_discarded = 0  # KV positions soft resets threw away (to be recomputed)
        self.num_forks = 0  # n > 1 siblings forked off a computed prompt (its prefill not repeated)
        self.num_cow_copies = 0  # shared blocks copied before a write
        self._caching = block_manager.enable_prefix_caching if caching is None else caching
        # Speculative decoding (engine/spec_decode.py): None is off. `_spec_on`: it runs in the step being planned.
        self.speculative = speculative
        self._spec_on = False
        # Where drafts come from (engine/spec_decode.py): a draft model's proposer is the core's (it runs a model);
        # the n-gram method's is made here.
        if speculative is not None and propose is None:
            assert speculative.method == "ngram", "a draft model's proposer comes from the engine core"
            propose = ngram_proposer(speculative)
        self.propose = propose
        # Running sequences above which no step speculates: disable_by_batch_size, or by default where it stopped
        # paying (DEFAULT_BATCH_LIMIT), at most the most whose every decode still fits K drafts in a step's
        # sampling rows (max_num_seqs), so a full batch keeps the two-slot pipeline.
        if speculative is not None:
            self._spec_batch_limit = speculative.disable_by_batch_size or min(
                DEFAULT_BATCH_LIMIT, max(1, max_num_seqs // (1 + speculative.num_speculative_tokens)))
        # Committed tokens, rows that rode along after their request finished, tokens a grammar accepted; draft
        # tokens proposed and accepted, and the chunks that verified drafts.
        self.counters = {"generation_tokens": 0, "zombie_rows": 0, "constrained_tokens": 0,
                         "spec_draft_tokens": 0, "spec_accepted_tokens": 0, "spec_verify_chunks": 0}

    # ---- queue management ----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.swapped) or any(self._schedulable(s) for s in self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a finalized sequence out of the queues (device blocks are released separately; host
        blocks of a swapped sequence are freed now: nothing in flight reads them)."""
        if seq.status is SeqStatus.RUNNING:
            self._leave_running(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.SWAPPED:
            self._drop_swapped(seq)
        seq.status = SeqStatus.FINISHED

    def release_if_idle(self, seq: Sequence) -> None:
        """Called whenever a sequence may have no in-flight step left: free or soft-reset it then."""
        if seq.inflight_refs or seq.released:
            return
        if seq.finalized:
            self.bm.free(seq)
            seq.released = True
            if seq.lora_slot:
                self.lora_slots.release(seq)
        elif seq.preempted:
            seq.preempted = False
            if seq.lora_slot:  # it runs no more until readmitted: its adapter may be evicted meanwhile
                self.lora_slots.release(seq)
            if not self._offload(seq):
                self._soft_reset(seq)

    # ---- results -------------------------------------------------------------------------------------
    def update_from_output(self, step, result) -> list[Sequence]:
        """Apply a committed step (engine.slot.Step) and its StepResult: append each sampling row's token,
        set the finishes known here, release sequences nothing in flight reads any more. Returns the
        sequences this step touched, in step order (a sequence appears in at most one chunk of a step);
        the engine core reports their news and ends the finished ones."""
        if result.prompt_logprobs is not None:
            prompt_logprobs.commit(result.prompt_logprobs)  # scored prompt positions, into their sequences
        tokens, changed = result.tokens, []
        row = generated = zombies = 0
        caching, bs = self._caching, self.bm.block_size
        for c in step.chunks + step.forks if step.forks else step.chunks:  # forks' rows come last
            seq = c.seq
            seq.inflight_refs -= 1
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = step.launch_time
            if c.draft:
                seq.num_pending -= 1
                if seq.finalized:
                    zombies += 1
                else:
                    generated += self._verify(c, tokens, result, row)
                row += 1 + len(c.draft)
            elif c.samples:
                seq.num_pending -= 1
                if seq.finalized:
                    zombies += 1  # rode along after finishing: nothing to commit
                elif seq.constraint is None and seq.logprobs is None and seq.first_token_time is not None:
                    # _append_token's common case inlined: this runs for every decoding row every step
                    token = tokens[row]
                    ids = seq.token_ids
                    ids.append(token)
                    n = len(ids)
                    if caching:
                        known = seq.num_computed if seq.num_computed < n else n
                        if known // bs > len(seq.block_hashes):
                            self.bm.cache_full_blocks(seq, known)
                    if token in seq.stop_ids or n >= seq.max_total_len:
                        self._set_finish(seq, token, n)
                    generated += 1
                elif self._append_token(seq, tokens[row], result, row):
                    generated += 1
                row += 1
            changed.append(seq)
            if not seq.inflight_refs and (seq.finalized or seq.finish_reason is None):
                self.release_if_idle(seq)  # (one that finished just now is released when the core ends it)
        self.counters["generation_tokens"] += generated
        self.counters["zombie_rows"] += zombies
        return changed

    def _verify(self, c: ScheduledChunk, tokens: list[int], result, row: int) -> int:
        """Commit a chunk that verified drafts (engine/spec_decode.py): the rows' tokens up to and including the
        first that differs from the draft it checked (all k + 1 when every draft held). The computed length goes
        back to the accepted prefix first, so no block holding a rejected position's KV is ever hashed.
        Returns the tokens committed."""
        seq, draft = c.seq, c.draft
        k, accepted = len(draft), 0
        while accepted < k and tokens[row + accepted] == draft[accepted]:
            accepted += 1
        seq.num_computed = c.start + 1 + accepted  # the committed token at `start` and the accepted drafts
        seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed)  # a draft model's KV likewise
        self.counters["spec_draft_tokens"] += k
        self.counters["spec_accepted_tokens"] += accepted
        self.counters["spec_verify_chunks"] += 1
        committed = 0
        for i in range(accepted + 1):
            if not self._append_token(seq, tokens[row + i], result, row + i):
                break
            committed += 1
            if seq.finish_reason is not None:  # EOS, a stop token or the length cap among them: the rest is dropped
                break
        return committed

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence: finalized, out of the queues, its blocks freed now or when its steps drain."""
        seq.finalized = True
        seq.finish_reason = reason
        self.remove(seq)
        self.release_if_idle(seq)

    def _append_token(self, seq: Sequence, token: int, result, row: int) -> bool:
        """Commit one sampled token (False when its constraint rejected it and the request ends).
        update_from_output commits a decoding row without constraint or logprobs itself (the append and the
        block hashing, then _set_finish): a change to what a commit does goes in both places."""
        if seq.constraint is not None and not self._accept_constrained(seq, token):
            return False
        ids = seq.token_ids
        ids.append(token)
        n = len(ids)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        if seq.logprobs is not None:
            k = seq.params.logprobs
            top = list(zip(result.top_ids[row][:k], result.top_logprobs[row][:k])) if k else []
            seq.logprobs.append(TokenLogprob(token, result.logprobs[row], top))
        if self._caching:
            known = seq.num_computed if seq.num_computed < n else n
            if known // self.bm.block_size > len(seq.block_hashes):
                self.bm.cache_full_blocks(seq, known)  # a block just filled up
        self._set_finish(seq, token, n)
        return True

    @staticmethod
    def _set_finish(seq: Sequence, token: int, n: int) -> None:
        """The finish, if any, that committing `token` (the sequence now `n` tokens long) sets."""
        if token in seq.stop_ids:  # an EOS or one of stop_token_ids
            p = seq.params
            if not p.min_tokens or n - len(seq.prompt_token_ids) >= p.min_tokens:
                seq.finish_reason, seq.stop_token = "stop", True
                return
        if seq.constraint is not None and seq.constraint.terminated:
            seq.finish_reason = "stop"  # the grammar ended on its stop token (also under ignore_eos)
        elif n >= seq.max_total_len:
            seq.finish_reason = "length"

    def _accept_constrained(self, seq: Sequence, token: int) -> bool:
        """Advance the request's matcher with its newly committed token (the only place it advances).

        A rejected token was sampled from a row whose constraints left nothing allowed (e.g. min_tokens
        banning the stop token of a finished grammar): the request ends without it, as "stop" when the
        output is already a complete match."""
        if seq.constraint.accept(token):
            self.counters["constrained_tokens"] += 1
            return True
        complete = seq.constraint.completed
        logger.warning("request %s: constraints allowed no token (min_tokens or allowed_token_ids "
                       "against the grammar); ending it as %s", seq.request_id,
                       "stop" if complete else "abort")
        seq.finish_reason = "stop" if complete else "abort"
        return False

    # ---- planning ------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = [self.max_num_batched_tokens]
        self._starved = False
        spec = self.speculative
        self._spec_on = spec is not None and len(self.running) <= self._spec_batch_limit
        decodes, prefills = self._split_running()
        if self.policy == "fifo":
            self._schedule_decodes(decodes, out, budget)
            self._schedule_running(prefills, out, budget)
            self._swap_in(out, budget)
            self._admit_waiting(out, budget)
        else:
            self._schedule_running(prefills, out, budget)
            self._swap_in(out, budget)
            self._admit_waiting(out, budget)
            self._schedule_decodes(decodes, out, budget)
        if self._spec_on and out:
            self._add_drafts(out, budget)
        if out:  # copies ride with the next step that runs; until then nothing reads the blocks involved
            out.swaps, self._swaps = self._swaps, []
            if self._copies:
                out.copies, self._copies = self._copies, []
            if self.lora_slots is not None:
                out.lora_loads = self.lora_slots.take_loads()
        return out

    def _schedulable(self, seq: Sequence) -> bool:
        # A sequence whose pending token reaches its length cap is done once that token commits: skip the
        # step that would only compute KV nobody reads (no zombie for length-capped requests).
        if seq.inflight_refs and (self.one_step_per_seq or self._waits_to_speculate(seq)):
            return False
        if self.three_slots and seq.num_pending and seq.pending_step == self.latest_step \
                and sampling_waits_for_commit(seq):
            return False
        return not (seq.finalized or seq.preempted) and seq.num_total < seq.max_total_len

    def _waits_to_speculate(self, seq: Sequence) -> bool:
        """A decoding sequence that speculates waits for its in-flight step's commit: its drafts come from its
        committed tokens, and where its next position is depends on how many the commit accepts."""
        return self._spec_on and seq.num_computed >= len(seq.prompt_token_ids) and can_speculate(seq)

    def _add_drafts(self, out: SchedulerOutput, budget: list[int]) -> None:
        """Give the planned one-token decodes of speculating sequences drafts, within the token budget, the sampling
        rows of a step (max_num_seqs: the slot buffers' rows) and the free blocks (never preempting anyone for a
        draft). Room is reserved first, blocks included (a draft model writes KV at the draft positions while it
        proposes), then one call proposes for every sequence of the step."""
        chunks, rooms = self._draft_room(out, budget)
        if not chunks:
            return
        for c, draft in zip(chunks, self.propose([c.seq for c in chunks], rooms)):
            k = len(draft)  # (at most its room)
            if not k:
                continue
            c.num_tokens, c.draft = 1 + k, draft
            c.seq.num_computed += k
            out.num_tokens += k
            out.num_draft_tokens += k

    def _draft_room(self, out: SchedulerOutput, budget: list[int]) -> tuple[list[ScheduledChunk], list[int]]:
        """The chunks that may carry drafts and how many each, their budget and rows taken and their blocks
        allocated."""
        spec, bm = self.speculative, self.bm
        rows = sum(1 for c in out.chunks if c.samples) + len(out.forks)
        chunks, rooms = [], []
        for c in out.chunks:
            room = min(spec.num_speculative_tokens, budget[0], self.max_num_seqs - rows)
            if room < 1:
                break
            seq = c.seq
            if c.num_tokens != 1 or not c.samples or seq.inflight_refs != 1 or c.start != len(seq.token_ids) - 1 \
                    or c.start < len(seq.prompt_token_ids) or not can_speculate(seq):
                # A prompt chunk (also the last prompt token alone after a prefix hit: n > 1 siblings fork off its
                # row), a sequence also in flight elsewhere, or one that cannot speculate.
                continue
            room = min(room, seq.max_total_len - len(seq.token_ids) - 1)  # its last row's token ends it at most
            if room < 1 or bm.blocks_needed(seq, seq.num_computed + room, c.start) > bm.num_free - self.margin_blocks:
                continue
            ok = bm.allocate(seq, seq.num_computed + room, start=c.start)
            assert ok, "the free blocks were checked"
            chunks.append(c)
            rooms.append(room)
            budget[0] -= room
            rows += room
        return chunks, rooms

    def _split_running(self) -> tuple[list[Sequence], list[Sequence]]:
        """The schedulable running sequences: decodes (Sequence.is_decoding) and the rest, in running order.
        Inlined _schedulable and is_decoding: this runs over every running sequence every step."""
        decodes, prefills = [], []
        one_step, spec = self.one_step_per_seq, self._spec_on
        latest = self.latest_step if self.three_slots else None
        readers = waits = False
        for s in self.running:
            if (one_step and s.inflight_refs) or s.finalized or s.preempted:
                continue
            known = len(s.token_ids)
            if latest is not None:  # sampling_waits_for_commit(s), inlined (two calls a row cost ~0.5 us)
                waits = known < s.reads_commits_below
                if waits:
                    readers = True
            total = known + s.num_pending
            if total >= s.max_total_len:
                continue
            if total - s.num_computed == 1 and s.num_computed >= len(s.prompt_token_ids):
                if spec and s.inflight_refs and can_speculate(s):
                    continue  # waits for its commit (_waits_to_speculate)
                if waits and s.pending_step == latest and s.num_pending:
                    continue  # three slots: rides in the step after next (_schedulable)
                decodes.append(s)
            else:
                prefills.append(s)
        if latest is not None:
            self.commit_readers = readers
        return decodes, prefills

    def _schedule_decodes(self, seqs: list[Sequence], out: SchedulerOutput, budget: list[int]) -> None:
        """_schedule_running for one-token chunks, with the common case inlined: a sequence whose last block
        has room needs no allocation, and hashes a block only when one just filled up."""
        bs, chunks, caching = self.bm.block_size, out.chunks, self.bm.enable_prefix_caching
        taken, limit, running = 0, budget[0], SeqStatus.RUNNING  # (an enum member read once, not per row)
        for seq in seqs:
            if taken == limit:
                break
            if seq.status is not running:  # preempted earlier in this same pass
                continue
            start = seq.num_computed
            if (start >= len(seq.block_table) * bs or seq.cow) and not self._fit(seq, 1):
                continue
            chunks.append(ScheduledChunk(seq, start, 1, True))
            seq.num_computed = start + 1
            seq.inflight_refs += 1
            seq.num_pending += 1
            taken += 1
            if caching:  # positions up to start whose tokens are known: a block that just filled up is hashed
                known = len(seq.token_ids)
                if known > start:
                    known = start + 1
                if known // bs > len(seq.block_hashes):
                    self.bm.cache_full_blocks(seq, known)
        budget[0] -= taken
        out.num_tokens += taken
        out.num_samples += taken

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
        # A running sequence waiting for a victim's blocks must get them, and swapped-out sequences come
        # back before anyone new: admit nobody meanwhile.
        while self.waiting and budget[0] > 0 and not self._starved and not self.swapped:
            seq = self.waiting[0]
            if not self._has_seats(seq):
                return
            # prompt_logprobs needs every prompt position's logits: such a request never reads the cache.
            hits, hashes = self.bm.cached_prefix(seq.token_ids, self.bm.prompt_hashes(seq)) \
                if seq.params.prompt_logprobs is None else ([], [])
            computed = len(hits) * self.bm.block_size
            n = min(seq.num_total - computed, budget[0])
            # Cached hits sitting in the free queue are taken back out of it, so they count as needed.
            needed = self.bm.admission_pages(hits, hashes, computed + n)
            margin = self.margin_blocks if self.running else 0
            if needed + margin > self.bm.num_free:
                if self.running:
                    return
                # Alone, its first chunk shrinks to what the free pages hold, as a running prefill's does: with
                # window groups a chunk wider than the window can need more pages than the prompt ever holds at
                # once (RequestLimits.check admitted it on the latter), and nobody running will free any.
                n = min(n, self.bm.admission_capacity(hits, hashes, self.bm.num_free))
                if n <= 0:
                    return
            if seq.lora is not None and not self.lora_slots.acquire(seq):
                return  # every adapter slot is held by running sequences: wait in line for one
            self.waiting.popleft()
            self.bm.admit(seq, hits, hashes)
            ok = self.bm.allocate(seq, computed + n)
            assert ok, "admission checked the free blocks"
            self._enter_running(seq)
            self._plan(seq, n, out, budget)

    def _has_seats(self, seq: Sequence) -> bool:
        """Room under max_num_seqs for `seq` and its unforked siblings."""
        need = 1 + len(seq.forks) if seq.forks else 1
        return len(self.running) + self._unforked + need <= self.max_num_seqs

    def _enter_running(self, seq: Sequence) -> None:
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        if self.three_slots and not self.commit_readers:  # (the next plan's pass over the running recounts)
            self.commit_readers = sampling_waits_for_commit(seq)
        if seq.forks:
            self._unforked += len(seq.forks)

    def _leave_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if seq.forks:
            self._unforked -= len(seq.forks)

    def _plan(self, seq: Sequence, n: int, out: SchedulerOutput, budget: list[int]) -> None:
        start = seq.num_computed
        samples = start + n == seq.num_total
        out.chunks.append(ScheduledChunk(seq, start, n, samples))
        out.num_samples += samples
        if seq.params.prompt_logprobs is not None and start < len(seq.prompt_token_ids) - 1:
            out.prompt_logprobs = True
        out.num_tokens += n
        budget[0] -= n
        seq.num_computed += n
        seq.inflight_refs += 1
        if samples:
            seq.num_pending += 1
        known = min(seq.num_computed, len(seq.token_ids))
        if known // self.bm.block_size > len(seq.block_hashes):
            self.bm.cache_full_blocks(seq, known)
        if samples and seq.forks:
            self._fork(seq, out)

    def _fork(self, seq: Sequence, out: SchedulerOutput) -> None:
        """`seq`'s planned chunk ends the prompt: its siblings take its blocks and sample their first tokens
        from the same logits row, in this step; the seats they held become theirs."""
        parent, forks = out.chunks[-1], seq.forks
        seq.forks = None
        self._unforked -= len(forks)
        self.num_forks += len(forks)
        shared_tail = seq.num_computed % self.bm.block_size != 0  # a partial last block: copy before writing
        seq.cow = shared_tail
        for child in forks:
            self.bm.fork(seq, child)
            child.num_computed, child.num_cached = seq.num_computed, seq.num_cached
            child.prompt_hashes = seq.prompt_hashes
            child.num_pending = 1
            child.inflight_refs += 1
            child.cow = shared_tail
            if child.lora is not None:
                self.lora_slots.acquire(child)  # cannot fail: `seq` holds the adapter's slot
            child.status = SeqStatus.RUNNING
            self.running.append(child)
            out.forks.append(ScheduledChunk(child, seq.num_computed, 0, True, parent))

    # ---- preemption ----------------------------------------------------------------------------------
    def _fit(self, seq: Sequence, n: int) -> int:
        """Grow `seq` for a chunk of up to `n` positions; return the chunk size it got (0: wait a step).

        When blocks run out, the newest other running sequences are preempted. A victim still referenced
        by an in-flight step gives its blocks back only after that step commits; `seq` then waits one
        step rather than preempting more than it needs. With nobody left to preempt, a prefill chunk
        shrinks to what the free blocks hold.
        """
        bs, per_block = self.bm.block_size, self.bm.pages_per_block
        if n == 1 and not seq.cow and seq.num_computed == len(seq.block_table) * bs and self.bm.append_block(seq):
            return 1  # the common case, a decode opening a block with a page free: none of the accounting below
        cow = seq.cow and self.bm.shares_block(seq, seq.num_computed // bs)  # the block written is shared
        if not cow:
            seq.cow = False
        # Net of the window pages the slide at seq.num_computed gives back (BlockManager.blocks_needed); counted
        # again after each preemption, as a victim sharing those pages (a sibling) leaves them to `seq` alone.
        releasing = 0
        while (needed := self.bm.blocks_needed(seq, seq.num_computed + n) + cow * per_block) > self.bm.num_free:
            if needed <= self.bm.num_free + releasing:
                self._starved = True
                return 0
            victim = self._pick_victim(seq)
            if victim is None:
                break
            held = self.bm.pages_held(victim)
            self._preempt(victim)
            if victim.preempted:  # reset deferred until its in-flight step drains
                releasing += held
        if cow and not self.bm.shares_block(seq, seq.num_computed // bs):
            cow = seq.cow = False  # the sibling sharing it was preempted and released it meanwhile
        capacity = self.bm.capacity(seq, self.bm.num_free - cow * per_block)
        n = min(n, capacity)
        if n <= 0:
            self._starved = True
            return 0
        if cow:
            # The slide first: the count above is net of the pages it gives back, which the copy may need.
            self.bm.slide(seq, seq.num_computed)
            self._copies += self.bm.copy_on_write(seq, seq.num_computed // bs)
            self.num_cow_copies += 1
            seq.cow = False
            # A draft model's cache is not copied: its KV in the copied block is recomputed at the next proposal.
            seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed // bs * bs)
        ok = self.bm.allocate(seq, seq.num_computed + n)
        assert ok, "capacity was computed from the free blocks"
        return n

    def stuck(self) -> list[Sequence]:
        """Sequences that can never get a block: nothing in flight, nothing schedulable fits.

        The engine calls this only when a tick launched nothing and no step is in flight; the KV cache
        is then wholly held by these running sequences, so the oldest must end (its KV budget is
        exhausted). With none running, it is a swapped sequence that does not fit the empty cache."""
        running = [s for s in self.running if self._schedulable(s)]
        return running or sorted(self.swapped, key=lambda s: s.arrival_time)[:1]

    def _pick_victim(self, requester: Sequence) -> Sequence | None:
        """Newest running sequence other than the requester (never the last one running)."""
        for seq in reversed(self.running):
            if seq is not requester and not seq.finalized:
                return seq
        return None

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        logger.debug("preempting %s (%d blocks, %d tokens)", seq.request_id, len(seq.block_table),
                     seq.num_computed)
        self._leave_running(seq)
        seq.preempted = True
        seq.status = SeqStatus.WAITING
        self.release_if_idle(seq)

    def _soft_reset(self, seq: Sequence) -> None:
        """Free the blocks and requeue at the front; the generated tokens are now part of what to
        recompute, and the sequence keeps its sampler state, so its output continues."""
        self.num_soft_resets += 1
        self.kv_tokens_discarded += seq.num_computed
        self.bm.free(seq)
        seq.num_computed = seq.num_cached = seq.num_draft_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    # ---- offload and swap-in ------------------------------------------------------------------------------
    def _offload(self, seq: Sequence) -> bool:
        """Copy `seq`'s blocks to the host pool and free its device blocks; False when there is no host
        pool or it lacks room (the caller soft-resets instead). A block whose content the host pool already
        holds (a prefix shared with another offloaded sequence) is referenced there, not copied again."""
        if self.cpu_pool is None:
            return False
        self.bm.slide(seq, seq.num_computed)  # what no query from here on reads is not copied (nothing is in flight)
        pool, table, hashes = self.cpu_pool, seq.block_table, seq.block_hashes
        cpu: list[int | None] = [pool.lookup(hashes[i] if i < len(hashes) else None) for i in range(len(table))]
        copy = [i for i, c in enumerate(cpu) if c is None]
        window = seq.window_table[seq.window_base * self.bm.window_groups:]  # live window pages: always copied
        fresh = pool.allocate(len(copy) + len(window))
        if fresh is None:
            return False
        if window:
            fresh, seq.cpu_window = fresh[:len(copy)], fresh[len(copy):]
            self._swaps.append(SwapOp("out", window, seq.cpu_window))
        for c in cpu:
            if c is not None:
                pool.share(c)
        for i, c in zip(copy, fresh):
            cpu[i] = c
            if i < len(hashes):
                pool.register(c, hashes[i])
        if copy:
            self._swaps.append(SwapOp("out", [table[i] for i in copy], fresh))
        seq.cpu_blocks = cpu
        base = seq.window_base
        self.bm.free(seq)  # shared device blocks just lose this reference: their other holders keep them
        seq.block_hashes = hashes  # the content is unchanged
        seq.num_draft_computed = 0  # a draft model's KV stays behind: it comes back in other blocks
        seq.window_base = base  # the blocks before it come back without window pages
        seq.status = SeqStatus.SWAPPED
        self.swapped.append(seq)
        self.num_offloads += 1
        return True

    def _swap_in(self, out: SchedulerOutput, budget: list[int]) -> None:
        """Bring swapped sequences back, oldest first, while their blocks fit with the margin kept free."""
        while self.swapped and budget[0] > 0 and not self._starved:
            seq = min(self.swapped, key=lambda s: s.arrival_time)
            if not self._has_seats(seq):
                return
            found = self._on_device(seq)
            n = min(seq.num_uncomputed, budget[0])
            growth = max(0, -(-(seq.num_computed + n) // self.bm.block_size) - len(seq.cpu_blocks)) \
                * self.bm.pages_per_block
            fresh = len(seq.cpu_blocks) - len(found) + len(seq.cpu_window or ())
            reused_free = sum(1 for b in found.values() if self.bm.ref_counts[b] == 0)
            margin = self.margin_blocks if self.running else 0
            if fresh + reused_free + growth + margin > self.bm.num_free:
                return
            if seq.lora is not None and not self.lora_slots.acquire(seq):
                return
            self._restore(seq, found)
            n = self._fit(seq, n)
            if n:
                self._plan(seq, n, out, budget)

    def _on_device(self, seq: Sequence) -> dict[int, int]:
        """Table index -> device block, for the blocks whose content is still in the device prefix cache
        (shared prefixes, or freed blocks not yet evicted): those come back without a copy."""
        found = {}
        for i, h in enumerate(seq.block_hashes[:len(seq.cpu_blocks)]):
            block = self.bm.cached_block(h)
            if block is not None:
                found[i] = block
        return found

    def _restore(self, seq: Sequence, found: dict[int, int]) -> None:
        for block in found.values():  # first, so allocating fresh blocks cannot evict them
            self.bm.take(block)
        table, fresh, cpu = [], [], []
        for i, cpu_block in enumerate(seq.cpu_blocks):
            if i in found:
                table.append(found[i])
                continue
            block = self.bm.take_fresh(seq.block_hashes[i] if i < len(seq.block_hashes) else None)
            table.append(block)
            fresh.append(block)
            cpu.append(cpu_block)
        if seq.cpu_window:
            window = [self.bm.take_fresh(None) for _ in seq.cpu_window]
            fresh += window
            cpu += seq.cpu_window
            seq.window_table = [0] * (seq.window_base * self.bm.window_groups) + window
        if fresh:
            self._swaps.append(SwapOp("in", fresh, cpu))
        self._drop_swapped(seq)  # host blocks may be reused now: a later swap-out runs after this copy
        seq.block_table = table
        self._enter_running(seq)
        self.num_swap_ins += 1

    def _drop_swapped(self, seq: Sequence) -> None:
        self.swapped.remove(seq)
        self.cpu_pool.release(seq.cpu_blocks)
        seq.cpu_blocks = None
        if seq.cpu_window:
            self.cpu_pool.release(seq.cpu_window)
            seq.cpu_window = None
