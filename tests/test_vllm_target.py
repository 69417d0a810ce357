"""vLLM's KV-cache manager as a prefix target (fuzz/adapters/vllm.py,
docs/conformance.md "vLLM"): the recorded minimal traces under
tests/traces/vllm/ replay against our prefix pool always (exit 0) and
against vLLM wherever it is importable (exit 1, at the op the report
names, in paranoid mode too); the public reports' traces
(tests/traces/prefix_report_*.json) replay against vLLM with the outcome
docs/conformance.md records; the adapter's answers, its refusals, whose
failure an exception is, and the search itself where vLLM is installed.
vLLM is imported once per process (5 to 20 s). Which engines the traces
were replayed on is printed (and each skip says why)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from kvspec.fuzz.adapters import vllm as av
from kvspec.fuzz.commands import conformance_prefix as cp
from kvspec.fuzz.commands.cli import main
from kvspec.fuzz.failures import Divergence, HarnessFailure
from kvspec.fuzz.prefix import spec_world
from kvspec.fuzz.replay import replay
from kvspec.fuzz.trace import load

HERE = Path(__file__).parent
FOLDER = HERE / "traces" / "vllm"
TRACES = sorted(FOLDER.glob("KVCacheManager_[0-9][0-9].json"))
REPORTS = sorted((HERE / "traces").glob("prefix_report_*.json"))
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
ABSENT = "vLLM not installed (tools/install-vllm, or make vllm)"
NOT_INSTALLED = f"{ABSENT}: the vLLM traces replayed against our prefix pool only"
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason=ABSENT)
DONE = {"ours": 0, "vllm": 0}
#: the public reports' traces on vLLM 0.34.0 (docs/conformance.md "vLLM"): every one agrees
#: but the double free, where vLLM's pool drops a held block's refcount (op, rule)
REPORTS_ON_VLLM = {"prefix_report_vllm_42571_double_free": (2, "refcount")}
CACHE = {"kind": "prefix", "mode": "fp16", "block_size": 2, "n_blocks": 4, "window": None, "kv_heads": 1,
         "head_dim": 8, "dtype": "float16"}


def _cache(**kw):
    return {**CACHE, **kw}


# -- what needs no vLLM ---------------------------------------------------------


def _report():
    return json.loads((FOLDER / "report.json").read_text())


def _finding(path: Path) -> dict:
    (f,) = [f for c in _report()["classes"] for f in c["findings"] if Path(f["trace"]).name == path.name]
    return f


def test_every_recorded_trace_is_listed_and_classified():
    assert TRACES, "no recorded vLLM traces"
    doc = _report()
    listed = {Path(f["trace"]).name for c in doc["classes"] for f in c["findings"]}
    assert listed == {p.name for p in TRACES} and doc["ok"] is True and doc["exit"] == 0
    for c in doc["classes"]:
        assert c["cache_class"] == cp.CLASS and c["examples"] > 0 and c["steps"] > 0
        for f in c["findings"]:
            assert f["confirmed"] and f["on_target"] == 1 and f["on_impl"] == 0 and f["on_paranoid"] == 1
            assert f["rule"] == cp.rule_of(f["what"])
            assert f["category"] == cp.category(f["what"], bool(f["state"]), f["excluded"])


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_recorded_trace_passes_on_ours(path):
    assert main(["replay", str(path)]) == 0
    DONE["ours"] += 1


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_recorded_trace_states_the_spec_refusals(path):
    """Every op the spec refuses carries "error": true, and no other does."""
    doc = json.loads(path.read_text())
    assert cp.annotate_refusals(doc["cache"], doc["ops"]) == doc["ops"]


def test_the_double_free_is_a_finding_with_a_trace():
    """BlockPool.free_blocks([b, b]) on a block one table holds: a fault
    (refcount), recorded with its minimal trace; not a declared difference
    (only the absent refusal is declared, what the call does is compared)."""
    found = [f for c in _report()["classes"] for f in c["findings"] if f["excluded"] == "free_blocks a held block twice"]
    assert len(found) == 1 and found[0]["category"] == "fault" and found[0]["rule"] == "refcount"
    assert "vllm -1, spec 1" in found[0]["summary"]
    assert "refcount" not in av.DECLARED and "free_blocks refusal" in av.DECLARED


def test_rules_and_categories():
    what = "block 3 refcount differs (rule 'refcount': kvspec.spec.prefix.refcounts_match_tables: ...)"
    assert cp.rule_of(what) == "refcount" and cp.category(what) == "fault"
    # an op the spec answers no for room, after which the engine's state differs
    assert cp.category(what, True, "decode without room after a window release") == "refusal changes state"
    assert cp.category(what, True, "decode evicting") == "fault"
    refusal = "refusal differs (rule 'refusal': kvspec.spec.errors: ...)"
    assert cp.rule_of(refusal) == "refusal"
    assert cp.category(refusal, state_differs=False) == "contract difference"
    assert cp.category(refusal, state_differs=True) == "fault"
    assert cp.rule_of("observe() raised") == "observe() raised"


def test_op_classes_split_where_vllm_splits():
    world = spec_world(_cache())
    c = cp.op_class
    assert c({"op": "free_blocks", "blocks": []}, world) == "free_blocks of no block"
    assert c({"op": "free_blocks", "blocks": [4]}, world) == "free_blocks out of range"
    assert c({"op": "free_blocks", "blocks": [1]}, world) == "free_blocks a free block"
    assert c({"op": "free", "req": "a"}, world) == "free of a request holding nothing"
    assert c({"op": "admit", "req": "a", "tokens": []}, world) == "admit the spec refuses"
    assert c({"op": "admit", "req": "a", "tokens": [1, 2, 3]}, world) == "admit missing"
    assert c({"op": "admit", "req": "a", "tokens": [1] * 9}, world) == "admit not admitted"
    world = cp.spec_step(world, {"op": "admit", "req": "a", "tokens": [1, 2, 3]})[1]
    assert c({"op": "free_blocks", "blocks": [0, 0]}, world) == "free_blocks a held block twice"
    assert c({"op": "free_blocks", "blocks": [0]}, world) == "free_blocks a held block"
    assert c({"op": "admit", "req": "b", "tokens": [1, 2, 3]}, world) == "admit hitting"
    assert c({"op": "decode", "req": "a", "tokens": [4]}, world) == "decode filling a block"
    assert c({"op": "lookup", "tokens": [1, 2, 3]}, world) == "lookup hitting"
    assert c({"op": "reset"}, world) == "reset refused"
    win = spec_world(_cache(block_size=1, n_blocks=7, window=2))
    for op in ({"op": "admit", "req": "a", "tokens": [3, 3, 1, 2, 2]}, {"op": "admit", "req": "b", "tokens": [3]},
               {"op": "admit", "req": "c", "tokens": [3, 3]}):
        win = cp.spec_step(win, op)[1]
    assert c({"op": "decode", "req": "c", "tokens": [0]}, win) == "decode without room after a window release"
    # a's release (blocks 1 to 3 reach refcount 0; block 0 is c's too) makes room for its block
    assert c({"op": "decode", "req": "a", "tokens": [0]}, win) == "decode releasing blocks before the window"
    pre = cp.spec_step(world, {"op": "preempt", "req": "a"})[1]
    assert c({"op": "free", "req": "a"}, pre) == "free of a preempted request"
    assert c({"op": "resume", "req": "a"}, pre) == "resume hitting cached-free blocks"
    assert c({"op": "reset"}, pre) == "reset"


def test_the_generator_reaches_every_op_and_honours_exclusions():
    import random

    world = spec_world(_cache(block_size=1, n_blocks=6))
    gen = cp.Generator(random.Random(0), _cache(block_size=1, n_blocks=6),
                       frozenset({"free_blocks a held block twice", "lookup hitting"}))
    seen = set()
    for _ in range(400):
        for op in gen.ops(world):
            cls = cp.op_class(op, world)
            assert cls not in gen.excluded
            seen.add(op["op"])
            world = cp.spec_step(world, op)[1]
    assert seen >= {"admit", "decode", "free", "preempt", "resume", "lookup", "reset", "free_blocks"}


def test_an_earlier_runs_findings_are_cleared_first(tmp_path):
    for name in ("KVCacheManager_01.json", "KVCacheManager_12.json", "report.json", "kept.json"):
        (tmp_path / name).write_text("{}")
    assert cp.clear_findings(tmp_path) == ["KVCacheManager_01.json", "KVCacheManager_12.json", "report.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["kept.json"]


@pytest.mark.parametrize("option", [["--budget", "5"], ["--sarif", "x.sarif"]])
def test_options_of_the_seconds_budgeted_search_do_not_apply_to_vllm(option, capsys):
    assert main(["conformance", "--target", "vllm", *option, "--json"]) == 2
    assert f"{option[0]}: does not apply to --target vllm" in json.loads(capsys.readouterr().out)["error"]


def test_a_trace_of_another_kind_is_not_applicable(capsys):
    cells = next((HERE / "traces").glob("cells_*.json"))
    assert main(["replay", str(cells), "--target", "vllm", "--json"]) == 2
    assert "target vllm runs prefix traces" in json.loads(capsys.readouterr().out)["unsupported"]


def test_without_vllm_the_target_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setattr(av, "_V", None)
    assert main(["replay", str(REPORTS[0]), "--target", "vllm", "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "not applicable" and "tools/install-vllm" in doc["unsupported"]
    assert main(["conformance", "--target", "vllm", "--examples", "1", "--json"]) == 2
    assert "tools/install-vllm" in json.loads(capsys.readouterr().out)["error"]


# -- against vLLM ---------------------------------------------------------------


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_recorded_trace_diverges_on_vllm(path):
    """The regression gate: vLLM diverges exactly where the report pins it
    (op index and what differs), in paranoid mode too."""
    if not HAVE_VLLM:
        pytest.skip(NOT_INSTALLED)
    f = _finding(path)
    result = replay(load(path), target="vllm")
    assert not result.ok and result.divergence.index == f["index"] and result.divergence.what == f["what"]
    doc = json.loads(path.read_text())
    para = cp.first_divergence(doc["cache"], doc["ops"], True, paranoid=True)
    assert para is not None and (para.index, para.what) == (f["index"], f["what"])
    DONE["vllm"] += 1


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_recorded_trace_is_one_minimal(path):
    """Removing any one op (op 0 included) loses the recorded divergence
    (same rule, op name and class); the class recomputed from the trace is
    the recorded one."""
    if not HAVE_VLLM:
        pytest.skip(NOT_INSTALLED)
    f = _finding(path)
    doc = json.loads(path.read_text())
    cache, ops = doc["cache"], doc["ops"]
    rule, name = cp.rule_of(f["what"]), f["op"]["op"]
    assert cp.same_divergence(cache, ops, rule, name, f["excluded"]) == f["index"]
    assert cp._class_at(cache, ops, f["index"]) == f["excluded"]
    for i in range(len(ops)):
        assert cp.same_divergence(cache, ops[:i] + ops[i + 1:], rule, name, f["excluded"]) is None, \
            f"op {i} can be removed"


@pytest.mark.parametrize("path", REPORTS, ids=[p.stem for p in REPORTS])
def test_public_report_traces_on_vllm(path):
    """Each public report's trace on vLLM 0.34.0: it agrees, except the
    double free (vLLM's pool drops the refcount of a block a table holds)."""
    if not HAVE_VLLM:
        pytest.skip(ABSENT)
    result = replay(load(path), target="vllm")
    want = REPORTS_ON_VLLM.get(path.stem)
    if want is None:
        assert result.ok, str(result.divergence)
    else:
        assert not result.ok and (result.divergence.index, cp.rule_of(result.divergence.what)) == want


def test_say_which_engines_the_traces_were_replayed_on(capsys):
    on = (f"and against vLLM ({DONE['vllm']})" if DONE["vllm"] else
          "only (vLLM not installed: tools/install-vllm, or make vllm)")
    with capsys.disabled():
        print(f"\nkvspec: recorded vLLM traces replayed against our prefix pool ({DONE['ours']}) {on}")


@needs_vllm
def test_admit_decode_free_and_the_view():
    """Ids mapped back past vLLM's null block, keys named (salt, tokens), the
    free queue tail first, rows where the model wrote them; the paranoid
    view (other read paths) is the same view."""
    t = av.VllmTarget(_cache(n_blocks=5))
    assert t.admit("a", (1, 2, 3)) == {"admitted": True, "hit": 0, "table": [0, 1]}
    assert t.admit("b", (1, 2, 3, 4), 1) == {"admitted": True, "hit": 0, "table": [2, 3]}
    assert t.decode("a", (4,)) is True and t.decode("a", (5,)) is True
    view = t.observe()
    assert view["requests"]["a"] == {"table": [0, 1, 4], "tokens": 5, "live": True}
    assert view["blocks"][:3] == [(1, (None, (1, 2))), (1, (None, (1, 2, 3, 4))), (1, (1, (1, 2)))]
    assert view["free"] == [] and view["rows"][(4, 0)] == (None, (1, 2, 3, 4, 5))
    assert view["reads"]["b"] == [(1, (1,)), (1, (1, 2)), (1, (1, 2, 3)), (1, (1, 2, 3, 4))]
    t.free("a")
    assert t.observe()["free"] == [4, 1, 0]  # the unkeyed tail at the front, then the keyed ones tail first
    assert t.admit("c", (1, 2, 3, 4, 9)) == {"admitted": True, "hit": 4, "table": [0, 1, 4]}
    assert t.lookup((1, 2, 3, 4)) == 2 and t.lookup((1, 2, 3, 4), 1) == 2 and t.lookup((1, 2, 3, 4), 0) == 0
    para = av.VllmTarget(_cache(n_blocks=5), paranoid=True)
    for call in (lambda x: x.admit("a", (1, 2, 3)), lambda x: x.admit("b", (1, 2, 3, 4), 1),
                 lambda x: x.decode("a", (4, 5)), lambda x: x.free("a"), lambda x: x.admit("c", (1, 2, 3, 4, 9))):
        call(para)
    for other in (av.VllmTarget(_cache(n_blocks=5)),):
        for call in (lambda x: x.admit("a", (1, 2, 3)), lambda x: x.admit("b", (1, 2, 3, 4), 1),
                     lambda x: x.decode("a", (4, 5)), lambda x: x.free("a"), lambda x: x.admit("c", (1, 2, 3, 4, 9))):
            call(other)
        assert other.observe() == para.observe()


@needs_vllm
def test_an_admit_that_does_not_fit_changes_nothing_in_vllm():
    """allocate_slots returns None before it touches anything: every block's
    refcount, hash and queue links, the cached map, the manager's per-request
    bookkeeping and the requests are as they were (a hit on cached-free blocks
    counts against the free blocks, so a prompt that would hit them is refused too)."""
    t = av.VllmTarget(_cache(block_size=2, n_blocks=5))
    t.admit("a", (1, 2, 3, 4, 5, 6, 7, 8))
    t.free("a")
    t.admit("b", (9,))
    before = t.raw_state()
    assert t.admit("c", (1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9)) == {"admitted": False, "hit": 0, "table": []}
    assert t.raw_state() == before and "c" not in t.group.req_to_blocks
    assert t.admit("d", tuple(range(20))) == {"admitted": False, "hit": 0, "table": []}
    assert t.raw_state() == before


@needs_vllm
def test_a_decode_without_room_is_taken_back():
    """The appended tokens and the block hash they completed are taken back:
    vLLM's state and the request are as they were."""
    t = av.VllmTarget(_cache(block_size=2, n_blocks=2), paranoid=True)
    assert t.admit("a", (1, 2, 3))["admitted"]
    assert t.decode("a", (4,)) is True
    before = t.raw_state()
    assert t.decode("a", (5,)) is False and t.decode("a", (5, 6)) is False
    assert t.raw_state() == before and len(t.requests["a"].block_hashes) == 2


@needs_vllm
def test_a_free_of_a_request_holding_nothing_changes_nothing():
    """The declared difference: vLLM ignores it, the spec refuses it."""
    t = av.VllmTarget(_cache())
    t.admit("a", (1, 2, 3))
    t.free("a")
    before = t.raw_state()
    assert t.free("a") is None and t.free("never") is None and t.raw_state() == before
    assert "free refusal" in av.DECLARED


@needs_vllm
def test_request_level_rules_are_refused_as_the_scheduler_would_and_recorded():
    t = av.VllmTarget(_cache())
    t.admit("a", (1, 2, 3))
    t.preempt("a")
    for call, cls in ((lambda: t.admit("b", ()), av.AdapterRefusal),
                      (lambda: t.admit("b", (1, -1)), av.AdapterRefusal),
                      (lambda: t.admit("a", (1,)), av.AdapterStateRefusal),
                      (lambda: t.preempt("a"), av.AdapterStateRefusal),
                      (lambda: t.decode("a", (1,)), av.AdapterStateRefusal),
                      (lambda: t.free("a"), av.AdapterStateRefusal),
                      (lambda: t.free_blocks([4]), av.AdapterRefusal)):
        with pytest.raises(cls):
            call()
        assert t.refused_first is not None
    assert t.resume("a")["hit"] == 2 and t.refused_first is None
    with pytest.raises(av.AdapterRefusal, match="duplicate request id"):
        t.admit("a", (1,))


@needs_vllm
def test_the_double_free_drives_ref_cnt_below_zero_and_vllm_asserts_later():
    """BlockPool.free_blocks([b, b]) on a block one table holds: no error,
    ref_cnt -1 and the block in the free queue while the table holds it;
    the next allocation that pops it raises vLLM's own AssertionError (not
    the adapter's: harness_error stays None); observe() still reads it."""
    t = av.VllmTarget(_cache(block_size=1, n_blocks=2))
    t.admit("a", (1, 2))
    t.free_blocks((1, 1))
    view = t.observe()
    assert view["blocks"][1][0] == -1 and view["free"] == [1] and view["requests"]["a"]["table"] == [0, 1]
    with pytest.raises(AssertionError):
        t.admit("b", (7,))
    assert t.harness_error is None
    t.observe()


@needs_vllm
def test_a_later_assertion_error_of_vllm_is_a_divergence_not_a_tool_failure(monkeypatch):
    """With the state comparison switched off past the double free (the
    broken variant of the lockstep), the admit that pops the corrupted block
    fails inside vLLM (the spec answers "not admitted": no room): a
    divergence at that op naming vLLM's AssertionError, never a
    HarnessFailure."""
    lock = av.make_lockstep(_cache(block_size=1, n_blocks=2))
    lock.step(0, {"op": "admit", "req": "a", "tokens": [1, 2]})
    monkeypatch.setattr(type(lock), "compare_view", lambda self, index, op: None)
    lock.step(1, {"op": "free_blocks", "blocks": [1, 1]})
    with pytest.raises(Divergence) as e:
        lock.step(2, {"op": "admit", "req": "b", "tokens": [7]})
    assert e.value.what.startswith("refusal differs") and e.value.index == 2
    assert "AssertionError" in str(e.value.impl) and "block_pool.py" in str(e.value.impl)


@needs_vllm
def test_an_exception_of_the_adapters_own_code_is_a_tool_failure(monkeypatch, tmp_path, capsys):
    def broken(self, req, r, lo, hi):
        raise KeyError("the adapter's own bug")

    monkeypatch.setattr(av.VllmTarget, "_write_rows", broken)
    ops = [{"op": "admit", "req": "a", "tokens": [1, 2, 3]}]
    with pytest.raises(HarnessFailure):
        av.make_lockstep(_cache()).step(0, ops[0])
    with pytest.raises(cp.HarnessFailure):
        cp.run_ops(_cache(), ops, True)
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"kvtrace": 1, "cache": _cache(), "ops": ops}))
    assert main(["replay", str(path), "--target", "vllm", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["status"] == "tool failure"


@needs_vllm
def test_a_refusal_of_the_adapter_where_the_spec_accepts_is_a_harness_failure(monkeypatch):
    real = av.VllmTarget._tokens

    def picky(self, op, tokens):
        if len(tokens) > 2:
            raise self._refuse(av.AdapterRefusal, f"{op}: at most 2 tokens (a broken adapter)")
        return real(self, op, tokens)

    monkeypatch.setattr(av.VllmTarget, "_tokens", picky)
    with pytest.raises(cp.HarnessFailure, match="adapter refused"):
        cp.run_ops(_cache(), [{"op": "admit", "req": "a", "tokens": [1, 2, 3]}], True)
    # both refusing (the spec too: no tokens) is no failure of anyone
    assert cp.first_divergence(_cache(), [{"op": "admit", "req": "a", "tokens": []}], True) is None


@needs_vllm
def test_a_divergence_the_paranoid_mode_loses_is_not_confirmed(monkeypatch, tmp_path):
    """A broken variant of the adapter's name table (each hash named one
    token short): the keys read wrong in normal mode, right in paranoid mode
    (names hashed again from the tokens), so the finding is not confirmed:
    ok false, exit 1."""
    def wrong(self, req, r):
        salt, bs = self.salts.get(req), self.block_size
        tokens = tuple(int(t) for t in r.all_token_ids)
        self.sequences.add((salt, tokens))
        for i, h in enumerate(r.block_hashes):
            self.names[bytes(h)] = (salt, tokens[: (i + 1) * bs - 1])

    monkeypatch.setattr(av.VllmTarget, "_learn", wrong)
    ops = [{"op": "admit", "req": "a", "tokens": [1, 2, 3]}]
    d = cp.first_divergence(_cache(), ops, True)
    assert d is not None and cp.rule_of(d.what) == "key"
    assert cp.first_divergence(_cache(), ops, True, paranoid=True) is None
    finding = cp.record(_cache(), ops, d.what, "admit missing", 1, tmp_path, 1)
    assert (finding.on_target, finding.on_impl, finding.on_paranoid) == (1, 0, 0) and not finding.confirmed
    doc = cp.to_json([cp.PrefixClassReport(cp.CLASS, findings=[finding])], 1, 1, 1)
    assert doc["ok"] is False and doc["exit"] == 1
    monkeypatch.undo()
    assert cp.first_divergence(_cache(), ops, True) is None


@needs_vllm
def test_the_search_finds_the_double_free_by_itself(tmp_path, capsys):
    import jsonschema

    code = main(["conformance", "--target", "vllm", "--examples", "15", "--steps", "30", "--seed", "5",
                 "--max-findings", "4", "--out", str(tmp_path), "--json"])
    doc = json.loads(capsys.readouterr().out)
    schema = json.loads((HERE.parent / "fuzz" / "schemas" / "conformance.schema.json").read_text())
    jsonschema.validate(doc, schema, cls=jsonschema.Draft202012Validator)
    assert code == 0 and doc["ok"] and doc["budget"] == 15 and doc["budget_unit"] == "examples per round"
    found = {f["excluded"]: f for c in doc["classes"] for f in c["findings"]}
    assert any(k.startswith("free_blocks") for k in found)
    assert all(f["confirmed"] and f["category"] == "fault" for f in found.values())
    assert json.loads((tmp_path / "report.json").read_text())["ok"] is True
    assert main(["conformance", "--target", "vllm", "--class", "NoSuchManager", "--json"]) == 2
    assert cp.CLASS in json.loads(capsys.readouterr().out)["error"]


@needs_vllm
def test_the_harness_campaign_plugs_vllm_in():
    """kvspec.fuzz.prefix_runs.prefix_campaign (the kind's own machine) drives the
    same target: it diverges, and its minimal trace replays 1 on vLLM and 0
    on ours through replay_prefix."""
    from kvspec.fuzz.prefix_runs import prefix_campaign, replay_prefix

    r = prefix_campaign(av.target_factory, max_examples=60, seed=1)
    assert r.status == "diverged" and r.trace is not None
    assert not replay_prefix(r.trace, av.target_factory).ok
    assert replay_prefix(r.trace).ok


@needs_vllm
@pytest.mark.parametrize("change,field", [({"window": 0}, "cache.window"), ({"n_blocks": 0}, "cache.n_blocks")])
def test_a_trace_past_the_targets_limits_is_not_applicable(change, field, tmp_path, capsys):
    doc = json.loads(REPORTS[0].read_text())
    doc["cache"].update(change)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    assert main(["replay", str(path), "--target", "vllm", "--json"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["status"] in ("not applicable", "invalid") and field in json.dumps(out)


def test_a_token_past_vllms_int32_buffer_is_no_kvtrace(tmp_path, capsys):
    """vLLM keeps token ids in an int32 array; the kvtrace schema caps them
    there already, so no trace reaches the target with a larger one."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"kvtrace": 1, "cache": _cache(),
                                "ops": [{"op": "admit", "req": "a", "tokens": [2**31]}]}))
    assert main(["replay", str(path), "--target", "vllm", "--json"]) == 2
    assert "2147483647" in json.loads(capsys.readouterr().out)["invalid"]


@needs_vllm
@pytest.mark.parametrize("window", [1, 2, 3, 5])
def test_a_sliding_window_group_agrees_with_the_spec(window):
    """One SlidingWindowSpec group: releases at each decode (the null block
    as None), the windowed hit with its None entries, the free order with
    the leading nulls trimmed, and w = 1 keying nothing, all as the spec
    says (block ids included)."""
    ops = [{"op": "admit", "req": "a", "tokens": list(range(9))},
           *[{"op": "decode", "req": "a", "tokens": [t]} for t in (20, 21, 22)],
           {"op": "free", "req": "a"}, {"op": "lookup", "tokens": list(range(9)) + [20, 21, 5]},
           {"op": "admit", "req": "b", "tokens": list(range(9)) + [20, 21, 5]},
           {"op": "decode", "req": "b", "tokens": [6, 7]}, {"op": "preempt", "req": "b"},
           {"op": "resume", "req": "b"}, {"op": "free", "req": "b"}]
    lock = av.make_lockstep(_cache(block_size=2, n_blocks=12, window=window))
    for i, op in enumerate(ops):
        lock.step(i, op)
    assert (window == 1) == (not lock.world.cached)
