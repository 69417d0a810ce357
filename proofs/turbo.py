"""The Turbo modes' obligations: 10 physical trim, 11 Delegated's
fold schedule, 12 the 3-bit packing's byte count. Each names the spec
functions it proves (``kvspec.spec.turbo``, ``kvspec.spec.dense.trim`` in the Turbo modes);
each negative control names the buggy rule it refutes.

Parts are validity checks ``premises => goal`` over the encodings in
:mod:`kvspec.proofs.turbo_model`, run over unbounded integers and in 32-bit
wrapping arithmetic (``bv32``) like the dense obligations. The fold schedule
is a loop (``kvspec.spec.turbo.fold_schedule``); it is proved by induction: every
step of it (the handoff fold, an append of the new rows, one block fold, a
trim) preserves the invariant from any state that satisfies it, and each
block fold moves at least one row while hot exceeds the threshold, so the
loop ends with hot at most the threshold.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import z3

from kvspec.proofs.core import ObligationResult, PartBuilder, control_from_parts, overall, run_parts
from kvspec.proofs.domain import Domain
from kvspec.proofs.turbo_model import (
    COLD,
    NON_DELEGATED,
    SPEC,
    TurboRules,
    array_rows_after_append,
    array_rows_after_trim,
    cold_ok,
    d_append,
    d_fold,
    d_trim,
    delegated_rows_after_trim,
    delegated_vars,
    fetch_is_window,
    fold_block_rows,
    handoff_fold,
    pack_guard,
    packed_bytes,
)

# ===========================================================================
# Obligation 10: physical trim


def trim_parts(rules: TurboRules = SPEC) -> list[tuple[str, PartBuilder]]:
    parts: list[tuple[str, PartBuilder]] = []

    for mode, names in NON_DELEGATED.items():
        def append_lockstep(d: Domain, names: tuple[str, ...] = names) -> tuple[list[Any], Any]:
            cap, live, n, step = d.var("capacity"), d.var("live_len"), d.var("n"), d.var("step")
            rows = {a: d.var(f"rows_{a}") for a in names}
            after = array_rows_after_append(d, names, rows, live, n, step)
            premises = [step >= 1, n >= 1, live >= 0, live <= cap, *(rows[a] == cap for a in names)]
            new_cap = after[names[0]]
            return premises, z3.And(new_cap >= live + n, *(after[a] == new_cap for a in names))

        def trim_cuts(d: Domain, names: tuple[str, ...] = names) -> tuple[list[Any], Any]:
            cap, live, n = d.var("capacity"), d.var("live_len"), d.var("n")
            rows = {a: d.var(f"rows_{a}") for a in names}
            after, left = array_rows_after_trim(d, names, rows, live, n, rules.trim)
            premises = [live >= 1, live <= cap, n >= 1, *(rows[a] == cap for a in names)]
            return premises, z3.And(*(after[a] == left for a in names))

        parts.append((f"{mode}: an append keeps every buffer and sidecar at one capacity >= live_len",
                      append_lockstep))
        parts.append((f"{mode}: a trim cuts every buffer and sidecar to exactly the live rows", trim_cuts))

    def delegated_cuts(d: Domain) -> tuple[list[Any], Any]:
        cap, live, cold, n = d.var("capacity"), d.var("live_len"), d.var("cold_offset"), d.var("n")
        names = ("keys", *COLD, "hot")
        rows = {a: d.var(f"rows_{a}") for a in names}
        after, left, cold2 = delegated_rows_after_trim(d, rows, live, cold, n, rules)
        premises = [live >= 1, live <= cap, 0 <= cold, cold <= live, n >= 1, rows["keys"] == cap,
                    *(rows[c] == cold for c in COLD), rows["hot"] == live - cold]
        goal = z3.And(after["keys"] == left, *(after[c] == cold2 for c in COLD),
                      after["hot"] == left - cold2, 0 <= cold2, cold2 <= left)
        return premises, goal

    parts.append(("turbo4delegated: a trim cuts K to the live rows, cold V to cold_offset, hot V to the rest",
                  delegated_cuts))
    return parts


TRIM_CONTROLS = [
    ("logical_trim_in_turbo", "a Turbo trim moves only the offset (the Fp16/Int8 rewind)",
     TurboRules(trim="logical")),
    ("sidecar_not_trimmed", "the norm and rescale sidecars keep their rows at a trim",
     TurboRules(trim="skip_sidecar")),
]


def prove_trim() -> ObligationResult:
    t0 = time.perf_counter()
    parts = run_parts(trim_parts())
    controls = [control_from_parts(name, text, trim_parts(rules)) for name, text, rules in TRIM_CONTROLS]
    return ObligationResult(
        10, "Turbo physical trim", ("trim", "trim_is_logical", "array_rows"),
        "after any trim every buffer and sidecar of a Turbo mode holds exactly the live rows "
        "(Delegated: K live_len, cold V cold_offset, hot V the rest); appends keep them in lockstep",
        overall(parts, controls), parts, controls, time.perf_counter() - t0)


# ===========================================================================
# Obligation 11: Delegated's fold schedule


def _inv(c: Any) -> Any:
    return z3.And(cold_ok(c), fetch_is_window(c))


def fold_parts(rules: TurboRules = SPEC) -> list[tuple[str, PartBuilder]]:
    def append(d: Domain) -> tuple[list[Any], Any]:
        c, n, new = delegated_vars(d, "0"), d.var("n"), d.array("new")
        c1 = d_append(d, c, n, new)
        return [_inv(c), n >= 1], _inv(c1)

    def handoff(d: Domain) -> tuple[list[Any], Any]:
        c, n = delegated_vars(d, "0"), d.var("n")
        hot = d.sub(c.off, c.cold, "offset - cold")
        c1 = d_fold(d, c, hot, rules.fold)
        return [_inv(c), handoff_fold(d, c.cold, c.off, n)], _inv(c1)

    def block(d: Domain) -> tuple[list[Any], Any]:
        c, T, B = delegated_vars(d, "0"), d.var("hot_threshold"), d.var("fold_block")
        hot = d.sub(c.off, c.cold, "offset - cold")
        f = fold_block_rows(d, hot, T, B, rules.fold)
        c1 = d_fold(d, c, f, rules.fold)
        return [_inv(c), T >= 0, B >= 1, hot > T], _inv(c1)

    def progress(d: Domain) -> tuple[list[Any], Any]:
        c, T, B = delegated_vars(d, "0"), d.var("hot_threshold"), d.var("fold_block")
        hot = d.sub(c.off, c.cold, "offset - cold")
        f = fold_block_rows(d, hot, T, B, rules.fold)
        return [cold_ok(c), T >= 0, B >= 1], z3.And(z3.Implies(hot > T, f >= 1), f >= 0, f <= hot)

    def trim(d: Domain) -> tuple[list[Any], Any]:
        c, n = delegated_vars(d, "0"), d.var("n")
        c1 = d_trim(d, c, n, rules.trim_order)
        return [_inv(c)], _inv(c1)

    return [
        ("an append of n >= 1 rows to the hot part keeps 0 <= cold <= offset and cold ++ hot = window", append),
        ("the handoff fold (every held row) keeps the invariant", handoff),
        ("a block fold of min(fold_block, hot) rows keeps the invariant", block),
        ("a block fold moves between 1 and hot rows while hot > hot_threshold (the loop ends)", progress),
        ("a trim (hot rows first, clamped to [0, offset]) keeps the invariant", trim),
    ]


FOLD_CONTROLS = [
    ("delegated_trim_cold_first", "a Delegated trim takes the cold rows first", TurboRules(trim_order="cold_first")),
    ("fold_one_row_too_many", "a fold advances cold_offset by one row more than it moves",
     TurboRules(fold="one_too_many")),
    ("fold_drops_a_row", "a fold removes one hot row more than it moves cold", TurboRules(fold="drops_a_row")),
    ("fold_block_unclamped", "a block fold moves fold_block rows even when fewer are hot",
     TurboRules(fold="unclamped")),
]


def prove_fold() -> ObligationResult:
    t0 = time.perf_counter()
    parts = run_parts(fold_parts())
    controls = [control_from_parts(name, text, fold_parts(rules)) for name, text, rules in FOLD_CONTROLS]
    return ObligationResult(
        11, "Delegated fold schedule", ("fold_schedule", "handoff_fold", "fold_block_rows", "trim_split"),
        "across appends, handoff and block folds and trims (hot first): 0 <= cold_offset <= offset and "
        "fetch = dequant(cold) ++ hot is the chronological window",
        overall(parts, controls), parts, controls, time.perf_counter() - t0)


# ===========================================================================
# Obligation 12: 3-bit packing


def pack_parts(rules: TurboRules = SPEC) -> list[tuple[str, PartBuilder]]:
    def exact_iff(d: Domain) -> tuple[list[Any], Any]:
        h = d.var("head_dim")
        b = packed_bytes(d, h, 3)
        return [h >= 1, h <= 8192], (b * 8 == 3 * h) == (h % 8 == 0)

    def guard_exact(d: Domain) -> tuple[list[Any], Any]:
        h = d.var("head_dim")
        b = packed_bytes(d, h, 3)
        return [h >= 1, h <= 8192, pack_guard(d, h, rules.pack_exact)], b * 8 == 3 * h

    def nibbles(d: Domain) -> tuple[list[Any], Any]:
        h = d.var("head_dim")
        b = packed_bytes(d, h, 4)
        return [h >= 1, h <= 8192], (b * 8 == 4 * h) == (h % 2 == 0)

    return [
        ("3-bit: 3 * head_dim // 8 bytes hold every index exactly iff head_dim % 8 == 0", exact_iff),
        ("a head_dim the 3-bit packer accepts packs with no bit lost", guard_exact),
        ("4-bit: head_dim // 2 bytes hold every index exactly iff head_dim is even", nibbles),
    ]


PACK_CONTROLS = [
    ("pack3_accepts_partial_word", "the 3-bit packer accepts head_dim % 4 == 0 and truncates",
     TurboRules(pack_exact="mod4")),
]


def prove_pack() -> ObligationResult:
    t0 = time.perf_counter()
    parts = run_parts(pack_parts())
    controls = [control_from_parts(name, text, pack_parts(rules)) for name, text, rules in PACK_CONTROLS]
    return ObligationResult(
        12, "3-bit packing byte count", ("packed_bytes", "head_dim_allowed"),
        "3 * head_dim // 8 bytes are exact iff head_dim % 8 == 0; the packer accepts no other head_dim",
        overall(parts, controls), parts, controls, time.perf_counter() - t0)


OBLIGATIONS: list[tuple[int, Callable[[], ObligationResult]]] = [(10, prove_trim), (11, prove_fold), (12, prove_pack)]
