"""A request's state inside the engine: tokens, KV bookkeeping, pipeline refcounts."""

from __future__ import annotations

import enum
import sys
import time
from array import array

import torch

from engine.sampling_params import SamplingParams


# Sequence.sample_row: a request's sampling parameters as one tuple, made once (engine/sampler.py reads it
# every step); SPECIAL flags what needs per-row work: SPECIAL_PENALTIES (repetition, presence, frequency: done
# for all rows at once) and SPECIAL_OTHER (min_tokens, logit_bias, seed, logprobs, constraints: a row at a time).
ROW_TEMPERATURE, ROW_GREEDY, ROW_TOP_K, ROW_TOP_P, ROW_MIN_P, ROW_SPECIAL = range(6)
SPECIAL_PENALTIES, SPECIAL_OTHER = 1, 2
TOP_K_OFF = 1 << 30


def sample_row(p: SamplingParams) -> tuple:
    special = (SPECIAL_PENALTIES if p.needs_penalties else 0) | (
        SPECIAL_OTHER if (p.min_tokens > 0 or bool(p.logit_bias) or p.seed is not None or p.logprobs is not None
                          or p.constrained) else 0)
    return (p.temperature if p.temperature > 0 else 1.0, p.greedy, p.top_k if p.top_k > 0 else TOP_K_OFF,
            p.top_p, p.min_p, special)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # offloaded to the host KV pool; holds no device blocks
    FINISHED = "finished"


class Sequence:
    """One request.

    Token accounting (the pipeline runs one step ahead of the CPU):
      token_ids      prompt + committed output tokens, known on the host: an int64 `array` (as is
                     prompt_token_ids), not a list. A list holds one object per token, and the garbage collector
                     visits every one of them each time it scans a young sequence; it never looks into an
                     array's elements. With hundreds of running sequences that made each collection on the engine
                     loop cost milliseconds, growing with their lengths (docs/engine.md#host-work-per-step).
      num_pending    tokens sampled by launched steps but not yet committed (at most one per step in flight).
                     The next forward reads a pending token straight from the device buffer it was sampled into.
      num_computed   positions whose KV has been written by a launched forward (scheduled, in stream order).
    A sequence wants `num_total - num_computed` more positions computed; a chunk that reaches num_total
    samples one new (pending) token. Decode is simply a chunk of one.

    Zombies (Photon): `finalized` is set at the commit that ends the request; `inflight_refs` counts launched
    steps that still reference it. Its blocks are freed only when both hold.
    """

    __slots__ = ("request_id", "params", "prompt", "prompt_token_ids", "token_ids", "num_pending",
                 "num_computed", "num_cached", "num_draft_computed", "block_table", "block_hashes", "window_table",
                 "window_base",
                 "cpu_window", "status", "finalized",
                 "finish_reason", "inflight_refs", "generator", "arrival_time", "first_token_time",
                 "logprobs", "stop_token", "eos_token_ids", "stop_ids", "max_total_len", "pending_src", "pending_step",
                 "released",
                 "num_emitted_tokens", "preempted", "vocab_size", "cpu_blocks", "constraint",
                 "first_scheduled_time", "sim_key", "sample_row", "prompt_hashes", "table_row",
                 "reads_commits_below", "lora", "lora_slot", "hash_root", "final_only",
                 "prompt_logprobs", "prompt_logprobs_sent", "index", "key", "forks", "cow", "penalty_row")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, eos_token_ids: frozenset[int], max_model_len: int,
                 vocab_size: int, device: torch.device | str = "cpu", index: int = 0):
        self.request_id = request_id
        # SamplingParams.n > 1: the request's samples are sequences 0..n-1 of one request id; `key` names this one
        # in the engine's request table (the plain request id for sample 0, so n = 1 costs nothing).
        self.index = index
        self.key = request_id if index == 0 else (request_id, index)
        # Sample 0 of an n > 1 request carries its siblings until the step that samples its first token is
        # planned: they then take its prompt blocks and sample from the same logits row (Scheduler._fork).
        self.forks: list[Sequence] | None = None
        self.cow = False  # its last block may be shared with a sibling: copy it before writing (copy-on-write)
        self.vocab_size = vocab_size
        self.params = params
        self.sample_row = sample_row(params)
        self.prompt = prompt
        self.prompt_token_ids = array("q", prompt_token_ids)
        self.token_ids = array("q", prompt_token_ids)
        self.num_pending = 0
        self.num_computed = 0
        self.num_cached = 0  # prompt tokens served from the prefix cache
        # A draft model's KV (engine/spec_decode.py): positions whose draft KV matches token_ids (set back on a
        # rejection, a preemption or a copy-on-write, like num_computed; the next proposal catches up from here).
        self.num_draft_computed = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hashes of this sequence's full blocks, in order
        # Sliding-window KV groups (engine/kv_groups.py): k pages per logical block; those of the blocks before
        # window_base went back to the pool (BlockManager.slide). Empty without window groups.
        self.window_table: list[int] = []
        self.window_base = 0
        self.cpu_window: list[int] | None = None  # while swapped: the host pages holding its live window pages
        self.status = SeqStatus.WAITING
        self.finalized = False
        self.finish_reason: str | None = None
        self.inflight_refs = 0
        self.released = False
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device=device)  # on the device its draws are made on
            self.generator.manual_seed(params.seed)
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None  # launch time of the first step that included it
        self.first_token_time: float | None = None
        # SamplingParams.logprobs: the committed tokens' TokenLogprobs not yet reported (the core hands them
        # out with each output and starts a new list: a request's logprobs are never copied twice).
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.stop_token = False  # finished on an EOS / stop token id (its text is not part of the output)
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.stop_ids = self.eos_token_ids | frozenset(params.stop_token_ids or ())  # a token that ends it
        budget = max_model_len if params.max_tokens is None else len(prompt_token_ids) + params.max_tokens
        self.max_total_len = min(budget, max_model_len)
        # While it holds fewer tokens than this, its sampling reads state only its commits update on the host
        # (engine.scheduler.sampling_waits_for_commit): a grammar or allowed_token_ids for its whole life, a
        # min_tokens ban until that many output tokens are committed; 0 for neither.
        self.reads_commits_below = sys.maxsize if params.constrained else \
            len(prompt_token_ids) + params.min_tokens if params.min_tokens else 0
        # Where its latest pending token is sampled: that step's slot index * max_num_seqs + its row, and the step's id
        self.pending_src: int | None = None
        self.pending_step = -1
        # Its row in the runner's engine.sampler.PenaltyPool (a cache of its penalty inputs there, updated with
        # the tokens committed since its last step; token_ids only ever grows).
        self.penalty_row: int | None = None
        self.num_emitted_tokens = 0  # output tokens already reported (CoreOutput.new_token_ids)
        # Reported only when it finishes: its frontend reads no token before the end (a request that is not
        # streamed and has no stop strings), so the core builds no output for it at every commit.
        self.final_only = False
        self.preempted = False  # offload / soft reset requested; applied when inflight_refs drains
        # While swapped: the host block holding each block-table entry (engine/cpu/block_pool.py).
        self.cpu_blocks: list[int] | None = None
        # engine.structured.TokenConstraint (grammar matcher / allowed ids), set when the request is
        # admitted; advanced only at commit, so a recompute or swap-in after preemption never replays it.
        self.constraint = None
        self.sim_key: int | None = None  # a simulated device's per-request token key (engine/sim/tokens.py)
        # (number of tokens hashed, their full blocks' chained hashes): computed once per prompt, so a
        # request waiting at the head of the queue is not re-hashed every tick (BlockManager.cached_prefix).
        self.prompt_hashes: tuple[int, list[int]] | None = None
        self.table_row: int | None = None  # its row in the runner's persistent block tables (engine/block_tables.py)
        self.lora = None  # engine.lora.adapter.LoRAAdapter the request runs under; None = the base model
        self.lora_slot = 0  # the device slot holding it while the sequence runs (engine/lora/slots.py); 0 = none
        self.hash_root = 0  # seeds its blocks' prefix-cache hash chain: the adapter's identity (0 = base model)
        # SamplingParams.prompt_logprobs: per prompt position (engine/prompt_logprobs.py), the first stays None.
        self.prompt_logprobs: list | None = \
            [None] * len(prompt_token_ids) if params.prompt_logprobs is not None else None
        self.prompt_logprobs_sent = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):].tolist()  # host memory

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_total(self) -> int:
        return len(self.token_ids) + self.num_pending

    @property
    def num_uncomputed(self) -> int:
        return self.num_total - self.num_computed

    @property
    def is_decoding(self) -> bool:
        """Past its prompt with exactly one position to compute (the last sampled token, committed or not).

        Defined the same way whether the last token is still pending (depth 2) or already committed
        (depth 1), so scheduling policies behave identically at both depths."""
        return self.num_uncomputed == 1 and self.num_computed >= len(self.prompt_token_ids)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, total={self.num_total}, computed={self.num_computed}, "
                f"blocks={self.block_table}, status={self.status.value}, finalized={self.finalized})")
