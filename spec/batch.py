"""Batch caches: B sequences side by side, left-padded (semantics.md 7).

mlx-lm's batched generation (``batch_generate``, ``BatchGenerator``, the
server) runs B sequences through the model at once: every layer holds one
buffer of ``idx`` positions per sequence row, and sequence ``i`` occupies
positions ``[pads[i], idx)``, after ``pads[i]`` positions of left padding.
This module is the layout's arithmetic, the rules every batch cache obeys
(``kvspec.impl.batch``), as pure functions on :class:`BatchLayout`:

1. **A batch of B behaves as B independent caches.** Sequence ``i``'s
   offset (its RoPE position, the rows it holds) is ``idx - pads[i]``; its
   window is its rows in order, and equals the window of a single cache fed
   the same rows.
2. **Padding is never visible.** In every sequence's attention mask a key
   position ``j < pads[i]`` is hidden from every query (:func:`visible`).
3. **Merge, filter, extend, extract keep every surviving sequence's window
   exactly.** :func:`merge` left-pads B caches of ragged lengths to the
   longest (each sequence's offset is its length); :func:`filter` keeps the
   chosen rows, in the given order, and drops the columns no kept sequence
   uses (the smallest padding becomes 0); :func:`extend` right-aligns two
   batches (the shorter one's sequences get more padding); :func:`extract`
   is one sequence's positions; :func:`trim` takes the same count from
   every sequence, never more than the shortest holds (so no sequence's
   offset goes negative and padding never becomes a row).

A right-padded block (:func:`append_ragged`: mlx-lm's ``prepare`` with
``right_padding`` then ``finalize``) appends ``lengths[i]`` rows to sequence
``i`` in a block of ``max(lengths)`` positions; the finalize shifts each
sequence's rows right so they end at the new ``idx``, turning its right
padding into left padding.

Z3 proves the rules for batches of up to 3 sequences and any integers
(``proofs/batch.py``, obligation 13), with a negative control per injected
bug of ``fuzz/bugs/batch.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvspec.spec.errors import InvalidArgumentError


@dataclass(frozen=True)
class BatchLayout:
    """``idx``: positions in the shared buffer; ``pads[i]``: left padding of
    sequence ``i`` (``0 <= pads[i] <= idx``)."""

    idx: int
    pads: tuple[int, ...]


def check_layout(layout: BatchLayout) -> None:
    """Raise InvalidArgumentError unless ``0 <= pads[i] <= idx`` for all i
    and the batch holds at least one sequence."""
    if not layout.pads:
        raise InvalidArgumentError("batch: a batch holds at least one sequence, got pads=()")
    if layout.idx < 0 or any(p < 0 or p > layout.idx for p in layout.pads):
        raise InvalidArgumentError(f"batch: pads must satisfy 0 <= pad <= idx ({layout.idx}), got {layout.pads}")


def offsets(layout: BatchLayout) -> tuple[int, ...]:
    """Every sequence's offset: ``idx - pads[i]`` (rule 1)."""
    return tuple(layout.idx - p for p in layout.pads)


def positions(layout: BatchLayout, i: int) -> range:
    """The buffer positions of sequence ``i``'s rows, oldest first."""
    return range(layout.pads[i], layout.idx)


def visible(layout: BatchLayout, i: int, query: int, key: int, window: int | None = None) -> bool:
    """Whether the query at buffer position ``query`` of sequence ``i`` sees
    the key at position ``key``: causal, never padding (rule 2), and with a
    ``window``, among the query's latest ``window`` positions."""
    return layout.pads[i] <= key <= query and (window is None or query - key < window)


def merge(lengths: tuple[int, ...]) -> BatchLayout:
    """The layout of B single caches of ``lengths`` rows merged into one
    batch: left-padded to the longest, so sequence ``i`` has offset
    ``lengths[i]`` (rule 3). Raises InvalidArgumentError for no caches or a
    negative length."""
    if not lengths or any(n < 0 for n in lengths):
        raise InvalidArgumentError(f"merge: lengths must be one or more integers >= 0, got {lengths}")
    longest = max(lengths)
    return BatchLayout(longest, tuple(longest - n for n in lengths))


def append(layout: BatchLayout, n: int) -> BatchLayout:
    """Every sequence gets ``n`` rows (a block the width of the batch)."""
    if n < 0:
        raise InvalidArgumentError(f"append: n must be >= 0, got {n}")
    return BatchLayout(layout.idx + n, layout.pads)


def append_ragged(layout: BatchLayout, lengths: tuple[int, ...]) -> BatchLayout:
    """Sequence ``i`` gets ``lengths[i]`` rows, in a right-padded block of
    ``max(lengths)`` positions; after the finalize its rows end at the new
    ``idx`` and its ``max - lengths[i]`` positions of right padding are left
    padding."""
    if len(lengths) != len(layout.pads) or any(n < 0 for n in lengths):
        raise InvalidArgumentError(f"append_ragged: lengths must be {len(layout.pads)} integers >= 0, got {lengths}")
    width = max(lengths)
    return BatchLayout(layout.idx + width, tuple(p + width - n for p, n in zip(layout.pads, lengths)))


def announced_block(layout: BatchLayout, left: tuple[int, ...], n: int) -> BatchLayout:
    """mlx-lm's announced left padding (``prepare(left_padding=left)``, on an
    empty batch) then a block of ``n`` positions for every sequence:
    sequence ``i`` keeps the block's last ``n - (pads[i] + left[i])`` rows,
    the layout ``(n, pads + left)``. Raises InvalidArgumentError when the
    batch already holds positions (``idx > 0``), ``left`` is not one integer
    ``>= 0`` per sequence, ``n < 0``, or a padding would pass the block
    (``pads[i] + left[i] > n``): a refused block changes nothing
    (semantics.md 7)."""
    if layout.idx != 0:
        raise InvalidArgumentError(f"announced_block: left padding is announced on an empty batch, got idx={layout.idx}")
    if len(left) != len(layout.pads) or any(q < 0 for q in left) or n < 0:
        raise InvalidArgumentError(f"announced_block: left must be {len(layout.pads)} integers >= 0 and n >= 0, "
                                   f"got left={left}, n={n}")
    pads = tuple(p + q for p, q in zip(layout.pads, left))
    if any(p > n for p in pads):
        raise InvalidArgumentError(f"announced_block: a block of {n} positions is shorter than the padding {pads}")
    return BatchLayout(n, pads)


def filter(layout: BatchLayout, keep: tuple[int, ...]) -> BatchLayout:
    """Keep the sequences ``keep`` (distinct indices, in that order) and drop
    the leading columns no kept sequence uses (rule 3)."""
    if not keep or len(set(keep)) != len(keep) or any(k < 0 or k >= len(layout.pads) for k in keep):
        raise InvalidArgumentError(f"filter: keep must be distinct indices in [0, {len(layout.pads)}), got {keep}")
    pads = tuple(layout.pads[k] for k in keep)
    drop = min(pads)
    return BatchLayout(layout.idx - drop, tuple(p - drop for p in pads))


def extend(a: BatchLayout, b: BatchLayout) -> BatchLayout:
    """``a``'s sequences then ``b``'s, right-aligned on the longer buffer."""
    idx = max(a.idx, b.idx)
    return BatchLayout(idx, tuple(p + idx - a.idx for p in a.pads) + tuple(p + idx - b.idx for p in b.pads))


def trim_count(layout: BatchLayout, n: int) -> int:
    """Rows a trim of ``n`` takes from every sequence: ``min(n, every
    offset)``, 0 for ``n <= 0`` (rule 3)."""
    return max(0, min(n, *offsets(layout)))


def trim(layout: BatchLayout, n: int) -> tuple[int, BatchLayout]:
    """Take :func:`trim_count` rows from the end of every sequence."""
    count = trim_count(layout, n)
    return count, BatchLayout(layout.idx - count, layout.pads)


def extract(layout: BatchLayout, i: int) -> tuple[int, range]:
    """Sequence ``i`` alone: its offset and its positions (rule 1)."""
    if i < 0 or i >= len(layout.pads):
        raise InvalidArgumentError(f"extract: idx must be in [0, {len(layout.pads)}), got {i}")
    return layout.idx - layout.pads[i], positions(layout, i)


__all__ = ["BatchLayout", "append", "append_ragged", "check_layout", "extend", "extract", "filter", "merge",
           "offsets", "positions", "trim", "trim_count", "visible"]
