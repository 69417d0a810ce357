"""What an exec: adapter leaves out of its ``hello`` (docs/targets.md "What it
declares"): a cache field it does not declare is its own at the field's
default, never sent and never a reason to refuse a campaign's caches (an
adapter without the ``inplace`` switch is fuzzed once, and runs); a
trace that sets it to another value is refused. An observable it declares
but leaves out of a state line is the adapter breaking the protocol, said
in a sentence, never a crash of the harness nor a trace written for it.

The adapter is tests/broken_targets/kvproto_dense.py behind a small filter
that rewrites its hello and state lines."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from kvspec.fuzz.adapters import exec as ex
from kvspec.fuzz.commands.cli import main

ADAPTER = Path(__file__).resolve().parent / "broken_targets" / "kvproto_dense.py"

#: a kvproto/1 adapter in front of ADAPTER: ``--drop-field F`` leaves F out of
#: the hello's fields (and exits, an adapter crash, if init still sends it);
#: ``--strip-state O`` leaves observable O out of every state line, though
#: the hello declares it; ``--strip-from-op N``: only from the replies to
#: the N-th op request on (0-based), init's and earlier ops' complete
FILTER = '''
import json, subprocess, sys
args = sys.argv[1:]
drop = [args[i + 1] for i, a in enumerate(args) if a == "--drop-field"]
strip = [args[i + 1] for i, a in enumerate(args) if a == "--strip-state"]
start = int(next((args[i + 1] for i, a in enumerate(args) if a == "--strip-from-op"), -1))
ops = 0
inner = subprocess.Popen([sys.executable, ADAPTER, "--observables", "offset,live_start,live_len"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
for line in sys.stdin:
    req = json.loads(line)
    if req["request"] == "init" and any(f in req["cache"] for f in drop):
        sys.exit(f"init sent an undeclared field: {sorted(req['cache'])}")
    inner.stdin.write(line)
    inner.stdin.flush()
    if req["request"] == "bye":
        break
    reply = json.loads(inner.stdout.readline())
    if "kinds" in reply:
        for d in reply["kinds"].values():
            d["fields"] = [f for f in d["fields"] if f not in drop]
    if req["request"] == "op":
        ops += 1
    if start < 0 or (req["request"] == "op" and ops > start):
        for o in strip:
            reply.get("state", {}).pop(o, None)
    sys.stdout.write(json.dumps(reply) + "\\n")
    sys.stdout.flush()
'''

TRACE = {"kvtrace": 1, "cache": {"kind": "dense", "step": 2, "kv_heads": 1, "head_dim": 4},
         "ops": [{"op": "append", "n": 3}, {"op": "trim", "n": 1}, {"op": "append", "n": 1}, {"op": "fetch"}]}


@pytest.fixture
def adapter(tmp_path: Path):
    path = tmp_path / "filter.py"
    path.write_text(f"ADAPTER = {str(ADAPTER)!r}\n" + FILTER)

    def spec(*args: str) -> str:
        return "exec:" + shlex.join([sys.executable, str(path), *args])

    yield spec
    ex.close_sessions()


def fuzz_json(capsys: pytest.CaptureFixture, target: str, out: Path) -> tuple[int, dict]:
    code = main(["fuzz", "--target", target, "--budget", "1", "--seed", "1", "--out", str(out), "--json"])
    return code, json.loads(capsys.readouterr().out)


def replay(capsys: pytest.CaptureFixture, target: str, trace: dict, tmp_path: Path) -> tuple[int, str]:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    code = main(["replay", str(path), "--target", target])
    got = capsys.readouterr()
    return code, got.out + got.err


def test_an_adapter_without_the_inplace_switch_is_fuzzed_once_and_runs(adapter, capsys, tmp_path):
    code, report = fuzz_json(capsys, adapter("--drop-field", "inplace"), tmp_path / "out")
    runs = report["runs"]
    assert code == 0 and [r["config"].rsplit("/", 1)[1] for r in runs] == ["inplace"], report
    assert runs[0]["result"] == "ok" and runs[0]["steps"] > 0, runs[0]
    # the control: an adapter that takes the switch runs both settings
    code, report = fuzz_json(capsys, adapter(), tmp_path / "out2")
    assert code == 0 and [r["config"].rsplit("/", 1)[1] for r in report["runs"]] == ["inplace", "copy"], report
    assert all(r["result"] == "ok" and r["steps"] > 0 for r in report["runs"]), report


def test_an_undeclared_field_is_taken_at_its_default_and_refused_otherwise(adapter, capsys, tmp_path):
    target = adapter("--drop-field", "inplace")
    for inplace in (None, True):
        trace = {**TRACE, "cache": {**TRACE["cache"], **({} if inplace is None else {"inplace": inplace})}}
        code, out = replay(capsys, target, trace, tmp_path)
        assert code == 0, out  # the filter exits if init sends the field
    code, out = replay(capsys, target, {**TRACE, "cache": {**TRACE["cache"], "inplace": False}}, tmp_path)
    assert code == 2 and "declares no cache field 'inplace'" in out, out


def test_a_declared_observable_missing_from_the_state_is_no_harness_crash(adapter, capsys, tmp_path):
    target = adapter("--strip-state", "live_start")
    code, report = fuzz_json(capsys, target, tmp_path / "out")
    for run in report["runs"]:
        assert run["result"] != "tool failure", run
        assert "its state lacks live_start" in run.get("error", "") + json.dumps(run), run
    assert "NoneType" not in json.dumps(report), report
    written = sorted(p.name for p in (tmp_path / "out").rglob("*")) if (tmp_path / "out").exists() else []
    assert not written, written  # nothing to shrink: no 0-op "minimal trace"
    code, out = replay(capsys, target, TRACE, tmp_path)
    assert code != 0 and "its state lacks live_start" in out and "NoneType" not in out, out


def test_an_undeclared_observable_left_out_of_the_state_is_not_compared(capsys, tmp_path):
    # live_start neither declared nor reported: not compared, and no invariant reads it
    target = "exec:" + shlex.join([sys.executable, str(ADAPTER), "--observables", "offset,live_len"])
    code, report = fuzz_json(capsys, target, tmp_path / "out")
    ex.close_sessions()
    assert code == 0 and all(r["result"] == "ok" and r["steps"] > 0 for r in report["runs"]), report


def test_an_observable_missing_from_a_later_op_reply_is_said_at_that_op(adapter, capsys, tmp_path):
    """The state line of every reply is checked, not only init's: an
    adapter whose op replies lose a declared observable from op 2 on
    diverges at op 2, naming it."""
    code, out = replay(capsys, adapter("--strip-state", "live_start", "--strip-from-op", "2"), TRACE, tmp_path)
    text = " ".join(out.split())
    assert code == 1 and "its state lacks live_start" in text and "NoneType" not in text, out
    assert "op 2" in text, out
