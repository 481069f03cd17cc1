"""CUDA graphs for every step: one graph per padded shape and DecodeSlot, all sharing one memory pool.

A graph bakes in the addresses it read and wrote at capture, so each slot gets its own graph set (SiPipe's
two graph sets per batch size; pegainfer's fixed-address decode buffers): the forward reads the slot's
StepBuffers and writes the slot's logits buffer, both allocated outside the pool. Per-step values reach the
graph only through those buffers, copied in before replay. Sampling stays eager.

Two kinds of graph (GraphPlan decides which a step replays; the simulated device asks the same plan):
- decode: `size` one-token rows, all sampled (batch sizes from capture_sizes). The padding rows are empty
  sequences (slot -1, seq_len 0).
- mixed: steps that carry prompt chunks (or drafts to verify), padded to `tokens` positions and `seqs`
  sequences (mixed_sizes: token counts 16, 32, 64, ... up to the step budget; for each, sequence counts 1, 2,
  4, ... below it). Padding positions write no KV (slot -1) and belong to no sequence; padding sequences have no
  tokens and no context; the logits of `seqs` rows are computed (rows past the step's own read row 0). The whole
  forward is captured, attention included, not pieces between attention calls as vLLM's piecewise graphs are:
  the Triton attention kernel reads every per-step value from tensors and sizes its grid from the padded
  shapes alone (engine/attention/triton_paged.py), so nothing in the step needs the host. Backends whose
  prefill path reads host values (flash-attn's max lengths) say so (`supports_mixed_graphs`) and run these
  steps eagerly; so do steps scoring prompt tokens and mixture-of-experts models.

Shapes are captured at start-up, largest first (the shared pool is sized by the largest), each after an eager
warm-up that compiles the Triton kernels. A step replays the smallest graph that fits, else runs eagerly.

`emulate=True` records the forward as a plain function replayed on the same fixed buffers: the CPU tests
use it to run the padded, buffer-driven path end to end without a GPU.
"""

from __future__ import annotations

import bisect
import functools
from typing import Callable

import torch

from engine.slot import DecodeSlot


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_batch_size (which is always included)."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch_size] + list(range(16, max_batch_size + 1, 8))
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


MIN_MIXED_TOKENS = 16
MAX_GRAPH_BATCH_SIZE = 512  # decode batches past it run in mixed-step graphs, or eagerly without them


def mixed_sizes(max_tokens: int, max_seqs: int) -> list[tuple[int, int]]:
    """(tokens, sequences) of the mixed-step graphs: tokens 16, 32, 64, ... and max_tokens (always included);
    for each, sequences 1, 2, 4, ... and the most below the token count (at most max_seqs). Fewer sequences
    than tokens keeps the attention kernel in its prefill mode (a step of one token per sequence is a decode)."""
    if max_tokens < 2 or max_seqs < 1:
        raise ValueError(f"mixed-step graphs need max_tokens >= 2 and max_seqs >= 1, got {max_tokens}, {max_seqs}")
    tokens, t = [], min(MIN_MIXED_TOKENS, max_tokens)
    while t < max_tokens:
        tokens.append(t)
        t *= 2
    tokens.append(max_tokens)
    pairs = []
    for t in tokens:
        cap = min(max_seqs, t - 1)
        seqs = [s for s in (1 << i for i in range(cap.bit_length())) if s < cap] + [cap]
        pairs += [(t, s) for s in seqs]
    return pairs


class GraphPlan:
    """Which captured graph a step replays, from its shape alone: the CUDA runner and the simulated device
    decide with the same plan."""

    def __init__(self, decode_sizes: list[int], mixed: list[tuple[int, int]] = ()):
        self.decode_sizes = sorted(decode_sizes)
        self.mixed = sorted(mixed)
        self._mixed_tokens = sorted({t for t, _ in self.mixed})
        self._mixed_seqs = {t: sorted(s for tt, s in self.mixed if tt == t) for t in self._mixed_tokens}

    def padded_size(self, batch_size: int) -> int | None:
        """The smallest decode graph >= batch_size; None when the batch is larger than every one."""
        i = bisect.bisect_left(self.decode_sizes, batch_size)
        return self.decode_sizes[i] if i < len(self.decode_sizes) else None

    def mixed_key(self, num_tokens: int, num_seqs: int, num_rows: int) -> tuple[int, int] | None:
        """The smallest mixed graph holding a step of these tokens, sequences and sampling rows (its logits rows
        are one per graph sequence); None when none does."""
        need = max(num_seqs, num_rows)
        for t in self._mixed_tokens[bisect.bisect_left(self._mixed_tokens, num_tokens):]:
            seqs = self._mixed_seqs[t]
            i = bisect.bisect_left(seqs, need)
            if i < len(seqs):
                return t, seqs[i]
        return None

    def for_step(self, step) -> tuple[int, int | None] | None:
        """(graph size, graph sequences) of the graph `step` (engine.slot.Step) replays: (size, None) for a
        decode graph, (tokens, seqs) for a mixed one; None: eager. A step scoring prompt tokens reads every
        position's hidden state, which no graph returns."""
        chunks = step.chunks
        if step.is_decode:
            size = self.padded_size(len(chunks))
            if size is not None or not self.mixed:
                return None if size is None else (size, None)
        if not self.mixed or step.prompt_logprobs is not None:
            return None
        return self.mixed_key(step.num_tokens, len(chunks), len(step.sample_chunks))


def engine_plan(max_num_seqs: int, max_tokens: int, mixed: bool, max_batch_size: int | None = None) -> GraphPlan:
    """The graphs an engine captures, for the CUDA runner and the simulated device alike: decode batches up to
    max_batch_size (default max_num_seqs; at most MAX_GRAPH_BATCH_SIZE) and, with `mixed`, the mixed-step shapes
    up to the step budget `max_tokens`."""
    limit = min(max_batch_size or max_num_seqs, max_num_seqs, MAX_GRAPH_BATCH_SIZE)
    return GraphPlan(capture_sizes(limit), mixed_sizes(max_tokens, max_num_seqs) if mixed else [])


class _EmulatedGraph:
    def __init__(self, fn: Callable[[], None]):
        self._fn = fn

    def replay(self) -> None:
        self._fn()


class StepGraphs:
    """Captured forwards keyed by (slot index, tokens, sequences): a decode graph of `size` rows is (size, size)."""

    def __init__(self, plan: GraphPlan, emulate: bool = False):
        self.plan = plan
        self.emulate = emulate
        self._graphs: dict[tuple[int, int, int], object] = {}
        self.pool = None

    def capture(self, slots: list[DecodeSlot], decode: Callable, mixed: Callable, block_size: int,
                stream: torch.cuda.Stream | None, progress: bool = True) -> None:
        """decode(slot, size, meta) runs the decode forward of `size` rows on `slot`'s buffers; mixed(slot, tokens,
        seqs, meta) a mixed step's padded to those counts. Largest first: the shared pool is sized by the first."""
        if not self.emulate:
            self.pool = torch.cuda.graph_pool_handle()
        shapes = sorted([(size, size) for size in self.plan.decode_sizes] + list(self.plan.mixed), reverse=True)
        work = [(shape, slot) for shape in shapes for slot in slots]
        bar = _progress(len(work), progress and not self.emulate)
        for (tokens, seqs), slot in work:
            slot.inputs.stage_padding(seqs, tokens)  # padding only: the warm-up writes no KV
            meta = slot.inputs.metadata(block_size, full_width=True, host_lists=False)
            fn = functools.partial(decode, slot, seqs, meta) if tokens == seqs else \
                functools.partial(mixed, slot, tokens, seqs, meta)
            self._graphs[(slot.index, tokens, seqs)] = self._capture_one(slot, fn, stream, warm_up=slot is slots[0])
            bar.update(1)
        bar.close()

    def _capture_one(self, slot: DecodeSlot, fn: Callable[[], None], stream, warm_up: bool):
        if self.emulate:
            return _EmulatedGraph(fn)
        with torch.cuda.stream(stream), torch.inference_mode():
            slot.inputs.upload()  # outside the graph: replays get their inputs from the forward job's upload
            if warm_up:  # eager once per shape: compiles the Triton kernels before capture
                fn()
                stream.synchronize()  # sync-ok: start-up only, before capture
            graph = torch.cuda.CUDAGraph()
            # thread_local: other threads of the process (an actor's event loop) may touch CUDA meanwhile.
            with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
                fn()
        return graph

    def replay(self, slot: DecodeSlot, size: int, seqs: int | None = None) -> None:
        """The decode graph of `size` rows (seqs None), or the mixed graph of `size` tokens and `seqs` sequences."""
        self._graphs[(slot.index, size, size if seqs is None else seqs)].replay()

    def __len__(self) -> int:
        return len(self._graphs)


def _progress(total: int, enabled: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm comes with transformers; keep capture working without it
        enabled = False
    if not enabled:
        return _NoBar()
    return tqdm(total=total, desc="Capturing CUDA graphs", unit="graph")


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass
