"""BlockManager: exact block ids, LRU free order, ref counts, chained prefix hashing, lazy eviction.

Expected block ids and hit lengths are worked out by hand from the documented contract (fresh manager hands
out 0, 1, 2, ...; a freed table goes to the free-queue tail in reverse order; a block hits only if every
ancestor hits; the last token is never served from cache; partial blocks are never cached).
"""

import hashlib
import random
import struct
from array import array

import pytest

from engine.block_manager import BlockManager, chain_hashes, hash_block, prefix_hashes, prompt_block_hashes
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BS = 4


def make_seq(token_ids, rid="r"):
    return Sequence(rid, None, list(token_ids), SamplingParams(max_tokens=8), frozenset({0}),
                    max_model_len=256, vocab_size=512)


def toks(start, n):
    """n distinct token ids starting at `start` (disjoint ranges never share a block's content)."""
    return list(range(start, start + n))


def computed_seq(bm, token_ids, rid="r"):
    """A sequence that took blocks for all its tokens and had its full blocks registered in the cache."""
    seq = make_seq(token_ids, rid)
    assert bm.allocate(seq, len(token_ids))
    bm.cache_full_blocks(seq, len(token_ids))
    return seq


def admit_with_hits(bm, token_ids, rid="r"):
    seq = make_seq(token_ids, rid)
    hits, hashes = bm.cached_prefix(seq.token_ids)
    bm.admit(seq, hits, hashes)
    assert bm.allocate(seq, len(token_ids))
    return seq


# ---- construction and allocation ---------------------------------------------------------------------------
@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0), (-1, 4)])
def test_rejects_empty_pool_or_block(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


def test_fresh_manager_hands_out_ids_in_order():
    bm = BlockManager(8, BS)
    a, b = make_seq(toks(1, 10), "a"), make_seq(toks(50, 4), "b")
    assert bm.allocate(a, 10)  # 10 tokens -> 3 blocks
    assert bm.allocate(b, 4)   # exactly one full block
    assert a.block_table == [0, 1, 2]
    assert b.block_table == [3]
    assert bm.num_free == 4
    assert bm.usage == pytest.approx(0.5)
    bm.check_integrity([a, b])


def test_allocate_grows_only_by_missing_blocks():
    bm = BlockManager(8, BS)
    seq = make_seq(toks(1, 12))
    assert bm.allocate(seq, 4) and seq.block_table == [0]
    assert bm.allocate(seq, 4) and seq.block_table == [0]  # already holds 4 positions
    assert bm.allocate(seq, 5) and seq.block_table == [0, 1]
    assert bm.allocate(seq, 8) and seq.block_table == [0, 1]
    assert bm.blocks_needed(seq, 9) == 1
    assert bm.blocks_needed(seq, 17) == 3
    assert bm.blocks_needed(seq, 3) == 0


def test_allocate_that_does_not_fit_changes_nothing():
    bm = BlockManager(2, BS)
    seq = make_seq(toks(1, 12))
    assert not bm.allocate(seq, 12)  # needs 3 of 2
    assert seq.block_table == []
    assert bm.num_free == 2
    assert bm.allocate(seq, 8) and seq.block_table == [0, 1]
    bm.check_integrity([seq])


# ---- free order --------------------------------------------------------------------------------------------
def test_freed_blocks_go_to_tail_in_reverse_table_order():
    bm = BlockManager(4, BS)
    a = make_seq(toks(1, 12), "a")
    b = make_seq(toks(50, 4), "b")
    bm.allocate(a, 12)
    bm.allocate(b, 4)
    assert (a.block_table, b.block_table, bm.num_free) == ([0, 1, 2], [3], 0)
    bm.free(a)
    assert a.block_table == [] and bm.num_free == 3
    c = make_seq(toks(100, 12), "c")
    bm.allocate(c, 12)
    assert c.block_table == [2, 1, 0]  # a's tail block is handed out first
    bm.check_integrity([b, c])


def test_freed_blocks_queue_behind_never_used_blocks():
    bm = BlockManager(6, BS)
    a = make_seq(toks(1, 8), "a")
    bm.allocate(a, 8)
    bm.free(a)
    b = make_seq(toks(50, 24), "b")
    bm.allocate(b, 24)
    assert b.block_table == [2, 3, 4, 5, 1, 0]


def test_free_order_follows_free_time_across_sequences():
    bm = BlockManager(4, BS)
    a, b = make_seq(toks(1, 8), "a"), make_seq(toks(50, 8), "b")
    bm.allocate(a, 8)  # [0, 1]
    bm.allocate(b, 8)  # [2, 3]
    bm.free(b)
    bm.free(a)
    c = make_seq(toks(100, 16), "c")
    bm.allocate(c, 16)
    assert c.block_table == [3, 2, 1, 0]  # b freed first, so its blocks are older in the LRU queue


# ---- ref counts and sharing --------------------------------------------------------------------------------
def test_shared_prefix_blocks_are_ref_counted():
    bm = BlockManager(8, BS)
    a = computed_seq(bm, toks(1, 10), "a")            # blocks [0, 1, 2]; [0, 1] full and hashed
    b = admit_with_hits(bm, toks(1, 8) + [200, 201, 202], "b")
    assert b.block_table == [0, 1, 3]
    assert (b.num_cached, b.num_computed) == (8, 8)
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
    assert bm.num_free == 4
    bm.check_integrity([a, b])

    bm.free(a)
    assert bm.ref_counts[:4] == [1, 1, 0, 1]
    assert bm.num_free == 5  # only a's private tail block came back
    bm.check_integrity([b])
    bm.free(b)
    assert bm.num_free == 8
    bm.check_integrity([])


def test_shared_blocks_return_to_queue_when_last_owner_frees():
    bm = BlockManager(4, BS)
    a = computed_seq(bm, toks(1, 9), "a")            # [0, 1, 2]
    b = admit_with_hits(bm, toks(1, 8) + [300], "b")  # hits [0, 1], own tail [3]
    bm.free(a)   # queue: 2
    bm.free(b)   # queue: 2, 3, 1, 0
    c = make_seq(toks(400, 16), "c")
    bm.allocate(c, 16)
    assert c.block_table == [2, 3, 1, 0]


def test_every_block_free_after_all_sequences_freed():
    bm = BlockManager(10, BS)
    prefix = toks(1, 8)
    seqs = [computed_seq(bm, prefix + [100], "a")]
    seqs += [admit_with_hits(bm, prefix + toks(200 + 10 * i, 5), f"s{i}") for i in range(3)]
    bm.check_integrity(seqs)
    assert bm.ref_counts[0] == bm.ref_counts[1] == 4
    for seq in (seqs[2], seqs[0], seqs[3], seqs[1]):
        bm.free(seq)
    assert bm.num_free == 10 and bm.usage == 0.0
    assert bm.ref_counts == [0] * 10
    bm.check_integrity([])
    big = make_seq(toks(400, 40), "big")
    assert bm.allocate(big, 40) and sorted(big.block_table) == list(range(10))


# ---- prefix hits -------------------------------------------------------------------------------------------
def test_hash_is_chained_on_parent():
    assert hash_block(0, [1, 2, 3, 4]) == hash_block(0, [1, 2, 3, 4])
    assert hash_block(0, [1, 2, 3, 4]) != hash_block(0, [1, 2, 3, 5])
    assert hash_block(0, [1, 2, 3, 4]) != hash_block(hash_block(0, [9, 9, 9, 9]), [1, 2, 3, 4])


def _oracle_chain(ids: list[int], block_size: int, root: int = 0) -> list[int]:
    """The documented hash, from its definition: blake2b-128 over the parent's 16 little-endian bytes and the
    block's ids as little-endian int64, chained from `root`, the full blocks before the last token."""
    out, parent = [], root
    for i in range((len(ids) - 1) // block_size):
        data = parent.to_bytes(16, "little") + struct.pack(f"<{block_size}q", *ids[i * block_size:(i + 1) * block_size])
        parent = int.from_bytes(hashlib.blake2b(data, digest_size=16).digest(), "little")
        out.append(parent)
    return out


@pytest.mark.parametrize("n", [1, 4, 5, 8, 9, 33, 200])
def test_prompt_hashes_match_the_definition_from_a_list_an_array_and_a_frontend(n):
    """The sequence's array, a frontend's list (prompt_block_hashes, sent with a request to a core process) and
    hash_block one block at a time all give the definition's hashes: the prefix cache and the router agree."""
    rng = random.Random(n)
    ids = [rng.randrange(200_000) for _ in range(n)]
    want = _oracle_chain(ids, BS)
    assert len(want) == (n - 1) // BS
    bm = BlockManager(num_blocks=64, block_size=BS)
    assert bm.prompt_hashes(make_seq(ids)) == want
    assert prompt_block_hashes(ids, BS) == want == prompt_block_hashes(array("q", ids), BS)
    chained, parent = [], 0
    for i in range(len(want)):
        parent = hash_block(parent, ids[i * BS:(i + 1) * BS])
        chained.append(parent)
    assert chained == want
    assert chain_hashes(7, array("q", ids), 0, len(want), BS) == _oracle_chain(ids, BS, root=7)
    if len(want) > 1:  # from a later block on, chained on the block before it
        assert chain_hashes(want[0], array("q", ids), 1, len(want) - 1, BS) == want[1:]
    # the router's: every full block (the last token's too), 63 bits, at most max_blocks
    full = [h & ((1 << 63) - 1) for h in _oracle_chain(ids + [0], BS)]
    assert prefix_hashes(ids, BS, 64) == full and prefix_hashes(ids, BS, 2) == full[:2]


def test_hit_covers_longest_matching_full_block_prefix():
    bm = BlockManager(8, BS)
    a = computed_seq(bm, toks(1, 12) + [99], "a")  # 3 full blocks cached: [0, 1, 2]
    assert bm.cached_prefix(toks(1, 12) + [7])[0] == [0, 1, 2]
    assert bm.cached_prefix(toks(1, 8) + [7, 7, 7, 7, 7])[0] == [0, 1]
    assert bm.cached_prefix(toks(1, 4) + [7] * 9)[0] == [0]
    blocks, hashes = bm.cached_prefix(toks(1, 12) + [7])
    assert hashes == a.block_hashes


def test_block_matches_only_if_all_ancestors_match():
    bm = BlockManager(8, BS)
    computed_seq(bm, toks(1, 12) + [99], "a")
    # Blocks 1 and 2 carry the same tokens as a's, but block 0 differs: nothing may hit.
    assert bm.cached_prefix([500, 501, 502, 503] + toks(5, 8) + [7]) == ([], [])
    # Block 1 differs: block 0 hits, block 2 (same tokens as a's block 2) must not.
    assert bm.cached_prefix(toks(1, 4) + [500, 501, 502, 503] + toks(9, 4) + [7])[0] == [0]


def test_last_prompt_token_never_served_from_cache():
    bm = BlockManager(8, BS)
    computed_seq(bm, toks(1, 8), "a")  # two full blocks cached
    assert bm.cached_prefix(toks(1, 8))[0] == [0]         # the last token sits in block 1
    assert bm.cached_prefix(toks(1, 8) + [9])[0] == [0, 1]
    assert bm.cached_prefix(toks(1, 4))[0] == []
    assert bm.cached_prefix(toks(1, 1))[0] == []


def test_partial_blocks_are_never_cached():
    bm = BlockManager(8, BS)
    a = computed_seq(bm, toks(1, 10), "a")  # blocks [0, 1, 2], block 2 holds 2 tokens
    assert len(a.block_hashes) == 2
    assert bm.cached_prefix(toks(1, 12) + [7])[0] == [0, 1]
    assert bm.block_hash[2] is None


def test_cache_full_blocks_only_registers_blocks_within_num_tokens():
    bm = BlockManager(8, BS)
    seq = make_seq(toks(1, 12))
    bm.allocate(seq, 12)
    bm.cache_full_blocks(seq, 7)
    assert len(seq.block_hashes) == 1
    assert bm.cached_prefix(toks(1, 12) + [7])[0] == [0]
    bm.cache_full_blocks(seq, 12)  # extends the chain from where it stopped
    assert len(seq.block_hashes) == 3
    assert bm.cached_prefix(toks(1, 12) + [7])[0] == [0, 1, 2]
    bm.check_integrity([seq])


def test_identical_content_computed_twice_keeps_first_block():
    bm = BlockManager(8, BS)
    a = computed_seq(bm, toks(1, 8), "a")  # [0, 1]
    b = computed_seq(bm, toks(1, 8), "b")  # [2, 3]: same content, allocated without a lookup
    assert b.block_hashes == a.block_hashes
    assert bm.cached_prefix(toks(1, 8) + [9])[0] == [0, 1]
    bm.check_integrity([a, b])


def test_admit_counts_hit_and_queried_tokens():
    bm = BlockManager(8, BS)
    a = admit_with_hits(bm, toks(1, 9), "a")  # nothing cached yet
    bm.cache_full_blocks(a, 9)
    assert (a.num_cached, bm.hit_tokens, bm.queried_tokens) == (0, 0, 9)
    b = admit_with_hits(bm, toks(1, 8) + [300, 301], "b")
    assert b.num_cached == 8
    assert (bm.hit_tokens, bm.queried_tokens) == (8, 19)


# ---- lazy eviction -----------------------------------------------------------------------------------------
def test_freed_blocks_keep_their_hash_until_handed_out():
    bm = BlockManager(3, BS)
    a = computed_seq(bm, toks(1, 12), "a")  # [0, 1, 2], all cached
    bm.free(a)
    query = toks(1, 12) + [7]
    assert bm.cached_prefix(query)[0] == [0, 1, 2]  # free, but still a hit
    bm.check_integrity([])

    x = make_seq(toks(100, 4), "x")
    bm.allocate(x, 4)
    assert x.block_table == [2]                     # a's tail block is evicted first...
    assert bm.block_hash[2] is None
    assert bm.cached_prefix(query)[0] == [0, 1]     # ...so the head of the chain still hits
    y = make_seq(toks(200, 4), "y")
    bm.allocate(y, 4)
    assert y.block_table == [1]
    assert bm.cached_prefix(query)[0] == [0]
    bm.check_integrity([x, y])


def test_evicted_ancestor_breaks_the_chain_for_descendants():
    bm = BlockManager(3, BS)
    a = computed_seq(bm, toks(1, 8), "a")  # [0, 1]
    bm.free(a)                             # queue: 2, 1, 0
    x = make_seq(toks(100, 12), "x")
    bm.allocate(x, 12)                     # takes 2, 1, 0: every cached block is overwritten
    assert x.block_table == [2, 1, 0]
    assert bm.cached_prefix(toks(1, 8) + [9]) == ([], [])
    assert bm.hash_to_block == {} and bm.block_hash == [None, None, None]


def test_hit_on_a_free_block_takes_it_back_from_the_free_queue():
    bm = BlockManager(3, BS)
    a = computed_seq(bm, toks(1, 12), "a")
    bm.free(a)
    assert bm.num_free == 3
    b = make_seq(toks(1, 12) + [7], "b")
    hits, hashes = bm.cached_prefix(b.token_ids)
    bm.admit(b, hits, hashes)
    assert b.block_table == [0, 1, 2] and b.num_computed == 12
    assert bm.num_free == 0 and bm.ref_counts == [1, 1, 1]
    assert not bm.allocate(b, 13)  # the 13th position needs a 4th block
    bm.check_integrity([b])


def test_reset_prefix_cache_forgets_hashes_but_not_ownership():
    bm = BlockManager(4, BS)
    a = computed_seq(bm, toks(1, 9), "a")
    bm.reset_prefix_cache()
    assert bm.cached_prefix(toks(1, 9)) == ([], [])
    assert a.block_table == [0, 1, 2] and bm.num_free == 1
    bm.check_integrity([a])


# ---- disabled prefix caching -------------------------------------------------------------------------------
def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    a = computed_seq(bm, toks(1, 12), "a")
    assert a.block_hashes == []
    assert bm.block_hash == [None] * 4
    assert bm.cached_prefix(toks(1, 12) + [7]) == ([], [])
    bm.free(a)
    assert bm.cached_prefix(toks(1, 12) + [7]) == ([], [])
    b = admit_with_hits(bm, toks(1, 12) + [7], "b")
    assert b.num_cached == b.num_computed == 0
    assert b.block_table == [3, 2, 1, 0]
    bm.check_integrity([b])


# ---- check_integrity ---------------------------------------------------------------------------------------
def _shared_state():
    bm = BlockManager(6, BS)
    a = computed_seq(bm, toks(1, 9), "a")             # [0, 1, 2]
    b = admit_with_hits(bm, toks(1, 8) + [300], "b")  # [0, 1, 3]
    bm.check_integrity([a, b])
    return bm, a, b


def test_integrity_catches_tampered_ref_count():
    bm, a, b = _shared_state()
    bm.ref_counts[0] = 1
    with pytest.raises(AssertionError):
        bm.check_integrity([a, b])


def test_integrity_catches_a_live_sequence_left_out():
    bm, a, b = _shared_state()
    with pytest.raises(AssertionError):
        bm.check_integrity([a])


def test_integrity_catches_used_block_in_free_queue():
    bm, a, b = _shared_state()
    bm.free_queue[3] = None
    with pytest.raises(AssertionError):
        bm.check_integrity([a, b])


def test_integrity_catches_free_block_missing_from_queue():
    bm, a, b = _shared_state()
    del bm.free_queue[5]
    with pytest.raises(AssertionError):
        bm.check_integrity([a, b])


def test_integrity_catches_hash_map_pointing_at_wrong_block():
    bm, a, b = _shared_state()
    h = a.block_hashes[0]
    bm.hash_to_block[h] = 1
    with pytest.raises(AssertionError):
        bm.check_integrity([a, b])


def test_integrity_catches_block_hash_unknown_to_map():
    bm, a, b = _shared_state()
    bm.block_hash[3] = 12345
    with pytest.raises(AssertionError):
        bm.check_integrity([a, b])


def test_append_block_is_allocate_of_one_block_and_refuses_what_it_cannot_do():
    """append_block (the scheduler's decode fast path) takes the same page allocate would, evicting the same cached
    block; it refuses, changing nothing, with window groups or no free page, where allocate's general path runs."""
    managers = [BlockManager(num_blocks=3, block_size=BS) for _ in range(2)]
    seqs = []
    for bm in managers:
        old = computed_seq(bm, toks(100, 2 * BS), "old")  # blocks 0 and 1, cached; freed: the queue is 2, 1, 0
        bm.free(old)
        seq = computed_seq(bm, toks(0, BS), "s")  # takes block 2; its table is full
        seq.num_computed = BS
        seqs.append(seq)
        assert len(bm.hash_to_block) == 3
    assert managers[0].allocate(seqs[0], BS + 1)
    assert managers[1].append_block(seqs[1])
    assert seqs[0].block_table == seqs[1].block_table == [2, 1]  # block 1 handed out again: its hash evicted
    assert managers[0].hash_to_block == managers[1].hash_to_block and len(managers[1].hash_to_block) == 2
    assert list(managers[0].free_queue) == list(managers[1].free_queue) == [0]
    assert managers[0].ref_counts == managers[1].ref_counts
    bm, seq = managers[1], seqs[1]
    assert bm.append_block(seq) and seq.block_table == [2, 1, 0]
    assert not bm.append_block(seq) and seq.block_table == [2, 1, 0]  # nothing free
    windowed = BlockManager(num_blocks=8, block_size=BS, window_groups=1, window=BS)
    wseq = make_seq(toks(0, BS))
    assert windowed.allocate(wseq, BS)
    free = windowed.num_free
    assert not windowed.append_block(wseq) and windowed.num_free == free and len(wseq.block_table) == 1
