"""The host KV pool and the copies that move a preempted sequence's blocks out of the device cache and back.

Layout: the device cache is [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]; the host pool
is [num_cpu_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], so one block (all layers, K and V)
is contiguous on the host and a run of consecutive host ids is one contiguous transfer. The pool is
allocated once (pinned on CUDA, so the copies are DMA) and never in the hot path.

Ordering: the runner runs a step's swaps right before its forward, in the order the scheduler issued them
(swap-outs of freed blocks before the swap-ins that may reuse them). On CPU they run on the executor that
runs the forwards, so they are ordered like any kernel. On CUDA they run on a side stream that first waits
for the compute stream (the blocks' last writer) and that the compute stream then waits for (the next
forward may overwrite a swapped-out block, or reads a swapped-in one), via events.

Host writes go through basic slices (views), never `host[idx].copy_(...)`: advanced indexing returns a
temporary and the copy would be lost.
"""

from __future__ import annotations

import torch

from engine.cpu.block_pool import contiguous_runs
from engine.kv_dtype import bytes_view
from engine.scheduler import SwapOp


class KVSwapError(RuntimeError):
    """A KV copy failed: swapped sequences' KV is no longer trustworthy, so the engine must stop (the
    replica is then replaced) rather than fail one step's requests and go on."""


def copy_blocks(kv_cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Copy whole device blocks (all layers, K and V) src -> dst, in stream order (copy-on-write of a block
    that n > 1 siblings share). The block ids go up pinned and non-blocking: a pageable upload would wait for
    the compute stream to drain."""
    pin = kv_cache.device.type == "cuda"
    idx = torch.tensor(pairs, dtype=torch.long, pin_memory=pin).to(kv_cache.device, non_blocking=True)
    kv_cache = bytes_view(kv_cache)  # an fp8 cache as bytes: index_copy_ has no fp8 kernel on CPU
    kv_cache.index_copy_(2, idx[:, 1], kv_cache.index_select(2, idx[:, 0]))


class KVOffloader:
    def __init__(self, kv_cache: torch.Tensor, num_cpu_blocks: int):
        self.kv_cache = bytes_view(kv_cache)  # [L, 2, N, bs, Hkv, D]; an fp8 cache (and its pool) as bytes
        self.device = kv_cache.device
        on_cuda = self.device.type == "cuda"
        shape = (num_cpu_blocks, kv_cache.shape[0], 2, *kv_cache.shape[3:])
        self.host = torch.zeros(shape, dtype=self.kv_cache.dtype, pin_memory=on_cuda)
        self.stream = torch.cuda.Stream(self.device) if on_cuda else None
        self.blocks_out = 0
        self.blocks_in = 0

    @property
    def bytes_per_block(self) -> int:
        return self.host[0].numel() * self.host.element_size()

    def run(self, ops: list[SwapOp]) -> None:
        """Execute swaps in issue order (on CUDA: enqueue them on the side stream)."""
        if not ops:
            return
        try:
            self._run(ops)
        except Exception as exc:
            raise KVSwapError(f"KV swap failed: {type(exc).__name__}: {exc}") from exc

    def _run(self, ops: list[SwapOp]) -> None:
        if self.stream is None:
            for op in ops:
                self._copy(op)
            return
        compute = torch.cuda.current_stream(self.device)
        ready = torch.cuda.Event()
        ready.record(compute)  # every earlier forward has written (or finished reading) these blocks
        self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream):
            for op in ops:
                self._copy(op)
        done = torch.cuda.Event()
        done.record(self.stream)
        compute.wait_event(done)  # the next forward reads swapped-in blocks / reuses swapped-out ones

    def _copy(self, op: SwapOp) -> None:
        # Pinned + non_blocking on CUDA: a pageable upload would block the engine thread until the side
        # stream (waiting on the compute stream) got there.
        idx = torch.tensor(op.device_blocks, dtype=torch.long, pin_memory=self.stream is not None)
        idx = idx.to(self.device, non_blocking=True)
        if op.direction == "out":
            self._out(idx, op.cpu_blocks)
            self.blocks_out += len(op.cpu_blocks)
        else:
            self._in(idx, op.cpu_blocks)
            self.blocks_in += len(op.cpu_blocks)

    def _out(self, idx: torch.Tensor, cpu_blocks: list[int]) -> None:
        # One gather per request: [L, 2, n, bs, Hkv, D] -> [n, L, 2, bs, Hkv, D] in the host layout.
        data = self.kv_cache.index_select(2, idx).permute(2, 0, 1, 3, 4, 5).contiguous()
        for pos, first, n in contiguous_runs(cpu_blocks):
            self.host[first:first + n].copy_(data[pos:pos + n], non_blocking=True)

    def _in(self, idx: torch.Tensor, cpu_blocks: list[int]) -> None:
        runs = contiguous_runs(cpu_blocks)
        if len(runs) == 1 and self.stream is None:
            data = self.host[runs[0][1]:runs[0][1] + runs[0][2]]  # a view: no extra host copy
        else:
            data = torch.empty((len(cpu_blocks), *self.host.shape[1:]), dtype=self.host.dtype, device=self.device)
            for pos, first, n in runs:
                data[pos:pos + n].copy_(self.host[first:first + n], non_blocking=True)
        self.kv_cache.index_copy_(2, idx, data.permute(1, 2, 0, 3, 4, 5))
