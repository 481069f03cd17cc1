"""Speculative decoding with an n-gram proposer (prompt lookup), verified in one forward of the target model.

How a step speculates (engine/scheduler.py `_add_drafts`, engine/step_buffers.py, Scheduler.update_from_output):
- A decoding sequence whose last token is committed gets up to K draft tokens: the tokens that followed the most
  recent earlier occurrence of its last n tokens (n from prompt_lookup_max down to prompt_lookup_min), in its
  prompt and output. Its chunk then computes 1 + k positions, its last committed token and the k drafts, and
  every position is a sampling row.
- Each row is sampled as usual from the target's distribution at that position. The commit accepts drafts while
  the row before each sampled exactly that draft; the first row that sampled something else gives the next
  token, and when all k are accepted the last row gives one more. With a draft that is one fixed token (n-gram
  proposals are), this is Leviathan et al.'s rejection sampling: a draft d at a row with target distribution p
  is accepted with probability p(d), and on rejection the row's token is distributed as p without d,
  renormalized; so every emitted token is a sample of the target given the tokens before it, and greedy
  output is the non-speculative output token for token.
- The KV of rejected positions is left where it is: the sequence's computed length is set back to the accepted
  prefix, later steps overwrite those positions before anything reads them, and a block is hashed for the
  prefix cache only once the tokens it holds are committed.

The two-slot pipeline: a step's drafts come from its sequence's committed tokens, and how many of them will be
accepted is known only at its commit, so a speculating sequence never rides in two steps at once (the scheduler
waits for its commit instead of launching it again). Its step is then not overlapped with the host work of the
one before; speculation pays only while a step's accepted tokens outweigh that, which is why it turns itself
off above `disable_by_batch_size` running sequences (by default 32, where it stopped paying on CPU, or fewer when
the drafts of every running sequence would no longer fit a step's sampling rows, max_num_seqs).

Requests that speculate: decoding, no grammar or allowed_token_ids, no repetition/presence/frequency penalty and
no min_tokens still to wait for (those read the output so far at every row, drafts included). Others decode one
token a step as before, in the same steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

METHODS = ("ngram",)
# disable_by_batch_size's default: above this many running sequences speculation stopped paying on CPU
# (measured: bench/README.md#speculative-decoding-bench_specpy). Not measured on a GPU.
DEFAULT_BATCH_LIMIT = 32


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` for the n-gram method; `from_dict` validates what users pass."""

    method: str = "ngram"
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
        if "model" in d and d.get("method", "draft_model") in ("draft_model", None):
            raise ValueError("speculative_config: a draft model (\"model\") is not supported yet; use "
                             "{\"method\": \"ngram\", \"num_speculative_tokens\": K, ...}")
        method = d.get("method", "ngram")
        if method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(METHODS)}; got {method!r}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {', '.join(unknown)}; valid: "
                             f"{', '.join(sorted(known))}")
        cfg = cls(**d)
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
            return token_ids[start:start + k]
    return []
