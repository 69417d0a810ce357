"""Portable rows (spec/rows.py, docs/kvtrace.md "Portable rows"): the bound
is checked exhaustively, the NumPy copy agrees with the spec's scalar form,
and traces without ``rows`` keep the NumPy rows they always had.

The distinctness claim is proved by exhausting its two parts: the scramble
is a bijection of [0, 2^24) (every value is hit), and the element pair
``K[0, 0, 0]``, ``V[0, 0, 0]`` decodes back to the identity in every dtype,
with and without wide rows, for every one of the 2^24 identities (an
independent uint32 decoder written from the docs' bit layout, not
kvspec.spec.rows.identify)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvspec.fuzz import rows as fr
from kvspec.fuzz.replay import replay
from kvspec.fuzz.trace import MAX_TOKENS, TraceFormatError, loads
from kvspec.spec import rows as sr

N = sr.TOKEN_LIMIT
CHUNK = 1 << 22


def _mix32(x: np.ndarray) -> np.ndarray:
    # uint32 arithmetic wraps mod 2^32, as in C
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> np.uint32(16))


def _code_of(bits: np.ndarray, dtype: str) -> np.ndarray:
    """The 12-bit code of each element from its bit pattern (docs/kvtrace.md),
    -1 where the exponent is not one the function uses."""
    bits = bits.astype(np.int64)
    if dtype == "float16":
        sign, e, m = bits >> 15, ((bits >> 10) & 31) - 7, (bits >> 3) & 127
    elif dtype == "bfloat16":
        sign, e, m = bits >> 15, ((bits >> 7) & 255) - 119, bits & 127
    else:
        sign, e, m = bits >> 31, ((bits >> 23) & 255) - 119, (bits >> 16) & 127
    e = np.where(e >= 24, e - 24, e) if dtype != "float16" else e
    return np.where((e >= 0) & (e < 16), (sign << 11) | (e << 7) | m, -1)


def test_scramble_is_a_bijection_of_every_identity():
    t = np.arange(N, dtype=np.uint32)
    z = (t * np.uint32(sr.MULTIPLIER)) & np.uint32(0xFFFFFF)
    z ^= z >> np.uint32(12)
    hit = np.zeros(N, dtype=bool)
    hit[z] = True
    assert hit.all()  # N values into N slots, all hit: a bijection
    back = z ^ (z >> np.uint32(12))
    back = (back * np.uint32(sr.MULTIPLIER_INVERSE)) & np.uint32(0xFFFFFF)
    assert np.array_equal(back, t)
    assert [sr.unscramble(sr.scramble(x)) for x in (0, 1, 4095, 4096, N - 1)] == [0, 1, 4095, 4096, N - 1]


def _back(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    z = (hi.astype(np.int64) << 12) | lo
    return (z ^ (z >> 12)) * sr.MULTIPLIER_INVERSE & 0xFFFFFF


def _salt(kv: int, b: int, h: int, c: int) -> int:
    return sr.mix32(sr.place(kv, b, h, c)) & 0xFFF


def test_every_identity_has_its_own_rows():
    """For all 2^24 identities (float16 rows): K[0,0,0] with V[0,0,0]
    decodes back to the identity (so no two identities share a (K, V) row
    pair, in any shape), and so does K[0,0,0] with K[0,0,1] (a side of two
    or more elements is distinct on its own: the neighbour along any axis
    carries the other digit, V's as K's, by digit_of)."""
    for kv in (0, 1):
        d0 = sr.digit_of(kv, 0, 0, 0)
        assert {sr.digit_of(kv, 0, 0, 1), sr.digit_of(kv, 0, 1, 0), sr.digit_of(kv, 1, 0, 0)} == {1 - d0}
    for start in range(0, N, CHUNK):
        t = np.arange(start, start + CHUNK)
        k = _code_of(fr.portable_bits(t, 0, 1, 1, 2, "float16").reshape(-1, 2), "float16")
        v = _code_of(fr.portable_bits(t, 1, 1, 1, 1, "float16").reshape(-1), "float16")
        assert (k >= 0).all() and (v >= 0).all()
        assert np.array_equal(_back(k[:, 0] ^ _salt(0, 0, 0, 0), v ^ _salt(1, 0, 0, 0)), t)
        assert np.array_equal(_back(k[:, 0] ^ _salt(0, 0, 0, 0), k[:, 1] ^ _salt(0, 0, 0, 1)), t)


@pytest.mark.parametrize("dtype,wide", [("float16", False), ("bfloat16", False), ("bfloat16", True),
                                        ("float32", False), ("float32", True)])
def test_every_code_survives_every_dtype(dtype, wide):
    """The code of an element (what the test above decodes) is the same in
    every dtype, wide or not: for all 4096 codes of K[0,0,0] and of
    V[0,0,0], each with 64 identities (every residue mod 5, so wide and
    plain rows), the bit pattern decodes to the code."""
    lo, hi = np.meshgrid(np.arange(4096), np.arange(64), indexing="ij")
    lo, hi = lo.reshape(-1), hi.reshape(-1)
    z = (hi << 12) | lo
    t = (z ^ (z >> 12)) * sr.MULTIPLIER_INVERSE & 0xFFFFFF  # unscramble
    assert set((t % 5).tolist()) == {0, 1, 2, 3, 4}
    for kv, want in ((0, lo ^ _salt(0, 0, 0, 0)), (1, hi ^ _salt(1, 0, 0, 0))):
        bits = fr.portable_bits(t, kv, 1, 1, 1, dtype, wide).reshape(-1)
        assert np.array_equal(_code_of(bits, dtype), want)
    assert len(set(_code_of(fr.portable_bits(t, 0, 1, 1, 1, dtype, wide).reshape(-1), dtype).tolist())) == 4096


@pytest.mark.parametrize("dtype", sr.DTYPES)
def test_every_value_is_a_normal_finite_number_and_wide_rows_leave_float16(dtype):
    tokens = list(range(0, 50_000, 7))
    for wide in (False, True):
        x = fr.rows(tokens, "k", 2, 3, 16, dtype, wide, "portable").astype(np.float64)
        assert np.isfinite(x).all() and (np.abs(x) >= 2.0**-8).all()
        is_wide = np.array([sr.is_wide(t, dtype, wide) for t in tokens])[None, None, :, None]
        assert (np.abs(x) < np.where(is_wide, 2.0**32, 2.0**8)).all()
        assert (np.abs(x) >= np.where(is_wide, 2.0**16, 0)).all()
        assert is_wide.any() == (wide and dtype != "float16")


def test_a_narrower_storage_shows_in_every_row():
    """float16 rows through bfloat16, float32 rows through float16 or
    bfloat16: the dropped extra bits change every row of 8 elements."""
    tokens = list(range(5000))
    f16 = fr.rows(tokens, "v", 1, 1, 8, "float16", False, "portable")
    through_bf16 = fr.round_to_bfloat16(f16.astype(np.float32))
    assert (through_bf16 != f16.astype(np.float32)).any(axis=-1).all()
    f32 = fr.rows(tokens, "k", 1, 1, 8, "float32", False, "portable")
    assert (f32.astype(np.float16).astype(np.float32) != f32).any(axis=-1).all()
    assert (fr.round_to_bfloat16(f32) != f32).any(axis=-1).all()


@given(t=st.one_of(st.integers(0, 64), st.integers(0, N - 1)), kv=st.integers(0, 1),
       shape=st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 6)),
       dtype=st.sampled_from(sr.DTYPES), wide=st.booleans())
def test_numpy_copy_equals_the_spec(t, kv, shape, dtype, wide):
    b, h, d = shape
    want = sr.row_bits(t, kv, b, h, d, dtype, wide)
    assert fr.portable_bits([t], kv, b, h, d, dtype, wide).reshape(-1).tolist() == want
    k000, v000 = sr.element_bits(t, 0, 0, 0, 0, dtype, wide), sr.element_bits(t, 1, 0, 0, 0, dtype, wide)
    assert sr.identify(k000, v000, dtype, wide) == t


def test_identify_refuses_what_no_identity_writes():
    k = sr.element_bits(5, 0, 0, 0, 0)
    v = sr.element_bits(6, 1, 0, 0, 0)  # a mixed pair decodes to a third identity whose rows differ
    assert sr.identify(k, v) is None or sr.element_bits(sr.identify(k, v), 0, 0, 0, 0) == k
    assert sr.identify(0, 0) is None  # an all-zero slot
    with pytest.raises(ValueError, match="token identity"):
        sr.element_bits(N, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="coordinates"):
        sr.element_bits(0, 0, 64, 0, 0)
    with pytest.raises(ValueError, match="dtype"):
        sr.element_bits(0, 0, 0, 0, 0, "int8")


def test_a_trace_without_rows_keeps_the_numpy_rows():
    old = fr.rows([0, 1, 2, 3], "k", 1, 2, 8, "float16")
    assert np.array_equal(old, fr.rows([0, 1, 2, 3], "k", 1, 2, 8, "float16", False, "numpy"))
    assert not np.array_equal(old, fr.rows([0, 1, 2, 3], "k", 1, 2, 8, "float16", False, "portable"))
    assert not old[:, :, 3].any()  # NumPy rows: every 7th K row (t % 7 == 3) is zero, as before
    doc = {"kvtrace": 1, "cache": {"kind": "dense", "rows": "nope"}, "ops": []}
    with pytest.raises(TraceFormatError, match="rows"):
        loads(json.dumps(doc))


def test_more_identities_than_the_bound_are_refused():
    doc = {"kvtrace": 1, "cache": {"kind": "rotating", "max_size": 4, "head_dim": 1, "kv_heads": 1},
           "ops": [{"op": "append", "n": 2**20}] * 16 + [{"op": "append", "n": 1}]}
    with pytest.raises(TraceFormatError, match=f"more than the limit of {MAX_TOKENS}"):
        loads(json.dumps(doc))
    doc["ops"] = doc["ops"][:-1]
    loads(json.dumps(doc))  # exactly 2^24 identities: 0 .. 2^24 - 1


@pytest.mark.parametrize("name", ["token_identities", "int8_round_half_away", "turbo4_shared_signs",
                                  "rotating_worked_example", "paged_forks_and_front_trims",
                                  "layers_rollback_after_wrap", "fp16_casts_rows"])
def test_traces_replay_with_portable_rows_too(name):
    """Every kind and mode runs on portable rows (quantized ones included):
    a regression trace given ``"rows": "portable"`` passes on our caches."""
    from pathlib import Path

    path = Path(__file__).parent / "traces" / f"{name}.json"
    doc = json.loads(path.read_text())
    doc["cache"]["rows"] = "portable"
    result = replay(loads(json.dumps(doc)))
    assert result.ok, result.divergence


@pytest.mark.parametrize("dtype", fr.DTYPES)
def test_ranged_rows_reach_every_end_of_the_range(dtype):
    """The ``ranged`` scheme is there for the quantizers' range rules, so
    over a few dozen identities its rows must reach each end it promises:
    negative zeros (some among ordinary values, some rows all ``-0.0``),
    tiny rows (drawn within the lowest four binades of the dtype's range),
    huge rows (peak within a factor 2 of its largest finite value, never
    beyond it) and rows that mix scales far apart; every value finite in
    ``dtype``. A scheme that stopped drawing one of them (a ``0.0`` for the
    ``-0.0``, a huge row scaled down, a tiny one scaled up) passed every
    other test and left the Turbo oracle without its edge."""
    lo, hi = fr.EXPONENTS[dtype]
    top = fr.LARGEST[dtype]
    neg_zero = all_neg_zero = tiny = huge = mixed = 0
    for t in range(78):
        for which in ("k", "v"):
            x = fr.rows([t], which, 2, 2, 16, dtype, scheme="ranged").astype(np.float64)
            assert np.isfinite(x).all() and np.abs(x).max() <= top, (t, which)
            zero = x == 0
            neg_zero += int((zero & np.signbit(x)).any())
            all_neg_zero += int(zero.all() and np.signbit(x).all())
            nonzero = np.abs(x[~zero])
            if nonzero.size:
                # a tiny row is tiny throughout, a huge row huge in bulk (a
                # mixed-scale row has a tiny and a huge coordinate or two)
                tiny += int(nonzero.max() < 2.0 ** (lo + 6))
                huge += int(nonzero.max() >= top / 2 and np.median(nonzero) >= top / 64)
                mixed += int(nonzero.max() / nonzero.min() >= 2.0 ** ((hi - lo) // 2))
    assert neg_zero >= 10 and all_neg_zero >= 2, (neg_zero, all_neg_zero)
    assert tiny >= 10 and huge >= 10 and mixed >= 10, (tiny, huge, mixed)


def test_int8_edge_rows_reach_both_sides_of_the_float16_rounding_boundary():
    """Int8's rule is "finite once cast to float16" (kvspec.impl.quant), not
    ``<= 65504``: float32 edge rows reach the band (65504, 65520) that
    rounds to 65504, and the exact edge 65504; every edge row is finite in
    float16 (never refused), and the band's top is the last float32 below
    65520 (which itself turns inf)."""
    from kvspec.fuzz.rows import BAND, EDGE, row

    low, high = BAND["float32"]
    assert 65504.0 < low <= high < 65520.0 and np.isfinite(np.float16(np.float32(high)))
    with np.errstate(over="ignore"):
        assert np.isinf(np.float16(np.nextafter(np.float32(high), np.float32(np.inf))))
    for dtype in ("float16", "bfloat16", "float32"):
        peaks = [float(np.max(np.abs(row(t, w, 1, 2, 8, dtype, "edge")))) for t in range(200) for w in "kv"]
        assert all(np.isfinite(np.float16(p)) for p in peaks), dtype
        assert EDGE[dtype] in peaks, dtype
        in_band = [p for p in peaks if 65504.0 < p < 65520.0]
        assert (len(in_band) >= 5) == (dtype == "float32"), (dtype, in_band)



def test_numpy_and_ranged_rows_are_default_rngs_stream():
    """The ``numpy`` and (ordinary rows of the) ``ranged`` schemes draw from
    ``np.random.default_rng([token, side, ...])``: rows.py builds the same
    Generator faster, and every saved trace's rows depend on it being the
    same stream."""
    import numpy as np

    checked = 0
    for token in (1, 2, 4, 5, 9, 10, 4093):
        for which, side in (("k", 0), ("v", 1)):
            got = fr.row(token, which, 2, 3, 4, "float32")
            if got.any():  # the scheme's zero rows draw nothing
                rng = np.random.default_rng([token, side, 2, 3, 4])
                magnitude = float(2.0 ** rng.integers(-6, 6))
                want = (rng.standard_normal((2, 3, 1, 4)) * magnitude).astype(np.float32)
                assert np.array_equal(got, want), (token, which)
                checked += 1
            if token % 6 in (4, 5):  # ordinary ranged rows: one normal draw, one binade
                shape = (1, 2, 1, 3)
                rng = np.random.default_rng([token, side, *shape, fr.DTYPES.index("float32"), 7])
                want = rng.standard_normal(shape)
                want = want * 2.0 ** int(rng.integers(-6, 6))
                assert np.array_equal(fr.ranged_row(token, which, shape, "float32"), want), (token, which)
                checked += 1
    assert checked >= 12
