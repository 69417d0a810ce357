"""The target API (docs/targets.md): a cache class in another package under
``kvspec fuzz --target pkg:Class`` and ``kvspec replay --target``, refusals
compared by category, registration by entry point and by scheme, and every
capability gap an exit 2 with a sentence, in text and in ``--json``."""

import json
import sys
from pathlib import Path

import pytest

from kvspec.fuzz import targets
from kvspec.fuzz.commands.cli import main
from kvspec.fuzz.lockstep import Divergence, Outcome
from kvspec.fuzz.protocol import refusal_category
from kvspec.fuzz.replay import make_lockstep, replay
from kvspec.fuzz.targets import TargetCapabilityError, TargetError, resolve
from kvspec.fuzz.trace import Trace, load
from kvspec.spec.errors import InvalidArgumentError, StateError, UnsupportedOperationError
from tests.target_examples import write_package

TRACES = Path(__file__).parent / "traces"


@pytest.fixture
def userpkg(tmp_path, monkeypatch):
    """A package ``usercache`` under tmp_path (not one of this repository's)."""
    write_package(tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for mod in [m for m in sys.modules if m == "usercache" or m.startswith("usercache.")]:
        monkeypatch.delitem(sys.modules, mod)
    return tmp_path


# -- the two crashes: a capability gap is exit 2 with a reason --------------------


@pytest.mark.parametrize("extra", [[], ["--waive", "capacity"]])
def test_mlx_lm_on_a_ring_with_an_undo_log_is_exit_2(capsys, extra):
    trace = str(TRACES / "undo_log_one_short.json")
    assert load(trace).cache["undo"] > 0
    assert main(["replay", trace, "--target", "mlx-lm", *extra]) == 2
    out = capsys.readouterr().out
    assert "target cannot run it" in out and "undo" in out and "no undo log" in out and "Traceback" not in out
    assert main(["replay", trace, "--target", "mlx-lm", "--json", *extra]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit"] == 2 and doc["ok"] is False and "undo=0" in doc["unsupported"]


def test_a_turbo_bug_on_a_trace_of_another_mode_is_exit_2(capsys):
    trace = str(TRACES / "dense_tree_rollback.json")
    assert load(trace).cache.get("mode", "fp16") == "fp16"
    assert main(["replay", trace, "--bug", "turbo_logical_trim"]) == 2
    out = capsys.readouterr().out
    assert "turbo_logical_trim" in out and "cannot build" in out and "Traceback" not in out
    assert main(["replay", trace, "--bug", "turbo_logical_trim", "--json"]) == 2
    assert "dense/fp16" in json.loads(capsys.readouterr().out)["unsupported"]
    # on a trace of its own mode it still runs (and is caught)
    assert main(["replay", str(TRACES / "turbo_logical_trim.json"), "--bug", "turbo_logical_trim"]) == 1


def test_a_bug_and_another_target_is_exit_2_in_json(capsys):
    trace = str(TRACES / "dense_tree_rollback.json")
    assert main(["replay", trace, "--bug", "inplace_after_trim", "--target", "mlx-lm", "--json"]) == 2
    assert "cannot be combined" in json.loads(capsys.readouterr().out)["error"]


# -- a class in another package ------------------------------------------------------


def test_a_correct_class_elsewhere_passes_and_a_planted_bug_is_caught(userpkg, capsys):
    out = userpkg / "out"
    assert main(["fuzz", "--target", "usercache.cache:ListCache", "--budget", "3", "--seed", "1",
                 "--out", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and doc["runs"][0]["examples"] > 0 and doc["runs"][0]["steps"] > 0
    declared = doc["declared"]["ListCache (dense/fp16)"]
    assert "trim_to" in declared["skipped"] and "detach" in declared["skipped"]
    assert doc["runs"][0]["reached"]["not compared: capacity (no such attribute)"] > 0

    assert main(["fuzz", "--target", "usercache.cache:NegativeTrimCache", "--budget", "20", "--seed", "1",
                 "--out", str(out), "--json"]) == 1
    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert run["result"] == "FAILED" and "trim" in run["failure"]
    assert run["replay"].endswith("--target usercache.cache:NegativeTrimCache")
    trace = run["trace"]
    assert main(["replay", trace, "--target", "usercache.cache:NegativeTrimCache"]) == 1
    assert "spec and usercache.cache:NegativeTrimCache disagree" in capsys.readouterr().out
    assert main(["replay", trace, "--target", "usercache.cache:ListCache"]) == 0
    assert main(["replay", trace]) == 0


def test_an_op_the_class_lacks_is_exit_2_and_named(userpkg, tmp_path, capsys):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"kvtrace": 1, "cache": {"kind": "dense"},
                             "ops": [{"op": "append", "n": 2}, {"op": "trim_to", "len": 1}]}))
    assert main(["replay", str(p), "--target", "usercache.cache:ListCache", "--json"]) == 2
    assert "no trim_to method" in json.loads(capsys.readouterr().out)["unsupported"]
    assert main(["replay", str(p), "--target", "usercache.cache:CategoryCache"]) == 0


def test_refusals_are_compared_by_category_not_by_words(userpkg, tmp_path, capsys):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"kvtrace": 1, "cache": {"kind": "dense"},
                             "ops": [{"op": "append", "n": 2}, {"op": "trim_to", "len": 5, "error": True}]}))
    # ValueError("bad length 5") against the spec's InvalidArgumentError: same category
    assert main(["replay", str(p), "--target", "usercache.cache:CategoryCache"]) == 0
    capsys.readouterr()
    assert main(["replay", str(p), "--target", "usercache.cache:WrongCategoryCache"]) == 1
    out = capsys.readouterr().out
    assert "refusal category differs" in out and "(state)" in out and "(invalid argument)" in out


def test_refusal_categories():
    assert refusal_category(InvalidArgumentError("x")) == "invalid argument"
    assert refusal_category(StateError("x")) == "state"
    assert refusal_category(UnsupportedOperationError("x")) == "unsupported"
    assert refusal_category(ValueError()) == "invalid argument"
    assert refusal_category(NotImplementedError()) == "unsupported"
    assert refusal_category(RuntimeError()) == "state"
    assert refusal_category(AttributeError()) is None  # a crash, never a refusal
    assert refusal_category(KeyError(), {KeyError: "state"}) == "state"
    # our implementation is still held to the spec's type and words
    lock = make_lockstep({"kind": "dense", "mode": "fp16", "step": 2, "batch": 1, "kv_heads": 1, "head_dim": 8,
                          "inplace": True, "dtype": "float16"})
    with pytest.raises(Divergence, match="refusal differs"):
        lock.compare_refusal(0, {"op": "trim_to", "len": 9}, Outcome(error=InvalidArgumentError("a")),
                             Outcome(error=ValueError("a")))
    with pytest.raises(Divergence, match="refusal message differs"):
        lock.compare_refusal(0, {"op": "trim_to", "len": 9}, Outcome(error=InvalidArgumentError("a")),
                             Outcome(error=InvalidArgumentError("b")))


def test_a_class_without_kvspec_kind_is_a_usage_error(userpkg, capsys):
    assert main(["fuzz", "--target", "usercache.cache:NoKind", "--budget", "1"]) == 2
    assert "kvspec_kind" in capsys.readouterr().out
    assert main(["fuzz", "--target", "usercache.cache:Missing", "--budget", "1", "--json"]) == 2
    assert "Missing" in json.loads(capsys.readouterr().out)["error"]


# -- registration -----------------------------------------------------------------------


def test_entry_point_registration(userpkg, monkeypatch):
    dist = userpkg / "site" / "usercache-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: usercache\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[kvspec.targets]\nlistcache = usercache.cache:ListCache\n")
    assert "listcache" in targets.known_names()
    t = resolve("listcache")
    assert t.label == "listcache" and t.configs() == [("dense", "fp16")]
    trace = load(TRACES / "dense_tree_rollback.json")
    assert trace.cache["kind"] == "dense"


def test_a_scheme_is_one_registration(monkeypatch, userpkg):
    def make(rest: str) -> targets.Target:
        base = resolve("usercache.cache:ListCache")
        return targets.Target(f"demo:{rest}", "a scheme's target", base.classes)

    monkeypatch.setitem(sys.modules, "demo_scheme_mod", type(sys)("demo_scheme_mod"))
    sys.modules["demo_scheme_mod"].make = make
    monkeypatch.setitem(targets.SCHEMES, "demo", "demo_scheme_mod:make")
    t = resolve("demo:anything")
    assert t.label == "demo:anything" and t.cache_class("dense", "fp16").name == "ListCache"
    with pytest.raises(TargetError, match="unknown target"):
        resolve("nodemo")


def test_target_check_names_the_gap():
    t = resolve("mlx-lm")
    ring = {"kind": "rotating", "mode": "fp16", "max_size": 4, "keep": 0, "undo": 1, "step": 2, "batch": 1,
            "kv_heads": 1, "head_dim": 8, "inplace": True, "dtype": "float16"}
    with pytest.raises(TargetCapabilityError, match="undo"):
        t.check(ring, [])
    with pytest.raises(TargetCapabilityError, match="no class for paged"):
        t.check({**ring, "kind": "paged"}, [])
    assert replay(Trace(cache={**ring, "undo": 0}, ops=[{"op": "append", "n": 1}]), target=t).ok


def test_module_attr_follows_a_dotted_attribute_path(userpkg, monkeypatch):
    """``module:a.b`` resolves ``b`` inside ``a``, never ``a`` itself."""
    import types

    from usercache.cache import ListCache

    mod = types.ModuleType("nested_target_mod")
    mod.ns = types.SimpleNamespace(Cache=ListCache)
    monkeypatch.setitem(sys.modules, "nested_target_mod", mod)
    t = resolve("nested_target_mod:ns.Cache")
    assert t.label == "nested_target_mod:ns.Cache" and t.cache_class("dense", "fp16").name == "ListCache"


def test_a_class_target_is_fuzzed_in_every_shape_and_dtype():
    """A user's class runs the shapes and dtypes of our own campaigns (batch
    > 1, a V head dim other than the keys', bfloat16 and float32): it used to
    get mlx-lm's plain machine (batch 1, one head dim, float16), so a class
    with a V-layout, batch or bfloat16 bug passed every seed. kvspec_dtypes
    narrows the dtypes, and a replay of another dtype is exit 2."""
    from kvspec.fuzz.campaign import machine_for, run_machine
    from tests.broken_targets.classes import DenseControl

    seen: set[tuple[int, int, int, str]] = set()

    class Recording(DenseControl):
        def update_and_fetch(self, keys, values):
            seen.add((keys.shape[0], keys.shape[-1], values.shape[-1], str(keys.dtype).split(".")[-1]))
            return super().update_and_fetch(keys, values)

    run = run_machine(machine_for("dense", target=targets.class_target(Recording)), seed=3, max_examples=25, steps=10)
    assert not run.failed, run.error
    assert {b for b, *_ in seen} >= {1, 2}, seen
    assert any(dk != dv for _, dk, dv, _ in seen), seen
    assert {d for *_, d in seen} == {"float16", "bfloat16", "float32"}, seen

    class OnlyHalf(Recording):
        kvspec_dtypes = ("float16",)

    seen.clear()
    run = run_machine(machine_for("dense", target=targets.class_target(OnlyHalf)), seed=3, max_examples=10, steps=5)
    assert not run.failed and {d for *_, d in seen} == {"float16"}, (run.error, seen)
    with pytest.raises(TargetCapabilityError, match="cache.dtype"):
        targets.class_target(OnlyHalf).check({"kind": "dense", "head_dim": 8, "dtype": "bfloat16"}, [])
    with pytest.raises(TargetError, match="kvspec_dtypes"):
        targets.class_target(type("Bad", (DenseControl,), {"kvspec_dtypes": ("float64",)}))


def test_only_built_in_third_party_targets_keep_the_plain_machine():
    """mlx-lm's caches keep the plain machine of their recorded findings;
    ``impl`` (also when the conformance search excludes an op) and a user's
    class get the full one."""
    from kvspec.fuzz.campaign import machine_for
    from kvspec.fuzz.dense import PlainDenseMachine
    from tests.broken_targets.classes import DenseControl

    assert issubclass(machine_for("dense", target=resolve("mlx-lm")), PlainDenseMachine)
    for target in (resolve("impl").excluding("trim_to"), targets.class_target(DenseControl)):
        assert not issubclass(machine_for("dense", target=target), PlainDenseMachine), target.name
