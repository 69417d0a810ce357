"""``exec:`` targets over kvproto/1 (docs/targets.md "The line protocol"),
with the reference adapter in C (adapters/c/kvspec_dense.c), built here
with ``cc``.

The adapter passes every dense trace of tests/traces/ within its declared
ops, and the rest are refused with the reason; a copy with an off-by-one
planted in its trim clamp fails them and ``kvspec fuzz`` shrinks that to a
one-op trace; a crashed or hung adapter is a divergence at the op, a
missing or mute one a usage error; refusals are compared by category; the
rows ``kvspec rows`` prints are the C code's, in every dtype."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvspec.fuzz.adapters import exec as ex
from kvspec.fuzz.commands.cli import main
from kvspec.fuzz.replay import replay
from kvspec.fuzz.targets import resolve
from kvspec.fuzz.trace import TraceFormatError, load, loads

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "adapters" / "c" / "kvspec_dense.c"
TRACES = sorted((REPO / "tests" / "traces").glob("*.json"))

#: planted variants: name -> edits (a line of the reference source, its
#: replacement), each of which must match exactly once
VARIANTS: dict[str, list[tuple[str, str]]] = {
    # the trim clamp off by one: a trim that reaches the start keeps one row
    "broken_trim": [("    if (n > C.offset) n = C.offset;\n", "    if (n >= C.offset) n = C.offset - 1;\n")],
    # dies on the second trim of a session
    "crash": [("static int op_trim(long long n, long long *out) {\n",
               ("static int op_trim(long long n, long long *out) {\n    static int calls;\n"
                "    if (++calls == 2) abort();\n"))],
    # never answers a trim_to
    "hang": [("    if (!strcmp(name, \"trim_to\")) {\n", "    if (!strcmp(name, \"trim_to\")) {\n        for (;;) pause();\n"),
             ("#include <string.h>\n", "#include <string.h>\n#include <unistd.h>\n")],
    # answers a trim_to with a line that is not JSON
    "garbage": [("    if (!strcmp(name, \"trim_to\")) {\n",
                 "    if (!strcmp(name, \"trim_to\")) {\n        printf(\"trim_to? sure\\n\"); fflush(stdout);\n")],
    # answers with the next request's id
    "stale_id": [('            printf("{\\"id\\":%lld,\\"ok\\":%s", id, ok ? "true" : "false");\n',
                  '            printf("{\\"id\\":%lld,\\"ok\\":%s", id + 1, ok ? "true" : "false");\n')],
    # declares a ring, which kvproto/1 does not drive
    "declares_ring": [('"\\"kinds\\":{\\"dense\\":', '"\\"kinds\\":{\\"rotating\\":')],
    # reports windows one row longer than the bytes it sends
    "short_window": [('    printf("{\\"rows\\":%d", rows);\n', '    printf("{\\"rows\\":%d", rows + 1);\n')],
    # refuses a bad trim_to as a state error, not an invalid argument
    "wrong_category": [("            return refuse(\"invalid_argument\", err_buf);\n",
                        "            return refuse(\"state\", err_buf);\n")],
    # grows one row more than the regrow rule says: only capacity shows it
    "capacity": [("        Buf *nb = buf_new(prev + (int)((n + C.step - 1) / C.step) * C.step);\n",
                  "        Buf *nb = buf_new(prev + (int)((n + C.step - 1) / C.step) * C.step + 1);\n")],
    # never writes in place (always copies): only the in-place observable shows it
    "always_copies": [("    int inplace = C.inplace && n == 1 && C.marker_buf == C.buf->id && prev == C.marker_len;\n",
                       "    int inplace = 0;\n")],
    # the ownership rule forgets where the last write ended: after a trim a
    # decode step writes into buffers a snapshot still reads; the in-place
    # observable is not declared, so only the isolation check can see it
    "ownership": [("    int inplace = C.inplace && n == 1 && C.marker_buf == C.buf->id && prev == C.marker_len;\n",
                   "    int inplace = C.inplace && n == 1 && C.marker_buf == C.buf->id;\n"),
                  ("\\\"capacity\\\",\\\"inplace\\\"]", "\\\"capacity\\\"]")],
    # misreports one observable, each on its own, after a trim (the state line's
    # offset, live_start and live_len are compared only if the client reads them)
    "offset": [("           C.offset, C.offset, C.buf ? C.buf->cap : 0);\n",
                "           C.marker_len, C.offset, C.buf ? C.buf->cap : 0);\n")],
    "live_len": [("           C.offset, C.offset, C.buf ? C.buf->cap : 0);\n",
                  "           C.offset, C.marker_len, C.buf ? C.buf->cap : 0);\n")],
    "live_start": [('\\"live_start\\":0,', '\\"live_start\\":%d,'),
                   ("           C.offset, C.offset, C.buf ? C.buf->cap : 0);\n",
                    "           C.offset, C.offset != C.marker_len, C.offset, C.buf ? C.buf->cap : 0);\n")],
    # a refused trim_to still moves the offset back one row (a refusal must change nothing)
    "refusal_mutates": [("        if (len < 0 || len > C.offset) {\n",
                         "        if (len < 0 || len > C.offset) {\n            if (C.offset > 0) C.offset--;\n")],
    # a multi-row append writes its rows in reverse order
    "reversed_rows": [("    for (int i = 0; i < n; i++) write_row(C.buf, prev + i, (uint32_t)(first + i));\n",
                       "    for (int i = 0; i < n; i++) write_row(C.buf, prev + (int)n - 1 - i, (uint32_t)(first + i));\n")],
    # the broken trim of an adapter that takes 6 ms a request (a slow engine
    # behind kvproto): shrinking its failure would take minutes unbounded
    "slow_broken_trim": [("    if (n > C.offset) n = C.offset;\n", "    if (n >= C.offset) n = C.offset - 1;\n"),
                         ("#include <string.h>\n", "#include <string.h>\n#include <time.h>\n"),
                         ("        jp = line; jerr = 0;\n",
                          ("        jp = line; jerr = 0;\n"
                           "        nanosleep(&(struct timespec){0, 6000000L}, NULL);\n"))],
    # answers hello with a protocol version kvspec does not speak
    "kvproto3": [('\\"kvproto\\":1,\\"adapter', '\\"kvproto\\":3,\\"adapter')],
    # a regrow copies the values with the keys' head dim
    "values_layout": [("        int D = s ? C.Dv : C.Dk;\n        unsigned char *d = s ? dst->v : dst->k, *from = s ? src->v : src->k;\n",
                       "        int D = C.Dk;\n        unsigned char *d = s ? dst->v : dst->k, *from = s ? src->v : src->k;\n")],
}


def build(out: Path, name: str = "kvspec_dense", variant: str | None = None) -> str:
    src = SOURCE.read_text()
    for old, new in VARIANTS.get(variant or "", []):
        assert src.count(old) == 1, f"the line {variant} patches is not in the adapter once: {old!r}"
        src = src.replace(old, new)
    path = out / f"{name}.c"
    path.write_text(src)
    exe = out / name
    cc = shutil.which("cc")
    assert cc is not None, "the C adapter's tests need a C compiler (cc)"
    subprocess.run([cc, "-std=c99", "-O0", "-Wall", "-Wextra", "-Werror", "-o", str(exe), str(path)],
                   check=True, capture_output=True, text=True)
    return str(exe)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("adapters")
    built = {"good": build(out)}
    for v in VARIANTS:
        built[v] = build(out, v, v)
    yield built
    ex.close_sessions()


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    got = capsys.readouterr()
    return code, got.out + got.err


def run_json(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    got = capsys.readouterr()
    return code, json.loads(got.out)


def dense_fp16(path: Path) -> bool:
    c = json.loads(path.read_text())["cache"]
    return c["kind"] == "dense" and c.get("mode", "fp16") == "fp16"


# -- the reference adapter ------------------------------------------------------------


@pytest.mark.parametrize("windows", ["bytes", "identities"])
def test_reference_adapter_passes_the_dense_traces_within_its_ops(adapters, windows):
    target = resolve(f"exec:{adapters['good']} --windows {windows}")
    assert target.windows == windows
    passed, refused = [], []
    for path in filter(dense_fp16, TRACES):
        trace = load(path)
        try:
            result = replay(trace, target=target)
        except TraceFormatError as exc:
            assert "not among the ops its hello declares" in str(exc) or "declares no cache field" in str(exc), exc
            refused.append(path.name)
            continue
        assert result.ok, f"{path.name}: {result.divergence}"
        passed.append(path.name)
    assert len(passed) >= 12 and "trim_to_zero_keeps_buffers.json" in passed, passed
    assert "dense_detach_install.json" in refused  # detach is not one of its ops


def test_broken_trim_fails_the_traces(adapters, capsys):
    failed = []
    for path in filter(dense_fp16, TRACES):
        code, out = run(capsys, "replay", str(path), "--target", f"exec:{adapters['broken_trim']}")
        assert code in (0, 1, 2), out
        if code == 1:
            assert "diverged" in out and "exec:" in out
            failed.append(path.name)
    assert "trim_to_zero_keeps_buffers.json" in failed


def test_fuzz_shrinks_the_broken_trim_to_one_op(adapters, capsys, tmp_path):
    """Shrunk under the default limit (the budget), the failure is not cut
    (the cut one: test_shrinking_a_slow_adapter_stops_at_the_shrink_budget)
    and is one op."""
    code, report = run_json(capsys, "fuzz", "--target", f"exec:{adapters['broken_trim']}", "--budget", "20",
                            "--seed", "5", "--inplace", "on", "--out", str(tmp_path))
    assert code == 1 and report["runs"][0]["result"] == "FAILED", report
    assert report["runs"][0]["shrink_cut"] is False, report
    trace = load(report["runs"][0]["trace"])
    assert trace.cache["rows"] == "portable"
    ops = [op for op in trace.ops if op["op"] != "expect"]
    assert len(ops) == 1 and ops[0]["op"] in ("trim", "trim_to"), ops
    assert run(capsys, "replay", report["runs"][0]["trace"], "--target", f"exec:{adapters['broken_trim']}")[0] == 1
    assert run(capsys, "replay", report["runs"][0]["trace"], "--target", f"exec:{adapters['good']}")[0] == 0
    assert run(capsys, "replay", report["runs"][0]["trace"])[0] == 0  # and on our caches


def test_shrinking_a_slow_adapter_stops_at_the_shrink_budget(adapters, capsys, tmp_path):
    """--shrink-budget bounds the shrinking (a slow adapter would shrink
    for minutes): the run ends about budget + shrink budget after it
    starts, the table and JSON say the shrink was cut, and the trace
    written is still a failing run that replays as one."""
    import time

    start = time.perf_counter()
    code, report = run_json(capsys, "fuzz", "--target", f"exec:{adapters['slow_broken_trim']}", "--budget", "20",
                            "--shrink-budget", "1.5", "--seed", "5", "--inplace", "on", "--out", str(tmp_path))
    took = time.perf_counter() - start
    row = report["runs"][0]
    assert code == 1 and row["result"] == "FAILED", report
    assert row["shrink_cut"] is True and 1.5 <= row["shrink_seconds"] < 6, row
    assert took < row["seconds"] + 6, (took, row)  # search + the 1.5 s cap + one example's overshoot
    assert run(capsys, "replay", row["trace"], "--target", f"exec:{adapters['slow_broken_trim']}")[0] == 1
    # the same failure shrunk under the default limit (the budget) is not cut:
    # test_fuzz_shrinks_the_broken_trim_to_one_op
    with pytest.raises(SystemExit) as exit_:
        main(["fuzz", "--target", f"exec:{adapters['good']}", "--budget", "1", "--shrink-budget=-1"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--shrink-budget" in err and ">= 0" in err, err


def test_fuzz_runs_the_reference_adapter_clean(adapters):
    from kvspec.fuzz.campaign import machine_for, run_machine

    machine = machine_for("dense", "fp16", True, target=resolve(f"exec:{adapters['good']}"))
    result = run_machine(machine, seed=1, max_examples=12, steps=30)
    assert not result.failed, result.error
    assert result.examples >= 12 and result.steps > 100
    reached = result.stats
    assert reached.get("in-place writes", 0) > 0 and reached.get("copying writes", 0) > 0
    assert reached.get("skipped detach", 0) > 0  # undeclared ops are skipped and counted


def test_the_inplace_switch_reaches_the_adapter(adapters, capsys, tmp_path):
    """With the switch off the spec never writes in place: the reference
    adapter must copy too, and a copy that always copies agrees."""
    from kvspec.fuzz.campaign import machine_for, run_machine

    for name in ("good", "always_copies"):
        machine = machine_for("dense", "fp16", False, target=resolve(f"exec:{adapters[name]}"))
        result = run_machine(machine, seed=4, max_examples=8, steps=25)
        assert not result.failed and result.stats.get("copying writes", 0) > 0, (name, result.error)
        assert result.stats.get("in-place writes", 0) == 0
    code, report = run_json(capsys, "fuzz", "--target", f"exec:{adapters['good']}", "--budget", "1", "--seed", "1",
                            "--inplace", "off", "--out", str(tmp_path))
    assert code == 0 and [r["config"].rsplit("/", 1)[1] for r in report["runs"]] == ["copy"], report


# -- failures of the adapter -----------------------------------------------------------

TRIMS = {"kvtrace": 1, "cache": {"kind": "dense", "step": 2, "kv_heads": 1, "head_dim": 4},
         "ops": [{"op": "append", "n": 3}, {"op": "trim", "n": 1}, {"op": "trim", "n": 1},
                 {"op": "trim_to", "len": 9}, {"op": "fetch"}]}


def test_a_crash_is_a_divergence_at_its_op_with_the_trace_so_far(adapters, capsys, tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(TRIMS))
    code, out = run(capsys, "replay", str(path), "--target", f"exec:{adapters['crash']}")
    assert code == 1, out
    assert "op 2" in out and "adapter crashed" in out and "SIGABRT" in out, out
    assert "ops 0 to 2" in out


def test_a_hang_times_out(adapters, capsys, tmp_path, monkeypatch):
    signal.alarm(60)  # if the timeout ever stops working, fail here rather than hang the suite
    monkeypatch.setenv("KVSPEC_EXEC_TIMEOUT", "0.5")
    path = tmp_path / "t.json"
    path.write_text(json.dumps(TRIMS))
    code, out = run(capsys, "replay", str(path), "--target", f"exec:{adapters['hang']}")
    assert code == 1, out
    assert "op 3" in out and "adapter hung" in out and "0.5 s" in out, out
    monkeypatch.setenv("KVSPEC_EXEC_TIMEOUT", "soon")
    code, out = run(capsys, "replay", str(path), "--target", f"exec:{adapters['good']}")
    assert code == 2 and "KVSPEC_EXEC_TIMEOUT" in out, out
    signal.alarm(0)


def test_fuzz_shrinks_a_crash_to_a_minimal_trace(adapters):
    from kvspec.fuzz.campaign import machine_for, run_machine

    machine = machine_for("dense", "fp16", True, target=resolve(f"exec:{adapters['crash']}"))
    result = run_machine(machine, seed=2, max_examples=50, steps=12)
    assert result.failed and "adapter crashed" in str(result.error), result.error
    ops = [op for op in result.trace.ops if op["op"] != "expect"]
    assert [op["op"] for op in ops] in (["trim", "trim"], ["trim", "trim_to"], ["trim_to", "trim"],
                                        ["trim_to", "trim_to"]), ops


def test_refusals_are_compared_by_category(adapters, capsys, tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(TRIMS))
    code, out = run(capsys, "replay", str(path), "--target", f"exec:{adapters['wrong_category']}")
    assert code == 1 and "refusal category differs" in out and "StateError" in out, out
    assert "does not compare" not in out  # it declares every observable of a dense cache
    code, out = run(capsys, "replay", str(path), "--target", f"exec:{adapters['good']}")
    assert code == 0 and "note: op 3 was refused" in out, out  # same category, other words: agreement


@pytest.mark.parametrize("spec,why", [
    ("exec:", "PATH is empty"),
    ("exec:/nonexistent/adapter", "cannot start"),
    ("exec:true", "did not answer hello"),
    ("exec:echo hello", "did not answer hello"),
    ("exec:cat", "did not answer hello"),
])
def test_an_adapter_that_cannot_be_used_is_a_usage_error(spec, why, capsys, monkeypatch):
    monkeypatch.setenv("KVSPEC_EXEC_TIMEOUT", "2")
    trace = str(REPO / "tests" / "traces" / "token_identities.json")
    for argv in (["replay", trace, "--target", spec], ["fuzz", "--target", spec, "--budget", "1"]):
        code, out = run(capsys, *argv)
        assert code == 2 and why in out and "Traceback" not in out, out


# -- the protocol ------------------------------------------------------------------------


def test_requests_and_replies_follow_the_schema(adapters, monkeypatch):
    """Everything kvspec sends validates against $defs/request (the replies
    are checked on every call already)."""
    sent = []
    original = ex.Session.request

    def checked(self, body, part="reply"):
        req = {"id": self.next_id, **body}
        errors = list(ex.validator("request").iter_errors(req))
        assert not errors, (req, errors[0].message)
        sent.append(req["request"])
        return original(self, body, part)

    monkeypatch.setattr(ex.Session, "request", checked)
    ex.close_sessions()
    target = resolve(f"exec:{adapters['good']}")
    for name in ("token_identities", "dense_inplace_beside_snapshot", "fp16_casts_rows"):
        assert replay(load(REPO / "tests" / "traces" / f"{name}.json"), target=target).ok
    assert {"hello", "init", "op"} <= set(sent)


WINDOW = st.one_of(
    st.fixed_dictionaries({"rows": st.integers(0, 3), "k": st.sampled_from(["", "00ff", "0g", "abc"]),
                           "v": st.sampled_from(["", "1c00"])}),
    st.lists(st.one_of(st.integers(-1, 5), st.sampled_from(["zero", "?", "x"])), max_size=3),
    st.integers(0, 3), st.none(),
)
REPLY = st.fixed_dictionaries(
    {"id": st.one_of(st.integers(-1, 3), st.just(True)), "ok": st.one_of(st.booleans(), st.just(1))},
    optional={
        "result": st.one_of(st.integers(), st.booleans(), st.none(), WINDOW, st.floats(0, 1)),
        "inplace": st.one_of(st.booleans(), st.just(0)),
        "error": st.fixed_dictionaries({"category": st.sampled_from(["state", "invalid_argument", "unsupported", "x"]),
                                        "message": st.text(max_size=3)}),
        "state": st.fixed_dictionaries(
            {"cache": WINDOW, "held": WINDOW, "holders": st.dictionaries(st.text(max_size=2), WINDOW, max_size=2)},
            optional={"offset": st.one_of(st.integers(), st.just(1.0)), "capacity": st.integers(),
                      "extra": st.just(1)}),
        "extra": st.just(0),
    })


@given(REPLY)
def test_the_fast_reply_check_agrees_with_the_schema(reply):
    assert ex.reply_ok(reply) == ex.validator("reply").is_valid(reply)


def test_kvspec_rows_match_the_c_code_in_every_dtype(adapters, capsys, tmp_path):
    for dtype in ("float16", "bfloat16", "float32"):
        for mode, wide in (("fp16", True), ("int8", False)):
            if mode == "int8" and dtype != "float16":
                continue
            doc = {"kvtrace": 1, "cache": {"kind": "dense", "mode": mode, "batch": 2, "kv_heads": 3, "head_dim": 3,
                                           "v_head_dim": 2, "dtype": dtype, "rows": "portable"},
                   "ops": [{"op": "append", "n": 4}, {"op": "trim", "n": 1}, {"op": "append", "n": 3}]}
            path = tmp_path / f"{dtype}-{mode}.json"
            path.write_text(json.dumps(doc))
            code, out = run(capsys, "rows", str(path))
            assert code == 0, out
            ours = [line for line in out.splitlines() if not line.startswith("#")]
            argv = [adapters["good"], "--rows", dtype, "2", "3", "3", "2", "0", "7"] + (["wide"] if wide else [])
            theirs = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.splitlines()
            assert ours == theirs and len(ours) == 14, (dtype, mode)
            width = 8 if dtype == "float32" else 4
            assert all(len(cell) == width for cell in ours[0].split()[2:]) and len(ours[0].split()) == 2 + 18


def test_kvspec_rows_of_a_numpy_trace_and_bad_ranges(capsys):
    trace = str(REPO / "tests" / "traces" / "token_identities.json")
    code, out = run(capsys, "rows", trace, "--format", "values", "--first", "3", "--count", "1")
    assert code == 0 and "numpy rows" in out
    assert out.splitlines()[1].startswith("3 k 0.0 ")  # a NumPy trace's 7th-token zero K row
    code, out = run(capsys, "rows", trace, "--first", "3", "--count", "9")
    assert code == 2 and "--first/--count" in out


def test_identities_the_adapter_reports_are_trusted_only_as_identities(adapters):
    """In ``identities`` mode a window is compared as a list of identities;
    a stale row shows as the older identity it holds."""
    target = resolve(f"exec:{adapters['broken_trim']} --windows identities")
    doc = {"kvtrace": 1, "cache": {"kind": "dense", "step": 4, "kv_heads": 1, "head_dim": 2},
           "ops": [{"op": "append", "n": 2}, {"op": "trim", "n": 2}]}
    result = replay(loads(json.dumps(doc)), target=target)
    assert not result.ok and result.divergence.index == 1
    assert os.path.basename(adapters["broken_trim"]) in result.divergence.labels[1]


def test_the_reference_implementation_in_the_docs_is_the_row_function(tmp_path):
    """docs/kvtrace.md's C block, compiled as printed, gives kvspec.spec.rows'
    bits for every dtype, wide or not (a doc that drifted from the code
    fails here)."""
    from kvspec.spec import rows as sr

    text = (REPO / "docs" / "kvtrace.md").read_text()
    block = text.split("## Portable rows", 1)[1].split("```c\n", 1)[1].split("```", 1)[0]
    main_c = (
        "#include <stdint.h>\n#include <stdio.h>\n" + block +
        "int main(void) {\n"
        "    for (uint32_t t = 0; t < 40; t++) for (int d = 0; d < 3; d++) for (int w = 0; w < 2; w++)\n"
        "        for (uint32_t kv = 0; kv < 2; kv++) for (uint32_t c = 0; c < 3; c++)\n"
        "            printf(\"%u\\n\", element_bits(t * 419430u, kv, t % 3, t % 2, c + t % 7, d, w));\n"
        "    return 0;\n}\n")
    (tmp_path / "doc.c").write_text(main_c)
    subprocess.run(["cc", "-std=c99", "-Wall", "-Werror", "-o", str(tmp_path / "doc"), str(tmp_path / "doc.c")],
                   check=True, capture_output=True, text=True)
    got = subprocess.run([str(tmp_path / "doc")], capture_output=True, text=True, check=True).stdout.split()
    want = [str(sr.element_bits(t * 419430, kv, t % 3, t % 2, c + t % 7, dtype, bool(w)))
            for t in range(40) for dtype in sr.DTYPES for w in range(2) for kv in range(2) for c in range(3)]
    assert got == want


# -- each planted class is caught ------------------------------------------------------

PLANTED = {
    "capacity": ({"step": 2}, [{"op": "append", "n": 1}], 0, "capacity differs"),
    "always_copies": ({"step": 4}, [{"op": "append", "n": 1}, {"op": "append", "n": 1}], 1,
                      "in-place decision differs"),
    "ownership": ({"step": 4}, [{"op": "append", "n": 3}, {"op": "snapshot", "name": "s"}, {"op": "trim", "n": 1},
                                {"op": "append", "n": 1}], 3, "view of holder:s changed (isolation)"),
    "values_layout": ({"step": 1, "head_dim": 4, "v_head_dim": 2, "kv_heads": 2}, [{"op": "append", "n": 1}, {"op": "append", "n": 1}],
                      1, "returned window differs"),
    "garbage": ({"step": 2}, [{"op": "append", "n": 2}, {"op": "trim_to", "len": 1}], 1, "adapter broke the protocol"),
    **{name: ({"step": 4}, [{"op": "append", "n": 3}, {"op": "trim", "n": 1}], 1, f"{name} differs")
       for name in ("offset", "live_start", "live_len")},
    "refusal_mutates": ({"step": 4}, [{"op": "append", "n": 3}, {"op": "trim_to", "len": 5}], 1, "offset differs"),
    "reversed_rows": ({"step": 4}, [{"op": "append", "n": 2}], 0, "returned window differs"),
}


@pytest.mark.parametrize("windows", ["bytes", "identities"])
@pytest.mark.parametrize("variant", sorted(PLANTED))
def test_each_planted_adapter_bug_is_a_divergence(adapters, variant, windows):
    """In both window forms: an adapter reporting identities decodes each
    whole row (a row wrong past its first element is not its identity)
    and keeps their order."""
    cache, ops, index, what = PLANTED[variant]
    doc = {"kvtrace": 1, "cache": {"kind": "dense", "kv_heads": 1, "head_dim": 4, **cache}, "ops": ops}
    trace = loads(json.dumps(doc))
    assert replay(trace, target=resolve(f"exec:{adapters['good']} --windows {windows}")).ok
    result = replay(trace, target=resolve(f"exec:{adapters[variant]} --windows {windows}"))
    assert not result.ok and result.divergence.index == index and result.divergence.what.startswith(what), \
        result.divergence


def test_every_observable_has_a_planted_misreport():
    """Each observable the client compares (and the in-place decision) has
    a planted adapter that gets only it wrong, caught above: a client that
    silently stops comparing one fails there."""
    assert set(ex.OBSERVABLES) | {"inplace"} <= {v.split(" ")[0].replace("in-place", "inplace")
                                                  for _, _, _, v in PLANTED.values()}


def test_another_protocol_version_is_refused_at_hello(adapters, capsys):
    trace = str(REPO / "tests" / "traces" / "token_identities.json")
    for argv in (["replay", trace], ["fuzz", "--budget", "1"]):
        code, out = run(capsys, *argv, "--target", f"exec:{adapters['kvproto3']}")
        assert code == 2 and "did not answer hello" in out and "kvproto" in out and "Traceback" not in out, out


def test_a_reply_to_another_request_breaks_the_protocol(adapters, capsys):
    trace = str(REPO / "tests" / "traces" / "token_identities.json")
    code, out = run(capsys, "replay", trace, "--target", f"exec:{adapters['stale_id']}")
    assert code == 2 and "reply id 2 to request id 1" in out and "Traceback" not in out, out


def test_a_kind_the_protocol_does_not_drive_is_refused_at_hello(adapters, capsys):
    trace = str(REPO / "tests" / "traces" / "token_identities.json")
    code, out = run(capsys, "replay", trace, "--target", f"exec:{adapters['declares_ring']}")
    assert code == 2 and "did not answer hello" in out and "'rotating'" in out, out


def test_any_name_a_trace_may_use_reaches_the_adapter_intact(adapters):
    """Names are any string of 1 to 128 characters: NUL, quotes,
    backslashes, newlines, non-ASCII (an adapter that cut a name at NUL
    showed as 'holders differ')."""
    names = ["a\x00b", "a", 'q"\\', "é😀\n", "\x01"]
    ops: list[dict] = [{"op": "append", "n": 2}]
    for i, name in enumerate(names):
        ops += [{"op": "snapshot", "name": name}, {"op": "append", "n": 1}]
    ops += [{"op": "restore", "name": "a\x00b"}, {"op": "expect", "window": [0, 1]},
            {"op": "drop", "name": "a"}, {"op": "expect", "of": "a\x00b", "window": [0, 1]}]
    doc = {"kvtrace": 1, "cache": {"kind": "dense", "step": 2, "kv_heads": 1, "head_dim": 2}, "ops": ops}
    result = replay(loads(json.dumps(doc)), target=resolve(f"exec:{adapters['good']}"))
    assert result.ok, result.divergence


def test_kvspec_rows_into_a_closed_pipe_is_quiet(tmp_path):
    """``kvspec rows T | head``: more than a pipe holds, the reader gone."""
    path = tmp_path / "long.json"
    path.write_text(json.dumps({"kvtrace": 1, "cache": {"kind": "dense", "head_dim": 16, "rows": "portable"},
                                "ops": [{"op": "append", "n": 3000}]}))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "kvspec.fuzz.commands.cli", "rows", str(path)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().startswith(b"# rows of")
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0 and "Traceback" not in err, err


def test_windows_that_do_not_fit_their_shape_break_the_protocol(adapters, capsys):
    trace = str(REPO / "tests" / "traces" / "token_identities.json")
    code, out = run(capsys, "replay", trace, "--target", f"exec:{adapters['short_window']}")
    assert code == 2 and "window of 1 rows" in out and "needs" in out and "Traceback" not in out, out
