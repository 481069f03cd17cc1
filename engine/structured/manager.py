"""Structured output for the engine loop: compiles off the loop, masks at finalize, advances at commit.

Photon's commit-before-finalize ordering makes this rollback-free: the mask for step t+1 is built after
step t is committed (its token accepted by the request's matcher), so a matcher only ever sees tokens
that were actually committed, each exactly once. A sequence recomputed after preemption (soft reset)
replays its committed tokens through the forward only; its matcher is not touched again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.sampling_params import SamplingParams
from engine.structured.backend import (CompiledGrammar, GrammarBackend, GrammarMatcher, fill_bitmask_batch,
                                       ids_to_bitmask)

COMPILE_WORKERS = 4  # a slow schema holds one worker; xgrammar releases the GIL while it compiles
CACHE_SIZE = 512  # compiled grammars kept per engine (= per tokenizer)


class TokenConstraint:
    """One request's constraint state: its grammar matcher and/or its allowed_token_ids mask."""

    __slots__ = ("matcher", "allowed")

    def __init__(self, matcher: GrammarMatcher | None, allowed: torch.Tensor | None):
        self.matcher = matcher
        self.allowed = allowed  # [ceil(V/32)] int32, allowed_token_ids as a bitmask row

    def accept(self, token: int) -> bool:
        """Advance at commit; False when the grammar rejects the token (nothing was allowed)."""
        return self.matcher is None or self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the request is done."""
        return self.matcher is not None and self.matcher.is_terminated()

    @property
    def completed(self) -> bool:
        """The output so far is a complete match (it may still go on, e.g. more digits)."""
        return self.matcher is None or self.matcher.is_completed()


class StructuredOutputManager:
    """Compiles constraints on a thread pool, caches compiled grammars by (kind, spec, layout), builds
    per-request constraint state and fills the step's bitmask."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self.backend = GrammarBackend(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = self.backend.vocab_size
        self._pool = ThreadPoolExecutor(max_workers=COMPILE_WORKERS, thread_name_prefix="tandem-grammar")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiles = 0

    # ---- compilation (any thread) ----------------------------------------------------------------------
    def compile_async(self, params: SamplingParams) -> Future | None:
        """The future compiled grammar of a request, or None when it needs none. Never blocks: a cache
        hit returns the (possibly still running) compile of an earlier request."""
        so = params.structured_outputs
        if so is None:
            return None
        with self._lock:
            fut = self._cache.get(so.cache_key)
            if fut is None or fut.cancelled():
                fut = self._pool.submit(self.backend.compile, so)
                self._cache[so.cache_key] = fut
                self.num_compiles += 1
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(so.cache_key)
        return fut

    def timed_out(self, params: SamplingParams, compiled: Future, timeout_s: float) -> ValueError:
        """The error for a request whose grammar did not compile within `timeout_s`. A compile still queued
        is cancelled; one already running cannot be stopped (xgrammar has no way to), so it finishes on its
        worker and its result stays cached for a later identical request."""
        if compiled.cancel():
            with self._lock:
                if self._cache.get(params.structured_outputs.cache_key) is compiled:
                    del self._cache[params.structured_outputs.cache_key]
        kind = params.structured_outputs.kind
        return ValueError(f"structured_outputs.{kind}: did not compile within {timeout_s:g} s "
                          f"(grammar_compile_timeout_s); simplify the {kind}")

    # ---- per request (engine thread) -------------------------------------------------------------------
    def constraint(self, params: SamplingParams, compiled: CompiledGrammar | None) -> TokenConstraint | None:
        if not params.constrained:
            return None
        matcher = self.backend.matcher(compiled) if compiled is not None else None
        allowed = None
        if params.allowed_token_ids is not None:
            allowed = ids_to_bitmask(params.allowed_token_ids, self.vocab_size)
        return TokenConstraint(matcher, allowed)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def fill_bitmask(constraints: list[TokenConstraint | None], bitmask: torch.Tensor) -> list[int]:
    """Write each constrained row's allowed tokens into `bitmask` [>= rows, ceil(V/32)] int32 (host) and
    return those rows; the other rows are left as they are and must not be applied."""
    grammar_rows = [i for i, c in enumerate(constraints) if c is not None and c.matcher is not None]
    if grammar_rows:
        fill_bitmask_batch([constraints[i].matcher for i in grammar_rows], bitmask, grammar_rows)
    rows = []
    for i, c in enumerate(constraints):
        if c is None:
            continue
        rows.append(i)
        if c.allowed is not None:
            if c.matcher is None:
                bitmask[i].copy_(c.allowed)
            else:
                bitmask[i].bitwise_and_(c.allowed)
    return rows
