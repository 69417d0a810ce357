"""Hypothesis state machines that drive spec and implementation in lockstep.

One machine per cache kind. Rules emit kvtrace ops (so every run *is* a
trace), bundles hold what lives across steps (snapshots, detached handles),
and every step is checked by the lockstep driver against the properties of
semantics.md section 5. Parameters are small on purpose (step 1 to 8, head
dim 8 or 16, one or two kv heads): small sizes reach the edges (regrow after
trim, exact-fit buffers, shared buffers) that large sizes hide.

After a failing run, Hypothesis shrinks it and re-runs the minimal example
last; ``teardown`` records each run, so ``Machine.last_run`` is then the
minimal counterexample, which :func:`kvspec.fuzz.campaign.failure_trace` writes out.
"""

from __future__ import annotations

import sys
import time
from typing import Any, ClassVar

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    precondition,
    rule,
)

from kvspec.fuzz.kinds import get as kind_entry

SMALL_STEPS = st.integers(1, 8)
HEAD_DIMS = st.sampled_from([8, 16])
KV_HEADS = st.integers(1, 2)
# Shapes and dtypes of our implementation's runs: batch 1 to 3 (1 most
# often), kv heads 1 to 3, a value head dim that often differs from the
# keys', and the three floating dtypes models hand in.
BATCHES = st.one_of(st.just(1), st.integers(1, 3))
ALL_KV_HEADS = st.integers(1, 3)
V_HEAD_DIMS = st.sampled_from([None, None, 4, 8, 16])
DTYPES = st.sampled_from(["float16", "float16", "bfloat16", "float32"])
#: KV_INPLACE_WRITE spellings a run may build its cache under: the four off
#: words in other cases and with blanks first (Hypothesis starts from the
#: first), then plain, then other words and the empty string.
_OFF_WORDS = ("0", "false", "off", "no")
INPLACE_SPELLINGS = (
    " OFF", "No", "\tfalse\n", "0 ", "Off", " no ", "FALSE", "\n0", "oFf\t", "NO",
    *_OFF_WORDS,
    "", " ", "1", "true", "on", "yes", "nope", "offf", "0.0", "disable",
)
INPLACE_ENV = st.sampled_from(INPLACE_SPELLINGS)
# Decode steps dominate real traffic and are the only writes that may go in
# place, so n = 1 is drawn most often; multi-row appends cross step edges.
APPEND_N = st.one_of(st.just(1), st.just(1), st.integers(1, 9))


#: how many times :meth:`KVMachine.flaky_verdict` runs a failing run's ops again
FLAKY_REPLAYS = 3


class FlakyVerdict(Exception):
    """The same run of ops gave two answers: it failed once, and Hypothesis
    could not make it fail again. A defect of the tool (a verdict must be a
    function of the trace alone: docs/fuzzing.md, "Determinism of a
    verdict"), never a finding: ``kvspec fuzz``, ``mutants`` and ``verify``
    report it as a tool failure (exit 2) with both answers. ``first``: what
    the failing run saw; ``again``: what Hypothesis's replay and
    :data:`FLAKY_REPLAYS` runs of the same ops on fresh caches gave."""

    def __init__(self, first: str, again: str) -> None:
        super().__init__(f"flaky verdict (a tool failure, not a finding): one run of ops gave two answers. "
                         f"First: {first}. Then: {again}")
        self.first, self.again = first, again


def _one_line(error: BaseException) -> str:
    """``error``'s text on one line, at most 600 characters: a divergence's
    op and what differs, then both sides in parentheses (``op 1 {...}:
    offset differs (spec says: 1; impl did: 2)``)."""
    lines = [" ".join(line.split()) for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    text = lines[0] + (f" ({'; '.join(lines[1:])})" if len(lines) > 1 else "")
    return text if len(text) <= 600 else text[:597] + "..."


class KVMachine(RuleBasedStateMachine):
    """Shared plumbing: configuration, op recording, the lockstep driver,
    and the rules every cache kind runs alike (fetch, hold, trims,
    snapshots)."""

    snapshots = Bundle("snapshots")

    kind = "dense"
    mode = "fp16"
    inplace = True
    factories: dict[str, Any] | None = None
    check_inplace = True
    #: cache fields pinned for every example (e.g. ``{"max_size": 16}``)
    fixed: ClassVar[dict[str, Any]] = {}
    #: a ``kvspec.fuzz.targets.Target`` (None: ``impl``). Ops it does not run are
    #: not generated (counted as "skipped <op>"); ``covered`` counts the ops
    #: each example did run, by name.
    target: Any = None
    #: ``kvspec.fuzz.replay.make_lockstep``, bound by ``machine_for`` (the base
    #: machine sits below the registry that knows every kind's driver)
    make_lockstep: ClassVar[Any] = None
    covered: ClassVar[dict[str, int]] = {}
    #: the kind's machine as mlx-lm targets run it (their shapes and draw
    #: order); None: this machine
    plain: ClassVar[Any] = None
    last_run: tuple[dict[str, Any], list[dict[str, Any]]] | None = None
    runs = 0
    stats: ClassVar[dict[str, int]] = {}
    #: (examples run, perf_counter time) when the first failure was seen,
    #: before shrinking: what "examples and seconds to catch" report.
    first_failure: tuple[int, float] | None = None
    #: the exception of that first failing op and the run up to it, as
    #: (cfg, ops): what a failure Hypothesis could not replay was
    #: (kvspec.fuzz.campaign.run_machine's flaky case)
    first_error: BaseException | None = None
    first_failure_run: tuple[dict[str, Any], list[dict[str, Any]]] | None = None
    #: called with the examples run so far when the first failure is seen
    #: (a campaign's progress line says shrinking starts); None: nobody
    on_failure: ClassVar[Any] = None

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[dict[str, Any]] = []
        self.names = 0
        self.cfg: dict[str, Any] = {}
        self.lock: Any = None
        self.without: dict[str, str] = {}

    def draw_shape(self, data: st.DataObject, head_dims: Any = HEAD_DIMS) -> dict[str, Any]:
        """Batch, kv heads, K and V head dims, dtype and (sometimes) a
        ``KV_INPLACE_WRITE`` spelling for our implementation's runs; an
        mlx-lm target keeps the shapes its findings were taken with (batch
        1, kv heads 1 to 2, one head dim, float16)."""
        shape: dict[str, Any] = {"head_dim": data.draw(head_dims, label="head_dim")}
        if self.target is not None:
            shape["kv_heads"] = data.draw(KV_HEADS, label="kv_heads")
            return shape
        shape["kv_heads"] = data.draw(ALL_KV_HEADS, label="kv_heads")
        shape["batch"] = data.draw(BATCHES, label="batch")
        v_head_dim = data.draw(V_HEAD_DIMS, label="v_head_dim")
        if v_head_dim is not None and v_head_dim != shape["head_dim"]:
            shape["v_head_dim"] = v_head_dim
        shape["dtype"] = data.draw(DTYPES, label="dtype")
        if self.inplace and self.mode == "fp16" and data.draw(st.integers(0, 2), label="env") == 0:
            shape["inplace_env"] = data.draw(INPLACE_ENV, label="inplace_env")
        return shape

    def setup(self, **cfg: Any) -> None:
        type(self).runs += 1
        defaults = kind_entry(self.kind, self.mode).defaults()
        self.cfg = {**defaults, "kind": self.kind, "mode": self.mode, "inplace": self.inplace, **cfg, **self.fixed}
        # a field pinned to None is absent (e.g. no v_head_dim: keys' head dim)
        self.cfg = {k: v for k, v in self.cfg.items() if v is not None}
        if "keep" in self.fixed or "max_size" in self.fixed:
            self.cfg["keep"] = min(self.cfg["keep"], self.cfg["max_size"] - 1)
        if self.make_lockstep is None:
            raise TypeError(f"{type(self).__name__}: build machines with kvspec.fuzz.campaign.machine_for")
        self.lock = self.make_lockstep(self.cfg, self.factories, self.check_inplace, self.target)
        #: ops of the trace kind this kind's implementation does not run (kvspec.fuzz.kinds)
        self.without = kind_entry(self.kind, self.mode).without

    def do(self, op: dict[str, Any]) -> None:
        if self.target is not None and self.target.skip_reason(self.cfg, op) is not None:
            self.lock.reached("skipped " + op["op"])
            return
        if op["op"] in self.without:
            self.lock.reached("skipped " + op["op"])
            return
        type(self).covered[op["op"]] = type(self).covered.get(op["op"], 0) + 1
        self.ops.append(op)
        try:
            self.lock.step(len(self.ops) - 1, op)
        except Exception:
            if type(self).first_error is None:
                type(self).first_error = sys.exc_info()[1]
                type(self).first_failure_run = (self.recorded_cfg(), list(self.ops))
            if type(self).first_failure is None:
                type(self).first_failure = (type(self).runs, time.perf_counter())
                if type(self).on_failure is not None:
                    type(self).on_failure(type(self).runs)
            raise

    def check_invariants(self, *args: Any, **kwargs: Any) -> None:
        """Hypothesis's invariant pass, with an invariant's first failure
        kept as :meth:`do` keeps an op's (``first_error``,
        ``first_failure_run``), so that one Hypothesis cannot replay is
        still a catch (kvspec.fuzz.campaign.run_machine)."""
        try:
            super().check_invariants(*args, **kwargs)
        except AssertionError:
            if type(self).first_error is None:
                type(self).first_error = sys.exc_info()[1]
                type(self).first_failure_run = (self.recorded_cfg(), list(self.ops))
            raise

    @classmethod
    def flaky_verdict(cls, flaky: BaseException) -> FlakyVerdict:
        """The :class:`FlakyVerdict` of a batch whose failure
        (``first_error``, in the run ``first_failure_run``) Hypothesis could
        not replay (``flaky``: its FlakyFailure or FlakyStrategyDefinition):
        the first answer, Hypothesis's, and the outcomes of the run's ops
        run again :data:`FLAKY_REPLAYS` times on fresh caches (same
        implementation, bug, in-place observation and target), counted."""
        assert cls.first_error is not None and cls.first_failure_run is not None
        first = _one_line(cls.first_error)
        if type(flaky).__name__ == "FlakyStrategyDefinition":
            hypothesis = ("Hypothesis's replay of the example drew other choices (FlakyStrategyDefinition: the "
                          "machine's draws depended on more than the seed)")
        else:
            hypothesis = f"Hypothesis's replay of the example did not fail the same way ({type(flaky).__name__})"
        outcomes: dict[str, int] = {}
        for _ in range(FLAKY_REPLAYS):
            got = cls._run_again()
            outcomes[got] = outcomes.get(got, 0) + 1
        again = "; ".join(f"{got} ({n} of {FLAKY_REPLAYS})" for got, n in outcomes.items())
        return FlakyVerdict(first, f"{hypothesis}; its {len(cls.first_failure_run[1])} ops run again here: {again}")

    @classmethod
    def _run_again(cls) -> str:
        """One run of ``first_failure_run``'s ops on a fresh lockstep: what
        it gave, in words (the machine's invariants are not run)."""
        from kvspec.fuzz.lockstep import Divergence
        from kvspec.fuzz.trace import cache_defaults

        cfg, ops = cls.first_failure_run  # type: ignore[misc]
        cache = {**cache_defaults(cfg.get("kind", cls.kind), cfg.get("mode", cls.mode)), **cfg}
        try:
            lock = cls.make_lockstep(cache, cls.factories, cls.check_inplace,
                                     cls.target if cls.target is not None else "impl")
            for i, op in enumerate(ops):
                lock.step(i, op)
        except Divergence as d:
            return f"diverged: {_one_line(d)}"
        except Exception as exc:  # noqa: BLE001 - what the run gave, whatever it was, is the answer
            return f"raised {type(exc).__name__}: {_one_line(exc)}"
        return "spec and implementation agreed at every op"

    def fresh_name(self, prefix: str) -> str:
        self.names += 1
        return f"{prefix}{self.names}"

    def recorded_cfg(self) -> dict[str, Any]:
        """The cache fields a trace of this run records."""
        return {k: v for k, v in self.cfg.items() if k in kind_entry(self.kind, self.mode).cache_fields}

    def teardown(self) -> None:
        type(self).last_run = (self.recorded_cfg(), list(self.ops))
        if self.lock is not None:
            for key, count in self.lock.stats.items():
                type(self).stats[key] = type(self).stats.get(key, 0) + count
                event(key)

    # -- rules every kind runs alike (Hypothesis orders rules by name, so
    # -- where they are defined changes no fixed-seed run) --
    @property
    def offset(self) -> int:
        return self.lock.world.cache.offset

    @rule()
    def decode(self) -> None:
        """A decode step: appends of one row are the common case and the only
        ones that may go in place (kinds add more append rules for weight)."""
        self.do({"op": "append", "n": 1})

    @rule()
    def fetch(self) -> None:
        self.do({"op": "fetch"})

    @rule()
    def hold(self) -> None:
        if self.lock.world.returned is not None:
            self.do({"op": "hold"})

    @rule()
    def release_hold(self) -> None:
        self.do({"op": "release_hold"})

    @rule(n=st.integers(-1, 4))
    def trim(self, n: int) -> None:
        self.do({"op": "trim", "n": n})

    @rule(data=st.data())
    def trim_to(self, data: st.DataObject) -> None:
        self.do({"op": "trim_to", "len": data.draw(st.integers(-1, self.offset + 1), label="len")})

    @rule(target=snapshots)
    def snapshot(self) -> str:
        name = self.fresh_name("s")
        self.do({"op": "snapshot", "name": name})
        return name

    @rule(name=snapshots)
    def restore(self, name: str) -> None:
        self.do({"op": "restore", "name": name})

    @rule(name=consumes(snapshots))
    def drop(self, name: str) -> None:
        self.do({"op": "drop", "name": name})

    @rule(n=st.integers(1, 2))
    def branch(self, n: int) -> None:
        """Two continuations from one point, the first one's window still
        alive while the second writes (best-of-n sampling, tree search and
        prompt-cache reuse do this): snapshot, append, hold, restore,
        append, drop. A write that lands in memory the other branch still
        reads (an in-place write the ownership rule should have refused)
        shows in the held window at the next comparison; the single rules
        above reach this order too, but rarely."""
        name = self.fresh_name("b")
        self.do({"op": "snapshot", "name": name})
        self.do({"op": "append", "n": n})
        self.do({"op": "hold"})
        self.do({"op": "restore", "name": name})
        self.do({"op": "append", "n": n})
        self.do({"op": "drop", "name": name})

    #: ops that take a holder's name, for :meth:`misuse_name`
    named_ops: ClassVar[tuple[str, ...]] = ("snapshot", "restore", "drop")

    @rule(data=st.data())
    def misuse_name(self, data: st.DataObject) -> None:
        """A name used wrongly: an unknown one, one already in use, or one of
        the other holder class (a handle to ``restore``, a snapshot to
        ``install``). Both sides must refuse with the same error and change
        nothing; the bundle rules above only ever use names the right way."""
        names = sorted(self.lock.world.holders) + ["nope"]
        name = data.draw(st.sampled_from(names), label="name")
        op = data.draw(st.sampled_from(self.named_ops), label="op")
        self.do({"op": op, "name": name})


class StateProtocolMachine(KVMachine):
    """The rules of mlx-lm's snapshot protocol, for the kinds whose classes
    have it (``kvspec.fuzz.kinds.STATE_OPS``): a snapshot kept as ``saved =
    c.state`` (no copy, as programs keep ``[c.state for c in cache]``), a
    restore as ``c.state = saved``. The spec's answer is the snapshot rule:
    the saved rows never change, whatever the cache does next."""

    states = Bundle("states")
    named_ops: ClassVar[tuple[str, ...]] = ("snapshot", "restore", "drop", "state_restore")

    @rule(target=states)
    def state_snapshot(self) -> str:
        name = self.fresh_name("st")
        self.do({"op": "state_snapshot", "name": name})
        return name

    @rule(name=states)
    def state_restore(self, name: str) -> None:
        self.do({"op": "state_restore", "name": name})

    @rule(name=consumes(states))
    def drop_state(self, name: str) -> None:
        self.do({"op": "drop", "name": name})

    @rule(data=st.data())
    def reuse_state(self, data: st.DataObject) -> None:
        """How programs reuse a prompt cache through the protocol: keep
        ``saved = c.state``, go on (or not), restore ``c.state = saved``,
        rewind part of it and decode. The single rules above reach this
        order too, but rarely in a short budget."""
        name = self.fresh_name("st")
        self.do({"op": "state_snapshot", "name": name})
        if data.draw(st.booleans(), label="go on"):
            self.do({"op": "append", "n": data.draw(st.integers(1, 3), label="n")})
        self.do({"op": "state_restore", "name": name})
        self.do({"op": "trim", "n": data.draw(st.integers(1, 3), label="rewind")})
        for _ in range(data.draw(st.integers(1, 3), label="decodes")):
            self.do({"op": "append", "n": 1})


#: what an ``append_mismatch`` may change (kvspec.spec.dense.ROW_FIELDS)
MISMATCH_FIELDS = ("batch", "kv_heads", "k_head_dim", "v_head_dim", "dtype", "k_dtype", "v_dtype")
#: what the values of an ``append_pair_mismatch`` differ in from its keys (kvspec.spec.dense.PAIR_FIELDS)
PAIR_FIELDS = ("dtype", "batch", "kv_heads", "rows")


class LifecycleRules:
    """Rules for the cache's life outside the decode loop (kinds that run
    ``kvspec.fuzz.kinds.LIFECYCLE_OPS``): copies of the cache as mlx-lm's
    prompt-cache helpers make them, rows of another shape or dtype, and
    save/load through a prompt-cache file or mlx-lm's load order. Mixed into
    a kind's machine; the plain machines of mlx-lm targets leave them out
    (:func:`without_lifecycle`)."""

    snapshots: Any
    lock: Any

    @rule(target=KVMachine.snapshots, deep=st.booleans(), live=st.sampled_from(["copy", "copy", "original"]))
    def copy_cache(self, deep: bool, live: str) -> str:
        """``copy.deepcopy`` (LRUPromptCache on every fetch) or ``copy.copy``
        of the cache; the trace goes on writing the copy (the original held,
        like the store's entry) or the original (the copy held). Checked
        against the snapshot rule: shared memory, no ownership."""
        name = self.fresh_name("c")  # type: ignore[attr-defined]
        self.do({"op": "copy", "name": name, "deep": deep, "live": live})  # type: ignore[attr-defined]
        return name

    @rule(deep=st.sampled_from([True, True, False]))
    def prompt_cache_fetch(self, deep: bool) -> None:
        """mlx-lm's ``LRUPromptCache`` pattern: fetch a (deep) copy of a
        stored prompt cache, decode on it while the store keeps the
        original: copy, two decode steps, then a decode on the original
        restored from the store (after one decode on the original, so that
        it owns its buffers when copied). A copy that still owns the buffers writes
        its rows in place into the memory the stored original reads."""
        name = self.fresh_name("c")  # type: ignore[attr-defined]
        self.do({"op": "append", "n": 1})  # type: ignore[attr-defined]
        self.do({"op": "copy", "name": name, "deep": deep, "live": "copy"})  # type: ignore[attr-defined]
        self.do({"op": "append", "n": 1})  # type: ignore[attr-defined]
        self.do({"op": "append", "n": 1})  # type: ignore[attr-defined]
        self.do({"op": "restore", "name": name})  # type: ignore[attr-defined]
        self.do({"op": "append", "n": 1})  # type: ignore[attr-defined]
        self.do({"op": "drop", "name": name})  # type: ignore[attr-defined]

    @rule(n=st.integers(1, 3), first=st.sampled_from(MISMATCH_FIELDS))
    def append_mismatch(self, n: int, first: str) -> None:
        """Rows whose batch, kv heads, K or V head dim or dtype differ from
        the cached rows', each in turn (from ``first``): refused, nothing
        changes (only while the cache holds a buffer: an empty cache takes
        any shape)."""
        if not self.lock.spec_module.holds_buffer(self.lock.world):
            return
        at = MISMATCH_FIELDS.index(first)
        for differs in MISMATCH_FIELDS[at:] + MISMATCH_FIELDS[:at]:
            self.do({"op": "append_mismatch", "n": n, "differs": differs})  # type: ignore[attr-defined]

    @rule(n=st.integers(1, 3), first=st.sampled_from(PAIR_FIELDS))
    def append_pair_mismatch(self, n: int, first: str) -> None:
        """K/V pairs whose values disagree with their keys (another dtype,
        batch, kv heads or rows than the keys, the keys as the cache holds
        them), each in turn (from ``first``): refused, nothing changes, on
        any cache, empty or not (a pair is checked against itself, not only
        against the cached rows)."""
        at = PAIR_FIELDS.index(first)
        for differs in PAIR_FIELDS[at:] + PAIR_FIELDS[:at]:
            self.do({"op": "append_pair_mismatch", "n": n, "differs": differs})  # type: ignore[attr-defined]

    #: the load paths :meth:`reload` takes, in order
    reload_paths: ClassVar[tuple[str, ...]] = ("state", "file")

    @rule()
    def reload(self) -> None:
        """Save and load the cache through every load path in turn: mlx-lm's
        load order (``state`` then ``meta_state``) and a prompt-cache file;
        the trace goes on with what was loaded, so every later op compares
        the loaded cache's behaviour with the spec's (not only its
        counters)."""
        for via in self.reload_paths:
            self.do({"op": "reload", "via": via})  # type: ignore[attr-defined]


#: rules that exist to reach a rare edge within a few examples (regrow after
#: trim, a whole rejected block): hidden with the lifecycle rules from the
#: machines mlx-lm targets run, whose fixed seeds reproduce their findings
EDGE_RULES = ("regrow_after_trim", "reject_block", "reject_beside_snapshot")


def without_lifecycle(cls: type) -> type:
    """``cls`` with the :class:`LifecycleRules` rules hidden (Hypothesis
    collects rules by attribute, so a plain attribute shadows one): for
    machines run against mlx-lm's caches, whose draw order fixed seeds
    reproduce."""
    for name in ("copy_cache", "prompt_cache_fetch", "append_mismatch", "append_pair_mismatch", "reload", "reinstall",
                 *EDGE_RULES):
        setattr(cls, name, None)
    return cls


__all__ = ["APPEND_N", "HEAD_DIMS", "KV_HEADS", "SMALL_STEPS", "KVMachine", "LifecycleRules", "StateProtocolMachine",
           "precondition", "without_lifecycle"]
