"""Speculative decoding: a proposer drafts K tokens, one forward of the target model verifies them.

Two proposers (`SpeculativeConfig.method`, vLLM's names):
- "ngram" (prompt lookup): the tokens that followed the most recent earlier occurrence of the sequence's last n
  tokens (n from prompt_lookup_max down to prompt_lookup_min), in its prompt and output. No model, no KV.
- "draft_model": a smaller model of the target's vocabulary run greedily (engine/spec_draft.py). It has a paged KV
  cache of its own with as many pages as the target's, indexed by the same block ids (the sequence's
  `block_table`), so it needs no block accounting: the scheduler already holds a block for every position the draft
  writes. `Sequence.num_draft_computed` counts the positions whose draft KV matches the sequence's tokens: each
  proposal first catches up on the committed tokens past it (one chunk per sequence, all sequences in one
  forward), then runs K - 1 one-token steps, each feeding the previous argmax back. The verification sets it back
  to the accepted prefix, as it does the target's computed length; preemption, a swap and a copy-on-write of the
  block being written set it back too, and the next catch-up recomputes.

The scheduler stays model-free: it is given a `propose(seqs, rooms) -> drafts` callable (Propose), calls it once a
step for every speculating sequence, and each draft has at most its room of tokens.

How a step speculates (engine/scheduler.py `_add_drafts`, engine/step_buffers.py, Scheduler.update_from_output):
- A decoding sequence whose last token is committed is given room for up to K drafts (within the step's token
  budget, its sampling rows and the free blocks; blocks for the whole room are allocated before proposing, since
  a draft model writes KV at the draft positions). Its chunk then computes 1 + k positions, its last committed
  token and the k drafts, and every position is a sampling row.
- Each row is sampled as usual from the target's distribution at that position. The commit accepts drafts while
  the row before each sampled exactly that draft; the first row that sampled something else gives the next
  token, and when all k are accepted the last row gives one more. With a draft that is one fixed token (n-gram
  proposals are, and so are a draft model's greedy ones), this is Leviathan et al.'s rejection sampling: a draft
  d at a row with target distribution p is accepted with probability p(d), and on rejection the row's token is
  distributed as p without d, renormalized; so every emitted token is a sample of the target given the tokens
  before it, and greedy output is the non-speculative output token for token, whatever the proposer.
- The KV of rejected positions is left where it is: the sequence's computed length is set back to the accepted
  prefix, later steps overwrite those positions before anything reads them, and a block is hashed for the
  prefix cache only once the tokens it holds are committed.

The two-slot pipeline: a step's drafts come from its sequence's committed tokens, and how many of them will be
accepted is known only at its commit, so a speculating sequence never rides in two steps at once (the scheduler
waits for its commit instead of launching it again). Its step is then not overlapped with the host work of the
one before; speculation pays only while a step's accepted tokens outweigh that, which is why it turns itself
off above `disable_by_batch_size` running sequences (by default 32, where it stopped paying on CPU, or fewer when
the drafts of every running sequence would no longer fit a step's sampling rows, max_num_seqs).
A draft model's forwards run at schedule time, through the runner's executor: after the forward and sampling in
flight (on the compute stream on CUDA, on the forward thread on CPU when there is one), never beside them; the
proposal then waits for its draft tokens (the scheduler stages them on the host, where the commit compares them),
so the step it plans starts after the previous step's forward instead of under it.

Requests that speculate: decoding, no grammar or allowed_token_ids (their matcher advances a token at a time, at
the commit) and no min_tokens still to wait for (its ban is decided per step). Others decode one token a step as
before, in the same steps. Repetition, presence and frequency penalties do speculate: a row's
penalties count the drafts before it as output (`Step.drafts`), in a copy of its sequence's penalty row, so
each row is penalized exactly as it would be had those drafts been committed; the pool itself only ever holds
committed tokens. (Qwen2.5-Instruct's generation_config gives every request a repetition_penalty of 1.05, so
without this none of that model's requests would speculate.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:
    from engine.sequence import Sequence

METHODS = ("ngram", "draft_model")
# disable_by_batch_size's default: above this many running sequences speculation stopped paying on CPU
# (measured: bench/README.md#speculative-decoding-bench_specpy). Not measured on a GPU.
DEFAULT_BATCH_LIMIT = 32
_NGRAM_FIELDS = ("prompt_lookup_max", "prompt_lookup_min")

# The scheduler's proposer: for each sequence (its last token committed) and its room (how many drafts at most),
# up to that many draft token ids.
Propose = Callable[[list["Sequence"], list[int]], list[list[int]]]


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`: the n-gram method, or a draft model (`model`); `from_dict` validates what
    users pass."""

    method: str = "ngram"
    model: str | None = None  # draft_model: its local checkpoint directory (the target's vocabulary)
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # Speculate only while at most this many sequences run. None: DEFAULT_BATCH_LIMIT, or fewer when
    # max_num_seqs // (1 + K) is (the most sequences whose drafts all fit a step's sampling rows).
    disable_by_batch_size: int | None = None

    @classmethod
    def from_dict(cls, d: dict) -> "SpeculativeConfig":
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        method = d.get("method") or ("draft_model" if d.get("model") is not None else "ngram")
        if method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(METHODS)}; got {method!r}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {', '.join(unknown)}; valid: "
                             f"{', '.join(sorted(known))}")
        _check_method_fields(method, d)
        cfg = cls(**{**d, "method": method})
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(cfg, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config {name} must be a positive integer, got {value!r}")
        if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({cfg.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({cfg.prompt_lookup_max})")
        b = cfg.disable_by_batch_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"speculative_config disable_by_batch_size must be a positive integer or None, got {b!r}")
        return cfg


def _check_method_fields(method: str, d: dict) -> None:
    """The fields only one method reads are refused with the other; a draft model must be a local directory."""
    model = d.get("model")
    if method == "ngram":
        if model is not None:
            raise ValueError("speculative_config model is the draft_model method's (a draft model's directory); "
                             "the ngram method takes none")
        return
    given = [f for f in _NGRAM_FIELDS if f in d]
    if given:
        raise ValueError(f"speculative_config {', '.join(given)} are the ngram method's; the draft_model method "
                         "takes none")
    if not isinstance(model, str) or not model:
        raise ValueError("speculative_config method 'draft_model' needs model: the draft model's local checkpoint "
                         "directory")
    if model.lower().endswith(".gguf") or not os.path.isdir(model):
        raise ValueError(f"speculative_config model must be the draft model's local checkpoint directory "
                         f"(config.json, *.safetensors); {model!r} is not a directory")


def ngram_proposer(cfg: SpeculativeConfig) -> Propose:
    """The n-gram method as the scheduler's Propose."""
    lo, hi = cfg.prompt_lookup_min, cfg.prompt_lookup_max

    def propose(seqs: list[Sequence], rooms: list[int]) -> list[list[int]]:
        return [propose_ngram(s.token_ids, room, lo, hi) for s, room in zip(seqs, rooms)]

    return propose


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the last n tokens of `token_ids`,
    for the largest n in [min_n, max_n] that occurs; [] when none does.

    numpy over a sliding window of the ids: one vectorized compare per n, no Python loop over positions."""
    size = len(token_ids)
    if size < min_n + 1 or k < 1:
        return []
    ids = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        pattern = ids[size - n:]
        windows = np.lib.stride_tricks.sliding_window_view(ids[:size - 1], n)  # starts 0 .. size-1-n
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n  # the token after the most recent match
            return list(token_ids[start:start + k])
    return []
