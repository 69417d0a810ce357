"""A Ctrl-C that lands in a finalizer or a gc callback still stops a run
(kvspec.fuzz.interrupt): CPython drops the KeyboardInterrupt raised there."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from kvspec.fuzz import interrupt
    from kvspec.fuzz.campaign import Campaign, interleaved

    if sys.argv[1] == "install":
        assert interrupt.install()

    class Finalizer:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(200):  # the handler runs in this frame: its KeyboardInterrupt is dropped
                time.sleep(0.001)

    f = Finalizer()
    del f
    print("carried on", flush=True)
    try:
        # 0.5 s: the campaign checks for a recorded Ctrl-C before its first batch; without
        # that check it would run to its end and print "finished", whatever the budget
        interleaved([Campaign("dense", "fp16", True, 5, batch=2, steps=5)], budget=0.5)
    except KeyboardInterrupt:
        print("stopped", flush=True)
        sys.exit(130)
    print("finished", flush=True)
""")


def run(mode: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "KVSPEC_DB": "none"}
    return subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def test_a_swallowed_ctrl_c_still_stops_a_campaign():
    proc = run("install")
    assert "Exception ignored" in proc.stderr and "KeyboardInterrupt" in proc.stderr, proc.stderr
    assert proc.stdout.split() == ["carried", "on", "stopped"], proc.stdout + proc.stderr
    assert proc.returncode == 130


def test_without_the_handler_the_same_ctrl_c_is_lost():
    # the control: Python's own handler loses it, and the campaign runs to its end
    proc = run("default")
    assert "Exception ignored" in proc.stderr, proc.stderr
    assert proc.stdout.split() == ["carried", "on", "finished"], proc.stdout + proc.stderr
    assert proc.returncode == 0


def test_install_leaves_a_host_handler_alone():
    code = textwrap.dedent("""
        import signal
        from kvspec.fuzz import interrupt
        mine = lambda s, f: None
        signal.signal(signal.SIGINT, mine)
        assert not interrupt.install()
        assert signal.getsignal(signal.SIGINT) is mine
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.stdout.strip() == "ok", proc.stderr


TRACE = str(REPO / "tests" / "traces" / "dense_detach_install.json")


@pytest.fixture
def recorded(monkeypatch):
    """A Ctrl-C recorded by kvspec's handler whose KeyboardInterrupt went
    nowhere (as in a gc callback); the process's handler and the module's
    state are put back afterwards."""
    import signal

    from kvspec.fuzz import interrupt

    before = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(interrupt, "_installed", interrupt._installed)
    try:
        interrupt._handler(signal.SIGINT, None)
    except KeyboardInterrupt:
        pass
    assert interrupt.requested()
    yield interrupt
    interrupt.clear()
    signal.signal(signal.SIGINT, before)


def test_every_lockstep_step_raises_a_recorded_request(recorded):
    from kvspec.fuzz.replay import replay
    from kvspec.fuzz.trace import load

    with pytest.raises(KeyboardInterrupt):
        replay(load(TRACE))


def test_every_campaign_batch_raises_a_recorded_request(recorded, monkeypatch):
    # the batch itself stubbed out: only the campaign loop's own check can stop it
    from kvspec.fuzz.campaign import Campaign, interleaved

    batches = []

    def batch(self, share):
        batches.append(share)
        if len(batches) > 3:  # without its check the loop would spin on to its budget's end
            raise AssertionError("the campaign ran batches with a Ctrl-C recorded")

    monkeypatch.setattr(Campaign, "batch", batch)
    with pytest.raises(KeyboardInterrupt):
        interleaved([Campaign("dense", "fp16", True, 5, batch=2, steps=5)], budget=2.0)
    assert batches == []


def test_a_command_forgets_the_request_it_handled(recorded):
    """kvspec's main() stops a command on a recorded request (exit 130) and
    clears it: the next command in the same process (an embedding program,
    a test) runs to its end instead of stopping at its first step."""
    from kvspec.fuzz.commands import cli

    assert cli.main(["replay", TRACE]) == 130
    assert not recorded.requested()
    assert cli.main(["replay", TRACE]) == 0
