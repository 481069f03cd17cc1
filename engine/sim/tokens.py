"""Tokens of the simulated device: a deterministic function of (request, position, seed).

A request's key hashes its seed (the engine's when it has none) and its prompt, so the same request gets
the same output on every run and at either pipeline depth, and two requests with the same prompt and
seed get the same output, as greedy decoding would. Tokens are drawn from the tokenizer's own ordinary
vocabulary (no special tokens), never an EOS unless `eos_rate` asks for a realistic finish pattern (each
token ends the request with that probability, so outputs are geometric with mean 1 / eos_rate), and a
constrained row picks among the tokens its structured-output bitmask allows, so grammars really advance.
Vectorized with numpy: the simulation should add as little host time as it can to the host it measures.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from engine.sequence import Sequence

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class SimTokens:
    def __init__(self, tokenizer, eos_rate: float, seed: int):
        special = set(tokenizer.all_special_ids)
        self.candidates = np.array([t for t in range(len(tokenizer)) if t not in special], dtype=np.int64)
        if not len(self.candidates):
            raise ValueError("the tokenizer has no ordinary tokens for the simulated device to emit")
        self.eos_threshold = np.uint64(int(eos_rate * 2**64) if eos_rate < 1 else 2**64 - 1)
        self.eos_rate = eos_rate
        self.seed = seed

    def key(self, seq: Sequence) -> int:
        if seq.sim_key is None:
            seed = seq.params.seed if seq.params.seed is not None else self.seed
            data = np.asarray(seq.prompt_token_ids, dtype=np.int64).tobytes() + int(seed).to_bytes(16, "little",
                                                                                                      signed=True)
            seq.sim_key = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
        return seq.sim_key

    def sample(self, seqs: list[Sequence], positions: list[int], bitmask: torch.Tensor | None,
               bitmask_rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Tokens for these rows at these positions, and the hashes that drew them (for fake logprobs)."""
        keys = [s.sim_key for s in seqs]  # (a list comprehension: cheaper per row than np.fromiter over a generator)
        if None in keys:
            keys = [k if k is not None else self.key(s) for k, s in zip(keys, seqs)]
        keys = np.array(keys, dtype=np.uint64)
        with np.errstate(over="ignore"):
            h = _mix(keys ^ (np.asarray(positions, dtype=np.uint64) * _GOLDEN))
        tokens = self.candidates[(h % np.uint64(len(self.candidates))).astype(np.int64)]
        if self.eos_rate > 0:
            ends = np.flatnonzero(_mix(h) < self.eos_threshold)
            for r in ends:
                eos = _eos_of(seqs[r])
                if eos is not None:
                    tokens[r] = eos
        for r in bitmask_rows:
            tokens[r] = self._constrained(seqs[r], bitmask[r], int(h[r]))
        return tokens, h

    @staticmethod
    def accept_drafts(tokens: np.ndarray, h: np.ndarray, rows: list[int], drafts: list[int], rate: float) -> None:
        """Speculative decoding: set each of these rows' token to its draft with probability `rate`, decided by
        the row's hash (so the same request accepts the same drafts on every run)."""
        if not rows:
            return
        u = (_mix(h[rows] ^ _GOLDEN) >> np.uint64(11)).astype(np.float64) / 2.0**53
        hit = u < rate
        tokens[np.asarray(rows)[hit]] = np.asarray(drafts, dtype=np.int64)[hit]

    def _constrained(self, seq: Sequence, row: torch.Tensor, h: int) -> int:
        """An allowed token: an ordinary one when any is allowed (EOS instead with probability eos_rate),
        else the stop token a finished grammar allows. With nothing allowed, token 0, as an argmax over
        all -inf logits gives (the engine then ends the request)."""
        allowed = np.flatnonzero(np.unpackbits(row.numpy().view(np.uint8), bitorder="little"))  # host memory
        eos = [int(t) for t in allowed if t in seq.eos_token_ids] if _eos_of(seq) is not None else []
        ordinary = np.setdiff1d(allowed, list(seq.eos_token_ids))
        roll_eos = bool(eos) and self.eos_rate > 0 and (h >> 11) / 2**53 < self.eos_rate
        if len(ordinary) and not roll_eos:
            return int(ordinary[h % len(ordinary)])
        return eos[0] if eos else 0


def _eos_of(seq: Sequence) -> int | None:
    """The request's EOS token, unless it may not end yet (ignore_eos, or min_tokens not reached)."""
    if not seq.eos_token_ids or seq.num_output_tokens + 1 < seq.params.min_tokens:
        return None
    return min(seq.eos_token_ids)


def fake_logprobs(tokens: np.ndarray, h: np.ndarray, candidates: np.ndarray, k: int
                  ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Well-formed logprobs (negative, top-k best first, the chosen token first) derived from the hashes."""
    chosen = -((h >> np.uint64(20)) % np.uint64(400)).astype(np.float32) / 100.0 - 0.01
    if k <= 0:
        return chosen, None, None
    n = len(tokens)
    steps = (h[:, None] + np.arange(1, k, dtype=np.uint64)[None, :] * np.uint64(7919)) % np.uint64(len(candidates))
    top_ids = np.concatenate([tokens[:, None], candidates[steps.astype(np.int64)]], axis=1) if k > 1 else \
        tokens[:, None].copy()
    top_lp = chosen[:, None] - np.arange(k, dtype=np.float32)[None, :] * 0.5
    return chosen, top_ids.reshape(n, k), top_lp.astype(np.float32)
