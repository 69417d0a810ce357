"""Runs of the prefix kind against any prefix target: ``prefix_campaign``
(a seeded campaign, its failure shrunk to a minimal kvtrace) and
``replay_prefix`` (one trace). Another engine (vLLM:
``fuzz/adapters/vllm.py``) plugs in through these two calls with a
``target_factory(cache) -> PrefixTarget`` (``kvspec.fuzz.prefix.PrefixTarget``);
the lockstep is ``kvspec.fuzz.prefix.PrefixLockstep``. This module sits with the
runners (``kvspec.fuzz.campaign``, ``kvspec.fuzz.replay``), above the kinds' harnesses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvspec.fuzz.campaign import machine_for, run_machine
from kvspec.fuzz.prefix import target_factories
from kvspec.fuzz.replay import ReplayResult, failure_status, replay
from kvspec.fuzz.trace import Trace, TraceFormatError, load

__all__ = ["PrefixResult", "prefix_campaign", "replay_prefix"]


@dataclass
class PrefixResult:
    """What :func:`prefix_campaign` found. ``status``: ``ok``, ``diverged``
    (``trace``: the minimal failing trace, ``error`` its divergence),
    ``not applicable`` (the target cannot run an op) or ``tool failure``.
    ``examples``: the examples the search ran (up to and including the
    failing one); ``shrink_examples``: those shrinking ran after it;
    ``stats``: the events reached (``kvspec.fuzz.prefix.PrefixLockstep.note``)."""

    ok: bool
    status: str
    examples: int
    seconds: float
    examples_to_catch: int | None = None
    seconds_to_catch: float | None = None
    error: BaseException | None = None
    trace: Any = None
    stats: dict[str, int] = field(default_factory=dict)
    shrink_examples: int = 0


def prefix_campaign(target_factory: Any, cache: dict[str, Any] | None = None, max_examples: int = 200,
                    seed: int = 0, shrink: bool = True, steps: int = 30) -> PrefixResult:
    """Fuzz a prefix target against the spec: ``max_examples`` examples of
    ``kvspec.fuzz.prefix.PrefixMachine`` from ``seed``. ``target_factory(cache) ->
    PrefixTarget`` builds the target for each example's cache fields (None:
    ours; a subclass of ``kvspec.impl.prefix.PrefixCachePool``: ours with that
    class); ``cache`` pins cache fields (e.g. ``{"block_size": 16}`` for an
    engine of that block size; None: all drawn). A divergence is shrunk
    (unless ``shrink=False``) to a minimal kvtrace
    (:attr:`PrefixResult.trace`, a ``kvspec.fuzz.trace.Trace``; write it with
    ``kvspec.fuzz.trace.write``) that :func:`replay_prefix` runs again."""
    machine = machine_for("prefix", "fp16", True, target_factories(target_factory), fixed=cache or {})
    r = run_machine(machine, seed, max_examples=max_examples, steps=steps, shrink=shrink)
    status = "ok" if not r.failed else failure_status(r.error)
    searched = r.examples_to_catch if r.failed and r.examples_to_catch else r.examples
    return PrefixResult(not r.failed, status, searched, r.seconds, r.examples_to_catch, r.seconds_to_catch,
                        r.error, r.trace, r.stats, shrink_examples=r.examples - searched)


def replay_prefix(trace: Any, target_factory: Any = None) -> ReplayResult:
    """Run a prefix kvtrace (a ``kvspec.fuzz.trace.Trace``, or a path) on the spec
    and a target (``target_factory(cache) -> PrefixTarget``; None: ours).
    Returns ``kvspec.fuzz.replay.ReplayResult`` (``ok``, ``divergence``); raises
    TraceFormatError for a trace it cannot run (the CLI's exit 2)."""
    if not isinstance(trace, Trace):
        trace = load(trace)
    if trace.cache.get("kind") != "prefix":
        raise TraceFormatError(f"field cache.kind: replay_prefix runs prefix traces, got {trace.cache.get('kind')!r}")
    return replay(trace, target_factories(target_factory))
