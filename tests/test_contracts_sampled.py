"""The contracts CrossHair cannot confirm (``kvspec.proofs.crosshair_run.EXPLAINED``),
evaluated as written on reachable inputs.

For each explained function the very ``pre:``/``post:`` lines of its
docstring are evaluated (in the function's module, with its arguments bound
and ``__return__`` the result) on caches reached from ``new_cache`` by a
drawn sequence of the spec's own ops (appends, trims, front trims, gathers,
in every mode and small steps), with the op's arguments drawn around the
edges (0, the live length, beyond it, negative). Inputs that break a
``pre:`` line are discarded (the spec's refusals are tested elsewhere); a
``post:`` line that is false fails with the input. The test fails if an
explained function has no sampler here, or a sampler runs no input meeting
the preconditions (a check that checked nothing).
"""

from __future__ import annotations

import inspect
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec.proofs.crosshair_run import EXPLAINED
from kvspec.spec import dense
from kvspec.spec.errors import KVCacheError

COND = re.compile(r"^\s*(pre|post):\s*(.*)$", re.MULTILINE)


def conditions(fn) -> tuple[list[str], list[str]]:
    doc = inspect.getdoc(fn) or ""
    pre = [m[2] for m in COND.finditer(doc) if m[1] == "pre"]
    post = [m[2] for m in COND.finditer(doc) if m[1] == "post"]
    return pre, post


def check(fn, **kwargs) -> bool:
    """Evaluate ``fn``'s contract on ``kwargs``; False when a pre: line fails."""
    pre, post = conditions(fn)
    scope = dict(inspect.getmodule(fn).__dict__)
    bound = inspect.signature(fn).bind(**kwargs)
    bound.apply_defaults()
    scope.update(bound.arguments)
    if not all(eval(p, scope) for p in pre):
        return False
    scope["__return__"] = fn(**kwargs)
    for p in post:
        assert eval(p, scope), f"{fn.__name__}: {p} is false for {kwargs!r} -> {scope['__return__']!r}"
    return True


@st.composite
def reachable_caches(draw) -> dense.DenseCache:
    cache = dense.new_cache(draw(st.sampled_from(list(dense.Mode))), draw(st.integers(1, 4)),
                            draw(st.booleans()))
    token = 0
    for _ in range(draw(st.integers(0, 6))):
        op = draw(st.sampled_from(["append", "append", "trim", "front", "gather"]))
        try:
            if op == "append":
                k = draw(st.integers(1, 4))
                _, cache = dense.append(cache, tuple(range(token, token + k)))
                token += k
            elif op == "trim":
                _, cache = dense.trim(cache, draw(st.integers(-1, cache.live_len + 1)))
            elif op == "front":
                _, cache = dense.trim_front_keep_sink(cache, draw(st.integers(0, 3)), draw(st.integers(0, 2)))
            elif cache.live_len:
                keep = sorted(draw(st.sets(st.integers(0, cache.live_len - 1), min_size=1)))
                _, cache = dense.gather_positions(cache, tuple(keep))
        except KVCacheError:
            pass  # a refused op changes nothing
    return cache


MET: dict[str, int] = {}


def _count(name: str, met: bool) -> None:
    MET[name] = MET.get(name, 0) + met


@st.composite
def _append_args(draw):
    cache = draw(reachable_caches())
    return {"cache": cache, "tokens": tuple(range(100, 100 + draw(st.integers(1, 5))))}


@st.composite
def _trim_args(draw):
    cache = draw(reachable_caches())
    return {"cache": cache, "n": draw(st.integers(-2, cache.live_len + 2))}


@st.composite
def _trim_to_args(draw):
    cache = draw(reachable_caches())
    return {"cache": cache, "length": draw(st.integers(0, cache.offset))}


@st.composite
def _front_args(draw):
    cache = draw(reachable_caches())
    return {"cache": cache, "n": draw(st.integers(-1, cache.live_len + 1)), "keep": draw(st.integers(-1, 3))}


@st.composite
def _tail_args(draw):
    cache = draw(reachable_caches())
    tail = draw(st.integers(1, max(1, cache.live_len)))
    kept = sorted(draw(st.sets(st.integers(0, tail - 1), min_size=1)))
    return {"cache": cache, "tail_len": tail, "kept": tuple(kept)}


@st.composite
def _gather_args(draw):
    cache = draw(reachable_caches())
    positions = sorted(draw(st.sets(st.integers(0, max(0, cache.live_len - 1)), min_size=1)))
    return {"cache": cache, "positions": tuple(positions)}


WORDS = ["0", "false", "off", "no", "1", "on", "true", "yes", ""]


@st.composite
def _switch_args(draw):
    word = draw(st.sampled_from(WORDS) | st.text(max_size=8))
    word = "".join(c.upper() if draw(st.booleans()) else c for c in word)
    pad = st.sampled_from(["", " ", "\t", "  \n"])
    return {"env_value": draw(st.none() | st.just(draw(pad) + word + draw(pad)))}


SAMPLERS = {
    ("spec/dense.py", "append"): (dense.append, _append_args()),
    ("spec/dense.py", "trim"): (dense.trim, _trim_args()),
    ("spec/dense.py", "trim_to"): (dense.trim_to, _trim_to_args()),
    ("spec/dense.py", "trim_front_keep_sink"): (dense.trim_front_keep_sink, _front_args()),
    ("spec/dense.py", "gather_within_tail"): (dense.gather_within_tail, _tail_args()),
    ("spec/dense.py", "gather_positions"): (dense.gather_positions, _gather_args()),
    ("spec/dense.py", "inplace_switch"): (dense.inplace_switch, _switch_args()),
}


def test_every_explained_contract_has_a_sampler() -> None:
    assert set(EXPLAINED) == set(SAMPLERS)
    for fn, _ in SAMPLERS.values():
        assert conditions(fn)[1], f"{fn.__name__} has no post: line to check"


@pytest.mark.parametrize("key", sorted(SAMPLERS), ids=lambda k: k[1])
def test_contract_holds_on_reachable_inputs(key) -> None:
    fn, strategy = SAMPLERS[key]
    MET.pop(fn.__name__, None)

    @settings(max_examples=150)
    @given(strategy)
    def run(kwargs):
        _count(fn.__name__, check(fn, **kwargs))

    run()
    assert MET.get(fn.__name__, 0) >= 30, f"{fn.__name__}: only {MET.get(fn.__name__, 0)} inputs met the pre: lines"


def test_a_false_postcondition_is_seen() -> None:
    """The evaluator is not vacuous: trim's contract fails on a trim that
    drops one row too few."""
    def broken_trim(cache, n):
        got, out = dense.trim(cache, n)
        return (got, out) if got == 0 else dense.trim(cache, n - 1)

    broken_trim.__doc__ = dense.trim.__doc__
    broken_trim.__module__ = dense.trim.__module__
    _, cache = dense.append(dense.new_cache(dense.Mode.FP16, 4), (1, 2, 3))
    with pytest.raises(AssertionError, match="is false"):
        check(broken_trim, cache=cache, n=2)
