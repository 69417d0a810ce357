"""The comparison machinery: sizes, streams, byte-for-byte comparison, the failure type."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from kvspec.fuzz.commands.e2e.models import VOCAB


class Divergence(AssertionError):
    """A scenario's check failed: streams differ, a holder's view changed,
    layers disagree, or the scenario did not reach what it must exercise."""


@dataclass(frozen=True)
class Size:
    """``tokens``: tokens per greedy stretch; ``window``: the sliding window;
    ``seeds``: one model per seed."""

    tokens: int
    window: int
    seeds: tuple[int, ...]


SHORT = Size(tokens=32, window=8, seeds=(0, 1))  # tests/test_e2e.py (make test)


#: ``kvspec verify``: the short size's streams (32 tokens, window 8: each
#: stream crosses its window four times, as at the default size) on two
#: models the test suite does not build (seeds 2 and 3), so that ``make
#: test`` and ``make verify`` together decode through four models; every
#: scenario's check and its minimums (wraps, rollbacks, rollback lengths)
#: are the short size's
VERIFY = Size(tokens=32, window=8, seeds=(2, 3))


DEFAULT = Size(tokens=64, window=16, seeds=(0, 1, 2))  # kvspec e2e


LONG = Size(tokens=160, window=48, seeds=(0, 1, 2, 3))  # kvspec e2e --long


#: whether a scenario also measures what it only reports (its notes: a
#: deviation from fp16, how mlx-lm's own caches fare): no check reads those
#: figures, so ``kvspec verify``, which shows a passed scenario's tokens and
#: not its notes, runs the scenarios without them (:func:`checks_only`)
_RECORDS: ContextVar[bool] = ContextVar("e2e_records", default=True)


def records() -> bool:
    """True unless inside :func:`checks_only`: measure the figures a
    scenario only reports."""
    return _RECORDS.get()


@contextmanager
def checks_only() -> Iterator[None]:
    """Run the scenarios inside without their report-only measurements
    (:func:`records` is False): every check is the same, the notes say
    which figures were not measured."""
    token = _RECORDS.set(False)
    try:
        yield
    finally:
        _RECORDS.reset(token)


def views(holders: Iterable[Any]) -> list[bytes]:
    """The bytes of every holder's window (snapshots or caches)."""
    out = []
    for h in holders:
        got = h.fetch()
        out.append(b"" if got is None else b"".join(np.array(a).tobytes() for a in got))
    return out


def layer_states(caches: list[Any]) -> list[tuple[int, bytes]]:
    return [(c.offset, v) for c, v in zip(caches, views(caches))]


@dataclass
class Stream:
    """Generated tokens and each step's float16 log-probabilities (raw
    bytes); ``inplace_writes`` counts decode steps whose last write went in
    place (summed over layers)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[bytes] = field(default_factory=list)
    inplace_writes: int = 0

    def __add__(self, other: Stream) -> Stream:
        return Stream(self.tokens + other.tokens, self.logprobs + other.logprobs,
                      self.inplace_writes + other.inplace_writes)


@dataclass
class Tally:
    """What a scenario compared: the generated tokens checked against a
    reference (each with its log-probability vector)."""

    tokens: list[int] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        self.checks.append(text)


def logprob_bytes(logprobs: mx.array) -> bytes:
    """A step's log-probabilities as bytes: float16 as they are; bfloat16
    (NumPy has none) as the float32 of each value, exact and one-to-one."""
    if logprobs.dtype == mx.bfloat16:
        logprobs = logprobs.astype(mx.float32)
    return np.array(logprobs).tobytes()


def _first_diff(a: bytes, b: bytes) -> str:
    dtype = np.float16 if len(a) == 2 * VOCAB else np.float32
    x, y = np.frombuffer(a, dtype=dtype), np.frombuffer(b, dtype=dtype)
    if x.shape != y.shape:
        return f"shapes {x.shape} vs {y.shape}"
    d = np.abs(x.astype(np.float32) - y.astype(np.float32))
    bits = np.uint16 if dtype == np.float16 else np.uint32
    return f"{int((x.view(bits) != y.view(bits)).sum())} of {x.size} entries differ, max |diff| {np.nanmax(d):.3g}"


def min_distinct(n: int) -> int:
    """The fewest distinct tokens a stream of ``n`` tokens must show."""
    return n // 3


def compare(label: str, got: Stream, want: Stream, tally: Tally) -> None:
    """Tokens and log-probability bytes equal at every step; the stream did
    not collapse. Raises Divergence naming the first differing step."""
    for i, (a, b) in enumerate(zip(got.tokens, want.tokens)):
        if a != b:
            raise Divergence(f"{label}: step {i}: token {a}, reference {b}")
        if got.logprobs[i] != want.logprobs[i]:
            raise Divergence(f"{label}: step {i} (token {a}): log-probabilities differ: "
                             f"{_first_diff(got.logprobs[i], want.logprobs[i])}")
    if len(got.tokens) != len(want.tokens):
        raise Divergence(f"{label}: {len(got.tokens)} tokens, reference {len(want.tokens)}")
    distinct = len(set(got.tokens))
    if distinct < min_distinct(len(got.tokens)):
        raise Divergence(f"{label}: stream collapsed: {distinct} distinct tokens in {len(got.tokens)} "
                         f"(need {min_distinct(len(got.tokens))}); the scenario would not be sensitive")
    tally.tokens.extend(got.tokens)


def require(cond: bool, message: str) -> None:
    if not cond:
        raise Divergence(message)


def check_unchanged(label: str, before: list[bytes], after: list[bytes]) -> None:
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
    require(not changed, f"{label}: snapshot of layer(s) {changed} changed (isolation)")


@dataclass
class Deviation:
    """Log-probability deviation of a cache mode from fp16 along one stream."""

    max_abs: float = 0.0
    mean_max_abs: float = 0.0
    top1: float = 1.0
    steps: int = 0

    def add(self, got: list[np.ndarray], ref: list[np.ndarray]) -> None:
        per_step = [float(np.max(np.abs(a - b))) for a, b in zip(got, ref)]
        agree = [int(np.argmax(a) == np.argmax(b)) for a, b in zip(got, ref)]
        n = self.steps + len(per_step)
        self.mean_max_abs = (self.mean_max_abs * self.steps + sum(per_step)) / n
        self.top1 = (self.top1 * self.steps + sum(agree)) / n
        self.max_abs = max(self.max_abs, *per_step)
        self.steps = n

    def __str__(self) -> str:
        return f"max |dlogp| {self.max_abs:.3f} (mean per step {self.mean_max_abs:.3f}), top-1 agreement {self.top1:.0%}"


def _max_logprob_diff(a: list[bytes], b: list[bytes]) -> float:
    return max((float(np.abs(np.frombuffer(x, np.float16).astype(np.float32) - np.frombuffer(y, np.float16)).max())
                for x, y in zip(a, b)), default=0.0)


def on_gpu() -> bool:
    from kvspec.fuzz.device import current

    return current() == "gpu"
