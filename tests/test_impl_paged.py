"""The MLX block pool and its KVCache against spec/paged.py: byte-identical
windows, the same block tables, refcounts, free list and write paths, with
block sizes 1 to 4; in-place writes that really alias the slab; atomic
refusals; an mlx-lm model decoding through pool sequences."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec.impl.paged import BlockPool, PagedKVCache, fork_prompt_cache, make_paged_prompt_cache
from kvspec.spec import paged as sp
from kvspec.spec.errors import InvalidArgumentError, StateError, UnsupportedOperationError

H, DK, DV = 2, 3, 2


def rows(first: int, n: int, dtype=mx.float16) -> tuple[mx.array, mx.array]:
    """``[1, H, n, D]`` rows whose every value names the token identity
    (distinct per head and per K/V)."""
    t = np.arange(first, first + n, dtype=np.float32)[None, None, :, None]
    k = t * 8 + np.arange(H, dtype=np.float32)[None, :, None, None] + np.zeros((1, H, n, DK), np.float32)
    v = -(t * 8 + np.arange(H, dtype=np.float32)[None, :, None, None]) + np.zeros((1, H, n, DV), np.float32)
    return mx.array(k).astype(dtype), mx.array(v).astype(dtype)


def expected(tokens: tuple[int, ...], dtype=mx.float16) -> tuple[np.ndarray, np.ndarray]:
    ks, vs = zip(*(rows(t, 1, dtype) for t in tokens), strict=True) if tokens else ((), ())
    k = mx.concatenate(ks, axis=2) if ks else None
    v = mx.concatenate(vs, axis=2) if vs else None
    return k, v


def same_window(got, tokens: tuple[int, ...]) -> bool:
    if not tokens:
        return got is None
    k, v = expected(tokens)
    return bool(np.array_equal(np.array(got[0]), np.array(k)) and np.array_equal(np.array(got[1]), np.array(v)))


def pool_state(pool: BlockPool):
    """Everything a refused op must leave alone, slab bytes included."""
    slabs = None if pool.keys is None else tuple(bytes(memoryview(a.view(mx.uint8))) for a in (pool.keys, pool.values))
    seqs = {k: (list(s.table), s.length, s.start) for k, s in pool.seqs.items()}
    return seqs, list(pool.refcounts), list(pool.free), slabs


def apply_both(pool: BlockPool, world: sp.PagedWorld, op: dict):
    """One op on the implementation and on the spec; both refuse alike."""
    seq = op.get("seq", "main")
    try:
        result, world2 = sp.apply_op(world, op)
    except (StateError, InvalidArgumentError, UnsupportedOperationError) as exc:
        before = pool_state(pool)
        with pytest.raises(type(exc)):
            run_impl(pool, world, op, seq)
        assert pool_state(pool) == before
        return world, None
    got = run_impl(pool, world, op, seq)
    if op["op"] == "append":
        w = pool.last_write
        assert (w.inplace, w.fresh, w.copied) == (result.inplace, result.fresh, result.copied)
        assert same_window(got, result.window)
    elif op["op"] in ("trim", "trim_front", "trim_to"):
        assert got == result
    return world2, result


def run_impl(pool: BlockPool, world: sp.PagedWorld, op: dict, seq: str):
    name = op["op"]
    if name == "append":
        return pool.append(seq, *rows(world.next_token, op["n"]))
    if name == "trim":
        return pool.trim(seq, op["n"])
    if name == "trim_to":
        return pool.trim_to(seq, op["len"])
    if name == "trim_front":
        return pool.trim_front(seq, op["n"], op.get("keep", 0))
    if name == "fork":
        return pool.fork(op["from"], op["as"])
    if name == "release":
        return pool.release(seq)
    raise AssertionError(name)


def check_agree(pool: BlockPool, world: sp.PagedWorld) -> None:
    assert pool.broken_invariants() == ()
    assert pool.refcounts == list(world.pool.refcounts)
    assert pool.free == list(world.pool.free)
    assert set(pool.seqs) == set(world.seqs)
    for name, s in world.seqs.items():
        got = pool.seqs[name]
        assert (tuple(got.table), got.length, got.start) == (s.table, s.length, s.start)
        assert pool.capacity(name) == sp.capacity_of(len(s.table), world.pool.block_size)
        assert same_window(pool.fetch(name), world.window(name))


NAMES = ("main", "a", "b")
OPS = st.one_of(
    st.builds(lambda n, s: {"op": "append", "n": n, "seq": s}, st.integers(1, 5), st.sampled_from(NAMES)),
    st.builds(lambda n, s: {"op": "append", "n": 1, "seq": s}, st.just(1), st.sampled_from(NAMES)),
    st.builds(lambda n, s: {"op": "trim", "n": n, "seq": s}, st.integers(-1, 5), st.sampled_from(NAMES)),
    st.builds(lambda n, s: {"op": "trim_to", "len": n, "seq": s}, st.integers(-1, 9), st.sampled_from(NAMES)),
    st.builds(lambda n, k, s: {"op": "trim_front", "n": n, "keep": k, "seq": s},
              st.integers(0, 5), st.sampled_from([0, 0, 0, 1]), st.sampled_from(NAMES)),
    st.builds(lambda f, a: {"op": "fork", "from": f, "as": a}, st.sampled_from(NAMES), st.sampled_from(NAMES)),
    st.builds(lambda s: {"op": "release", "seq": s}, st.sampled_from(NAMES)),
)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.sampled_from([None, 0, 1, 3, 6]), st.integers(1, 3), st.booleans(), st.integers(1, 6),
       st.lists(OPS, max_size=18))
def test_pool_matches_spec(bs, max_blocks, chunk, inplace, prompt, ops):
    pool = BlockPool(bs, max_blocks=max_blocks, chunk=chunk, inplace=inplace)
    world = sp.new_world(bs, max_blocks, chunk, inplace)
    # a shared prompt first: most random ops then land on shared blocks
    preamble = [{"op": "append", "n": prompt}, {"op": "fork", "from": "main", "as": "a"}]
    for op in preamble + ops:
        world, _ = apply_both(pool, world, op)
        check_agree(pool, world)


def test_inplace_write_aliases_the_slab_and_spares_the_fork():
    pool = BlockPool(4, chunk=2)
    pool.append("main", *rows(0, 2))
    slab = pool.keys
    raw_before = np.array(slab[0, 2]).copy()
    pool.append("main", *rows(2, 1))
    assert pool.keys is slab  # no new slab: the row went into its memory
    assert pool.last_write.inplace
    assert not np.array_equal(np.array(slab[0, 2]), raw_before)
    pool.fork("main", "b")
    pool.append("b", *rows(3, 1))  # shared block: copy on write, into block 1
    assert pool.last_write.copied == ((0, 1),) and not pool.last_write.inplace
    assert same_window(pool.fetch("main"), (0, 1, 2))
    assert same_window(pool.fetch("b"), (0, 1, 2, 3))


def test_held_window_never_changes():
    pool = BlockPool(2)
    k, _ = pool.append("main", *rows(0, 3))
    held = np.array(k).copy()
    pool.trim("main", 2)
    pool.append("main", *rows(3, 2))  # in place over the trimmed rows
    assert pool.last_write.inplace
    assert np.array_equal(np.array(k), held)


def test_unread_windows_never_change():
    """A window nobody has read yet (MLX is lazy) must not see later
    in-place writes either: every reader (append's return, fetch, the
    protocol's update_and_fetch, fetch and state) is checked only after its
    rows were trimmed and rewritten in place, and after its block was
    released and reused by another sequence."""
    pool = BlockPool(2)
    cache = PagedKVCache(pool)
    readers = {
        "append": lambda: pool.append("main", *rows(0, 3)),
        "fetch": lambda: pool.fetch("main"),
        "cache.fetch": cache.fetch,
        "cache.state": lambda: cache.state,
    }
    windows = {}
    for name, read in readers.items():
        windows[name] = read()  # not evaluated by the test
    windows["update_and_fetch"] = PagedKVCache(pool, "main").update_and_fetch(*rows(3, 1))
    pool.trim("main", 3)
    pool.append("main", *rows(10, 3))  # in place over the rows the windows hold
    assert pool.last_write.inplace
    pool.release("main")
    pool.create("other")
    pool.append("other", *rows(20, 4))  # the released blocks, reused in place
    assert same_window(windows.pop("update_and_fetch"), (0, 1, 2, 3))
    for name, got in windows.items():
        assert same_window(got, (0, 1, 2)), name


def test_switch_off_writes_by_copy():
    pool = BlockPool(2, inplace=False)
    pool.append("main", *rows(0, 1))
    slab = pool.keys
    pool.append("main", *rows(1, 1))
    assert not pool.last_write.inplace and pool.keys is not slab
    assert same_window(pool.fetch(), (0, 1))


def test_exhaustion_leaves_everything_as_it_was():
    pool = BlockPool(2, max_blocks=3, chunk=2)
    pool.append("main", *rows(0, 3))
    pool.fork("main", "b")
    pool.append("b", *rows(3, 1))  # copy of block 1 into block 2: pool full
    before = pool_state(pool)
    with pytest.raises(StateError, match=r"append: pool exhausted: needs 2 free blocks, has 0 free of 3"):
        pool.append("main", *rows(4, 4))
    assert pool_state(pool) == before
    assert pool.broken_invariants() == ()


@pytest.mark.parametrize("max_blocks", [0, 1])
def test_max_blocks_is_a_ceiling_down_to_zero(max_blocks):
    """0 is a ceiling like any other (None is "no maximum"): a falsy check
    would let a pool of max_blocks=0 grow without bound."""
    pool = BlockPool(2, max_blocks=max_blocks, chunk=4)
    for _ in range(max_blocks):
        pool.append("main", *rows(0, 2))
    before = pool_state(pool)
    with pytest.raises(StateError, match="append: pool exhausted"):
        pool.append("main", *rows(2, 1))
    assert pool_state(pool) == before and pool.size == max_blocks


def test_make_paged_prompt_cache_passes_every_setting_to_every_layer():
    """Each layer its own pool on ``main``, built with exactly the settings
    asked for (a dropped block_size fell back to a default and an mlx-lm
    decode, which reads only windows, could not tell)."""
    caches = make_paged_prompt_cache(3, block_size=3, max_blocks=5, chunk=2, inplace=False)
    assert len(caches) == 3 and len({id(c.pool) for c in caches}) == 3
    for c in caches:
        p = c.pool
        assert (p.block_size, p.max_blocks, p.chunk, p.inplace, c.seq) == (3, 5, 2, False, "main")


def test_fork_prompt_cache_is_all_layers_or_none():
    """A layer that refuses the fork (the name is in use there) undoes the
    forks of the layers before it: no sequence, no raised refcount left."""
    caches = make_paged_prompt_cache(3, block_size=2, chunk=1)
    for c in caches:
        c.update_and_fetch(*rows(0, 3))
    caches[2].pool.create("r")
    before = [pool_state(c.pool) for c in caches]
    with pytest.raises(StateError, match="already exists"):
        fork_prompt_cache(caches, "r")
    assert [pool_state(c.pool) for c in caches] == before
    assert all(c.pool.broken_invariants() == () for c in caches)


def test_rows_kept_in_incoming_dtype_and_mismatch_refused():
    pool = BlockPool(3)
    k, _ = pool.append("main", *rows(0, 2, mx.bfloat16))
    assert k.dtype == mx.bfloat16 and pool.keys.dtype == mx.bfloat16
    assert pool.last_write.inplace  # bfloat16 in place through an integer view
    k, _ = pool.append("main", *rows(2, 1, mx.bfloat16))
    assert np.array_equal(np.array(k.astype(mx.float32)), np.array(expected((0, 1, 2))[0].astype(mx.float32)))
    before = pool_state(pool)
    with pytest.raises(InvalidArgumentError, match="dtype mlx.core.bfloat16, got shape"):
        pool.append("main", *rows(3, 1, mx.float16))
    with pytest.raises(InvalidArgumentError, match="batch must be 1"):
        pool.append("main", mx.zeros((2, H, 1, DK), mx.bfloat16), mx.zeros((2, H, 1, DV), mx.bfloat16))
    with pytest.raises(InvalidArgumentError, match=r"values must match the pool's \[H, D\] = \[2, 2\]"):
        pool.append("main", mx.zeros((1, H, 1, DK), mx.bfloat16), mx.zeros((1, H, 1, 5), mx.bfloat16))
    with pytest.raises(StateError, match="append: no sequence named 'x'"):
        pool.append("x", *rows(3, 1, mx.bfloat16))
    assert pool_state(pool) == before


def test_invariant_check_sees_a_leak_and_a_freed_held_block():
    pool = BlockPool(1)
    pool.append("main", *rows(0, 2))
    pool.refcounts[0] += 1
    assert "refcounts_match_tables" in pool.broken_invariants()
    pool.refcounts[0] -= 1
    pool.free.append(1)
    assert "free_blocks_unheld" in pool.broken_invariants()


def test_cache_protocol_and_trim_through_the_pool():
    cache = PagedKVCache(block_size=2, chunk=1)
    assert cache.offset == 0 and cache.empty() and cache.state == ()
    assert cache.make_mask(1) is None and cache.make_mask(3) == "causal"
    cache.update_and_fetch(*rows(0, 5))
    assert cache.offset == 5 and cache.size() == 5 and cache.is_trimmable()
    assert cache.trim(2) == 2 and cache.offset == 3 and cache.pool.free == [2]
    assert cache.trim_front(2) == 2 and cache.offset == 3 and cache.live_len == 1
    mask = cache.make_mask(2, return_array=True)
    assert mask.shape == (2, 3)
    with pytest.raises(UnsupportedOperationError, match="keep must be 0"):
        cache.trim_front_keep_sink(1, keep=1)
    other = cache.fork("b")
    assert same_window(other.fetch(), (2,))
    k, v = cache.state
    with pytest.raises(InvalidArgumentError, match="from_state: meta_state must describe the rows from position 0"):
        PagedKVCache.from_state((k, v), cache.meta_state)  # front-trimmed: start 2
    restored = PagedKVCache.from_state((k, v), ("2", "1", "0"))
    assert restored.offset == 1 and restored.pool.block_size == 2 and same_window(restored.fetch(), (2,))
    with pytest.raises(InvalidArgumentError, match="integers"):
        PagedKVCache.from_state((k, v), ("x",))
    assert cache.nbytes > 0


def test_state_setter_is_atomic():
    cache = PagedKVCache(block_size=2)
    cache.update_and_fetch(*rows(0, 3))
    before = pool_state(cache.pool)
    with pytest.raises(InvalidArgumentError):
        cache.state = (mx.zeros((1, H, 1, 7)), mx.zeros((1, H, 1, DV)))
    assert pool_state(cache.pool) == before
    cache.state = rows(7, 2)
    assert cache.offset == 2 and same_window(cache.fetch(), (7, 8))
    assert cache.pool.broken_invariants() == ()


def test_state_setter_refused_late_changes_nothing():
    """A refusal that only the append inside the setter sees (the pool is
    exhausted: the new rows need blocks while the old ones are still held)
    leaves the sequence's rows, and the whole pool, as they were; a setter
    that released the old rows first lost them."""
    cache = PagedKVCache(block_size=2, max_blocks=3, chunk=1)
    cache.update_and_fetch(*rows(0, 4))
    before = pool_state(cache.pool)
    with pytest.raises(StateError, match="pool exhausted"):
        cache.state = rows(10, 5)
    assert pool_state(cache.pool) == before
    assert cache.offset == 4 and same_window(cache.fetch(), (0, 1, 2, 3))


def test_mlx_lm_model_decodes_through_forked_pool_sequences():
    pytest.importorskip("mlx_lm")
    from mlx_lm.models import llama
    from mlx_lm.models.cache import KVCache as LmKVCache

    mx.random.seed(3)
    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=48,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=64,
                           head_dim=8, tie_word_embeddings=True)
    model = llama.Model(args)
    mx.eval(model.parameters())
    prompt = mx.array([[1, 5, 9, 2, 7]])

    def decode(caches, first, n):
        out, tok = [], mx.array([[first]])
        for _ in range(n):
            logits = model(tok, cache=caches)[:, -1]
            t = int(mx.argmax(logits, axis=-1).item())
            out.append((t, np.array(logits.astype(mx.float32)).tobytes()))
            tok = mx.array([[t]])
        return out

    paged = make_paged_prompt_cache(2, block_size=3, chunk=2)
    model(prompt, cache=paged)
    streams = {}
    for i, first in enumerate((3, 11, 40)):
        streams[first] = decode(fork_prompt_cache(paged, f"r{i}"), first, 6)
    for first, got in streams.items():
        dense = [LmKVCache() for _ in range(2)]
        model(prompt, cache=dense)
        assert decode(dense, first, 6) == got
    assert all(c.pool.broken_invariants() == () for c in paged)


@pytest.mark.parametrize("bs", [1, 2, 3, 4])
def test_a_fetch_gathers_exactly_the_blocks_that_hold_the_visible_rows(bs, monkeypatch):
    """The gather through the block table's device mirror takes the blocks
    from ``start // bs`` to ``ceil(length / bs)``, no more: a block too many
    at a block boundary is sliced off again (the window is right) but costs
    a block of reads at every fetch; one too few loses rows."""
    import kvspec.impl.paged as P

    pool = BlockPool(bs, chunk=2)
    taken = []
    real_take = mx.take

    def spy(a, idx, *args, **kw):
        if a is pool.keys:
            taken.append(int(idx.shape[0]))
        return real_take(a, idx, *args, **kw)

    monkeypatch.setattr(P.mx, "take", spy)
    for length in range(1, 3 * bs + 2):
        for start in range(length):
            pool = BlockPool(bs, chunk=2)
            pool.append("main", *rows(0, length))
            pool.trim_front("main", start)
            taken.clear()
            k, _ = pool.fetch("main")
            want = sp.table_len(length, bs) - start // bs
            assert taken == [want], (bs, length, start, taken)
            assert k.shape[2] == length - start
            assert np.array_equal(np.array(k[0, 0, :, 0]), np.arange(start, length, dtype=np.float16) * 8)  # head 0's key names its token


def test_copies_of_a_sequence_handle_are_refused_naming_fork():
    """``copy.copy`` would be a second writer of the same sequence and
    ``copy.deepcopy`` a whole pool whose slabs alias this one's memory
    (before the refusal both happened: a deep copy's in-place decode wrote
    into the original's slab): refused, the pool unchanged."""
    import copy

    cache = PagedKVCache(block_size=2)
    cache.update_and_fetch(*rows(0, 3))
    before = pool_state(cache.pool)
    for fn, how in ((copy.copy, "copy.copy"), (copy.deepcopy, "copy.deepcopy")):
        with pytest.raises(UnsupportedOperationError, match=rf"{how} of a PagedKVCache is refused.*fork\(name\)"):
            fn(cache)
    with pytest.raises(UnsupportedOperationError, match="fork"):
        copy.deepcopy([cache])  # a prompt-cache list, as LRUPromptCache deep-copies it
    assert pool_state(cache.pool) == before


def test_a_released_sequence_handle_is_spent_even_once_its_name_is_taken():
    """The handle a fork returned, used after its release: refused, also
    after a new fork took the name (which the old handle would otherwise
    write into); the new handle and the other sequences' are unaffected,
    and a state assignment keeps the sequence's handles live."""
    cache = PagedKVCache(block_size=2)
    cache.update_and_fetch(*rows(0, 3))
    old = cache.fork("f")
    old.release()
    new = cache.fork("f")
    before = pool_state(cache.pool)
    for use in (lambda h: h.update_and_fetch(*rows(9, 1)), lambda h: h.fetch(), lambda h: h.trim(1),
                lambda h: h.release(), lambda h: h.offset):
        with pytest.raises(StateError, match="the handle of sequence 'f' was consumed by its release"):
            use(old)
    assert pool_state(cache.pool) == before
    assert same_window(new.update_and_fetch(*rows(3, 1)), (0, 1, 2, 3))
    other = PagedKVCache(cache.pool, "f")
    new.state = rows(7, 2)
    assert other.offset == 2 and same_window(other.fetch(), (7, 8))


def test_a_paged_sequence_loads_in_mlx_lm_order_and_refuses_files_naming_the_rule(tmp_path):
    """mlx-lm's load order (``state``, then ``meta_state``) on a sequence
    that starts at position 0: its rows come back in fresh blocks (a fork's
    shared blocks stay with the fork) and the counters it then holds are
    accepted; other counters are refused, nothing changed. A prompt-cache
    file is refused (its blocks belong to the pool), through the handle's
    own refusal also for a subclass the file layer would otherwise know by
    name."""
    from kvspec.impl.models import save_prompt_cache

    class Subclass(PagedKVCache):
        pass

    cache = Subclass(block_size=2)
    cache.update_and_fetch(*rows(0, 3))
    fork = cache.fork("f")
    state, meta = cache.state, cache.meta_state
    cache.state = state
    cache.meta_state = meta
    assert cache.meta_state == meta and same_window(cache.fetch(), (0, 1, 2)) and same_window(fork.fetch(), (0, 1, 2))
    assert not set(cache.pool.sequence("main").held()) & set(cache.pool.sequence("f").held())
    assert cache.pool.broken_invariants() == ()
    before = pool_state(cache.pool)
    with pytest.raises(UnsupportedOperationError, match="counters are set by its pool"):
        cache.meta_state = ("2", "5", "1")
    assert pool_state(cache.pool) == before
    with pytest.raises(UnsupportedOperationError, match="layer 0 is a PagedKVCache, whose blocks belong to its pool"):
        save_prompt_cache(tmp_path / "p.safetensors", [cache])
    assert not (tmp_path / "p.safetensors").exists()
