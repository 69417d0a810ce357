"""``kvspec conformance --target llama.cpp``: llama.cpp's KV memory (the
``cells`` kind) fuzzed against ``kvspec.spec.cells``, every divergence class with
a minimal trace.

Two classes, one per memory llama.cpp builds for the target's models
(``kvspec.fuzz.adapters.llama_cpp``): ``llama_kv_cache`` (the llama model, store
``full``, 256 cells) and ``llama_kv_cache_iswa`` (the gemma2 model, stores
``full`` and ``window``, window 4; 512 full and 256 window cells, so the
window store reuses cells while the full store has room). Each is searched
in rounds, like the mlx-lm classes (``kvspec.fuzz.commands.conformance``):

* a round runs seeded examples: a fresh memory on each side
  (``kvspec.fuzz.cells.CellsLockstep``: the spec beside llama.cpp), up to
  ``steps`` ops drawn from the spec's state (decodes of 1 to 64 tokens,
  groups of sequences with equal positions, ``seq_rm`` whole or partial,
  ``seq_cp`` into a cleared range, context shifts ``seq_rm`` + ``seq_add``,
  plain ``seq_add``/``seq_div``, saves, restores into the same or another
  sequence, clears);
* the first divergence is shrunk (ops removed one by one, op 0 included,
  and token lists halved while the same divergence stays, until neither
  does: 1-minimal) to a trace whose ops the spec refuses carry ``"error":
  true``, written as ``<class>_NN.json`` and replayed on llama.cpp (exit 1
  expected), on llama.cpp in paranoid mode (every read forces the memory
  update: the same divergence expected, else it was the adapter's) and on
  our ``kvspec.impl.cells.CellCache`` (exit 0 expected); only a finding that does
  all three is confirmed;
* a refusal the adapter makes itself on an op the spec accepts is the
  harness's failure (:class:`HarnessFailure`): the class ends without a
  verdict, never with a finding;
* the round's op class (:func:`op_class`: the op, split where llama.cpp's
  code paths split: a partial or whole ``seq_rm``, a save while a shift is
  pending, a decode after a shift (the slot search starts at cell 0), a
  restore of an empty snapshot, a ``seq_cp``/``seq_add``/``seq_div``
  right after a ``seq_rm`` of its sequence or not, an op the spec refuses)
  is then no longer generated, and the next round starts.

A class ends when a round spends its examples without a divergence, when
``max_findings`` are found, or when nothing is left to exclude. The search
is budgeted by examples (``examples`` per round), not seconds: the report
gives the seconds and ops per second it took.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvspec.fuzz.commands.conformance import ClassReport
from kvspec.fuzz.failures import Divergence
from kvspec.fuzz.trace import TraceFormatError

#: (class name, cache fields) of the two memories llama.cpp builds for the target's models; the sizes
#: (n_cells, window_cells) are checked against the ones llama.cpp reports before a search
#: (kvspec.fuzz.adapters.llama_cpp.cache_sizes)
CLASSES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("llama_kv_cache", {"kind": "cells", "n_cells": 256, "window": None, "stores": ["full"], "n_seq": 3,
                        "kv_heads": 2, "head_dim": 16, "dtype": "float16"}),
    ("llama_kv_cache_iswa", {"kind": "cells", "n_cells": 512, "window_cells": 256, "window": 4,
                             "stores": ["full", "window"],
                             "n_seq": 3, "kv_heads": 2, "head_dim": 16, "dtype": "float16"}),
)
#: tokens drawn (the target's models have 24; 0-2 are unknown/BOS/EOS, still decodable)
TOKENS = range(3, 24)
#: divergences that are contract differences (how llama.cpp says no), not faults
CONTRACT = ("refusal differs", "refusal category differs", "refusal message differs")
DEFAULT_SEED = 20261206
#: the search's default budget: examples per round, ops per example
DEFAULT_EXAMPLES = 200
DEFAULT_STEPS = 40
#: divergence classes per memory at most
DEFAULT_MAX_FINDINGS = 16


def category(what: str) -> str:
    """``"fault"`` or ``"contract difference"`` for a divergence's ``what``."""
    return "contract difference" if what in CONTRACT else "fault"


# -- generation ----------------------------------------------------------------


class Generator:
    """Seeded ops drawn from the spec's state (``kvspec.spec.cells``), skipping the
    op classes in ``excluded``."""

    def __init__(self, rng: random.Random, cache: dict[str, Any], excluded: frozenset[str]):
        self.rng, self.cache, self.excluded = rng, cache, excluded
        self.n_seq = cache["n_seq"]
        self.saved: dict[str, bool] = {}  # name -> empty snapshot
        self.k = 0
        #: a shift since the rows were last read (run_example keeps it)
        self.pending = False
        #: a shift since the last decode or restore (llama.cpp's slot search then starts at cell 0)
        self.head_reset = False

    def ops(self, world: Any, last: dict[str, Any] | None) -> list[dict[str, Any]]:
        """One or two ops (a guarded op brings its seq_rm), drawn from the
        spec's ``world`` (``kvspec.fuzz.cells.CellsWorld``)."""
        from kvspec.spec import cells as sc

        self.world = world
        memory = world.memory
        r, n = self.rng, self.n_seq
        for _ in range(20):
            choice = r.choices(["decode", "seq_rm", "seq_cp", "seq_keep", "shift", "seq_add", "seq_div", "save",
                                "restore", "clear"], weights=[30, 14, 8, 3, 8, 4, 3, 10, 8, 2])[0]
            s = r.randrange(n)
            pm = sc.pos_max(memory, s)
            if choice == "decode":
                seqs = [s]
                partner = r.randrange(n)
                if partner != s and r.random() < 0.25 and sc.pos_min(memory, partner) == sc.pos_min(memory, s) \
                        and sc.pos_max(memory, partner) == pm:
                    seqs.append(partner)
                size = r.choice([1, 1, 2, 3, 5, 8, 16, 32, 64])
                pos0 = pm + 1 if r.random() > 0.03 else pm + 2
                out = [{"op": "decode", "seqs": seqs, "tokens": [r.choice(TOKENS) for _ in range(size)], "pos0": pos0}]
            elif choice == "seq_rm":
                whole = r.random() < 0.3
                seq = -1 if r.random() < 0.1 else s
                if whole:
                    out = [{"op": "seq_rm", "seq": seq, "p0": -1, "p1": None}]
                else:
                    a = r.randint(0, max(0, pm))
                    b = None if r.random() < 0.5 else a + r.randint(1, 8)
                    out = [{"op": "seq_rm", "seq": seq, "p0": a, "p1": b}]
            elif choice == "seq_cp":
                dst = r.randrange(n)
                a = 0 if r.random() < 0.6 else r.randint(0, max(0, pm))
                b = None if r.random() < 0.7 else a + r.randint(1, 8)
                cp = {"op": "seq_cp", "src": s, "dst": dst, "p0": a, "p1": b}
                out = [cp] if r.random() < 0.1 else [{"op": "seq_rm", "seq": dst, "p0": a, "p1": b}, cp]
            elif choice == "seq_keep":
                out = [{"op": "seq_keep", "seq": s}]
            elif choice == "shift":  # llama.cpp's context shift: discard k after keep, move the rest back
                keep = r.randint(0, max(0, pm // 2))
                k = r.randint(1, max(1, (pm - keep) // 2 + 1))
                out = [{"op": "seq_rm", "seq": s, "p0": keep, "p1": keep + k},
                       {"op": "seq_add", "seq": s, "p0": keep + k, "p1": None, "delta": -k}]
            elif choice == "seq_add":
                a = r.randint(0, max(0, pm))
                out = [{"op": "seq_add", "seq": s, "p0": a, "p1": None if r.random() < 0.7 else a + r.randint(1, 8),
                        "delta": r.choice([-8, -3, -1, 1, 2, 5, 40])}]
            elif choice == "seq_div":
                a = r.randint(0, max(0, pm))
                d = r.choice([1, 2, 3])
                div = {"op": "seq_div", "seq": s, "p0": a, "p1": a + r.randint(1, 4), "d": d}
                if r.random() < 0.6:  # one position, its target cleared first (as a guarded shift)
                    div["p1"] = a + 1
                    out = [{"op": "seq_rm", "seq": s, "p0": a // d, "p1": a}, div] if a // d < a else [div]
                else:
                    out = [div]
            elif choice == "save":
                name = f"s{self.k}"
                empty = not any(s in c.seqs for st in memory.config.stores for c in memory.present(st))
                out = [{"op": "save", "seq": s, "name": name}]
                if self.allowed(out, last):
                    self.k += 1
                    self.saved[name] = empty
                    return out
                continue
            elif choice == "restore":
                if not self.saved:
                    continue
                out = [{"op": "restore", "name": r.choice(sorted(self.saved)), "seq": s}]
            else:
                out = [{"op": "clear"}]
            if self.allowed(out, last):
                return out
        return [{"op": "pos_max", "seq": 0}]

    def allowed(self, ops: list[dict[str, Any]], last: dict[str, Any] | None) -> bool:
        prev, world, pending, head = last, self.world, self.pending, self.head_reset
        for op in ops:
            cls, world = classify(op, prev, world, self.saved, pending, head)
            if cls in self.excluded:
                return False
            prev, pending, head = op, still_pending(op, pending), still_head_reset(op, head)
        return True


def classify(op: dict[str, Any], prev: dict[str, Any] | None, world: Any,
             empty_saves: dict[str, bool], pending: bool = False, head_reset: bool = False) -> tuple[str, Any]:
    """``(op_class, the spec's world after op)``: the op's class, or
    ``"<op> the spec refuses"`` when the spec refuses it in ``world``."""
    from kvspec.fuzz.cells import _spec_run
    from kvspec.spec.errors import KVCacheError

    try:
        _, after = _spec_run(world, op)
    except (KVCacheError, TraceFormatError):
        return f"{op['op']} the spec refuses", world
    return op_class(op, prev, empty_saves, pending, head_reset), after


def op_class(op: dict[str, Any], prev: dict[str, Any] | None, empty_saves: dict[str, bool],
             pending: bool = False, head_reset: bool = False) -> str:
    """The class of an op the search can exclude (module docstring): a
    partition of the op space along llama.cpp's code paths, not a list of
    its faults. ``pending``: a shift was made since the rows were last
    read (the lockstep reads them after every op but a shift or a save).
    ``head_reset``: a shift was made since the last decode or restore:
    llama.cpp's ``seq_add``/``seq_div`` set the store's search head to cell
    0, so the next slot search meets the lowest cells first (reusing a
    window cell masked for its sequence there, even while free cells are
    left): a decode then is ``"decode after a shift"``.
    (:func:`classify` splits off the ops the spec refuses.)"""
    name = op["op"]
    if name == "seq_rm":
        whole = (op["p0"] is None or op["p0"] <= 0) and op["p1"] is None
        return "seq_rm whole" if whole else "seq_rm partial"
    if name == "save":
        return "save with a shift pending" if pending else "save"
    if name == "decode" and head_reset:
        return "decode after a shift"
    if name == "restore":
        return "restore of an empty snapshot" if empty_saves.get(op["name"]) else "restore"
    if name in ("seq_cp", "seq_add", "seq_div"):
        guarded = prev is not None and prev["op"] == "seq_rm" and prev.get("seq") in (op.get("dst"), op.get("seq"))
        return f"{name} guarded" if guarded else f"{name} unguarded"
    return name


def still_head_reset(op: dict[str, Any], head_reset: bool) -> bool:
    """Whether llama.cpp's slot search starts at cell 0 after ``op``: a
    shift sets it there, a decode or a restore moves it past what it wrote."""
    if op["op"] in ("seq_add", "seq_div"):
        return True
    return head_reset and op["op"] not in ("decode", "restore")


def still_pending(op: dict[str, Any], pending: bool) -> bool:
    """Whether a shift is pending after ``op``: a shift makes one, any op
    but a save then reads the rows (the lockstep's observation)."""
    if op["op"] in ("seq_add", "seq_div"):
        return True
    return pending and op["op"] == "save"


# -- replay and shrinking ------------------------------------------------------


class HarnessFailure(RuntimeError):
    """The tool, not llama.cpp, is at fault: the adapter refused an op the
    spec accepts (its own limits: :func:`kvspec.fuzz.adapters.llama_cpp.trace_limits`
    must have kept the op out), or a divergence vanished in paranoid mode.
    Never a finding: the search stops the class with ``no_verdict``."""


def lockstep(cache: dict[str, Any], on_llama: bool, paranoid: bool = False) -> Any:
    """A fresh lockstep: the spec beside llama.cpp (``on_llama``; in paranoid
    mode with ``paranoid``: every read of rows forces llama.cpp's memory
    update) or beside our ``kvspec.impl.cells.CellCache``."""
    from kvspec.fuzz.adapters.llama_cpp import paranoid_factory, target_factory
    from kvspec.fuzz.cells import CellsLockstep

    if not on_llama:
        return CellsLockstep(cache, None)
    return CellsLockstep(cache, {"target": paranoid_factory if paranoid else target_factory})


def first_divergence(cache: dict[str, Any], ops: list[dict[str, Any]], on_llama: bool,
                     paranoid: bool = False) -> Divergence | None:
    """The first divergence of ``ops`` replayed from a fresh memory, or None.
    A trace the lockstep cannot run (a restore of a snapshot removed by
    shrinking) counts as no divergence. Raises :class:`HarnessFailure` when
    the divergence is a refusal the adapter made itself before calling
    llama.cpp (the spec accepted the op: the harness's limit, not llama.cpp's
    answer)."""
    lock = lockstep(cache, on_llama, paranoid)
    ops = [dict(op) for op in ops]  # the lockstep writes an adopted choice of window cells into an op (drops)
    try:
        for i, op in enumerate(ops):
            lock.step(i, op)
    except Divergence as d:
        first = getattr(getattr(lock, "target", None), "refused_first", None)
        if on_llama and first is not None and d.what in ("refusal differs", "refusal category differs"):
            raise HarnessFailure(f"op {d.index} ({_describe(d.op)}): the adapter refused it before calling "
                                 f"llama.cpp ({first}) where the spec accepts it: a limit of the harness, "
                                 "not a llama.cpp divergence") from None
        return d
    except TraceFormatError:
        return None
    finally:
        close = getattr(getattr(lock, "target", None), "close", None)
        if close is not None:
            close()
    return None


def shrink(cache: dict[str, Any], ops: list[dict[str, Any]], what: str, op_name: str,
           cls: str | None = None) -> list[dict[str, Any]]:
    """A 1-minimal op list that still diverges on llama.cpp with the same
    ``what`` at an op named ``op_name`` (charged to an op of class ``cls``,
    when given: :func:`_culprit`): the ops after the divergence cut, then,
    until nothing changes, single ops removed (last first, op 0 included)
    while it still does and token lists halved. The result loses that
    divergence when any one of its ops is removed (:func:`same_divergence`)."""
    def same(candidate: list[dict[str, Any]]) -> int | None:
        return same_divergence(cache, candidate, what, op_name, cls)

    ops = without_drops(ops)
    at = same(ops)
    if at is None:
        return ops
    ops = ops[:at + 1]
    changed = True
    while changed:
        changed = False
        for i in range(len(ops) - 1, -1, -1):
            cand = ops[:i] + ops[i + 1:]
            if cand and (j := same(cand)) is not None:
                ops, changed = cand[:j + 1], True
                break
        if changed:
            continue
        for i, op in enumerate(ops):
            if op["op"] == "decode" and len(op["tokens"]) > 1:
                cand_op = {**op, "tokens": op["tokens"][: len(op["tokens"]) // 2]}
                cand = ops[:i] + [cand_op] + ops[i + 1:]
                if (j := same(cand)) is not None:
                    ops, changed = cand[:j + 1], True
                    break
    return ops


def without_drops(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of ``ops`` without the window cells a run recorded as dropped
    (``drops``: a shrunk trace records its own, :func:`with_drops`)."""
    return [{k: v for k, v in op.items() if k != "drops"} for op in ops]


def with_drops(cache: dict[str, Any], ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of ``ops`` with the ``drops`` the lockstep records when it
    runs them on llama.cpp up to the first divergence (the window cells
    llama.cpp chose to reuse, adopted by the spec): the trace then replays
    on ours as it did on llama.cpp."""
    lock = lockstep(cache, True)
    ops = [dict(op) for op in ops]
    try:
        for i, op in enumerate(ops):
            lock.step(i, op)
    except (Divergence, TraceFormatError):
        pass
    finally:
        lock.target.close()
    return ops


def same_divergence(cache: dict[str, Any], ops: list[dict[str, Any]], what: str, op_name: str,
                    cls: str | None = None) -> int | None:
    """The index of ``ops``'s first divergence on llama.cpp when it is the
    same one (``what``, at an op named ``op_name``, charged to an op of class
    ``cls`` when given), else None (a harness failure counts as None)."""
    try:
        d = first_divergence(cache, ops, True)
    except HarnessFailure:
        return None
    if d is None or d.what != what or d.op["op"] != op_name:
        return None
    if cls is not None and _class_at(cache, ops, _culprit(ops, d, spec_refused(cache, ops))) != cls:
        return None
    return d.index


# -- the search ----------------------------------------------------------------


@dataclass
class CellsFinding:
    """One divergence class: what, where (``index``: the op it shows at;
    ``culprit``: the op it is charged to, of class ``excluded``), its
    minimal trace and replays: ``on_target`` / ``on_impl`` the replay's
    exit on llama.cpp / on ours, ``on_paranoid`` 1 when llama.cpp in
    paranoid mode (every read forces the memory update) diverges the same
    way. Confirmed: 1, 0, 1; any other finding is the tool's failure."""

    cache_class: str
    index: int
    op: dict[str, Any]
    what: str
    summary: str
    trace: str
    excluded: str
    examples_to_catch: int
    on_target: int | None = None
    on_impl: int | None = None
    culprit: int = -1
    on_paranoid: int | None = None

    @property
    def category(self) -> str:
        return category(self.what)

    @property
    def confirmed(self) -> bool:
        return self.on_target == 1 and self.on_impl == 0 and self.on_paranoid == 1

    @property
    def replay_command(self) -> str:
        return f"kvspec replay --target llama.cpp {self.trace}"


@dataclass
class CellsClassReport(ClassReport):
    """What fuzzing one llama.cpp memory found: mlx-lm's class report (the
    conformance schema) with the search's own rates."""

    target: str = "llama.cpp"
    kind: str = "cells"
    mode: str = ""
    findings: list[CellsFinding] = field(default_factory=list)  # type: ignore[assignment]
    #: ops per second while running examples (shrinking and replays not counted)
    ops_per_second: float = 0.0
    #: seconds spent running examples (the rest: shrinking, replays)
    example_seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        for f, doc in zip(self.findings, out["findings"]):
            doc["then"] = f"stopped generating {f.excluded}"
            doc["waived"] = []
        return out


def run_example(cache: dict[str, Any], rng: random.Random, excluded: frozenset[str], steps: int,
                covered: dict[str, int]) -> tuple[list[dict[str, Any]], Divergence | None]:
    """One example: ops drawn and run until ``steps`` or a divergence."""
    lock = lockstep(cache, True)
    gen = Generator(rng, cache, excluded)
    ops: list[dict[str, Any]] = []
    try:
        while len(ops) < steps:
            last = ops[-1] if ops else None
            for op in gen.ops(lock.world, last):
                gen.pending = still_pending(op, gen.pending)
                gen.head_reset = still_head_reset(op, gen.head_reset)
                ops.append(op)
                covered[op["op"]] = covered.get(op["op"], 0) + 1
                lock.step(len(ops) - 1, op)
    except Divergence as d:
        return ops, d
    finally:
        lock.target.close()
    return ops, None


def search_class(name: str, cache: dict[str, Any], examples: int, steps: int, seed: int, out: Path,
                 max_findings: int = DEFAULT_MAX_FINDINGS) -> CellsClassReport:
    """Fuzz one llama.cpp memory in rounds of ``examples`` examples."""
    report = CellsClassReport(name, mode=f"window {cache['window']}" if cache["window"] else "full attention",
                              not_compared={"cell indices": "not observable (the spec's cells are a multiset)",
                                            "layers past the first of each store": "rows named by the first layer"})
    excluded: frozenset[str] = frozenset()
    start = time.perf_counter()
    k = 0
    while len(report.findings) < max_findings:
        failure = None
        for _ in range(examples):
            rng = random.Random(seed * 1000003 + k)
            k += 1
            t0 = time.perf_counter()
            ops, d = run_example(cache, rng, excluded, steps, report.covered)
            report.example_seconds += time.perf_counter() - t0
            report.examples += 1
            report.steps += len(ops)
            if d is not None:
                failure = (ops, d, report.examples)
                break
        if failure is None:
            report.ended = f"{examples} examples without a further divergence"
            break
        ops, d, at = failure
        ops = without_drops(ops)
        cls = _class_at(cache, ops, _culprit(ops, d, spec_refused(cache, ops)))
        try:
            minimal = shrink(cache, ops, d.what, d.op["op"], cls)
            finding = _record(name, cache, minimal, d.what, cls, at, out, len(report.findings) + 1)
        except HarnessFailure as exc:
            report.no_verdict = f"tool failure: {exc}"
            report.ended = "stopped: the harness failed (no verdict)"
            break
        report.findings.append(finding)
        if cls in excluded:
            report.ended = f"stopped: {cls} diverged although excluded"
            break
        excluded = excluded | {cls}
    else:
        report.ended = f"{max_findings} findings (max)"
    report.seconds = time.perf_counter() - start
    report.ops_per_second = report.steps / report.example_seconds if report.example_seconds else 0.0
    return report


def _culprit(ops: list[dict[str, Any]], d: Divergence, refused: list[bool] | None = None) -> int:
    """The op a divergence is charged to: the op it happened at, but for
    rows that differ at the first read after shifts, the last of those
    shifts (a K row is re-rotated lazily: the shift is where it went wrong).
    Ops that read no rows (saves) or that the spec refused (``refused``,
    :func:`spec_refused`: refused on both sides, else the divergence would
    be there) are passed over on the way back."""
    if "rows differ" in d.what:
        j = d.index - 1
        while j >= 0 and (ops[j]["op"] == "save" or (refused is not None and refused[j])):
            j -= 1
        if j >= 0 and ops[j]["op"] in ("seq_add", "seq_div"):
            return j
    return d.index


def spec_refused(cache: dict[str, Any], ops: list[dict[str, Any]]) -> list[bool]:
    """Per op, whether the spec refuses it in the state the ops before it
    leave (an op past a trace format error: False)."""
    from kvspec.fuzz.cells import CellsWorld, _spec_run, spec_memory
    from kvspec.spec.errors import KVCacheError

    world = CellsWorld(spec_memory(cache))
    out = []
    for op in ops:
        try:
            _, world = _spec_run(world, op)
            out.append(False)
        except KVCacheError:
            out.append(True)
        except TraceFormatError:
            out.append(False)
    return out


def _class_at(cache: dict[str, Any], ops: list[dict[str, Any]], index: int) -> str:
    """The class of ``ops[index]`` in the spec's world after the ops before it
    (as the generator classified it)."""
    from kvspec.fuzz.cells import CellsWorld, spec_memory

    world = CellsWorld(spec_memory(cache))
    empty: dict[str, bool] = {}
    pending = head = False
    for i, op in enumerate(ops):
        cls, after = classify(op, ops[i - 1] if i else None, world, empty, pending, head)
        if i == index:
            return cls
        if op["op"] == "save" and after is not world:
            empty[op["name"]] = not any(after.snapshots[op["name"]][0].cells)
        world, pending, head = after, still_pending(op, pending), still_head_reset(op, head)
    raise IndexError(index)


def annotate_refusals(cache: dict[str, Any], ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``ops`` with ``"error": true`` on every op the spec refuses (a trace
    states the refusals it expects: ``kvspec replay`` checks them)."""
    refused = spec_refused(cache, ops)
    return [{**op, "error": True} if r else {k: v for k, v in op.items() if k != "error"}
            for op, r in zip(ops, refused)]


def _record(name: str, cache: dict[str, Any], ops: list[dict[str, Any]], what: str, cls: str, at: int, out: Path,
            number: int) -> CellsFinding:
    from kvspec.fuzz.adapters.llama_cpp import llama_cpp_version

    plain = annotate_refusals(cache, without_drops(ops))
    d = first_divergence(cache, plain, True)
    ops = annotate_refusals(cache, with_drops(cache, plain))
    dropped = first_divergence(cache, ops, True) if ops != plain else d
    if d is not None and (dropped is None or (dropped.index, dropped.what) != (d.index, d.what)):
        ops = plain  # the recorded drops would not replay to the same divergence: the lockstep adopts them again
    else:
        d = dropped
    refused = spec_refused(cache, ops)
    summary = what if d is None else f"op {d.index} {_describe(d.op)}: {_both_refused(d, refused)}{d.what}: " \
                                     f"llama.cpp {_short(d.impl)}, spec {_short(d.spec)}"
    doc = {"kvtrace": 1,
           "title": f"{llama_cpp_version()} {name} does not conform (kvspec replay --target llama.cpp): "
                    f"{summary}"[:600],
           "cache": dict(cache), "ops": ops}
    path = out / f"{name}_{number:02d}.json"
    path.write_text(_dump(doc))
    culprit = _culprit(ops, d, refused) if d is not None else -1
    finding = CellsFinding(name, d.index if d else -1, d.op if d else {}, what, summary, str(path), cls, at,
                           culprit=culprit)
    finding.on_target = replay_exit(doc, True)
    finding.on_impl = replay_exit(doc, False)
    para = first_divergence(cache, ops, True, paranoid=True)
    finding.on_paranoid = int(para is not None and d is not None and para.index == d.index and para.what == d.what)
    return finding


def _both_refused(d: Divergence, refused: list[bool]) -> str:
    """``"refused on both sides, yet "`` when the op a divergence shows at
    was refused by the spec and the divergence is no refusal difference (so
    the target refused it too): what differs was already there, it is only
    read here."""
    both = 0 <= d.index < len(refused) and refused[d.index] and d.what not in CONTRACT
    return "refused on both sides, yet " if both else ""


def replay_exit(doc: dict[str, Any], on_llama: bool) -> int:
    """``kvspec replay``'s exit status for a cells trace document: 1 when it
    diverges, 0 when it does not."""
    return 1 if first_divergence(doc["cache"], doc["ops"], on_llama) is not None else 0


def _describe(op: dict[str, Any]) -> str:
    return (op["op"] + " " + " ".join(f"{k}={json.dumps(v)}" for k, v in op.items() if k != "op")).strip()


def _short(x: Any) -> str:
    s = x if isinstance(x, str) else json.dumps(x, default=str)
    return s if len(s) <= 240 else s[:237] + "..."


def _dump(doc: dict[str, Any]) -> str:
    """A trace as the project writes them: one op per line."""
    head = json.dumps({k: v for k, v in doc.items() if k != "ops"}, indent=2)[:-2]
    ops = ",\n".join("    " + json.dumps(op) for op in doc["ops"])
    return f"{head},\n  \"ops\": [\n{ops}\n  ]\n}}\n"


def run_llama_conformance(examples: int = DEFAULT_EXAMPLES, steps: int = DEFAULT_STEPS, seed: int = DEFAULT_SEED,
                          out: str | Path = "fuzz-failures/conformance-llama.cpp", only: list[str] | None = None,
                          max_findings: int = DEFAULT_MAX_FINDINGS) -> list[CellsClassReport]:
    """Search every llama.cpp memory class (or those named in ``only``);
    ``<class>_NN.json`` traces and ``report.json`` are written to ``out``,
    after the traces of an earlier run (every class's ``<class>_NN.json``)
    and its ``report.json`` are removed from ``out``, so that the report
    describes every trace beside it (:data:`LAST_CLEARED` lists what was
    removed). Raises KeyError for an unknown class, NotInstalled without
    llama-cpp-python."""
    from kvspec.fuzz.adapters.llama_cpp import cache_sizes, require

    require()
    known = {n: {**c, **cache_sizes(c)} for n, c in CLASSES}
    names = list(known) if not only else list(only)
    for n in names:
        if n not in known:
            raise KeyError(f"--class: unknown class {n!r}; llama.cpp's: {', '.join(known)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    LAST_CLEARED[:] = clear_findings(out)
    reports = []
    for i, n in enumerate(names):
        reports.append(search_class(n, known[n], examples, steps, seed + 1000 * i, out, max_findings))
    (out / "report.json").write_text(json.dumps(to_json(reports, seed, examples, steps), indent=1) + "\n")
    return reports


#: the files :func:`run_llama_conformance` removed from its ``out`` before its last run
LAST_CLEARED: list[str] = []


def clear_findings(out: Path) -> list[str]:
    """Remove an earlier run's findings from ``out``: every class's
    ``<class>_NN.json`` and ``report.json`` (other files are kept, e.g. a
    trace kept under another name). Returns the names removed."""
    gone = []
    for n, _ in CLASSES:
        for stale in sorted(out.glob(f"{n}_[0-9][0-9].json")):
            stale.unlink()
            gone.append(stale.name)
    if (out / "report.json").exists():
        (out / "report.json").unlink()
        gone.append("report.json")
    return gone


def to_json(reports: list[CellsClassReport], seed: int, examples: int, steps: int) -> dict[str, Any]:
    """The report (``kvspec conformance --json``'s schema, fuzz/schemas/conformance.schema.json):
    ``budget`` counts examples per round here (``budget_unit``), ``engine``
    names llama.cpp's version; ``mlx_lm``/``mlx`` are the schema's fields.
    ``ok`` (and ``exit`` 0) only when every finding is confirmed (replays 1
    on llama.cpp, in paranoid mode too, and 0 on ours) and no class ended
    without a verdict; ``exit`` 1 for a finding not confirmed (the tool's
    failure, not llama.cpp's: shown as such), 2 for a class without a
    verdict (the harness failed: ``no_verdict``)."""
    import mlx.core as mx

    from kvspec.fuzz.adapters.llama_cpp import llama_cpp_version
    from kvspec.fuzz.adapters.mlx_lm import mlx_lm_version

    ok = all(f.confirmed for r in reports for f in r.findings) and not any(r.no_verdict for r in reports)
    code = 2 if any(r.no_verdict for r in reports) else 0 if ok else 1
    return {"target": "llama.cpp", "engine": llama_cpp_version(), "seed": seed,
            "budget": examples, "budget_unit": "examples per round", "steps": steps,
            "mlx_lm": mlx_lm_version(), "mlx": mx.__version__, "interrupted": False,
            "classes": [r.to_json() for r in reports], "ok": ok, "exit": code,
            "no_verdict": {r.cache_class: r.no_verdict for r in reports if r.no_verdict}}


def cmd_llama_conformance(args: Any, console: Any, usage_error: Any, default_out: bool = False) -> int:
    """``kvspec conformance --target llama.cpp``: exit 0 when every finding
    is confirmed (replays 1 on llama.cpp, in paranoid mode too, and 0 on
    ours), 1 otherwise, 2 without llama-cpp-python, for an unknown
    ``--class``, an option of the seconds-budgeted search (``--budget``,
    ``--sarif``) or a class without a verdict. With the default
    ``--out`` the traces go to its subfolder ``llama.cpp`` (beside mlx-lm's
    report, not over it)."""
    from rich.markup import escape

    from kvspec.fuzz.adapters.llama_cpp import NotInstalled

    for option, given in (("--budget", getattr(args, "budget", None) is not None),
                          ("--sarif", getattr(args, "sarif", None) is not None)):
        if given:
            return usage_error(console, f"{option}: does not apply to --target llama.cpp (its search is budgeted "
                                        "by examples: --examples per round, --steps per example; its findings are "
                                        "in report.json)", args.json)
    examples = args.examples if getattr(args, "examples", None) is not None else DEFAULT_EXAMPLES
    max_findings = args.max_findings if args.max_findings is not None else DEFAULT_MAX_FINDINGS
    steps = args.steps if getattr(args, "steps", None) is not None else DEFAULT_STEPS
    out = str(Path(args.out) / "llama.cpp") if default_out else args.out
    try:
        reports = run_llama_conformance(examples, steps, args.seed, out, args.classes, max_findings)
    except NotInstalled as exc:
        return usage_error(console, str(exc), args.json)
    except KeyError as exc:
        return usage_error(console, str(exc.args[0]), args.json)
    doc = to_json(reports, args.seed, examples, steps)
    doc["cleared"] = list(LAST_CLEARED)
    code = doc["exit"]
    if args.json:
        print(json.dumps(doc))
        return code
    if LAST_CLEARED:
        console.print(f"removed the earlier run's {len(LAST_CLEARED)} files from {escape(str(out))}/ first "
                      f"({escape(', '.join(LAST_CLEARED[:6]))}{', ...' if len(LAST_CLEARED) > 6 else ''})")
    print_llama_report(reports, doc, console)
    for r in reports:
        if r.no_verdict:
            console.print(f"[bold red]{escape(r.cache_class)}: no verdict[/]: {escape(r.no_verdict)}")
    console.print(f"minimal traces in {escape(str(out))}/ (report.json beside them)")
    return code




def print_llama_report(reports: list[CellsClassReport], doc: dict[str, Any], console: Any) -> None:
    """One row per class, then one per divergence, then the replay commands."""
    from rich.markup import escape
    from rich.table import Table

    from kvspec.fuzz.commands.reports import print_table

    table = Table(title=f"kvspec conformance: {doc['engine']}, seed {doc['seed']}, {doc['budget']} examples "
                        f"per round, {doc['steps']} ops per example")
    for col in ("class", "examples", "ops", "ops/s", "seconds", "faults", "contract differences", "search ended"):
        table.add_column(col, overflow="fold")
    for r in reports:
        faults = sum(f.category == "fault" for f in r.findings)
        table.add_row(escape(r.cache_class), str(r.examples), str(r.steps), f"{r.ops_per_second:.0f}",
                      f"{r.seconds:.1f}", str(faults), str(len(r.findings) - faults), escape(r.ended))
    print_table(console, table)
    found = Table(title="divergences (each trace replays 1 on llama.cpp, 0 on impl)")
    for col in ("class", "#", "category", "what goes wrong", "then", "replay"):
        found.add_column(col, overflow="fold")
    lines = []
    for r in reports:
        for i, f in enumerate(r.findings, 1):
            check = ("[green]1/0 ok[/]" if f.confirmed else
                     f"[bold red]{f.on_target}/{f.on_impl}, paranoid {f.on_paranoid}[/]")
            found.add_row(escape(r.cache_class), str(i), f.category, escape(f.summary[:200]),
                          escape(f"stopped generating {f.excluded}"), check)
            lines.append(f"{r.cache_class} #{i}: {f.replay_command}")
    print_table(console, found)
    for line in lines:
        console.print(line, soft_wrap=True, markup=False)
