"""CUDA graphs for decode steps: one graph per padded batch size and DecodeSlot, sharing one memory pool.

A graph bakes in the addresses it read and wrote at capture, so each slot gets its own graph set (SiPipe's
two graph sets per batch size; pegainfer's fixed-address decode buffers): the forward reads the slot's
StepBuffers and writes the slot's logits buffer, both allocated outside the pool. Per-step values reach the
graph only through those buffers, copied in before replay. Sampling stays eager.

Sizes are captured at start-up, largest first (the shared pool is sized by the largest), each after an eager
warm-up that compiles the Triton kernels. A decode batch replays the smallest graph that fits; the padding
rows are empty sequences (slot -1, seq_len 0). Prefill and mixed steps run eagerly.

`emulate=True` records the forward as a plain function replayed on the same fixed buffers: the CPU tests
use it to run the padded, buffer-driven decode path end to end without a GPU.
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


class _EmulatedGraph:
    def __init__(self, fn: Callable[[], None]):
        self._fn = fn

    def replay(self) -> None:
        self._fn()


class DecodeGraphs:
    """Captured decode forwards keyed by (slot index, padded batch size)."""

    def __init__(self, sizes: list[int], emulate: bool = False):
        self.sizes = sorted(sizes)
        self.emulate = emulate
        self._graphs: dict[tuple[int, int], object] = {}
        self.pool = None

    def padded_size(self, batch_size: int) -> int | None:
        """The smallest captured size >= batch_size; None when the batch is larger than every graph."""
        i = bisect.bisect_left(self.sizes, batch_size)
        return self.sizes[i] if i < len(self.sizes) else None

    def capture(self, slots: list[DecodeSlot], forward: Callable, block_size: int,
                stream: torch.cuda.Stream | None, progress: bool = True) -> None:
        """forward(slot, size, meta) runs the decode forward of `size` rows on `slot`'s buffers."""
        if not self.emulate:
            self.pool = torch.cuda.graph_pool_handle()
        work = [(size, slot) for size in reversed(self.sizes) for slot in slots]
        bar = _progress(len(work), progress and not self.emulate)
        for size, slot in work:
            slot.inputs.stage_padding(size)  # all rows padding: the warm-up writes no KV
            meta = slot.inputs.metadata(block_size, full_width=True, host_lists=False)
            fn = functools.partial(forward, slot, size, meta)
            self._graphs[(slot.index, size)] = self._capture_one(slot, fn, stream, warm_up=slot is slots[0])
            bar.update(1)
        bar.close()

    def _capture_one(self, slot: DecodeSlot, fn: Callable[[], None], stream, warm_up: bool):
        if self.emulate:
            return _EmulatedGraph(fn)
        with torch.cuda.stream(stream), torch.inference_mode():
            slot.inputs.upload()  # outside the graph: replays get their inputs from the forward job's upload
            if warm_up:  # eager once per size: compiles the Triton kernels before capture
                fn()
                stream.synchronize()  # sync-ok: start-up only, before capture
            graph = torch.cuda.CUDAGraph()
            # thread_local: other threads of the process (an actor's event loop) may touch CUDA meanwhile.
            with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
                fn()
        return graph

    def replay(self, slot: DecodeSlot, size: int) -> None:
        self._graphs[(slot.index, size)].replay()

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
