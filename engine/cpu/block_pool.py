"""Accounting for the host-memory KV pool that preempted sequences are offloaded to.

Pure CPU Python, no torch: ids index the host KV tensor owned by engine.kv_offload.KVOffloader. Full blocks
carry their prefix-cache content hash here too, so a block shared by several offloaded sequences (a common
prompt prefix) is copied to the host once and ref-counted, never twice.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable


class CpuBlockPool:
    """Hands out host KV block ids, preferring one contiguous run per request so that its copy is one
    transfer (see contiguous_runs)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks))  # sorted
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def lookup(self, block_hash: int | None) -> int | None:
        """The host block already holding this content, if any."""
        return None if block_hash is None else self.hash_to_block.get(block_hash)

    def allocate(self, n: int) -> list[int] | None:
        """n block ids, each with one reference (a contiguous run when one exists, else the lowest free
        ids); None if too few are free."""
        if n > len(self._free):
            return None
        start = self._find_run(n)
        if start is None:
            taken, self._free = self._free[:n], self._free[n:]
        else:
            taken = self._free[start:start + n]
            del self._free[start:start + n]
        for block in taken:
            self.ref_counts[block] = 1
        return taken

    def share(self, block: int) -> None:
        self.ref_counts[block] += 1

    def register(self, block: int, block_hash: int) -> None:
        self.block_hash[block] = block_hash
        self.hash_to_block[block_hash] = block

    def release(self, ids: Iterable[int]) -> None:
        """Drop one reference per id; a block whose last reference goes is free (and forgets its hash)."""
        for block in ids:
            if self.ref_counts[block] <= 0:
                raise AssertionError(f"cpu block {block} freed twice")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                h = self.block_hash[block]
                if h is not None:
                    self.block_hash[block] = None
                    del self.hash_to_block[h]
                bisect.insort(self._free, block)

    def _find_run(self, n: int) -> int | None:
        """Index in the free list where n consecutive ids start (first fit)."""
        free = self._free
        for i in range(len(free) - n + 1):
            if free[i + n - 1] - free[i] == n - 1:
                return i
        return None

    def check_integrity(self, held: Iterable[int] = ()) -> None:
        """Ref counts equal the references held by swapped sequences; free = unreferenced; hashes agree."""
        expected = [0] * self.num_blocks
        for block in held:
            expected[block] += 1
        if expected != self.ref_counts:
            bad = [b for b in range(self.num_blocks) if expected[b] != self.ref_counts[b]]
            raise AssertionError(f"cpu block ref counts disagree with the swapped sequences for {bad[:10]}")
        if self._free != [b for b in range(self.num_blocks) if expected[b] == 0]:
            raise AssertionError("cpu free list does not hold exactly the unreferenced blocks")
        if any(self.block_hash[b] != h for h, b in self.hash_to_block.items()) or \
                sum(h is not None for h in self.block_hash) != len(self.hash_to_block):
            raise AssertionError("cpu block hashes and the hash map disagree")


def contiguous_runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """Split block ids into (position in ids, first id, length) runs of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for pos, block in enumerate(ids):
        if runs and block == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((pos, block, 1))
    return runs
