"""Edges of the portable rows (spec/rows.py): the coordinate bounds, the
defaults, the wide exponent shift and identification at its corners (a
wide row of exponent 0, a code of 0, a negative float32, a tampered
extra bit)."""

import pytest

from kvspec.spec import rows as sr

WIDE = [t for t in range(2, 400, 5)]  # t % 5 == 2: wide where the flag and the dtype say so


def k_code_exponent(t):
    return (sr.code(t, 0, 0, 0, 0) >> 7) & 15


def test_the_last_head_and_column_are_inside_the_bounds_and_one_more_is_refused():
    assert sr.place(1, 63, 63, 1023) < 2**23
    with pytest.raises(ValueError, match=r"h < 64, c < 1024, got kv=0, b=0, h=64, c=0$"):
        sr.place(0, 0, 64, 0)
    with pytest.raises(ValueError, match=r"got kv=0, b=0, h=0, c=1024$"):
        sr.place(0, 0, 0, 1024)


def test_element_bits_default_to_float16_rows_without_the_wide_shift():
    assert sr.element_bits(2, 0, 0, 0, 0) == sr.element_bits(2, 0, 0, 0, 0, "float16", False)
    assert sr.element_bits(2, 0, 0, 0, 0, "float32") == sr.element_bits(2, 0, 0, 0, 0, "float32", False)
    assert sr.element_bits(2, 0, 0, 0, 0, "float32") != sr.element_bits(2, 0, 0, 0, 0, "float32", True)


@pytest.mark.parametrize("dtype,exponent_shift", [("bfloat16", 7), ("float32", 23)])
def test_a_wide_row_adds_24_to_the_exponent_and_nothing_else(dtype, exponent_shift):
    for t in (2, 7):
        for kv in (0, 1):
            narrow = sr.element_bits(t, kv, 0, 1, 2, dtype, False)
            assert sr.element_bits(t, kv, 0, 1, 2, dtype, True) == narrow + (24 << exponent_shift)
    assert sr.element_bits(3, 0, 0, 0, 0, dtype, True) == sr.element_bits(3, 0, 0, 0, 0, dtype, False)


def test_row_bits_default_to_float16_rows_without_the_wide_shift():
    assert sr.row_bits(2, 1, 1, 2, 3) == [sr.element_bits(2, 1, b, h, c, "float16", False)
                                         for b in range(1) for h in range(2) for c in range(3)]
    assert sr.row_bits(2, 1, 1, 1, 2, "float32") == [sr.element_bits(2, 1, 0, 0, c, "float32") for c in range(2)]


def test_row_bits_pass_the_wide_flag_to_every_element():
    assert sr.row_bits(2, 0, 1, 1, 2, "bfloat16", True) == [sr.element_bits(2, 0, 0, 0, c, "bfloat16", True)
                                                           for c in range(2)]


def pair(t, dtype="float16", wide=False):
    return sr.element_bits(t, 0, 0, 0, 0, dtype, wide), sr.element_bits(t, 1, 0, 0, 0, dtype, wide)


def test_identify_defaults_to_float16_rows_without_the_wide_shift():
    for t in (0, 1, 2, 12345):
        assert sr.identify(*pair(t)) == t
    assert sr.identify(*pair(7, "float32")) is None  # float32 bits are no float16 pair


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_identify_finds_every_wide_row_and_only_with_the_flag(dtype):
    for t in WIDE[:8]:
        assert sr.identify(*pair(t, dtype, True), dtype, True) == t
        assert sr.identify(*pair(t, dtype, True), dtype) is None


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_identify_finds_a_wide_row_whose_code_exponent_is_0(dtype):
    t = next(t for t in WIDE if k_code_exponent(t) == 0)
    assert sr.identify(*pair(t, dtype, True), dtype, True) == t


@pytest.mark.parametrize("dtype", sr.DTYPES)
def test_identify_finds_a_row_whose_v_code_is_0(dtype):
    salt = sr.mix32(sr.place(1, 0, 0, 0)) & 0xFFF
    t = sr.unscramble(salt << 12)
    assert sr.code(t, 1, 0, 0, 0) == 0
    assert sr.identify(*pair(t, dtype), dtype) == t


def test_identify_finds_a_negative_float32_row():
    t = next(t for t in range(1, 200) if sr.element_bits(t, 0, 0, 0, 0, "float32") >> 31)
    assert sr.identify(*pair(t, "float32"), "float32") == t


def test_identify_refuses_a_pair_whose_v_extra_bits_were_changed():
    k, v = pair(5)
    assert sr.identify(k, v ^ 1) is None
    assert sr.identify(k ^ 1, v) is None
