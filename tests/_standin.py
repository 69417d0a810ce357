"""Stand in a device backend for kvspec.impl.write on this CPU-only machine: the
real ``backend()`` and ``inplace_mechanism()`` run, reading a GPU where the
default device is (``W._GPU`` set to its type) with ``answer`` as what that
GPU is; ``"cpu"`` makes no device a GPU."""

from __future__ import annotations

import mlx.core as mx

import kvspec.impl.write as W


class _NoDevice:
    """A device type no default device has."""


def stand_in(monkeypatch, answer: str) -> None:
    if answer == "cpu":
        monkeypatch.setattr(W, "_GPU", _NoDevice())
        return
    if answer not in ("cuda", "metal"):
        raise ValueError(f"stand_in: answer must be cpu, cuda or metal, got {answer!r}")
    monkeypatch.setattr(W, "_GPU", mx.default_device().type)
    monkeypatch.setattr(W, "_BACKENDS", {"gpu": answer})
    assert W.backend() == answer
