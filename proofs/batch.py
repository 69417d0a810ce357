"""Obligation 13: the batch layout (semantics.md 7, ``kvspec.spec.batch``).

For batches of ``B`` (3) sequences, any lengths, paddings and counts:

* merge: every sequence's offset is its length, no padding is negative or
  beyond the buffer, and the longest sequence has none;
* filter (any two distinct rows, in any order): each kept sequence keeps
  its offset, and the smallest padding becomes 0;
* extend: every sequence of both batches keeps its offset;
* a right-padded block: sequence ``i``'s offset grows by its own length;
* announced left padding then a block (an empty batch): a block shorter
  than a padding is refused and the layout is the one before; otherwise
  sequence ``i`` holds ``n - left[i]`` rows;
* trim: the count is ``min(n, every offset)`` for ``n > 0``, and no offset
  goes negative;
* the mask: a padding position is visible to no query of its sequence, and
  every row of the sequence up to the query is.

Every layout that comes out is valid (``0 <= pad <= idx``). Negative
controls, one per injected bug of ``fuzz/bugs/batch.py``: a merge that
shifts one sequence's offset (``batch_merge_shifts_offset``), a filter that
keeps the wrong row (``batch_filter_wrong_row``), a mask that shows padding
(``batch_padding_visible``), a refused block that moved ``idx`` anyway
(``batch_refused_block_moves_idx``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import z3

from kvspec.proofs.core import ObligationResult, PartBuilder, control_from_parts, overall, run_parts
from kvspec.proofs.domain import Domain

B = 3
REQUIRED = ("merge", "filter", "extend", "append_ragged", "announced_block", "trim_count", "visible", "offsets")


def available() -> bool:
    try:
        from kvspec.spec import batch as sb
    except ImportError:
        return False
    return all(hasattr(sb, name) for name in REQUIRED)


@dataclass(frozen=True)
class BatchRules:
    """The layout rules; a negative control changes one."""

    merge_shift: int = 0  # added to sequence 1's padding by merge
    filter_shift: int = 0  # a kept row is read from keep[j] + shift (mod B)
    mask_pads: bool = True  # the mask hides padding
    refusal_keeps: bool = True  # a refused announced block leaves the layout as it was


SPEC = BatchRules()


def _min(xs: list[Any]) -> Any:
    out = xs[0]
    for x in xs[1:]:
        out = z3.If(x < out, x, out)
    return out


def _max(xs: list[Any]) -> Any:
    out = xs[0]
    for x in xs[1:]:
        out = z3.If(x > out, x, out)
    return out


# -- the model of kvspec.spec.batch (tests/test_proofs_fidelity_batch.py samples it against the spec) --
def merge(lengths: list[Any], rules: BatchRules = SPEC) -> tuple[Any, list[Any]]:
    longest = _max(lengths)
    pads = [longest - n + (rules.merge_shift if i == 1 else 0) for i, n in enumerate(lengths)]
    return longest, pads


def pick(pads: list[Any], k: Any, rules: BatchRules = SPEC) -> Any:
    """``pads[k]`` for a symbolic index (``k + filter_shift`` mod B under a control)."""
    out = pads[-1]
    for i in range(len(pads)):
        src = (i + rules.filter_shift) % len(pads)
        out = z3.If(k == i, pads[src], out)
    return out


def filter_(idx: Any, pads: list[Any], keep: list[Any], rules: BatchRules = SPEC) -> tuple[Any, list[Any]]:
    kept = [pick(pads, k, rules) for k in keep]
    drop = _min(kept)
    return idx - drop, [p - drop for p in kept]


def extend(a: tuple[Any, list[Any]], b: tuple[Any, list[Any]]) -> tuple[Any, list[Any]]:
    idx = _max([a[0], b[0]])
    return idx, [p + idx - a[0] for p in a[1]] + [p + idx - b[0] for p in b[1]]


def append_ragged(idx: Any, pads: list[Any], lengths: list[Any]) -> tuple[Any, list[Any]]:
    width = _max(lengths)
    return idx + width, [p + width - n for p, n in zip(pads, lengths)]


def announced_block(idx: Any, pads: list[Any], left: list[Any], n: Any,
                    rules: BatchRules = SPEC) -> tuple[Any, Any, list[Any]]:
    """(refused, idx, pads) after announced padding ``left`` and a block of
    ``n`` on an empty batch (``kvspec.spec.batch.announced_block``): refused when a
    padding passes the block, and then the layout is the one before (under
    the control: the block's idx and padding anyway)."""
    grown = [p + q for p, q in zip(pads, left)]
    refused = z3.Or(*(g > n for g in grown))
    if not rules.refusal_keeps:
        return refused, n, grown
    return refused, z3.If(refused, idx, n), [z3.If(refused, p, g) for p, g in zip(pads, grown)]


def trim_count(idx: Any, pads: list[Any], n: Any) -> Any:
    least = _min([n, *(idx - p for p in pads)])
    return z3.If(least > 0, least, 0)


def visible(pad: Any, query: Any, key: Any, rules: BatchRules = SPEC) -> Any:
    return z3.And(key <= query, pad <= key) if rules.mask_pads else key <= query


# -- parts --------------------------------------------------------------------------
def _layout(d: Domain, name: str, b: int = B) -> tuple[Any, list[Any], list[Any]]:
    idx = d.var(f"{name}_idx")
    pads = [d.var(f"{name}_pad{i}") for i in range(b)]
    return idx, pads, [z3.And(0 <= p, p <= idx) for p in pads]


def _valid(idx: Any, pads: list[Any]) -> Any:
    return z3.And(*(z3.And(0 <= p, p <= idx) for p in pads))


def batch_parts(rules: BatchRules = SPEC) -> list[tuple[str, PartBuilder]]:
    def merged(d: Domain) -> tuple[list[Any], Any]:
        lengths = [d.var(f"len{i}") for i in range(B)]
        idx, pads = merge(lengths, rules)
        goal = z3.And(*(idx - p == n for p, n in zip(pads, lengths)), _valid(idx, pads), _min(pads) == 0)
        return [n >= 0 for n in lengths], goal

    def filtered(d: Domain) -> tuple[list[Any], Any]:
        idx, pads, pre = _layout(d, "a")
        keep = [d.var("k0"), d.var("k1")]
        pre += [z3.And(0 <= k, k < B) for k in keep] + [keep[0] != keep[1]]
        nidx, npads = filter_(idx, pads, keep, rules)
        same = z3.And(*(nidx - q == idx - pick(pads, k) for q, k in zip(npads, keep)))
        return pre, z3.And(same, _valid(nidx, npads), _min(npads) == 0)

    def extended(d: Domain) -> tuple[list[Any], Any]:
        a_idx, a_pads, pre_a = _layout(d, "a")
        b_idx, b_pads, pre_b = _layout(d, "b")
        idx, pads = extend((a_idx, a_pads), (b_idx, b_pads))
        before = [a_idx - p for p in a_pads] + [b_idx - p for p in b_pads]
        return pre_a + pre_b, z3.And(*(idx - p == o for p, o in zip(pads, before)), _valid(idx, pads))

    def ragged(d: Domain) -> tuple[list[Any], Any]:
        idx, pads, pre = _layout(d, "a")
        lengths = [d.var(f"n{i}") for i in range(B)]
        nidx, npads = append_ragged(idx, pads, lengths)
        grown = z3.And(*(nidx - q == idx - p + n for p, q, n in zip(pads, npads, lengths)))
        return pre + [n >= 0 for n in lengths], z3.And(grown, _valid(nidx, npads))

    def announced(d: Domain) -> tuple[list[Any], Any]:
        pads = [d.var(f"pad{i}") for i in range(B)]
        left = [d.var(f"left{i}") for i in range(B)]
        n = d.var("n")
        refused, nidx, npads = announced_block(0, pads, left, n, rules)
        pre = [p == 0 for p in pads] + [q >= 0 for q in left] + [n >= 0]
        kept = z3.And(nidx == 0, *(q == p for p, q in zip(pads, npads)))
        return pre, z3.And(_valid(nidx, npads), z3.Implies(refused, kept),
                           z3.Implies(z3.Not(refused), z3.And(*(nidx - q == n - lq for q, lq in zip(npads, left)))))

    def trimmed(d: Domain) -> tuple[list[Any], Any]:
        idx, pads, pre = _layout(d, "a")
        n = d.var("n")
        count = trim_count(idx, pads, n)
        least = _min([n, *(idx - p for p in pads)])
        goal = z3.And(count >= 0, *(idx - p - count >= 0 for p in pads), z3.Implies(least > 0, count == least),
                      _valid(idx - count, pads))
        return pre, goal

    def masked(d: Domain) -> tuple[list[Any], Any]:
        idx, pads, pre = _layout(d, "a", 1)
        query, key = d.var("query"), d.var("key")
        pre += [pads[0] <= query, query < idx, 0 <= key]
        goal = z3.And(z3.Implies(key < pads[0], z3.Not(visible(pads[0], query, key, rules))),
                      z3.Implies(z3.And(pads[0] <= key, key <= query), visible(pads[0], query, key, rules)))
        return pre, goal

    return [("merge: offset = length, the longest unpadded", merged),
            ("filter: each kept sequence keeps its offset; the least padding is 0", filtered),
            ("extend: every sequence keeps its offset", extended),
            ("a right-padded block grows each offset by its own length", ragged),
            ("announced padding then a block: a padding past the block is refused and changes nothing", announced),
            ("trim: min(n, every offset), no offset below 0", trimmed),
            ("the mask hides padding and shows every row up to the query", masked)]


#: (name, what the bug does, rules): one per injected bug of fuzz/bugs/batch.py
CONTROLS: list[tuple[str, str, BatchRules]] = [
    ("batch_merge_shifts_offset", "merge pads sequence 1 one position more than the longest needs",
     BatchRules(merge_shift=1)),
    ("batch_filter_wrong_row", "filter reads each kept sequence's padding from the next row",
     BatchRules(filter_shift=1)),
    ("batch_padding_visible", "the mask shows padding positions to the sequence's queries",
     BatchRules(mask_pads=False)),
    ("batch_refused_block_moves_idx", "a block shorter than the announced padding is refused after its rows moved idx",
     BatchRules(refusal_keeps=False)),
]


def prove_batch() -> ObligationResult:
    t0 = time.perf_counter()
    parts = run_parts(batch_parts())
    controls = [control_from_parts(name, text, batch_parts(rules)) for name, text, rules in CONTROLS]
    return ObligationResult(
        NUMBER, "batch layout", ("merge", "filter", "extend", "append_ragged", "announced_block", "trim_count",
                                 "visible"),
        "a batch of B keeps each sequence's offset and window through merge, filter, extend, blocks and trims; "
        "padding is never visible",
        overall(parts, controls), parts, controls, time.perf_counter() - t0)


NUMBER = 13
OBLIGATIONS: list[tuple[int, Callable[[], ObligationResult]]] = [(NUMBER, prove_batch)]
