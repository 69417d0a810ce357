"""kvspec.spec.prefix: every rule of the prefix kind and every refusal, each
refusal shown to change nothing, the invariants after random op sequences,
and the worked examples of docs/prefix.md (semantics.md 11)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec.spec import prefix as sp
from kvspec.spec.errors import (
    InvalidArgumentError,
    KVCacheError,
    StateError,
    UnsupportedOperationError,
)

N = None  # the default salt


def world(block_size: int = 2, n_blocks: int = 6) -> sp.PrefixWorld:
    return sp.new_world(block_size, n_blocks)


def run(w: sp.PrefixWorld, *ops: dict) -> sp.PrefixWorld:
    for op in ops:
        _, w = sp.apply_op(w, op)
        assert sp.broken_invariants(w) == (), (op, sp.broken_invariants(w))
    return w


def admit(req: str, tokens: list[int], salt: int | None = None) -> dict:
    return {"op": "admit", "req": req, "tokens": tokens, "salt": salt}


def refused_unchanged(w: sp.PrefixWorld, call, exc=InvalidArgumentError, match: str | None = None) -> None:
    before = w
    with pytest.raises(exc, match=match):
        call(w)
    assert w == before


def key(tokens: tuple[int, ...], salt: int | None = None) -> sp.Key:
    return (salt, tuple(tokens))


# -- integer rules --------------------------------------------------------------------------


def test_integer_rules():
    assert [sp.max_hit_blocks(n, 2) for n in (1, 2, 3, 4, 5)] == [0, 0, 1, 1, 2]
    assert [sp.max_hit_blocks(n, 1) for n in (1, 2, 5)] == [0, 1, 4]
    assert [sp.blocks_for(n, 3) for n in (0, 1, 3, 4, 6, 7)] == [0, 1, 1, 2, 2, 3]
    assert [sp.full_blocks(n, 3) for n in (0, 2, 3, 5, 6)] == [0, 0, 1, 1, 2]
    assert sp.is_full(0, 3, 3) and not sp.is_full(1, 5, 3) and sp.is_full(1, 6, 3)
    assert sp.new_blocks_needed(4, 1, 2) == 1 and sp.new_blocks_needed(5, 2, 2) == 1 and sp.new_blocks_needed(5, 0, 2) == 3
    assert [sp.decode_blocks_needed(n, 1, 2) for n in (0, 1, 2, 3, 4)] == [1, 0, 1, 0, 1]
    assert sp.decode_blocks_needed(3, 4, 2) == 2
    assert sp.available_blocks(5, 2) == 3
    assert [sp.key_slot_length(1, s, 3) for s in range(3)] == [4, 5, 6]


def test_names():
    assert sp.row_name(1, (5, 6, 7), 1) == (1, (5, 6))
    assert sp.block_key(None, (5, 6, 7, 8, 9), 1, 2) == (None, (5, 6, 7, 8))
    assert sp.key_index((None, (5, 6, 7, 8)), 2) == 1
    assert sp.key_rows((0, (5, 6, 7, 8)), 2) == ((0, (5, 6, 7)), (0, (5, 6, 7, 8)))


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"block_size": 0, "n_blocks": 4}, InvalidArgumentError, "block_size must be an integer >= 1"),
    ({"block_size": 2, "n_blocks": 0}, InvalidArgumentError, "n_blocks must be an integer >= 1"),
    ({"block_size": True, "n_blocks": 4}, InvalidArgumentError, "block_size"),
    ({"block_size": 2, "n_blocks": 4, "window": 0}, InvalidArgumentError, "window must be None or an integer"),
    ({"block_size": 2, "n_blocks": 4, "window": True}, InvalidArgumentError, "window must be None or an integer"),
])
def test_new_world_refusals_name_the_field(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        sp.new_world(**kwargs)


def test_new_world_is_all_free_in_id_order():
    w = world(3, 4)
    assert w.free == (0, 1, 2, 3) and w.cached == () and dict(w.requests) == {}
    assert all(b == sp.Block(0, None, (None, None, None)) for b in w.blocks)
    assert sp.broken_invariants(w) == ()


# -- admit ----------------------------------------------------------------------------------


def test_admit_miss_takes_blocks_from_the_front_and_keys_the_full_ones():
    r, w = sp.admit(world(), "a", [1, 2, 3, 4, 5])
    assert r == sp.AdmitResult(True, 0, (0, 1, 2))
    assert w.free == (3, 4, 5)
    assert w.blocks[0].key == key((1, 2)) and w.blocks[1].key == key((1, 2, 3, 4))
    assert w.blocks[2].key is None  # the partial tail is never keyed
    assert w.blocks[2].rows == ((N, (1, 2, 3, 4, 5)), None)
    assert w.cached_map() == {key((1, 2)): (0,), key((1, 2, 3, 4)): (1,)}
    assert [b.refcount for b in w.blocks] == [1, 1, 1, 0, 0, 0]
    assert sp.broken_invariants(w) == ()


def test_admit_hit_shares_the_prefix_and_raises_the_refcounts():
    _, w = sp.admit(world(), "a", [1, 2, 3, 4, 5])
    assert sp.lookup(w, [1, 2, 3, 4, 9, 9]) == 4
    r, w = sp.admit(w, "b", [1, 2, 3, 4, 9, 9])
    assert r == sp.AdmitResult(True, 4, (0, 1, 3))
    assert [b.refcount for b in w.blocks[:4]] == [2, 2, 1, 1]
    assert w.blocks[3].key == key((1, 2, 3, 4, 9, 9))
    assert w.free == (4, 5)
    assert sp.broken_invariants(w) == ()


def test_hit_is_capped_one_token_short_of_a_whole_prompt_match():
    """Worked example: a prompt of two whole blocks, wholly cached, hits one
    block only (its last token is recomputed); its second block is computed
    again into a new block, cached under the same key: a duplicate."""
    _, w = sp.admit(world(), "a", [1, 2, 3, 4])
    assert sp.lookup(w, [1, 2, 3, 4]) == 2  # not 4
    assert sp.lookup(w, [1, 2, 3, 4, 5]) == 4
    assert sp.lookup(w, [1, 2, 3]) == 2
    assert sp.lookup(w, [1, 2]) == 0  # one block, whole: capped to 0
    r, w = sp.admit(w, "b", [1, 2, 3, 4])
    assert r == sp.AdmitResult(True, 2, (0, 2))
    assert w.cached_map()[key((1, 2, 3, 4))] == (1, 2)  # duplicate: the first stays first
    assert sp.lookup_block(w, key((1, 2, 3, 4))) == 1
    assert sp.broken_invariants(w) == ()


def test_salt_separates_keys():
    _, w = sp.admit(world(), "a", [1, 2, 3, 4, 5], salt=0)
    assert sp.lookup(w, [1, 2, 3, 4, 5], salt=0) == 4
    assert sp.lookup(w, [1, 2, 3, 4, 5]) == 0
    assert sp.lookup(w, [1, 2, 3, 4, 5], salt=1) == 0
    r, w = sp.admit(w, "b", [1, 2, 3], salt=1)
    assert r.hit_tokens == 0 and w.blocks[3].key == key((1, 2), 1)
    assert w.blocks[3].rows == ((1, (1,)), (1, (1, 2)))


def test_admit_without_room_returns_not_admitted_and_changes_nothing():
    _, w = sp.admit(world(2, 3), "a", [1, 2, 3])
    before = w
    r, w2 = sp.admit(w, "b", [7, 8, 9])
    assert r == sp.REFUSED == sp.AdmitResult(False, 0, ())
    assert w2 == before and "b" not in w2.requests


def test_room_counts_the_cached_free_hits_as_taken():
    """Touching a cached-free block takes it out of the free queue: an
    admission whose new blocks fit the queue only by counting its own hits
    twice is refused (vLLM's get_num_blocks_to_allocate)."""
    _, w = sp.admit(world(2, 3), "a", [1, 2, 3, 4, 5])
    _, w = sp.free(w, "a")
    assert w.free == (2, 1, 0)
    # hits blocks 0 and 1 (both cached-free), needs 2 new: 3 free - 2 hit = 1
    r, w2 = sp.admit(w, "b", [1, 2, 3, 4, 6, 7, 8])
    assert not r.admitted and w2 == w
    r, w3 = sp.admit(w, "b", [1, 2, 3, 4, 6])
    assert r == sp.AdmitResult(True, 4, (0, 1, 2))
    assert w3.free == () and sp.broken_invariants(w3) == ()


def test_refused_admit_keeps_its_hits_where_they_were_in_the_queue():
    """A refused admission touches nothing: its cached-free hit stays in its
    place, ahead of an unrelated block behind it (a rollback that re-queued
    it at the back would reorder the queue). lookup still reports the hit:
    it ignores room."""
    w = run(world(2, 4), admit("a", [1, 2, 3]), admit("c", [5, 6, 7]))
    w = run(w, {"op": "free", "req": "a"}, {"op": "free", "req": "c"})
    assert w.free == (3, 1, 0, 2)  # 0 (key (1,2)) is the hit; 2 (key (5,6)) sits behind it
    tokens = [1, 2, 9, 9, 9, 9, 9, 9, 9]  # hit 1 block, 4 new > 4 free - 1 cached-free hit
    r, w2 = sp.admit(w, "b", tokens)
    assert r == sp.REFUSED and w2 == w and w2.free == (3, 1, 0, 2)
    assert sp.lookup(w, tokens) == 2
    r, _ = sp.admit(w, "b", tokens[:7])  # 3 new: fits
    assert r == sp.AdmitResult(True, 2, (0, 3, 1, 2))


def test_cached_free_block_hit_leaves_the_free_queue():
    _, w = sp.admit(world(2, 6), "a", [1, 2, 3])
    _, w = sp.free(w, "a")
    assert w.free == (1, 2, 3, 4, 5, 0)  # tail unkeyed to the front, keyed root to the back
    assert w.blocks[0].refcount == 0 and w.blocks[0].key == key((1, 2))
    r, w = sp.admit(w, "b", [1, 2, 7])
    assert r == sp.AdmitResult(True, 2, (0, 1))
    assert w.blocks[0].refcount == 1 and 0 not in w.free and w.free == (2, 3, 4, 5)
    assert w.blocks[1].rows == ((N, (1, 2, 7)), None)


@pytest.mark.parametrize("args,exc,match", [
    ((1, [1]), InvalidArgumentError, "req must be a request id"),
    (("x", []), InvalidArgumentError, "at least one token"),
    (("x", [1, -1]), InvalidArgumentError, "integers >= 0"),
    (("x", [1, True]), InvalidArgumentError, "integers >= 0"),
    (("x", "12"), InvalidArgumentError, "list of token ids"),
    (("x", [1], -1), InvalidArgumentError, "salt must be None or an integer >= 0"),
    (("x", [1], "s"), InvalidArgumentError, "salt"),
    (("a", [1]), InvalidArgumentError, "already admitted"),
    (("p", [1]), StateError, "preempted; resume it"),
])
def test_admit_refusals_change_nothing(args, exc, match):
    w = run(world(), admit("a", [1, 2, 3]), admit("p", [4, 5]), {"op": "preempt", "req": "p"})
    refused_unchanged(w, lambda w: sp.admit(w, *args), exc, match)


# -- eviction and duplicates ----------------------------------------------------------------


def test_eviction_clears_the_key():
    """Worked example: a popped cached-free block loses its key; its entry
    leaves the map; a later lookup misses it."""
    _, w = sp.admit(world(2, 3), "a", [1, 2, 3, 4, 5])
    _, w = sp.free(w, "a")
    assert w.free == (2, 1, 0)
    r, w = sp.admit(w, "b", [7, 8, 9])  # pops 2 (unkeyed) then 1 (keyed: evicted)
    assert r == sp.AdmitResult(True, 0, (2, 1))
    assert w.blocks[1].key is None and w.blocks[1].rows == ((N, (7, 8, 9)), None)
    assert w.cached_map() == {key((1, 2)): (0,), key((7, 8)): (2,)}
    assert sp.lookup(w, [1, 2, 3, 4, 5]) == 2
    assert w.free == (0,) and sp.broken_invariants(w) == ()


def test_duplicate_keys_lookup_returns_the_first_and_evicting_the_second_keeps_it():
    _, w = sp.admit(world(2, 6), "a", [1, 2, 3, 4])
    _, w = sp.admit(w, "b", [1, 2, 3, 4])  # block 2: duplicate of block 1
    assert w.cached_map()[key((1, 2, 3, 4))] == (1, 2)
    _, w = sp.free(w, "a")  # release order 1, 0: 1 reaches 0 -> back; 0 still held by b
    _, w = sp.free(w, "b")  # release order 2, 0 -> back
    assert w.free == (3, 4, 5, 1, 2, 0)
    r, w = sp.admit(w, "c", [1, 2, 3, 4, 5])
    assert r == sp.AdmitResult(True, 4, (0, 1, 3))  # the first under the key: block 1
    _, w = sp.free(w, "c")
    assert w.free == (3, 4, 5, 2, 1, 0)  # c's tail 3 was unkeyed: to the front
    # pops 3, 4, 5 (unkeyed) then 2: the second of the duplicates, evicted
    r, w = sp.admit(w, "d", [9, 9, 9, 9, 9, 9, 9])
    assert r.table == (3, 4, 5, 2)
    assert w.cached_map()[key((1, 2, 3, 4))] == (1,)
    _, w = sp.free(w, "d")
    assert w.free == (2, 1, 0, 5, 4, 3)
    r, w = sp.admit(w, "e", [1, 2, 3, 4, 5])
    assert r == sp.AdmitResult(True, 4, (0, 1, 2))
    assert sp.broken_invariants(w) == ()


def test_evicting_the_first_of_duplicates_leaves_the_second_for_lookups():
    _, w = sp.admit(world(2, 5), "a", [1, 2, 3, 4])
    _, w = sp.admit(w, "b", [1, 2, 3, 4])
    assert w.cached_map()[key((1, 2, 3, 4))] == (1, 2)
    _, w = sp.free(w, "a")
    _, w = sp.free(w, "b")
    assert w.free == (3, 4, 1, 2, 0)
    r, w = sp.admit(w, "c", [7, 7, 7, 7, 7])  # pops 3, 4 and 1: the first of the duplicates
    assert r.table == (3, 4, 1)
    assert w.cached_map()[key((1, 2, 3, 4))] == (2,)
    assert sp.lookup_block(w, key((1, 2, 3, 4))) == 2
    assert sp.hit_table(w, N, (1, 2, 3, 4, 5)) == (0, 2)
    assert sp.broken_invariants(w) == ()


# -- decode ---------------------------------------------------------------------------------


def test_decode_fills_the_tail_then_keys_the_block_that_became_full():
    _, w = sp.admit(world(2, 4), "a", [1, 2, 3])
    ok, w = sp.decode(w, "a", [4])
    assert ok and w.requests["a"].table == (0, 1) and w.free == (2, 3)
    assert w.blocks[1].key == key((1, 2, 3, 4)) and w.blocks[1].rows == ((N, (1, 2, 3)), (N, (1, 2, 3, 4)))
    ok, w = sp.decode(w, "a", [5, 6, 7])  # several tokens: a verify block
    assert ok and w.requests["a"].table == (0, 1, 2, 3) and w.free == ()
    assert w.blocks[2].key == key((1, 2, 3, 4, 5, 6)) and w.blocks[3].key is None
    assert sp.broken_invariants(w) == ()


def test_decode_without_room_returns_false_and_changes_nothing():
    _, w = sp.admit(world(2, 2), "a", [1, 2, 3, 4])
    ok, w2 = sp.decode(w, "a", [5])
    assert ok is False and w2 == w
    _, w = sp.admit(world(2, 3), "a", [1, 2, 3])
    ok, w2 = sp.decode(w, "a", [4, 5, 6, 7])  # needs 2, 1 free
    assert ok is False and w2 == w


def test_decode_evicts_from_the_front():
    _, w = sp.admit(world(2, 3), "a", [1, 2])
    _, w = sp.free(w, "a")
    assert w.free == (1, 2, 0)
    _, w = sp.admit(w, "b", [5])
    ok, w = sp.decode(w, "b", [6, 7])  # fills block 1, pops 2
    assert ok and w.requests["b"].table == (1, 2) and w.free == (0,)
    assert w.blocks[1].key == key((5, 6))
    ok, w = sp.decode(w, "b", [8, 9])  # fills block 2, pops 0: a's cached root, evicted
    assert ok and w.requests["b"].table == (1, 2, 0)
    assert w.blocks[2].key == key((5, 6, 7, 8)) and w.blocks[0].key is None
    assert key((1, 2)) not in w.cached_map() and w.blocks[0].rows == ((N, (5, 6, 7, 8, 9)), None)
    assert sp.broken_invariants(w) == ()


@pytest.mark.parametrize("args,exc,match", [
    ((1, [1]), InvalidArgumentError, "req must be a request id"),
    (("a", []), InvalidArgumentError, "at least one token"),
    (("a", [-2]), InvalidArgumentError, "integers >= 0"),
    (("zz", [1]), StateError, "no request 'zz'"),
    (("p", [1]), StateError, "is preempted"),
])
def test_decode_refusals_change_nothing(args, exc, match):
    w = run(world(), admit("a", [1, 2, 3]), admit("p", [4, 5]), {"op": "preempt", "req": "p"})
    refused_unchanged(w, lambda w: sp.decode(w, *args), exc, match)


# -- free, preempt, resume ------------------------------------------------------------------


def test_free_order_tail_first_keyed_to_the_back_unkeyed_to_the_front():
    """Worked example: the prompt's root is the last of its blocks to be
    evicted; its private tail is reused first."""
    _, w = sp.admit(world(2, 6), "a", [1, 2, 3, 4, 5])
    assert w.free == (3, 4, 5)
    _, w = sp.free(w, "a")
    assert w.free == (2, 3, 4, 5, 1, 0)
    assert "a" not in w.requests
    assert [b.refcount for b in w.blocks] == [0] * 6
    assert w.blocks[0].key == key((1, 2)) and w.blocks[1].key == key((1, 2, 3, 4)) and w.blocks[2].key is None
    assert sp.broken_invariants(w) == ()


def test_free_of_a_shared_prefix_queues_only_blocks_reaching_zero():
    w = run(world(2, 8), admit("a", [1, 2, 3, 4, 5]), admit("b", [1, 2, 3, 4, 6, 7, 8]))
    assert w.requests["b"].table == (0, 1, 3, 4)
    _, w = sp.free(w, "b")  # 4 (unkeyed) front, 3 (keyed) back; 1, 0 still held by a
    assert w.free == (4, 5, 6, 7, 3)
    assert [b.refcount for b in w.blocks[:3]] == [1, 1, 1]
    _, w = sp.free(w, "a")
    assert w.free == (2, 4, 5, 6, 7, 3, 1, 0)
    assert sp.broken_invariants(w) == ()


def test_free_after_decode_queues_keyed_blocks_tail_first():
    w = run(world(1, 5), admit("a", [1, 2]), {"op": "decode", "req": "a", "tokens": [3]})
    _, w = sp.free(w, "a")  # B = 1: every block full and keyed
    assert w.free == (3, 4, 2, 1, 0)


@pytest.mark.parametrize("op", ["free", "preempt"])
@pytest.mark.parametrize("req,exc,match", [
    (1, InvalidArgumentError, "req must be a request id"),
    ("zz", StateError, "no request 'zz'"),
    ("p", StateError, "is preempted"),
])
def test_free_and_preempt_refusals_change_nothing(op, req, exc, match):
    w = run(world(), admit("a", [1, 2, 3]), admit("p", [4, 5]), {"op": "preempt", "req": "p"})
    fn = getattr(sp, op)
    refused_unchanged(w, lambda w: fn(w, req), exc, match)


def test_double_free_is_refused():
    _, w = sp.admit(world(), "a", [1, 2, 3])
    _, w = sp.free(w, "a")
    refused_unchanged(w, lambda w: sp.free(w, "a"), StateError, "no request 'a'")


def test_preempt_then_resume_hits_its_own_blocks():
    """Worked example: preemption releases as free does, keeps the tokens
    (prompt and decoded); resume re-admits them and hits what was keyed."""
    w = run(world(2, 6), admit("a", [1, 2, 3]), {"op": "decode", "req": "a", "tokens": [4, 5]})
    assert w.requests["a"].table == (0, 1, 2)
    _, w = sp.preempt(w, "a")
    assert w.requests["a"] == sp.Req((1, 2, 3, 4, 5), None, (), False)
    assert w.free == (2, 3, 4, 5, 1, 0)
    assert sp.broken_invariants(w) == ()
    r, w = sp.resume(w, "a")
    assert r == sp.AdmitResult(True, 4, (0, 1, 2))
    assert w.requests["a"].live and w.free == (3, 4, 5)
    assert sp.broken_invariants(w) == ()


def test_preempt_then_resume_keeps_the_salt():
    """Resume re-admits under the request's own salt: it hits the blocks
    keyed under that salt, not an unsalted copy of the same tokens."""
    w = run(world(2, 8), admit("a", [1, 2, 3], salt=5), {"op": "decode", "req": "a", "tokens": [4, 5]},
            admit("u", [1, 2, 3, 4, 6]))
    assert w.requests["a"].table == (0, 1, 2) and w.requests["u"].table == (3, 4, 5)
    _, w = sp.preempt(w, "a")
    assert w.requests["a"] == sp.Req((1, 2, 3, 4, 5), 5, (), False)
    r, w = sp.resume(w, "a")
    assert r == sp.AdmitResult(True, 4, (0, 1, 2))
    assert w.requests["a"].salt == 5 and w.blocks[2].rows == ((5, (1, 2, 3, 4, 5)), None)
    assert sp.broken_invariants(w) == ()
    assert sp.lookup(w, [1, 2, 3, 4, 5], salt=5) == 4 and sp.lookup(w, [1, 2, 3, 4, 5]) == 4


def test_resume_without_room_stays_preempted():
    w = run(world(2, 3), admit("a", [1, 2, 3]))
    _, w = sp.preempt(w, "a")
    w = run(w, admit("b", [7, 7, 7, 7, 7]))  # takes the three blocks (evicting a's root)
    r, w2 = sp.resume(w, "a")
    assert r == sp.REFUSED and w2 == w and not w2.requests["a"].live


@pytest.mark.parametrize("req,exc,match", [
    (1, InvalidArgumentError, "req must be a request id"),
    ("zz", StateError, "no request 'zz'"),
    ("a", StateError, "is live, not preempted"),
])
def test_resume_refusals_change_nothing(req, exc, match):
    w = run(world(), admit("a", [1, 2, 3]))
    refused_unchanged(w, lambda w: sp.resume(w, req), exc, match)


# -- lookup, free_blocks, reset -------------------------------------------------------------


@pytest.mark.parametrize("args,match", [
    (([],), "at least one token"), (([1, "x"],), "integers >= 0"), (([1], -3), "salt"),
])
def test_lookup_refusals(args, match):
    with pytest.raises(InvalidArgumentError, match=match):
        sp.lookup(world(), *args)


@pytest.mark.parametrize("blocks,exc,match", [
    ([], InvalidArgumentError, "non-empty list"),
    (3, InvalidArgumentError, "non-empty list"),
    ([6], InvalidArgumentError, r"block ids in 0\.\.5"),
    ([True], InvalidArgumentError, "block ids"),
    ([0, 0], InvalidArgumentError, "listed twice"),
    ([4], StateError, "refcount 0"),
    ([1, 4], StateError, "refcount 0"),
    ([1], StateError, r"held by request\(s\) \['a'\]"),
    ([0], StateError, r"\['a', 'b'\]"),
])
def test_free_blocks_is_always_refused_and_changes_nothing(blocks, exc, match):
    w = run(world(2, 6), admit("a", [1, 2, 3]), admit("b", [1, 2, 5]))
    refused_unchanged(w, lambda w: sp.free_blocks(w, blocks), exc, match)


def test_reset_refused_while_blocks_are_held():
    w = run(world(2, 4), admit("a", [1, 2, 3]), admit("b", [5, 6, 7]))
    ok, w2 = sp.reset(w)
    assert ok is False and w2 == w
    _, w = sp.free(w, "a")
    ok, w2 = sp.reset(w)
    assert ok is False and w2 == w  # b still holds blocks
    _, w = sp.preempt(w, "b")  # a preempted request holds none
    queue = w.free
    ok, w = sp.reset(w)
    assert ok is True
    assert w.cached == () and all(b.key is None for b in w.blocks)
    assert w.free == queue  # the queue keeps its order
    assert sp.lookup(w, [1, 2, 3]) == 0
    assert sp.broken_invariants(w) == ()
    r, w = sp.resume(w, "b")
    assert r == sp.AdmitResult(True, 0, (3, 1))  # the front of the queue: b's tail, then a's


def test_the_worked_example_of_docs_prefix():
    """docs/prefix.md's worked example, step by step."""
    w = world(2, 4)
    steps = [
        (admit("a", [1, 2, 3, 4]), {"admitted": True, "hit": 0, "table": [0, 1]}, (2, 3)),
        (admit("b", [1, 2, 3, 4]), {"admitted": True, "hit": 2, "table": [0, 2]}, (3,)),
        ({"op": "free", "req": "a"}, None, (3, 1)),
        (admit("c", [1, 2, 3, 4, 5]), {"admitted": True, "hit": 4, "table": [0, 1, 3]}, ()),
        (admit("d", [7]), {"admitted": False, "hit": 0, "table": []}, ()),
        ({"op": "free", "req": "c"}, None, (3, 1)),
        ({"op": "free", "req": "b"}, None, (3, 1, 2, 0)),
        (admit("d", [7, 8, 9]), {"admitted": True, "hit": 0, "table": [3, 1]}, (2, 0)),
        ({"op": "lookup", "tokens": [1, 2, 3, 4, 5]}, 4, (2, 0)),
    ]
    for i, (op, want, queue) in enumerate(steps, 1):
        got, w = sp.apply_op(w, op)
        assert (got, w.free) == (want, queue), i
        assert sp.broken_invariants(w) == ()
        if i == 2:
            assert w.cached_map()[key((1, 2, 3, 4))] == (1, 2)
    assert w.cached_map() == {key((1, 2)): (0,), key((1, 2, 3, 4)): (2,), key((7, 8)): (3,)}
    assert w.blocks[1].rows == ((N, (7, 8, 9)), None) and w.blocks[1].key is None


# -- apply_op, observe, the model ---------------------------------------------------------


def test_apply_op_results_are_trace_shaped():
    w = world(2, 4)
    r, w = sp.apply_op(w, admit("a", [1, 2, 3]))
    assert r == {"admitted": True, "hit": 0, "table": [0, 1]}
    r, w = sp.apply_op(w, {"op": "admit", "req": "b", "tokens": [1, 2, 9]})  # salt absent: None
    assert r == {"admitted": True, "hit": 2, "table": [0, 2]}
    r, w = sp.apply_op(w, {"op": "decode", "req": "a", "tokens": [4]})
    assert r is True
    r, w = sp.apply_op(w, {"op": "lookup", "tokens": [1, 2, 3, 4, 5]})
    assert r == 4
    r, w = sp.apply_op(w, {"op": "preempt", "req": "b"})
    assert r is None
    r, w = sp.apply_op(w, {"op": "resume", "req": "b"})
    assert r == {"admitted": True, "hit": 2, "table": [0, 2]}
    r, w = sp.apply_op(w, {"op": "free", "req": "b"})
    assert r is None
    r, w = sp.apply_op(w, {"op": "reset"})
    assert r is False
    view, w2 = sp.apply_op(w, {"op": "expect", "req": "a", "hit": 0})
    assert w2 == w and view == sp.observe(w)
    with pytest.raises(StateError):
        sp.apply_op(w, {"op": "free_blocks", "blocks": [0]})
    with pytest.raises(UnsupportedOperationError, match="not an operation of a prefix cache"):
        sp.apply_op(w, {"op": "fork"})
    with pytest.raises(InvalidArgumentError, match="needs the field 'tokens'"):
        sp.apply_op(w, {"op": "decode", "req": "a"})


def test_observe_names_every_observable():
    w = run(world(2, 4), admit("a", [1, 2, 3]), admit("p", [1, 2, 4]), {"op": "preempt", "req": "p"})
    view = sp.observe(w)
    assert view["requests"] == {"a": {"table": [0, 1], "tokens": 3, "live": True},
                                "p": {"table": [], "tokens": 3, "live": False}}
    assert view["blocks"] == [(1, key((1, 2))), (1, None), (0, None), (0, None)]
    assert view["free"] == [2, 3]
    assert view["cached"] == {key((1, 2)): [0]}
    # rows of held or keyed blocks only (block 2, p's freed tail, is free and unkeyed)
    assert view["rows"] == {(0, 0): (N, (1,)), (0, 1): (N, (1, 2)), (1, 0): (N, (1, 2, 3)), (1, 1): None}


def test_model_replaces_its_world_only_on_success():
    m = sp.PrefixModel(2, 3)
    assert m.declared == {}
    assert m.admit("a", [1, 2, 3]) == sp.AdmitResult(True, 0, (0, 1))
    before = m.world
    with pytest.raises(InvalidArgumentError):
        m.admit("a", [1])
    with pytest.raises(StateError):
        m.free_blocks([0])
    assert m.admit("b", [5, 6, 7, 8, 9]) == sp.REFUSED
    assert m.world == before
    assert m.reset() is False and m.world is before  # refused: not even reassigned
    assert m.decode("a", [4]) is True and m.lookup([1, 2, 3, 4, 5]) == 4
    m.preempt("a")
    assert m.reset() is True
    assert m.resume("a").hit_tokens == 0
    m.free("a")
    assert m.observe()["requests"] == {}


# -- each invariant sees its own break -------------------------------------------------------


def _base() -> sp.PrefixWorld:
    w = run(world(2, 5), admit("a", [1, 2, 3, 4, 5]))
    _, w = sp.free(w, "a")
    return run(w, admit("b", [1, 2, 7]))  # b hits cached-free block 0


def _set_block(w: sp.PrefixWorld, b: int, **kw) -> sp.PrefixWorld:
    blocks = list(w.blocks)
    blocks[b] = replace(blocks[b], **kw)
    return replace(w, blocks=tuple(blocks))


@pytest.mark.parametrize("breakage,names", [
    # a block evicted and rewritten but still reached through its old key (the reports' fault)
    (lambda w: _set_block(w, 1, rows=((N, (9,)), (N, (9, 9)))), {"keys_name_contents"}),
    # the map keeps an id whose block lost its key (stale entry on eviction)
    (lambda w: _set_block(w, 1, key=None), {"keys_name_contents", "cached_map_exact"}),
    # a keyed block missing from the map
    (lambda w: replace(w, cached=tuple((k, ids) for k, ids in w.cached if ids != (1,))), {"cached_map_exact"}),
    # a hit that did not raise the refcount
    (lambda w: _set_block(w, 0, refcount=0), {"refcounts_match_tables", "free_queue_exact"}),
    # a touched block left in the free queue
    (lambda w: replace(w, free=w.free + (0,)), {"free_queue_exact"}),
    # a free block queued twice
    (lambda w: replace(w, free=w.free + (w.free[0],)), {"free_queue_exact"}),
    # a row overwritten under a live request
    (lambda w: _set_block(w, 2, rows=((N, (1, 2, 8)), None)), {"requests_read_their_rows"}),
    # the partial tail keyed
    (lambda w: replace(_set_block(w, 2, key=(N, (1, 2, 7))), cached=w.cached + (((N, (1, 2, 7)), (2,)),)),
     {"partial_tail_private", "keys_name_contents"}),
    # the unkeyed partial tail shared (refcount 2): a second live request holding b's table
    (lambda w: replace(_set_block(_set_block(w, 0, refcount=2), 2, refcount=2),
                       requests={**w.requests, "c": w.requests["b"]}), {"partial_tail_private"}),
    # a table one block short
    (lambda w: replace(w, requests={**w.requests, "b": replace(w.requests["b"], table=(0,))}),
     {"tables_sized", "requests_read_their_rows", "refcounts_match_tables", "partial_tail_private"}),
    # a held full block whose key was dropped (and its entry with it)
    (lambda w: replace(_set_block(w, 0, key=None), cached=tuple((k, i) for k, i in w.cached if i != (0,))),
     {"full_blocks_keyed"}),
])
def test_each_invariant_sees_its_break(breakage, names):
    w = _base()
    assert sp.broken_invariants(w) == ()
    assert set(sp.broken_invariants(breakage(w))) == names


# -- random op sequences --------------------------------------------------------------------

BASES = ((1, 2, 3, 4, 5, 6, 7), (1, 2, 3, 9, 9, 8), (1, 2, 3, 4, 5, 6, 1, 2), (5, 6, 7))
REQS = ("a", "b", "c", "d")


@st.composite
def ops(draw) -> dict:
    kind = draw(st.sampled_from(["admit", "admit", "admit", "decode", "decode", "free", "free", "preempt",
                                 "resume", "lookup", "reset", "free_blocks"]))
    req = draw(st.sampled_from(REQS))
    if kind in ("admit", "lookup"):
        base = draw(st.sampled_from(BASES))
        n = draw(st.integers(1, len(base)))
        tokens = list(base[:n]) + draw(st.lists(st.integers(0, 3), max_size=1))
        salt = draw(st.sampled_from([None, None, 0, 1]))
        op = {"op": kind, "tokens": tokens, "salt": salt}
        return {**op, "req": req} if kind == "admit" else op
    if kind == "decode":
        return {"op": "decode", "req": req, "tokens": draw(st.lists(st.integers(0, 9), min_size=1, max_size=2))}
    if kind == "free_blocks":
        return {"op": "free_blocks", "blocks": draw(st.lists(st.integers(0, 7), max_size=3))}
    if kind == "reset":
        return {"op": "reset"}
    return {"op": kind, "req": req}


def _step(w: sp.PrefixWorld, op: dict) -> tuple[object, sp.PrefixWorld, bool]:
    """Apply ``op``; return (result, new world, refused)."""
    before = w
    try:
        r, w = sp.apply_op(w, op)
    except KVCacheError:
        return None, before, True
    return r, w, False


@settings(max_examples=300, deadline=None)
@given(bs=st.integers(1, 4), n_blocks=st.integers(3, 8), seq=st.lists(ops(), max_size=30))
def test_invariants_hold_after_random_op_sequences(bs, n_blocks, seq):
    w = sp.new_world(bs, n_blocks)
    for op in seq:
        hit_before = None
        if op["op"] == "admit":
            hit_before = sp.lookup(w, op["tokens"], op["salt"])
        before = w
        r, w, refused = _step(w, op)
        assert sp.broken_invariants(w) == (), (op, sp.broken_invariants(w))
        if refused or r is False or (isinstance(r, dict) and not r["admitted"]):
            assert w == before  # a refusal, a decode or admit without room, a refused reset
        if op["op"] == "free_blocks":
            assert refused
        if op["op"] == "admit" and not refused:
            assert r["hit"] == (hit_before if r["admitted"] else 0)
            assert r["hit"] % bs == 0 and r["hit"] <= len(op["tokens"]) - 1
        if op["op"] == "lookup":
            assert w == before


def test_random_walk_reaches_every_worked_event():
    """A seeded walk of the same op mix reaches the events the examples
    above show (so the property test's draws do too): hits, capped
    whole-prompt hits, cached-free hits, evictions, duplicate keys, admit
    and decode without room, reset refused and done, preempt then resume
    with a hit."""
    seen: set[str] = set()
    rng = random.Random(20261207)
    for _ in range(60):
        bs = rng.randint(1, 4)
        w = sp.new_world(bs, rng.randint(3, 8))
        for _ in range(40):
            kind = rng.choice(["admit"] * 3 + ["decode"] * 2 + ["free", "free", "preempt", "resume", "reset"])
            req = rng.choice(REQS)
            if kind == "admit":
                base = rng.choice(BASES)
                op = {"op": "admit", "req": req, "tokens": list(base[:rng.randint(1, len(base))]),
                      "salt": rng.choice([None, 0])}
            elif kind == "decode":
                op = {"op": "decode", "req": req, "tokens": [rng.randint(0, 9)]}
            elif kind == "reset":
                op = {"op": "reset"}
            else:
                op = {"op": kind, "req": req}
            keyed = {b for b, blk in enumerate(w.blocks) if blk.key is not None}
            cached_free = {b for b in keyed if w.blocks[b].refcount == 0}
            was_preempted = req in w.requests and not w.requests[req].live
            r, w2, refused = _step(w, op)
            assert sp.broken_invariants(w2) == ()
            if refused:
                continue
            if isinstance(r, dict):
                if not r["admitted"]:
                    seen.add("admit refused")
                elif r["hit"]:
                    seen.add("hit")
                    if r["hit"] == len(op.get("tokens", w2.requests[req].tokens)) - bs:
                        seen.add("capped")
                    if set(r["table"]) & cached_free:
                        seen.add("cached-free hit")
                    if was_preempted:
                        seen.add("preempt then resume hit")
            if r is False and op["op"] == "decode":
                seen.add("decode refused")
            if op["op"] == "reset":
                seen.add("reset" if r else "reset refused")
            if any(w2.blocks[b].key != w.blocks[b].key for b in keyed):
                seen.add("eviction")
            if any(len(ids) > 1 for _, ids in w2.cached):
                seen.add("duplicate keys")
            w = w2
    assert seen == {"admit refused", "hit", "capped", "cached-free hit", "preempt then resume hit",
                    "decode refused", "reset", "reset refused", "eviction", "duplicate keys"}


# -- sliding window (window = w) ------------------------------------------------------------
# The expected tables, queues and hits below are vLLM 0.34.0's SlidingWindowManager's on the same
# calls (its block ids are ours + 1, its null block 0 is our None).


def ids(table) -> list:
    return [None if b is None else b for b in table]


def test_window_integer_rules():
    # get_num_skipped_tokens(n) = max(0, n - w + 1); blocks wholly before the window: // B
    assert [sp.skipped_blocks(n, 5, 1) for n in range(12)] == [0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7]
    assert [sp.skipped_blocks(n, 3, 2) for n in (7, 8, 9, 10)] == [2, 3, 3, 4]
    assert [sp.hit_run(w, 4) for w in (1, 2, 5, 8, 9)] == [1, 1, 1, 2, 2]
    assert sp.hit_run(3, 2) == 1 and sp.hit_run(5, 2) == 2
    assert sp.window_keys(None) and sp.window_keys(2) and not sp.window_keys(1)


@pytest.mark.parametrize("cached,run,want", [
    # vLLM's find_longest_cache_hit on a pool with exactly these blocks cached (B=4 w=8: run 2, cap 4)
    ((1, 1, 1, 1), 2, 4), ((1, 0, 1, 1), 2, 4), ((1, 1, 0, 1), 2, 2), ((0, 1, 0, 1), 2, 0),
    ((1, 1, 0, 0), 2, 2), ((1, 1, 1, 1, 1), 2, 5),
    ((1, 0, 1, 0), 1, 3), ((0, 0, 0, 1), 1, 4),  # B=2 w=3: run 1
    ((1, 1, 0, 1, 0), 2, 2),  # B=2 w=5: no run of 2, the leading run
    ((0, 1, 0, 0), 1, 2), ((0, 0, 0, 0), 1, 0),  # w=1 (run 0 counts as 1)
    ((1, 0, 1, 0, 1), 1, 5), ((1, 0, 0), 1, 1),
])
def test_window_hit_is_vllms_scan(cached, run, want):
    assert sp.window_hit(tuple(bool(c) for c in cached), run) == want


@given(st.lists(st.booleans(), max_size=8), st.integers(1, 4))
def test_window_hit_contract_on_every_small_input(cached, run):
    cached = tuple(cached)
    e = sp.window_hit(cached, run)
    assert 0 <= e <= len(cached) and all(cached[max(0, e - run):e])
    assert not any(all(cached[max(0, f - run):f]) for f in range(e + 1, len(cached) + 1))


def test_window_prompt_longer_than_w_keeps_every_block_until_the_next_decode():
    """B=2 w=3, 7 tokens: every block allocated at admit (the prefill computes through them); each
    decode from n tokens first releases the blocks below (n - w + 1) // B, highest first, keyed ones
    to the back; vLLM: tables [1,2,3,4] -> [0,0,3,4] -> [0,0,0,4,5] -> same -> [0,0,0,0,5,6]."""
    w = sp.new_world(2, 12, 3)
    r, w = sp.admit(w, "A", list(range(7)))
    assert r.table == (0, 1, 2, 3) and sorted(b for b, x in enumerate(w.blocks) if x.key) == [0, 1, 2]
    tables, queues = [], []
    for t in (100, 101, 102, 103):
        ok, w = sp.decode(w, "A", [t])
        assert ok and sp.broken_invariants(w) == ()
        tables.append(ids(w.requests["A"].table))
        queues.append(w.free[-4:])
    assert tables == [[None, None, 2, 3], [None, None, None, 3, 4], [None, None, None, 3, 4],
                      [None, None, None, None, 4, 5]]
    assert queues[0] == (10, 11, 1, 0) and queues[-1] == (1, 0, 2, 3)
    # out-of-window full blocks keep their keys (cached-free, at the back)
    assert all(w.blocks[b].key is not None for b in (0, 1, 2, 3))
    _, w = sp.free(w, "A")  # the leading Nones skipped, the rest tail first
    assert w.free == (5, 6, 7, 8, 9, 10, 11, 1, 0, 2, 3, 4)


def test_window_hit_pads_with_none_and_touches_only_the_run():
    """B=2 w=3: A (9 tokens) freed, then B = A's tokens + 1: cap 4 blocks, run 1: hit 8 through
    block 3 alone; vLLM's table [0,0,0,4,5], refcounts {4: 1, 5: 1}."""
    w = sp.new_world(2, 12, 3)
    _, w = sp.admit(w, "A", list(range(9)))
    _, w = sp.free(w, "A")
    assert sp.lookup(w, list(range(9)) + [50]) == 8
    r, w = sp.admit(w, "B", list(range(9)) + [50])
    assert (r.hit_tokens, r.table) == (8, (None, None, None, 3, 4))
    assert [b.refcount for b in w.blocks[:5]] == [0, 0, 0, 1, 1] and sp.broken_invariants(w) == ()


def test_window_hit_past_a_gap():
    """Block 1's key evicted: full attention hits 1 block, a window of run 1 hits up to the cap."""
    w = sp.new_world(2, 6, 3)
    _, w = sp.admit(w, "A", [1, 2, 3, 4, 5, 6, 7])
    _, w = sp.free(w, "A")  # queue: 3 (unkeyed) front, then 4 5, then keyed 2 1 0
    w2 = replace(w, window=None)
    assert sp.lookup(w2, [1, 2, 3, 4, 5, 6, 7, 8]) == 6
    # evict block 1 (key (1,2,3,4)) by hand through the private pop: drop it from cached
    w = replace(w, cached=tuple((k, i) for k, i in w.cached if len(k[1]) != 4),
                blocks=sp._set(w.blocks, 1, replace(w.blocks[1], key=None)))
    assert sp.lookup(replace(w, window=None), [1, 2, 3, 4, 5, 6, 7, 8]) == 2
    assert sp.lookup(w, [1, 2, 3, 4, 5, 6, 7, 8]) == 6  # blocks 2 cached: run of 1 ends at the cap


def test_window_release_makes_room_for_the_decode():
    """4 blocks, A holds them all (8 tokens, B=2 w=3): the decode's release frees 3, so it succeeds
    (vLLM: [0,0,0,4,3], queue [2,1])."""
    w = sp.new_world(2, 4, 3)
    _, w = sp.admit(w, "A", list(range(8)))
    ok, w = sp.decode(w, "A", [9])
    assert ok and ids(w.requests["A"].table) == [None, None, None, 3, 2] and w.free == (1, 0)


def test_window_refused_decode_changes_nothing_not_even_the_release():
    """B=2 w=2, 4 blocks: A (5 tokens) holds 0 1 2; B (6 tokens) hits through block 1 alone (table
    [None, 1, 3]): the pool is full. A's decode of 4 tokens would release blocks 1 (shared: no room
    gained) and 0 (one block of room) but needs 2: refused, the release undone with it (vLLM keeps
    it: docs/prefix.md, Decisions)."""
    w = sp.new_world(2, 4, 2)
    _, w = sp.admit(w, "A", [1, 2, 3, 4, 5])
    r, w = sp.admit(w, "B", [1, 2, 3, 4, 5, 6])
    assert (r.hit_tokens, r.table) == (4, (None, 1, 3)) and w.free == ()
    before = w
    ok, w = sp.decode(w, "A", [6, 7, 8, 9])
    assert not ok and w == before
    ok, w = sp.decode(w, "A", [6, 7, 8])  # one block needed: the release makes room
    assert ok and ids(w.requests["A"].table) == [None, None, 2, 0] and w.blocks[1].refcount == 1


def test_window_one_keys_nothing():
    w = sp.new_world(2, 8, 1)
    _, w = sp.admit(w, "A", list(range(7)))
    assert w.cached == () and all(b.key is None for b in w.blocks)
    ok, w = sp.decode(w, "A", [9])  # n=7: 3 blocks released, unkeyed: to the front, highest first
    assert ok and ids(w.requests["A"].table) == [None, None, None, 3] and w.free[:3] == (2, 1, 0)
    assert sp.lookup(w, list(range(7))) == 0


def test_window_invariants_see_a_none_inside_the_window():
    w = sp.new_world(2, 8, 3)
    _, w = sp.admit(w, "A", list(range(5)))
    q = w.requests["A"]
    bad = replace(w, requests={"A": replace(q, table=(q.table[0], None, q.table[2]))},
                  blocks=sp._set(w.blocks, q.table[1], replace(w.blocks[q.table[1]], refcount=0)),
                  free=w.free + (q.table[1],))
    assert "requests_read_their_rows" in sp.broken_invariants(bad)
    _, w = sp.admit(sp.new_world(2, 8, 3), "A", [0, 1, 2])
    q = w.requests["A"]
    early = replace(w, requests={"A": replace(q, table=(None,) + q.table[1:])},
                    blocks=sp._set(w.blocks, q.table[0], replace(w.blocks[q.table[0]], refcount=0)),
                    free=w.free + (q.table[0],))
    assert "requests_read_their_rows" in sp.broken_invariants(early)  # 3 tokens, w=3: block 0 is needed


@settings(max_examples=300, deadline=None)
@given(bs=st.integers(1, 4), n_blocks=st.integers(3, 8), window=st.integers(1, 5), seq=st.lists(ops(), max_size=30))
def test_window_invariants_hold_after_random_op_sequences(bs, n_blocks, window, seq):
    w = sp.new_world(bs, n_blocks, window)
    for op in seq:
        before = w
        r, w, refused = _step(w, op)
        assert sp.broken_invariants(w) == (), (op, sp.broken_invariants(w))
        if refused or r is False or (isinstance(r, dict) and not r["admitted"]):
            assert w == before
        if op["op"] == "admit" and not refused and r["admitted"]:
            assert r["hit"] % bs == 0 and r["hit"] <= len(op["tokens"]) - 1
