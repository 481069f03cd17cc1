"""Token sampling for one step: penalties, min_tokens, logit_bias, constraint masks, temperature,
top-k/top-p/min-p, per-request seeds.

Sampling parameters are gathered on the host into a `SamplingBatch`: per-row values go into the slot's
fixed buffers (engine/step_buffers.py: pinned staging, non-blocking copy), variable-size ones through pinned
memory, so building a batch never synchronizes with the device; the math itself never synchronizes either:
the random draw is one uniform per row searched in the row's cumulative distribution (`inverse_cdf`), no
multinomial. That replaced an exponential race (argmax of p / Exp(1)): it needs a random number per vocabulary
entry, and drawing a whole vocabulary's worth per row on CPU costs far more than the fp64 cumsum and search
(docs/engine.md#sampler).
Top-p on CPU looks for the nucleus among the most likely tokens (`TOP_P_CANDIDATES`) before it sorts a
whole row.
Constrained rows (grammar, allowed_token_ids) get an int32 bitmask built on the host after the previous
commit (engine.structured) and applied here, before any sampling math: masked tokens become -inf.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.sampling_params import MAX_LOGPROBS
from engine.sequence import ROW_GREEDY, ROW_MIN_P, ROW_SPECIAL, ROW_TEMPERATURE, ROW_TOP_K, ROW_TOP_P, \
    SPECIAL_PENALTIES, TOP_K_OFF, Sequence
from engine.structured import allocate_bitmask, apply_bitmask, fill_bitmask

_NEG_INF = float("-inf")
_CPU = torch.device("cpu")
# CPU top-p: the candidate counts searched for a row's nucleus before it falls back to a full sort (_top_p). A
# small topk is much cheaper than sorting a row and holds almost every nucleus of ordinary text; the larger
# counts catch flatter distributions (random-token prompts) before the sort. Chosen by measurement:
# docs/engine.md#sampler.
TOP_P_CANDIDATES = (256, 4096, 16384)


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling inputs for the rows of one step that sample (row order = step order)."""

    temperature: torch.Tensor  # [R] float32, 1.0 where greedy (unused there)
    greedy: torch.Tensor  # [R] bool
    top_k: torch.Tensor | None  # [R] int64, TOP_K_OFF where disabled; None if no row uses it
    top_p: torch.Tensor | None  # [R] float32
    min_p: torch.Tensor | None  # [R] float32
    penalties: "PenaltyRows | None"  # rows with repetition/presence/frequency penalties, together
    banned: list[tuple[int, torch.Tensor]]  # (row, token ids) masked to -inf (min_tokens: eos + stop ids)
    generators: dict[int, torch.Generator]  # seeded rows' own generators; other rows use the engine's
    num_logprobs: int  # -1: no row wants logprobs; else max top-k asked (0 = chosen token only)
    all_greedy: bool  # decided on the host, so skipping the random path never reads the device
    logit_bias: list[tuple[int, torch.Tensor, torch.Tensor]]  # (row, token ids [n], biases [n])
    # Allowed tokens of constrained rows: int32 [R, ceil(V/32)], bit j of row r set = token j allowed.
    # Filled on the host from the matchers (after the previous commit), then copied to the device;
    # on CUDA that copy belongs on the copy stream from a pinned buffer (never a synchronous copy).
    bitmask: torch.Tensor | None
    bitmask_rows: list[int]  # rows the bitmask applies to; other rows are unconstrained
    top_k_max: int = 0  # the largest top_k a row asks for (host value: sizes the topk without a sync)
    any_greedy: bool = True  # host value: a batch with no greedy row skips the argmax it would not read
    # Seeded rows' uniform draws made where the batch was built, from each request's own generator, in place of
    # `generators` (a batch sampled elsewhere: the last pipeline stage): the same draw, so the same token.
    drawn: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    @classmethod
    def build(cls, seqs: list[Sequence], device: torch.device, buffers=None,
              bitmask_buffer: torch.Tensor | None = None, draw_seeded: bool = False,
              penalty_pool: "PenaltyPool | None" = None, drafts: list | None = None,
              pending_from: tuple | None = None) -> "SamplingBatch":
        """buffers: the slot's StepBuffers (per-row fields are staged and uploaded there); None allocates.
        penalty_pool: the runner's PenaltyPool on `device`, where penalized sequences keep their state from step
        to step (None: one for this batch alone, filled from each penalized sequence's whole text).
        bitmask_buffer: a reusable host buffer [>= len(seqs), ceil(V/32)] int32 (the slot's; pinned on CUDA).
        drafts: per row, the draft tokens before it (a step verifying drafts; PenaltyPool.take), or None.
        pending_from: three slots only: (the step's sampling chunks, its staged logits_indices, its device input_ids),
        where penalized rows find an input token that is not committed yet (PenaltyRows.pending).
        draw_seeded: make seeded rows' draws now (`drawn`) instead of handing over their generators, for a
        batch that is sampled in another process (sampling draws once per non-greedy row and step, so the
        request's generator advances exactly as if it were sampled here).

        Each sequence carries its parameters as one tuple (Sequence.sample_row, made once). When every row
        has the same tuple (the common case) the per-row fields are filled from scalars; per-row Python runs
        only for the rows flagged special (min_tokens, logit_bias, seeds, logprobs, constraints; penalties go to
        the penalty pool, every row at once)."""
        put = _uploader(device, buffers)
        rows = [s.sample_row for s in seqs]
        n, first = len(rows), rows[0]
        uniform = rows.count(first) == n
        cols = first if uniform else tuple(zip(*rows))  # scalars, or one tuple of values per field
        temperature = put("temperature", cols[ROW_TEMPERATURE], n, torch.float32)
        greedy = put("greedy", cols[ROW_GREEDY], n, torch.bool)
        used = (lambda i, off: cols[i] != off) if uniform else (lambda i, off: any(v != off for v in cols[i]))
        top_k = put("top_k", cols[ROW_TOP_K], n, torch.long) if used(ROW_TOP_K, TOP_K_OFF) else None
        top_p = put("top_p", cols[ROW_TOP_P], n, torch.float32) if used(ROW_TOP_P, 1.0) else None
        min_p = put("min_p", cols[ROW_MIN_P], n, torch.float32) if used(ROW_MIN_P, 0.0) else None
        all_greedy = bool(cols[ROW_GREEDY]) if uniform else all(cols[ROW_GREEDY])
        any_greedy = bool(cols[ROW_GREEDY]) if uniform else any(cols[ROW_GREEDY])
        special = (range(n) if first[ROW_SPECIAL] else ()) if uniform else [i for i, r in enumerate(rows)
                                                                           if r[ROW_SPECIAL]]
        if buffers is not None:
            buffers.upload_sampling()  # one copy for every field, in stream order before the sampling
        batch = cls(temperature, greedy, top_k, top_p, min_p, None, [], {}, -1, all_greedy, [], None, [],
                    any_greedy=any_greedy)
        if top_k is not None:
            batch.top_k_max = cols[ROW_TOP_K] if uniform else max(v for v in cols[ROW_TOP_K] if v != TOP_K_OFF)
        if uniform and first[ROW_SPECIAL] == SPECIAL_PENALTIES:  # (a model's default repetition_penalty)
            batch._add_penalties(list(special), seqs, device, penalty_pool, drafts, pending_from)  # every row alone
        elif special:
            batch._add_special(seqs, special, device, bitmask_buffer, draw_seeded, penalty_pool, drafts, pending_from)
        return batch

    def _add_special(self, seqs: list[Sequence], special, device: torch.device,
                     bitmask_buffer: torch.Tensor | None, draw_seeded: bool, penalty_pool,
                     drafts: list | None = None, pending_from: tuple | None = None) -> None:
        """Penalties, min_tokens bans, logit_bias, seeds, logprobs and constraints of the special rows."""
        constraints = None
        penalized = []
        for i in special:
            s = seqs[i]
            p = s.params
            if p.needs_penalties:
                penalized.append(i)
            if p.min_tokens and s.num_output_tokens < p.min_tokens:
                self.banned.append((i, to_device(sorted(s.eos_token_ids | set(p.stop_token_ids)), torch.long,
                                                 device)))
            if p.logit_bias:
                self.logit_bias.append((i, to_device(list(p.logit_bias), torch.long, device),
                                        to_device(list(p.logit_bias.values()), torch.float32, device)))
            if s.generator is None:
                pass
            elif not draw_seeded:
                self.generators[i] = s.generator
            elif not s.sample_row[ROW_GREEDY]:  # a greedy row reads no draw
                self.drawn[i] = torch.rand((1,), dtype=torch.float64, generator=s.generator,
                                           device=s.generator.device)
            if p.logprobs is not None:
                self.num_logprobs = max(self.num_logprobs, p.logprobs)
            if s.constraint is not None and not s.finalized:  # a finalized row is a zombie: no mask
                constraints = constraints or [None] * len(seqs)
                constraints[i] = s.constraint
        if constraints is not None:
            self.bitmask, self.bitmask_rows = _constraint_bitmask(constraints, device, bitmask_buffer,
                                                                  seqs[0].vocab_size)
        if penalized:
            self._add_penalties(penalized, [seqs[i] for i in penalized], device, penalty_pool,
                                None if drafts is None else [drafts[i] for i in penalized], pending_from)

    def _add_penalties(self, rows: list[int], seqs: list[Sequence], device: torch.device, pool,
                       drafts: list | None = None, pending_from: tuple | None = None) -> None:
        """The penalties of batch rows `rows` (sequences `seqs`; `drafts`: the draft tokens before each), from
        `pool` (None: a pool for this batch)."""
        pending = None
        if pending_from is not None:  # three slots: rows whose input token a step in flight sampled
            # (Not a chunk verifying drafts: its inputs are its committed last token and the drafts, which `drafts`
            # counts; a sequence that speculates is never planned while a step it rides in is uncommitted.)
            chunks, logits_rows, input_ids = pending_from
            at = [(j, int(logits_rows[i])) for j, i in enumerate(rows)  # host memory (a staged numpy row)
                  if chunks[i].parent is None and not chunks[i].draft
                  and chunks[i].start + chunks[i].num_tokens > len(seqs[j].token_ids)]
            if at:
                pending = ([j for j, _ in at], [p for _, p in at], input_ids)
        self.penalties = (pool or PenaltyPool(len(rows), seqs[0].vocab_size, device)).take(rows, seqs, drafts,
                                                                                           pending)

    @classmethod
    def worst_case(cls, rows: int, device: torch.device, vocab: int) -> "SamplingBatch":
        """Every row sampled the most memory-hungry way (temperature, top-k, top-p, MAX_LOGPROBS): what the
        memory profiling pass runs (engine/memory.py)."""
        def full(value, dtype):
            return torch.full((rows,), value, dtype=dtype, device=device)
        return cls(full(1.0, torch.float32), full(False, torch.bool), full(50, torch.long), full(0.9, torch.float32),
                   None, None, [], {}, MAX_LOGPROBS, False, [], None, [], top_k_max=min(50, vocab), any_greedy=False)

    def to(self, device: torch.device) -> "SamplingBatch":
        """This batch with every tensor on `device` (the last pipeline stage's). Request generators cannot
        move: a batch for another device is built with draw_seeded."""
        if device.type == self.temperature.device.type:
            return self
        assert not self.generators, "a batch sampled on another device carries draws, not generators"

        def move(t):
            return None if t is None else t.to(device)
        return dataclasses.replace(
            self, temperature=move(self.temperature), greedy=move(self.greedy), top_k=move(self.top_k),
            top_p=move(self.top_p), min_p=move(self.min_p), bitmask=move(self.bitmask),
            penalties=None if self.penalties is None else dataclasses.replace(
                self.penalties, **{f.name: move(getattr(self.penalties, f.name))
                                   for f in dataclasses.fields(self.penalties)}),
            banned=[(row, move(ids)) for row, ids in self.banned],
            logit_bias=[(row, move(ids), move(values)) for row, ids, values in self.logit_bias],
            drawn={row: move(u) for row, u in self.drawn.items()})


def _constraint_bitmask(constraints: list, device: torch.device, buffer: torch.Tensor | None,
                        vocab_size: int) -> tuple[torch.Tensor, list[int]]:
    if buffer is None:
        buffer = allocate_bitmask(len(constraints), vocab_size)
    host = buffer[:len(constraints)]
    rows = fill_bitmask(constraints, host)
    return host.to(device, non_blocking=True), rows


class PenaltyPool:
    """The penalty inputs of penalized sequences, one row each, kept on the device from step to step and brought
    up to date with the tokens each sequence committed since its last step: a step's host work is O(new tokens)
    and its device work a few kernels, whatever the sequences' lengths and the number of penalized rows.
    It replaced rebuilding every row's inputs from its whole sequence at every step, then applying them a row at a
    time: O(length) of host work per row and step, and kernels per row, for every request of a model whose
    generation_config sets a repetition_penalty (Qwen2.5-Instruct: 1.05); docs/engine.md#sampler measures both.

    `seen` [rows, V] bool: the tokens of prompt + output (repetition penalty); `counts` [rows, V] int32: each
    token's occurrences in the output (presence / frequency); `values` [rows, 3]: each row's repetition, presence
    and frequency penalties. `seen` and `counts` are allocated when a sequence first needs them, and all are
    grown by doubling up to `max_rows` (the runner's: twice max_num_seqs, as the block tables). A sequence's row
    is `Sequence.penalty_row` while the pool's owner of that row is the sequence; rows of sequences that left
    (finished, or holding no blocks with nothing in flight) are reclaimed when the pool runs short, and a
    sequence that lost its row (preempted meanwhile) gets a new one filled from its whole text. Each step's
    batch reads copies of its rows (`take`), so reusing a row never changes an in-flight step."""

    GROWTH_MIN = 16

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device):
        self.max_rows, self.vocab_size, self.device = max_rows, vocab_size, device
        self.seen: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        # device "meta": the simulated device's pool (engine/sim/runner.py), its rows and the host's work only
        self.modelled = device.type == "meta"
        self.values = torch.zeros(0, 3, dtype=torch.float32, device=device)  # [rows, 3]: each row's penalties
        self._true = torch.ones((), dtype=torch.bool, device=device)
        self.capacity = 0
        self._owner: list[Sequence | None] = []
        self._applied: list[int] = []  # token ids of the row's sequence already in its row
        self._kinds: list[tuple[bool, bool, int]] = []  # (repetition, presence or frequency, prompt length)
        self._free: list[int] = []

    def take(self, rows: list[int], seqs: list[Sequence], drafts: list | None = None,
             pending: tuple | None = None) -> PenaltyRows:
        """The penalties of batch rows `rows` (of sequences `seqs`), their pool rows updated first. Per row only
        a few list operations (the common row adds the one token its last step committed); the rest is a few
        device operations for every row at once.

        `drafts`: per row, the draft tokens before its position (engine/spec_decode.py: a chunk verifying k
        drafts has k + 1 rows of one sequence, row j after drafts[:j]). They count as output in that row's copy
        only, never in the pool: whether they are accepted is known at the commit, which appends what was.
        `pending`: (indices into `seqs`, where each one's input token is in the step's input_ids, those input_ids)
        for rows whose input token is not committed yet (three slots): PenaltyRows.pending."""
        owner, applied, kinds = self._owner, self._applied, self._kinds
        slots, seen_rows, seen_ids, count_rows, count_ids = [], [], [], [], []
        any_rep = any_count = False
        for seq in seqs:
            r = seq.penalty_row
            if r is None or r >= self.capacity or owner[r] is not seq:
                r = self._assign(seq)
            slots.append(r)
            rep, counted, prompt_len = kinds[r]
            any_rep, any_count = any_rep or rep, any_count or counted
            ids, start = seq.token_ids, applied[r]
            end = len(ids)
            if start == end:
                continue
            applied[r] = end
            if end - start == 1:  # a decode step's row: the token its previous step committed
                token = ids[start]
                if rep:
                    seen_rows.append(r)
                    seen_ids.append(token)
                if counted and start >= prompt_len:
                    count_rows.append(r)
                    count_ids.append(token)
                continue
            if rep:  # a row new to the pool (its prompt and output), or one that committed several tokens
                new = ids[start:].tolist()  # host memory (an int64 array)
                seen_rows += [r] * len(new)
                seen_ids += new
            if counted:
                new = ids[max(start, prompt_len):].tolist()  # host memory
                count_rows += [r] * len(new)
                count_ids += new
        draft_seen = draft_counts = None
        if drafts is not None:
            draft_seen, draft_counts = _draft_entries(drafts, slots, kinds)
        if self.modelled:  # the simulated device: the host's work here is real, the kernels below are priced
            to_device(slots, torch.long, _CPU)  # (the slots' upload, as below)
            if pending is not None:
                to_device(pending[:2], torch.long, _CPU)
            values = torch.empty(len(slots), 3)  # not read: the simulated sampler applies no penalties
            return PenaltyRows(to_device(rows, torch.long, _CPU), values[:, 0:1], values[:, 1:2], values[:, 2:3],
                               None, None)
        if seen_ids:
            where = to_device([seen_rows, seen_ids], torch.long, self.device)
            self._table("seen").index_put_((where[0], where[1]), self._true)
        if count_ids:
            where = to_device([count_rows, count_ids], torch.long, self.device)
            # accumulate: a token twice among the new ones counts twice (no bincount: on CUDA it reads back a size)
            self._table("counts").index_put_((where[0], where[1]),
                                             torch.ones(where.shape[1], dtype=torch.int32, device=self.device),
                                             accumulate=True)
        slot = to_device(slots, torch.long, self.device)
        values = self.values[slot]  # [r, 3]: repetition, presence, frequency
        seen = self._table("seen")[slot] if any_rep else None  # (copies: gathered by index)
        counts = self._table("counts")[slot] if any_count else None  # (none yet: no output so far)
        if draft_seen:
            where = to_device(draft_seen, torch.long, self.device)
            seen.index_put_((where[0], where[1]), self._true)
        if draft_counts:
            where = to_device(draft_counts, torch.long, self.device)
            counts.index_put_((where[0], where[1]), torch.ones(where.shape[1], dtype=torch.int32, device=self.device),
                              accumulate=True)
        if pending is not None:
            where = to_device(pending[:2], torch.long, self.device)
            pending = (where[0], where[1], pending[2])
        return PenaltyRows(to_device(rows, torch.long, self.device), values[:, 0:1], values[:, 1:2], values[:, 2:3],
                           seen, counts, pending)

    def _table(self, name: str) -> torch.Tensor:
        t = getattr(self, name)
        if t is None:
            t = torch.zeros(self.capacity, self.vocab_size, dtype=torch.bool if name == "seen" else torch.int32,
                            device=self.device)
            setattr(self, name, t)
        return t

    def _assign(self, seq: Sequence) -> int:
        if not self._free:
            self._reclaim()
        if not self._free:
            self._grow()
        r = self._free.pop()
        p = seq.params
        self._owner[r], self._applied[r] = seq, 0
        self._kinds[r] = (p.repetition_penalty != 1.0, bool(p.presence_penalty or p.frequency_penalty),
                          len(seq.prompt_token_ids))
        seq.penalty_row = r
        if not self.modelled:
            self.values[r] = to_device([p.repetition_penalty, p.presence_penalty, p.frequency_penalty],
                                       torch.float32, self.device)
            for t in (self.seen, self.counts):
                if t is not None:
                    t[r].zero_()
        return r

    def _reclaim(self) -> None:
        for r, seq in enumerate(self._owner):
            if seq is not None and (seq.penalty_row != r or seq.finalized or seq.released or
                                    (not seq.block_table and not seq.inflight_refs)):
                self._owner[r] = None
                if seq.penalty_row == r:
                    seq.penalty_row = None
                self._free.append(r)

    def _grow(self) -> None:
        old = self.capacity
        new = min(self.max_rows, max(self.GROWTH_MIN, 2 * old))
        if new <= old:
            raise RuntimeError(f"all {old} penalty rows are held by sequences still running")
        for name in ("seen", "counts", "values"):
            t = getattr(self, name)
            if t is not None and not self.modelled:
                grown = torch.zeros(new, t.shape[1], dtype=t.dtype, device=self.device)
                grown[:old] = t
                setattr(self, name, grown)
        self.capacity = new
        self._owner += [None] * (new - old)
        self._applied += [0] * (new - old)
        self._kinds += [(False, False, 0)] * (new - old)
        self._free += range(new - 1, old - 1, -1)


@dataclass(slots=True)
class PenaltyRows:
    """One step's penalized rows, applied together: their batch rows, per-row penalties [r, 1], and copies of
    their pool rows (gathered when the batch is built: the pool may change before the step samples)."""

    rows: torch.Tensor  # [r] int64: rows of the batch
    repetition: torch.Tensor  # [r, 1] float32 (1.0: none)
    presence: torch.Tensor  # [r, 1] float32
    frequency: torch.Tensor  # [r, 1] float32
    seen: torch.Tensor | None  # [r, V] bool: the tokens of prompt + output (None: no row has a repetition penalty)
    counts: torch.Tensor | None  # [r, V] int32: occurrences in the output (None: no presence or frequency)
    # Three slots (EngineConfig.pipeline_depth=3): rows whose input token a step still in flight sampled, so the
    # pool cannot hold it yet: (their indices among these rows [m], where the token is in `input_ids` [m], the
    # step's device input_ids). The sampling adds those tokens to `seen` and `counts` first (add_pending_tokens),
    # on the device and in stream order after the forward gathered them. None: every input token is committed.
    pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __reduce__(self):
        """Pickled (a pipeline step's StageBatch goes to every stage) as the tables' set entries, not [r, V]: a
        row's seen tokens and counts are a few thousand of a vocabulary's 50-250 thousand."""
        assert self.pending is None, "pending tokens are a single device's (three slots)"
        return _dense_penalty_rows, (self.rows, self.repetition, self.presence, self.frequency,
                                     _entries(self.seen), _entries(self.counts))


def _draft_entries(drafts: list, slots: list[int], kinds: list) -> tuple[list | None, list | None]:
    """[batch rows, token ids] of the draft tokens before each row: to mark seen (rows with a repetition
    penalty), and to count (rows with presence or frequency); None where there are none."""
    seen_rows, seen_ids, count_rows, count_ids = [], [], [], []
    for i, tokens in enumerate(drafts):
        if tokens:
            rep, counted, _ = kinds[slots[i]]
            if rep:
                seen_rows += [i] * len(tokens)
                seen_ids += tokens
            if counted:
                count_rows += [i] * len(tokens)
                count_ids += tokens
    return ([seen_rows, seen_ids] if seen_ids else None), ([count_rows, count_ids] if count_ids else None)


def _entries(table: torch.Tensor | None):
    if table is None:
        return None
    r, v = table.nonzero(as_tuple=True)
    return tuple(table.shape), table.dtype, r.to(torch.int32), v.to(torch.int32), table[r, v]


def _dense_penalty_rows(rows, repetition, presence, frequency, seen, counts) -> PenaltyRows:
    def dense(entries):
        if entries is None:
            return None
        shape, dtype, r, v, values = entries
        return torch.zeros(shape, dtype=dtype, device=values.device).index_put_((r.long(), v.long()), values)
    return PenaltyRows(rows, repetition, presence, frequency, dense(seen), dense(counts))


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device` without a synchronizing copy (on CUDA: pinned, non-blocking;
    the caching host allocator keeps the pinned block until the copy has run)."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def _uploader(device: torch.device, buffers):
    """put(field, values, n, dtype) -> n values on `device` (`values`: a sequence, or one scalar for every
    row): into the slot's fixed buffers when given."""
    if buffers is not None:
        return lambda name, values, n, dtype: buffers.put(name, values, n)

    def put(name, values, n, dtype):
        return to_device([values] * n if not isinstance(values, tuple) else list(values), dtype, device)
    return put


@dataclass(slots=True)
class SamplerOutput:
    tokens: torch.Tensor  # [R] int64
    logprobs: torch.Tensor | None  # [R] float32: logprob of the chosen token under the raw model
    top_ids: torch.Tensor | None  # [R, k] int64
    top_logprobs: torch.Tensor | None  # [R, k] float32


class Sampler:
    """Turns the step's logits rows into tokens. Logprobs are of the raw model distribution."""

    def __init__(self, seed: int, device: torch.device):
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        raw = logits  # [R, V] float32
        if batch.penalties or batch.banned or batch.logit_bias or batch.bitmask_rows:
            logits = self._edit_logits(logits.clone(), batch)
        if batch.all_greedy:
            tokens = argmax(logits)
        elif batch.any_greedy:
            tokens = torch.where(batch.greedy, argmax(logits), self._sample(logits, batch))
        else:  # no row reads the argmax, a pass over every logit, so skip it
            tokens = self._sample(logits, batch)
        if batch.num_logprobs < 0:
            return SamplerOutput(tokens, None, None, None)
        lp = torch.log_softmax(raw, dim=-1)
        chosen = lp.gather(1, tokens[:, None])[:, 0]
        if batch.num_logprobs == 0:
            return SamplerOutput(tokens, chosen, None, None)
        top_lp, top_ids = lp.topk(batch.num_logprobs, dim=-1)
        return SamplerOutput(tokens, chosen, top_ids, top_lp)

    @classmethod
    def _edit_logits(cls, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Penalties, then min_tokens bans, logit_bias, and last the constraint mask (so nothing a
        constraint forbids can come back)."""
        logits = cls._apply_penalties(logits, batch)
        for row, ids in batch.banned:
            logits[row].index_fill_(0, ids, _NEG_INF)  # a scalar argument: `logits[row, ids] = x` copies x
            # from the host, a synchronizing copy on CUDA (caught by torch's sync debug mode)
        for row, ids, values in batch.logit_bias:
            logits[row].index_add_(0, ids, values)
        if batch.bitmask_rows:
            apply_bitmask(logits, batch.bitmask, batch.bitmask_rows)
        return logits

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """repetition (HF/CTRL: over prompt + output), presence and frequency (OpenAI: over output), every
        penalized row at once (a row without one of them gets the identity: x * 1, x / 1, x - 0)."""
        pen = batch.penalties
        if pen is None:
            return logits
        if pen.pending is not None:
            add_pending_tokens(pen)
        return penalize_rows(logits, pen) if logits.is_cuda else penalize_entries(logits, pen)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        logits = logits / batch.temperature[:, None]
        if batch.top_k is not None:  # topk of the largest k asked for, not a sort of the whole vocabulary
            k = min(batch.top_k_max, logits.shape[-1])
            kth = logits.topk(k, dim=-1).values.gather(1, (batch.top_k.clamp(max=k) - 1)[:, None])
            kth = kth.masked_fill(batch.top_k[:, None] > k, _NEG_INF)  # rows without top_k (or k >= vocab)
            logits = logits.masked_fill(logits < kth, _NEG_INF)
        probs = logits.softmax(dim=-1)
        if batch.top_p is not None:
            probs = _top_p(probs, batch.top_p)
        if batch.min_p is not None:
            probs = probs.masked_fill(probs < batch.min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
        u = torch.rand((probs.shape[0], 1), dtype=torch.float64, generator=self.generator, device=probs.device)
        for row, gen in batch.generators.items():  # seeded: the draw depends only on the request's own generator
            u[row] = torch.rand((1,), dtype=torch.float64, generator=gen, device=probs.device)
        for row, drawn in batch.drawn.items():  # seeded, drawn where the batch was built
            u[row] = drawn
        return inverse_cdf(probs, u)


def add_pending_tokens(pen: PenaltyRows) -> None:
    """Count each pending row's uncommitted input token (PenaltyRows.pending) in the row's copies: seen, and one
    more occurrence in the output (it was sampled, so it is output). Read and written on the device."""
    k, at, input_ids = pen.pending
    tokens = input_ids[at]
    if pen.seen is not None:
        pen.seen[k, tokens] = True
    if pen.counts is not None:
        pen.counts.index_put_((k, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)


def penalize_rows(logits: torch.Tensor, pen: PenaltyRows) -> torch.Tensor:
    """The penalties over the penalized rows whole (CUDA: no step reads anything back from the device)."""
    sub = logits[pen.rows]
    if pen.seen is not None:
        sub = torch.where(pen.seen, torch.where(sub < 0, sub * pen.repetition, sub / pen.repetition), sub)
    if pen.counts is not None:
        counts = pen.counts.to(sub.dtype)
        sub = sub - (pen.frequency * counts + pen.presence * (counts > 0).to(sub.dtype))
    logits[pen.rows] = sub  # (indices on the device: no sync)
    return logits


def penalize_entries(logits: torch.Tensor, pen: PenaltyRows) -> torch.Tensor:
    """penalize_rows' result computed at the entries a penalty changes only: the seen tokens, and those with a
    count (elsewhere the whole-row formula subtracts 0). On CPU a fraction of its cost; on CUDA finding the
    entries would read their number back (a sync)."""
    if pen.seen is not None:
        r, v = pen.seen.nonzero(as_tuple=True)
        rows, factor = pen.rows[r], pen.repetition[r, 0]
        vals = logits[rows, v]
        logits[rows, v] = torch.where(vals < 0, vals * factor, vals / factor)
    if pen.counts is not None:
        r, v = pen.counts.nonzero(as_tuple=True)
        rows, counts = pen.rows[r], pen.counts[r, v].to(logits.dtype)
        logits[rows, v] -= pen.frequency[r, 0] * counts + pen.presence[r, 0]
    return logits


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of [R, V], the first index on ties, as `argmax` gives. On CPU `argmax(dim=-1)` is a
    slow reduction, several times slower than `max(dim=-1).indices`, which gives the same indices
    (docs/engine.md#sampler)."""
    return x.max(dim=-1).indices


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row of `probs` [R, V] (non-negative, each row's sum > 0, not necessarily 1): the first token
    whose cumulative mass exceeds u * the row's mass, u [R, 1] float64 uniform in [0, 1). Sums in float64, so
    every token's share of the interval is its probability to ~1e-16 (float32 sums over 49,152 tokens could
    move ~6e-8 of mass per token); a zero-probability token has an empty interval and is never drawn. A row
    with no mass at all (a constraint that allows no token: NaN after the softmax) gets an index in range all
    the same; the structured-output path ends such a request."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    total = cdf[:, -1:]
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))  # below the total, always
    return torch.searchsorted(cdf, x, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of tokens whose mass reaches top_p (the top token always stays): in descending
    order, a token stays while the mass before it is under top_p.

    On CPU each row's nucleus is looked for among its k + 1 most likely tokens (topk) for each k of
    TOP_P_CANDIDATES in turn, and a row whose last candidate is still inside the nucleus goes on to the next k,
    then to a sort of the whole row. The kept tokens are the sort's: the same values in the same order, so the
    same running sums. On other devices the sort is cheap and never waits on the host: every row is sorted."""
    if probs.device.type != "cpu":
        return _top_p_sorted(probs, top_p)
    out = torch.zeros_like(probs)
    rows = torch.arange(probs.shape[0])  # rows whose nucleus is not found yet
    for k in TOP_P_CANDIDATES:
        if k + 1 >= probs.shape[-1]:
            break
        pending = probs if len(rows) == probs.shape[0] else probs[rows]  # no copy while every row is pending
        top, idx = pending.topk(k + 1, dim=-1)  # sorted, descending
        kept = _nucleus(top, top_p[rows])
        fits = kept[:, -1] == 0  # host tensors: no device to wait on
        out[rows[fits, None], idx[fits, :-1]] = kept[fits, :-1]
        rows = rows[~fits]
        if not len(rows):
            return out
    out[rows] = _top_p_sorted(probs[rows], top_p[rows])
    return out


def _top_p_sorted(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    return torch.zeros_like(probs).scatter_(1, idx, _nucleus(sorted_p, top_p))


def _nucleus(sorted_p: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Rows sorted in descending order, zeroed past the nucleus."""
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    return sorted_p.masked_fill(mass_before >= top_p[:, None], 0.0)
