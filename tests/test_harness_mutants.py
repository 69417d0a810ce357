"""The harness's cheaper checks are themselves checked (kvspec.fuzz.harness_mutants,
docs/fuzzing.md "How the cheaper checks are checked"): each catches the
catalog bug paired with it, and only it does; the Int8 expected rows come
from kvspec.fuzz.quant_ref, never from kvspec.impl.quant. tests/test_fast_checks.py
compares fast and slow forms on a correct implementation only, where a
weakened check gives the same bytes: these tests fail on the weakenings
themselves (each planted below and seen failing)."""

from __future__ import annotations

import pytest

from kvspec.fuzz import harness_mutants as hm
from kvspec.fuzz.bugs import by_name, catalog
from kvspec.fuzz.dense import DenseLockstep
from kvspec.fuzz.layers import LayersLockstep


@pytest.mark.parametrize("check", hm.CHECKS, ids=lambda c: c.bug)
def test_each_cheaper_check_catches_its_paired_bug_and_only_it_does(check):
    assert hm.check_pairing(check) == []


def test_every_paired_bug_is_in_the_catalog_once():
    names = [c.bug for c in hm.CHECKS]
    assert len(set(names)) == len(names)
    assert set(names) <= {b.name for b in catalog()}
    assert all(by_name(n).factories for n in names)


def test_the_int8_expected_rows_come_from_the_oracle_not_from_impl():
    """Wrong kvspec.impl.quant functions (bound everywhere: module globals and the
    cache class's quantize_rows) leave the expected bytes unchanged; a
    wrong kvspec.fuzz.quant_ref changes them (the control)."""
    assert hm.check_int8_oracle() == []


def test_a_check_switched_off_fails_its_pairing(monkeypatch):
    monkeypatch.setattr(DenseLockstep, "check_dense_masks", False)
    (check,) = [c for c in hm.CHECKS if c.bug == "mask_window_from_newest_query"]
    problems = hm.check_pairing(check)
    assert problems and "no longer catches mask_window_from_newest_query" in problems[0]


def test_a_mask_compared_on_its_newest_row_only_fails_its_pairing(monkeypatch):
    """The weakening of the breaker's report (B12): make_mask compared on
    the last query's row only (a decode's one row is all a decode shows)."""
    from kvspec.fuzz import masks

    monkeypatch.setattr(masks, "same_mask", lambda got, want: bool((got[-1] == want[-1]).all()))
    (check,) = [c for c in hm.CHECKS if c.bug == "mask_window_from_newest_query"]
    problems = hm.check_pairing(check)
    assert problems and "no longer catches mask_window_from_newest_query" in problems[0]


def test_an_oracle_that_reads_back_through_float16_fails_its_pairing(monkeypatch):
    """kvspec.fuzz.quant_ref's read-back rounded to float16 before the rows'
    dtype (the paired bug, made in the oracle): the bug's returned window
    now agrees with the oracle, and the implementation's does not (the
    trace fails on it: a loud weakening, but a weakening)."""
    from kvspec.fuzz import quant_ref

    exact = quant_ref.round_to
    monkeypatch.setattr(quant_ref, "round_to", lambda x, dtype: exact(quant_ref.round_to_float16(x), dtype))
    (check,) = [c for c in hm.CHECKS if c.bug == "int8_dequantizes_in_float16"]
    problems = hm.check_pairing(check)
    assert any("fails on the implementation" in p for p in problems), problems
    assert any("diverges on another check" in p and "live window differs" in p for p in problems), problems


def test_stored_codes_from_the_cache_s_quantizer_fail_their_pairing(monkeypatch):
    """The stored-codes check's expected codes and scales taken from the
    cache's own quantizer (the weakening the Int8 rows had): they agree
    with a quantizer that stores a zero row's scale as 0."""
    import numpy as np

    def from_impl(self, token):
        k, v = self.input_rows([token])
        (kq, ks), (vq, vs) = self.cache.quantize_rows(k), self.cache.quantize_rows(v)
        return tuple(np.asarray(a) for a in (kq, ks, vq, vs))

    monkeypatch.setattr(DenseLockstep, "stored_int8", from_impl)
    (check,) = [c for c in hm.CHECKS if c.bug == "int8_zero_row_scale_zero"]
    problems = hm.check_pairing(check)
    assert problems and "no longer catches int8_zero_row_scale_zero" in problems[0]


def test_a_list_mismatch_that_stops_at_the_first_refusal_fails_its_pairing(monkeypatch):
    """The weakening of the breaker's report (B14): the first layer's
    refusal raised at once, the later layers never handed the rows."""

    def first_refusal(self, op):
        k, v = self.mismatched_rows(op["n"], op["differs"])
        for c in self.caches:
            c.update_and_fetch(k, v)
        return "every layer took the rows"

    monkeypatch.setattr(LayersLockstep, "_append_mismatch", first_refusal)
    (check,) = [c for c in hm.CHECKS if c.bug == "list_ring_casts_rows"]
    problems = hm.check_pairing(check)
    assert problems and "no longer catches list_ring_casts_rows" in problems[0]


def test_expected_int8_rows_from_the_cache_s_quantizer_fail_the_oracle_check(monkeypatch):
    """The weakening of the breaker's report (B9): the host path's Int8
    rows read back through the cache's own quantizer and kvspec.impl.quant's
    dequantizer. Same bytes on a correct implementation, so only swapping
    the implementation's functions shows it."""
    from kvspec.fuzz import dense as fdense
    from kvspec.fuzz.rows import host

    def from_impl(self, token, mode):
        if mode != "int8":
            return None
        k, v = self.input_rows([token])
        return tuple(host(fdense.dequantize_int8(*self.cache.quantize_rows(x), x.dtype)) for x in (k, v))

    monkeypatch.setattr(DenseLockstep, "host_stored_rows", from_impl)
    problems = hm.check_int8_oracle(("bfloat16",))
    assert any("dense rows change when kvspec.impl.quant's quantizer is wrong" in p for p in problems), problems
    assert any("dense rows stay the same when kvspec.fuzz.quant_ref is wrong" in p for p in problems), problems


def test_the_replacement_reaches_every_binding_and_restores_it():
    import kvspec.impl.dense
    import kvspec.impl.quant
    from kvspec.fuzz import dense as fdense

    orig_q, orig_d = kvspec.impl.quant.quantize_int8, kvspec.impl.quant.dequantize_int8
    with hm.replaced({orig_q: len, orig_d: abs}, ("kvspec.impl", "kvspec.fuzz")) as n:
        assert kvspec.impl.quant.quantize_int8 is len and kvspec.impl.dense.quantize_int8 is len
        assert kvspec.impl.dense.KVCache.quantize_rows is len  # the staticmethod, rewrapped
        assert kvspec.impl.dense.dequantize_int8 is abs and fdense.dequantize_int8 is abs
        assert n >= 5
    assert kvspec.impl.quant.quantize_int8 is orig_q and kvspec.impl.dense.KVCache.quantize_rows is orig_q
    assert fdense.dequantize_int8 is orig_d
