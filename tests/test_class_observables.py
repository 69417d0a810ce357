"""What a cache class target does not provide (docs/targets.md "Not compared
means nowhere"): an observable that is missing, or that reads ``None`` on the
fresh cache, is not compared, by the lockstep nor by a machine's invariant,
and the report says which; it never crashes the harness (a class whose
``live_start`` read None once failed every campaign after 0 steps on ``'<='
not supported between 'int' and 'NoneType'``). A class target has no
in-place switch of ours, and is fuzzed once per kind and mode.

The classes are written into a package under ``tmp_path``, as a user's would be."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvspec.fuzz.commands.cli import main
from tests.target_examples import CACHE_MODULE

EXTRA = '''

class NoneStartOnClass:
    """this project's dense cache with live_len and capacity, and live_start
    a class attribute of None"""
    kvspec_kind = "dense"
    live_start = None

    def __init__(self, step=256):
        from kvspec.impl.dense import KVCache

        self.inner = KVCache(step=step, inplace=False)

    def update_and_fetch(self, keys, values):
        return self.inner.update_and_fetch(keys, values)

    def fetch(self):
        return self.inner.fetch()

    def trim(self, n):
        return self.inner.trim(n)

    offset = property(lambda self: self.inner.offset)
    live_len = property(lambda self: self.inner.live_len)
    capacity = property(lambda self: self.inner.capacity)


class NoneInInit(ListCache):
    """the three optional observables set to None on the instance"""

    def __init__(self):
        super().__init__()
        self.live_start = self.live_len = self.capacity = None


class StartGoesNone(NoneStartOnClass):
    """live_start provided (0) on the fresh cache, None once rows arrive: compared, a divergence"""

    @property
    def live_start(self):
        return 0 if self.offset == 0 else None
'''

TRACE = {"kvtrace": 1, "cache": {"kind": "dense", "step": 2, "kv_heads": 1, "head_dim": 4},
         "ops": [{"op": "append", "n": 3}, {"op": "trim", "n": 1}, {"op": "append", "n": 1}, {"op": "fetch"}]}


@pytest.fixture
def userpkg(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "nonecache"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "cache.py").write_text(CACHE_MODULE + EXTRA)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for mod in [m for m in sys.modules if m == "nonecache" or m.startswith("nonecache.")]:
        monkeypatch.delitem(sys.modules, mod)
    return tmp_path


def fuzz_json(capsys, target: str, out: Path) -> tuple[int, dict]:
    # one batch of examples, whatever the machine's speed (tests/test_broken_targets.py)
    code = main(["fuzz", "--target", target, "--budget", "0.001", "--seed", "1", "--out", str(out), "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(("cls", "absent"), [("NoneStartOnClass", ["live_start"]),
                                             ("NoneInInit", ["capacity", "live_len", "live_start"])])
def test_an_observable_reading_none_is_not_compared_and_no_crash(userpkg, capsys, cls, absent):
    code, report = fuzz_json(capsys, f"nonecache.cache:{cls}", userpkg / "out")
    text = json.dumps(report)
    assert "NoneType" not in text, report
    assert code == 0, report
    # a class target has no in-place switch of ours: one run per kind and mode
    assert [r["config"].rsplit(":", 1)[1] for r in report["runs"]] == ["dense/fp16/inplace"], report
    run = report["runs"][0]
    assert run["result"] == "ok" and run["steps"] > 0, run
    for name in absent:
        assert any(k.startswith(f"not compared: {name} (reads None)") for k in run["reached"]), run["reached"]
    assert not (userpkg / "out").exists() or not list((userpkg / "out").rglob("*.json"))


def test_the_text_report_and_a_replay_name_what_was_not_compared(userpkg, capsys):
    main(["fuzz", "--target", "nonecache.cache:NoneStartOnClass", "--budget", "0.001", "--seed", "1",
          "--out", str(userpkg / "out")])
    out = " ".join(capsys.readouterr().out.split())
    assert "not compared: live_start (reads None)" in out, out
    path = userpkg / "t.json"
    path.write_text(json.dumps(TRACE))
    code = main(["replay", str(path), "--target", "nonecache.cache:NoneStartOnClass"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0 and "does not compare live_start" in out and "NoneType" not in out, out


def test_an_observable_that_turns_none_later_is_a_divergence_not_a_crash(userpkg, capsys, tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(TRACE))
    code = main(["replay", str(path), "--target", "nonecache.cache:StartGoesNone"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 1 and "live_start differs" in out and "NoneType" not in out, out


@pytest.mark.parametrize("machine", ["dense", "rotating"])
def test_an_invariant_does_not_crash_on_a_value_that_is_no_number(machine):
    """Behind the lockstep's own check: a machine's invariant over the
    target's observables returns (the lockstep compares them after every
    op) when one is not a number, e.g. None on a fresh cache."""
    if machine == "dense":
        from kvspec.fuzz.dense import DenseMachine as M
        check = M.offsets_in_range
        cache = SimpleNamespace(live_start=None, live_len=0, offset=0, capacity=0)
    else:
        from kvspec.fuzz.rotating import RotatingMachine as M
        check = M.cursor_in_range
        cache = SimpleNamespace(idx=None, capacity=4, keep=0, offset=0)
    check(SimpleNamespace(lock=SimpleNamespace(cache=cache, not_compared=set())))
    # the control: numbers that break the rule still fail it
    bad = (SimpleNamespace(live_start=3, live_len=0, offset=1, capacity=0) if machine == "dense"
           else SimpleNamespace(idx=9, capacity=4, keep=0, offset=9))
    with pytest.raises(AssertionError):
        check(SimpleNamespace(lock=SimpleNamespace(cache=bad, not_compared=set())))
