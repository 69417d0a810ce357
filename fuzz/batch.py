"""Batch caches in lockstep with B single caches (``kvspec.spec.batch``, semantics.md 7).

A Hypothesis state machine drives a batch cache (``kvspec.impl.batch.BatchKVCache``,
or the batch ring) and, beside it, one single cache of ours per sequence
(the reference: "a batch of B behaves as B independent caches") and the
spec's layout arithmetic (``kvspec.spec.batch``). Ops, with tiny sizes (batch 1
to 3, 1 to 3 heads, K and V head dims that differ, step 1 to 8, ring
windows 2 to 8, ragged lengths so that rings wrap in some rows only) and
rows in float16, bfloat16 or float32 (a window is compared with its dtype,
so a dtype a merge, grow or extend drops is seen):

* ``merge`` (the start, and again for ``extend``): single caches of ragged
  lengths (a block, then decode steps: a ring may have wrapped) merged by ``merge`` (our ``KVCache.merge`` /
  ``RotatingKVCache.merge``, or an injected bug's);
* ``decode``: one row for every sequence;
* ``block``: a right-padded block of ragged lengths (mlx-lm's ``prepare``
  with ``right_padding``, the block, ``finalize``);
* ``filter``: keep an ordered subset of the sequences;
* ``extend``: merge fresh single caches and append them;
* ``trim`` (dense): the same count from every sequence, counts from -3
  (kvspec.spec.batch: a trim of ``n <= 0`` takes nothing) to 8 (so that a batch
  of equal offsets is trimmed back to idx 0);
* ``extract``: one sequence back as a single cache; a dense one then goes
  on in lockstep with kvspec.spec.dense at the batch's step (its step, capacity
  and regrow on a few decode rows), so a lost setting is seen;
* ``announced`` (dense): mlx-lm's announced left padding. On a batch that
  holds no positions (empty, or trimmed back to idx 0): a block shorter
  than it (refused by the spec and the batch, which must change nothing),
  then a block at least as wide; on a batch that holds positions the
  announcement itself is refused (InvalidArgumentError, nothing changed);
* ``refused`` (dense): an argument kvspec.spec.batch refuses: a filter with a
  duplicate, out-of-range or no index, an out-of-range extract; both the
  spec and the batch must raise InvalidArgumentError, and nothing may
  change (layout, offsets, every window, the masks: the full check);
* ``merge_refused``: single caches a batch cannot hold, one of them odd:
  (dense) an Int8 cache or a front-trimmed one (UnsupportedOperationError),
  rows of another dtype, head count or head dim (InvalidArgumentError);
  (ring) a ring with sinks (UnsupportedOperationError), another
  ``max_size``, dtype, head count or head dim (InvalidArgumentError).
  ``merge`` must raise that type and leave every input cache as it was;
* ``extend_refused`` (dense, on a batch with rows): a batch of another
  dtype, head count or head dim: InvalidArgumentError, nothing changed.

After every op, for every sequence: its window (bytes) equals its single
cache's, its offset equals the single's and the spec's, the layout equals
the spec's, and (dense) the decode mask shows exactly the sequence's rows,
never padding. A disagreement raises :class:`BatchDivergence` naming the op
and the sequence. :func:`catch` runs the machine against an injected bug
of ``fuzz/bugs/batch.py``.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from mlx import nn

from kvspec.impl.dense import KVCache
from kvspec.impl.rotating import RotatingKVCache
from kvspec.spec import batch as sb
from kvspec.spec import dense as sd
from kvspec.spec.errors import InvalidArgumentError, UnsupportedOperationError


class BatchDivergence(AssertionError):
    """The batch cache disagrees with its B single caches or with the spec."""


DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def _bytes(window: Any) -> list[bytes]:
    """A window's dtype and bytes, per array; no window and an empty one (0
    rows) are the same. bfloat16 (which NumPy lacks) is read through
    float32, exactly."""
    if window is None or int(window[0].shape[2]) == 0:
        return []
    return [b for a in window for b in (str(a.dtype).encode(),
                                         np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a).tobytes())]


@dataclass
class Shape:
    heads: int
    k_dim: int
    v_dim: int
    step: int
    window: int  # rings only
    dtype: str = "float16"  # the rows' dtype, a key of DTYPES


class Run:
    """One lockstep run: the batch, the single caches, the spec layout and
    the log of ops (for the failure message)."""

    def __init__(self, ring: bool, shape: Shape, single: type, seed: int):
        self.ring, self.shape, self.single = ring, shape, single
        self.rng = np.random.default_rng(seed)
        self.log: list[str] = []
        self.singles: list[Any] = []
        self.batch: Any = None
        self.layout: sb.BatchLayout | None = None

    # -- rows and singles ------------------------------------------------------
    def rows(self, b: int, n: int, dtype: str | None = None, heads: int | None = None,
             k_dim: int | None = None, v_dim: int | None = None) -> tuple[mx.array, mx.array]:
        """``[b, heads, n, dim]`` random keys and values in the run's dtype
        and shape, or the given ones (a refused merge's odd cache)."""
        s = self.shape
        h = heads or s.heads
        k = self.rng.standard_normal((b, h, n, k_dim or s.k_dim)).astype(np.float32)
        v = self.rng.standard_normal((b, h, n, v_dim or s.v_dim)).astype(np.float32)
        dt = DTYPES[dtype or s.dtype]
        return mx.array(k).astype(dt), mx.array(v).astype(dt)

    def fresh(self, length: int) -> Any:
        """A single cache of ``length`` rows: a prompt block of a random part
        of them, then decode steps, so that a ring longer than its window
        has wrapped (physical order is not chronological) before a merge
        reads it, as after a conversation's turns."""
        s = self.shape
        c = (self.single(max_size=s.window, step=s.step) if self.ring else self.single("fp16", step=s.step))
        block = int(self.rng.integers(0, length + 1)) if length else 0
        if block:
            c.update_and_fetch(*self.rows(1, block))
        for _ in range(length - block):
            c.update_and_fetch(*self.rows(1, 1))
        return c

    def merged(self, lengths: tuple[int, ...]) -> tuple[list[Any], Any]:
        """Single caches of ``lengths`` rows and their merge; merge reads
        them (new buffers), so they go on as the references."""
        singles = [self.fresh(n) for n in lengths]
        return singles, type(singles[0]).merge(singles)

    # -- ops -----------------------------------------------------------------------
    def start(self, lengths: tuple[int, ...]) -> None:
        self.log.append(f"merge {list(lengths)}")
        self.singles, self.batch = self.merged(lengths)
        self.layout = sb.merge(tuple(min(n, self.shape.window) if self.ring else n for n in lengths))
        self.check("merge")

    def decode(self) -> None:
        self.log.append("decode")
        k, v = self.rows(len(self.singles), 1)
        self.batch.update_and_fetch(k, v)
        for i, c in enumerate(self.singles):
            c.update_and_fetch(k[i : i + 1], v[i : i + 1])
        assert self.layout is not None
        self.layout = sb.append(self.layout, 1)
        self.check("decode")

    def block(self, lengths: tuple[int, ...]) -> None:
        self.log.append(f"block {list(lengths)}")
        width = max(lengths)
        k, v = self.rows(len(self.singles), width)
        pads = [width - n for n in lengths]
        self.batch.prepare(lengths=list(lengths), right_padding=pads)
        self.batch.update_and_fetch(k, v)
        self.batch.finalize()
        for i, (c, n) in enumerate(zip(self.singles, lengths)):
            c.update_and_fetch(k[i : i + 1, :, :n], v[i : i + 1, :, :n])
        assert self.layout is not None
        self.layout = sb.append_ragged(self.layout, lengths)
        self.check("block")

    def announced(self, arg: tuple[tuple[int, ...], int, int]) -> None:
        """mlx-lm's announced left padding on an empty batch
        (``prepare(left_padding=...)``), a block shorter than the padding
        (refused by both kvspec.spec.batch.announced_block and the batch, which
        must change nothing: still empty, the announced layout), then a
        block as wide as the padding or wider; sequence ``i`` keeps the
        block's rows after its padding."""
        left, short, width = arg
        assert self.layout is not None
        if self.layout.idx != 0:  # the batch holds positions: the announcement itself is refused
            self.log.append(f"announced {list(left)} (refused: idx {self.layout.idx})")
            self.expect_refusal("announced", lambda: self.batch.prepare(left_padding=list(left)),
                                InvalidArgumentError, "kvspec.spec.batch.announced_block")
            self.check("announced")
            return
        self.log.append(f"announced {list(left)}: block {short} (refused), block {width}")
        was_empty = self.batch.empty()
        try:
            sb.announced_block(self.layout, left, short)
        except InvalidArgumentError:
            pass
        else:  # the draw is meant to be refused: a draw bug, not an impl one
            raise AssertionError(f"kvspec.spec.batch accepts a block of {short} under padding {left}: not a refused draw")
        pads = tuple(p + q for p, q in zip(self.layout.pads, left))
        b = len(self.singles)
        self.batch.prepare(left_padding=list(left))
        try:
            self.batch.update_and_fetch(*self.rows(b, short))
        except InvalidArgumentError:
            pass
        except Exception as exc:  # noqa: BLE001 - the wrong refusal is the divergence
            self.fail("announced", f"a block of {short} under padding {list(pads)} raised {type(exc).__name__}: "
                                   f"{exc}; kvspec.spec.batch.announced_block raises InvalidArgumentError")
        else:
            self.fail("announced", f"a block of {short} under padding {list(pads)} accepted; "
                                   "kvspec.spec.batch.announced_block refuses it")
        got = self.batch.layout
        if self.batch.empty() != was_empty or (got.idx, tuple(got.pads)) != (0, pads):
            self.fail("announced", f"the refused block changed the batch: empty={self.batch.empty()} (was "
                                   f"{was_empty}), layout idx={got.idx} pads={tuple(got.pads)}; nothing may "
                                   f"change (idx=0 pads={pads})")
        k, v = self.rows(b, width)
        self.batch.update_and_fetch(k, v)
        for i, (c, p) in enumerate(zip(self.singles, pads)):
            if width > p:
                c.update_and_fetch(k[i : i + 1, :, p:], v[i : i + 1, :, p:])
        self.layout = sb.announced_block(self.layout, left, width)
        self.check("announced")

    def filter(self, keep: tuple[int, ...]) -> None:
        self.log.append(f"filter {list(keep)}")
        self.batch.filter(list(keep))
        self.singles = [self.singles[k] for k in keep]
        assert self.layout is not None
        self.layout = sb.filter(self.layout, keep)
        self.check("filter")

    def extend(self, lengths: tuple[int, ...]) -> None:
        self.log.append(f"extend {list(lengths)}")
        refs, other = self.merged(lengths)
        self.batch.extend(other)
        self.singles += refs
        assert self.layout is not None
        self.layout = sb.extend(self.layout, sb.merge(lengths))
        self.check("extend")

    def trim(self, n: int) -> None:
        self.log.append(f"trim {n}")
        assert self.layout is not None
        want, self.layout = sb.trim(self.layout, n)
        got = self.batch.trim(n)
        if got != want:
            self.fail("trim", f"trimmed {got}, spec says {want}")
        for c in self.singles:
            c.trim(want)
        self.check("trim")

    def extract(self, i: int) -> None:
        self.log.append(f"extract {i}")
        one = self.batch.extract(i)
        if type(one) is not (RotatingKVCache if self.ring else KVCache):
            self.fail("extract", f"sequence {i} came back as a {type(one).__name__}")
        ref = self.singles[i]
        got, want = self.window(one), self.window(ref)
        if (one.offset, got) != (ref.offset, want):
            self.fail("extract", f"sequence {i}: offset {one.offset}, window {len(got)} arrays; "
                                 f"single cache offset {ref.offset}, window differs: {got != want}")
        if not self.ring:
            self.extracted_lockstep(i, one)

    def extracted_lockstep(self, i: int, one: KVCache) -> None:
        """The extracted cache against kvspec.spec.dense: a fresh Fp16 cache of the
        batch's step that took the sequence's rows in one block, then three
        decode rows; step, offset and capacity must agree after each."""
        step = self.shape.step
        if one.step != step:
            self.fail("extract", f"sequence {i}: extracted cache has step {one.step}, the batch's is {step}")
        ref = sd.new_cache("fp16", step=step)
        if one.offset:
            _, ref = sd.append(ref, tuple(range(one.offset)))
        for j in range(4):
            if (one.offset, one.capacity) != (ref.offset, ref.capacity):
                self.fail("extract", f"sequence {i} after {j} decode rows: offset {one.offset} capacity "
                                     f"{one.capacity}, kvspec.spec.dense at step {step}: offset {ref.offset} "
                                     f"capacity {ref.capacity}")
            one.update_and_fetch(*self.rows(1, 1))
            _, ref = sd.append(ref, (ref.offset,))

    def refused(self, arg: tuple[str, Any]) -> None:
        """An argument kvspec.spec.batch refuses: InvalidArgumentError from both,
        and nothing changed (the full check against the singles and the
        unchanged layout)."""
        op, value = arg
        self.log.append(f"{op} {value!r} (refused)")
        assert self.layout is not None
        spec_call = {"filter": lambda: sb.filter(self.layout, value), "extract": lambda: sb.extract(self.layout, value)}
        try:
            spec_call[op]()
        except InvalidArgumentError:
            pass
        else:  # the draw is meant to be refused: a draw bug, not an impl one
            raise AssertionError(f"kvspec.spec.batch accepts {op} {value!r}: not a refused draw")
        try:
            getattr(self.batch, op)(list(value) if op == "filter" else value)
        except InvalidArgumentError:
            pass
        except Exception as exc:  # noqa: BLE001 - the wrong refusal is the divergence
            self.fail(op, f"{value!r} raised {type(exc).__name__}: {exc}; kvspec.spec.batch raises InvalidArgumentError")
        else:
            self.fail(op, f"{value!r} accepted; kvspec.spec.batch raises InvalidArgumentError")
        self.check(op)

    def expect_refusal(self, op: str, call: Any, want: type, rule: str) -> None:
        """``call()`` must raise ``want`` (the rule ``rule`` refuses it)."""
        try:
            call()
        except want:
            return
        except Exception as exc:  # noqa: BLE001 - the wrong refusal is the divergence
            self.fail(op, f"raised {type(exc).__name__}: {exc}; {rule} raises {want.__name__}")
        self.fail(op, f"accepted; {rule} refuses it with {want.__name__}")

    def odd_cache(self, odd: str, length: int) -> tuple[Any, type]:
        """A single cache of ``length`` rows that a batch of this run cannot
        hold, and the error merge must raise for it."""
        s = self.shape
        other = {"dtype": "bfloat16" if s.dtype != "bfloat16" else "float32", "heads": s.heads % 3 + 1,
                 "k_dim": 6 - s.k_dim, "v_dim": s.v_dim % 6 + 2}
        if self.ring:
            c = self.single(max_size=s.window + (1 if odd == "max_size" else 0), keep=1 if odd == "sinks" else 0,
                            step=s.step)
        else:
            c = self.single("int8" if odd == "int8" else "fp16", step=s.step)
        rows = self.rows(1, length + (1 if odd == "front_trim" else 0), **(
            {odd: other[odd]} if odd in other else {}))
        c.update_and_fetch(*rows)
        if odd == "front_trim":
            c.trim_front_keep_sink(1, keep=0)
        return c, (UnsupportedOperationError if odd in ("int8", "front_trim", "sinks") else InvalidArgumentError)

    def merge_refused(self, arg: tuple[str, tuple[int, ...], int]) -> None:
        """``merge`` of single caches of ``lengths`` rows (at least one each)
        with an odd one at ``at``: refused with the odd one's error, every
        input cache unchanged (window and offset)."""
        odd, lengths, at = arg
        self.log.append(f"merge {list(lengths)} with a cache of another {odd} at {at} (refused)")
        caches = [self.fresh(n) for n in lengths]
        bad, want = self.odd_cache(odd, 1 + int(self.rng.integers(0, 4)))
        caches.insert(min(at, len(caches)), bad)
        before = [(c.offset, self.window(c)) for c in caches]
        self.expect_refusal("merge_refused", lambda: type(caches[0]).merge(caches), want,
                            "merge (semantics.md 7: a batch holds one dtype and shape of Fp16 rows, no sinks)")
        for j, (c, b) in enumerate(zip(caches, before)):
            if (c.offset, self.window(c)) != b:
                self.fail("merge_refused", f"input cache {j} changed by the refused merge (offset {b[0]} -> "
                                           f"{c.offset}, window same: {self.window(c) == b[1]})")
        self.check("merge_refused")

    def extend_refused(self, arg: tuple[str, tuple[int, ...]]) -> None:
        """``extend`` with a batch of another dtype, head count or head dim
        (the batch holding rows): InvalidArgumentError, nothing changed."""
        odd, lengths = arg
        if self.batch.empty():
            return  # no rows to disagree with: not a refusal
        self.log.append(f"extend {list(lengths)} of another {odd} (refused)")
        other = type(self.singles[0]).merge([self.odd_cache(odd, n)[0] for n in lengths])
        self.expect_refusal("extend_refused", lambda: self.batch.extend(other), InvalidArgumentError,
                            "extend (a batch holds one dtype and shape)")
        self.check("extend_refused")

    # -- checks ----------------------------------------------------------------------
    def window(self, c: Any) -> list[bytes]:
        """A single cache's window in chronological order (a ring's through
        its chronological read: the batch ring keeps another physical order)."""
        w = c._chronological() if self.ring else c.fetch()
        if self.ring and w is not None:
            n = c.size()
            w = (w[0][..., -n:, :], w[1][..., -n:, :])
        return _bytes(w)

    def fail(self, op: str, what: str) -> None:
        raise BatchDivergence(f"op {len(self.log) - 1} {op}: {what}\n  ops: {'; '.join(self.log)}")

    def check(self, op: str) -> None:
        offsets = [int(x) for x in np.array(self.batch.offset).tolist()]
        want = [c.offset for c in self.singles]
        if offsets != want:
            self.fail(op, f"offsets {offsets}, single caches {want}")
        if self.ring:
            for i in range(len(self.singles)):
                self.extract_silently(op, i)
            return
        assert self.layout is not None
        got = self.batch.layout  # impl's own record (kvspec.impl.batch.BatchLayout): compared field by field
        if (got.idx, tuple(got.pads)) != (self.layout.idx, self.layout.pads):
            self.fail(op, f"layout idx={got.idx} pads={tuple(got.pads)}, spec says idx={self.layout.idx} "
                          f"pads={self.layout.pads}")
        if list(sb.offsets(self.layout)) != want:
            self.fail(op, f"spec offsets {sb.offsets(self.layout)}, single caches {want}")
        for i, c in enumerate(self.singles):
            if _bytes(self.batch.fetch_sequence(i)) != _bytes(c.fetch()):
                self.fail(op, f"sequence {i}: window differs from its single cache's (offset {c.offset})")
        idx = self.layout.idx
        for n, window in ((1, None), (3, None), (1, 2), (3, 2)):  # a decode step, a block; with a window
            mask = np.array(self.batch.make_mask(n, return_array=True, window_size=window))
            for i in range(len(self.singles)):
                for q in range(n):
                    seen = [j for j in range(idx + n) if mask[i, 0, q, j]]
                    rule = [j for j in range(idx + n) if sb.visible(self.layout, i, idx + q, j, window)]
                    if seen != rule:
                        self.fail(op, f"sequence {i}: query {q} of {n} (window {window}) sees positions {seen}, "
                                      f"kvspec.spec.batch.visible says {rule} (padding {self.layout.pads[i]})")

    def extract_silently(self, op: str, i: int) -> None:
        one = self.batch.extract(i)
        if (one.offset, self.window(one)) != (self.singles[i].offset, self.window(self.singles[i])):
            self.fail(op, f"sequence {i}: extracted window or offset {one.offset} differs from its single cache's "
                          f"({self.singles[i].offset})")


LENGTHS = st.lists(st.integers(0, 6), min_size=1, max_size=3).map(tuple)


def refused_args(b: int) -> st.SearchStrategy[tuple[str, Any]]:
    """A filter or extract argument kvspec.spec.batch refuses for a batch of
    ``b``: a duplicate index, an index out of [0, b) (below or at/above),
    no index at all; an extract index out of range."""
    out_of_range = st.one_of(st.integers(-3, -1), st.integers(b, b + 2))
    duplicate = st.lists(st.integers(0, b - 1), min_size=1, max_size=b).flatmap(
        lambda keep: st.permutations(keep + [keep[0]]))
    outside = st.tuples(st.lists(st.integers(0, b - 1), max_size=b - 1, unique=True), out_of_range).flatmap(
        lambda t: st.permutations(t[0] + [t[1]]))
    return st.one_of(
        st.tuples(st.just("filter"), st.one_of(duplicate, outside, st.just([])).map(tuple)),
        st.tuples(st.just("extract"), out_of_range))


@st.composite
def programs(draw: Any, ring: bool) -> tuple[Shape, tuple[int, ...], list[tuple[str, Any]]]:
    shape = Shape(draw(st.integers(1, 3)), draw(st.sampled_from([2, 4])), draw(st.sampled_from([2, 4, 6])),
                  draw(st.integers(1, 8)), draw(st.integers(2, 8)),
                  draw(st.sampled_from(["float16", "float16", "bfloat16", "float32"])))
    # dense: a quarter of the programs start empty (every length 0), and
    # half of those with announced padding and a refused block
    start = draw(LENGTHS.filter(lambda ls: max(ls) > 0) if ring else
                 st.one_of(LENGTHS, LENGTHS, LENGTHS, LENGTHS.map(lambda ls: (0,) * len(ls))))
    ops: list[tuple[str, Any]] = []
    b = len(start)
    if not ring and max(start) == 0 and draw(st.booleans()):
        left = tuple(draw(st.integers(0, 3)) for _ in range(b))
        if max(left) > 0:
            short = draw(st.integers(0, max(left) - 1))
            ops.append(("announced", (left, short, draw(st.integers(max(left), max(left) + 3)))))
    names = ["decode", "block", "filter", "extend", "extract", "merge_refused"] + (
        [] if ring else ["trim", "trim", "refused", "announced", "extend_refused"])
    for _ in range(draw(st.integers(1, 10))):
        op = draw(st.sampled_from(names))
        if op == "block":
            ops.append((op, tuple(draw(st.integers(1, 4)) for _ in range(b))))
        elif op == "filter":
            keep = draw(st.lists(st.integers(0, b - 1), min_size=1, max_size=b, unique=True))
            ops.append((op, tuple(sorted(keep) if ring else keep)))
            b = len(keep)
        elif op == "extend" and b < 3:
            more = draw(st.lists(st.integers(1 if ring else 0, 6), min_size=1, max_size=3 - b).map(tuple))
            ops.append((op, more))
            b += len(more)
        elif op == "extract":
            ops.append((op, draw(st.integers(0, b - 1))))
        elif op == "trim":
            ops.append((op, draw(st.integers(-3, 8))))
        elif op == "announced":
            left = tuple(draw(st.integers(0, 3)) for _ in range(b))
            short = draw(st.integers(0, max(left) - 1)) if max(left) > 0 else None
            if short is not None:
                ops.append((op, (left, short, draw(st.integers(max(left), max(left) + 3)))))
        elif op == "merge_refused":
            odd = draw(st.sampled_from(["sinks", "max_size", "dtype", "heads", "v_dim"] if ring else
                                       ["int8", "front_trim", "dtype", "heads", "k_dim", "v_dim"]))
            ops.append((op, (odd, draw(LENGTHS.map(lambda ls: tuple(n + 1 for n in ls))), draw(st.integers(0, 3)))))
        elif op == "extend_refused":
            ops.append((op, (draw(st.sampled_from(["dtype", "heads", "k_dim", "v_dim"])),
                             draw(st.lists(st.integers(1, 4), min_size=1, max_size=2).map(tuple)))))
        elif op == "refused":
            ops.append((op, draw(refused_args(b))))
        elif op == "decode":
            ops.append((op, None))
    return shape, start, ops


def run_program(program: tuple[Shape, tuple[int, ...], list[tuple[str, Any]]], ring: bool,
                single: type | None = None, seed: int = 0, log: list[str] | None = None) -> None:
    """Run one program in lockstep; ``log`` (when given) receives the ops run
    so far, for a failure message. Raises :class:`BatchDivergence` on a
    disagreement, or whatever the batch cache or the harness raised."""
    shape, start, ops = program
    run = Run(ring, shape, single or (RotatingKVCache if ring else KVCache), seed)
    if log is not None:
        run.log = log
    run.start(start)
    for name, arg in ops:
        getattr(run, name)(*(() if arg is None else (arg,)))


class BatchHarnessFailure(Exception):
    """The harness's own code (``fuzz/`` outside ``fuzz/bugs/``, or
    ``spec/``) raised while running a batch program: a tool failure (exit
    2), never a divergence. ``__cause__`` is the exception."""


def _classify(exc: Exception, log: list[str]) -> Exception:
    """Whose failure ``exc`` (not a BatchDivergence) is: raised in the
    harness's own code (kvspec.fuzz.failures.harness_dirs with impl as the target:
    ``fuzz/`` less ``fuzz/bugs/``, and ``spec/``), a
    :class:`BatchHarnessFailure`; else (raised in ``impl/``, an injected
    bug's class, or MLX called from them) the batch cache crashed on an op
    the single caches and the spec ran: a :class:`BatchDivergence`."""
    from kvspec.fuzz.failures import _is_harness, raised_in

    where = raised_in(exc)
    ops = "; ".join(log)
    if _is_harness(where, impl_is_target=True):
        return BatchHarnessFailure(f"op {len(log) - 1}: the harness raised {type(exc).__name__}: {exc} (in {where}; "
                                   f"a tool failure, not a divergence)\n  ops: {ops}")
    return BatchDivergence(f"op {len(log) - 1}: the batch cache raised {type(exc).__name__}: {exc} (in {where}); "
                           f"the single caches and kvspec.spec.batch ran it\n  ops: {ops}")


@dataclass
class CampaignResult:
    """``status``: ``ok`` (every program agreed), ``diverged`` (the batch
    cache disagreed with its single caches or the spec, or crashed where
    they did not: ``failure`` names the op and lists the program's ops) or
    ``tool failure`` (the harness itself raised: no verdict). ``examples``
    programs, ``steps`` ops run in all, ``seconds`` of wall time (reported,
    never part of a verdict)."""

    ok: bool
    examples: int
    seconds: float
    failure: str = ""
    status: str = "ok"
    steps: int = 0

    @property
    def caught(self) -> bool:
        """A divergence was found (a tool failure is not a catch)."""
        return self.status == "diverged"


def campaign(ring: bool, single: type | None = None, max_examples: int = 150, seed: int = 0,
             shrink: bool = True, search_seed: int | None = None) -> CampaignResult:
    """Run ``max_examples`` programs (Hypothesis, shrinking a failure);
    ``single`` is the single-cache class whose ``merge`` builds the batch
    (an injected bug's); ``shrink=False`` stops at the first failure
    unshrunk. ``search_seed`` None draws the same programs on every call
    (derandomized); an int draws other programs, reproducibly for that
    seed. A failure is told apart by where it was raised (:func:`_classify`):
    ``status`` ``diverged`` or ``tool failure``."""
    return _campaign(programs(ring), lambda p, s, log: run_program(p, ring, single, s, log), max_examples, seed,
                     shrink, search_seed)


def _campaign(programs_of: Any, runner: Any, max_examples: int, seed: int, shrink: bool,
              search_seed: int | None) -> CampaignResult:
    """Run ``runner(program, row_seed, log)`` on ``max_examples`` programs
    drawn from ``programs_of`` (see :func:`campaign`)."""
    import hypothesis

    count, steps = [0], [0]
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])
    start = time.perf_counter()

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=search_seed is None,
              phases=phases, suppress_health_check=list(HealthCheck), print_blob=False, report_multiple_bugs=False)
    @given(programs_of, st.integers(0, 2**16))
    def prop(program: Any, data_seed: int) -> None:
        count[0] += 1
        log: list[str] = []
        where = f"\n  program: {program[0]}, row seed {seed + data_seed}"
        try:
            runner(program, seed + data_seed, log)
        except BatchDivergence as exc:
            raise BatchDivergence(f"{exc}{where}") from exc
        except Exception as exc:  # told apart: the target's crash or the harness's
            told = _classify(exc, log)
            raise type(told)(f"{told}{where}") from exc
        finally:
            steps[0] += len(log)

    if search_seed is not None:
        prop = hypothesis.seed(search_seed)(prop)
    failure, status = "", "ok"
    try:
        prop()
    except BatchDivergence as exc:
        failure, status = str(exc), "diverged"
    except BatchHarnessFailure as exc:
        failure, status = str(exc), "tool failure"
    except Exception as exc:  # noqa: BLE001 - raised outside a program (Hypothesis, the draw): the tool's
        failure, status = f"the harness raised {type(exc).__name__}: {exc} (a tool failure)", "tool failure"
    return CampaignResult(status == "ok", count[0], time.perf_counter() - start, failure, status, steps[0])


def catch(bug: Any, max_examples: int = 150, shrink: bool = True, search_seed: int | None = None) -> CampaignResult:
    """Run the campaign of ``bug``'s kind (``"batch"`` dense, ``"batch_ring"``
    or ``"batch_recurrent"``) with its factories; ``caught`` True means caught
    (``ok`` False with ``status`` ``tool failure`` is no catch)."""
    if "recurrent" in bug.factories:
        return recurrent_campaign(bug.factories["recurrent"], max_examples, shrink=shrink, search_seed=search_seed)
    ring = "rotating" in bug.factories
    return campaign(ring, bug.factories["rotating" if ring else "dense"], max_examples, shrink=shrink,
                    search_seed=search_seed)




# -- the recurrent kind: a batch RecurrentCache beside B single ones ------------------------
#
# The batch RecurrentCache (kvspec.impl.recurrent, a drop-in for mlx-lm's ArraysCache) in
# lockstep with one single RecurrentCache per sequence: the singles run the
# recurrent harness's layer (kvspec.fuzz.recurrent.FakeMixer, through the step
# recorder), the batch runs the same recurrence as mlx-lm's batched mixers
# run it (:class:`BatchMixer`). After every op, every sequence's conv window
# and recurrent state (dtype and bytes) equal its single cache's.


class BatchMixer(nn.Module):
    """The harness's recurrent layer (``kvspec.fuzz.recurrent.FakeMixer``'s exact
    recurrence: the conv window is the last ``kernel - 1`` input rows, the
    state per batch element ``(t, h1, h2)``) as mlx-lm's batched mixers
    (qwen3_next's GatedDeltaNet, lfm2's ShortConv) run it: ``mask`` (B, S)
    from ``cache.make_mask(S)`` zeroes padded positions' inputs, and a padded
    position leaves the state as it was (gated_delta_update's mask); with
    ``cache.lengths`` set (a right-padded block) the conv window ends at the
    sequence's length (``clip(lengths, 0, S)``), else at the block's end.
    A cache whose arrays or mask do not fit the call's batch raises
    :class:`BatchDivergence` (the cache's fault, not the harness's)."""

    def __init__(self, kernel: int, size: int):
        super().__init__()
        self.conv_kernel_size = kernel
        self.size = size

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        from kvspec.fuzz.recurrent import HASHES, STATE_WIDTH

        B, S, C = x.shape
        k = self.conv_kernel_size - 1
        for e, a in enumerate(cache.cache):
            if a is not None and a.shape[0] != B:
                raise BatchDivergence(f"the batch cache's array {e} has batch axis {a.shape[0]} for a call of "
                                      f"batch {B} (shape {tuple(a.shape)})")
        if mask is not None:
            if tuple(mask.shape) != (B, S):
                raise BatchDivergence(f"the batch cache's make_mask({S}) has shape {tuple(mask.shape)}, the call is "
                                      f"batch {B} of {S} tokens (left_padding or lengths of another batch)")
            x = mx.where(mask[..., None], x, mx.zeros_like(x))
        conv = cache[0] if cache[0] is not None else mx.zeros((B, k, C), dtype=x.dtype)
        conv_input = mx.concatenate([conv, x], axis=1)
        if cache.lengths is not None:
            ends = mx.clip(cache.lengths, 0, S)
            positions = (ends[:, None] + mx.arange(k))[..., None]
            cache[0] = mx.take_along_axis(conv_input, positions, axis=1)
        else:
            cache[0] = conv_input[:, -k:, :]
        if self.size == 2:
            words = x.view(mx.uint16).astype(mx.int32).sum(axis=-1)
            state = cache[1] if cache[1] is not None else mx.zeros((B, STATE_WIDTH), dtype=mx.float32)
            cols = [state[:, j].astype(mx.int32) for j in range(STATE_WIDTH)]
            for s in range(S):
                v = words[:, s]
                new = [cols[0] + 1] + [mx.remainder(cols[j] * mul + v, mod)
                                       for j, (mul, mod) in enumerate(HASHES, start=1)]
                cols = new if mask is None else [mx.where(mask[:, s], n, o) for n, o in zip(new, cols)]
            cache[1] = mx.stack(cols, axis=1).astype(mx.float32)
        cache.advance(S)
        return x


class _Block(nn.Module):
    def __init__(self, mixer: nn.Module):
        super().__init__()
        self.mixer = mixer


class BatchModel(nn.Module):
    """One recurrent layer of a batched hybrid model: the ssm mask is
    ``cache.make_mask(S)`` (mlx-lm's ``create_ssm_mask``)."""

    def __init__(self, kernel: int, size: int):
        super().__init__()
        self.layers = [_Block(BatchMixer(kernel, size))]

    def __call__(self, x: mx.array, cache: Any) -> mx.array:
        mask = cache.make_mask(x.shape[1]) if (cache.left_padding is not None or cache.lengths is not None) else None
        return self.layers[0].mixer(x, mask, cache)


@dataclass
class RecurrentShape:
    kernel: int  # conv width >= 2: the conv window holds kernel - 1 rows
    channels: int
    size: int  # 2 (conv window, recurrent state) or 1 (lfm2: conv window only)
    depth: int  # the singles' depth U
    dtype: str = "float16"


class RecurrentRun:
    """One recurrent lockstep run: the batch RecurrentCache, one single
    RecurrentCache per sequence, the tokens each sequence consumed (for the
    failure message) and the log of ops."""

    def __init__(self, shape: RecurrentShape, single: type, seed: int):
        from kvspec.fuzz.recurrent import FakeModel
        from kvspec.impl.recurrent import record_steps

        self.shape, self.single = shape, single
        self.rng = np.random.default_rng(seed)
        self.log: list[str] = []
        self.singles: list[Any] = []
        self.consumed: list[int] = []
        self.batch: Any = None
        self.one_model = FakeModel(shape.kernel, shape.size)
        self.batch_model = BatchModel(shape.kernel, shape.size)
        record_steps(self.one_model)
        record_steps(self.batch_model)

    # -- inputs and singles ----------------------------------------------------------
    def rows(self, b: int, n: int, dtype: str | None = None, channels: int | None = None) -> mx.array:
        """``(b, n, C)`` random inputs in the run's dtype (no all-zero row)."""
        x = self.rng.standard_normal((b, n, channels or self.shape.channels)).astype(np.float32) + 0.25
        return mx.array(x).astype(DTYPES[dtype or self.shape.dtype])

    def feed(self, c: Any, x: mx.array) -> None:
        """``x`` (1, n, C) into single cache ``c`` through the recorded layer
        (a block of a random part, then single tokens)."""
        n = int(x.shape[1])
        if n:
            cut = int(self.rng.integers(1, n + 1))
            self.one_model(x[:, :cut], None, c)
            for j in range(cut, n):
                self.one_model(x[:, j : j + 1], None, c)

    def fresh(self, length: int, kernel: int | None = None, dtype: str | None = None, size: int | None = None,
              channels: int | None = None) -> Any:
        s = self.shape
        c = self.single(size=size or s.size, depth=s.depth)
        if length:
            if (kernel or s.kernel, size or s.size) == (s.kernel, s.size):
                self.feed(c, self.rows(1, length, dtype, channels))
            else:  # an odd layer: its own model
                from kvspec.fuzz.recurrent import FakeModel

                FakeModel(kernel or s.kernel, size or s.size)(self.rows(1, length, dtype, channels), None, c)
        return c

    def merged(self, lengths: tuple[int, ...]) -> tuple[list[Any], Any]:
        singles = [self.fresh(n) for n in lengths]
        return singles, type(singles[0]).merge(singles)

    # -- ops -----------------------------------------------------------------------------
    def start(self, lengths: tuple[int, ...]) -> None:
        self.log.append(f"merge {list(lengths)}")
        self.singles, self.batch = self.merged(lengths)
        self.consumed = list(lengths)
        self.check("merge")

    def padded(self, arg: tuple[tuple[int, ...], int]) -> None:
        """A batch built empty with left padding (``RecurrentCache(size,
        left_padding=...)``, as a left-padded prompt batch), then one block
        of ``width >= max(left)``: sequence ``i`` consumes the block's rows
        after its padding."""
        left, width = arg
        self.log.append(f"left padding {list(left)}: block {width}")
        b = len(left)
        self.singles = [self.single(size=self.shape.size, depth=self.shape.depth) for _ in left]
        self.consumed = [0] * b
        self.batch = self.single(size=self.shape.size, left_padding=list(left))
        x = self.rows(b, width)
        self.batch_model(x, self.batch)
        for i, (c, p) in enumerate(zip(self.singles, left)):
            self.feed(c, x[i : i + 1, p:])
            self.consumed[i] += width - p
        self.check("padded")

    def decode(self) -> None:
        self.log.append("decode")
        x = self.rows(len(self.singles), 1)
        self.batch_model(x, self.batch)
        for i, c in enumerate(self.singles):
            self.one_model(x[i : i + 1], None, c)
            self.consumed[i] += 1
        self.check("decode")

    def block(self, arg: tuple[tuple[int, ...], int]) -> None:
        """A right-padded block of ragged ``lengths`` as BatchGenerator
        runs it: ``prepare(lengths=..., right_padding=...)``, the block in
        chunks of ``chunk`` tokens (its prefill step: ``advance`` lowers
        ``lengths`` between chunks), ``finalize``."""
        lengths, chunk = arg
        self.log.append(f"block {list(lengths)} in chunks of {chunk}")
        width = max(lengths)
        x = self.rows(len(self.singles), width)
        self.batch.prepare(lengths=list(lengths), right_padding=[width - n for n in lengths])
        for j in range(0, width, chunk):
            self.batch_model(x[:, j : j + chunk], self.batch)
        self.batch.finalize()
        for i, (c, n) in enumerate(zip(self.singles, lengths)):
            self.feed(c, x[i : i + 1, :n])
            self.consumed[i] += n
        self.check("block")

    def filter(self, keep: tuple[int, ...]) -> None:
        self.log.append(f"filter {list(keep)}")
        self.batch.filter(list(keep))
        self.singles = [self.singles[k] for k in keep]
        self.consumed = [self.consumed[k] for k in keep]
        self.check("filter")

    def extend(self, lengths: tuple[int, ...]) -> None:
        self.log.append(f"extend {list(lengths)}")
        refs, other = self.merged(lengths)
        self.batch.extend(other)
        self.singles += refs
        self.consumed += list(lengths)
        self.check("extend")

    def extract(self, i: int) -> None:
        """Sequence ``i`` back as a single cache, equal to its single; then
        both take three decode tokens through the recorded layer (the
        extracted cache must be a RecurrentCache of the batch's kind, on its
        own: the batch, checked again, must not see those writes)."""
        self.log.append(f"extract {i}")
        one = self.batch.extract(i)
        if not isinstance(one, self.single):
            self.fail("extract", f"sequence {i} came back as a {type(one).__name__}")
        ref = copy.copy(self.singles[i])
        self.compare("extract", f"sequence {i} extracted", one, 0, ref)
        for j in range(3):
            x = self.rows(1, 1)
            self.one_model(x, None, one)
            self.one_model(x, None, ref)
            self.compare("extract", f"sequence {i} extracted, after {j + 1} decode tokens", one, 0, ref)
        self.check("extract")

    def refused(self, arg: tuple[str, Any]) -> None:
        """An argument kvspec.spec.batch refuses: InvalidArgumentError, nothing changed."""
        op, value = arg
        self.log.append(f"{op} {value!r} (refused)")
        before = self.held()
        self.expect_refusal(op, lambda: getattr(self.batch, op)(list(value) if op == "filter" else value))
        if self.held() != before:
            self.fail(op, f"the refused {op} changed the batch (arrays, left_padding or lengths)")
        self.check(op)

    def odd_cache(self, odd: str, length: int) -> Any:
        s = self.shape
        if odd == "kernel":
            return self.fresh(length, kernel=s.kernel + 1)
        if odd == "channels":
            return self.fresh(length, channels=s.channels + 1)
        if odd == "size":
            return self.fresh(length, size=3 - s.size)
        return self.fresh(length, dtype="float32" if s.dtype != "float32" else "bfloat16")

    def merge_refused(self, arg: tuple[str, tuple[int, ...], int]) -> None:
        """``merge`` of single caches (one token or more each) with an odd
        one (another kernel, channels, size or dtype) at ``at``:
        InvalidArgumentError, every input unchanged."""
        odd, lengths, at = arg
        self.log.append(f"merge {list(lengths)} with a cache of another {odd} at {at} (refused)")
        caches = [self.fresh(n) for n in lengths]
        caches.insert(min(at, len(caches)), self.odd_cache(odd, 1 + int(self.rng.integers(0, 3))))
        before = [(list(c.cache), c.left_padding, c.lengths) for c in caches]
        self.expect_refusal("merge_refused", lambda: type(caches[0]).merge(caches))
        for j, (c, (arrays, lp, ln)) in enumerate(zip(caches, before)):
            if any(a is not b for a, b in zip(c.cache, arrays)) or c.left_padding is not lp or c.lengths is not ln:
                self.fail("merge_refused", f"input cache {j} changed by the refused merge")
        self.check("merge_refused")

    def extend_refused(self, arg: tuple[str, tuple[int, ...]]) -> None:
        """``extend`` with a batch of another kernel, channels, size or dtype
        (both holding arrays): InvalidArgumentError, nothing changed."""
        odd, lengths = arg
        if self.batch.empty() and odd != "size":
            return  # nothing to disagree with: not a refusal
        self.log.append(f"extend {list(lengths)} of another {odd} (refused)")
        other = type(self.singles[0]).merge([self.odd_cache(odd, n) for n in lengths])
        before = self.held()
        self.expect_refusal("extend_refused", lambda: self.batch.extend(other))
        if self.held() != before:
            self.fail("extend_refused", "the refused extend changed the batch (arrays, left_padding or lengths)")
        self.check("extend_refused")

    # -- checks --------------------------------------------------------------------------
    def held(self) -> tuple[Any, ...]:
        """What the batch holds, by identity (MLX arrays are replaced, never
        written, by every op but an in-place slice write), and by bytes."""
        b = self.batch
        return (tuple(id(a) for a in b.cache), tuple(_bytes_of(a) for a in b.cache), _bytes_of(b.left_padding),
                _bytes_of(b.lengths))

    def expect_refusal(self, op: str, call: Any) -> None:
        try:
            call()
        except InvalidArgumentError:
            return
        except Exception as exc:  # noqa: BLE001 - the wrong refusal is the divergence
            self.fail(op, f"raised {type(exc).__name__}: {exc}; kvspec.spec.batch refuses it with InvalidArgumentError")
        self.fail(op, "accepted; kvspec.spec.batch refuses it (InvalidArgumentError, nothing changed)")

    def fail(self, op: str, what: str) -> None:
        raise BatchDivergence(f"op {len(self.log) - 1} {op}: {what}\n  ops: {'; '.join(self.log)}")

    def compare(self, op: str, who: str, batch: Any, i: int, single: Any) -> None:
        """Row ``i`` of ``batch``'s arrays against ``single``'s (batch 1):
        dtype and bytes; an array None on one side must be all zero (the
        layer's initial value) on the other."""
        names = ("conv window", "recurrent state")
        for e, (a, s) in enumerate(zip(batch.cache, single.cache)):
            got = None if a is None else a[i : i + 1]
            if got is None and s is None:
                continue
            if got is None or s is None:
                held = s if got is None else got
                if np.any(np.array(held.astype(mx.float32))):
                    self.fail(op, f"{who}: the {'single cache' if got is None else 'batch'} holds a non-zero "
                                  f"{names[e]} where the {'batch' if got is None else 'single cache'} holds none "
                                  "(the layer's zeros)")
                continue
            if _bytes_of(got) != _bytes_of(s):
                self.fail(op, f"{who}: {names[e]} differs from its single cache's ({self.describe(e, got, s)})")

    def describe(self, e: int, got: mx.array, want: mx.array) -> str:
        if (tuple(got.shape), got.dtype) != (tuple(want.shape), want.dtype):
            return f"shape {tuple(got.shape)} {got.dtype}, single {tuple(want.shape)} {want.dtype}"
        g, w = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
        if e == 1:
            return (f"the state after {int(g[0, 0])} tokens (hashes {g[0, 1:].astype(int).tolist()}), the single's "
                    f"after {int(w[0, 0])} tokens (hashes {w[0, 1:].astype(int).tolist()})")
        rows = [j for j in range(g.shape[1]) if not np.array_equal(g[0, j], w[0, j])]
        return f"rows {rows} of {g.shape[1]} differ"

    def check(self, op: str) -> None:
        b = len(self.singles)
        if self.batch.batch_size != b:
            self.fail(op, f"batch_size {self.batch.batch_size}, {b} sequences")
        for e, a in enumerate(self.batch.cache):
            if a is not None and a.shape[0] != b:
                self.fail(op, f"array {e} has shape {tuple(a.shape)} for {b} sequences")
        for name in ("left_padding", "lengths"):
            v = getattr(self.batch, name)
            if v is not None and v.size != b:
                self.fail(op, f"{name} holds {v.size} entries for {b} sequences")
        for i, c in enumerate(self.singles):
            self.compare(op, f"sequence {i} ({self.consumed[i]} tokens)", self.batch, i, c)


def _bytes_of(a: Any) -> bytes | None:
    if a is None:
        return None
    return str(a.dtype).encode() + str(tuple(a.shape)).encode() + np.array(
        a.astype(mx.float32) if a.dtype == mx.bfloat16 else a).tobytes()


@st.composite
def recurrent_programs(draw: Any) -> tuple[RecurrentShape, tuple[Any, ...], list[tuple[str, Any]]]:
    """A recurrent batch program: the shape, the start (``("merge",
    lengths)`` of ragged single caches, or ``("padded", (left, width))``: an
    empty batch with left padding and one block), then up to 10 ops."""
    shape = RecurrentShape(draw(st.integers(2, 4)), draw(st.integers(1, 3)), draw(st.sampled_from([2, 2, 1])),
                           draw(st.integers(0, 2)), draw(st.sampled_from(["float16", "bfloat16", "float32"])))
    if draw(st.integers(0, 3)) == 0:
        left = tuple(draw(st.lists(st.integers(0, 3), min_size=1, max_size=3)))
        start: tuple[Any, ...] = ("padded", (left, draw(st.integers(max(left), max(left) + 3))))
        b = len(left)
    else:
        lengths = draw(st.one_of(LENGTHS, LENGTHS, LENGTHS.map(lambda ls: (0,) * len(ls))))
        start, b = ("merge", lengths), len(lengths)
    ops: list[tuple[str, Any]] = []
    names = ["decode", "block", "block", "filter", "extend", "extract", "refused", "merge_refused", "extend_refused"]
    for _ in range(draw(st.integers(1, 10))):
        op = draw(st.sampled_from(names))
        if op == "block":
            ops.append((op, (tuple(draw(st.integers(0, 5)) for _ in range(b - 1)) + (draw(st.integers(1, 5)),),
                             draw(st.integers(1, 5)))))
            ops[-1] = (op, (tuple(draw(st.permutations(ops[-1][1][0]))), ops[-1][1][1]))
        elif op == "filter":
            keep = draw(st.lists(st.integers(0, b - 1), min_size=1, max_size=b, unique=True))
            ops.append((op, tuple(keep)))
            b = len(keep)
        elif op == "extend" and b < 3:
            more = draw(st.lists(st.integers(0, 6), min_size=1, max_size=3 - b).map(tuple))
            ops.append((op, more))
            b += len(more)
        elif op == "extract":
            ops.append((op, draw(st.integers(0, b - 1))))
        elif op == "refused":
            ops.append((op, draw(refused_args(b))))
        elif op == "merge_refused":
            ops.append((op, (draw(st.sampled_from(["kernel", "channels", "size", "dtype"])),
                             draw(LENGTHS.map(lambda ls: tuple(n + 1 for n in ls))), draw(st.integers(0, 3)))))
        elif op == "extend_refused":
            ops.append((op, (draw(st.sampled_from(["kernel", "channels", "size", "dtype"])),
                             draw(st.lists(st.integers(1, 4), min_size=1, max_size=2).map(tuple)))))
        elif op == "decode":
            ops.append((op, None))
    return shape, start, ops


def run_recurrent_program(program: tuple[RecurrentShape, tuple[Any, ...], list[tuple[str, Any]]],
                          single: type | None = None, seed: int = 0, log: list[str] | None = None) -> None:
    """Run one recurrent program in lockstep (``single``: the RecurrentCache
    class, an injected bug's); raises :class:`BatchDivergence` on a
    disagreement, or whatever the batch cache or the harness raised."""
    from kvspec.impl.recurrent import RecurrentCache

    shape, (how, arg), ops = program
    run = RecurrentRun(shape, single or RecurrentCache, seed)
    if log is not None:
        run.log = log
    (run.start if how == "merge" else run.padded)(arg)
    for name, a in ops:
        getattr(run, name)(*(() if a is None else (a,)))


def recurrent_campaign(single: type | None = None, max_examples: int = 150, seed: int = 0, shrink: bool = True,
                       search_seed: int | None = None) -> CampaignResult:
    """:func:`campaign` for the recurrent kind: ``max_examples`` programs of
    a batch RecurrentCache against B single RecurrentCaches."""
    return _campaign(recurrent_programs(), lambda p, s, log: run_recurrent_program(p, single, s, log),
                     max_examples, seed, shrink, search_seed)


__all__ = ["BatchDivergence", "BatchHarnessFailure", "BatchMixer", "CampaignResult", "RecurrentRun", "Run", "campaign",
           "catch", "programs", "recurrent_campaign", "recurrent_programs", "run_program", "run_recurrent_program"]
