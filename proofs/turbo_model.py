"""Z3 encodings of ``kvspec.spec.turbo`` (the Turbo modes' physical layout), one
per spec function and under its name:

* ``handoff_fold``, ``fold_block_rows``, ``trim_split``, ``packed_bytes``:
  the counters;
* ``array_rows_after_append`` / ``array_rows_after_trim``: the row count of
  every array (buffer or sidecar) after an append or a trim, each array
  updated by its own cut or regrow, as an implementation does;
* ``DelegatedS``: Delegated's V as token arrays ``cold``, ``hot`` against
  the chronological window ``win``, and the transitions ``d_append`` (the
  new rows go hot), ``d_fold`` (the oldest ``f`` hot rows go cold) and
  ``d_trim`` (hot rows first).

``tests/test_proofs_fidelity_turbo.py`` compares these with ``kvspec.spec.turbo``
on concrete values. Buggy variants for the negative controls are selected
by :class:`TurboRules`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import z3

from kvspec.proofs.domain import Domain

#: arrays per mode (kvspec.spec.turbo.array_names); the sidecars are what the
#: lockstep bug forgets
NON_DELEGATED = {
    "turbo4asym": ("keys", "v_norm", "v_packed", "v_rescale"),
    "turbo4": ("k_norm", "k_packed", "k_rescale", "v_norm", "v_packed", "v_rescale"),
    "turbo3asym": ("keys", "v_norm", "v_packed"),
}
COLD = ("cold_norm", "cold_packed", "cold_rescale")
SIDECARS = ("k_norm", "k_rescale", "v_norm", "v_rescale", "cold_norm", "cold_rescale")


@dataclass(frozen=True)
class TurboRules:
    """The spec's rules by default; other values are negative controls."""

    trim: str = "physical"  # | "logical" (only the offset moves) | "skip_sidecar" (norm/rescale kept)
    trim_order: str = "hot_first"  # | "cold_first"
    fold: str = "spec"  # | "one_too_many" | "drops_a_row" | "unclamped"
    pack_exact: str = "mod8"  # | "mod4" (the truncating packer's guard)


SPEC = TurboRules()


# ---------------------------------------------------------------------------
# Counters


def handoff_fold(d: Domain, cold: Any, live: Any, n: Any) -> Any:
    """``kvspec.spec.turbo.handoff_fold``."""
    return z3.And(n == 1, cold == 0, live > 0)


def fold_block_rows(d: Domain, hot: Any, threshold: Any, block: Any, rule: str = "spec") -> Any:
    """``kvspec.spec.turbo.fold_block_rows``: ``min(block, hot)`` when hot exceeds
    the threshold, else 0. ``unclamped``: ``block`` (a fold of more rows
    than are hot)."""
    moved = block if rule == "unclamped" else d.min(block, hot)
    return z3.If(hot > threshold, moved, 0)


def trim_split(d: Domain, cold: Any, live: Any, n: Any, rule: str = "hot_first") -> tuple[Any, Any]:
    """``kvspec.spec.turbo.trim_split``: ``(from_hot, from_cold)``. ``cold_first``:
    the cold rows go first (the bug)."""
    if rule == "cold_first":
        from_cold = d.min(n, cold)
        return d.sub(n, from_cold, "n - from_cold"), from_cold
    from_hot = d.min(n, d.sub(live, cold, "live - cold"))
    return from_hot, d.sub(n, from_hot, "n - from_hot")


def packed_bytes(d: Domain, head_dim: Any, bits: int) -> Any:
    """``kvspec.spec.turbo.packed_bytes``: ``bits * head_dim // 8``."""
    return d.floordiv(d.mul(d.val(bits), head_dim, "bits * d"), d.val(8), "// 8")


def pack_guard(d: Domain, head_dim: Any, rule: str = "mod8") -> Any:
    """The 3-bit packer's acceptance test: ``head_dim % 8 == 0`` (spec),
    ``head_dim % 4 == 0`` (a packer that accepts partial words)."""
    m = 4 if rule == "mod4" else 8
    return head_dim % m == 0


# ---------------------------------------------------------------------------
# Row counts of every array


def regrow_capacity(d: Domain, prev: Any, n: Any, step: Any) -> Any:
    """``kvspec.spec.dense.regrow_capacity``: ``prev + ceil(n / step) * step``."""
    return d.add(prev, d.mul(d.ceildiv(n, step), step, "ceil * step"), "prev + ...")


def array_rows_after_append(d: Domain, names: tuple[str, ...], rows: dict[str, Any], live: Any, n: Any,
                            step: Any) -> dict[str, Any]:
    """Every array of a non-Delegated cache after an append of ``n`` rows
    (kvspec.spec.dense.append's regrow rule, applied to each array on its own):
    an array whose ``live + n`` rows do not fit grows to
    ``regrow_capacity``, the others keep their rows."""
    grown = d.stored("capacity", regrow_capacity, live, n, step)
    return {a: z3.If(d.add(live, n, "live + n") > rows[a], grown, rows[a]) for a in names}


def array_rows_after_trim(d: Domain, names: tuple[str, ...], rows: dict[str, Any], live: Any, n: Any,
                          rule: str = "physical") -> tuple[dict[str, Any], Any]:
    """``kvspec.spec.dense.trim`` in a Turbo mode: ``n`` clamped to ``[0, live]``;
    each array cut to the rows that stay (all dropped at 0 rows, under every
    rule). ``logical``: only the offset moves; ``skip_sidecar``: the norm
    and rescale sidecars keep their rows. Returns (rows, live after)."""
    k = d.clamp(n, 0, live)
    left = d.sub(live, k, "live - n")
    out = {}
    for a in names:
        keep = rule == "logical" or (rule == "skip_sidecar" and a in SIDECARS)
        # at 0 rows everything is dropped, whatever the rule
        out[a] = z3.If(k == 0, rows[a], z3.If(left == 0, 0, rows[a] if keep else left))
    return out, left


def delegated_rows_after_trim(d: Domain, rows: dict[str, Any], live: Any, cold: Any, n: Any,
                              rules: TurboRules = SPEC) -> tuple[dict[str, Any], Any, Any]:
    """Delegated's trim (kvspec.spec.turbo.apply_op): ``from_hot, from_cold =
    trim_split``; keys cut to the live rows, cold arrays to the new
    cold_offset, hot to the rest. Returns (rows, live after, cold after)."""
    k = d.clamp(n, 0, live)
    left = d.sub(live, k, "live - n")
    from_hot, from_cold = trim_split(d, cold, live, k, rules.trim_order)
    cold2 = z3.If(left == 0, 0, d.sub(cold, from_cold, "cold - from_cold"))
    hot2 = d.sub(d.sub(live, cold, "live - cold"), from_hot, "hot - from_hot")
    out = {}
    for a, new in (("keys", left), *((c, cold2) for c in COLD), ("hot", z3.If(left == 0, 0, hot2))):
        keep = rules.trim == "logical" or (rules.trim == "skip_sidecar" and a in SIDECARS)
        out[a] = z3.If(k == 0, rows[a], z3.If(left == 0, 0, rows[a] if keep else new))
    return out, left, cold2


# ---------------------------------------------------------------------------
# Delegated's V against the window


@dataclass(frozen=True)
class DelegatedS:
    """``off`` rows live (live_start is 0 in Turbo modes), the first
    ``cold`` cold; ``win[i]`` the token at window position i, ``cold_v[i]``
    the token in cold row i, ``hot_v[j]`` in hot row j."""

    off: Any
    cold: Any
    win: Any
    cold_v: Any
    hot_v: Any


def delegated_vars(d: Domain, tag: str) -> DelegatedS:
    return DelegatedS(d.var(f"offset_{tag}"), d.var(f"cold_offset_{tag}"), d.array(f"win_{tag}"),
                      d.array(f"cold_{tag}"), d.array(f"hot_{tag}"))


def cold_ok(c: DelegatedS) -> Any:
    """``kvspec.spec.turbo.cold_offset_ok``: ``0 <= cold_offset <= offset``."""
    return z3.And(c.cold >= 0, c.cold <= c.off)


def fetch_is_window(c: DelegatedS) -> Any:
    """``dequant(cold) ++ hot`` is the window: cold row i is window row i,
    hot row j is window row ``cold + j``."""
    i = z3.Int("i")
    return z3.And(
        z3.ForAll([i], z3.Implies(z3.And(i >= 0, i < c.cold), z3.Select(c.cold_v, i) == z3.Select(c.win, i))),
        z3.ForAll([i], z3.Implies(z3.And(i >= 0, i < c.off - c.cold),
                                  z3.Select(c.hot_v, i) == z3.Select(c.win, c.cold + i))),
    )


def d_append(d: Domain, c: DelegatedS, n: Any, new: Any) -> DelegatedS:
    """``n`` new rows (tokens ``new[0..n)``) at the end of the window and of
    the hot part."""
    hot = d.sub(c.off, c.cold, "offset - cold")
    off = d.stored("offset", lambda d, a, b: d.add(a, b, "offset + n"), c.off, n)
    win = d.lam(lambda i: z3.If(i >= c.off, z3.Select(new, i - c.off), z3.Select(c.win, i)))
    hot_v = d.lam(lambda j: z3.If(j >= hot, z3.Select(new, j - hot), z3.Select(c.hot_v, j)))
    return DelegatedS(off, c.cold, win, c.cold_v, hot_v)


def d_fold(d: Domain, c: DelegatedS, f: Any, rule: str = "spec") -> DelegatedS:
    """The oldest ``f`` hot rows fold cold (quantized, appended to the cold
    part). ``one_too_many``: cold_offset counts one row more than moved;
    ``drops_a_row``: the hot part loses one row more than moved."""
    moved_cold = d.add(f, 1, "f + 1") if rule == "one_too_many" else f
    cut_hot = d.add(f, 1, "f + 1") if rule == "drops_a_row" else f
    cold = d.add(c.cold, moved_cold, "cold + f")
    cold_v = d.lam(lambda i: z3.If(i >= c.cold, z3.Select(c.hot_v, i - c.cold), z3.Select(c.cold_v, i)))
    hot_v = d.lam(lambda j: z3.Select(c.hot_v, j + cut_hot))
    return DelegatedS(c.off, cold, c.win, cold_v, hot_v)


def d_trim(d: Domain, c: DelegatedS, n: Any, rule: str = "hot_first") -> DelegatedS:
    """Trim ``n`` rows: ``n`` clamped to ``[0, offset]``, hot rows first
    (kvspec.spec.turbo.trim_split); every array keeps its prefix."""
    k = d.clamp(n, 0, c.off)
    _, from_cold = trim_split(d, c.cold, c.off, k, rule)
    off = d.sub(c.off, k, "offset - n")
    cold = z3.If(off == 0, 0, d.sub(c.cold, from_cold, "cold - from_cold"))
    return DelegatedS(off, cold, c.win, c.cold_v, c.hot_v)
