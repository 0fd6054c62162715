"""KVCacheManager: block accounting, prefix hits, reviving, LRU eviction, all-or-nothing allocation."""

from __future__ import annotations

import hashlib
import itertools

import pytest

from tessera.engine import kv_cache
from tessera.engine.kv_cache import KVCacheManager, hash_block
from tessera.engine.request import Sequence
from tessera.sampling import SamplingParams

BS = 4
_ids = itertools.count()


def make_seq(prompt: list[int], max_tokens: int = 16) -> Sequence:
    return Sequence(f"req-{next(_ids)}", list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def prefill(kv: KVCacheManager, seq: Sequence) -> None:
    """Admit seq and compute its whole prompt in one chunk, as the engine would."""
    assert kv.allocate_for_admission(seq, max_new_tokens=10_000)
    seq.num_computed_tokens = seq.num_tokens
    kv.commit_computed(seq)


def decode(kv: KVCacheManager, seq: Sequence, token: int) -> None:
    """Append a sampled token, then compute it in the next step."""
    seq.output_token_ids.append(token)
    assert kv.allocate_slots(seq, 1)
    seq.num_computed_tokens += 1
    kv.commit_computed(seq)


def test_block_hash_is_chained_sha256_of_a_stable_encoding():
    tokens = [1, 2, 3, 70_000]
    expected = hashlib.sha256(b"".join(t.to_bytes(8, "little") for t in tokens)).digest()
    assert hash_block(None, tokens) == expected
    parent = hash_block(None, [9, 9, 9, 9])
    assert hash_block(parent, tokens) == hashlib.sha256(parent + b"".join(t.to_bytes(8, "little") for t in tokens)).digest()
    assert hash_block(parent, tokens) != hash_block(None, tokens)


def test_block_zero_is_never_handed_out_and_a_fresh_pool_is_all_free():
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    assert kv.num_usable_blocks == kv.num_free_blocks == 4 and kv.usage == 0.0
    seq = make_seq(list(range(16)))
    assert kv.allocate_for_admission(seq, 16)
    assert sorted(seq.block_table) == [1, 2, 3, 4] and kv.usage == 1.0
    kv.check_invariants([seq])
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        KVCacheManager(num_blocks=1, block_size=BS)


def test_second_sequence_reuses_exactly_the_shared_three_block_prefix():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    shared = list(range(100, 112))  # 3 full blocks
    a = make_seq(shared + [1, 2, 3])
    prefill(kv, a)
    b = make_seq(shared + [7, 8])
    assert kv.allocate_for_admission(b, 10_000)
    assert b.block_table[:3] == a.block_table[:3]
    assert b.block_table[3] not in a.block_table
    assert b.num_computed_tokens == b.num_cached_tokens == 3 * BS
    assert [kv.blocks[i].ref_count for i in a.block_table[:3]] == [2, 2, 2]
    assert (kv.prefix_queries, kv.prefix_hits) == (15 + 14, 12)
    kv.check_invariants([a, b])


def test_a_fully_cached_prompt_backs_off_one_block_to_compute_its_last_token():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    shared = list(range(100, 112))
    prefill(kv, make_seq(shared + [1]))
    exact = make_seq(shared)  # all 3 blocks cached, but its last token must produce logits
    assert kv.allocate_for_admission(exact, 10_000)
    assert exact.num_computed_tokens == 2 * BS
    assert exact.num_uncomputed_tokens == BS
    one_more = make_seq(shared + [5])
    assert kv.allocate_for_admission(one_more, 10_000)
    assert one_more.num_computed_tokens == 3 * BS


def test_freed_blocks_are_revived_by_a_later_identical_prompt():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(50, 60))  # 2 full blocks + 2 tokens
    first = make_seq(prompt)
    prefill(kv, first)
    full_blocks = first.block_table[:2]
    kv.free(first)
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert kv.num_cached_blocks == 2  # freed, but kept with their hashes
    again = make_seq(prompt)
    assert kv.allocate_for_admission(again, 10_000)
    assert again.block_table[:2] == full_blocks
    assert again.num_cached_tokens == 2 * BS and kv.num_evictions == 0
    assert kv.num_free_blocks == kv.num_usable_blocks - 3
    kv.check_invariants([again])


def test_eviction_takes_anonymous_blocks_first_then_cached_ones_least_recently_freed_first():
    kv = KVCacheManager(num_blocks=7, block_size=BS)  # usable blocks 1..6
    x = make_seq(list(range(10, 18)))  # 2 full blocks
    y = make_seq(list(range(20, 28)))
    prefill(kv, x)
    prefill(kv, y)
    assert (x.block_table, y.block_table) == ([1, 2], [3, 4])
    kv.free(x)  # freed tail first: block 2 is older in the LRU than block 1
    kv.free(y)

    def take_one() -> int:
        z = make_seq([999])
        assert kv.allocate_for_admission(z, 1)
        return z.block_table[0]

    order = [take_one() for _ in range(6)]
    assert order == [5, 6, 2, 1, 4, 3]
    assert kv.num_evictions == 4 and kv.num_cached_blocks == 0


def test_lru_keeps_the_head_of_a_prefix_longest():
    kv = KVCacheManager(num_blocks=5, block_size=BS)  # usable 1..4
    x = make_seq(list(range(10, 18)))
    prefill(kv, x)
    kv.free(x)
    filler = make_seq([7] * 9)  # needs 3 blocks: 3, 4 (anonymous) and x's tail block 2
    assert kv.allocate_for_admission(filler, 10_000)
    assert filler.block_table == [3, 4, 2] and kv.num_evictions == 1
    kv.free(filler)
    probe = make_seq(list(range(10, 18)) + [1])
    assert kv.allocate_for_admission(probe, 10_000)
    assert probe.block_table[0] == 1 and probe.num_cached_tokens == BS


def test_a_block_in_use_is_never_handed_out_and_failed_allocation_takes_nothing():
    kv = KVCacheManager(num_blocks=9, block_size=BS)
    holder = make_seq(list(range(12)))
    prefill(kv, holder)  # 3 cached blocks, in use
    other = make_seq([1] * 20)
    assert kv.allocate_for_admission(other, 20)  # the other 5 blocks
    assert not set(other.block_table) & set(holder.block_table)
    assert kv.num_free_blocks == 0
    before = (list(other.block_table), other.num_computed_tokens)
    assert not kv.allocate_slots(other, 21)
    assert (list(other.block_table), other.num_computed_tokens) == before
    late = make_seq([2] * 3)
    assert not kv.allocate_for_admission(late, 3)
    assert late.block_table == [] and late.num_computed_tokens == 0
    kv.check_invariants([holder, other, late])


def test_failed_admission_with_a_revivable_hit_takes_nothing():
    kv = KVCacheManager(num_blocks=5, block_size=BS)  # usable 1..4
    prompt = list(range(8))
    owner = make_seq(prompt)
    prefill(kv, owner)  # blocks 1, 2 registered
    kv.free(owner)  # free list: 3, 4 (anonymous), 2, 1 (cached)
    blocker = make_seq([5] * 8)
    assert kv.allocate_for_admission(blocker, 8)  # takes 3, 4
    # Hit: 2 blocks (revived from the free list) + 1 block for the tail: 3 needed, 2 free.
    wants = make_seq(prompt + [1, 2, 3])
    assert not kv.allocate_for_admission(wants, 10_000)
    assert wants.block_table == [] and wants.num_computed_tokens == 0
    assert kv.num_free_blocks == 2 and kv.num_cached_blocks == 2
    assert [kv.blocks[i].ref_count for i in (1, 2)] == [0, 0]
    kv.check_invariants([blocker, wants])
    kv.free(blocker)
    assert kv.allocate_for_admission(wants, 10_000)
    assert wants.block_table[:2] == [1, 2] and wants.num_computed_tokens == 8


def test_generated_tokens_are_cached_and_hit_by_the_next_turn():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    turn1 = make_seq([11, 12, 13, 14, 15, 16])  # 1.5 blocks
    prefill(kv, turn1)
    assert kv.num_cached_blocks == 1
    for token in [21, 22, 23, 24, 25, 26]:  # outputs complete block 1 and fill block 2
        decode(kv, turn1, token)
    turn1.output_token_ids.append(27)  # sampled last, never computed: the turn ended
    assert turn1.num_computed_tokens == 12
    assert kv.num_cached_blocks == 3
    head = list(turn1.block_table[:3])
    assert all(kv.blocks[b].block_hash is not None for b in head)
    kv.free(turn1)
    turn2 = make_seq(turn1.token_ids + [31, 32, 33])  # old prompt + old output + new text
    assert kv.allocate_for_admission(turn2, 10_000)
    assert turn2.block_table[:3] == head
    assert turn2.num_cached_tokens == turn2.num_computed_tokens == 12


def test_two_sequences_computing_one_prefix_at_once_register_it_once():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    a, b = make_seq(list(range(9))), make_seq(list(range(9)))
    assert kv.allocate_for_admission(a, 100) and kv.allocate_for_admission(b, 100)
    assert not set(a.block_table) & set(b.block_table)  # neither was computed yet: no hit
    for s in (a, b):
        s.num_computed_tokens = s.num_tokens
        kv.commit_computed(s)
    assert kv.num_cached_blocks == 2
    kv.check_invariants([a, b])
    b_blocks = list(b.block_table)
    assert all(kv.blocks[i].block_hash is None for i in b_blocks)
    kv.free(b)  # b's blocks are anonymous duplicates: they go to the front of the free list
    c = make_seq([3] * 12)
    assert kv.allocate_for_admission(c, 100)
    assert sorted(c.block_table) == sorted(b_blocks)
    assert kv.num_evictions == 0
    kv.check_invariants([a, c])


def test_invariant_check_catches_a_wrong_ref_count_and_a_stale_table():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    seq = make_seq(list(range(6)))
    prefill(kv, seq)
    kv.check_invariants([seq])
    with pytest.raises(AssertionError, match="ref_count"):
        kv.check_invariants([])  # a live sequence left out
    kv.blocks[seq.block_table[0]].ref_count += 1
    with pytest.raises(AssertionError, match="ref_count"):
        kv.check_invariants([seq])


def test_free_returns_every_block_and_counts_usage():
    kv = KVCacheManager(num_blocks=11, block_size=BS)
    a, b = make_seq(list(range(12))), make_seq(list(range(12)) + [5, 6])
    prefill(kv, a)
    prefill(kv, b)
    assert kv.usage == pytest.approx(4 / 10)
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == kv.num_usable_blocks and kv.usage == 0.0
    assert a.block_table == b.block_table == []
    kv.check_invariants([])


def test_with_prefix_caching_off_nothing_is_hashed(monkeypatch):
    def no_hashing(*args):
        raise AssertionError("hash_block called with prefix caching off")

    monkeypatch.setattr(kv_cache, "hash_block", no_hashing)
    kv = KVCacheManager(num_blocks=20, block_size=BS, enable_prefix_caching=False)
    prompt = list(range(13))
    a = make_seq(prompt)
    prefill(kv, a)
    for token in range(8):
        decode(kv, a, token)
    kv.free(a)
    b = make_seq(prompt)
    prefill(kv, b)
    assert b.num_cached_tokens == 0 and kv.num_cached_blocks == 0
    assert (kv.prefix_queries, kv.prefix_hits, kv.num_evictions) == (0, 0, 0)
    assert kv._seq_hashes == {}
    kv.check_invariants([b])


def test_host_index_lru_room_and_pending_blocks():
    from tessera.engine.swap import HostBlockPool

    host = HostBlockPool(num_blocks=2, block_size=BS)
    h = [bytes([i]) * 32 for i in range(4)]
    assert host.demote(h[0], 5) == (5, 0) and host.demote(h[1], 6) == (6, 1)
    assert host.demote(h[0], 7) is None  # already here: no copy, and h[0] is now the most recent
    assert host.demote(h[2], 8) == (8, 1)  # full: drops the least recently demoted, h[1]
    assert not host.has_cached(h[1]) and host.num_evicted_blocks == 1
    assert host.promote(h[2]) == 1  # pending until the copy ran: a demotion cannot take it
    assert host.demote(h[3], 9) == (9, 0) and host.num_evicted_blocks == 2  # drops h[0] instead
    assert host.cached_blocks() == {h[3]: 0} and host.promote(h[3]) == 0
    assert host.demote(bytes(32), 10) is None  # both pending, nothing cached: a plain eviction
    host.check_invariants([])
    host.begin_step()
    assert host.num_available_blocks == 2 and host.cached_blocks() == {}
    host.check_invariants([])


def test_an_evicted_block_is_demoted_and_a_later_hit_promotes_it():
    from tessera.engine.swap import HostBlockPool

    kv = KVCacheManager(num_blocks=4, block_size=BS)  # 3 usable blocks
    host = HostBlockPool(num_blocks=8, block_size=BS)
    kv.attach_host_tier(host)
    a = make_seq(list(range(100, 109)))  # 2 full blocks + 1 token
    prefill(kv, a)
    kv.free(a)
    b = make_seq(list(range(200, 212)))  # needs all 3 blocks: both of a's cached blocks go
    prefill(kv, b)
    first_demotions, promotions = kv.take_block_copies()
    assert len(first_demotions) == 2 and promotions == [] and host.num_cached_blocks == 2
    kv.free(b)
    host.begin_step()
    c = make_seq(list(range(100, 108)) + [5])
    assert kv.allocate_for_admission(c, 100)
    assert c.num_cached_tokens == 8 and host.num_promoted_blocks == 2
    _, promotions = kv.take_block_copies()
    # a's blocks come back from the host blocks they were demoted to, into c's first two blocks
    assert sorted(h for h, _ in promotions) == sorted(h for _, h in first_demotions)
    assert [d for _, d in promotions] == c.block_table[:2]
    kv.check_invariants([c])
    host.check_invariants([c])
