"""Conformance of mlx-lm's own caches (docs/conformance.md).

A short search from fixed seeds must find the negative-trim and the
wrapped-ring-trim divergences by fuzzing, and every shipped conformance trace
must replay with exit 1 on its mlx-lm target and exit 0 on ours.
"""

import json
import math
from pathlib import Path

import pytest

from kvspec.fuzz.adapters.mlx_lm import KVCACHE, ROTATING, target_of_class
from kvspec.fuzz.commands.cli import main
from kvspec.fuzz.commands.conformance import REPORT, next_target, search_class
from kvspec.fuzz.lockstep import Divergence
from kvspec.fuzz.replay import make_lockstep, replay
from kvspec.fuzz.targets import resolve
from kvspec.fuzz.trace import Trace, TraceFormatError, load
from kvspec.spec import rotating as sr

FOLDER = Path(__file__).parent / "traces" / "conformance"
TRACES = sorted(FOLDER.glob("*_[0-9][0-9].json"))
#: each search below stops at max_findings within a few rounds (seeded, so
#: the same rounds every run); the verdict is bounded by rounds, never by the clock
ROUNDS = 40


def _findings(cls, seed, max_findings, tmp_path):
    report = search_class(cls, "mlx-lm", math.inf, seed, tmp_path, max_findings=max_findings, max_rounds=ROUNDS)
    assert all(f.confirmed for f in report.findings), [(f.summary, f.on_target, f.on_impl) for f in report.findings]
    return report.findings


def _spec_before(trace, index):
    """The spec's rotating cache just before op ``index`` of ``trace``."""
    lock = make_lockstep(trace.cache)
    for op in trace.ops[:index]:
        if op["op"] != "expect":
            _, lock.world = lock.spec_apply(op)
    return lock.world.cache


def test_negative_trim_is_found_by_fuzzing(tmp_path):
    found = _findings(KVCACHE, 2, 2, tmp_path)
    neg = [f for f in found if f.op.get("op") == "trim" and f.op["n"] < 0]
    assert neg, [f.summary for f in found]
    assert neg[0].what == "return value differs"


def test_wrapped_trim_is_found_by_fuzzing(tmp_path):
    found = _findings(ROTATING, 1, 5, tmp_path)
    wrapped = []
    for f in found:
        if f.op.get("op") == "trim" and f.op["n"] > 0 and f.what == "return value differs":
            before = _spec_before(load(f.trace), f.index)
            # the spec refuses to trim here (fails closed); mlx-lm moves its counters
            if not sr.is_trimmable(before) and before.offset > before.max_size:
                wrapped.append(f)
    assert wrapped, [f.summary for f in found]


def test_report_lists_every_shipped_trace():
    doc = json.loads((FOLDER / REPORT).read_text())
    listed = {Path(f["trace"]).name for c in doc["classes"] for f in c["findings"]}
    assert listed == {p.name for p in TRACES}
    assert doc["ok"] is True


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_shipped_trace_diverges_on_mlx_lm_and_not_on_ours(path, capsys):
    target = target_of_class(path.stem.rsplit("_", 1)[0])
    assert main(["replay", "--target", target.name, str(path)]) == 1
    assert main(["replay", str(path)]) == 0
    # with the waivers it was found under, it stops at the op it reports
    doc = json.loads((FOLDER / REPORT).read_text())
    (finding,) = [f for c in doc["classes"] for f in c["findings"] if Path(f["trace"]).name == path.name]
    waived = target
    for w in finding["waived"]:
        waived = waived.waiving(w)
    result = replay(load(path), target=waived)
    assert not result.ok and result.divergence.index == finding["index"]


def test_shipped_traces_cover_the_known_faults():
    doc = json.loads((FOLDER / REPORT).read_text())
    seen = {(c["cache_class"], f["op"].get("op"), f["what"]) for c in doc["classes"] for f in c["findings"]}
    assert ("KVCache", "trim", "return value differs") in seen  # negative trim grows the offset
    assert ("RotatingKVCache", "trim", "return value differs") in seen  # trim on a wrapped ring
    assert ("ConcatenateKVCache", "trim", "live window differs") in seen  # trimmed rows come back
    assert ("KVCache", "append", "view of held changed (isolation)") in seen  # exactly full buffer aliased


def test_cli_choices_match_the_registries():
    from kvspec.fuzz import targets
    from kvspec.fuzz.commands import cli, conformance

    assert cli.TARGET_NAMES == list(targets.BUILTIN)
    assert tuple(cli.WAIVABLE) == conformance.WAIVABLE
    assert cli.CONFORMANCE_SEED == conformance.DEFAULT_SEED


def test_next_target_waives_observables_and_excludes_op_classes():
    base = resolve("mlx-lm")
    t, note = next_target(base, Divergence(3, {"op": "append", "n": 1}, "capacity differs", 1, 2))
    assert t is not None and "capacity" in t.waived and "stopped comparing capacity" == note
    t, _ = next_target(base, Divergence(0, {"op": "trim", "n": -1}, "return value differs", 0, -1))
    assert t is not None and "trim n<0" in t.excluded and "trim n>0" not in t.excluded
    t, _ = next_target(base, Divergence(2, {"op": "append", "n": 1}, "view of held changed (isolation)", [], []))
    assert t is not None and {"hold", "release_hold"} <= t.excluded
    t, note = next_target(base, AssertionError("invariant"))
    assert t is None and note.startswith("stopped")


def test_ops_a_class_lacks_make_replay_exit_2(tmp_path, capsys):
    doc = {"kvtrace": 1, "cache": {"kind": "dense", "step": 2},
           "ops": [{"op": "append", "n": 2}, {"op": "trim_front", "n": 1}]}
    p = tmp_path / "t.json"
    p.write_text(json.dumps(doc))
    assert main(["replay", "--target", "mlx-lm", str(p)]) == 2
    assert "KVCache: no trim_front_keep_sink" in capsys.readouterr().out
    assert main(["replay", str(p)]) == 0
    with pytest.raises(TraceFormatError, match="head_dim % 32"):
        replay(Trace(cache={**load(p).cache, "mode": "int8"}, ops=[]), target="mlx-lm")


def test_findings_are_split_into_faults_and_contract_differences():
    from kvspec.fuzz.commands.conformance import CONTRACT, FAULT, category

    assert category("capacity differs") == CONTRACT and category("trimmable differs") == CONTRACT
    assert category("refusal differs") == CONTRACT
    for what in ("live window differs", "return value differs", "idx differs", "offset differs",
                 "view of held changed (isolation)", "make_mask(2, {}) differs", "returned window differs"):
        assert category(what) == FAULT, what
    doc = json.loads((FOLDER / REPORT).read_text())
    findings = [f for c in doc["classes"] for f in c["findings"]]
    assert all(f["category"] == category(f["what"]) for f in findings)
    # the ring keeps its buffers on a trim to zero, as mlx-lm's does: that finding is withdrawn
    rotating = next(c for c in doc["classes"] if c["cache_class"] == "RotatingKVCache")
    assert not any(f["what"] == "capacity differs" for f in rotating["findings"])
    assert rotating["withdrawn"] and not (FOLDER / "RotatingKVCache_02.json").exists()
