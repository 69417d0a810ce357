"""``kvspec render``: draw a kvtrace as a timeline (SVG or HTML).

A trace is replayed exactly as ``kvspec replay`` does it (the spec and an
implementation in lockstep, :func:`kvspec.fuzz.replay.make_lockstep`), and the
state the **spec** holds after every op is recorded as a :class:`Frame`:

* one column per op, headed by the op;
* one row per window the spec knows (the live window, each snapshot or
  handle, the held window, each paged sequence, each layer of a list), its
  cells the token identities a fetch returns (docs/kvtrace.md, "Token
  identities");
* one row per physical store: a dense buffer (live rows, the dead tail up to
  the capacity, the ownership marker), a ring's slots (sinks, the write
  cursor, the undo log), a paged block table (block ids and refcounts);
* a badge per op: an append's write path (``in place`` or ``copy``, and
  ``grew`` when it regrew), a refusal (the spec's message), a return value;
* the first divergence: its column outlined, what the implementation held
  beside what the spec says, and the rule it broke (a row of
  docs/semantics.md, :func:`rule_for`) with the spec function that states it
  and the row's own text (:func:`rule_row`).

A trace may come from a stranger (a bug report): every string it carries is
drawn as text, escaped for where it stands with every attribute quoted
(:func:`_esc`), control and bidirectional characters shown as escapes
(:func:`visible`), long strings cut for the layout with the whole string as
a tooltip; the HTML page has no script and no link, and its
Content-Security-Policy (:data:`CSP`) refuses any script.

Everything drawn comes from the spec's state; the implementation is only
asked where it first disagrees. The pictures of the docs site are drawn by
the same code from the worked-example traces (docs/hooks.py).
"""

from __future__ import annotations

import functools
import html
import importlib
import json
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvspec.fuzz.lockstep import Divergence
from kvspec.fuzz.replay import check_ops, make_lockstep
from kvspec.fuzz.targets import resolve
from kvspec.fuzz.trace import Trace
from kvspec.spec.errors import KVCacheError

#: section of docs/semantics.md that states each spec module's rules
SECTIONS = {"kvspec.spec.dense": 2, "kvspec.spec.turbo": 2, "kvspec.spec.rotating": 3, "kvspec.spec.paged": 4, "kvspec.spec.layers": 6,
            "kvspec.spec.recurrent": 9, "kvspec.spec.cells": 10, "kvspec.spec.prefix": 11}


@dataclass(frozen=True)
class Rule:
    """The rule a divergence broke: its name on docs/semantics.md, the spec
    function that states it (``module.function``) and the page section."""

    name: str
    function: str
    section: int

    @property
    def doc(self) -> str:
        """The rule's own text: what its row on docs/semantics.md says
        (:func:`rule_row`, markup dropped); where the section has no row of
        that name (or the page is not there), the first sentence of the spec
        function's docstring."""
        row = rule_row(self.section, self.name)
        if row is not None:
            return row[1]
        module, _, attr = self.function.rpartition(".")
        fn = getattr(importlib.import_module(module), attr)
        text = " ".join((fn.__doc__ or "").replace("``", "").split())
        return text.split(". ")[0].rstrip(".") + "." if text else ""

    def cite(self) -> str:
        return f"semantics.md {self.section}, {self.name}"


#: the contract page the rules' texts are read from
SEMANTICS_MD = Path(__file__).resolve().parents[1] / "docs" / "semantics.md"


def _plain(md: str) -> str:
    """Markdown inline markup dropped: a link becomes its text, code and bold
    marks go, blanks collapse."""
    text = re.sub(r"\[([^[\]]*)\]\([^)]*\)", r"\1", md)
    return " ".join(text.replace("**", "").replace("`", "").split())


@functools.lru_cache(maxsize=1)
def semantics_rules() -> dict[int, list[tuple[str, str]]]:
    """Every rule stated on docs/semantics.md, per section number: ``(name,
    text)`` in page order, markup dropped. A rule is a table row (its name
    the first cell; its text the second cell where the table's second column
    says what the rule says, else the first cell's text after ``name:``) or a
    numbered bold item (``3. **Isolation**: text``). Empty when the page is
    not there."""
    try:
        page_text = SEMANTICS_MD.read_text(encoding="utf-8")
    except OSError:
        return {}
    out: dict[int, list[tuple[str, str]]] = {}
    parts = re.split(r"^## (\d+)\. ", page_text, flags=re.MULTILINE)
    for num, body in zip(parts[1::2], parts[2::2]):
        rules: list[tuple[str, str]] = []
        lines = body.splitlines()
        textual = False
        for k, line in enumerate(lines):
            item = re.match(r"^\d+\. \*\*([^*]+?)\.?\*\*:?\s*(.*)", line)
            if item:
                more = []
                for nxt in lines[k + 1:]:
                    if not nxt.startswith("   ") or not nxt.strip():
                        break
                    more.append(nxt)
                rules.append((_plain(item.group(1)), _plain(" ".join([item.group(2), *more]))))
                continue
            if not line.startswith("| ") or line.startswith("| ---"):
                continue
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            if k + 1 < len(lines) and lines[k + 1].startswith("| ---"):  # a header row
                textual = len(cells) > 1 and cells[1].lower() in ("what it says", "contract", "meaning")
                continue
            first = _plain(cells[0])
            if textual and len(cells) > 1:
                rules.append((first, _plain(cells[1])))
            elif ": " in first and first.partition(": ")[0].count("(") == first.partition(": ")[0].count(")"):
                name, _, text = first.partition(": ")
                rules.append((name, text))
            else:
                rules.append((first, first))
        out[int(num)] = rules
    return out


def rule_row(section: int, name: str) -> tuple[str, str] | None:
    """The row of docs/semantics.md section ``section`` that states the rule
    ``name``: ``(row name, its text)``. The row named exactly (case aside);
    else the one row whose name begins with ``name`` followed by a blank,
    ``(``, ``,`` or ``:`` (``trim_prompt_cache`` is the row
    ``trim_prompt_cache(caches, n)``); None when there is none or more than
    one."""
    rows = semantics_rules().get(section, [])
    key = name.lower()
    exact = [r for r in rows if r[0].lower() == key]
    if exact:
        return exact[0]
    begins = [r for r in rows if r[0].lower().startswith(key) and r[0][len(key):len(key) + 1] in (" ", "(", ",", ":")]
    return begins[0] if len(begins) == 1 else None


@dataclass
class Cell:
    """One box of a row: ``text`` (a token identity, a block id...), ``cls``
    its style (``live``, ``dead``, ``empty``, ``sink``, ``wrong``...)."""

    text: str
    cls: str = "live"
    token: int | None = None
    tip: str = ""


@dataclass
class Row:
    """A row of one column: a window (``view``) or a physical store."""

    label: str
    cells: list[Cell]
    group: str = "view"
    #: a marker drawn after this many cells (the ownership marker, the ring
    #: cursor), with its label
    marks: list[tuple[int, str]] = field(default_factory=list)
    note: str = ""


@dataclass
class Frame:
    """The spec's state after op ``index``."""

    index: int
    op: dict[str, Any]
    rows: list[Row]
    observables: dict[str, Any]
    #: ``in place``, ``copy``, ``refused``, ``returns``... with a detail
    badges: list[tuple[str, str]]
    refused: str | None = None
    diverged: bool = False
    #: the implementation's windows at the divergent op (name -> identities)
    impl_rows: dict[str, list[Any]] = field(default_factory=dict)
    run: bool = True


@dataclass
class Timeline:
    title: str
    cache: dict[str, Any]
    frames: list[Frame]
    divergence: Divergence | None = None
    rule: Rule | None = None
    bug: str | None = None
    implementation: str = "impl"
    #: the third-party target the trace ran on (None: this project's caches)
    target: str | None = None


# -- the rule a divergence broke ----------------------------------------------------

#: per spec module, the function of each kvtrace op (else ``w_<op>``, ``<op>``)
OP_FUNCTIONS: dict[str, dict[str, str]] = {
    "kvspec.spec.dense": {"append": "append", "trim": "trim", "trim_to": "trim_to", "trim_front": "trim_front_keep_sink",
                   "fetch": "view_of", "expect": "view_of"},
    "kvspec.spec.turbo": {"append": "apply_op", "fetch": "apply_op", "expect": "apply_op"},
    "kvspec.spec.rotating": {"trim": "trim", "trim_to": "trim_to", "fetch": "apply_op", "expect": "apply_op"},
    "kvspec.spec.paged": {"snapshot": "snapshots_by_fork", "restore": "snapshots_by_fork", "drop": "snapshots_by_fork",
                   "copy": "copy_refused"},
    "kvspec.spec.layers": {"trim": "trim_prompt_cache", "can_trim": "can_trim_prompt_cache", "layer": "w_layer",
                    "fetch": "view_of", "expect": "view_of"},
}


#: the docs/semantics.md rule of each lifecycle op whose refusal is its own
#: rule (a list's layers each refusing rows; a paged handle refused outright)
LIFECYCLE_RULES: dict[tuple[str, str], str] = {
    ("kvspec.spec.layers", "append_mismatch"): "rows of another batch",
    ("kvspec.spec.layers", "append_pair_mismatch"): "rows of another batch",
    ("kvspec.spec.layers", "copy"): "a copy of the list copies every layer",
    ("kvspec.spec.layers", "trim_refused_late"): "trim_refused_late",
    ("kvspec.spec.paged", "copy"): "copies",
    ("kvspec.spec.paged", "handle_reuse"): "handle reuse",
    ("kvspec.spec.paged", "state_assign"): "state assignment",
    ("kvspec.spec.paged", "append_mismatch"): "append mismatch",
    ("kvspec.spec.paged", "append_pair_mismatch"): "append pair mismatch",
    ("kvspec.spec.paged", "reload"): "prompt-cache files",
}


def _function(module: str, *names: str) -> str:
    mod = importlib.import_module(module)
    for name in names:
        if name and callable(getattr(mod, name, None)):
            return f"{module}.{name}"
    return f"{module}.apply_op"


def op_function(module: str, op: dict[str, Any], world: Any = None) -> str:
    """The spec function that runs ``op`` in ``module`` (``kvspec.spec.rotating``
    splits appends into ``decode`` and ``prefill``)."""
    name = op.get("op", "")
    if module == "kvspec.spec.rotating" and name == "append":
        return _function(module, "decode" if op.get("n") == 1 else "prefill")
    special = OP_FUNCTIONS.get(module, {}).get(name, "")
    return _function(module, special, f"w_{name}", name)


def rule_for(module: str, op: dict[str, Any], what: str, before: Any = None) -> Rule:
    """The rule on docs/semantics.md that the check ``what`` (a
    :class:`Divergence`'s ``what``) enforces for ``op``, in spec module
    ``module`` (``kvspec.spec.dense``...); ``before`` is the spec world before the
    op, where the rule depends on the state (a ring's warm-up or steady
    state)."""
    if module == "kvspec.spec.prefix":
        return _prefix_rule(op, what)
    section = SECTIONS.get(module, 5)
    w = what.lower()
    sharing = any(s in w for s in ("in-place", "isolation", "memory sharing", "inplace", "in place"))
    if module == "kvspec.spec.layers" and sharing:
        module = "kvspec.spec.dense"
    if sharing and op.get("op") == "append":
        if module == "kvspec.spec.rotating":
            cache = getattr(before, "cache", None)
            steady = cache is not None and cache.offset >= cache.max_size
            return Rule("steady state copies" if steady else "warm-up in place",
                        _function(module, "rotating_inplace_allowed"), section)
        if module == "kvspec.spec.paged":
            return Rule("copy on write", _function(module, "needs_copy_on_write"), section)
        if module == "kvspec.spec.turbo":  # the ownership rule's "Fp16 only", stated for the Turbo modes
            return Rule("Turbo writes copy", _function("kvspec.spec.dense", "inplace_write_allowed"), 2)
        return Rule("ownership rule", _function(module, "inplace_write_allowed", "apply_op"), 2)
    if sharing:
        return Rule("Isolation", op_function(module, op), 5)
    if module == "kvspec.spec.recurrent" and "after a rollback" in w:
        # kvspec.fuzz.recurrent probes every rollback the coverage allows after each op
        return Rule("the checkpoint ring", _function(module, "ring"), section)
    if "make_mask" in w or "mask" in w:
        if module == "kvspec.spec.rotating":
            return Rule("mask", _function(module, "mask_visible"), section)
        return Rule("mask", _function("kvspec.spec.dense", "dense_mask_visible"), 2)
    if "capacity" in w and op.get("op") == "append":
        if module in ("kvspec.spec.dense", "kvspec.spec.turbo"):
            return Rule("append: how much", _function("kvspec.spec.dense", "regrow_capacity"), 2)
        if module == "kvspec.spec.paged":
            return Rule("exhaustion", _function(module, "reserve"), section)
    if ("trimmable" in w or "log_saved" in w) and module == "kvspec.spec.rotating":
        return Rule("undo log", _function(module, "trimmable_rows"), section)
    if "refcount" in w or "free" in w or "pool size" in w:
        if op.get("op") == "append" and module == "kvspec.spec.paged":
            return Rule("copy on write", op_function(module, op), section)
        return _op_rule_of(module, op, w, before)
    named = LIFECYCLE_RULES.get((module, op.get("op", "")))
    if named is not None:
        return Rule(named, op_function(module, op), section)
    if "refusal" in w and "error" in op:
        return _op_rule_of(module, op, w, before, refused=True)
    if module == "kvspec.spec.paged" and op.get("op") == "append":
        # a refused append ran out of blocks; any other lands rows in the table
        return (Rule("exhaustion", _function(module, "reserve"), section) if op.get("error") is True
                else Rule("where a row lives", op_function(module, op), section))
    if module == "kvspec.spec.layers" and op.get("op") in ("trim", "can_trim"):
        # section 6 states the list's rules by the function's signature
        fn = op_function(module, op)
        return Rule(fn.rpartition(".")[2], fn, section)
    return _op_rule_of(module, op, w, before)


#: the row of docs/semantics.md 11 each op of the prefix kind runs under
PREFIX_OP_ROWS = {"admit": "admit", "decode": "decode", "free": "release order", "preempt": "preempt and resume",
                  "resume": "preempt and resume", "lookup": "lookup", "free_blocks": "free_blocks", "reset": "reset"}
#: the lockstep's rule (kvspec.fuzz.prefix.RULES, named in a divergence as ``rule
#: 'NAME'``) -> the row of docs/semantics.md 11 and the spec function stating
#: it (None: the op's own row and function)
PREFIX_RULES: dict[str, tuple[str | None, str | None]] = {
    "hit length": ("hit length", "hit_blocks"), "exhaustion": ("room", None), "decode room": ("room", None),
    "reset": ("reset", "reset"), "refcount": ("refcounts", "refcounts_match_tables"),
    "key": ("key to content", "keys_name_contents"), "cached map": ("key to content", "keys_name_contents"),
    "rows": ("key to content", "keys_name_contents"), "pool invariants": ("key to content", "keys_name_contents"),
    "reads": ("partial tail private", "requests_read_their_rows"),
    "nothing changed": ("refusals change nothing", None),
}


def _prefix_rule(op: dict[str, Any], what: str) -> Rule:
    """The row of docs/semantics.md 11 a prefix divergence breaks: the
    lockstep's rule named in ``what`` (``rule 'NAME'``) mapped by
    :data:`PREFIX_RULES`; a free queue's order is the release order after a
    free or preempt and the eviction order (pops from the front) after an
    allocation; a block table, a refusal or a trace's own check, the op's
    own row."""
    module, name = "kvspec.spec.prefix", str(op.get("op", ""))
    got = re.search(r"\(rule '([^']+)'", what)
    rule = got.group(1) if got else ""
    row, fn = PREFIX_RULES.get(rule, (None, None))
    if rule == "free queue":
        row, fn = (("release order", None) if name in ("free", "preempt") else
                   ("eviction", None) if name in ("admit", "decode", "resume") else ("free queue", "free_queue_exact"))
    row = row or PREFIX_OP_ROWS.get(name, "admit")
    return Rule(row, _function(module, fn or "", name, "apply_op"), SECTIONS[module])


def _op_rule_of(module: str, op: dict[str, Any], what: str, before: Any, refused: bool = False) -> Rule:
    """:func:`_op_rule` where the section has that row (``refused``: a
    refusal the trace expects, which the op table states); else the
    section's op table (the row that says which rule each op runs, and which
    ops are refused), and for a section without one the property of
    semantics.md 5 the check is about (Atomicity for a refusal, Window for
    anything else)."""
    name, section = ("", SECTIONS.get(module, 5)) if refused else _op_rule(module, op, what, before)
    if not name or rule_row(section, name) is None:
        table = next((t for t in ("the op table", "op table") if rule_row(section, t) is not None), None)
        if table is not None:
            name = table
        else:
            name, section = ("Atomicity" if "refus" in what or op.get("error") else "Window"), 5
    return Rule(name, op_function(module, op), section)


#: per spec module, the docs/semantics.md row (name, section) that states
#: each kvtrace op's own rule, where no check-specific rule applies
OP_RULES: dict[str, dict[str, tuple[str, int]]] = {
    "kvspec.spec.dense": {"append": ("append: the write", 2), "trim": ("trim(n)", 2), "trim_to": ("trim_to(len)", 2),
                   "trim_front": ("front trim", 2), "gather_positions": ("gather_positions", 2),
                   "gather_within_tail": ("gather_within_tail", 2), "snapshot": ("snapshot", 2),
                   "restore": ("restore", 2), "detach": ("detach / install", 2), "install": ("detach / install", 2),
                   "handle_trim_to": ("handle trim", 2), "drop": ("names", 2), "hold": ("names", 2),
                   "release_hold": ("names", 2)},
    "kvspec.spec.turbo": {"append": ("Turbo row storage", 2), "trim": ("Turbo trims are physical", 2),
                   "trim_to": ("Turbo trims are physical", 2), "gather_positions": ("Turbo trims are physical", 2),
                   "gather_within_tail": ("Turbo trims are physical", 2)},
    "kvspec.spec.rotating": {"trim": ("trim", 3), "trim_to": ("trim_to", 3), "snapshot": ("snapshot / restore", 3),
                      "restore": ("snapshot / restore", 3), "drop": ("op table", 3), "hold": ("op table", 3),
                      "release_hold": ("op table", 3)},
    "kvspec.spec.paged": {"append": ("where a row lives", 4), "trim": ("trim", 4), "trim_to": ("trim", 4),
                   "trim_front": ("front trim", 4), "fork": ("fork / release", 4), "release": ("fork / release", 4)},
    "kvspec.spec.layers": {"snapshot": ("snapshot / restore of the whole list", 6),
                    "restore": ("snapshot / restore of the whole list", 6), "reload": ("reload of the whole list", 6),
                    "restore_mixed": ("restore_mixed", 6), "trim": ("trim_prompt_cache", 6),
                    "can_trim": ("can_trim_prompt_cache", 6), "append": ("append: the write", 2)},
    "kvspec.spec.recurrent": {"append": ("step", 9), "append_unrecorded": ("step", 9), "trim": ("trim", 9),
                       "can_trim": ("is_trimmable", 9), "snapshot": ("snapshot", 9), "restore": ("restore", 9),
                       "state_restore": ("state_restore", 9), "copy": ("copy", 9), "reload": ("reload", 9)},
}

#: the ops whose check is the window itself (semantics.md 5, "rule 1": Window)
WINDOW_OPS = ("fetch", "expect")


def _op_rule(module: str, op: dict[str, Any], what: str, before: Any) -> tuple[str, int]:
    """The row (name, section) of docs/semantics.md stating ``op``'s own rule
    in ``module``: :data:`OP_RULES`; a ring's append is a decode or a
    multi-row append; Turbo4Delegated's appends and trims follow its fold and
    trim rules; a fetch's window is the Window property; else the op's name in
    the module's section."""
    name = str(op.get("op", ""))
    section = SECTIONS.get(module, 5)
    if name in WINDOW_OPS:
        return ("Window", 5)
    if module == "kvspec.spec.rotating" and name == "append":
        return ("decode (one row)" if op.get("n") == 1 else "multi-row append", 3)
    if module == "kvspec.spec.dense" and name == "trim" and "capacity" in what:
        # a trim to zero drops every buffer (trim(n)); any other keeps capacity
        cache = getattr(before, "cache", None)
        emptied = cache is not None and int(op.get("n", 0)) >= getattr(cache, "live_len", 0)
        return ("trim(n)" if emptied else "trim is logical", 2)
    if module == "kvspec.spec.turbo":
        cache = getattr(getattr(before, "dense", None), "cache", None)
        if str(getattr(getattr(cache, "mode", ""), "value", "")) == "turbo4delegated":
            if name == "append":
                return ("Delegated fold schedule", 2)
            if name in ("trim", "trim_to"):
                return ("Delegated trim", 2)
            if name == "gather_positions":
                return ("Delegated gathers", 2)
        got = OP_RULES[module].get(name) or OP_RULES["kvspec.spec.dense"].get(name)
        return got or (name or "the op table", section)
    return OP_RULES.get(module, {}).get(name) or (name or "op table", section)


# -- the state the spec holds ------------------------------------------------------

def _tok(e: Any) -> Cell:
    if e is None:
        return Cell("", "empty", tip="never written")
    t = getattr(e, "token", e)
    return Cell(str(t), "live", t if isinstance(t, int) else None)


def _dense_rows(world: Any, prefix: str = "") -> list[Row]:
    c = world.cache
    cap = 0 if c.buffer is None else c.buffer.capacity
    cells = [_tok(e) for e in c.entries]
    cells += [Cell("", "dead", tip="dead row: never read") for _ in range(max(0, cap - len(cells)))]
    marks = []
    if c.marker is not None and c.buffer is not None and c.marker.buffer == c.buffer.ident:
        marks.append((c.marker.live_len, "marker"))
    elif c.marker is not None:
        marks.append((c.marker.live_len, "stale marker"))
    ident = "no buffer" if c.buffer is None else f"#{c.buffer.ident}"
    note = f"{ident} cap {cap}" + (f", live from {c.live_start}" if c.live_start else "")
    rows = [Row(f"{prefix}buffer", cells, "store", marks, note)]
    if hasattr(world, "cold_offset"):
        rows[0].note += f", cold {world.cold_offset}"
    return rows


def _ring_rows(world: Any, prefix: str = "") -> list[Row]:
    c = world.cache
    cells = []
    for slot, e in enumerate(c.slots):
        cell = _tok(e)
        if slot < c.keep and e is not None:
            cell.cls = "sink"
        cells.append(cell)
    marks = [(c.idx, "idx")]
    note = f"#{c.ident} cap {len(c.slots)}, W {c.max_size}, K {c.keep}" + (" wrapped" if c.offset != c.idx else "")
    rows = [Row(f"{prefix}ring slots", cells, "store", marks, note)]
    if c.undo:
        saved = [Cell(str(e.token), "saved", e.token) for r in c.log for e in r.saved]
        kinds = ", ".join(f"{r.kind} {r.rows}" for r in c.log) or "empty"
        rows.append(Row(f"{prefix}undo log", saved, "store", [], f"U {c.undo}: {kinds}"))
    return rows


def _recurrent_rows(world: Any, prefix: str = "") -> list[Row]:
    """A recurrent layer (kvspec.spec.recurrent): its conv window by token (empty:
    a zero row before the first token) and, at depth U > 0, its checkpoint
    ring's U + 1 slots, each the offset whose checkpoint it holds."""
    from kvspec.spec import recurrent

    c = world.cache
    conv = [Cell("", "empty", tip="zero row (before the first token)") if t is None else _tok(t)
            for t in recurrent.conv_window(c)]
    state = "no state" if c.size == 1 else f"state after {c.offset} tokens"
    rows = [Row(f"{prefix}conv window", conv, "store", [], f"kernel {c.kernel}, {state}")]
    if c.depth:
        slots = [Cell("", "empty", tip="no live checkpoint") if x is None
                 else Cell(f"@{x}", "saved", tip=f"the checkpoint of offset {x}") for x in recurrent.ring(c)]
        rows.append(Row(f"{prefix}checkpoints", slots, "store", [(c.offset % (c.depth + 1), "idx")],
                        f"U {c.depth}, coverage {recurrent.trimmable_rows(c)}"))
    return rows


def _paged_rows(world: Any) -> list[Row]:
    rc = world.pool.refcounts
    rows = []
    for name, seq in sorted(world.seqs.items()):
        cells = []
        for b in seq.table:
            if b is None:
                cells.append(Cell("-", "dead", tip="released by a front trim"))
            else:
                cells.append(Cell(str(b), "shared" if rc[b] > 1 else "block", tip=f"block {b}, refcount {rc[b]}"))
        rows.append(Row(f"table {name}", cells, "store", [], f"len {seq.length}, start {seq.start}"))
    free = len(world.pool.free)
    rows.append(Row("refcounts", [Cell(str(r), "shared" if r > 1 else ("block" if r else "empty"),
                                       tip=f"block {i}") for i, r in enumerate(rc)], "store", [],
                    f"pool {len(rc)} blocks, {free} free"))
    return rows


def _cells_rows(world: Any, op: dict[str, Any] | None = None) -> list[Row]:
    """A cells memory's stores (``kvspec.spec.cells``): per store its present
    cells by position (token colour, a shared cell orange), then its free
    cells (dashed) up to the store's size, then its lost cells (hatched,
    window store: dropped, kept as logical positions); a cell the op's
    recorded ``drops`` dropped is outlined in red."""
    from kvspec.spec import cells as sc

    m = world.memory
    dropped: set[tuple[int, frozenset[int], int]] = set()
    for item in (op or {}).get("drops") or []:  # checked by the replay before the op ran
        key, seq = sc.drop_item(item)
        dropped.add((key[0], key[1] if seq is None else frozenset({seq}), key[2]))
    rows = []
    for name in m.config.stores:
        cells = []
        for c in sorted(m.present(name), key=lambda c: (c.pos, sorted(c.seqs))):
            seqs = ",".join(map(str, sorted(c.seqs)))
            cells.append(Cell(str(c.token), "shared" if len(c.seqs) > 1 else "live", c.token,
                              tip=f"pos {c.pos}, seqs {{{seqs}}}, token {c.token}"))
        free = sc.free_cells(m, name)
        cells += [Cell("", "empty", tip="free cell") for _ in range(free)]
        for c in sorted((c for c in m.store(name) if c.lost), key=lambda c: (c.pos, sorted(c.seqs))):
            seqs = ",".join(map(str, sorted(c.seqs)))
            hit = (c.pos, c.seqs, c.token) in dropped
            cells.append(Cell(str(c.pos), "wrong" if hit else "dead",
                              tip=f"lost: pos {c.pos}, seqs {{{seqs}}}, token {c.token}"
                                  + (" (dropped by this op: its recorded drops)" if hit else "")))
        lost = sum(1 for c in m.store(name) if c.lost)
        note = f"{m.config.size(name)} cells, {free} free" + (f", {lost} lost" if lost else "")
        rows.append(Row(f"{name} store", cells, "store", [], note))
    return rows


def _prefix_key(key: Any) -> str:
    salt, tokens = key
    return f"{list(tokens)}" + ("" if salt is None else f" salt {salt}")


def _prefix_rows(world: Any) -> list[Row]:
    """A prefix pool (``kvspec.spec.prefix``): per request its block table (a
    shared block orange, an entry the sliding window released ``-``, a
    preempted request's table empty), then every
    block by id (its refcount: held blue, shared orange, cached-free
    purple, free unkeyed dashed; its key in the tooltip), then the free
    queue front to back (a cached-free block purple: it can still be hit)."""
    blocks = world.blocks
    rows = []
    for name, q in world.requests.items():
        cells = [Cell("-", "dead", tip="released: wholly before the sliding window") if b is None
                 else Cell(str(b), "shared" if blocks[b].refcount > 1 else "block",
                           tip=f"block {b}, refcount {blocks[b].refcount}"
                               + (f", key {_prefix_key(blocks[b].key)}" if blocks[b].key is not None else ", no key"))
                 for b in q.table]
        salt = "" if q.salt is None else f", salt {q.salt}"
        rows.append(Row(f"table {name}", cells, "store", [],
                        f"{len(q.tokens)} tokens{salt}" + ("" if q.live else ", preempted")))
    cells = []
    for b, blk in enumerate(blocks):
        key = f"key {_prefix_key(blk.key)}" if blk.key is not None else "no key"
        if blk.refcount > 0:
            cells.append(Cell(str(blk.refcount), "shared" if blk.refcount > 1 else "block",
                              tip=f"block {b}: refcount {blk.refcount}, {key}"))
        elif blk.key is not None:
            cells.append(Cell("0", "saved", tip=f"block {b}: cached-free, {key}"))
        else:
            cells.append(Cell("", "empty", tip=f"block {b}: free, no key"))
    n_keys = len(world.cached)
    rows.append(Row("refcounts", cells, "store", [], f"{len(blocks)} blocks, {n_keys} key{'s' * (n_keys != 1)}"))
    queue = [Cell(str(b), "saved" if blocks[b].key is not None else "empty",
                  tip=f"block {b}" + (f": cached-free, key {_prefix_key(blocks[b].key)}" if blocks[b].key is not None
                                      else ": free, no key"))
             for b in world.free]
    rows.append(Row("free queue", queue, "store", [], f"{len(world.free)} free, front first"))
    return rows


def physical_rows(world: Any, op: dict[str, Any] | None = None) -> list[Row]:
    """The physical stores of a spec world, whatever its kind (``op``: the
    op just run, for a cells memory's recorded drops)."""
    if hasattr(getattr(world, "memory", None), "config"):
        return _cells_rows(world, op)
    if hasattr(world, "cached") and hasattr(world, "requests"):
        return _prefix_rows(world)
    if hasattr(world, "layers"):
        out = []
        for j, w in enumerate(world.layers):
            out += physical_rows_one(w, f"L{j} ")
        return out
    return physical_rows_one(world)


def physical_rows_one(world: Any, prefix: str = "") -> list[Row]:
    if hasattr(world, "pool"):
        return _paged_rows(world)
    cache = getattr(world, "cache", None)
    if cache is None:
        return []
    if hasattr(cache, "coverage"):
        return _recurrent_rows(world, prefix)
    if hasattr(cache, "slots"):
        return _ring_rows(world, prefix)
    if hasattr(cache, "entries"):
        return _dense_rows(world, prefix)
    return []


def _view_label(name: str) -> str:
    if name == "cache":
        return "live window"
    if name.startswith("holder:"):
        return "holder " + name.split(":", 1)[1]
    if name.startswith("seq:"):
        return "seq " + name.split(":", 1)[1]
    if name.startswith("req:"):
        return "request " + name.split(":", 1)[1]
    return name


def _shorten(op: dict[str, Any]) -> str:
    body = {k: v for k, v in op.items() if k != "op"}
    args = " ".join(f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in body.items())
    return f"{op['op']} {args}".strip()


# -- running the trace ---------------------------------------------------------------

def timeline(trace: Trace, factories: dict[str, Any] | None = None, bug: str | None = None,
             check_inplace: bool = True, target: Any = "impl") -> Timeline:
    """Replay ``trace`` (on an injected bug's classes with ``factories``, or
    on ``target``, a name or a ``kvspec.fuzz.targets.Target``, as ``kvspec replay
    --target`` does) and record the spec's state after every op up to the
    first divergence; the ops after it are listed, not run. Raises
    TraceFormatError as replay does (TargetCapabilityError when the target
    cannot run the trace), TargetError for a target that names nothing."""
    check_ops(trace.cache, trace.ops)
    tgt = resolve(target)
    tgt.check(trace.cache, trace.ops)
    lock = make_lockstep(trace.cache, factories, check_inplace, tgt)
    module = lock.spec_module.__name__
    seen: dict[str, Any] = {}
    spec_apply = lock.spec_apply

    def spy(op: dict[str, Any]) -> tuple[Any, Any]:
        seen.clear()
        try:
            result, world = spec_apply(op)
        except KVCacheError as exc:
            seen["error"] = exc
            raise
        seen["result"], seen["world"] = result, world
        return result, world

    lock.spec_apply = spy  # type: ignore[method-assign]
    frames: list[Frame] = []
    out = Timeline(trace.title, trace.cache, frames, bug=bug, implementation=lock.impl_name,
                   target=None if tgt.is_impl else tgt.label)
    for i, op in enumerate(trace.ops):
        before = lock.world
        seen.clear()
        divergence = None
        try:
            lock.step(i, op)
        except Divergence as d:
            divergence = d
            if "world" in seen and lock.world is before:
                lock.world = seen["world"]  # the spec's state after the op, for the picture
        frame = _frame(lock, i, op, seen)
        frames.append(frame)
        if divergence is not None:
            frame.diverged = True
            frame.badges.insert(0, ("diverged", (f"{divergence.what}: {divergence.labels[0]} {divergence.spec}, "
                                                f"{divergence.labels[1]} {divergence.impl}")))
            who = divergence.labels[1].removesuffix(" did").removesuffix(" expects")
            frame.badges.append((f"{who}: {_clip(divergence.impl, 30)}", f"{divergence.labels[1]}: {divergence.impl}"))
            out.divergence = divergence
            out.rule = rule_for(module, op, divergence.what, before)
            try:
                impl = lock.impl_views()
                frame.impl_rows = {n: lock.identify(a, lock.view_mode(n)) for n, a in impl.items()}
            except Exception:  # noqa: BLE001 - a broken implementation may not even fetch
                frame.impl_rows = {}
            for j in range(i + 1, len(trace.ops)):
                frames.append(Frame(j, trace.ops[j], [], {}, [("not run", "after the first divergence")], run=False))
            break
    return out


def _frame(lock: Any, index: int, op: dict[str, Any], seen: dict[str, Any]) -> Frame:
    badges: list[tuple[str, str]] = []
    refused = None
    if "error" in seen:
        refused = f"{type(seen['error']).__name__}: {seen['error']}"
        badges.append(("refused", refused))
    elif "result" in seen:
        r = seen["result"]
        if isinstance(r, tuple) and r and all(hasattr(x, "inplace") for x in r):
            # a list of layers: one result per layer
            paths = {x.inplace for x in r}
            if len(paths) == 1:
                badges.append(("in place", "every layer wrote in place") if r[0].inplace
                              else ("copy", "every layer wrote by a copying write"))
            else:
                badges += [(f"L{j} {'in place' if x.inplace else 'copy'}", f"layer {j}") for j, x in enumerate(r)]
        elif hasattr(r, "inplace"):
            badges.append(("in place", "written into the buffer it shares") if r.inplace
                          else ("copy", "a copying write into new private buffers"))
            if getattr(r, "regrew", False):
                badges.append(("grew", "the buffer regrew"))
        elif op["op"] not in ("fetch", "snapshot", "restore", "drop", "hold", "release_hold", "detach",
                              "install") and r is not None and not isinstance(r, (tuple, list)):
            badges.append(("returns", json.dumps(r)))
    elif op["op"] == "expect":
        badges.append(("expect", json.dumps(op.get("window"))))
    views = lock.spec_views()
    rows = [Row(_view_label(name), [_tok(t) for t in toks], "view", note=name) for name, toks in views.items()]
    rows += physical_rows(lock.world, op)
    try:
        obs = lock.spec_observables()
    except Exception:  # noqa: BLE001 - a state the observables cannot describe
        obs = {}
    return Frame(index, op, rows, obs, badges, refused)


# -- drawing ------------------------------------------------------------------------

CELL = 18
GUTTER = 150
HEAD = 58
PAD = 12

STYLE = """
.kvr text { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 10px; fill: #222; }
.kvr .lab { font-size: 11px; fill: #444; }
.kvr .op { font-size: 11px; font-weight: bold; }
.kvr .small { font-size: 9px; fill: #555; }
.kvr .live { stroke: #555; }
.kvr .dead { fill: url(#kvr-hatch); stroke: #aaa; }
.kvr .empty { fill: #fff; stroke: #ccc; stroke-dasharray: 2 2; }
.kvr .sink { stroke: #000; stroke-width: 2; }
.kvr .block { fill: #dfe9f7; stroke: #557; }
.kvr .shared { fill: #f7d9a8; stroke: #a60; }
.kvr .saved { fill: #e8e0f5; stroke: #649; }
.kvr .wrong { fill: #ffb3b3; stroke: #c00; stroke-width: 2; }
.kvr .b-inplace { fill: #c8f0c8; stroke: #2a2; }
.kvr .b-copy { fill: #ffe0b0; stroke: #c70; }
.kvr .b-refused { fill: #ffd0d0; stroke: #c00; }
.kvr .b-diverged { fill: #d00; stroke: #900; }
.kvr .b-diverged + text, .kvr g.b-diverged text { fill: #fff; font-weight: bold; }
.kvr .b-impl { fill: #fff; stroke: #d00; stroke-width: 1.5; }
.kvr g.badge text { stroke: none; }
.kvr .b-other { fill: #eee; stroke: #999; }
.kvr .col-diverged { fill: #fff0f0; stroke: #d00; stroke-width: 3; }
.kvr .col { fill: #fafafa; stroke: #e4e4e4; }
.kvr .col-notrun { fill: #f2f2f2; stroke: #e4e4e4; }
.kvr .mark { stroke: #d00; stroke-width: 2.5; }
.kvr .idx { stroke: #06c; stroke-width: 2.5; }
.kvr .callout { fill: #fff5f5; stroke: #d00; stroke-width: 1.5; }
"""


#: bidirectional controls: shown as escapes, so a trace's text cannot
#: reorder what is drawn around it
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")

#: longest badge text drawn (longer ones end at a word with an ellipsis; the
#: whole text is the badge's tooltip and is in the HTML page's ops table)
BADGE_CHARS = 40
#: longest row label drawn in the gutter (the whole label is its tooltip)
LABEL_CHARS = 19
#: longest trace title the HTML page shows above the picture (the picture
#: draws its first lines too)
TITLE_CHARS = 1000


def visible(s: Any) -> str:
    """``str(s)`` as one line of plain text: tab, line feed and carriage
    return become blanks (an array's repr spans lines), and every other
    character that is not plain text is written as an escape (``\\xNN``
    below U+0100, else ``\\uNNNN``): the other control characters (C0 and
    C1), lone surrogates, U+FFFE and U+FFFF (XML refuses all of them) and
    the bidirectional controls. A trace's strings come from strangers: drawn
    through this, a name shows what it is, and the SVG stays well-formed
    XML."""
    out = []
    for ch in str(s):
        o = ord(ch)
        if ch in "\t\n\r":
            out.append(" ")
        elif unicodedata.category(ch) in ("Cc", "Cs") or ch in _BIDI or o in (0xFFFE, 0xFFFF):
            out.append(f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}")
        else:
            out.append(ch)
    return "".join(out)


def _esc(s: Any) -> str:
    """``s`` as SVG/HTML text or a quoted attribute value: :func:`visible`,
    then ``&``, ``<``, ``>``, ``"`` and ``'`` escaped (every attribute this
    module writes is double-quoted)."""
    return html.escape(visible(s), quote=True)


def _word(ch: str) -> bool:
    return ch.isalnum() or ch in "._-"


def _clip(text: Any, limit: int) -> str:
    """:func:`visible` ``text`` cut to at most ``limit`` characters, with an
    ellipsis where anything was cut: after the last word that ends in the
    second half (at a blank), else after the last word or punctuation there
    (``(array([[`` rather than a number's first digits); only a word
    reaching over the second half is cut inside."""
    text = visible(text)
    if len(text) <= limit:
        return text
    room = max(1, limit - 1)
    space = text.rfind(" ", 0, room + 1)
    if space >= limit // 2:
        end = space
    else:
        end = next((j for j in range(room, limit // 2 - 1, -1) if not _word(text[j - 1]) or not _word(text[j])),
                   room)
    return text[:end].rstrip(" ,;:") + "\u2026"


def _lines(text: Any, width: int, most: int) -> list[str]:
    """:func:`_wrap` to ``width``, at most ``most`` lines, the last one
    ending in an ellipsis where lines were left out."""
    lines = _wrap(visible(text), width)
    if len(lines) <= most:
        return lines
    return lines[: most - 1] + [_clip(lines[most - 1] + " " + lines[most], width)]


def _badge_text(name: str, detail: str) -> str:
    """What a badge shows: its name (``returns`` and ``expect`` with their
    value), :func:`_clip` to :data:`BADGE_CHARS`."""
    return _clip(name if name not in ("returns", "expect") else f"{name} {detail}", BADGE_CHARS)


def _color(token: int | None) -> str:
    if token is None:
        return "#fff"
    return f"hsl({(token * 47) % 360},65%,82%)"


def _rows_of(tl: Timeline) -> list[tuple[str, str]]:
    """Every (group, label) row of the timeline, in order of appearance:
    windows first, then physical stores."""
    order: dict[tuple[str, str], None] = {}
    for f in tl.frames:
        for r in f.rows:
            if r.group == "view":
                order.setdefault((r.group, r.label), None)
    for f in tl.frames:
        for r in f.rows:
            if r.group != "view":
                order.setdefault((r.group, r.label), None)
    return list(order)


#: the cache fields a cells trace's header shows (its mode, step and in-place
#: switch mean nothing to a cells memory)
CELLS_HEADER = ("kind", "n_cells", "window_cells", "window", "stores", "n_seq")
#: the cache fields a prefix trace's header shows (its mode, step, batch and
#: in-place switch mean nothing to a prefix pool)
PREFIX_HEADER = ("kind", "block_size", "n_blocks", "window")


def _header_fields(cache: dict[str, Any]) -> list[tuple[str, Any]]:
    """The cache fields the picture's header lists: a cells trace's
    :data:`CELLS_HEADER` (``window_cells`` as ``n_cells`` when absent), a
    prefix trace's :data:`PREFIX_HEADER`,
    any other's fields but batch, kv_heads, head_dim and dtype."""
    if cache.get("kind") == "cells":
        got = {**cache}
        if got.get("window_cells") in (None, "n_cells"):
            got["window_cells"] = got.get("n_cells")
        return [(k, got.get(k)) for k in CELLS_HEADER]
    if cache.get("kind") == "prefix":
        return [(k, cache.get(k)) for k in PREFIX_HEADER]
    return [(k, v) for k, v in cache.items() if k not in ("batch", "kv_heads", "head_dim", "dtype")]


def svg(tl: Timeline, standalone: bool = True) -> str:
    """The timeline as one SVG document (``standalone=False``: an inline
    ``<svg>`` element for an HTML page)."""
    rows = _rows_of(tl)
    widths = []
    for f in tl.frames:
        n = max([len(r.cells) for r in f.rows] + [len(v) for v in f.impl_rows.values()] + [3])
        badge = max([len(_badge_text(name, detail)) * 6 + 8 for name, detail in f.badges] + [0])
        widths.append(max(n * CELL + 2 * PAD, 104, badge + 2 * PAD))
    row_h = []
    for key in rows:
        two = any(f.impl_rows and any(r.label == key[1] and r.group == "view" for r in f.rows) for f in tl.frames)
        row_h.append(2 * CELL + 14 if two else (CELL + 30 if key[0] == "store" else CELL + 16))
    obs_h = 56
    top = HEAD + 62
    height = top + sum(row_h) + obs_h + PAD
    callout = []
    if tl.divergence is not None:
        d, rule = tl.divergence, tl.rule
        callout = [
            f"first divergence at op {d.index} {_shorten(d.op)}: {d.what}",
            f"rule broken: {rule.cite()} (spec function {rule.function})" if rule else "",
            f"  {rule.doc}" if rule and rule.doc else "",
            f"{d.labels[0]}: {_short(d.spec)}",
            f"{d.labels[1]}: {_short(d.impl)}",
        ]
        wide = max(80, (GUTTER + sum(widths) - 2 * PAD) // 6)
        callout = [part for c in callout if c for part in _wrap(c, wide)]
    call_h = (len(callout) * 15 + 16) if callout else 0
    width = GUTTER + sum(widths) + PAD
    width = max(width, max([len(c) * 6 + 40 for c in callout] + [560]))
    title_lines = _lines(tl.title, max(60, (width - 2 * PAD) // 7), 4) if tl.title else []
    cfg = ", ".join(f"{k} {v}" for k, v in _header_fields(tl.cache))
    cfg += f" | injected bug {tl.bug}" if tl.bug else ""
    cfg += f" | target {tl.target}" if tl.target else ""
    cfg_lines = _wrap(cfg, max(60, (width - 2 * PAD) // 6))
    title_h = 16 * len(title_lines) + 12 * len(cfg_lines)
    total_h = height + call_h + title_h + PAD
    out = []
    attrs = f'width="{width}" height="{total_h}" viewBox="0 0 {width} {total_h}"'
    ns = ' xmlns="http://www.w3.org/2000/svg"'
    div = f' data-diverged-op="{tl.divergence.index}"' if tl.divergence is not None else ""
    out.append(f'<svg{ns} class="kvr" {attrs} role="img"{div}>')
    out.append(f"<title>{_esc(tl.title or 'kvtrace timeline')}</title>")
    out.append(f"<style>{STYLE}</style>")
    out.append('<defs><pattern id="kvr-hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
               'patternTransform="rotate(45)"><rect width="6" height="6" fill="#eee"/>'
               '<line x1="0" y1="0" x2="0" y2="6" stroke="#bbb" stroke-width="2"/></pattern></defs>')
    out.append(f'<rect x="0" y="0" width="{width}" height="{total_h}" fill="#fff"/>')
    y0 = PAD
    for line in title_lines:
        out.append(f'<text class="lab" x="{PAD}" y="{y0 + 10}">{_esc(line)}</text>')
        y0 += 16
    for line in cfg_lines:
        out.append(f'<text class="small" x="{PAD}" y="{y0 + 10}">{_esc(line)}</text>')
        y0 += 12
    # row labels
    y = y0 + top
    for (group, label), h in zip(rows, row_h):
        out.append(f'<text class="lab" x="{PAD}" y="{y + 13}"><title>{_esc(label)}</title>'
                   f'{_esc(_clip(label, LABEL_CHARS))}</text>')
        y += h
    out.append(f'<text class="lab" x="{PAD}" y="{y + 13}">counters</text>')
    x = GUTTER
    for f, w in zip(tl.frames, widths):
        cls = "col-diverged" if f.diverged else ("col" if f.run else "col-notrun")
        extra = ' data-diverged="true"' if f.diverged else ""
        out.append(f'<g class="opcol" data-op="{f.index}"{extra}>')
        out.append(f'<rect class="{cls}" x="{x + 2}" y="{y0 + 2}" width="{w - 4}" height="{height - 4}" rx="4"/>')
        out.append(f'<text class="op" x="{x + PAD}" y="{y0 + 16}">op {f.index}</text>')
        label = _shorten(f.op)
        chars = max(8, (w - 2 * PAD) // 6)
        for k, part in enumerate(_lines(label, chars, 2)):
            out.append(f'<text x="{x + PAD}" y="{y0 + 30 + 12 * k}"><title>{_esc(label)}</title>{_esc(part)}</text>')
        bx, by = x + PAD, y0 + HEAD
        for name, detail in f.badges:
            bcls = {"in place": "b-inplace", "copy": "b-copy", "refused": "b-refused", "diverged": "b-diverged"}.get(
                name.split(" ", 1)[1] if name.startswith("L") and name[1:2].isdigit() else name, "b-impl" if detail.startswith(tuple(f"{lab}:" for lab in ("impl did", "mlx-lm did", "trace expects")))
                or ": " in name else "b-other")
            text = _badge_text(name, detail)
            bw = len(text) * 6 + 8
            if bx > x + PAD and bx + bw > x + w - 4:
                bx, by = x + PAD, by + 18
            tfill = ' style="fill:#fff;font-weight:bold"' if bcls == "b-diverged" else ""
            out.append(f'<g class="badge {bcls}" data-badge="{_esc(name)}"><title>{_esc(detail)}</title>'
                       f'<rect class="{bcls}" x="{bx}" y="{by}" width="{bw}" height="16" rx="3"/>'
                       f'<text x="{bx + 4}" y="{by + 12}"{tfill}>{_esc(text)}</text></g>')
            bx += bw + 4
        y = y0 + top
        by_key = {(r.group, r.label): r for r in f.rows}
        for key, h in zip(rows, row_h):
            r = by_key.get(key)
            if r is not None:
                out.append(_cells(r, x + PAD, y + 2, f.impl_rows.get(r.note) if f.diverged and r.group == "view"
                                  else None, chars))
            y += h
        if f.run:
            obs = [f"{k} {v}" for k, v in f.observables.items() if not isinstance(v, (dict, list))]
            for k, part in enumerate(_lines(", ".join(obs), chars, 4)):
                out.append(f'<text class="small" x="{x + PAD}" y="{y + 11 + 11 * k}">{_esc(part)}</text>')
        out.append("</g>")
        x += w
    if callout:
        cy = height + title_h + PAD
        out.append(f'<g class="divergence"><rect class="callout" x="{PAD}" y="{cy}" width="{width - 2 * PAD}" '
                   f'height="{call_h - 4}" rx="4"/>')
        for k, line in enumerate(callout):
            weight = ' font-weight="bold"' if k == 0 else ""
            out.append(f'<text x="{PAD + 8}" y="{cy + 16 + 15 * k}"{weight}>{_esc(line)}</text>')
        out.append("</g>")
    out.append("</svg>")
    text = "\n".join(out)
    return ('<?xml version="1.0" encoding="UTF-8"?>\n' + text + "\n") if standalone else text


def _cells(r: Row, x: int, y: int, impl: list[Any] | None, chars: int = 20) -> str:
    parts = [f'<g class="row" data-row="{_esc(r.label)}"><title>{_esc(r.label)}: {_esc(r.note)}</title>']
    for j, c in enumerate(r.cells):
        fill = _color(c.token) if c.cls in ("live", "sink") else None
        style = f' style="fill:{fill}"' if fill else ""
        tip = f"<title>{_esc(c.tip)}</title>" if c.tip else ""
        parts.append(f'<rect class="{c.cls}"{style} x="{x + j * CELL}" y="{y}" width="{CELL - 2}" '
                     f'height="{CELL - 2}" rx="2">{tip}</rect>')
        if c.text:
            parts.append(f'<text x="{x + j * CELL + 2}" y="{y + 12}">{_esc(c.text[:3])}</text>')
    for pos, label in r.marks:
        mx_ = x + pos * CELL - 1
        cls = "idx" if label == "idx" else "mark"
        parts.append(f'<line class="{cls}" x1="{mx_}" y1="{y - 3}" x2="{mx_}" y2="{y + CELL + 1}">'
                     f"<title>{_esc(label)} at {pos}</title></line>")
    if r.group == "store" and r.note:
        for k, line in enumerate(_lines(r.note, chars, 2)):
            parts.append(f'<text class="small" x="{x}" y="{y + CELL + 9 + 10 * k}">{_esc(line)}</text>')
    if impl is not None:
        want = [c.text for c in r.cells]
        iy = y + CELL + 2
        for j, t in enumerate(impl):
            cls = "live" if j < len(want) and str(t) == want[j] else "wrong"
            tok = t if isinstance(t, int) else None
            style = f' style="fill:{_color(tok)}"' if cls == "live" else ""
            parts.append(f'<rect class="{cls} impl"{style} x="{x + j * CELL}" y="{iy}" width="{CELL - 2}" '
                         f'height="{CELL - 2}" rx="2"><title>implementation: {_esc(t)}</title></rect>')
            parts.append(f'<text x="{x + j * CELL + 2}" y="{iy + 12}">{_esc(str(t)[:3])}</text>')
        differs = len(impl) != len(want) or any(str(a) != b for a, b in zip(impl, want))
        parts.append(f'<text class="small" x="{x + max(len(impl), 1) * CELL + 2}" y="{iy + 12}" '
                     f'fill="{"#c00" if differs else "#555"}">impl{" differs" if differs else ""}</text>')
    parts.append("</g>")
    return "".join(parts)


def _short(x: Any, limit: int = 150) -> str:
    s = str(x)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _wrap(text: str, width: int) -> list[str]:
    words, lines, cur = text.split(" "), [], ""
    for w in words:
        while len(w) > width:
            if cur:
                lines.append(cur)
                cur = ""
            lines.append(w[:width])
            w = w[width:]
        if cur and len(cur) + 1 + len(w) > width:
            lines.append(cur)
            cur = w
        else:
            cur = f"{cur} {w}" if cur else w
    if cur:
        lines.append(cur)
    return lines


#: the page's Content-Security-Policy: no script at all (the page has none),
#: nothing fetched but its own inline styles and the empty data: icon, no
#: form, no base URL
CSP = "default-src 'none'; script-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"
CSP_META = f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'


def page(tl: Timeline, source: str = "") -> str:
    """A standalone HTML page: the timeline, the divergence with its rule, the
    ops as a table. Every string of the trace is data: escaped for where it
    stands (:func:`_esc`), the page carries no script and its
    Content-Security-Policy (:data:`CSP`) refuses any, and it links nowhere."""
    head = f"kvtrace {source}" if source else "kvtrace timeline"
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', CSP_META,
        f"<title>{_esc(head)}</title>",
        '<link rel="icon" href="data:,">',
        ("<style>body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}"
        ".scroll{overflow-x:auto;border:1px solid #ddd;padding:4px}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px;text-align:left}"
        "tr.diverged{background:#ffe5e5;font-weight:bold}code{font-size:12px}"
        ".divergence{border:2px solid #d00;background:#fff5f5;padding:.5em 1em;margin:1em 0}"
        "p,td,h1{overflow-wrap:anywhere}</style>"),
        "</head><body>", f"<h1>{_esc(head)}</h1>",
    ]
    if tl.title:
        parts.append(f'<p class="title">{_esc(_clip(tl.title, TITLE_CHARS))}</p>')
    if tl.target:
        parts.append(f'<p class="target">run on target <code>{_esc(tl.target)}</code></p>')
    if tl.divergence is not None and tl.rule is not None:
        d, rule = tl.divergence, tl.rule
        parts.append(
            f'<div class="divergence" id="divergence"><p><b>First divergence at op {d.index}</b> '
            f"<code>{_esc(json.dumps(d.op))}</code>: {_esc(d.what)}</p>"
            f"<p>Rule broken: <b>{_esc(rule.name)}</b> ({_esc(rule.cite())}), stated by "
            f"<code>{_esc(rule.function)}</code>: {_esc(rule.doc)}</p>"
            f"<p>{_esc(d.labels[0])}: <code>{_esc(_short(d.spec, 400))}</code><br>"
            f"{_esc(d.labels[1])}: <code>{_esc(_short(d.impl, 400))}</code></p></div>")
    elif tl.frames:
        parts.append(f"<p>spec and {_esc(tl.implementation)} agree on all {len(tl.frames)} ops.</p>")
    parts.append(f'<div class="scroll">{svg(tl, standalone=False)}</div>')
    parts.append("<h2>Ops</h2><table><tr><th>op</th><th>operation</th><th>spec</th><th>counters</th></tr>")
    for f in tl.frames:
        cls = ' class="diverged"' if f.diverged else ""
        badges = "; ".join(f"{n}: {d}" if n in ("refused", "returns") else n for n, d in f.badges)
        obs = ", ".join(f"{k} {v}" for k, v in f.observables.items())
        parts.append(f"<tr{cls}><td>{f.index}</td><td><code>{_esc(json.dumps(f.op))}</code></td>"
                     f"<td>{_esc(badges)}</td><td>{_esc(obs)}</td></tr>")
    parts.append("</table></body></html>\n")
    return "\n".join(parts)
