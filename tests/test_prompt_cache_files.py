"""Prompt-cache files (issue 16): save_prompt_cache / load_prompt_cache
round-trip our caches through a real safetensors file, decoding after a load
is byte-identical, mlx-lm's own loader refuses our files naming ours, and
every damaged file is refused before a cache is returned. Also
``to_quantized`` (mlx-lm's ``kv_bits`` hook) and the protocol's members."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("mlx_lm")

from kvspec.impl.dense import KVCache
from kvspec.impl.models import load_prompt_cache, make_prompt_cache, save_prompt_cache
from kvspec.impl.paged import PagedKVCache
from kvspec.impl.quant import dequantize_int8, quantize_int8
from kvspec.impl.rotating import RotatingKVCache
from kvspec.impl.turbo import DelegatedKVCache, TurboKVCache, make_cache
from kvspec.spec.errors import InvalidArgumentError, UnsupportedOperationError

DOCS = Path(__file__).resolve().parent.parent / "docs" / "mlx-lm.md"


def rows(n: int, seed: int, d: int = 8) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array(rng.standard_normal((1, 2, n, d)).astype(np.float16))


def feed(c, n: int, seed: int):
    return c.update_and_fetch(rows(n, seed), rows(n, seed + 1000))


def window(c) -> bytes:
    got = c.fetch()
    return b"" if got is None else b"".join(np.array(a).tobytes() for a in got)


def state_bytes(c) -> bytes:
    return b"".join(np.array(a).tobytes() for a in c.state)


def facts(c) -> tuple:
    common = (type(c).__name__, c.step, getattr(c, "inplace", None), c.offset, tuple(c.meta_state), window(c))
    if isinstance(c, RotatingKVCache):
        return (*common, c.max_size, c.keep, c.idx, c.undo)
    if isinstance(c, (TurboKVCache, DelegatedKVCache)):
        # the stored codes, norms and rescales too, not only what they decode to
        return (*common, c.mode, c.cold_offset, c.dtype, state_bytes(c))
    return (*common, c.mode, c.live_start, c.live_len)


def mixed() -> list:
    """Every layer kind and a range of states: dense Fp16 after a logical
    trim and a front trim, Int8, a wrapped ring, an oversized ring after a
    multi-row append, empty caches, a dense cache emptied by a trim, a ring
    with an undo depth, every Turbo mode (Delegated with cold and hot rows,
    3-bit with K and V head dims that differ)."""
    a = KVCache("fp16", step=3)
    feed(a, 5, 1)
    a.trim(2)
    feed(a, 1, 2)
    b = KVCache("int8", step=2, inplace=False)
    feed(b, 3, 3)
    b.trim_front_keep_sink(1, keep=1)
    c = RotatingKVCache(max_size=4, keep=1, step=2)
    for i in range(6):
        feed(c, 1, 10 + i)
    d = RotatingKVCache(max_size=4, keep=1, step=2)
    feed(d, 2, 20)
    feed(d, 5, 21)
    e = KVCache("fp16")
    f = RotatingKVCache(max_size=3)
    g = KVCache("int8", step=4)
    feed(g, 2, 30)
    g.trim(2)
    h = RotatingKVCache(max_size=3, keep=1, step=2, undo=2)  # the undo depth survives, not the log
    for i in range(4):
        feed(h, 1, 40 + i)
    t4a = make_cache("turbo4asym", step=3)
    feed(t4a, 5, 50)
    t4a.trim(1)
    t4 = make_cache("turbo4", step=2)
    feed(t4, 3, 51)
    t3 = make_cache("turbo3asym", step=2)
    t3.update_and_fetch(rows(3, 52, d=4), rows(3, 53))  # fp16 keys of head_dim 4, 3-bit values of 8
    dg = make_cache("turbo4delegated", step=2, hot_threshold=2, fold_block=2)
    for i in range(5):
        feed(dg, 1, 54 + i)
    return [a, b, c, d, e, f, g, h, t4a, t4, t3, dg, make_cache("turbo4")]


def test_round_trip_keeps_every_layer(tmp_path):
    caches = mixed()
    path = tmp_path / "cache.safetensors"
    save_prompt_cache(str(path), caches, {"model": "tiny", "turns": "3"})
    loaded, meta = load_prompt_cache(str(path), return_metadata=True)
    assert meta == {"model": "tiny", "turns": "3"}
    assert [facts(c) for c in loaded] == [facts(c) for c in caches]
    assert [type(c) for c in load_prompt_cache(path)] == [type(c) for c in caches]
    # decoding after the load is byte-identical: decodes, a chunk, masks
    for step, n in enumerate([1, 1, 3, 1, 1]):
        for orig, back in zip(caches, loaded):
            if isinstance(orig, RotatingKVCache):
                m1, m2 = orig.make_mask(n, return_array=True), back.make_mask(n, return_array=True)
                assert np.array_equal(np.array(m1), np.array(m2))
            d = 4 if getattr(orig, "mode", "") == "turbo3asym" else 8
            k1, v1 = orig.update_and_fetch(rows(n, 100 + step, d), rows(n, 200 + step))
            k2, v2 = back.update_and_fetch(rows(n, 100 + step, d), rows(n, 200 + step))
            assert np.array(k1).tobytes() == np.array(k2).tobytes()
            assert np.array(v1).tobytes() == np.array(v2).tobytes()
            assert facts(orig)[3:] == facts(back)[3:]


def test_the_file_describes_every_layer_as_it_is(tmp_path):
    """The kvspec metadata other readers see: class, meta_state, array count,
    and the in-place switch as the cache has it (Turbo caches have none and
    always copy: saved as false, never a default of true)."""
    caches = mixed()
    path = tmp_path / "cache.safetensors"
    save_prompt_cache(str(path), caches)
    _arrays, header = mx.load(str(path), return_metadata=True)
    layers = json.loads(header["0.__kvspec__"])["layers"]
    assert [(d["class"], d["meta_state"], d["inplace"], d["arrays"]) for d in layers] == [
        (type(c).__name__, list(c.meta_state), bool(getattr(c, "inplace", False)), len(c.state)) for c in caches]
    assert any(isinstance(c, (TurboKVCache, DelegatedKVCache)) for c in caches)
    assert all(d["inplace"] is False for d, c in zip(layers, caches) if isinstance(c, (TurboKVCache, DelegatedKVCache)))


def test_decoding_through_generate_step_is_byte_identical_after_a_load(tmp_path):
    from kvspec.fuzz.commands.e2e import greedy, tiny_gemma3, token_ids

    model = tiny_gemma3(7, window=6)
    prompt = token_ids(7, 11)
    caches = make_prompt_cache(model, step=4)
    assert {type(c) for c in caches} == {KVCache, RotatingKVCache}
    greedy(model, caches, prompt, 6)  # the rings wrap
    path = tmp_path / "conversation.safetensors"
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    turn = token_ids(8, 3)
    want = greedy(model, caches, turn, 12)
    got = greedy(model, loaded, turn, 12)
    assert got.tokens == want.tokens
    assert got.logprobs == want.logprobs
    assert len(set(want.tokens)) > 3


def test_mlx_lm_loader_refuses_our_file_naming_ours(tmp_path):
    from mlx_lm.models.cache import load_prompt_cache as lm_load

    path = tmp_path / "ours.safetensors"
    save_prompt_cache(path, mixed()[:3])
    with pytest.raises(KeyError, match=re.escape("load it with kvspec.impl.models.load_prompt_cache")):
        lm_load(str(path))


def test_mlx_lm_save_of_our_caches_is_refused_up_front(tmp_path):
    """mlx-lm's writer cannot store our counters: for every class and mode
    it is refused before anything is written, naming our writer."""
    from mlx_lm.models.cache import save_prompt_cache as lm_save

    from kvspec.impl.paged import BlockPool

    pool = BlockPool(2, chunk=2)
    seq = PagedKVCache(pool)
    feed(seq, 3, 9)
    for i, c in enumerate([*mixed(), seq]):
        path = tmp_path / f"theirs{i}.safetensors"
        with pytest.raises(UnsupportedOperationError,
                           match=f"cannot write a kvspec {type(c).__name__}.*kvspec.impl.models.save_prompt_cache"):
            lm_save(str(path), [c])
        assert not path.exists()
    assert len(mixed()[0].state) == 2  # any other reader of `state` is unaffected


def lm_history(model, prompt, n, max_kv_size=None):
    """mlx-lm's own caches after greedy decoding ``n`` tokens of ``prompt``."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache as lm_make_prompt_cache

    if max_kv_size is None:
        caches = lm_make_prompt_cache(model)
    else:  # mlx-lm's max_kv_size rings (4 sinks), whether or not the model has make_cache
        from mlx_lm.models.cache import RotatingKVCache as LmRing

        caches = [LmRing(max_size=max_kv_size, keep=4) for _ in model.layers]
    for _ in generate_step(prompt, model, max_tokens=n, prompt_cache=caches):
        pass
    return caches


@pytest.mark.parametrize("model_name, n", [("llama", 5), ("gemma3", 0), ("gemma3", 2), ("gemma3", 9), ("llama_rings", 9)])
def test_mlx_lm_files_of_its_own_caches_load_into_ours(tmp_path, model_name, n):
    """A file mlx-lm wrote from its own caches (dense KVCache; rings
    oversized after the prompt block, unwrapped, wrapped; max_kv_size rings
    with 4 sinks, wrapped) loads into our classes with the same counters
    (window, sinks, offset: decoding alone may not show a wrong window or
    lost sinks); decoding on from them equals mlx-lm's caches decoding on
    from the same file, tokens and log-probability bytes."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import load_prompt_cache as lm_load
    from mlx_lm.models.cache import save_prompt_cache as lm_save

    from kvspec.fuzz.commands.e2e import tiny_gemma3, tiny_llama, token_ids

    model = tiny_gemma3(4, window=6) if model_name == "gemma3" else tiny_llama(4)
    prompt = token_ids(4, 3 if n == 2 else 8)
    path = tmp_path / "theirs.safetensors"
    lm_save(str(path), lm_history(model, prompt, n, 7 if model_name == "llama_rings" else None), {"who": "mlx-lm"})
    ours, meta = load_prompt_cache(path, return_metadata=True)
    assert meta == {"who": "mlx-lm"}
    want = {"llama": ["KVCache"] * 2, "gemma3": ["RotatingKVCache", "RotatingKVCache", "KVCache"],
            "llama_rings": ["RotatingKVCache"] * 2}[model_name]
    assert [type(c).__name__ for c in ours] == want and all(c.__module__.startswith("kvspec.impl.") for c in ours)
    for c, theirs in zip(ours, lm_load(str(path))):
        assert (c.offset, getattr(c, "max_size", None), getattr(c, "keep", None)) == (
            theirs.offset, getattr(theirs, "max_size", None), getattr(theirs, "keep", None)), c
    turn = token_ids(5, 2)
    runs = [[(int(t), np.array(lp).tobytes()) for t, lp in generate_step(turn, model, max_tokens=12, prompt_cache=c)]
            for c in (ours, lm_load(str(path)))]
    assert runs[0] == runs[1]


def test_mlx_lm_files_of_classes_we_lack_are_refused_naming_them(tmp_path):
    from mlx_lm.models.cache import KVCache as LmKVCache
    from mlx_lm.models.cache import save_prompt_cache as lm_save

    c = LmKVCache()
    c.update_and_fetch(rows(3, 1, d=32), rows(3, 2, d=32))
    path = tmp_path / "quantized.safetensors"
    lm_save(str(path), [c, c.to_quantized(group_size=32, bits=4)])
    refused(path, "layer 1 is mlx-lm's QuantizedKVCache.*affine group-quantized", UnsupportedOperationError)


def test_save_refuses_what_it_cannot_write(tmp_path):
    from mlx_lm.models.cache import KVCache as LmKVCache

    path = tmp_path / "x.safetensors"
    with pytest.raises(UnsupportedOperationError, match="layer 1 is a KVCache; kvspec files hold kvspec caches only"):
        save_prompt_cache(path, [KVCache(), LmKVCache()])
    paged = PagedKVCache(block_size=2)
    paged.update_and_fetch(rows(3, 1), rows(3, 2))
    with pytest.raises(UnsupportedOperationError, match="layer 1 is a PagedKVCache, whose blocks belong to its pool"):
        save_prompt_cache(path, [KVCache(), paged])
    # what the message offers works: the sequence's rows in a dense cache
    dense = KVCache.from_state(paged.state)
    assert window(dense) == window(paged)
    with pytest.raises(InvalidArgumentError, match="metadata must map str to str"):
        save_prompt_cache(path, [KVCache()], {"n": 3})
    with pytest.raises(InvalidArgumentError, match="reserved"):
        save_prompt_cache(path, [KVCache()], {"__kvspec__": "x"})
    with pytest.raises(InvalidArgumentError, match="at least one layer"):
        save_prompt_cache(path, [])
    assert not path.exists()


# -- damaged files ------------------------------------------------------------------
def saved(tmp_path) -> tuple[Path, dict, dict]:
    path = tmp_path / "good.safetensors"
    save_prompt_cache(path, mixed())
    arrays, header = mx.load(str(path), return_metadata=True)
    return path, arrays, header


def rewrite(tmp_path, arrays, header, edit_layers=None) -> Path:
    header = dict(header)
    if edit_layers is not None:
        desc = json.loads(header["0.__kvspec__"])
        edit_layers(desc["layers"])
        header["0.__kvspec__"] = json.dumps(desc)
    path = tmp_path / "bad.safetensors"
    mx.save_safetensors(str(path), arrays, header)
    return path


def refused(path, match, kind=InvalidArgumentError):
    with pytest.raises(kind, match=match):
        load_prompt_cache(path)


def test_truncated_and_garbage_files_are_refused(tmp_path):
    path, _, _ = saved(tmp_path)
    data = path.read_bytes()
    for i, cut in enumerate([len(data) - 50, len(data) // 2, 7, 0]):
        p = tmp_path / f"cut{i}.safetensors"
        p.write_bytes(data[:cut])
        refused(p, "not a readable safetensors file")
    p = tmp_path / "garbage.safetensors"
    p.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}" + data[24:])
    refused(p, "not a readable safetensors file")
    refused(tmp_path / "missing.safetensors", "not a readable safetensors file")


def test_metadata_problems_are_refused(tmp_path):
    _, arrays, header = saved(tmp_path)
    no_meta = {k: v for k, v in header.items() if k != "0.__kvspec__"}
    refused(rewrite(tmp_path, arrays, no_meta), "kvspec class entries but no kvspec metadata")
    refused(rewrite(tmp_path, arrays, {"x": "y"}), "no kvspec metadata .* and no mlx-lm class entries")
    refused(rewrite(tmp_path, arrays, {**header, "0.__kvspec__": "{"}), "kvspec metadata is not JSON")
    refused(rewrite(tmp_path, arrays, {**header, "0.__kvspec__": '{"format": 2, "layers": []}'}), "'format': 1")

    def unknown(layers):
        layers[2]["class"] = "PagedKVCache"

    refused(rewrite(tmp_path, arrays, header, unknown),
            "layer 2: unknown class 'PagedKVCache'; known: KVCache, RotatingKVCache, TurboKVCache, DelegatedKVCache")

    def swapped(layers):
        layers[0]["class"] = "RotatingKVCache"

    refused(rewrite(tmp_path, arrays, header, swapped), "layer 0: class entry '1.0' does not match")
    refused(rewrite(tmp_path, arrays, {**header, "1.19": "x"}), "class entry '1.19' belongs to no layer")

    def bad_inplace(layers):
        layers[1]["inplace"] = "yes"

    refused(rewrite(tmp_path, arrays, header, bad_inplace), "layer 1: inplace must be true or false")

    def bad_count(layers):
        layers[1]["arrays"] = 3

    refused(rewrite(tmp_path, arrays, header, bad_count), r"tensors \['1.3'\] belong to no layer")

    def more(layers):
        layers[1]["arrays"] = 5

    refused(rewrite(tmp_path, arrays, header, more), "layer 1: tensor '1.4' is missing")
    for n in (-1, 17, True, "2"):
        def count(layers, n=n):
            layers[1]["arrays"] = n

        refused(rewrite(tmp_path, arrays, header, count), r"layer 1: arrays must be an integer in \[0, 16\]")

    def fewer(layers):  # Int8 keeps four arrays: two of them are not enough
        layers[1]["arrays"] = 2

    refused(rewrite(tmp_path, {k: v for k, v in arrays.items() if k not in ("1.2", "1.3")}, header, fewer),
            "layer 1: from_state: ")


def test_tensor_problems_are_refused(tmp_path):
    _, arrays, header = saved(tmp_path)
    missing = {k: v for k, v in arrays.items() if k != "1.2"}
    refused(rewrite(tmp_path, missing, header), "layer 1: tensor '1.2' is missing")
    refused(rewrite(tmp_path, {**arrays, "19.0": mx.zeros((1,))}, header), r"tensors \['19.0'\] belong to no layer")
    short = {**arrays, "0.0": arrays["0.0"][:, :, :-1, :]}
    refused(rewrite(tmp_path, short, header), r"layer 0: from_state: keys and values must agree on \[B, H, T\]")
    heads = {**arrays, "0.1": mx.concatenate([arrays["0.1"], arrays["0.1"]], axis=1)}
    refused(rewrite(tmp_path, heads, header), r"layer 0: from_state: keys and values must agree")
    both = {**arrays, "0.0": arrays["0.0"][:, :, :-1, :], "0.1": arrays["0.1"][:, :, :-1, :]}
    refused(rewrite(tmp_path, both, header), "layer 0: from_state: ")
    flat = {**arrays, "2.0": arrays["2.0"][0]}
    refused(rewrite(tmp_path, flat, header), "layer 2: from_state: keys must have rank 4")
    as_f32 = {**arrays, "1.0": arrays["1.0"].astype(mx.float32)}
    refused(rewrite(tmp_path, as_f32, header), "layer 1: from_state: keys dtype must be")
    scales = {**arrays, "1.1": mx.concatenate([arrays["1.1"], arrays["1.1"]], axis=3)}
    refused(rewrite(tmp_path, scales, header), r"layer 1: from_state: key_scales must be float16 of shape")
    ring = {**arrays, "2.0": arrays["2.0"][:, :, :-1, :], "2.1": arrays["2.1"][:, :, :-1, :]}
    refused(rewrite(tmp_path, ring, header), "layer 2: from_state: counters do not fit the ring")
    # Turbo (layer 9: turbo4; its arrays sorted by name: k_norm, k_packed, k_rescale, v_norm, ...)
    packed = {**arrays, "9.1": arrays["9.1"][..., :-1]}
    refused(rewrite(tmp_path, packed, header), "layer 9: from_state: k_packed")
    codes = {**arrays, "9.1": arrays["9.1"].astype(mx.int32)}
    refused(rewrite(tmp_path, codes, header), "layer 9: from_state: k_packed")
    rows_short = {**arrays, **{f"9.{j}": arrays[f"9.{j}"][:, :, :-1, :] for j in range(6)}}
    refused(rewrite(tmp_path, rows_short, header), "layer 9: from_state: ")

def test_counter_problems_are_refused(tmp_path):
    _, arrays, header = saved(tmp_path)

    def cursor(layers):  # ring: keep, max_size, step, offset, idx
        layers[2]["meta_state"][4] = "99"

    refused(rewrite(tmp_path, arrays, header, cursor), "layer 2: ")

    def offset(layers):  # dense: mode, step, offset, live_start
        layers[0]["meta_state"][2] = "1"

    refused(rewrite(tmp_path, arrays, header, offset), "layer 0: ")

    def mode(layers):
        layers[0]["meta_state"][0] = "turbo4"

    refused(rewrite(tmp_path, arrays, header, mode), "layer 0: ", UnsupportedOperationError)

    def words(layers):
        layers[3]["meta_state"][1] = "four"

    refused(rewrite(tmp_path, arrays, header, words), "layer 3: ")

    def names(layers):  # Turbo: the array names must be the mode's
        layers[9]["meta_state"][7] = "k_norm,k_packed,k_rescale,v_norm,v_packed,hot"

    refused(rewrite(tmp_path, arrays, header, names), "layer 9: ")

    def turbo_mode(layers):  # a Turbo layer's mode must be one of the class's
        layers[8]["meta_state"][0] = "turbo4delegated"

    refused(rewrite(tmp_path, arrays, header, turbo_mode), "layer 8: ")

    def cold(layers):  # Delegated: cold rows beyond the offset
        layers[11]["meta_state"][3] = "9"

    refused(rewrite(tmp_path, arrays, header, cold), "layer 11: ")

    def step(layers):
        layers[0]["meta_state"][1] = str(10**12)

    refused(rewrite(tmp_path, arrays, header, step), r"layer 0: .*step must be in \[1, 1048576\]")


def test_a_load_is_a_restore_the_undo_log_stays_behind(tmp_path):
    """The file keeps a ring's undo depth, not its log (save_prompt_cache):
    right after a load a wrapped ring can roll back nothing, exactly as
    after restoring a snapshot; rows written after the load roll back."""
    ring = RotatingKVCache(max_size=3, keep=1, step=2, undo=2)
    for i in range(5):
        feed(ring, 1, i)
    assert ring.trimmable_rows() == 2
    path = tmp_path / "ring.safetensors"
    save_prompt_cache(path, [ring])
    (back,) = load_prompt_cache(path)
    ring.restore(ring.snapshot())
    assert back.undo == ring.undo == 2
    assert back.trimmable_rows() == ring.trimmable_rows() == 0
    assert back.trim(1) == ring.trim(1) == 0  # fails closed: nothing moves
    for c in (ring, back):
        feed(c, 1, 9)
    assert back.trimmable_rows() == ring.trimmable_rows() == 1
    assert back.trim(1) == ring.trim(1) == 1
    assert facts(back) == facts(ring)


# -- save and load at random points of a run --------------------------------------
@st.composite
def runs(draw):
    kind = draw(st.sampled_from(["fp16", "int8", "ring", "turbo4asym", "turbo4", "turbo3asym", "turbo4delegated"]))
    step = draw(st.integers(1, 4))
    if kind == "ring":
        w = draw(st.integers(1, 6))
        keep = draw(st.integers(0, w - 1))
        undo = draw(st.integers(0, 3))

        def make():
            return RotatingKVCache(max_size=w, keep=keep, step=step, undo=undo)
    elif kind == "turbo4delegated":
        hot, block = draw(st.integers(1, 4)), draw(st.integers(1, 4))

        def make():
            return make_cache(kind, step=step, hot_threshold=hot, fold_block=block)
    elif kind.startswith("turbo"):
        def make():
            return make_cache(kind, step=step)
    else:
        def make():
            return KVCache(kind, step=step)
    ops = draw(st.lists(st.one_of(
        st.tuples(st.just("append"), st.integers(1, 4)),
        st.tuples(st.just("trim"), st.integers(0, 3)),
        st.tuples(st.just("front"), st.integers(0, 2)),
        st.tuples(st.just("reload"), st.just(0)),
    ), min_size=1, max_size=14))
    return make, ops


@settings(max_examples=40)
@given(runs())
def test_save_and_load_anywhere_changes_nothing(tmp_path_factory, run):
    """A save and load anywhere in a run acts as restoring a snapshot taken
    there (a ring's undo log included: a restored ring cannot roll back into
    the history before the restore), for every layer class and mode."""
    make, ops = run
    orig = make()
    other = make()
    path = tmp_path_factory.mktemp("pc") / "c.safetensors"
    for i, (op, n) in enumerate(ops):
        if op == "reload":
            save_prompt_cache(path, [other])
            (other,) = load_prompt_cache(path)
            orig.restore(orig.snapshot())
        elif op == "append":
            a, b = feed(orig, n, i), feed(other, n, i)
            assert np.array(a[0]).tobytes() == np.array(b[0]).tobytes()
            assert np.array(a[1]).tobytes() == np.array(b[1]).tobytes()
        elif op == "trim":
            assert orig.trim(n) == other.trim(n)
        elif isinstance(orig, KVCache):
            assert orig.trim_front_keep_sink(n, keep=1) == other.trim_front_keep_sink(n, keep=1)
        assert facts(orig) == facts(other)
        assert orig.is_trimmable() == other.is_trimmable()
        if isinstance(orig, RotatingKVCache):
            assert orig.trimmable_rows() == other.trimmable_rows()


# -- to_quantized -------------------------------------------------------------------
def test_to_quantized_gives_our_int8_cache():
    c = KVCache("fp16", step=3)
    feed(c, 5, 1)
    c.trim_front_keep_sink(1, keep=1)
    q = c.to_quantized(group_size=64, bits=8)
    assert isinstance(q, KVCache) and q.mode == "int8" and q is not c
    assert (q.offset, q.live_start, q.step) == (c.offset, c.live_start, c.step)
    k, v = c.fetch()
    qk, qv = q.fetch()
    assert np.array(qk).tobytes() == np.array(dequantize_int8(*quantize_int8(k))).tobytes()
    assert np.array(qv).tobytes() == np.array(dequantize_int8(*quantize_int8(v))).tobytes()
    assert q.to_quantized(bits=8) is q
    assert c.mode == "fp16" and window(c) == b"".join(np.array(a).tobytes() for a in (k, v))
    empty = KVCache().to_quantized(bits=8)
    assert empty.mode == "int8" and empty.offset == 0


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_to_quantized_keeps_the_rows_dtype(dtype):
    """An Int8 copy of a bfloat16 (or float32) cache dequantizes to that
    dtype, as an Int8 cache fed those rows does (a cast to float16 changes a
    bfloat16 model's output; the copy had lost it)."""
    c, ref = KVCache("fp16", step=3), KVCache("int8", step=3)
    for x in (c, ref):
        x.update_and_fetch(rows(5, 1).astype(dtype), rows(5, 2).astype(dtype))
    q = c.to_quantized(bits=8)
    assert [a.dtype for a in q.fetch()] == [dtype, dtype]
    assert [np.array(a.astype(mx.float32)).tobytes() for a in q.fetch()] == \
        [np.array(a.astype(mx.float32)).tobytes() for a in ref.fetch()]
    q.update_and_fetch(rows(1, 3).astype(dtype), rows(1, 4).astype(dtype))  # and it takes the model's next rows
    assert q.offset == 6


@pytest.mark.parametrize("bits, group_size", [(1, 64), (7, 64), (16, 64), (4, 16), (8, 0)])
def test_to_quantized_refuses_what_mlx_cannot_quantize(bits, group_size):
    with pytest.raises(UnsupportedOperationError, match=f"got bits={bits}, group_size={group_size}"):
        KVCache().to_quantized(bits=bits, group_size=group_size)


@pytest.mark.parametrize("bits", [2, 3, 4, 6])
def test_to_quantized_other_widths_hand_the_layer_to_mlx_lm(bits):
    """bits other than 8 on an Fp16 cache: mlx-lm's QuantizedKVCache of the
    same rows, exactly what mlx-lm's own KVCache.to_quantized builds."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import KVCache as LmKVCache
    from mlx_lm.models.cache import QuantizedKVCache

    c, lm = KVCache("fp16", step=3), LmKVCache()
    for i in range(5):
        k = rows(1, i, d=32)
        c.update_and_fetch(k, k)
        lm.update_and_fetch(k, k)
    q, want = c.to_quantized(group_size=32, bits=bits), lm.to_quantized(group_size=32, bits=bits)
    assert type(q) is QuantizedKVCache and (q.bits, q.group_size, q.offset) == (bits, 32, 5)
    x = rows(1, 99, d=32)
    got, ref = q.update_and_fetch(x, x), want.update_and_fetch(x, x)

    assert [np.array(a).tobytes() for _, a in tree_flatten(got)] == [np.array(a).tobytes() for _, a in tree_flatten(ref)]


@pytest.mark.parametrize("make", [lambda: KVCache("int8"), lambda: TurboKVCache("turbo4"), lambda: TurboKVCache("turbo3asym")],
                         ids=["int8", "turbo4", "turbo3asym"])
def test_a_quantized_mode_keeps_itself_under_other_kv_bits_and_says_so_once(make):
    """mlx-lm calls to_quantized only once the offset reaches
    quantized_kv_start: a layer whose mode already quantizes keeps its own
    storage (and its rows) with one warning per cache, never a late error."""
    c = make()
    k = rows(1, 3, d=8)
    c.update_and_fetch(k, k)
    before = [np.array(a).tobytes() for a in c.fetch()]
    bits = 6 if getattr(c, "mode", "") == "int8" else 2
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = [c.to_quantized(bits=bits), c.to_quantized(bits=bits)]
    assert got == [c, c]
    assert len(record) == 1 and "keeps" in str(record[0].message), [str(r.message) for r in record]
    assert [np.array(a).tobytes() for a in c.fetch()] == before


def test_a_ring_keeps_itself_under_kv_bits_and_says_so_once():
    ring = RotatingKVCache(max_size=4)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = [ring.to_quantized(bits=4), ring.to_quantized(bits=8)]
    assert got == [ring, ring]
    assert len(record) == 1 and "keeps its rows unquantized" in str(record[0].message)


def test_kv_bits_through_generate_step():
    """mlx-lm's generate quantizes a prompt cache with kv_bits: 8 gives our
    Int8 caches; 4 gives mlx-lm's QuantizedKVCache, and the stream equals
    mlx-lm's own caches under kv_bits=4 byte for byte, whether the
    quantization starts at the first token or mid-stream."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import QuantizedKVCache
    from mlx_lm.models.cache import make_prompt_cache as lm_make_prompt_cache

    from kvspec.fuzz.commands.e2e import tiny_llama, token_ids

    model = tiny_llama(3)
    caches = make_prompt_cache(model, step=4)
    toks = [int(t) for t, _ in generate_step(token_ids(3, 6), model, max_tokens=4, prompt_cache=caches,
                                                kv_bits=8, kv_group_size=64, quantized_kv_start=0)]
    assert len(toks) == 4 and all(isinstance(c, KVCache) and c.mode == "int8" for c in caches)
    model = tiny_llama(3, head_dim=32)  # mlx's quantizer takes groups of 32 or more
    for start in (0, 9):
        runs = []
        for caches in (make_prompt_cache(model, step=4), lm_make_prompt_cache(model)):
            runs.append([(int(t), np.array(lp).tobytes()) for t, lp in generate_step(
                token_ids(3, 6), model, max_tokens=8, prompt_cache=caches, kv_bits=4, kv_group_size=32,
                quantized_kv_start=start)])
            assert all(type(c) is QuantizedKVCache for c in caches)
        assert runs[0] == runs[1]


# -- the protocol, member by member -------------------------------------------------
def declared_missing() -> set[str]:
    """Members docs/mlx-lm.md declares as not provided (its table)."""
    text = DOCS.read_text()
    part = text.split("## Protocol members we do not provide", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(\w+\.\w+)` \|", part, re.MULTILINE))


@pytest.mark.parametrize("name", ["KVCache", "RotatingKVCache", "QuantizedKVCache"])
def test_every_public_member_of_mlx_lm_caches_is_provided_or_declared(name):
    import mlx_lm.models.cache as lm

    lm_cls = getattr(lm, name)
    lm_obj = lm_cls(max_size=4) if name == "RotatingKVCache" else lm_cls()
    ours = {"KVCache": [KVCache("fp16")], "RotatingKVCache": [RotatingKVCache(max_size=4)],
            "QuantizedKVCache": [KVCache("int8")]}[name]
    members = {m for m in dir(lm_obj) if not m.startswith("_")}
    declared = declared_missing()
    undeclared = sorted(m for m in members if not all(hasattr(o, m) for o in ours) and f"{name}.{m}" not in declared)
    assert undeclared == [], f"{name}: provide these or declare them in docs/mlx-lm.md: {undeclared}"
    stale = sorted(d for d in declared if d.startswith(name + ".") and d.split(".")[1] not in members)
    assert stale == [], f"docs/mlx-lm.md declares members mlx-lm no longer has: {stale}"


def test_metadata_keys_come_back_verbatim(tmp_path):
    """User metadata keys at the edges of the file's ``"0."`` namespace
    (a leading "0", ".", "0.", empty, non-ASCII) load back as they were
    saved (kvspec.spec.models.loaded_metadata; issue 47 (d): a loader that strips
    the prefix with ``lstrip("0.")`` turns "0shot" into "shot")."""
    from kvspec.spec.models import loaded_metadata

    meta = {"0shot": "a", ".hidden": "b", "0.": "c", "": "d", "00": "e", "0.5": "f", "température": "g", "模型": "h",
            "name": ""}
    c = KVCache("fp16", step=4)
    c.update_and_fetch(mx.ones((1, 1, 2, 8), dtype=mx.float16), mx.ones((1, 1, 2, 8), dtype=mx.float16))
    path = tmp_path / "p.safetensors"
    save_prompt_cache(path, [c], meta)
    _, got = load_prompt_cache(path, return_metadata=True)
    assert got == loaded_metadata(meta) == meta
