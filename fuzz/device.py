"""Which MLX device the harness runs on (``--device`` of ``kvspec verify``,
``fuzz`` and ``replay``), carried to worker processes in ``KVSPEC_DEVICE``.

``cpu`` runs every cache op on the CPU stream, ``gpu`` on the GPU (MLX's
CUDA backend, or Metal on Apple silicon); unset leaves MLX's own default
(the GPU where MLX has one). On a GPU, every window the harness compares is
first read by a device operation evaluated together with the writes before
it (:func:`device_read`), as a decoder's attention reads it: a host read
alone would wait for the whole graph and hide a write that a device read can
overtake (``gpu_kernel_ordered_by_depends`` in the injected-bug catalog).
"""

from __future__ import annotations

import os

import mlx.core as mx

ENV = "KVSPEC_DEVICE"
DEVICES = ("cpu", "gpu")


class DeviceError(ValueError):
    """A device that is not one of :data:`DEVICES`, or a GPU this MLX build
    does not have."""


def gpu_available() -> bool:
    """Whether this MLX build has a GPU backend it can run on."""
    return bool(mx.cuda.is_available() or mx.metal.is_available())


def check(name: str, source: str = "--device") -> str:
    """``name`` if it is a device this machine can run; DeviceError naming
    ``source`` (the option or the variable it came from) and the rule
    otherwise."""
    if name not in DEVICES:
        raise DeviceError(f"{source} must be one of {', '.join(DEVICES)}, got {name!r}")
    if name == "gpu" and not gpu_available():
        raise DeviceError(f"{source} gpu: this MLX build has no GPU backend (mx.cuda and mx.metal are unavailable); "
                          "run on a machine with MLX's CUDA or Metal backend, or use --device cpu")
    return name


def select(name: str | None) -> str:
    """Make ``name`` (``cpu``, ``gpu``; None: the environment's
    ``KVSPEC_DEVICE``, else MLX's default) the default device of this process
    and of the worker processes it starts. Returns the device in use.
    Raises DeviceError (the environment or the argument is bad)."""
    source = "--device"
    if name is None:
        name, source = os.environ.get(ENV) or None, ENV
    if name is None:
        return current()
    check(name, source)
    os.environ[ENV] = name
    mx.set_default_device(mx.gpu if name == "gpu" else mx.cpu)
    return name


def current() -> str:
    """``gpu`` when MLX's default device is a GPU, else ``cpu``."""
    return "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"


def device_read(a: mx.array) -> mx.array:
    """``a`` as read by a device operation (multiplication by one: exact for
    every float, signed zeros included) on a GPU, ``a`` itself on the CPU."""
    if current() == "gpu" and isinstance(a, mx.array) and mx.issubdtype(a.dtype, mx.floating):
        return a * mx.array(1, dtype=a.dtype)
    return a
