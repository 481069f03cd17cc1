"""Paged-KV block accounting: ref counts, an LRU free queue and content-hashed prefix caching.

Pure CPU Python: no torch. Block ids index the KV cache tensors owned by the model runner.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence as Seq

from engine.sequence import Sequence

_ROOT_HASH = 0
_MASK63 = (1 << 63) - 1


def hash_block(parent_hash: int, token_ids: Seq[int]) -> int:
    """Content hash of one full block, chained on its parent's hash.

    blake2b rather than Python's hash(): prefix-cache keys are shared between tenants, so they must not be
    cheap to collide on purpose. The bytes hashed are the parent's 16 little-endian bytes and the ids as int64:
    a sequence's `array("q")` slice gives them as they are (Sequence.token_ids).
    """
    data = parent_hash.to_bytes(16, "little") + _int64(token_ids).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=16).digest(), "little")


def chain_hashes(parent_hash: int, token_ids: array, first: int, count: int, block_size: int) -> list[int]:
    """hash_block over blocks first .. first + count - 1 of an int64 array, chained from `parent_hash`: one copy
    of the ids, and each digest is the next block's parent bytes as it is (half the cost of a hash_block loop,
    which matters where a whole prompt is hashed on the engine loop)."""
    out = []
    if count <= 0:
        return out
    width = 8 * block_size
    data = token_ids[first * block_size:(first + count) * block_size].tobytes()
    parent, blake, from_bytes = parent_hash.to_bytes(16, "little"), hashlib.blake2b, int.from_bytes
    for i in range(0, count * width, width):
        parent = blake(parent + data[i:i + width], digest_size=16).digest()
        out.append(from_bytes(parent, "little"))
    return out


def prefix_hashes(token_ids: Seq[int], block_size: int, max_blocks: int, root: int = _ROOT_HASH) -> list[int]:
    """Chained hashes of the first full blocks of `token_ids` (63-bit, as in `recent_hashes`); `root` seeds
    the chain (a LoRA adapter's hash_root, engine/lora/request.py; 0 for the base model)."""
    count = min(len(token_ids) // block_size, max_blocks)
    return [h & _MASK63 for h in chain_hashes(root, _int64(token_ids), 0, count, block_size)]


def prompt_block_hashes(token_ids: Seq[int], block_size: int, root: int = _ROOT_HASH) -> list[int]:
    """Chained hashes of a prompt's full blocks before its last token: what BlockManager.prompt_hashes keeps on a
    sequence, and what a frontend in another process sends with the request."""
    return chain_hashes(root, _int64(token_ids), 0, (len(token_ids) - 1) // block_size, block_size)


def _int64(token_ids: Seq[int]) -> array:
    return token_ids if type(token_ids) is array else array("q", token_ids)


class BlockManager:
    """Allocates fixed-size KV blocks to sequences.

    Free blocks sit in an LRU queue (head = next to hand out). A freed block keeps its content hash, so a
    later request with the same prefix can take it back (a prefix-cache hit); its hash is dropped only when
    the allocator hands the block out for new content (lazy eviction).

    Sliding-window groups (engine/kv_groups.py, `window_groups` k > 0): a block id is then a *page* of one KV
    group. `Sequence.block_table` holds the full-attention group's pages, one per logical block, as without
    groups; `Sequence.window_table` holds k pages per logical block (block i's at [i * k, (i + 1) * k)) for the
    sliding groups, of which the blocks before `Sequence.window_base` have gone back to the pool (their entries
    are stale: no query reads them). Every count here (num_free, blocks_needed, num_blocks) is in pages; growth is
    counted net of the window pages the slide at the step's start gives back, and allocate slides before it takes,
    so a count that fits is a growth that succeeds. Prefix caching keeps both: a hash maps to a full page
    (hash_to_block) and to a logical block's k window pages (hash_to_window); a hit needs the full pages of every
    block and the window pages of the blocks the first uncached query reads.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window_groups: int = 0, window: int | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        if window_groups and not (window and window >= 1):
            raise ValueError(f"window groups need a sliding window >= 1; got {window!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window_groups = window_groups  # k: sliding groups (0: one group of every layer)
        self.window = window if window_groups else None
        self.pages_per_block = 1 + window_groups
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # Window groups: the hash of the logical block whose window pages a page is one of, and those pages.
        self.window_hash: list[int | None] = [None] * num_blocks
        self.hash_to_window: dict[int, tuple[int, ...]] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.hit_tokens = 0
        self.queried_tokens = 0

    # ---- queries -------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int, start: int | None = None) -> int:
        """Pages `allocate(seq, num_tokens, start)` takes from the free pool, net: a new logical block takes a page
        in every group, and with window groups the slide at `start` (default seq.num_computed) first gives back
        the window pages no query from there on reads. Negative when the slide gives back more than is taken."""
        new = max(0, -(-num_tokens // self.block_size) - len(seq.block_table)) * self.pages_per_block
        return new - self.slide_frees(seq, seq.num_computed if start is None else start)

    def capacity(self, seq: Sequence, free_pages: int) -> int:
        """Positions past `seq.num_computed` that its pages plus `free_pages` more hold, the pages the slide at
        seq.num_computed gives back among them (every new logical block takes a page in every group)."""
        free_pages += self.slide_frees(seq, seq.num_computed)
        return (len(seq.block_table) + free_pages // self.pages_per_block) * self.block_size - seq.num_computed

    def slide_frees(self, seq: Sequence, start: int) -> int:
        """Pages `slide(seq, start)` would put back in the free pool: the window pages behind the window that
        only `seq` references (a page shared with a sibling or another request stays with them)."""
        if not self.window_groups:
            return 0
        lo = min(self._first_window_block(start), len(seq.block_table))
        k, refs = self.window_groups, self.ref_counts
        return sum(1 for b in seq.window_table[seq.window_base * k:lo * k] if refs[b] == 1)

    def pages_held(self, seq: Sequence) -> int:
        """Pages that only `seq` references: what freeing it gives back."""
        refs = self.ref_counts
        return sum(1 for b in seq.block_table if refs[b] == 1) + \
            sum(1 for b in self._live_window(seq) if refs[b] == 1)

    def admission_pages(self, hits: list[int], hashes: list[int], num_tokens: int) -> int:
        """Pages admitting a sequence with these prefix hits and `num_tokens` positions takes from the free
        pool: its new logical blocks' pages, plus the cached pages it takes back out of the free queue."""
        refs = self.ref_counts
        new = max(0, -(-num_tokens // self.block_size) - len(hits)) * self.pages_per_block
        reused = sum(1 for b in hits if refs[b] == 0)
        if self.window_groups and hits:
            lo = self._first_window_block(len(hits) * self.block_size)
            reused += sum(1 for h in hashes[lo:] for b in self.hash_to_window[h] if refs[b] == 0)
        return new + reused

    def admission_capacity(self, hits: list[int], hashes: list[int], free_pages: int) -> int:
        """Positions past the hits that admitting a sequence with these prefix hits holds with `free_pages` free
        (what admission_pages counts, inverted)."""
        reused = self.admission_pages(hits, hashes, len(hits) * self.block_size)
        return (free_pages - reused) // self.pages_per_block * self.block_size

    def prompt_hashes(self, seq: Sequence) -> list[int] | None:
        """Chained hashes of the full blocks of `seq.token_ids` before its last token, computed once per
        token count and kept on the sequence (a request waiting at the head of the queue is looked up again
        every tick; its prompt must not be re-hashed each time). None without prefix caching."""
        if not self.enable_prefix_caching:
            return None
        n = len(seq.token_ids)
        if seq.prompt_hashes is None or seq.prompt_hashes[0] != n:
            seq.prompt_hashes = (n, prompt_block_hashes(seq.token_ids, self.block_size, seq.hash_root))
        return seq.prompt_hashes[1]

    def cached_prefix(self, token_ids: Seq[int], known: list[int] | None = None,
                      root: int = _ROOT_HASH) -> tuple[list[int], list[int]]:
        """Cached blocks matching the longest full-block prefix of `token_ids`, and their hashes.

        The last token is never served from cache: its logits are needed to sample the first output token.
        `known`: the chained hashes of those blocks already computed (prompt_hashes), else hashed here from
        `root` (the sequence's hash_root).
        """
        if not self.enable_prefix_caching:
            return [], []
        blocks, hashes, parent = [], [], root
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            parent = known[i] if known is not None else hash_block(parent, token_ids[i * bs:(i + 1) * bs])
            block = self.hash_to_block.get(parent)
            if block is None:
                break
            blocks.append(block)
            hashes.append(parent)
        if self.window_groups and blocks:
            n = self._window_hit(hashes)
            del blocks[n:], hashes[n:]
        return blocks, hashes

    def _window_hit(self, hashes: list[int]) -> int:
        """The longest hit (in blocks, at most len(hashes)) whose first uncached query finds its window's pages
        cached too: the hashes from first_window_block(n * bs) to n all in hash_to_window."""
        run = 0  # cached window blocks ending at the block before n
        runs = [0]
        for h in hashes:
            run = run + 1 if h in self.hash_to_window else 0
            runs.append(run)
        for n in range(len(hashes), 0, -1):
            if runs[n] >= n - self._first_window_block(n * self.block_size):
                return n
        return 0

    def _first_window_block(self, position: int) -> int:
        return max(0, position - self.window + 1) // self.block_size

    # ---- allocation ----------------------------------------------------------------------------------
    def admit(self, seq: Sequence, hit_blocks: list[int], hit_hashes: list[int]) -> None:
        """Give a new sequence its prefix-cache hits; their prefill is skipped."""
        assert not seq.block_table, "admit() is for sequences without blocks"
        for block in hit_blocks:
            self._ref(block)
        seq.block_table = list(hit_blocks)
        seq.block_hashes = list(hit_hashes)
        if self.window_groups:
            lo = self._first_window_block(len(hit_blocks) * self.block_size) if hit_blocks else 0
            table = [0] * (lo * self.window_groups)  # gone before the window: never read
            for h in hit_hashes[lo:]:
                for page in self.hash_to_window[h]:
                    self._ref(page)
                    table.append(page)
            seq.window_table, seq.window_base = table, lo
        seq.num_cached = seq.num_computed = len(hit_blocks) * self.block_size
        self.queried_tokens += len(seq.token_ids)
        self.hit_tokens += seq.num_cached

    def allocate(self, seq: Sequence, num_tokens: int, start: int | None = None) -> bool:
        """Grow `seq`'s block table to hold `num_tokens` positions; False (and no change) if it can't. `start`:
        the first position the step being planned computes for it (default: seq.num_computed); with window
        groups, the blocks no query from there on reads give their window pages back first, so what the growth
        takes is net of them (blocks_needed) and they may be among the pages it takes."""
        start = seq.num_computed if start is None else start
        if self.blocks_needed(seq, num_tokens, start) > self.num_free:
            return False
        self.slide(seq, start)
        table, window = seq.block_table, seq.window_table
        for _ in range(max(0, -(-num_tokens // self.block_size) - len(table))):
            table.append(self._pop_free())
            for _ in range(self.window_groups):
                window.append(self._pop_free())
        return True

    def append_block(self, seq: Sequence) -> bool:
        """allocate() in its most common case, a decode step opening a new block: one page appended to `seq`'s
        table, without window groups. False (nothing changed) where there are window groups or no page is free:
        Scheduler._fit then takes the general path. A step of many decode rows opens blocks
        for a few of them every step; the cost is in docs/engine.md#host-work-per-step."""
        if self.window_groups or not self.free_queue:
            return False
        seq.block_table.append(self._pop_free())
        return True

    def slide(self, seq: Sequence, start: int) -> None:
        """Give back the window pages of `seq`'s blocks that no query at `start` or later reads (they keep their
        hash: still a prefix-cache hit until handed out again). Steps already launched may still read them: a
        page handed out again is written only by a later step (or a copy ordered before it), in stream order.
        Nothing without window groups."""
        if not self.window_groups:
            return
        lo = min(self._first_window_block(start), len(seq.block_table))
        k, window, refs = self.window_groups, seq.window_table, self.ref_counts
        for i in range(seq.window_base * k, lo * k):
            page = window[i]
            refs[page] -= 1
            if refs[page] == 0:
                self.free_queue[page] = None
        seq.window_base = max(seq.window_base, lo)

    def _live_window(self, seq: Sequence) -> list[int]:
        return seq.window_table[seq.window_base * self.window_groups:] if self.window_groups else []

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share `parent`'s blocks with `child` (another sample of the same prompt): each gains a reference.
        Full blocks are never written again; a shared partial block is copied by whichever sequence writes
        into it first (copy_on_write)."""
        assert not child.block_table, "fork() is for sequences without blocks"
        for block in parent.block_table:
            self.ref_counts[block] += 1  # held by the parent: not in the free queue
        for page in self._live_window(parent):
            self.ref_counts[page] += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.window_table, child.window_base = list(parent.window_table), parent.window_base

    def copy_on_write(self, seq: Sequence, index: int) -> list[tuple[int, int]]:
        """Before `seq` writes into its `index`-th block: when another sequence shares it, `seq` takes free
        pages instead (its full page and, with window groups, its window pages) and the caller copies the KV
        (src, dst) ahead of the write; [] when it is `seq`'s alone. The caller has checked that pages_per_block
        pages are free. The copy carries no hash: only full blocks are hashed, and a block being written is
        not full."""
        block = seq.block_table[index]
        if self.ref_counts[block] == 1:
            return []
        pairs = [(block, self._pop_free())]
        self.ref_counts[block] -= 1
        # A new list, not an edit in place: the runner's persistent block tables rewrite a row when its list
        # is replaced (engine/block_tables.py) and otherwise only append.
        seq.block_table = seq.block_table[:index] + [pairs[0][1]] + seq.block_table[index + 1:]
        k = self.window_groups
        if k:
            window = list(seq.window_table)
            for i in range(index * k, (index + 1) * k):
                pairs.append((window[i], self._pop_free()))
                self.ref_counts[window[i]] -= 1
                window[i] = pairs[-1][1]
            seq.window_table = window
        return pairs

    def shares_block(self, seq: Sequence, index: int) -> bool:
        """Whether `seq`'s `index`-th block (if it has one) is referenced by another sequence too."""
        return index < len(seq.block_table) and self.ref_counts[seq.block_table[index]] > 1

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references. Tail blocks are queued first so they are evicted before shared heads."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
        for page in reversed(self._live_window(seq)):
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                self.free_queue[page] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.window_table, seq.window_base = [], 0

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register content hashes for `seq`'s full blocks among its first `num_tokens` positions.

        Callers pass positions whose token ids are known on the host and whose KV write has been launched:
        any later reader is launched after the writer on the same stream, so it sees the data.
        """
        if not self.enable_prefix_caching:
            return
        bs, k = self.block_size, self.window_groups
        full = min(num_tokens // bs, len(seq.block_table))
        parent = seq.block_hashes[-1] if seq.block_hashes else seq.hash_root
        known = seq.prompt_hashes[1] if seq.prompt_hashes is not None else ()  # still valid: tokens only grow
        for i in range(len(seq.block_hashes), full):
            parent = known[i] if i < len(known) else hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs])
            seq.block_hashes.append(parent)
            block = seq.block_table[i]
            if parent not in self.hash_to_block and self.block_hash[block] is None:
                self.block_hash[block] = parent
                self.hash_to_block[parent] = block
            if k and i >= seq.window_base and parent not in self.hash_to_window:
                pages = tuple(seq.window_table[i * k:(i + 1) * k])
                if all(self.window_hash[p] is None for p in pages):
                    for p in pages:
                        self.window_hash[p] = parent
                    self.hash_to_window[parent] = pages

    # ---- swap-in (engine.scheduler restores an offloaded sequence's table with these) ---------------------
    def cached_block(self, block_hash: int) -> int | None:
        """The device block currently holding the content with this hash, if any."""
        return self.hash_to_block.get(block_hash) if self.enable_prefix_caching else None

    def take(self, block: int) -> None:
        """Add a reference to an existing block (out of the free queue if it was there)."""
        self._ref(block)

    def take_fresh(self, block_hash: int | None) -> int:
        """Hand out a free block for restored content, registering its hash when it has one."""
        block = self._pop_free()
        if (block_hash is not None and self.enable_prefix_caching and block_hash not in self.hash_to_block):
            self.block_hash[block] = block_hash
            self.hash_to_block[block_hash] = block
        return block

    def recent_hashes(self, limit: int) -> list[int]:
        """The most recently cached block hashes, truncated to 63 bits: a compact prefix summary for routers.

        Routers compare them with `prefix_hashes()` of a new prompt, truncated the same way."""
        keys = list(self.hash_to_block)[-limit:]
        return [h & _MASK63 for h in keys]

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their contents)."""
        self.hash_to_block.clear()
        self.block_hash = [None] * self.num_blocks
        self.hash_to_window.clear()
        self.window_hash = [None] * self.num_blocks

    # ---- internals -----------------------------------------------------------------------------------
    def _ref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_queue[block]
        self.ref_counts[block] += 1

    def _pop_free(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        old = self.block_hash[block]
        if old is not None:  # lazy eviction: the cached content is about to be overwritten
            self.block_hash[block] = None
            if self.hash_to_block.get(old) == block:
                del self.hash_to_block[old]
        old = self.window_hash[block]
        if old is not None:  # one window page of a cached block is overwritten: the block is no longer a hit
            pages = self.hash_to_window.pop(old)
            for p in pages:
                self.window_hash[p] = None
        self.ref_counts[block] = 1
        return block

    def check_integrity(self, live: Iterable[Sequence] = ()) -> None:
        """Assert the accounting invariants; `live` are the sequences currently holding blocks."""
        expected = [0] * self.num_blocks
        for seq in live:
            for block in seq.block_table + self._live_window(seq):
                expected[block] += 1
            if self.window_groups and len(seq.window_table) != self.window_groups * len(seq.block_table):
                raise AssertionError(f"{seq.request_id}: window table out of step with its block table")
        if expected != self.ref_counts:
            bad = [b for b in range(self.num_blocks) if expected[b] != self.ref_counts[b]]
            raise AssertionError(f"ref counts disagree with block tables for blocks {bad[:10]}")
        free = [b for b in range(self.num_blocks) if self.ref_counts[b] == 0]
        if sorted(self.free_queue) != free:
            raise AssertionError("free queue does not hold exactly the blocks with ref count 0")
        for h, block in self.hash_to_block.items():
            if self.block_hash[block] != h:
                raise AssertionError(f"hash map points block {block} at a hash it does not carry")
        if sum(h is not None for h in self.block_hash) != len(self.hash_to_block):
            raise AssertionError("a block carries a hash the map does not know")
        for h, pages in self.hash_to_window.items():
            if any(self.window_hash[p] != h for p in pages):
                raise AssertionError(f"window pages {pages} do not carry the hash that maps to them")
        if sum(h is not None for h in self.window_hash) != sum(map(len, self.hash_to_window.values())):
            raise AssertionError("a window page carries a hash the map does not know")
