"""kvspec.fuzz.device: the --device choice reaches worker processes, bad choices
name their source, and the harness's device read is exact."""

import mlx.core as mx
import numpy as np
import pytest

from kvspec.fuzz import device
from kvspec.fuzz import rows as rowgen


def test_select_exports_the_choice_for_worker_processes(monkeypatch):
    monkeypatch.delenv(device.ENV, raising=False)
    assert device.select("cpu") == "cpu"
    import os

    assert os.environ[device.ENV] == "cpu" and device.current() == "cpu"
    assert device.select(None) == "cpu"  # a worker: the parent's choice, from the environment


@pytest.mark.parametrize(("arg", "env", "message"), [
    ("tpu", None, "--device must be one of cpu, gpu, got 'tpu'"),
    (None, "tpu", "KVSPEC_DEVICE must be one of cpu, gpu, got 'tpu'"),
])
def test_a_bad_device_names_where_it_came_from(arg, env, message, monkeypatch):
    if env is None:
        monkeypatch.delenv(device.ENV, raising=False)
    else:
        monkeypatch.setenv(device.ENV, env)
    with pytest.raises(device.DeviceError, match=message):
        device.select(arg)


def test_gpu_without_a_gpu_backend_exits_2_on_the_cli(capsys, monkeypatch):
    from kvspec.fuzz.commands.cli import main

    monkeypatch.setattr(device, "gpu_available", lambda: False)
    assert main(["replay", "--device", "gpu", "tests/traces/steady_state_inplace.json"]) == 2
    assert "--device gpu: this MLX build has no GPU backend" in capsys.readouterr().out


SPECIAL = [0.0, -0.0, 1.5, -2.0**-14, 65504.0, -65504.0, 2.0**-24]


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_the_gpu_device_read_is_exact_bit_for_bit(dtype, monkeypatch):
    """On a GPU the harness reads windows through a device op; it must not
    change a bit (signed zeros, extremes, subnormals), or the row identities
    would hide what the cache did."""
    monkeypatch.setattr(device, "current", lambda: "gpu")
    a = mx.array(SPECIAL, dtype=dtype)
    read = device.device_read(a)
    assert read is not a  # really a device op, not the array itself
    bits = {mx.float16: mx.uint16, mx.bfloat16: mx.uint16, mx.float32: mx.uint32}[dtype]
    assert np.array(mx.view(read, bits)).tolist() == np.array(mx.view(a, bits)).tolist()


def test_host_reads_bfloat16_one_to_one():
    """bfloat16 rows reach NumPy as the float32 of each value: exact, and
    distinct bit patterns stay distinct."""
    patterns = mx.array([0x0000, 0x8000, 0x3F80, 0x3F81, 0x7F7F, 0x0001], dtype=mx.uint16)
    a = mx.view(patterns, mx.bfloat16)
    got = rowgen.host(a)
    assert got.dtype == np.float32 and len({x.tobytes() for x in got}) == 6
    assert ((got.view(np.uint32) >> 16).astype(np.uint16) == np.array(patterns)).all()
