"""The harness's cheaper checks, each checked by a bug only it catches.

The per-op checks were made cheaper (docs/fuzzing.md, "Where a campaign's
time goes"): masks compared as whole matrices, expected rows computed on the
host, a list's mismatched rows handed to every layer in one pass.
``tests/test_fast_checks.py`` shows each cheaper form computes what the
form it replaced computed, but only on a correct implementation, where a
weakened check gives the same bytes too (a mask compared on its newest row
only, expected Int8 rows taken from the implementation's own quantizer, a
list mismatch that stops at the first refusal: each passed every test).

So each cheaper check is paired here with an injected bug of the catalog
(``fuzz/bugs/``) that only that check catches, and :func:`check_pairings`
replays the bug's regression trace (``tests/traces/<bug>.json``): it must
pass on the implementation, diverge on the bug with the check's own
message, and (where the check has a switch) pass on the bug with the check
switched off, which shows that no other check stands in for it. A weakened
check lets its bug's trace pass: the pairing fails. The one check whose
weakening no bug can show, because a weakened oracle agrees with any
implementation it calls, is tested directly: :func:`check_int8_oracle`
swaps ``kvspec.impl.quant``'s quantizer and dequantizer for wrong ones and
requires the expected Int8 bytes to stay the same, and swaps
``kvspec.fuzz.quant_ref``'s and requires them to change.

``kvspec verify`` runs both (job "harness mutants"), and so does
``tests/test_harness_mutants.py`` in ``make test``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

#: where the catalog's regression traces live (as ``kvspec verify`` reads them)
TRACES = Path(__file__).resolve().parents[1] / "tests" / "traces"


@dataclass(frozen=True)
class HarnessCheck:
    """A cheaper check of the harness and the catalog bug only it catches.

    ``where``: the code that implements the check (module.qualname);
    ``fires``: words of the Divergence it raises (the bug's trace must
    diverge with them, not on another check); ``switch``: ``(class path,
    attribute)`` of a class-level flag that turns the check off (set to
    False, the bug's trace must pass: only this check sees the bug), or
    None where the check has no switch."""

    name: str
    where: str
    bug: str
    fires: str
    switch: tuple[str, str] | None = None


CHECKS: tuple[HarnessCheck, ...] = (
    HarnessCheck("make_mask compared as whole [N, L] matrices", "kvspec.fuzz.masks.same_mask",
                 "mask_window_from_newest_query", "make_mask(",
                 ("kvspec.fuzz.dense:DenseLockstep", "check_dense_masks")),
    HarnessCheck("make_mask compared in its short form too (None, \"causal\")", "kvspec.fuzz.masks._compare",
                 "dense_mask_ignores_window", "make_mask(1, {'window_size'"),
    HarnessCheck("ring masks at windows narrower than the ring (kvspec.fuzz.masks.ring_windows)",
                 "kvspec.fuzz.masks.check_ring_masks", "decode_mask_window_ignores_sinks", "make_mask(1, {'window_size'",
                 ("kvspec.fuzz.rotating:RotatingLockstep", "narrow_masks")),
    HarnessCheck("Int8 expected rows from kvspec.fuzz.quant_ref",
                 "kvspec.fuzz.dense.DenseLockstep.host_stored_rows", "int8_dequantizes_in_float16", "returned window differs"),
    HarnessCheck("Int8 stored codes and scales from kvspec.fuzz.quant_ref", "kvspec.fuzz.dense.DenseLockstep.stored_int8",
                 "int8_zero_row_scale_zero", "stored Int8 key scales differ",
                 ("kvspec.fuzz.dense:DenseLockstep", "check_stored_int8")),
    HarnessCheck("Int8 stored codes and scales from kvspec.fuzz.quant_ref, the values' too",
                 "kvspec.fuzz.dense.DenseLockstep.stored_int8", "int8_zero_value_row_scale_zero",
                 "stored Int8 value scales differ", ("kvspec.fuzz.dense:DenseLockstep", "check_stored_int8")),
    HarnessCheck("unquantized expected rows: the host form", "kvspec.fuzz.lockstep.Lockstep.host_stored_rows",
                 "fp16_casts_rows", "returned window differs"),
    HarnessCheck("list append_mismatch on every layer",
                 "kvspec.fuzz.layers.LayersLockstep._append_mismatch", "list_ring_casts_rows",
                 "took rows of another dtype"),
)


def _resolve(path: str) -> Any:
    import importlib

    module, _, qual = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


@contextmanager
def switched_off(switch: tuple[str, str]) -> Iterator[None]:
    """The class flag ``switch`` set to False for the duration."""
    cls, attr = _resolve(switch[0]), switch[1]
    saved = cls.__dict__.get(attr, _MISSING)
    setattr(cls, attr, False)
    try:
        yield
    finally:
        if saved is _MISSING:
            delattr(cls, attr)
        else:
            setattr(cls, attr, saved)


_MISSING = object()


def check_pairing(check: HarnessCheck) -> list[str]:
    """What is wrong with ``check``'s pairing (empty: it holds): the paired
    bug's trace must replay clean on the implementation, diverge on the bug
    with ``check.fires``, and with the check switched off pass on the bug."""
    from kvspec.fuzz.bugs import by_name
    from kvspec.fuzz.replay import replay
    from kvspec.fuzz.trace import load

    bug = by_name(check.bug)
    path = TRACES / f"{bug.name}.json"
    if not path.exists():
        return [f"{check.name}: the paired bug {bug.name} has no regression trace {path}"]
    trace = load(path)
    problems = []
    clean = replay(trace)
    if not clean.ok:
        problems.append(f"{check.name}: trace {path.name} fails on the implementation: {clean.divergence}")
    on_bug = replay(trace, bug.factories)
    if on_bug.ok:
        problems.append(f"{check.name} ({check.where}) no longer catches {bug.name}: its trace {path.name} "
                        "passes on the bug (the check is weakened or gone)")
    elif check.fires not in str(on_bug.divergence):
        first = str(on_bug.divergence).splitlines()[0]
        problems.append(f"{check.name}: {bug.name}'s trace diverges on another check, not this one "
                        f"(expected {check.fires!r}): {first}")
    if check.switch is not None:
        with switched_off(check.switch):
            off = replay(trace, bug.factories)
        if not off.ok:
            first = str(off.divergence).splitlines()[0]
            problems.append(f"{check.name}: with {check.switch[1]} off another check still catches {bug.name} "
                            f"(the pairing shows nothing about this check): {first}")
    return problems


def check_pairings() -> list[tuple[HarnessCheck, list[str]]]:
    """Every :data:`CHECKS` entry and its problems."""
    return [(c, check_pairing(c)) for c in CHECKS]


# -- the Int8 oracle: independent of kvspec.impl.quant --------------------------------------


@contextmanager
def replaced(swaps: dict[Callable[..., Any], Callable[..., Any]], packages: tuple[str, ...]) -> Iterator[int]:
    """Each function of ``swaps`` replaced by its value wherever a module of
    ``packages`` binds it: module globals (``from kvspec.impl.quant import
    dequantize_int8``) and class attributes (``quantize_rows =
    staticmethod(quantize_int8)``), restored afterwards. Yields how many
    bindings were replaced."""
    by_id = {id(f): g for f, g in swaps.items()}
    undo: list[tuple[Any, str, Any]] = []

    def swap(owner: Any, name: str, value: Any) -> None:
        fn = value.__func__ if isinstance(value, staticmethod) else value
        new = by_id.get(id(fn))
        if new is None:
            return
        undo.append((owner, name, value))
        setattr(owner, name, staticmethod(new) if isinstance(value, staticmethod) else new)

    try:
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or not mod_name.startswith(tuple(p + "." for p in packages)) and mod_name not in packages:
                continue
            for name, value in list(vars(mod).items()):
                swap(mod, name, value)
                if isinstance(value, type) and value.__module__ == mod_name:
                    for attr, member in list(vars(value).items()):
                        swap(value, attr, member)
        yield len(undo)
    finally:
        for owner, name, value in reversed(undo):
            setattr(owner, name, value)


def _wrong_impl_int8() -> dict[Callable[..., Any], Callable[..., Any]]:
    """kvspec.impl.quant's quantizer (scales doubled) and dequantizer (one added)
    replaced by wrong ones: any expected row computed through them changes."""
    from kvspec.impl import quant

    quantize, dequantize = quant.quantize_int8, quant.dequantize_int8

    def wrong_quantize(x: mx.array) -> tuple[mx.array, mx.array]:
        q, scale = quantize(x)
        return q, scale * 2

    def wrong_dequantize(q: mx.array, scale: mx.array, dtype: mx.Dtype = mx.float16) -> mx.array:
        return dequantize(q, scale, dtype) + 1

    return {quant.quantize_int8: wrong_quantize, quant.dequantize_int8: wrong_dequantize}


def _wrong_oracle() -> dict[Callable[..., Any], Callable[..., Any]]:
    """kvspec.fuzz.quant_ref's quantizer and read-back replaced by wrong ones (the
    control: expected rows that come from the oracle change)."""
    from kvspec.fuzz import quant_ref

    quantize, dequantize = quant_ref.quantize, quant_ref.dequantize

    def wrong_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        q, scale = quantize(x)
        return q, (scale.astype(np.float64) * 2).astype(np.float16)

    def wrong_dequantize(q: np.ndarray, scale: np.ndarray, dtype: str = "float16") -> np.ndarray:
        return dequantize(q, scale, dtype) + 1

    return {quant_ref.quantize: wrong_quantize, quant_ref.dequantize: wrong_dequantize}


#: tokens whose expected Int8 rows are compared (every seventh K row is all zero)
ORACLE_TOKENS = tuple(range(12))


def expected_int8(dtype: str) -> dict[str, list[tuple[bytes, ...]]]:
    """The harness's expected Int8 bytes for :data:`ORACLE_TOKENS` in
    ``dtype``, from fresh drivers: the dense kind's window rows and stored
    codes and scales, and a list's Int8 layer's window rows."""
    from kvspec.fuzz.dense import DenseLockstep
    from kvspec.fuzz.layers import LayersLockstep

    cfg = {"mode": "int8", "step": 4, "batch": 2, "kv_heads": 2, "head_dim": 8, "v_head_dim": 4, "inplace": True,
           "dtype": dtype}
    dense = DenseLockstep(cfg)
    layers = LayersLockstep({**cfg, "layers": [{"kind": "dense"}]})
    return {
        "dense rows": [dense.expected_row(t) for t in ORACLE_TOKENS],
        "dense stored codes": [tuple(a.tobytes() for a in dense.stored_int8(t)) for t in ORACLE_TOKENS],
        "list rows": [layers.expected_row(t, "int8") for t in ORACLE_TOKENS],
    }


def oracle_rows(dtype: str) -> list[tuple[bytes, bytes]]:
    """kvspec.fuzz.quant_ref's read-back of the rows of :data:`ORACLE_TOKENS`,
    computed here from the rows' host form (what the harness must expect)."""
    from kvspec.fuzz.dense import DenseLockstep
    from kvspec.fuzz.quant_ref import int8_oracle_host

    lock = DenseLockstep({"mode": "int8", "step": 4, "batch": 2, "kv_heads": 2, "head_dim": 8, "v_head_dim": 4,
                          "inplace": True, "dtype": dtype})
    out = []
    for t in ORACLE_TOKENS:
        k, v = lock.host_rows([t])
        out.append((int8_oracle_host(k, dtype).tobytes(), int8_oracle_host(v, dtype).tobytes()))
    return out


def check_int8_oracle(dtypes: tuple[str, ...] = ("float16", "bfloat16", "float32")) -> list[str]:
    """What is wrong with the Int8 oracle's independence (empty: it holds).
    Per dtype: the expected bytes equal kvspec.fuzz.quant_ref's on the host rows;
    they do not change when kvspec.impl.quant's quantizer and dequantizer are
    replaced by wrong ones (wherever impl/ and fuzz/ bind them, the cache
    class's ``quantize_rows`` included); and each of them changes when
    kvspec.fuzz.quant_ref's are (the control: the comparison can fail)."""
    problems = []
    for dtype in dtypes:
        want = expected_int8(dtype)
        if want["dense rows"] != oracle_rows(dtype) or want["list rows"] != want["dense rows"]:
            problems.append(f"{dtype}: the expected Int8 rows are not kvspec.fuzz.quant_ref's read-back of the host rows")
        with replaced(_wrong_impl_int8(), ("kvspec.impl", "kvspec.fuzz")) as n:
            if n < 3:
                problems.append(f"only {n} bindings of kvspec.impl.quant's Int8 functions found to replace")
            got = expected_int8(dtype)
        for what in want:
            if got[what] != want[what]:
                changed = [t for t, a, b in zip(ORACLE_TOKENS, want[what], got[what]) if a != b]
                problems.append(f"{dtype}: {what} change when kvspec.impl.quant's quantizer is wrong (tokens {changed}): "
                                "the harness's expected Int8 bytes come from the implementation, not kvspec.fuzz.quant_ref")
        with replaced(_wrong_oracle(), ("kvspec.fuzz",)):
            swapped = expected_int8(dtype)
        for what in want:
            if swapped[what] == want[what]:
                problems.append(f"{dtype}: {what} stay the same when kvspec.fuzz.quant_ref is wrong: they do not come "
                                "from the oracle")
    return problems
