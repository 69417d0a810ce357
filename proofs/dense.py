"""The dense cache's obligations: 1 ownership, 3 regrow, 4 trim then
append, 5 front trim. Each names the spec functions it proves; each negative
control names the buggy rule it refutes.

Reading guide: a *part* is one validity check ``premises => goal`` built in a
fresh :class:`~kvspec.proofs.domain.Domain`; ``run_parts`` checks it over unbounded
integers and in 32-bit two's-complement arithmetic (``bv32``). States are :class:`CacheS` values of
Z3 variables; transitions are the encodings in :mod:`kvspec.proofs.dense_model`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import z3

from kvspec.proofs import dense_controls, traces
from kvspec.proofs.core import (
    ObligationResult,
    PartBuilder,
    control_from_parts,
    overall,
    run_parts,
)
from kvspec.proofs.dense_model import (
    FP16,
    INT8,
    MODES,
    SPEC,
    CacheS,
    HolderS,
    Rules,
    adopt,
    append,
    cache_vars,
    capacity,
    detach,
    gather_positions,
    gather_within_tail,
    handle_trim_to,
    holder_of,
    holder_vars,
    is_empty,
    live_len,
    regrow_capacity,
    regrow_needed,
    select,
    trim,
    trim_front_keep_sink,
    trim_is_logical,
    trim_to,
)
from kvspec.proofs.domain import INT, Domain, solver

ZERO_ROW = -1  # token identity of a zero row nobody wrote


def _L(c: CacheS) -> Any:
    """live_len without overflow bookkeeping (used in statements only)."""
    return c.off - c.ls


def _rows(h: HolderS) -> Any:
    return h.off - h.ls


# ===========================================================================
# Obligation 1: ownership soundness (inplace_write_allowed)


def well_formed(d: Domain, c: CacheS) -> Any:
    """Offsets and identities of a reachable cache (semantics.md 5.6):
    ``0 <= live_start <= offset``, buffers exist iff rows do, ``live_len <=
    capacity``, and every identity in use (the cache's, the marker's, any
    holder's) is one ``next_ident`` already handed out: in ``[0,
    next_ident)``."""
    L = _L(c)
    return z3.And(
        c.step >= 1, c.mode >= 0, c.mode < len(MODES), c.ls >= 0, c.ls <= c.off, c.nid >= 0,
        z3.Implies(c.has_buf, z3.And(L >= 1, L <= c.cap, c.buf >= 0, c.buf < c.nid)),
        z3.Implies(z3.Not(c.has_buf), L == 0),
        z3.Implies(c.mk, z3.And(c.mkb >= 0, c.mkb < c.nid)),
    )


def holder_well_formed(d: Domain, c: CacheS, h: HolderS) -> Any:
    r = _rows(h)
    return z3.Implies(h.alive, z3.And(
        h.ls >= 0, h.ls <= h.off,
        z3.Implies(h.has_buf, z3.And(r >= 1, r <= h.cap, h.buf >= 0, h.buf < c.nid)),
        z3.Implies(z3.Not(h.has_buf), r == 0),
    ))


def owns(c: CacheS) -> Any:
    """The marker names the current buffers."""
    return z3.And(c.mk, c.has_buf, c.mkb == c.buf)


def ownership_invariant(d: Domain, c: CacheS, h: HolderS) -> Any:
    """When the marker names the current buffers: the cache's live_len and
    the valid rows of every holder of those buffers are at most
    ``marker.live_len``."""
    shares = z3.And(h.alive, h.has_buf, h.buf == c.buf)
    return z3.And(
        z3.Implies(owns(c), _L(c) <= c.mkl),
        z3.Implies(z3.And(owns(c), shares), _rows(h) <= c.mkl),
    )


def invariant(d: Domain, c: CacheS, h: HolderS) -> Any:
    return z3.And(well_formed(d, c), holder_well_formed(d, c, h), ownership_invariant(d, c, h))


def initial(d: Domain, c: CacheS) -> Any:
    """``new_world``: empty cache, no marker, no identity used yet."""
    return z3.And(c.off == 0, c.ls == 0, z3.Not(c.has_buf), z3.Not(c.mk), c.nid == 0, c.step >= 1,
                  c.mode >= 0, c.mode < len(MODES))


# A transition: (dom, cache, arbitrary holder h, arbitrary source holder g,
# rules) -> (guard, cache', candidates for h' — the holder h after the step,
# or the holder the step creates).
Transition = Callable[[Domain, CacheS, HolderS, HolderS, Rules], tuple[Any, CacheS, list[HolderS]]]


def _t_append(single: bool) -> Transition:
    def t(d: Domain, c: CacheS, h: HolderS, g: HolderS, rules: Rules) -> tuple[Any, CacheS, list[HolderS]]:
        n = d.var("n")
        _, c1 = append(d, c, n, rules=rules)
        guard = n == 1 if single else n >= 1
        return guard, c1, [h, holder_of(d, c1)]  # the returned window is a holder
    return t


def _t_trim(logical: bool | None) -> Transition:
    def t(d: Domain, c: CacheS, h: HolderS, g: HolderS, rules: Rules) -> tuple[Any, CacheS, list[HolderS]]:
        n = d.var("n")
        _, c1 = trim(d, c, n, rules)
        mode_ok = trim_is_logical(d, c.mode) if logical else z3.Not(trim_is_logical(d, c.mode))
        return mode_ok, c1, [h]
    return t


def _t_trim_to(d: Domain, c: CacheS, h: HolderS, g: HolderS, rules: Rules) -> tuple[Any, CacheS, list[HolderS]]:
    ok, _, c1 = trim_to(d, c, d.var("len"), rules)
    return ok, c1, [h]


def _t_front(d: Domain, c: CacheS, h: HolderS, g: HolderS, rules: Rules) -> tuple[Any, CacheS, list[HolderS]]:
    _, c1 = trim_front_keep_sink(d, c, d.var("n"), d.var("keep"), rules)
    return z3.BoolVal(True), c1, [h]


def _t_gather_positions(d: Domain, c: CacheS, h: HolderS, g: HolderS, rules: Rules) -> tuple[Any, CacheS, list[HolderS]]:
    ok, c1 = gather_positions(d, c, d.var("len_positions"))
    return ok, c1, [h]


def _t_gather_within_tail(d: Domain, c: CacheS, h: HolderS, g: HolderS, rules: Rules) -> tuple[Any, CacheS, list[HolderS]]:
    ok, c1 = gather_within_tail(d, c, d.var("tail"), d.var("len_kept"))
    return ok, c1, [h]


def _t_snapshot(d: Domain, c: CacheS, h: HolderS, g: HolderS, rules: Rules) -> tuple[Any, CacheS, list[HolderS]]:
    return z3.BoolVal(True), c, [h, holder_of(d, c)]


def _t_restore(d: Domain, c: CacheS, h: HolderS, g: HolderS, rules: Rules) -> tuple[Any, CacheS, list[HolderS]]:
    return g.alive, adopt(d, c, g, rules), [h]


def _t_detach(d: Domain, c: CacheS, h: HolderS, g: HolderS, rules: Rules) -> tuple[Any, CacheS, list[HolderS]]:
    handle, c1 = detach(d, c)
    return z3.BoolVal(True), c1, [h, handle]


def _t_install(d: Domain, c: CacheS, h: HolderS, g: HolderS, rules: Rules) -> tuple[Any, CacheS, list[HolderS]]:
    return z3.And(g.alive, is_empty(d, c)), adopt(d, c, g, rules), [h]


def _t_handle_trim_to(d: Domain, c: CacheS, h: HolderS, g: HolderS, rules: Rules) -> tuple[Any, CacheS, list[HolderS]]:
    ok, _, h1 = handle_trim_to(d, h, d.var("len"))
    return z3.And(ok, h.alive), c, [h1]


OWNERSHIP_TRANSITIONS: list[tuple[str, Transition]] = [
    ("append-1", _t_append(True)),
    ("append-S", _t_append(False)),
    ("trim (logical)", _t_trim(True)),
    ("trim (physical)", _t_trim(False)),
    ("trim_to", _t_trim_to),
    ("trim_front_keep_sink", _t_front),
    ("gather_positions", _t_gather_positions),
    ("gather_within_tail", _t_gather_within_tail),
    ("snapshot", _t_snapshot),
    ("restore", _t_restore),
    ("detach", _t_detach),
    ("install", _t_install),
    ("handle_trim_to", _t_handle_trim_to),
]
# hold, release_hold and drop change no buffer, marker or holder's rows: the
# invariant (about one arbitrary holder) is trivially preserved.


def ownership_parts(rules: Rules = SPEC) -> list[tuple[str, PartBuilder]]:
    def init(d: Domain) -> tuple[list[Any], Any]:
        c, h = cache_vars(d, "c."), holder_vars(d, "h.")
        return [initial(d, c), z3.Not(h.alive)], invariant(d, c, h)

    def step(t: Transition) -> PartBuilder:
        def build(d: Domain) -> tuple[list[Any], Any]:
            c, h, g = cache_vars(d, "c."), holder_vars(d, "h."), holder_vars(d, "g.")
            guard, c1, hs = t(d, c, h, g, rules)
            return [invariant(d, c, h), invariant(d, c, g), guard], z3.And(*[invariant(d, c1, x) for x in hs])
        return build

    def safety(d: Domain) -> tuple[list[Any], Any]:
        c, h = cache_vars(d, "c."), holder_vars(d, "h.")
        n = d.var("n")
        out, c1 = append(d, c, n, rules=rules)
        shares = z3.And(h.alive, h.has_buf, h.buf == c1.buf)
        # The in-place row is row prev (= live_len): no holder of the buffer
        # can see it, and it lies inside the buffer.
        goal = z3.Implies(out.inplace, z3.And(z3.Implies(shares, _rows(h) <= out.prev), out.prev < c1.cap))
        return [invariant(d, c, h), n >= 1], goal

    parts: list[tuple[str, PartBuilder]] = [("init", init)]
    parts += [(f"preserved by {name}", step(t)) for name, t in OWNERSHIP_TRANSITIONS]
    parts.append(("in-place row unseen", safety))
    return parts


# ---------------------------------------------------------------------------
# Bounded model checking: a reachable counterexample for a buggy rule.

BMC_OPS = ("append", "trim", "trim_front", "gather_positions", "gather_within_tail", "snapshot",
           "restore", "drop", "detach", "install", "handle_trim_to", "hold", "release_hold")
SLOTS = 2  # named holders (snapshots or handles) besides the held window
MAX_N = 4
MAX_STEP = 4


def _dead(d: Domain) -> HolderS:
    f = z3.BoolVal(False)
    return HolderS(f, f, d.val(0), d.val(0), d.val(0), d.val(0))


def _fresh_holder(d: Domain, p: str) -> HolderS:
    return holder_vars(d, p)


def _eq_holder(a: HolderS, b: HolderS) -> Any:
    return z3.And(a.alive == b.alive, a.has_buf == b.has_buf, a.buf == b.buf, a.cap == b.cap,
                  a.off == b.off, a.ls == b.ls)


def _eq_cache(a: CacheS, b: CacheS) -> Any:
    return z3.And(a.off == b.off, a.ls == b.ls, a.has_buf == b.has_buf, a.buf == b.buf, a.cap == b.cap,
                  a.mk == b.mk, a.mkb == b.mkb, a.mkl == b.mkl, a.nid == b.nid)


class _World:
    def __init__(self, c: CacheS, slots: list[HolderS], handles: list[Any], held: HolderS, returned: HolderS):
        self.c, self.slots, self.handles, self.held, self.returned = c, slots, handles, held, returned


def _world_vars(d: Domain, t: int, mode: Any, sw: Any, step: Any) -> _World:
    c = cache_vars(d, f"w{t}.")
    c = replace(c, mode=mode, sw=sw, step=step)
    slots = [_fresh_holder(d, f"w{t}.s{j}.") for j in range(SLOTS)]
    handles = [z3.Bool(f"w{t}.s{j}.handle") for j in range(SLOTS)]
    return _World(c, slots, handles, _fresh_holder(d, f"w{t}.held."), _fresh_holder(d, f"w{t}.ret."))


def _sees(h: HolderS, buf: Any, row: Any) -> Any:
    return z3.And(h.alive, h.has_buf, h.buf == buf, _rows(h) > row)


def bmc(rules: Rules, max_depth: int = 8, timeout_ms: int = 60_000) -> dict[str, Any] | None:
    """Search for ops from an empty Fp16 cache (switch on) that end with an
    append whose write goes in place onto a row some holder sharing the
    buffer can see. Returns the ops, the step and the model's states, or
    None when no such sequence of at most ``max_depth`` ops exists."""
    d = Domain(INT)
    step = z3.Int("step")
    mode, sw = z3.IntVal(FP16), z3.BoolVal(True)
    s = solver(timeout_ms)
    s.add(step >= 1, step <= MAX_STEP)
    w0 = _world_vars(d, 0, mode, sw, step)
    c0 = w0.c
    s.add(c0.off == 0, c0.ls == 0, z3.Not(c0.has_buf), z3.Not(c0.mk), c0.nid == 0)
    for j in range(SLOTS):
        s.add(z3.Not(w0.slots[j].alive))
    s.add(z3.Not(w0.held.alive), z3.Not(w0.returned.alive))
    worlds = [w0]
    ops, args = [], []
    for t in range(max_depth):
        w = worlds[-1]
        nxt = _world_vars(d, t + 1, mode, sw, step)
        op, n, a, jv = z3.Int(f"op{t}"), z3.Int(f"n{t}"), z3.Int(f"a{t}"), z3.Int(f"slot{t}")
        ops.append(op)
        args.append((n, a, jv))
        s.add(op >= 0, op < len(BMC_OPS), jv >= 0, jv < SLOTS)
        c = w.c
        L = live_len(d, c)
        target = w.slots[0]
        is_handle = w.handles[0]
        for j in range(1, SLOTS):
            target = select(jv == j, w.slots[j], target)
            is_handle = z3.If(jv == j, w.handles[j], is_handle)

        def keep_slots(new: HolderS | None = None, handle: Any = None, w: _World = w,
                       jv: Any = jv) -> tuple[list[HolderS], list[Any]]:
            if new is None:
                return w.slots, w.handles
            return ([select(jv == j, new, w.slots[j]) for j in range(SLOTS)],
                    [z3.If(jv == j, handle, w.handles[j]) for j in range(SLOTS)])

        alts: list[tuple[Any, CacheS, list[HolderS], list[Any], HolderS, HolderS]] = []
        bad = z3.BoolVal(False)
        # append
        out, c1 = append(d, c, n, rules=rules)
        sl, hd = keep_slots()
        alts.append((z3.And(n >= 1, n <= MAX_N), c1, sl, hd, w.held, holder_of(d, c1)))
        bad = z3.And(op == 0, out.inplace,
                     z3.Or(*[_sees(x, c1.buf, out.prev) for x in [*w.slots, w.held]]))
        # trim
        _, c1 = trim(d, c, n, rules)
        alts.append((z3.And(n >= 1, n <= L), c1, sl, hd, w.held, w.returned))
        # trim_front
        _, c1 = trim_front_keep_sink(d, c, n, a, rules)
        alts.append((z3.And(n >= 1, n <= L, a >= 0, a <= L), c1, sl, hd, w.held, w.returned))
        # gather_positions (the first n rows)
        ok, c1 = gather_positions(d, c, n)
        alts.append((ok, c1, sl, hd, w.held, w.returned))
        # gather_within_tail (tail n, kept = the first a rows of the tail)
        ok, c1 = gather_within_tail(d, c, n, a)
        alts.append((ok, c1, sl, hd, w.held, w.returned))
        # snapshot into an empty slot
        sl2, hd2 = keep_slots(holder_of(d, c), z3.BoolVal(False))
        alts.append((z3.Not(target.alive), c, sl2, hd2, w.held, w.returned))
        # restore a snapshot
        alts.append((z3.And(target.alive, z3.Not(is_handle)), adopt(d, c, target, rules), sl, hd, w.held, w.returned))
        # drop
        sl3, hd3 = keep_slots(_dead(d), z3.BoolVal(False))
        alts.append((target.alive, c, sl3, hd3, w.held, w.returned))
        # detach into an empty slot
        handle, c1 = detach(d, c)
        sl4, hd4 = keep_slots(handle, z3.BoolVal(True))
        alts.append((z3.Not(target.alive), c1, sl4, hd4, w.held, w.returned))
        # install a handle (consumed)
        alts.append((z3.And(target.alive, is_handle, is_empty(d, c)), adopt(d, c, target, rules), sl3, hd3,
                     w.held, w.returned))
        # handle_trim_to
        ok, _, cut = handle_trim_to(d, target, a)
        sl5, hd5 = keep_slots(cut, z3.BoolVal(True))
        alts.append((z3.And(target.alive, is_handle, ok), c, sl5, hd5, w.held, w.returned))
        # hold / release_hold
        alts.append((w.returned.alive, c, sl, hd, w.returned, w.returned))
        alts.append((w.held.alive, c, sl, hd, _dead(d), w.returned))
        assert len(alts) == len(BMC_OPS)

        for i, (guard, c1, sl_, hd_, held_, ret_) in enumerate(alts):
            s.add(z3.Implies(op == i, z3.And(
                guard, _eq_cache(nxt.c, c1),
                *[_eq_holder(nxt.slots[j], sl_[j]) for j in range(SLOTS)],
                *[nxt.handles[j] == hd_[j] for j in range(SLOTS)],
                _eq_holder(nxt.held, held_), _eq_holder(nxt.returned, ret_),
            )))
        worlds.append(nxt)
        s.push()
        s.add(bad)
        r = s.check()
        if r == z3.sat:
            m = s.model()
            result = _extract(m, d, step, ops, args, worlds, t + 1)
            s.pop()
            return result
        s.pop()
        if r == z3.unknown:
            return None
    return None


def _extract(m: Any, d: Domain, step: Any, ops: list[Any], args: list[Any], worlds: list[_World], depth: int) -> dict[str, Any]:
    def val(x: Any) -> Any:
        v = m.eval(x, model_completion=True)
        return z3.is_true(v) if z3.is_bool(v) else v.as_long()

    names: list[str | None] = [None] * SLOTS
    out_ops: list[dict[str, Any]] = []
    states = []
    for t in range(depth):
        kind = BMC_OPS[val(ops[t])]
        n, a, j = (val(x) for x in args[t])
        if kind == "append":
            op = {"op": "append", "n": n}
        elif kind == "trim":
            op = {"op": "trim", "n": n}
        elif kind == "trim_front":
            op = {"op": "trim_front", "n": n, "keep": a}
        elif kind == "gather_positions":
            op = {"op": "gather_positions", "positions": list(range(n))}
        elif kind == "gather_within_tail":
            op = {"op": "gather_within_tail", "tail": n, "kept": list(range(a))}
        elif kind in ("snapshot", "detach"):
            names[j] = f"{'s' if kind == 'snapshot' else 'h'}{t}"
            op = {"op": kind, "name": names[j]}
        elif kind in ("restore", "drop", "install"):
            op = {"op": kind, "name": names[j]}
            if kind != "restore":
                names[j] = None
        elif kind == "handle_trim_to":
            op = {"op": "handle_trim_to", "name": names[j], "len": a}
        else:
            op = {"op": kind}
        out_ops.append(op)
        nw = worlds[t + 1]
        states.append({
            "offset": val(nw.c.off), "live_start": val(nw.c.ls), "has_buf": val(nw.c.has_buf),
            "buf": val(nw.c.buf), "cap": val(nw.c.cap), "marker": val(nw.c.mk),
            "marker_buf": val(nw.c.mkb), "marker_len": val(nw.c.mkl), "next_ident": val(nw.c.nid),
        })
    # who sees the row the last append writes in place
    last = worlds[depth - 1]
    seer = None
    prev = val(last.c.off) - val(last.c.ls)
    for j in range(SLOTS):
        h = last.slots[j]
        if val(h.alive) and val(h.has_buf) and val(h.buf) == val(last.c.buf) and val(h.off) - val(h.ls) > prev:
            seer = names[j]
    if seer is None:
        seer = "held"
    return {"step": val(step), "ops": out_ops, "states": states, "row": prev, "seen_by": seer}


def _spec_state(c: Any) -> dict[str, Any]:
    return {
        "offset": c.offset, "live_start": c.live_start, "has_buf": c.buffer is not None,
        "buf": None if c.buffer is None else c.buffer.ident, "cap": c.capacity,
        "marker": c.marker is not None,
        "marker_buf": None if c.marker is None else c.marker.buffer,
        "marker_len": None if c.marker is None else c.marker.live_len, "next_ident": c.next_ident,
    }


def _same_state(model: dict[str, Any], spec: dict[str, Any]) -> bool:
    keys = ["offset", "live_start", "has_buf", "marker", "next_ident"]
    if spec["has_buf"]:
        keys += ["buf", "cap"]
    if spec["marker"]:
        keys += ["marker_buf", "marker_len"]
    return all(model[k] == spec[k] for k in keys)


def ownership_reachable(name: str, rules: Rules, max_depth: int = 8) -> Callable[[], tuple[Any, Any, str]]:
    """Find a reachable counterexample by BMC, then replay it on the spec
    with the buggy rule patched in: every state must match the model's, and
    the last append must go in place onto a row a holder of the buffer sees.
    The kvtrace carries the correct spec's checks."""

    def run() -> tuple[Any, Any, str]:
        found = bmc(rules, max_depth)
        if found is None:
            return None, None, f"no reachable counterexample within {max_depth} ops"
        cache = {"mode": "fp16", "step": found["step"]}
        ops = found["ops"]
        with traces.patched(traces.sd, **dense_controls.patches(rules)):
            steps = traces.replay("dense", cache, ops)
        for i, (st, ms) in enumerate(zip(steps, found["states"])):
            if not _same_state(ms, _spec_state(st.after.cache)):
                return None, found, f"model and spec disagree after op {i} {ops[i]}: {ms} vs {_spec_state(st.after.cache)}"
        last = steps[-1]
        prev = last.before.cache.live_len
        buf = last.before.cache.buffer
        holders = dict(last.before.holders)
        if last.before.held is not None:
            holders["held"] = last.before.held
        seers = sorted(k for k, h in holders.items()
                       if buf is not None and h.buffer is not None and h.buffer.ident == buf.ident and h.live_len > prev)
        if not (last.result.inplace and seers):
            return None, found, "the spec with the buggy rule does not write in place onto a visible row"
        correct = traces.replay("dense", cache, ops)[-1].result.inplace
        expect = [x for x in seers if x != "held"][:1]
        doc = traces.kvtrace(
            f"negative control {name}: the last append writes row {prev} in place while "
            f"{', '.join(seers)} still sees it", cache, traces.annotate("dense", cache, ops, expect))
        return doc, {"step": found["step"], "row": prev, "seen_by": seers}, (
            f"confirmed on spec with the bug: append writes row {prev} in place, visible to "
            f"{', '.join(seers)}; the correct rule copies (inplace={correct})")

    return run


OWNERSHIP_CONTROLS: list[tuple[str, str, Rules]] = [
    ("inplace_after_trim", "inplace_write_allowed without live_len == marker.live_len",
     Rules(inplace="no_length_check")),
    ("inplace_without_identity_restore_keeps_marker",
     "inplace_write_allowed without the buffer identity check, and restore keeps the old marker",
     Rules(inplace="no_identity_check", restore_marker="keep")),
    ("inplace_after_restore", "restore records a marker for the adopted (shared) buffers",
     Rules(restore_marker="record")),
]


def prove_ownership() -> ObligationResult:
    t0 = time.perf_counter()
    parts = run_parts(ownership_parts(), contracts=True)
    controls = [
        control_from_parts(name, rule, ownership_parts(rules), reachable=ownership_reachable(name, rules),
                           contracts=True)
        for name, rule, rules in OWNERSHIP_CONTROLS
    ]
    return ObligationResult(
        1, "ownership soundness", ("inplace_write_allowed",),
        "a write inplace_write_allowed lets through lands at row live_len, which no holder of the buffer sees",
        overall(parts, controls), parts, controls, time.perf_counter() - t0)


# ===========================================================================
# Physical rows (obligation 3): the buffer's contents, which the spec leaves
# abstract, follow semantics.md 2 append steps 2-3.


class Phys:
    """The buffer's rows: token identity and RoPE position per physical row."""

    def __init__(self, tok: Any, pos: Any):
        self.tok, self.pos = tok, pos


def physical_append(d: Domain, c: CacheS, p: Phys, n: Any, tokens: Any, rules: Rules = SPEC) -> Phys:
    """Regrow (cut to ``[0, prev)``, append zero rows), then write the n rows
    at ``[prev, prev + n)``. ``old_guard`` keeps the stale tail when
    ``prev % step == 0``; ``append_at == "offset"`` writes at the offset."""
    prev = live_len(d, c)
    regrew = regrow_needed(d, c.has_buf, prev, capacity(d, c), n)
    cut = prev
    if rules.regrow == "old_guard":
        cut = z3.If(z3.And(c.has_buf, (c.off - c.ls) % c.step == 0), capacity(d, c), prev)
    g_tok = d.lam(lambda i: z3.If(i < cut, p.tok[i], ZERO_ROW))
    g_pos = d.lam(lambda i: z3.If(i < cut, p.pos[i], ZERO_ROW))
    tok1 = z3.If(regrew, g_tok, p.tok)
    pos1 = z3.If(regrew, g_pos, p.pos)
    at = c.off if rules.append_at == "offset" else prev
    off = c.off
    return Phys(
        d.lam(lambda i: z3.If(z3.And(i >= at, i < at + n), tokens[i - at], tok1[i])),
        d.lam(lambda i: z3.If(z3.And(i >= at, i < at + n), off + (i - at), pos1[i])),
    )


def rows_hold_window(d: Domain, c: CacheS, p: Phys) -> Any:
    """Rows below live_len are never dead: physical row i holds the window's
    entry i (token and position) for every ``i < live_len``."""
    i = d.var("row")
    return z3.ForAll([i], z3.Implies(z3.And(i >= 0, i < _L(c)),
                                     z3.And(p.tok[i] == c.tok[i], p.pos[i] == c.pos[i])))


def content_invariant(d: Domain, c: CacheS, p: Phys) -> Any:
    return z3.And(well_formed(d, c), c.wlen == _L(c), rows_hold_window(d, c, p))


def _window_cache(d: Domain, prefix: str) -> tuple[CacheS, Phys]:
    c = cache_vars(d, prefix, window=True)
    return c, Phys(d.array(prefix + "ptok"), d.array(prefix + "ppos"))


def regrow_parts(rules: Rules = SPEC) -> list[tuple[str, PartBuilder]]:
    def after_append(d: Domain) -> tuple[list[Any], Any]:
        c, p = _window_cache(d, "c.")
        n, tokens = d.var("n"), d.array("tokens")
        out, c1 = append(d, c, n, tokens, rules)
        p1 = physical_append(d, c, p, n, tokens, rules)
        L1 = _L(c1)
        goal = z3.And(
            c1.has_buf, L1 <= c1.cap,
            z3.Implies(out.regrew, c1.cap == regrow_capacity(d, out.prev, n, c.step)),
            z3.Implies(z3.Not(out.regrew), c1.cap == c.cap),
            c1.wlen == L1, rows_hold_window(d, c1, p1),
        )
        return [content_invariant(d, c, p), n >= 1], goal

    def after_trim(d: Domain) -> tuple[list[Any], Any]:
        c, p = _window_cache(d, "c.")
        _, c1 = trim(d, c, d.var("n"), rules)
        # Logical trims keep the buffer; physical ones cut it to [0, live_len).
        return [content_invariant(d, c, p)], content_invariant(d, c1, p)

    def after_front(d: Domain) -> tuple[list[Any], Any]:
        c, p = _window_cache(d, "c.")
        moved_n = d.var("n")
        k, c1 = trim_front_keep_sink(d, c, moved_n, d.var("keep"), rules)
        # The live rows are compacted into fresh buffers: row i := entry i.
        p1 = Phys(z3.If(k != 0, c1.tok, p.tok), z3.If(k != 0, c1.pos, p.pos))
        return [content_invariant(d, c, p)], content_invariant(d, c1, p1)

    def contract(d: Domain) -> tuple[list[Any], Any]:
        prev, n, step = d.var("prev"), d.var("n"), d.var("step")
        r = regrow_capacity(d, prev, n, step, "ceil_by_add" if rules.regrow == "ceil_by_add" else "spec")
        goal = z3.And(prev + n <= r, r < prev + n + step)
        return [prev >= 0, n >= 1, step >= 1], goal

    return [("regrow_capacity contract: prev + n <= r < prev + n + step", contract),
            ("append: live_len <= capacity, capacity rule, rows below live_len live", after_append),
            ("preserved by trim", after_trim), ("preserved by trim_front_keep_sink", after_front)]


# ---------------------------------------------------------------------------
# Reachable counterexamples for the window obligations: a symbolic prefix
# from the empty cache, in kvtrace token numbering.


class _Prefix:
    """``append a1; trim_front f keep k0; append a2; trim r0`` from an empty
    cache (an op with a 0 count is skipped), so start states include
    front-trimmed caches (live_start > 0) and logically trimmed buffers
    (capacity > live_len)."""

    def __init__(self, d: Domain, rules: Rules, physical: bool = False):
        self.d = d
        c, p = _window_cache(d, "p0.")
        self.vars = {k: z3.Int(f"prefix.{k}") for k in ("a1", "f", "k0", "a2", "r0", "step", "mode")}
        v = self.vars
        self.premises = [
            c.off == 0, c.ls == 0, z3.Not(c.has_buf), z3.Not(c.mk), c.nid == 0, c.wlen == 0,
            c.step == v["step"], c.mode == v["mode"], c.sw == z3.BoolVal(True),
            v["step"] >= 1, v["step"] <= 4, v["mode"] >= 0, v["mode"] < len(MODES),
            v["a1"] >= 1, v["a1"] <= 8, v["f"] >= 0, v["f"] <= 4, v["k0"] >= 0, v["k0"] <= 2,
            v["a2"] >= 0, v["a2"] <= 8, v["r0"] >= 0, v["r0"] <= 4,
        ]
        self.counter = z3.IntVal(0)
        c, p = self._append(c, p, v["a1"], rules, physical)
        k, c1 = trim_front_keep_sink(d, c, v["f"], v["k0"], rules)
        p = Phys(z3.If(k != 0, c1.tok, p.tok), z3.If(k != 0, c1.pos, p.pos))
        c = c1
        c2, p2 = self._append(c, p, v["a2"], rules, physical)
        c, p = select(v["a2"] >= 1, c2, c), Phys(z3.If(v["a2"] >= 1, p2.tok, p.tok), z3.If(v["a2"] >= 1, p2.pos, p.pos))
        _, c = trim(d, c, v["r0"], rules)
        self.cache, self.phys = c, p

    def stages(self) -> list[list[Any]]:
        """Shortest prefixes first (only ``append a1``, then no front trim),
        in the modes the implementation has (Fp16, Int8) first."""
        v = self.vars
        implemented = z3.Or(v["mode"] == FP16, v["mode"] == INT8)
        shapes = [[v["f"] == 0, v["a2"] == 0, v["r0"] == 0, v["a1"] <= 4],
                  [v["f"] == 0, v["a2"] == 0],
                  [v["f"] == 0],
                  []]
        return [[implemented, *s] for s in shapes] + shapes[:-1]

    def tokens(self, n: Any) -> Any:
        """The next n token identities of the kvtrace counter."""
        base = self.counter
        self.counter = self.counter + n
        return self.d.lam(lambda i: base + i)

    def _append(self, c: CacheS, p: Phys, n: Any, rules: Rules, physical: bool) -> tuple[CacheS, Phys]:
        tokens = self.tokens(n)
        _, c1 = append(self.d, c, n, tokens, rules)
        p1 = physical_append(self.d, c, p, n, tokens, rules) if physical else p
        return c1, p1

    def ops(self, m: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        val = {k: m.eval(x, model_completion=True).as_long() for k, x in self.vars.items()}
        ops: list[dict[str, Any]] = [{"op": "append", "n": val["a1"]}]
        if val["f"]:
            ops.append({"op": "trim_front", "n": val["f"], "keep": val["k0"]})
        if val["a2"]:
            ops.append({"op": "append", "n": val["a2"]})
        if val["r0"]:
            ops.append({"op": "trim", "n": val["r0"]})
        return {"mode": MODES[val["mode"]].value, "step": val["step"]}, ops


def _solve(premises: list[Any], bad: Any, stages: list[list[Any]] | None = None, timeout_ms: int = 30_000) -> Any:
    """A model of ``premises and bad``, trying each stage's extra
    constraints first (shorter prefixes give shorter kvtraces)."""
    s = solver(timeout_ms)
    s.add(*premises, bad)
    for extra in [*(stages or []), []]:
        s.push()
        s.add(*extra)
        if s.check() == z3.sat:
            m = s.model()
            s.pop()
            return m
        s.pop()
    return None


def _regrow_reachable(name: str, rules: Rules) -> Callable[[], tuple[Any, Any, str]]:
    def run() -> tuple[Any, Any, str]:
        d = Domain(INT)
        pre = _Prefix(d, rules, physical=True)
        c, p = pre.cache, pre.phys
        n = z3.Int("n")
        tokens = pre.tokens(n)
        out, c1 = append(d, c, n, tokens, rules)
        p1 = physical_append(d, c, p, n, tokens, rules)
        i = z3.Int("dead_row")
        dead = z3.And(i >= 0, i < _L(c1), z3.Or(p1.tok[i] != c1.tok[i], p1.pos[i] != c1.pos[i]))
        wrong_cap = z3.And(out.regrew, c1.cap != regrow_capacity(d, out.prev, n, c.step))
        m = _solve([*pre.premises, n >= 1, n <= 8], z3.Or(dead, wrong_cap), pre.stages())
        if m is None:
            return None, None, "no reachable counterexample from the prefix"
        cache, ops = pre.ops(m)
        nv = m.eval(n).as_long()
        ops.append({"op": "append", "n": nv})
        steps = traces.replay("dense", cache, ops)
        last = steps[-1]
        before = last.before.cache
        values: dict[str, Any] = {"prev": before.live_len, "capacity_before": before.capacity, "n": nv,
                                  "step": cache["step"], "spec_capacity": last.after.cache.capacity}
        if z3.is_true(m.eval(wrong_cap)):
            model_cap = m.eval(c1.cap).as_long()
            values["buggy_capacity"] = model_cap
            ok = model_cap != last.after.cache.capacity and last.result.regrew
            if rules.regrow == "old_guard":
                prev, step = before.live_len, cache["step"]
                base = before.capacity if before.buffer is not None and prev % step == 0 else prev
                ok = ok and model_cap == base + -(-nv // step) * step
            msg = (f"confirmed on spec: after the append the spec's capacity is {last.after.cache.capacity}, "
                   f"the buggy rule gives {model_cap}")
        else:
            row = m.eval(i).as_long()
            values["dead_row"] = row
            values["row_holds"] = m.eval(p1.tok[i]).as_long()
            want = last.after.cache.entries[row].token if row < len(last.after.cache.entries) else None
            ok = want is not None and values["row_holds"] != want and want == m.eval(c1.tok[i]).as_long()
            msg = (f"confirmed on spec: the window's row {row} is token {want}, the buggy rule leaves "
                   f"{'a zero row' if values['row_holds'] == ZERO_ROW else 'token ' + str(values['row_holds'])} there")
        doc = traces.kvtrace(f"negative control {name}", cache, traces.annotate("dense", cache, ops, [None]))
        return doc, values, msg if ok else "model and spec disagree: " + msg

    return run


REGROW_CONTROLS: list[tuple[str, str, Rules, tuple[str, ...], bool]] = [
    ("old_regrow_guard", "cut the buffer before growing only when prev % step != 0 (pre-#1209)",
     Rules(regrow="old_guard"), ("int", "bv32"), True),
    ("append_at_offset", "write the new rows at offset instead of live_len",
     Rules(append_at="offset"), ("int", "bv32"), True),
    ("ceil_by_add", "ceil(n/step) computed as (n + step - 1) // step: overflows in 32 bits",
     Rules(regrow="ceil_by_add"), ("bv32",), False),
]


def prove_regrow() -> ObligationResult:
    t0 = time.perf_counter()
    parts = run_parts(regrow_parts())
    controls = [
        control_from_parts(name, rule, regrow_parts(rules), targets,
                           _regrow_reachable(name, rules) if reach else None)
        for name, rule, rules, targets, reach in REGROW_CONTROLS
    ]
    return ObligationResult(
        3, "regrow rule", ("regrow_needed", "regrow_capacity"),
        "after any append live_len <= capacity, capacity = regrow_capacity on growth, rows below live_len live",
        overall(parts, controls), parts, controls, time.perf_counter() - t0)


# ===========================================================================
# Obligation 4: trim then append equals never having appended the rejected rows


def _window_equal(a: CacheS, b: CacheS, d: Domain) -> Any:
    i = d.var("i")
    return z3.And(a.off == b.off, a.ls == b.ls, a.wlen == b.wlen,
                  z3.ForAll([i], z3.Implies(z3.And(i >= 0, i < a.wlen),
                                            z3.And(a.tok[i] == b.tok[i], a.pos[i] == b.pos[i]))))


def _window_differs(a: CacheS, b: CacheS, i: Any) -> Any:
    return z3.Or(a.off != b.off, a.ls != b.ls, a.wlen != b.wlen,
                 z3.And(i >= 0, i < a.wlen, z3.Or(a.tok[i] != b.tok[i], a.pos[i] != b.pos[i])))


def _trim_append_paths(d: Domain, c: CacheS, rules: Rules, toks: Callable[[str, Any], Any]) -> tuple[CacheS, CacheS, dict[str, Any]]:
    """Path 1: append a (if a >= 1), append r, trim r, append m.
    Path 2: append a (if a >= 1), append m."""
    a, r, m = d.var("a"), d.var("r"), d.var("m")
    A, R, C = toks("A", a), toks("R", r), toks("C", m)
    _, ca = append(d, c, a, A, rules)
    c0 = select(a >= 1, ca, c)
    _, c1 = append(d, c0, r, R, rules)
    _, c1 = trim(d, c1, r, rules)
    _, p1 = append(d, c1, m, C, rules)
    _, p2 = append(d, c0, m, C, rules)
    return p1, p2, {"a": a, "r": r, "m": m}


def trim_append_parts(rules: Rules = SPEC) -> list[tuple[str, PartBuilder]]:
    def build(d: Domain) -> tuple[list[Any], Any]:
        c = cache_vars(d, "c.", window=True)
        p1, p2, v = _trim_append_paths(d, c, rules, lambda name, n: d.array(name))
        pre = [well_formed(d, c), c.wlen == _L(c), v["a"] >= 0, v["r"] >= 1, v["m"] >= 1]
        return pre, _window_equal(p1, p2, d)
    return [("window, positions, offset equal", build)]


def _trim_append_reachable(name: str, rules: Rules) -> Callable[[], tuple[Any, Any, str]]:
    def run() -> tuple[Any, Any, str]:
        d = Domain(INT)
        pre = _Prefix(d, rules)
        p1, p2, v = _trim_append_paths(d, pre.cache, rules, lambda name, n: pre.tokens(n))
        i = z3.Int("i")
        m = _solve([*pre.premises, v["a"] >= 0, v["a"] <= 4, v["r"] >= 1, v["r"] <= 4, v["m"] >= 1, v["m"] <= 4],
                   _window_differs(p1, p2, i), pre.stages())
        if m is None:
            return None, None, "no reachable counterexample from the prefix"
        cache, ops = pre.ops(m)
        a, r, n = (m.eval(v[k]).as_long() for k in ("a", "r", "m"))
        if a:
            ops.append({"op": "append", "n": a})
        ops += [{"op": "append", "n": r}, {"op": "trim", "n": r}, {"op": "append", "n": n}]
        with traces.patched(traces.sd, **dense_controls.patches(rules)):
            bug = traces.replay("dense", cache, ops)[-1].after.cache
        good = traces.replay("dense", cache, ops)[-1].after.cache
        model = {"offset": m.eval(p1.off).as_long(), "wlen": m.eval(p1.wlen).as_long()}
        ok = model == {"offset": bug.offset, "wlen": len(bug.entries)} and (
            bug.offset != good.offset or bug.entries != good.entries)
        values = {"a": a, "r": r, "m": n, "buggy_offset": bug.offset, "spec_offset": good.offset,
                  "buggy_window": list(bug.window()), "spec_window": list(good.window())}
        doc = traces.kvtrace(f"negative control {name}", cache, traces.annotate("dense", cache, ops, [None]))
        msg = (f"confirmed on spec with the bug: offset {bug.offset} window {list(bug.window())}; "
               f"correct: offset {good.offset} window {list(good.window())}")
        return doc, values, msg if ok else "model and spec disagree: " + msg

    return run


TRIM_APPEND_CONTROLS: list[tuple[str, str, Rules]] = [
    ("trim_forgets_offset", "trim cuts the window but leaves the offset", Rules(trim="forgets_offset")),
    ("trim_keeps_rows", "trim moves the offset but keeps the rejected rows (concatenation cache)",
     Rules(trim="keeps_rows")),
]


def prove_trim_append() -> ObligationResult:
    t0 = time.perf_counter()
    parts = run_parts(trim_append_parts(), contracts=True)
    controls = [control_from_parts(name, rule, trim_append_parts(rules), reachable=_trim_append_reachable(name, rules),
                                   contracts=True)
                for name, rule, rules in TRIM_APPEND_CONTROLS]
    return ObligationResult(
        4, "trim then append", ("trim", "append"),
        "append r; trim r; append m gives the window, positions and offset of never appending the r rows",
        overall(parts, controls), parts, controls, time.perf_counter() - t0)


# ===========================================================================
# Obligation 5: front trim


def _front_goal(d: Domain, c: CacheS, c1: CacheS, k: Any, n: Any, keep: Any) -> Any:
    L = _L(c)
    kp = d.clamp(keep, 0, L - d.clamp(n, 0, L))
    i = d.var("i")
    sinks = z3.ForAll([i], z3.Implies(z3.And(i >= 0, i < kp, i < c1.wlen),
                                      z3.And(c1.tok[i] == c.tok[i], c1.pos[i] == c.pos[i])))
    rest = z3.ForAll([i], z3.Implies(z3.And(i >= kp, i < c1.wlen),
                                     z3.And(c1.tok[i] == c.tok[i + k], c1.pos[i] == c.pos[i + k])))
    return z3.And(
        c1.off >= c.off,  # offset never decreases
        c1.ls == c.ls + k,
        _L(c1) == L - k, c1.wlen == _L(c1),  # live_len as specified, window length agrees
        z3.Implies(k != 0, z3.And(k == d.clamp(n, 0, L), kp <= c1.wlen)),
        sinks, rest,  # the first keep entries unchanged, then rows[keep + n:]
    )


def front_parts(rules: Rules = SPEC) -> list[tuple[str, PartBuilder]]:
    def build(d: Domain) -> tuple[list[Any], Any]:
        c = cache_vars(d, "c.", window=True)
        n, keep = d.var("n"), d.var("keep")
        k, c1 = trim_front_keep_sink(d, c, n, keep, rules)
        return [well_formed(d, c), c.wlen == _L(c)], _front_goal(d, c, c1, k, n, keep)
    return [("offset kept, sinks kept, live_len = live_len - clamp(n)", build)]


def _front_reachable(name: str, rules: Rules) -> Callable[[], tuple[Any, Any, str]]:
    def run() -> tuple[Any, Any, str]:
        d = Domain(INT)
        pre = _Prefix(d, rules)
        c = pre.cache
        n, keep = z3.Int("n"), z3.Int("keep")
        k, c1 = trim_front_keep_sink(d, c, n, keep, rules)
        L = _L(c)
        kp = d.clamp(keep, 0, L - d.clamp(n, 0, L))
        i = z3.Int("i")
        bad = z3.Or(c1.off < c.off, c1.wlen != _L(c1), _L(c1) != L - k,
                    z3.And(i >= 0, i < kp, i < c1.wlen, c1.tok[i] != c.tok[i]))
        m = _solve([*pre.premises, n >= 1, n <= 6, keep >= 0, keep <= 8], bad, pre.stages())
        if m is None:
            return None, None, "no reachable counterexample from the prefix"
        cache, ops = pre.ops(m)
        nv, kv = m.eval(n).as_long(), m.eval(keep).as_long()
        ops.append({"op": "trim_front", "n": nv, "keep": kv})
        with traces.patched(traces.sd, **dense_controls.patches(rules)):
            bug = traces.replay("dense", cache, ops)[-1]
        good = traces.replay("dense", cache, ops)[-1]
        model = {"offset": m.eval(c1.off).as_long(), "wlen": m.eval(c1.wlen).as_long()}
        b = bug.after.cache
        ok = model == {"offset": b.offset, "wlen": len(b.entries)} and (
            b.offset < bug.before.cache.offset or len(b.entries) != b.live_len)
        values = {"n": nv, "keep": kv, "offset_before": bug.before.cache.offset, "buggy_offset": b.offset,
                  "buggy_live_len": b.live_len, "buggy_window": list(b.window()),
                  "spec_window": list(good.after.cache.window())}
        doc = traces.kvtrace(f"negative control {name}", cache, traces.annotate("dense", cache, ops, [None]))
        msg = (f"confirmed on spec with the bug: offset {bug.before.cache.offset} -> {b.offset}, live_len "
               f"{b.live_len}, window {list(b.window())}")
        return doc, values, msg if ok else "model and spec disagree: " + msg

    return run


FRONT_CONTROLS: list[tuple[str, str, Rules]] = [
    ("front_trim_decreases_offset", "trim_front_keep_sink moves the offset back instead of live_start forward",
     Rules(front="decreases_offset")),
    ("front_trim_keep_unclamped", "trim_front_keep_sink does not clamp keep to live_len - n",
     Rules(front="keep_unclamped")),
]


def prove_front() -> ObligationResult:
    t0 = time.perf_counter()
    parts = run_parts(front_parts(), contracts=True)
    controls = [control_from_parts(name, rule, front_parts(rules), reachable=_front_reachable(name, rules),
                                   contracts=True)
                for name, rule, rules in FRONT_CONTROLS]
    return ObligationResult(
        5, "front trim", ("trim_front_keep_sink",),
        "offset never decreases, the first keep entries are kept, live_len = live_len - clamp(n, 0, live_len)",
        overall(parts, controls), parts, controls, time.perf_counter() - t0)


OBLIGATIONS: list[tuple[int, Callable[[], ObligationResult]]] = [
    (1, prove_ownership),
    (3, prove_regrow),
    (4, prove_trim_append),
    (5, prove_front),
]
